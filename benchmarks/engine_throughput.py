"""Engine throughput: the torch engine next to the vLLM engine, same model, same batch, in one run.

    python benchmarks/engine_throughput.py [--models tiny:128x2,tiny:512x4] [--prompts 32] [--samples 8]
                                          [--new-tokens 16] [--repeat 3] [--threads 1] [--out FILE]

For each model (a `tiny:<hidden>x<layers>` Llama built in code, random weights, so nearly every
sample runs to --new-tokens): both engines get one warm-up call, then the same generate call
(prompts x samples, temperature 0.7, fixed seed) --repeat times, alternating engines so drift on a
shared machine hits both; the best rate is kept. Also measured: start-up time, weight reload time
(median of 2 x --repeat full-state loads, perturbed and back, wall time of `load_state_dict`), and
the log-prob mismatch of each engine's sampled tokens against the teacher-forced
`workers.training.logprobs.response_logprobs` on the same weights (mean and max absolute difference).
Both engines run with --threads intra-op threads. Prints a table, writes JSON. Needs vllm (`make vllm`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from relax_bus import log
from workers.data.models import load_model, materialize
from workers.data.tokenizer import BOS_ID
from workers.engines.base import Engine, Generated, SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.engines.vllm_engine import VllmEngine
from workers.training.logprobs import response_logprobs

TEMPERATURE = 0.7


def make_prompts(count: int) -> list[list[int]]:
    """Distinct addition prompts, "a+b=" with the bos in front (5-7 tokens)."""
    return [[BOS_ID, *f"{i % 10}+{i // 10}=".encode()] for i in range(count)]


def timed_generate(engine: Engine, prompts: list[list[int]], n: int, settings: SamplingSettings) -> dict[str, Any]:
    started = time.perf_counter()
    out = engine.generate(prompts, n, settings)
    seconds = time.perf_counter() - started
    tokens = sum(len(g.token_ids) for samples in out for g in samples)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "out": out}


def reload_seconds(engine: Engine, original: dict[str, torch.Tensor], repeat: int) -> float:
    """Median wall time of `load_state_dict` over 2 x repeat full-state loads (perturbed, then original)."""
    generator = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
    times = []
    for version in range(repeat):
        for state in (perturbed, original):
            started = time.perf_counter()
            engine.load_state_dict(state, version=version)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def logprob_mismatch(model: torch.nn.Module, prompts: list[list[int]], out: list[list[Generated]]) -> dict[str, float]:
    """Mean and max |engine log-prob - teacher-forced log-prob| over every sampled token."""
    diffs = []
    with torch.no_grad():
        for prompt, samples in zip(prompts, out, strict=True):
            ref = response_logprobs(model, prompt, [g.token_ids for g in samples], TEMPERATURE)
            diffs += [(torch.tensor(g.logprobs) - r).abs() for g, r in zip(samples, ref, strict=True)]
    flat = torch.cat(diffs)
    return {"logprob_mae": float(flat.mean()), "logprob_max": float(flat.max()), "tokens_compared": flat.numel()}


def bench_model(source: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = materialize(source, work / source.replace(":", "_"))
    reference = load_model(model_dir)
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    prompts = make_prompts(args.prompts)
    settings = SamplingSettings(temperature=TEMPERATURE, max_new_tokens=args.new_tokens, seed=0)
    engines: dict[str, Engine] = {}
    start_s: dict[str, float] = {}
    for name, cls in (("torch", TorchEngine), ("vllm", VllmEngine)):
        started = time.perf_counter()
        engines[name] = cls(model_dir)
        start_s[name] = time.perf_counter() - started
        engines[name].generate(prompts, args.samples, settings)  # warm-up
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeat):
        for name, engine in engines.items():
            run = timed_generate(engine, prompts, args.samples, settings)
            if name not in best or run["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = run
    rows = {}
    for name, engine in engines.items():
        run = best[name]
        rows[name] = {
            "tokens_per_s": run["tokens_per_s"],
            "seconds": run["seconds"],
            "tokens": run["tokens"],
            "start_s": start_s[name],
            "reload_s": reload_seconds(engine, original, args.repeat),
            **logprob_mismatch(reference, prompts, run["out"]),
        }
    return {
        "model": source,
        "params": sum(p.numel() for p in reference.parameters()),
        "engines": rows,
        "vllm_over_torch": rows["vllm"]["tokens_per_s"] / rows["torch"]["tokens_per_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="tiny:128x2,tiny:512x4", help="comma-separated tiny model sources")
    p.add_argument("--prompts", type=int, default=32, help="prompts per generate call (default 32)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--new-tokens", type=int, default=16, help="max new tokens per sample (default 16)")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per engine; the best is kept (default 3)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for both engines (default 1)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_throughput.json"))
    args = p.parse_args()
    log.configure("warning")
    torch.set_num_threads(args.threads)  # before the engines: the vLLM engine keeps the count it was built with
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as work:
        rows = [bench_model(source, args, Path(work)) for source in args.models.split(",")]

    header = (
        f"{'model':11} {'params':>7} {'engine':6} {'tok/s':>8} {'vllm/torch':>10} {'start s':>8} "
        f"{'reload ms':>9} {'|dlogp| mean':>12} {'|dlogp| max':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        for name, e in r["engines"].items():
            ratio = f"{r['vllm_over_torch']:9.2f}x" if name == "vllm" else ""
            print(
                f"{r['model']:11} {r['params'] / 1e6:6.2f}M {name:6} {e['tokens_per_s']:8.0f} {ratio:>10} "
                f"{e['start_s']:8.2f} {e['reload_s'] * 1e3:9.1f} {e['logprob_mae']:12.2e} {e['logprob_max']:11.2e}"
            )
    print(
        f"batch {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, "
        f"temperature {TEMPERATURE}, {args.threads} thread(s); best of {args.repeat}; "
        "dlogp = engine log-prob - teacher-forced log-prob"
    )
    write_json(Path(args.out), rows, args)


def write_json(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "engine_throughput",
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                },
                "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                "settings": {**vars(args), "temperature": TEMPERATURE},
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
