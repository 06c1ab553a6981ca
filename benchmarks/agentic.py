"""Agentic episodes on the bus: what a slow tool, the turn batch's KV cache and durable turns cost the rollout.

    python -m benchmarks.agentic [--prompts 32] [--samples 8] [--latencies 0,50,200] [--servers 2] [--rounds 3]
    python -m benchmarks.agentic --quick          # 8 prompts x 8, one round: 1-2 minutes

One embedded nats-server; a run provisioned from a config with an `agent` section (calculator, `tags` format,
4 turns, 96 tokens, 24 per turn); `--servers` environment servers (`workers.envs.service.serve_env`), each a
process of its own as the env role is, serving `calculator` with its `latency_s` option; the rollout's own
`workers.roles.agent.Agent` (its EnvClient, its episodes bucket, its records) around a TorchEngine on the tiny model
(128x2), first taught the tool format for a few seconds (supervised steps on the `arithmetic` task's clean
demonstrations, as the episode tests do). A batch is `--prompts` prompt groups of `--samples` episodes, run by one
`Agent.groups` call, as one rollout handler call runs them. The engine is wrapped in a timer (its `generate` and
its turn batches' `turn`), never changed.

1. latency: a batch at each tool latency (ms per step), recording on (the default): episodes/s, turns and tool
   calls per episode, the client's mean seconds per environment call, and the engine's busy fraction (seconds
   inside engine calls / the batch's wall seconds).
2. KV reuse: the same batch (tool latency 0, recording off, the same seeds) on the engine's turn batch
   (`open_turns`: one KV cache across turns) and on a wrapper without `open_turns` (every turn re-prefills each
   episode's ids through `generate`); rounds alternate the order. Reported: seconds in the engine, tokens fed as
   prefill (`TurnBatch.prefilled` against the sum of the context lengths of every `generate` call) and whether
   the sampled tokens are identical.
3. bytes: `schemas.codec.encode` of each group's RolloutGroup per episode, and the records put after each turn
   (`EpisodeRecord.to_bytes`), from the latency-0 batch of part 1.
4. recording: the same batch (latency 0) with `agent.record_turns` on and off; rounds alternate the order. The
   added wall seconds as a share of the batch without it.

Everything runs on the CPUs of this machine, side by side in one run. Prints tables and writes JSON to
benchmarks/results/agentic.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import torch

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.ops.server import EmbeddedServer
from relax_bus.provision import provision
from schemas import PromptGroup, RolloutGroup, WireTensor
from schemas.codec import encode
from workers.config import PipelineConfig, parse_config
from workers.data.models import materialize
from workers.data.prompts import prompt_ids
from workers.data.tasks import prompt_text
from workers.data.tool_tasks import arithmetic
from workers.engines.base import Generated, SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.engines.torch_turns import TurnBatch
from workers.envs.base import EnvItem
from workers.envs.client import EnvClient
from workers.envs.formats import TagFormat
from workers.envs.service import ServerLimits, serve_env
from workers.roles.agent import Agent, record_key
from workers.roles.episodes import EnvSessionLike, EpisodeRecord
from workers.training.logprobs import token_logprobs
from workers.training.supervised import demo_ids, sft_tensors

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny:128x2"
MAX_TURNS, MAX_TOKENS, TURN_TOKENS = 4, 96, 24


# ---- the taught model ----------------------------------------------------------------------------------------------


def teach(engine: TorchEngine, steps: int, batch: int = 16, lr: float = 3e-3) -> float:
    """Supervised steps on the clean demonstrations of 512 `arithmetic` items (`<call>a*b</call>`, the observation
    as untrained context, the answer): afterwards the model calls the tool on most prompts. Returns the last loss."""
    tok = engine.tokenizer
    examples = []
    for item in arithmetic(digits=2, seed=0, limit=512):
        ids, trained = demo_ids(tok, item.demos[0])
        examples.append((prompt_ids(tok, prompt_text(item.parts)), ids, trained))
    model = engine.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(0)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        chosen = [examples[rng.randrange(len(examples))] for _ in range(batch)]
        ids, attention, mask = sft_tensors([(p, (a, trained)) for p, a, trained in chosen])
        loss = -(token_logprobs(model, ids, attention) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return float(loss.detach())


# ---- the timed engine ----------------------------------------------------------------------------------------------


@dataclass
class EngineClock:
    """What the engine did during one batch: seconds inside its calls, the calls, tokens fed as prefill."""

    seconds: float = 0.0
    calls: int = 0
    generate_context_tokens: int = 0
    """Sum of the context lengths of every `generate` call (the re-prefill path feeds them all each turn)."""
    batches: list[TurnBatch] = field(default_factory=list)

    @property
    def prefilled(self) -> int:
        return self.generate_context_tokens + sum(b.prefilled for b in self.batches)

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        return call


class Reprefill:
    """The engine without `open_turns`: `run_episodes` re-prefills every episode's ids through `generate` each turn."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.name = engine.name
        self.tokenizer = engine.tokenizer
        self.clock = EngineClock()

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingSettings, seeds: list[int] | None = None
    ) -> list[list[Generated]]:
        self.clock.generate_context_tokens += sum(len(p) for p in prompts) * n
        out: list[list[Generated]] = self.clock.timed(self.engine.generate)(prompts, n, sampling, seeds)
        return out


class KvTurns(Reprefill):
    """The engine with its turn batch (one KV cache across an episode's turns), each batch's `turn` timed."""

    def open_turns(self, contexts: list[list[int]]) -> TurnBatch:
        batch = self.engine.open_turns(contexts)
        batch.turn = self.clock.timed(batch.turn)  # type: ignore[method-assign]
        self.clock.batches.append(batch)
        return batch


# ---- environment servers, one process each -------------------------------------------------------------------------


async def serve_one(url: str, run: str, latency_s: float, threads: int) -> None:
    """The server process: one instance of the run's calculator service until SIGTERM. `threads` > 0 gives the
    event loop a default executor of that many threads (the server runs every environment call in it); 0 keeps
    asyncio's own (`min(32, cpus + 4)` threads)."""
    if threads:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(threads))
    nc = await nats.connect(url)
    server = await serve_env(nc, run, "calculator", {"latency_s": latency_s}, limits=ServerLimits())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop()
    await nc.close()


class EnvServers:
    """`count` server processes of the run's environment at `latency_s` per step, stopped by their PIDs."""

    def __init__(self, url: str, run: str, latency_s: float, count: int, threads: int = 0) -> None:
        self.args = (url, run, str(latency_s), str(threads))
        self.count = count
        self.procs: list[asyncio.subprocess.Process] = []

    async def __aenter__(self) -> EnvServers:
        for _ in range(self.count):
            proc = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "benchmarks.agentic", "--serve-env", *self.args),
                stdout=asyncio.subprocess.PIPE,
                cwd=ROOT,
            )
            self.procs.append(proc)
        for proc in self.procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60.0)
            if line.strip() != b"ready":
                raise RuntimeError(f"an environment server did not start (exit code {proc.returncode})")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 15.0)
            except TimeoutError:
                os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()


# ---- one batch -----------------------------------------------------------------------------------------------------


def covered(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) spans: the wall time the batch spent in calls that overlap."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


@dataclass
class Batch:
    """One `Agent.groups` call's figures."""

    wall_s: float
    engine: EngineClock
    groups: list[tuple[int, tuple[Any, ...]]]
    prompts: list[PromptGroup]
    ids: list[list[int]]
    steps_s: list[float]
    """Each environment step's seconds, as the client saw them (request to reply)."""
    bucket_spans: list[tuple[float, float]]
    """Each call on the episodes bucket (read a record, put one, purge one): its start and end."""
    record_bytes: list[int]

    @property
    def samples(self) -> list[Any]:
        return [s for _, samples in self.groups for s in samples]

    @property
    def bucket_s(self) -> float:
        """Wall seconds the batch spent waiting on the episodes bucket (the calls of one wave overlap)."""
        return covered(self.bucket_spans) if self.bucket_spans else 0.0

    def summary(self) -> dict[str, float]:
        infos = [s.episode for s in self.samples]
        n = len(infos)
        return {
            "episodes": n,
            "wall_s": self.wall_s,
            "episodes_per_s": n / self.wall_s,
            "turns_per_episode": sum(i.turns for i in infos) / n,
            "tool_calls_per_episode": sum(i.tool_calls for i in infos) / n,
            "answered": sum(i.ended == "answer" for i in infos) / n,
            "engine_s": self.engine.seconds,
            "engine_calls": self.engine.calls,
            "engine_busy": self.engine.seconds / self.wall_s,
            "env_steps": len(self.steps_s),
            "env_step_ms_mean": 1000 * statistics.mean(self.steps_s) if self.steps_s else 0.0,
            "env_step_ms_max": 1000 * max(self.steps_s, default=0.0),
            "bucket_s": self.bucket_s,
            "bucket_share": self.bucket_s / self.wall_s,
            "tokens_per_episode": sum(s.token_ids.numel for s in self.samples) / n,
            "prefilled_tokens": self.engine.prefilled,
        }


class Bench:
    """The run, its agent and the taught engine."""

    def __init__(self, bus: Bus, engine: TorchEngine, prompts: int, samples: int) -> None:
        self.bus = bus
        self.engine = engine
        self.n = samples
        self.items = arithmetic(digits=2, seed=1, limit=prompts)
        self.ids = [prompt_ids(engine.tokenizer, prompt_text(it.parts)) for it in self.items]
        self.seeds = [1000 * g for g in range(prompts)]
        self.count = 0

    def prompt_groups(self) -> list[PromptGroup]:
        """The batch's prompt groups, under group ids of their own (records of one batch never meet another's)."""
        self.count += 1
        return [
            PromptGroup(
                run=self.bus.run,
                group_id=f"b{self.count}g{i}",
                parts=it.parts,
                answer=it.answer,
                n_samples=self.n,
                release_index=i,
                released_at_version=0,
                index=i,
            )
            for i, it in enumerate(self.items)
        ]

    async def batch(self, kv_turns: bool, record: bool, sizes: bool = False) -> Batch:
        """One batch through the rollout's `Agent`, on the turn batch or re-prefilling; `record`: its
        `record_turns`; `sizes`: keep each record's size (one more `to_bytes` per put)."""
        engine = KvTurns(self.engine) if kv_turns else Reprefill(self.engine)
        cfg = self.bus.config.agent
        assert cfg is not None
        sampling = SamplingSettings(temperature=1.0, max_new_tokens=TURN_TOKENS)
        client = EnvClient(self.bus.nc, self.bus.topology, timeout_s=cfg.step_timeout_s, retries=cfg.env_retries)
        kv = await self.bus.js.key_value(self.bus.topology.bucket("episodes"))
        agent = Agent(self.bus, engine, TagFormat(self.engine.tokenizer), sampling, client, kv)  # type: ignore[arg-type]
        agent.record_turns = record
        steps: list[float] = []
        spans: list[tuple[float, float]] = []
        record_bytes: list[int] = []
        if sizes:  # the put `Agent._record` makes, with each record's size kept

            async def sized(rec: EpisodeRecord) -> None:
                data = rec.to_bytes()
                record_bytes.append(len(data))
                await kv.put(record_key(self.bus.run, rec.episode), data)

            agent._record = sized  # type: ignore[method-assign]
        for name in ("_recorded", "_record", "_forget"):
            setattr(agent, name, spanned(getattr(agent, name), spans))
        opened = agent._open

        async def open_timed(item: EnvItem, actions: Sequence[str]) -> EnvSessionLike:
            session = await opened(item, actions)
            session.step = timed_step(session.step, steps)  # type: ignore[method-assign]
            return session

        agent._open = open_timed  # type: ignore[method-assign]
        prompts = self.prompt_groups()
        started = time.perf_counter()
        groups = await agent.groups(prompts, self.ids, self.n, self.seeds, current=0)
        wall = time.perf_counter() - started
        return Batch(wall, engine.clock, groups, prompts, self.ids, steps, spans, record_bytes)


def spanned(fn: Callable[..., Awaitable[Any]], spans: list[tuple[float, float]]) -> Callable[..., Awaitable[Any]]:
    """`fn` with the start and end of each call appended to `spans`."""

    async def call(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return await fn(*args)
        finally:
            spans.append((started, time.perf_counter()))

    return call


def timed_step(step: Callable[[str], Awaitable[Any]], seconds: list[float]) -> Callable[[str], Awaitable[Any]]:
    """An environment session's `step` with each call's seconds appended to `seconds`."""

    async def call(action: str) -> Any:
        started = time.perf_counter()
        try:
            return await step(action)
        finally:
            seconds.append(time.perf_counter() - started)

    return call


def bytes_on_bus(b: Batch) -> dict[str, float]:
    """Encoded RolloutGroup bytes per episode, and the episode records' bytes per put and per turn."""
    encoded = [
        len(
            encode(
                RolloutGroup(
                    prompt=p,
                    prompt_token_ids=WireTensor.from_values(ids, "int32"),
                    samples=samples,
                    policy_version=version,
                    engine="torch",
                    worker_id="bench",
                )
            )
        )
        for p, ids, (version, samples) in zip(b.prompts, b.ids, b.groups, strict=True)
    ]
    episodes = len(b.samples)
    turns = sum(s.episode.turns for s in b.samples)
    return {
        "rollout_group_bytes_per_episode": sum(encoded) / episodes,
        "tokens_per_episode": sum(s.token_ids.numel for s in b.samples) / episodes,
        "records_put": len(b.record_bytes),
        "record_bytes_mean": statistics.mean(b.record_bytes),
        "record_bytes_max": max(b.record_bytes),
        "record_bytes_per_turn": sum(b.record_bytes) / turns,
        "record_bytes_per_episode": sum(b.record_bytes) / episodes,
    }


def same_tokens(a: Batch, b: Batch) -> dict[str, int]:
    """Episodes whose token ids (and so every sampled token) are identical in the two batches."""
    pairs = list(zip(a.samples, b.samples, strict=True))
    same = sum(x.token_ids.to_values() == y.token_ids.to_values() for x, y in pairs)
    return {"episodes": len(pairs), "identical": same}


# ---- the measurements ----------------------------------------------------------------------------------------------


DEFAULT_ENV_THREADS = min(32, (os.cpu_count() or 1) + 4)
"""The threads of asyncio's default executor on this machine (Python 3.11): the environment calls one server
process runs at once."""


def latency_row(latency_ms: float, threads: int, b: Batch) -> dict[str, Any]:
    row = {"latency_ms": latency_ms, "env_threads": threads or DEFAULT_ENV_THREADS, **b.summary()}
    print(
        f"latency {latency_ms:>4g} ms, {row['env_threads']:>2} env threads: {row['episodes_per_s']:6.1f} episodes/s, "
        f"{row['turns_per_episode']:.2f} turns, {row['tool_calls_per_episode']:.2f} calls/episode, "
        f"engine busy {row['engine_busy']:.0%}, {row['env_step_ms_mean']:.0f} ms per step",
        flush=True,
    )
    return row


async def measure(url: str, args: argparse.Namespace, engine: TorchEngine) -> dict[str, Any]:
    run = f"agentic{uuid.uuid4().hex[:8]}"
    config = parse_config(
        {
            "run": run,
            "agent": {"env": {"type": "calculator"}, "max_turns": MAX_TURNS, "max_tokens": MAX_TOKENS},
            "rollout": {"max_new_tokens": TURN_TOKENS},
        }
    )
    nc = await nats.connect(url)
    await provision(nc.jetstream(), config)
    bus = await Bus.attach(nc, run, PipelineConfig)
    bench = Bench(bus, engine, args.prompts, args.samples)
    out: dict[str, Any] = {"latency": [], "kv": [], "record": []}
    try:
        for latency_ms in args.latencies:
            async with EnvServers(url, run, latency_ms / 1000, args.servers):
                if latency_ms == args.latencies[0]:
                    await bench.batch(True, False)  # warm-up: first allocations, first connections
                b = await bench.batch(True, True, sizes=latency_ms == 0)
                out["latency"].append(latency_row(latency_ms, 0, b))
                if latency_ms != 0:
                    continue
                out["bytes"] = bytes_on_bus(b)
                for r in range(args.rounds):
                    order = (True, False) if r % 2 == 0 else (False, True)
                    runs = {kv: await bench.batch(kv, False) for kv in order}
                    kv_row = {
                        "round": r + 1,
                        "kv_turns": runs[True].summary(),
                        "reprefill": runs[False].summary(),
                        "tokens": same_tokens(runs[True], runs[False]),
                    }
                    out["kv"].append(kv_row)
                    print(
                        f"kv round {r + 1}: engine {kv_row['kv_turns']['engine_s']:.2f} s (turn batch) vs "
                        f"{kv_row['reprefill']['engine_s']:.2f} s (re-prefill), prefilled "
                        f"{kv_row['kv_turns']['prefilled_tokens']} vs {kv_row['reprefill']['prefilled_tokens']} "
                        f"tokens, identical {kv_row['tokens']['identical']}/{kv_row['tokens']['episodes']}",
                        flush=True,
                    )
                for r in range(args.rounds):
                    order = (True, False) if r % 2 == 0 else (False, True)
                    recs = {rec: await bench.batch(True, rec) for rec in order}
                    rec_row = {
                        "round": r + 1,
                        "on_s": recs[True].wall_s,
                        "off_s": recs[False].wall_s,
                        "bucket_s": recs[True].bucket_s,
                        "bucket_calls": len(recs[True].bucket_spans),
                        "engine_on_s": recs[True].engine.seconds,
                        "engine_off_s": recs[False].engine.seconds,
                    }
                    out["record"].append(rec_row)
                    print(
                        f"record round {r + 1}: on {rec_row['on_s']:.2f} s (of which {rec_row['bucket_s']:.2f} s "
                        f"waiting on the bucket, {rec_row['engine_on_s']:.2f} s in the engine), off "
                        f"{rec_row['off_s']:.2f} s ({rec_row['engine_off_s']:.2f} s in the engine)",
                        flush=True,
                    )
        slowest = args.latencies[-1]
        if args.env_threads and slowest > 0:  # the slowest tool again, each server with more threads
            async with EnvServers(url, run, slowest / 1000, args.servers, args.env_threads):
                out["latency"].append(latency_row(slowest, args.env_threads, await bench.batch(True, True)))
    finally:
        await nc.close()
    return out


# ---- report --------------------------------------------------------------------------------------------------------


def median_of(rows: Sequence[dict[str, Any]], *path: str) -> float:
    values = []
    for row in rows:
        value: Any = row
        for key in path:
            value = value[key]
        values.append(float(value))
    return statistics.median(values)


def report(out: dict[str, Any], servers: int) -> dict[str, Any]:
    print()
    print(
        f"{'latency ms':>10} {'env threads':>11} {'episodes/s':>10} {'turns/ep':>9} {'calls/ep':>9} "
        f"{'engine busy':>12} {'ms/step':>8} {'bucket wait':>12} {'wall s':>7}"
    )
    for r in out["latency"]:
        threads = f"{servers} x {r['env_threads']}"
        print(
            f"{r['latency_ms']:>10g} {threads:>11} {r['episodes_per_s']:>10.1f} "
            f"{r['turns_per_episode']:>9.2f} {r['tool_calls_per_episode']:>9.2f} {r['engine_busy']:>12.0%} "
            f"{r['env_step_ms_mean']:>8.0f} {r['bucket_share']:>12.1%} {r['wall_s']:>7.2f}"
        )
    kv = out["kv"]
    identical = sum(r["tokens"]["identical"] for r in kv)
    episodes = sum(r["tokens"]["episodes"] for r in kv)
    summary = {
        "kv_engine_s": median_of(kv, "kv_turns", "engine_s"),
        "reprefill_engine_s": median_of(kv, "reprefill", "engine_s"),
        "kv_wall_s": median_of(kv, "kv_turns", "wall_s"),
        "reprefill_wall_s": median_of(kv, "reprefill", "wall_s"),
        "kv_prefilled_tokens": median_of(kv, "kv_turns", "prefilled_tokens"),
        "reprefill_prefilled_tokens": median_of(kv, "reprefill", "prefilled_tokens"),
        "identical_episodes": identical,
        "compared_episodes": episodes,
    }
    summary["reprefill_over_kv_engine_s"] = summary["reprefill_engine_s"] / summary["kv_engine_s"]
    summary["reprefill_over_kv_prefilled"] = summary["reprefill_prefilled_tokens"] / summary["kv_prefilled_tokens"]
    print()
    print(f"{'generation':>12} {'engine s':>9} {'wall s':>7} {'prefilled tokens':>17}")
    for name, key in (("turn batch", "kv"), ("re-prefill", "reprefill")):
        print(
            f"{name:>12} {summary[key + '_engine_s']:>9.2f} {summary[key + '_wall_s']:>7.2f} "
            f"{summary[key + '_prefilled_tokens']:>17.0f}"
        )
    print(
        f"re-prefill / turn batch: engine {summary['reprefill_over_kv_engine_s']:.2f}x, prefill "
        f"{summary['reprefill_over_kv_prefilled']:.2f}x (medians of {len(kv)} rounds); sampled tokens identical in "
        f"{identical}/{episodes} episodes"
    )
    b = out["bytes"]
    print()
    print(
        f"bytes: RolloutGroup {b['rollout_group_bytes_per_episode']:.0f} B/episode "
        f"({b['tokens_per_episode']:.1f} tokens/episode); records {b['record_bytes_mean']:.0f} B/put "
        f"(max {b['record_bytes_max']}), {b['record_bytes_per_turn']:.0f} B/turn, "
        f"{b['record_bytes_per_episode']:.0f} B/episode"
    )
    rec = out["record"]
    on, off = median_of(rec, "on_s"), median_of(rec, "off_s")
    added = statistics.median(r["on_s"] - r["off_s"] for r in rec)
    waited = statistics.median(r["bucket_s"] / r["on_s"] for r in rec)
    summary |= {
        "record_on_s": on,
        "record_off_s": off,
        "record_added_s": added,
        "record_added_pct": 100 * added / off,
        "record_bucket_pct": 100 * waited,
    }
    print(
        f"recording turns (latency 0, medians of {len(rec)} rounds): on {on:.2f} s, off {off:.2f} s, added "
        f"{added:+.2f} s = {summary['record_added_pct']:+.1f} % of the batch; waiting on the bucket "
        f"{summary['record_bucket_pct']:.1f} % of the batch with it"
    )
    return summary


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=32, help="prompt groups per batch (default 32)")
    p.add_argument("--samples", type=int, default=8, help="episodes per prompt group (default 8)")
    p.add_argument("--latencies", default="0,50,200", help="tool latencies to compare, ms per step")
    p.add_argument("--servers", type=int, default=2, help="environment server processes (default 2)")
    p.add_argument(
        "--env-threads",
        type=int,
        default=64,
        help="threads per server for a last run at the slowest latency (default 64; 0: skip it)",
    )
    p.add_argument("--rounds", type=int, default=5, help="rounds of the side-by-side comparisons (default 3)")
    p.add_argument("--teach-steps", type=int, default=200, help="supervised steps teaching the tool format")
    p.add_argument("--threads", type=int, default=1, help="torch threads, as `relax worker --threads` (default 1)")
    p.add_argument("--quick", action="store_true", help="8 prompts, one round: 1-2 minutes")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agentic.json"))
    p.add_argument("--serve-env", nargs=4, metavar=("URL", "RUN", "LATENCY_S", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    log.configure("warning")
    if args.serve_env:
        url, run, latency, threads = args.serve_env
        asyncio.run(serve_one(url, run, float(latency), int(threads)))
        return
    if args.quick:
        args.prompts, args.rounds = 8, 1
    args.latencies = [float(x) for x in args.latencies.split(",")]
    if 0 not in args.latencies:
        raise SystemExit("--latencies must include 0 (the KV, bytes and recording comparisons run there)")
    args.latencies.sort()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        engine = TorchEngine(materialize(MODEL, Path(tmp) / "tiny", seed=0))
    taught = time.perf_counter()
    loss = teach(engine, args.teach_steps)
    print(f"taught the tool format: {args.teach_steps} steps, loss {loss:.3f}, {time.perf_counter() - taught:.1f} s")
    with EmbeddedServer() as server:
        out = asyncio.run(measure(server.url, args, engine))
    summary = report(out, args.servers)
    load_after = os.getloadavg()
    before, after = (", ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    print(f"load average (1, 5, 15 min): before {before}; after {after}; {time.perf_counter() - started:.0f} s in all")
    result = {
        "benchmark": "agentic",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m benchmarks.agentic " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "setup": {
            "model": MODEL,
            "teach_steps": args.teach_steps,
            "teach_loss": loss,
            "prompts": args.prompts,
            "samples": args.samples,
            "episodes": args.prompts * args.samples,
            "env_servers": args.servers,
            "env_threads_default": DEFAULT_ENV_THREADS,
            "max_turns": MAX_TURNS,
            "max_tokens": MAX_TOKENS,
            "turn_tokens": TURN_TOKENS,
            "rounds": args.rounds,
        },
        "summary": summary,
        **out,
        "seconds": time.perf_counter() - started,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
