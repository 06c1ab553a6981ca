"""The tiny omni policy: offline build and reload, sampling after media prompts, and teacher-forced log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration

from workers.data.models import materialize
from workers.engines.base import Generated, MediaInputs, SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.omni import video
from workers.omni.errors import UnsupportedModelError
from workers.omni.loading import is_multimodal, load_omni
from workers.omni.logprobs import batch_media, media_token_ids, media_token_logprobs
from workers.omni.media import decode_parts, processor_inputs
from workers.omni.tasks import KINDS, Kind, item_parts, make_items
from workers.omni.tiny import MEDIA_IDS
from workers.training.media_policy import media_response_logprobs, policy_token_logprobs

pytestmark = pytest.mark.workers

TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test of this module runs with one torch thread (fixture in conftest.py)."""


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize("tiny-omni", tmp_path_factory.mktemp("models") / "tiny-omni", seed=0)


@pytest.fixture(scope="module")
def engine(omni_dir: Path) -> TorchEngine:
    return TorchEngine(omni_dir)


def prompts_for(engine: TorchEngine, kind: Kind, count: int, seed: int = 0) -> list[MediaInputs]:
    return [
        processor_inputs(engine.processor, decode_parts(item_parts(item), engine.tokenizer))
        for item in make_items(kind, count, seed)
    ]


def worst_error(engine: TorchEngine, inputs: list[MediaInputs], out: list[list[Generated]], tau: float) -> float:
    worst = 0.0
    with torch.no_grad():
        for prompt, samples in zip(inputs, out, strict=True):
            ref = media_response_logprobs(engine.model, prompt, [g.token_ids for g in samples], tau)
            for g, r in zip(samples, ref, strict=True):
                assert len(g.logprobs) == len(r)
                worst = max(worst, (torch.tensor(g.logprobs) - r).abs().max().item())
    return worst


def test_tiny_omni_builds_deterministically_and_reloads_offline(omni_dir: Path, tmp_path: Path) -> None:
    assert is_multimodal(omni_dir)
    assert materialize("tiny-omni", omni_dir, seed=0) == omni_dir  # the same build is reused
    with pytest.raises(ValueError, match="another model"):
        materialize("tiny-omni", omni_dir, seed=1)
    again = materialize("tiny-omni", tmp_path / "again", seed=0)
    other = materialize("tiny-omni", tmp_path / "other", seed=1)
    video.install()
    processor = AutoProcessor.from_pretrained(again)
    assert type(processor.video_processor).__name__ == "NumpyVideoProcessor"
    assert processor.tokenizer.convert_tokens_to_ids(processor.tokenizer.image_token) == MEDIA_IDS["image_token"]
    first = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni_dir).state_dict()
    second = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(again).state_dict()
    third = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(other).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], third[k]) for k in first)
    model, _ = load_omni(omni_dir)
    assert sorted(media_token_ids(model.config)) == sorted(MEDIA_IDS.values())


def test_processor_expands_each_media_item_to_its_tokens(engine: TorchEngine) -> None:
    expected: dict[Kind, tuple[str, int, int]] = {
        "colour": ("pixel_values", MEDIA_IDS["image_token"], 4),
        "beeps": ("input_features", MEDIA_IDS["audio_token"], 25),
        "direction": ("pixel_values_videos", MEDIA_IDS["video_token"], 8),
    }
    for kind, (tensor, token, count) in expected.items():
        (inputs,) = prompts_for(engine, kind, 1)
        assert tensor in inputs
        assert int((inputs["input_ids"] == token).sum()) == count, kind  # 56x56 image, 1 s audio, 4 frames
        assert inputs["attention_mask"].shape == inputs["input_ids"].shape


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_generate_logprobs_match_teacher_forced_forward(engine: TorchEngine, kind: Kind, tau: float) -> None:
    inputs = prompts_for(engine, kind, 2, seed=3)
    prompts = [x["input_ids"][0].tolist() for x in inputs]
    out = engine.generate(prompts, 3, SamplingSettings(temperature=tau, max_new_tokens=6), seeds=[5, 9], media=inputs)
    assert [len(samples) for samples in out] == [3, 3]
    assert worst_error(engine, inputs, out, tau) <= TOLERANCE


def test_mixed_batch_through_the_trainer_entry_point(engine: TorchEngine) -> None:
    """Rows of different media kinds in one right-padded batch score as each prompt does alone."""
    inputs = [prompts_for(engine, kind, 1, seed=1)[0] for kind in KINDS]
    prompts = [x["input_ids"][0].tolist() for x in inputs]
    out = engine.generate(prompts, 1, SamplingSettings(max_new_tokens=5), seeds=list(range(len(KINDS))), media=inputs)
    rows = [p + g[0].token_ids for p, g in zip(prompts, out, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    with torch.no_grad():
        logps = policy_token_logprobs(engine.model, ids, mask, 1.0, media=batch_media(inputs))  # [kinds, T-1]
    for i, (prompt, samples) in enumerate(zip(prompts, out, strict=True)):
        got = logps[i, len(prompt) - 1 : len(prompt) - 1 + len(samples[0].token_ids)]
        assert (got - torch.tensor(samples[0].logprobs)).abs().max().item() <= TOLERANCE


def test_media_tokens_are_never_sampled_and_masked_in_the_trainer(engine: TorchEngine) -> None:
    """At temperature 5 the random policy is near uniform: unmasked, its 7 media tokens would show up."""
    inputs = prompts_for(engine, "colour", 2, seed=2)
    prompts = [x["input_ids"][0].tolist() for x in inputs]
    out = engine.generate(prompts, 8, SamplingSettings(temperature=5.0, max_new_tokens=16), seeds=[0, 1], media=inputs)
    sampled = {t for samples in out for g in samples for t in g.token_ids}
    assert not sampled & set(MEDIA_IDS.values())
    assert len(sampled) > 100  # the draw does cover most of the vocabulary
    # The masked distribution is what the engine reported; the unmasked one differs.
    inp = inputs[0]
    ids = torch.tensor([prompts[0] + out[0][0].token_ids])
    with torch.no_grad():
        masked = media_token_logprobs(engine.model, ids, torch.ones_like(ids), inp, 5.0)[0, len(prompts[0]) - 1 :]
        unmasked = media_token_logprobs(
            engine.model, ids, torch.ones_like(ids), inp, 5.0, suppressed=torch.zeros(0, dtype=torch.long)
        )[0, len(prompts[0]) - 1 :]
    assert (masked - torch.tensor(out[0][0].logprobs)).abs().max().item() <= TOLERANCE
    assert (unmasked - masked).abs().min().item() > 1e-3


def test_text_prompt_on_the_omni_model(engine: TorchEngine) -> None:
    tok = engine.tokenizer
    prompt = [tok.bos_token_id, *tok.encode("1+2=")]
    out = engine.generate([prompt], 2, SamplingSettings(max_new_tokens=4), seeds=[0])
    inputs = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)}
    assert worst_error(engine, [inputs], out, 1.0) <= TOLERANCE


def test_media_calls_are_checked(engine: TorchEngine, model_dir: Path) -> None:
    (inputs,) = prompts_for(engine, "colour", 1)
    prompt = inputs["input_ids"][0].tolist()
    with pytest.raises(ValueError, match="media entries"):
        engine.generate([prompt, prompt], 1, SamplingSettings(), media=[inputs])
    with pytest.raises(ValueError, match="differ from the prompt"):
        engine.generate([prompt[:-1]], 1, SamplingSettings(), media=[inputs])
    text_engine = TorchEngine(model_dir)
    with pytest.raises(ValueError, match="multimodal model"):
        text_engine.generate([[257, 65]], 1, SamplingSettings(), media=[None])
    with pytest.raises(UnsupportedModelError, match="not a multimodal"):
        load_omni(model_dir)
