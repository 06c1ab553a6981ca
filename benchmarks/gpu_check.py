"""GPU readiness in one prepared script: trainer steps, micro-batching and generation on a device.

    python benchmarks/gpu_check.py [--device cuda] [--model models/SmolLM2-135M-Instruct] [--out FILE]

Cases, each timed after one untimed warm-up call (a case that cannot run is recorded with its reason):
- trainer step of `tiny:128x2` and of the real model (bf16 on CUDA by `trainer.compute.precision: auto`), one
  process: 64 sequences of ~96 tokens (random token ids, GRPO rewards), whole batch in one pass and
  micro-batched at 1,024 padded tokens: step time, trained tokens/s, peak device memory;
- the torch engine: 64 prompts x 32 new tokens, generated tokens/s;
- vLLM, when it is installed: the same generation, then one weight reload (seconds).
`--device cpu` runs the same cases on the CPU (how the script is checked where there is no GPU; the
figures are not GPU figures). Prints a table and writes JSON (default benchmarks/results/gpu_check.json).
It finishes in a few minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schemas import PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor  # noqa: E402
from workers.config import parse_config  # noqa: E402
from workers.data.models import load_model, load_tokenizer, materialize  # noqa: E402
from workers.engines.base import SamplingSettings, make_engine  # noqa: E402
from workers.training.trainer import PolicyTrainer  # noqa: E402

GROUPS, SAMPLES, PROMPT, RESPONSE = 8, 8, 64, 32


def synthetic_groups(vocab: int, seed: int = 0) -> list[TrainGroup]:
    """GROUPS x SAMPLES sequences of random tokens (PROMPT prompt, up to RESPONSE response tokens)."""
    rng = random.Random(seed)
    groups = []
    for g in range(GROUPS):
        prompt = PromptGroup(
            run="gpu",
            group_id=f"g{g}",
            parts=(TextPart(text="x"),),
            n_samples=SAMPLES,
            release_index=g,
            released_at_version=0,
        )
        samples = []
        for _ in range(SAMPLES):
            n = rng.randint(RESPONSE // 2, RESPONSE)
            samples.append(
                Sample(
                    token_ids=WireTensor.from_values([rng.randrange(vocab) for _ in range(n)], "int32"),
                    logprobs=WireTensor.from_values([-rng.uniform(0.5, 5.0) for _ in range(n)], "float32"),
                )
            )
        rollout = RolloutGroup(
            prompt=prompt,
            prompt_token_ids=WireTensor.from_values([rng.randrange(vocab) for _ in range(PROMPT)], "int32"),
            samples=tuple(samples),
            policy_version=0,
        )
        rewards = tuple(float(rng.random() < 0.5) for _ in range(SAMPLES))
        groups.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=rewards)))
    return groups


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's peak RSS so far


def timed(fn: Callable[[], Any], repeat: int = 2) -> float:
    fn()  # warm-up: allocations, kernels, autotuning
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def trainer_case(name: str, model_dir: Path, device: str, budget: int | None) -> dict[str, Any]:
    config = parse_config(
        {
            "run": "gpu",
            "groups_per_step": GROUPS,
            "samples_per_group": SAMPLES,
            "rollout": {"max_new_tokens": RESPONSE},
            "trainer": {"optim": {"lr": 1e-6}, "compute": {"device": device, "micro_batch_tokens": budget}},
        }
    )
    trainer = PolicyTrainer(model_dir, config)
    groups = synthetic_groups(len(load_tokenizer(model_dir)))
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    seconds = timed(lambda: trainer.step(groups))
    tokens = sum(
        len(g.scored.rollout.prompt_token_ids.to_values()) + s.token_ids.numel
        for g in groups
        for s in g.scored.rollout.samples
    )
    return {
        "case": f"trainer step {name}" + ("" if budget is None else f" (micro {budget})"),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_mib": round(peak_memory_mib(trainer.device), 1),
        "precision": str(trainer.dtype).removeprefix("torch."),
    }


def engine_case(kind: str, model_dir: Path, device: str) -> dict[str, Any]:
    engine = make_engine(kind, model_dir, device=device)
    vocab = len(load_tokenizer(model_dir))
    prompts = [[random.Random(i).randrange(vocab) for _ in range(16)] for i in range(64)]
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=32, seed=0)
    before = engine.tokens_generated()
    seconds = timed(lambda: engine.generate(prompts, 1, sampling), repeat=1)
    generated = (engine.tokens_generated() - before) / 2  # warm-up call + timed call
    row: dict[str, Any] = {"case": f"{kind} engine generate 64 x 32", "seconds": round(seconds, 3)}
    row["tokens_per_s"] = round(generated / seconds, 1)
    if kind == "vllm":
        state = {k: v.detach().cpu() for k, v in load_model(model_dir).state_dict().items()}
        started = time.perf_counter()
        engine.load_state_dict(state, version=1)
        row["reload_s"] = round(time.perf_counter() - started, 3)
    return row


def attempt(rows: list[dict[str, Any]], case: str, fn: Callable[[], dict[str, Any]]) -> None:
    print(f"... {case}", file=sys.stderr, flush=True)
    try:
        rows.append(fn())
    except Exception as err:  # deliberate: one case failing must not hide the others' figures
        rows.append({"case": case, "error": f"{type(err).__name__}: {err}"[:300]})


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"), help="a real model directory ('' for none)"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device (use --device cpu for a dry run)")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    tiny = materialize("tiny:128x2", work / "tiny")
    real = Path(args.model)
    rows: list[dict[str, Any]] = []
    attempt(rows, "trainer step tiny", lambda: trainer_case("tiny", tiny, args.device, None))
    if (real / "config.json").is_file():
        attempt(rows, "trainer step real", lambda: trainer_case(real.name, real, args.device, None))
        attempt(rows, "trainer step real micro", lambda: trainer_case(real.name, real, args.device, 1024))
    else:
        rows.append({"case": "trainer step real", "error": f"no model at {real} (make smollm2)"})
    generator = real if (real / "config.json").is_file() else tiny
    attempt(rows, "torch engine", lambda: engine_case("torch", generator, args.device))
    try:
        import vllm  # noqa: F401

        attempt(rows, "vllm engine", lambda: engine_case("vllm", generator, args.device))
    except ImportError:
        rows.append({"case": "vllm engine", "error": "vllm is not installed"})
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    print(f"\n{'case':<48} {'seconds':>9} {'tokens/s':>10} {'peak MiB':>9}  notes")
    for r in rows:
        notes = r.get("error") or " ".join(f"{k}={r[k]}" for k in ("precision", "reload_s") if k in r)
        figures = f"{r.get('seconds', ''):>9} {r.get('tokens_per_s', ''):>10} {r.get('peak_mib', ''):>9}"
        print(f"{r['case']:<48} {figures}  {notes}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device_name, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
