"""Trainer throughput on a real model: one `PolicyTrainer` step next to a plain transformers loop, same data.

    python benchmarks/trainer_throughput.py [--model models/SmolLM2-135M-Instruct] [--groups 4] [--samples 8]
        [--response-tokens 32] [--repeat 3] [--threads 2] [--out benchmarks/results/trainer_throughput.json]

The step: `--groups` word problems from examples/data/word_problems.jsonl rendered with the model's chat
template (the prompts a run sends), each with `--samples` responses of random token ids (lengths drawn
between half and all of `--response-tokens`, a fixed seed), random rewards. Three cases run in turn,
`--repeat` times, in one process on `--threads` threads; the median of each is reported:

- plain loop: what a user would write with transformers alone: per micro-batch (the trainer's packing,
  same token budget) `model(ids, attention_mask).logits`, log-softmax, the response tokens' log-probs,
  a token-mean policy-gradient loss, backward; then gradient clipping and one AdamW step.
- trainer, plain pass: `PolicyTrainer.step` with `trainer.compute.shared_prompt: false` (advantages, decoupled
  PPO + TIS loss, exact micro-batch normalisation, metrics).
- trainer, shared prompt: the default, each prompt forwarded once per micro-batch (`workers.training.shared_prompt`).

tokens/s counts every row's prompt + response tokens (what the plain pass forwards) for all three, so the
shared-prompt case's figure is the same work done in less time. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pipeline import write_results

from schemas import PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor
from workers.config import parse_config
from workers.data.models import load_model, load_tokenizer
from workers.data.prompts import prompt_ids
from workers.training.batch import make_batch
from workers.training.microbatch import pack
from workers.training.trainer import PolicyTrainer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "word_problems.jsonl"


def make_groups(model_dir: Path, groups: int, samples: int, response_tokens: int, seed: int = 0) -> list[TrainGroup]:
    """The step's train groups: chat-rendered prompts, random responses and rewards (fixed seed)."""
    tok = load_tokenizer(model_dir)
    rng = random.Random(seed)
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines()[:groups]]
    vocab = len(tok)
    out = []
    for i, q in enumerate(questions):
        ids = prompt_ids(tok, q, "chat", "Answer with the number.")
        prompt = PromptGroup(
            run="bench",
            group_id=f"g{i}",
            parts=(TextPart(text=q),),
            n_samples=samples,
            release_index=i,
            released_at_version=0,
        )
        responses = [
            [rng.randrange(vocab) for _ in range(rng.randint(max(1, response_tokens // 2), response_tokens))]
            for _ in range(samples)
        ]
        rollout = RolloutGroup(
            prompt=prompt,
            prompt_token_ids=WireTensor.from_values(ids, "int32"),
            samples=tuple(
                Sample(
                    token_ids=WireTensor.from_values(r, "int32"),
                    logprobs=WireTensor.from_values([-2.0] * len(r), "float32"),
                    text="",
                    finish_reason="length",
                )
                for r in responses
            ),
            policy_version=0,
        )
        rewards = tuple(float(rng.random() < 0.5) for _ in range(samples))
        out.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=rewards)))
    return out


class PlainLoop:
    """A transformers forward/backward loop over the trainer's micro-batches, with nothing of ours in it."""

    def __init__(self, model_dir: Path, lr: float, budget: int | None) -> None:
        self.model = load_model(model_dir).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.budget = budget

    def step(self, groups: list[TrainGroup]) -> None:
        batch = make_batch(groups)
        rewards = batch.rewards
        adv = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)).reshape(-1)
        tokens = float(batch.mask.sum())
        self.optimizer.zero_grad(set_to_none=True)
        for rows in pack(batch.lengths, self.budget):
            index = torch.tensor(rows)
            width = max(batch.lengths[r] for r in rows)
            ids, attention = batch.ids[index, :width], batch.attention[index, :width]
            mask = batch.mask[index, : width - 1]
            logits = self.model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(logp * adv[index].unsqueeze(1) * mask).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


def trainer(model_dir: Path, groups: list[TrainGroup], lr: float, budget: int | None, shared: bool) -> PolicyTrainer:
    config = parse_config(
        {
            "run": "bench",
            "groups_per_step": len(groups),
            "samples_per_group": len(groups[0].scored.rollout.samples),
            "model": {"source": str(model_dir)},
            "trainer": {
                "optim": {"lr": lr},
                "compute": {"micro_batch_tokens": budget, "shared_prompt": shared},
                "kl": {"coef": 0.0},
            },
        }
    )
    return PolicyTrainer(model_dir, config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--response-tokens", type=int, default=32)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trainer_throughput.json"))
    args = p.parse_args(argv)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        p.error(f"{model_dir} holds no model: run `make smollm2` first (or pass --model DIR)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    groups = make_groups(model_dir, args.groups, args.samples, args.response_tokens)
    batch = make_batch(groups)
    tokens = sum(batch.lengths)
    budget = args.micro_batch_tokens
    cases: dict[str, Any] = {
        "plain loop": PlainLoop(model_dir, 1e-6, budget),
        "trainer, plain pass": trainer(model_dir, groups, 1e-6, budget, shared=False),
        "trainer, shared prompt": trainer(model_dir, groups, 1e-6, budget, shared=True),
    }
    for case in cases.values():  # one untimed step each: allocator and thread pools warm
        case.step(groups)
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeat):
        for name, case in cases.items():
            started = time.perf_counter()
            case.step(groups)
            seconds[name].append(time.perf_counter() - started)
    base = statistics.median(seconds["plain loop"])
    rows = []
    for name, times in seconds.items():
        median = statistics.median(times)
        rows.append(
            {
                "case": name,
                "seconds": round(median, 3),
                "tokens_per_s": round(tokens / median, 1),
                "vs_plain_loop": round(base / median, 3),
                "all_seconds": [round(t, 3) for t in times],
            }
        )
    prompt_tokens = sum(batch.prompt_lengths)
    print(
        f"trainer throughput: {model_dir.name}, {args.groups} groups x {args.samples} samples, {tokens} tokens "
        f"({prompt_tokens} prompt), micro-batch {budget} tokens, {args.threads} threads, median of {args.repeat}"
    )
    print(f"{'case':<26}{'s/step':>9}{'tokens/s':>11}{'x plain loop':>14}")
    for r in rows:
        print(f"{r['case']:<26}{r['seconds']:>9.2f}{r['tokens_per_s']:>11.1f}{r['vs_plain_loop']:>14.2f}")
    result = {
        "model": model_dir.name,
        "groups": args.groups,
        "samples": args.samples,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "micro_batch_tokens": budget,
        "threads": args.threads,
        "rows": rows,
    }
    write_results("trainer_throughput", Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
