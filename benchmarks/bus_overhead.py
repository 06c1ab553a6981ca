"""Bus overhead per step: what the trainer and a rollout worker spend in the bus, against the step's compute.

    python benchmarks/bus_overhead.py [--configs demo,large] [--repeat 5] [--out FILE]

Method: the bus calls are timed directly, in one process, on an embedded nats-server (file storage)
with a run provisioned as `relax init` does, using the production code paths and messages of the
real size: a real engine call (torch engine, one thread) produces the step's rollout groups, the
reward scorer scores them. Then, per step:
- trainer: `Actor._collect` (pull fetch, decode, dedupe, staleness judgement) of the step's train
  messages, acking them one by one as `Actor._train` does, `Actor._publish_weights` (full state,
  safetensors, object-store put, compare-and-set of policy.version, announcement) and
  `Actor._record_step` (the Metric and step_trained events);
- rollout: a `relax_bus.worker.Worker` with the rollout role's input and output taking the step's
  prompt groups (fetch, decode, handler, publish of the rollout group, ack; the handler returns
  the ready-made group, so no compute is in it), then fetching and decoding the new weights
  (`ObjectStoreTransport.read`); loading them into the engine is shown apart (engine work);
- the version watch: latency from the compare-and-set to a rollout worker's tracker seeing it.
The step's compute is measured in the same run with one thread per role, as in a run: T_generate
(engine call) and T_train (PolicyTrainer.step). Fractions are bus seconds over the pipelined step
max(T_generate + rollout bus, T_train + trainer bus). Medians over --repeat steps.

Configurations: `demo` (examples/demo.yaml: 32 groups x 8 samples, 4 new tokens, tiny:128x2) and
`large` (128 groups x 16 samples x 16 new tokens of a random tiny:128x2, whose samples run to full
length: 4x the messages, 8x the samples and ~30x the tokens of a demo step).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from colocated import rollout_group
from pipeline import write_results

from relax_bus import log
from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.ops.server import EmbeddedServer
from relax_bus.policy_version import VersionTracker
from relax_bus.provision import provision
from relax_bus.settings import ConnectionSettings
from relax_bus.worker import Worker, WorkerOptions
from schemas import PromptGroup, RolloutGroup, TrainGroup, encode
from workers.config import PipelineConfig, load_config, task_spec
from workers.data.models import materialize
from workers.data.prompts import prompt_ids
from workers.data.tasks import load_task, prompt_text
from workers.engines.base import SamplingSettings
from workers.engines.torch_engine import TorchEngine
from workers.roles.actor import Actor
from workers.roles.reward import make_scorer_from, score_group
from workers.training.trainer import PolicyTrainer
from workers.weights import ObjectStoreTransport

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.yaml"
CONFIGS = {
    "demo": {},
    "large": {"groups_per_step": 128, "samples_per_group": 16, "rollout": {"max_new_tokens": 16, "batch_groups": 128}},
}


def make_config(name: str) -> PipelineConfig:
    data = load_config(DEMO).model_dump()
    for key, value in CONFIGS[name].items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    data["run"] = f"busov{uuid.uuid4().hex[:6]}"
    data["trainer"]["warmup"]["max_steps"] = 0
    data["bus"]["max_ack_pending"] = max(256, 2 * data["groups_per_step"])
    return PipelineConfig.model_validate(data)


class TrainerState:
    """What `Actor._publish_weights` asks of the trainer: the full state of a real model."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer

    def full_state(self) -> dict[str, torch.Tensor]:
        return self.trainer.full_state()


def compute_step(
    config: PipelineConfig, model_dir: Path
) -> tuple[list[PromptGroup], list[RolloutGroup], dict[str, float]]:
    """One real step with one thread: the prompt groups, their rollout groups, and the compute times."""
    torch.set_num_threads(1)
    engine, trainer = TorchEngine(model_dir), PolicyTrainer(model_dir, config)
    scorer = make_scorer_from(config)
    items = load_task(task_spec(config.task))
    tok = trainer.tokenizer
    prompts = [
        PromptGroup(
            run=config.run,
            group_id=f"g{i}",
            parts=items[i % len(items)].parts,
            answer=items[i % len(items)].answer,
            n_samples=config.samples_per_group,
            release_index=i,
            released_at_version=0,
            task=items[i % len(items)].task,
        )
        for i in range(config.groups_per_step)
    ]
    m = config.model
    ids = [prompt_ids(tok, prompt_text(p.parts), m.prompt_format, m.system_prompt) for p in prompts]
    r = config.rollout
    sampling = SamplingSettings(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    engine.generate(ids, config.samples_per_group, sampling)  # warm-up call
    t0 = time.perf_counter()
    outputs = engine.generate(ids, config.samples_per_group, sampling)
    t1 = time.perf_counter()
    groups = [rollout_group(p, i, o, 0) for p, i, o in zip(prompts, ids, outputs, strict=True)]
    train = [TrainGroup(scored=score_group(scorer, g)) for g in groups]
    trainer.step(train)  # warm-up step
    t2 = time.perf_counter()
    trainer.step(train)
    t3 = time.perf_counter()
    state = trainer.full_state()
    t4 = time.perf_counter()
    engine.load_state_dict(state, 1)
    load_s = time.perf_counter() - t4
    scorer.close()
    tokens = sum(s.token_ids.numel for g in groups for s in g.samples)
    return prompts, groups, {"generate_s": t1 - t0, "train_s": t3 - t2, "engine_load_s": load_s, "tokens": tokens}


def restamp(group: TrainGroup, version: int, suffix: str) -> TrainGroup:
    """The same group under a new id, generated by `version` (so the actor trains it: lag 0)."""
    rollout = group.scored.rollout
    prompt = rollout.prompt.model_copy(update={"group_id": f"{rollout.prompt.group_id}-{suffix}"})
    rollout = rollout.model_copy(update={"policy_version": version, "prompt": prompt})
    return group.model_copy(update={"scored": group.scored.model_copy(update={"rollout": rollout})})


async def trainer_side(bus: Bus, actor: Actor, train: list[TrainGroup], version: int) -> dict[str, float]:
    """One step of the actor's bus work on pre-published train messages."""
    subject = bus.topology.subject("train")
    await bus.publisher.publish_many([(subject, g) for g in train])
    sub = await bus.js.pull_subscribe_bind(actor.durable, actor.stream)
    held: list[Any] = []
    t0 = time.perf_counter()
    assert await actor._collect(sub, asyncio.Event(), held)
    t1 = time.perf_counter()
    for h in held:
        await h.msg.ack_sync()
    t2 = time.perf_counter()
    await actor._publish_weights(version)
    t3 = time.perf_counter()
    lags = collections.Counter(version - 1 - h.group.policy_version for h in held)
    actor.state.step += 1
    await actor._record_step(held, {"reward_mean": 0.5, "loss": 0.0, "train_s": 0.0}, lags, t3 - t2)
    t4 = time.perf_counter()
    await sub.unsubscribe()
    return {"collect_s": t1 - t0, "ack_s": t2 - t1, "publish_weights_s": t3 - t2, "record_s": t4 - t3}


async def concurrent_acks(bus: Bus, actor: Actor, train: list[TrainGroup]) -> float:
    """Seconds to ack a step's messages all at once (awaited together) instead of one round trip each."""
    await bus.publisher.publish_many([(bus.topology.subject("train"), g) for g in train])
    sub = await bus.js.pull_subscribe_bind(actor.durable, actor.stream)
    held: list[Any] = []
    assert await actor._collect(sub, asyncio.Event(), held)
    started = time.perf_counter()
    await asyncio.gather(*(h.msg.ack_sync() for h in held))
    seconds = time.perf_counter() - started
    await sub.unsubscribe()
    return seconds


async def rollout_side(
    bus: Bus, prompts: list[PromptGroup], groups: list[RolloutGroup], transport: ObjectStoreTransport, version: int
) -> dict[str, float]:
    """One step of a rollout worker's bus work: take the step's prompts, publish their groups, fetch weights."""
    subject = bus.topology.subject("prompts")
    stamped = [p.model_copy(update={"group_id": f"{p.group_id}-v{version}"}) for p in prompts]
    await bus.publisher.publish_many([(subject, p) for p in stamped])
    ready = {p.group_id: g.model_copy(update={"prompt": p}) for p, g in zip(stamped, groups, strict=True)}

    async def handle(prompt: PromptGroup, delivery: Any) -> RolloutGroup:
        return ready[prompt.group_id]

    worker = Worker(bus, "rollout", handle, PromptGroup, WorkerOptions(concurrency=bus.config.rollout.batch_groups))
    t0 = time.perf_counter()
    task = asyncio.create_task(worker.run())
    while worker.counters.processed < len(prompts):  # noqa: ASYNC110 - polls the real worker's counters
        await asyncio.sleep(0.0005)
    t1 = time.perf_counter()
    worker.stop()
    await task
    await drain(bus, "rollouts", "reward")
    t2 = time.perf_counter()
    await transport.read(version)
    t3 = time.perf_counter()
    return {"prompts_to_rollouts_s": t1 - t0, "fetch_weights_s": t3 - t2}


async def drain(bus: Bus, key: str, durable: str) -> None:
    """Empty a work-queue hop (what the next role would consume), outside the timings."""
    sub = await bus.js.pull_subscribe_bind(durable, bus.topology.stream(key).name)
    try:
        while True:
            for msg in await sub.fetch(256, timeout=0.2):
                await msg.ack()
    except TimeoutError:
        pass
    finally:
        await sub.unsubscribe()


async def watch_latency(bus: Bus, actor: Actor, trainer: TrainerState, version: int) -> float:
    """Seconds from the compare-and-set of a new version to a tracker (the rollout's watcher) seeing it."""
    tracker = await VersionTracker(bus.version).start()
    try:
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        actor.revision = await bus.version.advance(version, actor.revision)
        actor.state.version = version
        await tracker.wait_for(version)
        return time.perf_counter() - started
    finally:
        await tracker.stop()


async def bench_config(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    config = make_config(name)
    model_dir = materialize(config.model.source, work / "base", config.model.seed)
    prompts, groups, compute = await asyncio.to_thread(compute_step, config, model_dir)
    train = [TrainGroup(scored=score_group(make_scorer_from(config), g)) for g in groups]
    sizes = {
        "prompt_bytes": statistics.fmean(len(encode(p)) for p in prompts),
        "train_bytes": statistics.fmean(len(encode(t)) for t in train),
    }
    with EmbeddedServer(store_dir=work / f"nats-{name}") as server:
        nc = await connect(ConnectionSettings(nats_url=[server.url]), name="bus-overhead")
        try:
            await provision(nc.jetstream(), config)
            bus = await Bus.attach(nc, config.run, PipelineConfig)
            trainer = TrainerState(PolicyTrainer(model_dir, config))
            transport = ObjectStoreTransport(bus)
            actor = Actor(bus, trainer, transport)  # type: ignore[arg-type]
            _, actor.revision = await bus.version.get()
            await actor._publish_weights(0)
            trainer_rows, rollout_rows, watch, acks = [], [], [], []
            for step in range(1, args.repeat + 2):
                fresh = [restamp(t, actor.state.version, f"s{step}") for t in train]  # lag 0: all trained
                trainer_rows.append(await trainer_side(bus, actor, fresh, actor.state.version + 1))
                rollout_rows.append(await rollout_side(bus, prompts, groups, transport, actor.state.version))
                watch.append(await watch_latency(bus, actor, trainer, actor.state.version + 1))
                again = [restamp(t, actor.state.version, f"a{step}") for t in train]
                acks.append(await concurrent_acks(bus, actor, again))
        finally:
            await nc.close()
    trainer_rows, rollout_rows = trainer_rows[1:], rollout_rows[1:]  # the first step pays one-off set-up
    t = {k: statistics.median(r[k] for r in trainer_rows) for k in trainer_rows[0]}
    r = {k: statistics.median(row[k] for row in rollout_rows) for k in rollout_rows[0]}
    trainer_bus, rollout_bus = sum(t.values()), sum(r.values())
    step = max(compute["generate_s"] + rollout_bus, compute["train_s"] + trainer_bus)
    return {
        "config": name,
        "groups_per_step": config.groups_per_step,
        "samples_per_group": config.samples_per_group,
        "max_new_tokens": config.rollout.max_new_tokens,
        **compute,
        **sizes,
        "trainer": t,
        "rollout": r,
        "watch_latency_s": statistics.median(watch),
        "ack_concurrent_s": statistics.median(acks[1:]),
        "trainer_bus_s": trainer_bus,
        "rollout_bus_s": rollout_bus,
        "step_s": step,
        "trainer_frac": trainer_bus / step,
        "rollout_frac": rollout_bus / step,
    }


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bus-overhead-") as work:
        return [await bench_config(name, args, Path(work)) for name in args.configs]


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", default="demo,large", help="configurations (default demo,large)")
    p.add_argument("--repeat", type=int, default=5, help="steps timed per configuration; median kept (default 5)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bus_overhead.json"))
    args = p.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",")]
    log.configure("warning")
    rows = asyncio.run(bench(args))

    ms = 1e3
    header = (
        f"{'config':6} {'batch':>13} {'msg KiB':>8} {'generate':>9} {'train':>8} {'step':>8} | {'trainer bus':>11} "
        f"{'(collect/ack/weights/events)':>28} {'frac':>6} | {'rollout bus':>11} {'(hop/weights)':>13} {'frac':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        t, ro = r["trainer"], r["rollout"]
        batch = f"{r['groups_per_step']}x{r['samples_per_group']}x{r['max_new_tokens']}"
        parts = "/".join(f"{t[k] * ms:.0f}" for k in ("collect_s", "ack_s", "publish_weights_s", "record_s"))
        print(
            f"{r['config']:6} {batch:>13} {r['train_bytes'] / 1024:8.1f} {r['generate_s'] * ms:7.0f}ms "
            f"{r['train_s'] * ms:6.0f}ms {r['step_s'] * ms:6.0f}ms | {r['trainer_bus_s'] * ms:9.1f}ms {parts:>28} "
            f"{r['trainer_frac']:6.1%} | {r['rollout_bus_s'] * ms:9.1f}ms "
            f"{ro['prompts_to_rollouts_s'] * ms:6.0f}/{ro['fetch_weights_s'] * ms:<6.0f} {r['rollout_frac']:6.1%}"
        )
    for r in rows:
        print(
            f"{r['config']}: acks awaited together instead of one by one: {r['ack_concurrent_s'] * ms:.1f} ms "
            f"(not the actor's path); version watch latency {r['watch_latency_s'] * ms:.1f} ms; engine weight load "
            f"{r['engine_load_s'] * ms:.1f} ms (engine work, not counted); {r['tokens']} response tokens per step"
        )
    print(
        "times per step in ms, medians; batch = groups x samples x new tokens; msg KiB = one train message; "
        "step = max(generate + rollout bus, train + trainer bus), one thread per role; frac = bus / step"
    )
    write_results("bus_overhead", Path(args.out), {"rows": rows})


if __name__ == "__main__":
    main()
