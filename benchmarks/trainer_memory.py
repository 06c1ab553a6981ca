"""Trainer memory on a real model: peak memory of one step across micro-batch token budgets and batch sizes.

    python benchmarks/trainer_memory.py [--model models/SmolLM2-135M-Instruct]
        [--budgets 512,1024,2048,4096,8192,16384] [--rows 64] [--batch-sizes 16,32,64] [--slope-budget 2048]
        [--seq 256] [--prompt 64] [--threads 2]
        [--out benchmarks/results/trainer_memory.json]

Every measurement runs in a fresh process (peak RSS only grows within one), which loads the model, builds
one step of `rows` sequences of `seq` tokens (`prompt` prompt tokens shared by groups of 8 samples, random
ids, random rewards) and runs it; it reports its peak RSS (`ru_maxrss`) and, on CUDA, the peak allocated
GPU memory. Three series:

- budget sweep: `PolicyTrainer.step` over `--rows` sequences at each budget of `--budgets` (the default
  shared-prompt forward);
- batch sweep: the same step at `--slope-budget` tokens over each of `--batch-sizes` rows: once micro-batched,
  memory should not grow with the batch (the slope, MiB per extra sequence, is reported);
- reference: one plain transformers forward + backward of a single micro-batch of the budget's size, plus one
  AdamW step (the floor any trainer pays for that micro-batch): the step's peak is compared with it.

Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GROUP = 8


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """The child: one step (or one plain micro-batch) and its peaks."""
    import torch

    from workers.config import parse_config
    from workers.data.models import load_model
    from workers.training.trainer import PolicyTrainer

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    rng = random.Random(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.reference:
        model = load_model(model_dir).to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        rows = max(1, args.budget // args.seq)
        vocab = model.config.vocab_size
        ids = torch.tensor([[rng.randrange(vocab) for _ in range(args.seq)] for _ in range(rows)], device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        (-logp.mean()).backward()
        optimizer.step()
    else:
        groups = _groups(args.rows, args.seq, args.prompt, rng, model_dir)
        config = parse_config(
            {
                "run": "mem",
                "groups_per_step": len(groups),
                "samples_per_group": GROUP,
                "model": {"source": str(model_dir)},
                "trainer": {"optim": {"lr": 1e-6}, "compute": {"micro_batch_tokens": args.budget}, "kl": {"coef": 0.0}},
            }
        )
        PolicyTrainer(model_dir, config).step(groups)
    out = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device == "cuda":
        out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def _groups(rows: int, seq: int, prompt: int, rng: random.Random, model_dir: Path) -> list[Any]:
    from schemas import PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor
    from workers.data.models import load_tokenizer

    vocab = len(load_tokenizer(model_dir))
    out = []
    for g in range(max(1, rows // GROUP)):
        ids = [rng.randrange(vocab) for _ in range(prompt)]
        samples = []
        for _ in range(GROUP):
            r = [rng.randrange(vocab) for _ in range(seq - prompt)]
            samples.append(
                Sample(
                    token_ids=WireTensor.from_values(r, "int32"),
                    logprobs=WireTensor.from_values([-2.0] * len(r), "float32"),
                    text="",
                    finish_reason="length",
                )
            )
        group = PromptGroup(
            run="mem", group_id=f"g{g}", parts=(TextPart(text="x"),), n_samples=GROUP, release_index=g,
            released_at_version=0,
        )  # fmt: skip
        rollout = RolloutGroup(
            prompt=group,
            prompt_token_ids=WireTensor.from_values(ids, "int32"),
            samples=tuple(samples),
            policy_version=0,
        )
        rewards = tuple(float(rng.random() < 0.5) for _ in range(GROUP))
        out.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=rewards)))
    return out


def _child(args: argparse.Namespace, budget: int, rows: int, reference: bool = False) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--child", "--model", args.model, "--budget", str(budget), "--rows", str(rows),
        "--seq", str(args.seq), "--prompt", str(args.prompt), "--threads", str(args.threads),
    ]  # fmt: skip
    if reference:
        command.append("--reference")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {'reference' if reference else 'step':<9} budget {budget:>6} rows {rows:>4}: {result}", flush=True)
    return dict(result)


def _slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--budgets", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch-sizes", default="16,32,64")
    p.add_argument("--slope-budget", type=int, default=2048)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "trainer_memory.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=2048, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args)))
        return 0
    if not (Path(args.model) / "config.json").is_file():
        p.error(f"{args.model} holds no model: run `make smollm2` first (or pass --model DIR)")
    budgets = [int(b) for b in args.budgets.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"trainer memory: {Path(args.model).name}, sequences of {args.seq} tokens ({args.prompt} prompt)")
    sweep = []
    for budget in budgets:
        step = _child(args, budget, args.rows)
        ref = _child(args, budget, args.rows, reference=True)
        sweep.append({"budget": budget, "step": step, "reference": ref,
                      "ratio": round(step["peak_rss_mib"] / ref["peak_rss_mib"], 3)})  # fmt: skip
    batch = [{"rows": n, "step": _child(args, args.slope_budget, n)} for n in sizes]
    slope = _slope(sizes, [b["step"]["peak_rss_mib"] for b in batch])
    print(f"\n{'budget':>8}{'step peak MiB':>15}{'1 micro-batch MiB':>19}{'ratio':>8}")
    for s in sweep:
        print(
            f"{s['budget']:>8}{s['step']['peak_rss_mib']:>15.0f}{s['reference']['peak_rss_mib']:>19.0f}{s['ratio']:>8.2f}"
        )
    print(f"\n{'rows':>8}{'step peak MiB':>15}   (budget {args.slope_budget})")
    for b in batch:
        print(f"{b['rows']:>8}{b['step']['peak_rss_mib']:>15.0f}")
    print(f"slope: {slope:.2f} MiB per extra sequence")
    result = {
        "model": Path(args.model).name,
        "seq": args.seq,
        "prompt": args.prompt,
        "rows": args.rows,
        "threads": args.threads,
        "budget_sweep": sweep,
        "batch_sweep": batch,
        "slope_mib_per_sequence": round(slope, 3),
    }
    from pipeline import write_results  # benchmarks/pipeline.py: the JSON every benchmark writes

    write_results("trainer_memory", Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
