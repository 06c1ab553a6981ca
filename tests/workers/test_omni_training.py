"""A multimodal policy through the trainer: media groups scored like the engine sampled them, a step that
trains on them, the warm-up with media, the omni task and media by reference (tiny-omni, CPU, no bus)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from schemas import PromptGroup, RolloutGroup, ScoredGroup, TextPart, TrainGroup, WireTensor
from schemas.parts import Part
from workers.config import parse_config
from workers.data.models import materialize
from workers.data.tasks import load_task
from workers.engines.base import MediaInputs, SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.omni.group_forward import sample_after
from workers.omni.media_refs import by_reference, has_media, media_bytes, modality
from workers.omni.prompts import MediaPrompter
from workers.roles.rollout import sample_of
from workers.training.batch import make_batch
from workers.training.media_policy import media_rows_logprobs
from workers.training.supervised import item_prompt
from workers.training.trainer import PolicyTrainer
from workers.training.warmup import run_warmup

pytestmark = pytest.mark.workers

TOLERANCE = 1e-4
CONFIG = {
    "run": "omni-unit",
    "model": {"source": "tiny-omni"},
    "task": {"type": "omni", "options": {"count": 2}},
    "groups_per_step": 4,
    "samples_per_group": 4,
    "rollout": {"max_new_tokens": 3, "temperature": 1.0},
    "trainer": {"optim": {"lr": 1e-3}, "warmup": {"max_steps": 0}},
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test of this module runs with one torch thread (fixture in conftest.py)."""


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize("tiny-omni", tmp_path_factory.mktemp("models") / "tiny-omni", seed=0)


def groups_from_engine(
    engine: TorchEngine, parts: list[tuple[Part, ...]], n: int = 4, seed: int = 5
) -> tuple[list[TrainGroup], list[MediaInputs | None]]:
    """One train group per prompt as the rollout role builds it (media through the processor), rewards 0, 1, ..."""
    prompter = MediaPrompter(engine.processor)
    media: list[MediaInputs | None] = []
    ids = []
    for p in parts:
        if has_media(p):
            inputs = prompter.inputs(p)
            media.append(inputs)
            ids.append(inputs["input_ids"][0].tolist())
        else:
            media.append(None)
            ids.append([engine.tokenizer.bos_token_id, *engine.tokenizer.encode(p[0].text, add_special_tokens=False)])
    out = engine.generate(ids, n, SamplingSettings(temperature=1.0, max_new_tokens=3, seed=seed), media=media)
    groups = []
    for i, (p, pid, samples) in enumerate(zip(parts, ids, out, strict=True)):
        prompt = PromptGroup(run="t", group_id=f"g{i}", parts=p, n_samples=n, release_index=i, released_at_version=0)
        rollout = RolloutGroup(
            prompt=prompt,
            prompt_token_ids=WireTensor.from_values(pid, "int32"),
            samples=tuple(sample_of(g) for g in samples),
            policy_version=0,
        )
        groups.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=tuple(float(k % 2) for k in range(n)))))
    return groups, media


def task_parts(count: int = 1) -> list[tuple[Part, ...]]:
    return [item.parts for item in load_task({"type": "omni", "count": count})]


def test_the_trainer_scores_media_groups_as_the_engine_sampled_them(omni_dir):
    trainer = PolicyTrainer(omni_dir, parse_config(CONFIG))
    assert trainer.prompter is not None and not trainer.forward.shares_prompt
    engine = TorchEngine(omni_dir)
    mixed = load_task({"type": "omni", "count": 1, "kinds": ["mixed"]})[0].parts
    parts = [*task_parts(), mixed, (TextPart(text="What colour? "),)]  # image, audio, video, both, text
    groups, media = groups_from_engine(engine, parts)
    batch = make_batch(groups, media)
    with torch.no_grad():
        mb, logp = trainer.forward.logprobs(batch, list(range(batch.ids.shape[0])))
    mask = mb.mask.bool()
    picked, expected = logp[mask], mb.rollout_logp[mask]
    assert picked.numel() == sum(s.token_ids.numel for g in groups for s in g.scored.rollout.samples)
    worst = (picked - expected).abs().max().item()
    assert worst <= TOLERANCE, worst

    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.step(groups, 0, media)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert metrics["logprob_mismatch"] <= TOLERANCE, metrics["logprob_mismatch"]
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("visual" in k for k in changed) and any("audio_tower" in k for k in changed)


def test_a_media_group_without_its_tensors_is_not_scored_as_text(omni_dir):
    """The processor tensors are what puts the image into the forward: without them the log-probs differ."""
    trainer = PolicyTrainer(omni_dir, parse_config(CONFIG))
    groups, media = groups_from_engine(TorchEngine(omni_dir), task_parts()[:1])
    with torch.no_grad():
        with_media = trainer.forward.logprobs(make_batch(groups, media), [0])[1]
        without = trainer.forward.logprobs(make_batch(groups), [0])[1]
    assert (with_media - without).abs().max().item() > 1e-3


def test_the_warm_up_trains_on_media_prompts(omni_dir):
    config = parse_config({**CONFIG, "trainer": {"warmup": {"max_steps": 4, "check_every": 2, "batch_size": 6}}})
    trainer = PolicyTrainer(omni_dir, config)
    items = load_task({"type": "omni", "count": 2})
    ids, media = item_prompt(trainer, items[0])
    assert media is not None and ids == media["input_ids"][0].tolist()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    info = run_warmup(trainer, items)
    assert info["warmup_steps"] == 4 and 0.0 <= info["warmup_accuracy"] <= 1.0
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


def test_the_omni_task_interleaves_its_kinds_with_one_word_answers():
    items = load_task({"type": "omni", "count": 3, "kinds": ["colour", "direction"]})
    assert [it.task for it in items] == ["colour", "direction"] * 3
    assert [modality(it.parts) for it in items[:2]] == ["image", "video"]
    assert all(it.answer in ("red", "green", "blue", "yellow", "left", "right", "up", "down") for it in items)
    with pytest.raises(ValueError, match="unknown kinds"):
        load_task({"type": "omni", "kinds": ["smell"]})


def test_media_by_reference_names_the_payload_by_its_digest():
    parts = task_parts()[1]  # audio, then the question
    refs = by_reference(parts)
    audio = parts[0]
    assert audio.type == "audio" and audio.inline is not None
    assert refs[0].inline is None and refs[0].ref is not None
    assert refs[0].ref.digest == "sha256:" + hashlib.sha256(audio.inline).hexdigest()
    assert refs[0].ref.size == len(audio.inline) == media_bytes(refs) == media_bytes(parts)
    assert refs[1] == parts[1] and by_reference(refs) == refs  # text unchanged; a reference stays one


def test_each_prompt_embedded_once_gives_the_per_row_log_probs_and_gradients(omni_dir):
    trainer = PolicyTrainer(omni_dir, parse_config(CONFIG))
    mixed = load_task({"type": "omni", "count": 1, "kinds": ["mixed"]})[0].parts  # an image and audio in one prompt
    groups, media = groups_from_engine(TorchEngine(omni_dir), [*task_parts(), mixed, (TextPart(text="Beeps? "),)])
    mb = make_batch(groups, media)
    model = trainer.model
    results = []
    for lengths in (None, mb.prompt_lengths):  # each row with its own media, then each prompt once
        model.zero_grad(set_to_none=True)
        logp = media_rows_logprobs(model, mb.ids, mb.attention, mb.media, mb.group_of, 1.0, lengths)
        (logp * mb.mask).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), grads))
    (per_row, row_grads), (grouped, group_grads) = results
    assert (per_row - grouped).abs().max().item() <= 1e-5
    assert row_grads.keys() == group_grads.keys()
    towers = [k for k in row_grads if "visual" in k or "audio_tower" in k]
    assert towers
    for k in row_grads:
        scale = row_grads[k].abs().max().item() + 1e-12
        assert (row_grads[k] - group_grads[k]).abs().max().item() <= 1e-4 * scale, k


def test_the_batched_sampler_picks_what_the_engine_picks(omni_dir):
    """Left-padded prompts of different lengths and modalities (and a text one), near-greedy: the warm-up's
    sampler and the rollout engine choose the same tokens."""
    engine = TorchEngine(omni_dir)
    prompter = MediaPrompter(engine.processor)
    parts = [*task_parts(), (TextPart(text="Which way?"),)]
    prompts = []
    for p in parts:
        inputs = prompter.inputs(p) if has_media(p) else None
        ids = inputs["input_ids"][0].tolist() if inputs is not None else [engine.tokenizer.bos_token_id, *b"Which way?"]
        prompts.append((ids, inputs))
    eos = engine.tokenizer.eos_token_id
    sampled = sample_after(engine.model, prompts, 4, 1e-4, torch.Generator().manual_seed(0), eos)
    greedy = engine.generate(
        [ids for ids, _ in prompts],
        1,
        SamplingSettings(temperature=1e-4, max_new_tokens=4),
        media=[m for _, m in prompts],
    )
    for (got, stopped), (g,) in zip(sampled, greedy, strict=True):
        assert stopped == (g.finish_reason == "stop")
        assert got == (g.token_ids[:-1] if stopped else g.token_ids)
