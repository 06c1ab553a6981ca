"""Omni-modal media on the bus and in the roles: bytes per step, processor time, step time split.

    python benchmarks/omni.py [--groups 12] [--samples 8] [--epochs 25] [--repeat 5] [--threads 1]
                              [--metrics runs/omni/metrics.jsonl] [--out benchmarks/results/omni.json]

1. Bytes published per step (derived: the messages are built from a real tiny-omni engine's output on the omni
   task and encoded with the wire codec, not captured from a server). A group's prompt travels in each of its
   four messages (prompts, rollouts, scored, train). Three designs, per step of `--groups` groups x `--samples`:
   - per sample, by value: every sample carries its media (a per-sample message design);
   - per group, by value: each of the group's four messages carries the media inline (this code before the
     feeder stored media by digest; the claim check moves large ones to the object store, same bytes);
   - by reference (this code): each message carries a digest; each item's media is put once into the media
     store, so over `--epochs` passes it is counted once, amortised over the run's steps.
2. Processor tensors vs media bytes: what shipping the processor's output (pixel patches, audio features,
   float32) from the rollout to the trainer would move instead of the media itself, and the processor's time
   per group (each side runs it once per group: the rollout role to sample, the actor to train).
3. Step time split of an omni run, from its metrics.jsonl (`--metrics`, e.g. from `make demo-omni`): medians of
   train_s, data_wait_s (waiting for generation and scoring), admit_s, ack_s, weight_sync_s, processor_s.
Prints the tables, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pipeline import write_results

from schemas import PromptGroup, RolloutGroup, ScoredGroup, TrainGroup, WireTensor, encode
from schemas.parts import Part
from workers.data.models import materialize
from workers.data.tasks import load_task
from workers.engines.base import SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.omni.media_refs import by_reference, media_bytes, modality
from workers.omni.prompts import MediaPrompter
from workers.roles.rollout import sample_of

PHASES = ("step_s", "train_s", "data_wait_s", "admit_s", "ack_s", "weight_sync_s", "processor_s")


def group_messages(parts: tuple[Part, ...], ids: list[int], samples: list[Any], i: int) -> list[bytes]:
    """The encoded prompt, rollout, scored and train messages of one group whose prompt is `parts`."""
    prompt = PromptGroup(
        run="b", group_id=f"g{i}", parts=parts, n_samples=len(samples), release_index=i, released_at_version=0
    )
    rollout = RolloutGroup(
        prompt=prompt,
        prompt_token_ids=WireTensor.from_values(ids, "int32"),
        samples=tuple(sample_of(g) for g in samples),
        policy_version=0,
    )
    scored = ScoredGroup(rollout=rollout, rewards=(0.0,) * len(samples))
    return [encode(m) for m in (prompt, rollout, scored, TrainGroup(scored=scored))]


def bytes_table(args: argparse.Namespace, engine: TorchEngine, prompter: MediaPrompter) -> dict[str, Any]:
    items = load_task({"type": "omni", "count": max(1, args.groups // 3)})[: args.groups]
    inputs = [prompter.inputs(it.parts) for it in items]
    ids = [x["input_ids"][0].tolist() for x in inputs]
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=3, seed=0)
    out = engine.generate(ids, args.samples, sampling, media=inputs)
    rows = list(enumerate(zip(items, ids, out, strict=True)))
    inline = sum(sum(map(len, group_messages(it.parts, i, s, k))) for k, (it, i, s) in rows)
    refs = sum(sum(map(len, group_messages(by_reference(it.parts), i, s, k))) for k, (it, i, s) in rows)
    media = sum(media_bytes(it.parts) for it in items)
    per_sample = inline + 4 * (args.samples - 1) * media  # each message would hold the media once per sample
    stored = media / args.epochs  # each item stored once over the run's epochs
    tensors = sum(sum(v.numel() * v.element_size() for k, v in x.items() if k != "input_ids") for x in inputs)
    seconds: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        for it in items:
            started = time.perf_counter()
            prompter.inputs(it.parts)
            seconds.setdefault(modality(it.parts), []).append(time.perf_counter() - started)
    return {
        "groups": len(items),
        "samples": args.samples,
        "epochs": args.epochs,
        "media_bytes_per_step": media,
        "per_sample_by_value": per_sample,
        "per_group_by_value": inline,
        "by_reference": refs + stored,
        "by_reference_messages": refs,
        "by_reference_store_amortised": stored,
        "ratio_per_sample_vs_reference": per_sample / (refs + stored),
        "ratio_per_group_vs_reference": inline / (refs + stored),
        "processor_tensor_bytes_per_step": tensors,
        "processor_ms_per_group": {k: 1000 * statistics.median(v) for k, v in sorted(seconds.items())},
    }


def split_table(metrics: Path) -> dict[str, Any] | None:
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    out: dict[str, Any] = {"steps": len(rows), "source": str(metrics)}
    for name in PHASES:
        values = [r[name] for r in rows if name in r]
        out[name] = statistics.median(values) if values else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument(
        "--epochs", type=int, default=25, help="passes over the items the run makes (make demo-omni: 4800 / 192)"
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--metrics", type=Path, default=Path("runs/omni/metrics.jsonl"))
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench-omni"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/omni.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = materialize("tiny-omni", args.work_dir / "tiny-omni", seed=0)
    engine = TorchEngine(model_dir)
    prompter = MediaPrompter(engine.processor)
    table = bytes_table(args, engine, prompter)
    print(f"\nbytes published per step ({table['groups']} groups x {table['samples']} samples, 4 messages per group)")
    print(f"  media in the step's prompts       {table['media_bytes_per_step']:>10,}")
    print(f"  per sample, by value              {table['per_sample_by_value']:>10,}")
    print(f"  per group, by value               {table['per_group_by_value']:>10,}")
    print(
        f"  by reference (this code)          {table['by_reference']:>10,.0f}  "
        f"(messages {table['by_reference_messages']:,} + store {table['by_reference_store_amortised']:,.0f} "
        f"amortised over {table['epochs']} epochs)"
    )
    print(
        f"  ratio: per sample / reference {table['ratio_per_sample_vs_reference']:.1f}x, "
        f"per group / reference {table['ratio_per_group_vs_reference']:.1f}x"
    )
    print(f"  processor tensors instead of media: {table['processor_tensor_bytes_per_step']:,} bytes per step")
    print(
        "  processor time per group (ms): "
        + ", ".join(f"{k} {v:.1f}" for k, v in table["processor_ms_per_group"].items())
    )
    split = split_table(args.metrics)
    if split is None:
        print(f"\nno metrics at {args.metrics}: run `make demo-omni` first for the step time split")
    else:
        print(f"\nstep time split, medians over {split['steps']} steps of {split['source']} (seconds)")
        for name in PHASES:
            value = split[name]
            print(f"  {name:<14} {'-' if value is None else f'{value:.3f}'}")
    write_results("omni", args.out, {"bytes": table, "step_split": split})
    return 0


if __name__ == "__main__":
    sys.exit(main())
