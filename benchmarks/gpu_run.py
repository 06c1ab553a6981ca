"""A whole run on one GPU in one prepared script: `relax run` against plain Hugging Face loops of the same shapes.

    python benchmarks/gpu_run.py --prepare [DIR]                     # here: gather what a bare GPU machine lacks
    python benchmarks/gpu_run.py [--shape 0.5b|1.5b] [--steps 8]     # there: build, baseline, run, report
    python benchmarks/gpu_run.py --device cpu                        # the same path on the CPU (tiny, 2 steps)

`--prepare` fills DIR (default benchmarks/gpu_bundle, git-ignored) with the wheels the roles import that a bare
CUDA image (torch, transformers, peft, numpy, pyyaml, ...) does not hold, downloaded with
`pip download --no-deps --only-binary :all:` for CPython 3.11 and 3.12 on manylinux x86_64 at the versions this
environment runs, and with the nats-server binary `relax run` starts (`relax_bus.ops.server.find_nats_server`).
Copy the working tree with that folder (well under 64 MiB in all) to the GPU machine and run the script there:
it installs the wheels with `pip install --no-index --no-deps --target` into a temporary directory put on
PYTHONPATH (this process's and the roles'), and the binary into its `bin`, put on the run's PATH. No package index,
vLLM or nats-py install is needed there.

The run:
- builds a model of a real shape in code, random weights (`--shape 0.5b`: Qwen2.5-0.5B's config, vocabulary of
  151,936; `1.5b`: Qwen2.5-1.5B's; `tiny` for the CPU dry run) with a byte-level tokenizer as wide as that
  vocabulary (ids 0..255 are bytes, the rest decode to byte strings), saved as a model directory;
- measures the same model in this process, with the run's batch shapes (`--groups` x `--samples` sequences of
  `--prompt-tokens` + `--new-tokens` random tokens): a plain forward+backward+AdamW loop (bf16 autocast on CUDA,
  micro-batches of `--micro-batch-tokens`, as the trainer) and a plain `generate` loop (fp32 eager, as the torch
  engine loads the model);
- writes a run config (a JSONL task of prompts that long, torch engine on the GPU, trainer on the GPU with
  `precision: auto` = bf16, micro-batches, `weights: shm`) and runs `python -m workers.cli run` (the real
  launcher: embedded nats-server, every role a process) for `--steps` steps, under `--timeout-s`;
- reads the run's `metrics.jsonl` (steps after the first: the first holds start-up) and reports step time,
  trained and generated tokens/s, the peak GPU memory of the device (all processes, polled) and the bus share of
  the actor's step: weight snapshot/sync, acks, admission and decoding against `step_s`. The checkpoints of steps
  0 and last go to local disk under the work directory (not whole into the object store).
Prints a table and writes JSON to benchmarks/results/gpu_run_<device>.json (`--out` to change it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "benchmarks" / "gpu_bundle"
MANIFEST = "manifest.json"
BUNDLED = (
    "nats-py",
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "python-dotenv",
    "structlog",
    "bcrypt",
    "msgpack",
    "soundfile",  # workers.omni.media imports it at the top, and the actor imports that
    "cffi",
    "pycparser",
)
"""Distributions the roles import that a bare CUDA PyTorch image lacks (or holds at another version); the
versions are this environment's (the project's pins)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
PYTHONS = ("3.11", "3.12")
BUNDLE_LIMIT = 40 * 2**20
"""Most bytes the bundle may take: it travels with the working tree, 64 MiB in all."""
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {"hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14, "kv_heads": 2, "vocab": 151936},
    "1.5b": {"hidden": 1536, "intermediate": 8960, "layers": 28, "heads": 12, "kv_heads": 2, "vocab": 151936},
    "tiny": {"hidden": 64, "intermediate": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 1024},
}
"""Qwen2.5-0.5B and -1.5B as their config.json has them (tied embeddings, rope theta 1e6); `tiny` for CPU."""


# ---- --prepare: here, with the project installed and the package index reachable ------------------------------


def prepare(bundle: Path) -> None:
    """Download the wheels of `BUNDLED` for every Python of `PYTHONS` and copy the nats-server binary."""
    from relax_bus.ops.server import find_nats_server

    bundle.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in BUNDLED]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for python in PYTHONS:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
        cmd += ["--implementation", "cp", "--python-version", python, *platforms, "-d", str(bundle), *pins]
        subprocess.run(cmd, check=True)
    binary = find_nats_server()
    shutil.copy2(binary, bundle / "nats-server")
    (bundle / MANIFEST).write_text(json.dumps({"requirements": pins, "nats_server": "nats-server"}, indent=2) + "\n")
    files = sorted(p for p in bundle.iterdir() if p.is_file())
    for f in files:
        print(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
    total = sum(f.stat().st_size for f in files)
    print(f"{total / 2**20:8.2f} MiB  in {bundle} ({len(files)} files)")
    if total > BUNDLE_LIMIT:
        sys.exit(f"gpu_run: the bundle is over {BUNDLE_LIMIT / 2**20:.0f} MiB: the tree and it must stay under 64 MiB")


def install_bundle(bundle: Path, site: Path | None = None) -> dict[str, str]:
    """Install the bundle's wheels into `site` (default: a temporary directory) with no index and no dependencies;
    return the variables this process and the roles need: PYTHONPATH (`site`, then the repository) and PATH
    (`site`/bin first, holding nats-server) and RELAX_NATS_SERVER_BIN."""
    manifest = json.loads((bundle / MANIFEST).read_text())
    site = site or Path(tempfile.mkdtemp(prefix="gpu-run-site-"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--disable-pip-version-check", "--target", str(site), "--find-links", str(bundle)]
    subprocess.run([*cmd, *manifest["requirements"]], check=True)
    server = site / "bin" / "nats-server"  # a copy: the carried tree may not keep the executable bit
    server.parent.mkdir(exist_ok=True)
    shutil.copy2(bundle / manifest["nats_server"], server)
    server.chmod(0o755)
    sys.path[:0] = [str(site), str(ROOT)]
    # RELAX_NATS_SERVER_BIN names the binary for `relax run`; PATH holds it too for a shell opened there.
    path = os.pathsep.join(filter(None, [str(server.parent), os.environ.get("PATH")]))
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "PATH": path, "RELAX_NATS_SERVER_BIN": str(server)}


# ---- the model and its tokenizer, built in code ---------------------------------------------------------------


def wide_byte_tokenizer(vocab: int) -> Any:
    """A byte-level tokenizer of `vocab` ids: 0..255 the bytes, 256..258 pad/bos/eos (as the byte tokenizer of
    `workers.data.tokenizer`), the rest multi-byte strings no text encodes to (no merges) but that decode, so a
    model of a real vocabulary samples every id and each one reads back as text."""
    from workers.data.tokenizer import VOCAB_SIZE, _byte_alphabet, byte_level_tokenizer

    alphabet = _byte_alphabet()
    extra: dict[str, int] = {}
    width, i = 2, VOCAB_SIZE
    while i < vocab:  # every string of `width` byte characters, in order, until the vocabulary is full
        for k in range(len(alphabet) ** width):
            if i >= vocab:
                break
            chars, rest = [], k
            for _ in range(width):
                rest, digit = divmod(rest, len(alphabet))
                chars.append(alphabet[digit])
            extra["".join(chars)] = i
            i += 1
        width += 1
    return byte_level_tokenizer(extra)


def build_model(shape: str, target: Path, device: str) -> Path:
    """A Qwen2 causal LM of `shape` with random weights (seed 0) and its tokenizer, saved into `target`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from workers.data.tokenizer import SPECIAL_IDS

    s = SHAPES[shape]
    config = Qwen2Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        dtype="bfloat16",
        **SPECIAL_IDS,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    hf_logging.disable_progress_bar()
    model.save_pretrained(target, safe_serialization=True)
    wide_byte_tokenizer(s["vocab"]).save_pretrained(target)
    del model
    return target


# ---- the plain Hugging Face loops -----------------------------------------------------------------------------


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def best_of(fn: Any, device: str, repeat: int) -> float:
    """Seconds of the fastest of `repeat` calls of `fn`, after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def plain_train(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A forward+backward+AdamW step over the run's sequences: fp32 weights, bf16 autocast on CUDA, micro-batches
    of at most `--micro-batch-tokens` padded tokens, the loss on the response tokens' log-probs."""
    import torch

    from workers.data.models import load_model

    device = args.device
    model = load_model(model_dir).to(device).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows, length = args.groups * args.samples, args.prompt_tokens + args.new_tokens
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (rows, length), generator=gen).to(device)  # [N, P+R]
    advantages = torch.randn(rows, 1, generator=gen).to(device)  # [N, 1]
    per_micro = max(1, args.micro_batch_tokens // length)

    def step() -> None:
        optim.zero_grad(set_to_none=True)
        for start in range(0, rows, per_micro):
            chunk = ids[start : start + per_micro]
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
                logits = model(input_ids=chunk).logits[:, args.prompt_tokens - 1 : -1].float()  # [n, R, V]
            logp = torch.log_softmax(logits, -1).gather(-1, chunk[:, args.prompt_tokens :, None]).squeeze(-1)
            loss = -(logp * advantages[start : start + per_micro]).sum() / (rows * args.new_tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()

    reset_peak(device)
    seconds = best_of(step, device, args.repeat)
    out = {"seconds": seconds, "tokens_per_s": rows * length / seconds, "peak_gib": peak_gib(device)}
    return out


def plain_generate(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`generate` of `--samples` completions of `--new-tokens` tokens for each of `--groups` prompts, sampled at
    temperature 1, in the dtype and attention the torch engine loads the model with (fp32, eager)."""
    import torch

    from workers.data.models import load_model

    device = args.device
    model = load_model(model_dir).to(device)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (args.groups, args.prompt_tokens), generator=gen)
    ids = prompts.repeat_interleave(args.samples, dim=0).to(device)  # [G*S, P]

    def call() -> None:
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=256,
            )

    reset_peak(device)
    seconds = best_of(call, device, args.repeat)
    tokens = args.groups * args.samples * args.new_tokens
    out = {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_gib": peak_gib(device)}
    return out


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


class DeviceMemory:
    """The device's used memory (every process: the roles are processes of their own), polled in a thread."""

    def __init__(self, device: str, every_s: float = 0.2) -> None:
        self.device, self.every_s = device, every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def used(self) -> int:
        import torch

        free_bytes, total = torch.cuda.mem_get_info()
        return int(total - free_bytes)

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.used())

    def __enter__(self) -> DeviceMemory:
        if self.device == "cuda":
            self.before = self.peak = self.used()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak_gib(self) -> float | None:
        return (self.peak - self.before) / 2**30 if self.device == "cuda" else None


# ---- the run --------------------------------------------------------------------------------------------------


def write_task(path: Path, args: argparse.Namespace) -> Path:
    """Prompts of `--prompt-tokens - 1` bytes (one token each; bos makes the rest) for every group of the run."""
    import random

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    with path.open("w") as f:
        for _ in range(args.groups * (args.steps + 4)):
            text = "".join(rng.choice(letters) for _ in range(args.prompt_tokens - 1))
            f.write(json.dumps({"prompt": text, "answer": "x"}) + "\n")
    return path


def run_config(model_dir: Path, task: Path, shm_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The run: one rollout worker and the actor on the device, shm weights, the metrics written by the launcher,
    the checkpoints (steps 0 and last) on local disk under `work` (the default puts them whole into the object
    store: GBs through the bus at a real shape)."""
    return {
        "run": f"gpu-run-{args.shape}",
        "groups_per_step": args.groups,
        "samples_per_group": args.samples,
        "staleness": {"max_staleness": 1, "action": "drop"},
        "model": {"source": {"type": "dir", "path": str(model_dir)}},
        "task": {"type": "jsonl", "options": {"path": str(task)}},
        # About half the random completions start with an ASCII byte: rewards differ inside a group, so the
        # advantages and the gradients are not zero (as in a real run).
        "rewards": [{"type": "format", "options": {"pattern": r"(?s)[\x00-\x7f].*"}}],
        "rollout": {
            "engine": "torch",
            "device": args.device,
            "max_new_tokens": args.new_tokens,
            "batch_groups": args.groups,
            "temperature": 1.0,
        },
        "trainer": {
            "steps": args.steps,
            "optim": {"lr": 1e-6},
            "checkpoint": {"every": 10_000, "keep": 1, "dir": str(work / "ckpt")},
            "compute": {"device": args.device, "precision": "auto", "micro_batch_tokens": args.micro_batch_tokens},
        },
        "weights": {"type": "shm", "dir": str(shm_dir)},
        "metrics": {"enabled": False},
        "roles": {"rollout": 1, "reward": 1},
    }


def weights_dir(work: Path, weight_bytes: int) -> Path:
    """/dev/shm when it has room for a few fp32 versions of the weights; else a directory of the work dir (a
    container's /dev/shm is often 64 MiB): the same transport, its segments on disk instead of in RAM."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 4 * weight_bytes:
        return shm
    print(f"... /dev/shm has no room for 4 x {weight_bytes / 2**30:.1f} GiB: weights go to {work / 'shm'}")
    (work / "shm").mkdir(exist_ok=True)
    return work / "shm"


def relax_run(config: dict[str, Any], work: Path, env: dict[str, str], timeout_s: float) -> Path:
    """`python -m workers.cli run` on `config`; its run directory. Its output goes to run.log."""
    import yaml

    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_dir = work / "run"
    log = work / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers.cli", "run", str(path), "--run-dir", str(run_dir)],
            cwd=work,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: the launcher stops every role and the server by PID
            code = proc.wait(timeout=60)
    if code != 0:
        tail = log.read_text()[-3000:]
        roles = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        sys.exit(f"gpu_run: relax run exited with {code}; its output ends with:\n{tail}{roles[-6000:]}")
    return run_dir


def summarise(records: list[dict[str, float]], args: argparse.Namespace) -> dict[str, float]:
    """Means over the steps after the first (start-up: model loads, the first weights, warm-up kernels).

    trained tokens per step      = groups x samples x (prompt tokens + mean response length)
    generated tokens per step    = groups x samples x mean response length
    bus seconds (actor's path)   = weight_sync_s + ack_s + admit_s (+ decode_s when not read ahead)
    bus share                    = bus seconds / step_s; compute share = train_s / step_s;
    wait share                   = (data_wait_s - admit_s) / step_s: waiting for generation
    """
    steady = [r for r in records if r["step"] > 1] or records

    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key, 0.0)) for r in steady)

    rows = args.groups * args.samples
    response = mean("response/length_mean")
    step_s, train_s = mean("step_s"), mean("train_s")
    decode = statistics.fmean(float(r.get("decode_s", 0.0)) if not r.get("read_ahead") else 0.0 for r in steady)
    bus_s = mean("weight_sync_s") + mean("ack_s") + mean("admit_s") + decode
    return {
        "steps_measured": float(len(steady)),
        "step_s": step_s,
        "train_s": train_s,
        "trained_tokens_per_s": rows * (args.prompt_tokens + response) / train_s if train_s else 0.0,
        "trained_tokens_per_s_end_to_end": rows * (args.prompt_tokens + response) / step_s if step_s else 0.0,
        "engine_tokens_per_s": mean("rollout_tokens_per_s"),
        "generated_tokens_per_s_end_to_end": rows * response / step_s if step_s else 0.0,
        "response_length_mean": response,
        "bus_s": bus_s,
        "weight_publish_s": mean("weight_publish_s"),
        "bus_share": bus_s / step_s if step_s else 0.0,
        "compute_share": train_s / step_s if step_s else 0.0,
        "wait_share": max(0.0, mean("data_wait_s") - mean("admit_s")) / step_s if step_s else 0.0,
    }


def report(result: dict[str, Any]) -> None:
    run, train, gen = result["run"], result["plain_train"], result["plain_generate"]
    gib = result["run_peak_gpu_gib"]
    print(f"\n{result['device']}  shape {result['shape']}  {result['params_m']:.1f}M parameters")
    print(f"{'':<34} {'relax run':>12} {'plain HF':>12} {'ratio':>7}")
    rows = [
        ("train_s / plain step (s)", run["train_s"], train["seconds"]),
        ("trained tokens/s (train_s)", run["trained_tokens_per_s"], train["tokens_per_s"]),
        ("generated tokens/s (engine)", run["engine_tokens_per_s"], gen["tokens_per_s"]),
    ]
    for name, mine, plain in rows:
        print(f"{name:<34} {mine:>12.3f} {plain:>12.3f} {mine / plain if plain else 0:>7.2f}")
    print(f"{'run step_s (whole step)':<34} {run['step_s']:>12.3f}")
    print(f"{'trained tokens/s (per step_s)':<34} {run['trained_tokens_per_s_end_to_end']:>12.1f}")
    print(f"{'generated tokens/s (per step_s)':<34} {run['generated_tokens_per_s_end_to_end']:>12.1f}")
    print(f"{'bus s per step (actor path)':<34} {run['bus_s']:>12.4f}  share {run['bus_share']:.1%}")
    print(f"{'weight publish s (off path)':<34} {run['weight_publish_s']:>12.4f}")
    print(f"{'compute share / wait share':<34} {run['compute_share']:>11.1%} {run['wait_share']:>12.1%}")
    if gib is not None:
        print(f"{'peak GPU GiB run / train / gen':<34} {gib:>12.2f} {train['peak_gib']:>12.2f} {gen['peak_gib']:>7.2f}")


def parameters(model_dir: Path) -> int:
    """Parameters in the saved model (tied embeddings counted once: they are saved once)."""
    from safetensors import safe_open

    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return total


def device_slug(name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`: the result file's name part."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prepare", nargs="?", const=str(BUNDLE), metavar="DIR", help="gather the bundle and stop")
    p.add_argument("--bundle", default=str(BUNDLE), help="the prepared folder (used when it exists)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", choices=sorted(SHAPES), help="default: 0.5b on cuda, tiny on cpu")
    p.add_argument("--steps", type=int, help="default 8 on cuda, 2 on cpu")
    p.add_argument("--groups", type=int, help="prompt groups per step (default 8 on cuda, 2 on cpu)")
    p.add_argument("--samples", type=int, help="samples per group (default 8 on cuda, 2 on cpu)")
    p.add_argument("--prompt-tokens", type=int, help="prompt length, bos included (default 128 on cuda, 16 on cpu)")
    p.add_argument("--new-tokens", type=int, help="response length (default 256 on cuda, 16 on cpu)")
    p.add_argument("--micro-batch-tokens", type=int, default=8192, help="the trainer's micro-batch budget")
    p.add_argument("--repeat", type=int, help="timed calls of each plain loop (default 3 on cuda, 1 on cpu)")
    p.add_argument("--timeout-s", type=float, default=420.0, help="the run's wall-clock limit")
    p.add_argument("--work-dir", help="where the model, config and run go (default: a temporary directory)")
    p.add_argument("--out", help="default benchmarks/results/gpu_run_<device>.json")
    args = p.parse_args()
    if args.prepare:
        sys.path.insert(0, str(ROOT))
        prepare(Path(args.prepare))
        return
    gpu = args.device == "cuda"
    defaults = {"shape": "0.5b" if gpu else "tiny", "steps": 8 if gpu else 2, "groups": 8 if gpu else 2}
    defaults |= {"samples": 8 if gpu else 2, "prompt_tokens": 128 if gpu else 16, "new_tokens": 256 if gpu else 16}
    defaults |= {"repeat": 3 if gpu else 1}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    bundle = Path(args.bundle)
    started = time.perf_counter()
    env = install_bundle(bundle) if (bundle / MANIFEST).is_file() else {}
    installed_s = time.perf_counter() - started
    if not env:
        sys.path.insert(0, str(ROOT))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    import torch

    if gpu and not torch.cuda.is_available():
        sys.exit("gpu_run: torch sees no CUDA device (use --device cpu for a dry run)")
    if not gpu:
        torch.set_num_threads(1)  # as each role on the CPU: the dry run shares its cores with the run's processes
    name = torch.cuda.get_device_name(0) if gpu else platform.processor() or "cpu"
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu-run-"))
    work.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {"install_s": round(installed_s, 2)}

    def phase(name: str, note: str, fn: Any) -> Any:
        print(f"... {note}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        value = fn()
        phases[name] = round(time.perf_counter() - started, 2)
        return value

    model_dir = phase(
        "build_s",
        f"building the {args.shape} model in {work}",
        lambda: build_model(args.shape, work / "model", args.device),
    )
    train = phase("plain_train_s", "plain forward+backward loop", lambda: plain_train(model_dir, args))
    free(args.device)  # the loop's model and optimizer are gone with its frame: return their memory
    gen = phase("plain_generate_s", "plain generate loop", lambda: plain_generate(model_dir, args))
    free(args.device)
    params = parameters(model_dir)
    config = run_config(model_dir, write_task(work / "prompts.jsonl", args), weights_dir(work, 4 * params), work, args)
    with DeviceMemory(args.device) as memory:
        note = f"relax run, {args.steps} steps (output: {work / 'run.log'})"
        run_dir = phase("relax_run_s", note, lambda: relax_run(config, work, env, args.timeout_s))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(records) < args.steps:
        sys.exit(f"gpu_run: the run recorded {len(records)} of {args.steps} steps (see {work / 'run.log'})")
    result = {
        "device": name,
        "shape": args.shape,
        "params_m": params / 1e6,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "batch": {k: getattr(args, k) for k in ("groups", "samples", "prompt_tokens", "new_tokens", "steps")}
        | {"micro_batch_tokens": args.micro_batch_tokens},
        "bundle": "PATH" in env,
        "phases_s": phases,
        "run": summarise(records, args),
        "run_peak_gpu_gib": memory.peak_gib(),
        "plain_train": train,
        "plain_generate": gen,
        "records": records,
    }
    report(result)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"gpu_run_{device_slug(name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
