"""A LoRA run of a real pretrained model: SmolLM2-135M-Instruct learns to answer additions with just the number while
only a rank-8 adapter trains. Every role is a process on a real nats-server, the KL reference is the base with the
adapter off (the reference role holds v0's base only), and the run's only rollout worker is SIGKILLed mid-run and
replaced: the new one fetches the base once, then adapters only (the transport's counters in its log). The run's
adapter is then exported in peft's format and merged, and both generate the trainer's final greedy tokens."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.cluster import Cluster, replace_the_rollout_worker, role_events, small_config
from tests.e2e.test_real_model import GREEDY_PROMPT, GREEDY_TOKENS, smollm2  # noqa: F401 (the model's fixture)
from workers.config import parse_config
from workers.data.prompts import prompt_ids
from workers.launch.export import export
from workers.weights import make_transport
from workers.weights.adapter import merged

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
RISE = 0.1
"""How far the mean reward of the last three steps must be above that of the first three."""


def lora_config(model_dir: Path) -> dict:
    return small_config(
        f"lora{uuid.uuid4().hex[:8]}",
        groups_per_step=4,
        samples_per_group=4,
        model={"source": str(model_dir)},
        task={"type": "addition", "options": {"seed": 0, "template": "What is {a}+{b}? Answer with just the number."}},
        rewards=[
            {"type": "numeric"},
            # A denser term: the reply starts with a number (the base mostly restates the sum in words first).
            {"type": "format", "name": "number_first", "weight": 0.5, "options": {"pattern": r"\s*\d[\s\S]*"}},
        ],
        rollout={"engine": "torch", "max_new_tokens": 6, "batch_groups": 4},
        trainer={
            "steps": 8,
            "optim": {"lr": 5e-3},
            "kl": {"coef": 0.01},  # the reference role in the chain: the base, adapter off
            "checkpoint": {"every": 8},
            "compute": {"micro_batch_tokens": 512},
            "lora": LORA,
        },
    )


async def test_smollm2_lora_learns_fetches_the_base_once_and_exports(nats_server, tmp_path, smollm2):  # noqa: F811
    config = parse_config(lora_config(smollm2))
    cluster = await Cluster.start(nats_server.url, config, tmp_path)
    try:
        joiner, _ = await replace_the_rollout_worker(cluster, after_step=2)
        await cluster.wait_done(timeout_s=480)
        acc = await cluster.accounting()
        acc.check_exactly_once(config.trainer.steps, config.groups_per_step)
        assert all(g.ref_logprobs is not None for g in acc.train_groups)
        rewards = [m.values["reward_mean"] for m in sorted(acc.metrics, key=lambda m: m.step)]
        assert sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3 >= RISE, [round(r, 3) for r in rewards]

        # The first worker read v0 (the base); the replacement read the base once, with its first adapter, and
        # then adapters only.
        first = role_events(cluster.role("rollout"), "weights_adapter_read")
        assert first[0]["kind"] == "base" and all(e["kind"] == "adapter" for e in first[1:]), first
        reads = role_events(joiner, "weights_adapter_read")
        assert reads[0]["kind"] == "base+adapter" and len(reads) >= 2, reads
        assert all(e["kind"] == "adapter" and e["base_reads"] == 1 for e in reads[1:]), reads

        assert cluster.bus is not None
        adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
        done = await export(cluster.bus, adapter_dir, None, tmp_path / "work")
        assert done["lora"] == "adapter" and "adapter_model.safetensors" in done["files"]
        await export(cluster.bus, merged_dir, None, tmp_path / "work", merge=True)
        final = await make_transport(cluster.bus).read(config.trainer.steps)  # a new reader: base + adapter
    finally:
        await cluster.stop()

    def compare() -> None:
        from peft import PeftModel

        tok = AutoTokenizer.from_pretrained(smollm2)
        trained = AutoModelForCausalLM.from_pretrained(smollm2).eval()
        trained.load_state_dict(merged(final, config.trainer.lora))  # type: ignore[arg-type]
        ids = torch.tensor([prompt_ids(tok, GREEDY_PROMPT, "chat")])
        greedy = {"max_new_tokens": GREEDY_TOKENS, "do_sample": False}
        want = trained.generate(ids, **greedy)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2), adapter_dir).eval()
        assert torch.equal(adapted.generate(input_ids=ids, **greedy), want)
        assert torch.equal(AutoModelForCausalLM.from_pretrained(merged_dir).eval().generate(ids, **greedy), want)

    await asyncio.to_thread(compare)
