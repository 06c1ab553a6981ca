"""An attacker holding one role's credentials (the rollout's `<run dir>/auth/rollout.env`), for the chaos test
`tests/chaos/test_attacker.py`. It loops until SIGTERM over the attacks of issue 29, one round every
`--round-s` seconds, and writes what it tried, what the server refused and what it let through as JSON:

    reset         a chunk `{"seq": N}` written into the media store (N past what the hops hold, and 1), then push
                  consumers on the media store and the hops delivering to `$JS.API.CONSUMER.RESET.<stream>.
                  <durable>` of every hop; and the same body published there directly
    advisory      push consumers delivering to the reapers' `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.
                  <durable>`, and forged advisories (naming the hop's newest messages) published there directly
    amplification push consumers on the KV buckets, events and dlq delivering into the events and dlq subjects
    dead_letter   dead letters on the dlq subject whose payload is the prompt group the feeder released (or will
                  release next) at each index: what the feeder's dead-letter credit reads
    heartbeat     many new keys with large values under `$KV.<workers bucket>.rollout.*`, and heartbeats there
                  that claim another role
    poison        events that are not messages, or out of the schema's bounds, or a metric without reward_mean

A refused publish comes back as a permissions violation on the error callback; a consumer-create request that
the server does answer is counted as refused (an error) or accepted (a consumer now exists). The run config
is read from the file the test wrote (a rollout user reads the same from the run's KV bucket).

    python -m tests.chaos.attacker --config run.yaml --env run/auth/rollout.env --url nats://... --out attack.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import time
from collections import Counter, defaultdict, deque
from pathlib import Path
from typing import Any

import msgpack
import nats
import nats.errors
import yaml

from relax_bus.topology import Topology, build_topology
from schemas import DeadLetter, encode
from schemas.messages import SCHEMA_MAJOR
from workers.config import PipelineConfig, parse_config, task_seed, task_spec
from workers.data.tasks import load_task
from workers.launch.embedded import read_env_file
from workers.roles.feeder import group_for

ATTACKS = ("reset", "advisory", "amplification", "dead_letter", "heartbeat", "poison")
FLOOD_KEYS = 16
"""New heartbeat keys per round."""
FLOOD_VALUE_BYTES = 128 * 1024
"""Size of each flooded heartbeat value (below the server's 1 MiB payload limit, so the client is not cut off)."""
LETTERS_AHEAD = 16
"""Release indices past the feeder's cursor that get a forged dead letter before the feeder reaches them."""
LETTERS_PER_ROUND = 64
TAG = re.compile(r"atk-(\w+?)-\d+")
VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE)


class Attacker:
    """One connection with the stolen credentials, and the tallies of every attack."""

    def __init__(self, config: PipelineConfig, env: dict[str, str], url: str) -> None:
        self.config = config
        self.t: Topology = build_topology(config)
        self.env = env
        self.url = url
        self.nc: nats.NATS | None = None
        self.tried: Counter[str] = Counter()
        """Requests and publishes sent, by attack."""
        self.refused: Counter[str] = Counter()
        """Permissions violations the server reported, by attack."""
        self.api_refused: Counter[str] = Counter()
        """Consumer-create requests the server answered with an error."""
        self.accepted: Counter[str] = Counter()
        """Consumer-create requests that made a consumer, or publishes the stream stored."""
        self.errors: Counter[str] = Counter()
        """Publishes that failed otherwise (stream full, timeout, no connection), by attack."""
        self.samples: dict[str, list[str]] = defaultdict(list)
        """A few of the server's answers of each kind, to read in the summary."""
        self.rounds = 0
        self.first_round_at: float | None = None
        """When the first round ended (`time.time()`); the test compares it with the run's first step."""
        self.last_round_at: float | None = None
        self.forged_up_to = 0
        """Release indices below this have had a forged dead letter."""
        self.cursor_seen = 0
        self.items = load_task(task_spec(config.task))
        self.seed = task_seed(config.task)
        self.blob = os.urandom(FLOOD_VALUE_BYTES)
        self.started = time.time()
        self._n = 0
        self._unnamed: dict[str, deque[str]] = defaultdict(deque)
        """Attacks behind each consumer-create subject that names no consumer, oldest first: the server's
        refusals come back in the order the requests went out."""
        self._unnamed_by_name: dict[str, str] = {}

    # connection and tallies ----------------------------------------------------------------------------------

    async def connect(self, retry_for_s: float = 60.0) -> None:
        deadline = time.monotonic() + retry_for_s
        while True:
            try:
                self.nc = await nats.connect(
                    servers=[self.url],
                    user=self.env.get("RELAX_USER"),
                    password=self.env.get("RELAX_PASSWORD"),
                    inbox_prefix=self.env.get("RELAX_INBOX_PREFIX", "_INBOX"),
                    name="attacker",
                    error_cb=self._error,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    connect_timeout=3,
                )
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        inbox = self.env.get("RELAX_INBOX_PREFIX", "_INBOX")
        await self.nc.subscribe(f"{inbox}.atk.*", cb=self._answer)

    async def _error(self, err: Exception) -> None:
        m = VIOLATION.search(str(err))
        if m is None:
            self.errors["connection"] += 1
            self._sample("connection", str(err))
            return
        subject = m.group(2).lower()
        kind = self._unnamed[subject].popleft() if self._unnamed.get(subject) else _attack_of(subject)
        self.refused[kind] += 1
        self._sample(f"refused:{kind}", f"{m.group(1)} {m.group(2)}")

    async def _answer(self, msg: Any) -> None:
        """The server's answer to a consumer-create request (its reply subject names the attack)."""
        m = TAG.search(msg.subject)
        kind = m.group(1) if m else "other"
        if m and (subject := self._unnamed_by_name.pop(m.group(0), None)) and kind in self._unnamed[subject]:
            self._unnamed[subject].remove(kind)  # answered, so no refusal of it will come
        try:
            body = json.loads(msg.data)
        except ValueError:
            body = {}
        if isinstance(body, dict) and body.get("error"):
            self.api_refused[kind] += 1
            self._sample(f"api:{kind}", str(body["error"])[:200])
        else:
            self.accepted[kind] += 1
            self._sample(f"accepted:{kind}", msg.data[:300].decode(errors="replace"))

    def _sample(self, key: str, text: str) -> None:
        if len(self.samples[key]) < 3:
            self.samples[key].append(text)

    def summary(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "seconds": round(time.time() - self.started, 1),
            "first_round_at": self.first_round_at,
            "last_round_at": self.last_round_at,
            "tried": dict(self.tried),
            "refused": dict(self.refused),
            "api_refused": dict(self.api_refused),
            "accepted": dict(self.accepted),
            "errors": dict(self.errors),
            "forged_letters_up_to_index": self.forged_up_to,
            "feeder_cursor_seen": self.cursor_seen,
            "samples": dict(self.samples),
        }

    # the round ---------------------------------------------------------------------------------------------

    async def round(self) -> None:
        attacks = zip(
            ATTACKS,
            (self.reset, self.advisory, self.amplification, self.dead_letters, self.heartbeats, self.poison),
            strict=True,
        )
        for name, attack in attacks:
            try:
                await attack()
            except Exception as err:  # deliberate: a failed attack is tallied, the next one still goes out
                self.errors[name] += 1
                self._sample(f"error:{name}", f"{type(err).__name__}: {err}"[:200])
        assert self.nc is not None
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=5)
        self.rounds += 1
        self.last_round_at = time.time()
        self.first_round_at = self.first_round_at or self.last_round_at

    def _name(self, kind: str) -> str:
        self._n += 1
        return f"atk-{kind}-{self._n}"

    async def _create_push(self, kind: str, stream: str, deliver: str, filter_subject: str | None = None) -> None:
        """Ask for a push consumer on `stream` delivering to `deliver`: an ephemeral one (the API form that names
        no consumer, which ordered consumers use), a named one and a durable one."""
        assert self.nc is not None
        inbox = self.env.get("RELAX_INBOX_PREFIX", "_INBOX")
        for form in ("ephemeral", "named", "durable"):
            name = self._name(kind)
            config: dict[str, Any] = {"deliver_subject": deliver, "ack_policy": "none", "deliver_policy": "all"}
            if filter_subject:
                config["filter_subject"] = filter_subject
            if form == "ephemeral":
                subject = f"$JS.API.CONSUMER.CREATE.{stream}"
                self._unnamed[subject.lower()].append(kind)
                self._unnamed_by_name[name] = subject.lower()
            elif form == "named":
                subject, config["name"] = f"$JS.API.CONSUMER.CREATE.{stream}.{name}", name
            else:
                subject, config["durable_name"] = f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}", name
            body = json.dumps({"stream_name": stream, "config": config}).encode()
            await self.nc.publish(subject, body, reply=f"{inbox}.atk.{name}")
            self.tried[kind] += 1

    def _hops(self) -> list[tuple[str, str, str]]:
        """(stream, durable, subject) of every durable consumer of the run."""
        return [(self.t.stream(c.stream_key).name, c.durable, c.filter_subject) for c in self.t.consumers]

    def _all_streams(self) -> list[str]:
        return [
            *(s.name for s in self.t.streams),
            *(f"KV_{b.name}" for b in self.t.buckets),
            *(f"OBJ_{o.name}" for o in self.t.object_stores),
        ]

    async def _chunk(self, body: bytes) -> tuple[str, str]:
        """Write `body` as an object chunk into the media store (a rollout may); its stream and subject."""
        assert self.nc is not None
        media = self.t.object_store("media")
        subject = f"$O.{media}.C.atk{self._n}x{int(time.time() * 1000)}"
        self._n += 1
        try:
            await self.nc.jetstream().publish(subject, body, timeout=5)
            self.accepted["media_chunk"] += 1
        except Exception as err:  # tolerated: the consumer request below still goes out
            self.errors["media_chunk"] += 1
            self._sample("error:media_chunk", f"{type(err).__name__}: {err}"[:200])
        return f"OBJ_{media}", subject

    async def reset(self) -> None:
        """Skip past what each hop holds (its next sequence about the feeder's cursor: one message a group), and
        rewind it to the start (a replay)."""
        assert self.nc is not None
        self.cursor_seen = max(self.cursor_seen, await self._cursor())
        for body in (json.dumps({"seq": self.cursor_seen + 1}).encode(), b'{"seq": 1}'):
            stream_of_chunk, chunk = await self._chunk(body)
            for stream, durable, _ in self._hops():
                target = f"$JS.API.CONSUMER.RESET.{stream}.{durable}"
                await self._create_push("reset", stream_of_chunk, target, chunk)
                await self._create_push("reset", stream, target)
                await self.nc.publish(target, body)
                self.tried["reset"] += 1

    async def advisory(self) -> None:
        assert self.nc is not None
        for stream, durable, _ in self._hops():
            first = max(1, self.cursor_seen - 2)  # about the newest prompt: in flight (no role may read hop infos)
            body = json.dumps(
                {
                    "type": "io.nats.jetstream.advisory.v1.max_deliver",
                    "stream": stream,
                    "consumer": durable,
                    "stream_seq": first,
                    "deliveries": self.config.bus.max_deliver + 1,
                }
            ).encode()
            target = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}"
            stream_of_chunk, chunk = await self._chunk(body)
            await self._create_push("advisory", stream_of_chunk, target, chunk)
            await self.nc.publish(target, body)
            self.tried["advisory"] += 1

    async def amplification(self) -> None:
        sources = [f"KV_{b.name}" for b in self.t.buckets] + [self.t.stream(k).name for k in ("events", "dlq")]
        sources.append(f"OBJ_{self.t.object_store('media')}")
        for source in sources:
            for target in ("events", "dlq"):
                await self._create_push("amplification", source, self.t.subject(target))

    async def dead_letters(self) -> None:
        """Forge a letter for every release index up to a few past the feeder's cursor, each once: the
        feeder dedups by (index, group id), so a letter more for the same index is worth nothing."""
        assert self.nc is not None
        js = self.nc.jetstream()
        self.cursor_seen = max(self.cursor_seen, await self._cursor())
        end = min(self.cursor_seen + LETTERS_AHEAD, self.forged_up_to + LETTERS_PER_ROUND)
        prompts = self.t.subject("prompts")
        for index in range(self.forged_up_to, end):
            group = group_for(self.t.run, self.config.samples_per_group, self.items, index, 0, self.seed)
            letter = DeadLetter(
                run=self.t.run,
                reason="not settled after 5 deliveries (its worker crashed, hung or was stopped)",
                source_subject=prompts,
                stream_seq=10**9 + index,
                deliveries=self.config.bus.max_deliver,
                consumer="rollout",
                payload=encode(group),
            )
            headers = {"Relax-Kind": "dead_letter", "Relax-Schema": letter.schema_version}
            self.tried["dead_letter"] += 1
            try:
                await js.publish(self.t.subject("dlq"), encode(letter), headers=headers, timeout=5)
                self.accepted["dead_letter"] += 1
            except Exception as err:  # tolerated: tallied
                self.errors["dead_letter"] += 1
                self._sample("error:dead_letter", f"{type(err).__name__}: {err}"[:200])
        self.forged_up_to = max(self.forged_up_to, end)

    async def _cursor(self) -> int:
        """The feeder's cursor, read from the state bucket (every role may read it)."""
        assert self.nc is not None
        bucket = self.t.bucket("state")
        try:
            raw = await self.nc.jetstream().get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.feeder.cursor")
            return int(raw.data or b"0")
        except Exception:  # deliberate: no cursor yet, or a reply that is no number
            return 0

    async def heartbeats(self) -> None:
        assert self.nc is not None
        js = self.nc.jetstream()
        workers = self.t.bucket("workers")
        values = [self.blob] * FLOOD_KEYS
        lie = json.dumps(
            {
                "kind": "heartbeat",
                "schema_version": f"{SCHEMA_MAJOR}.0",
                "run": self.t.run,
                "role": "actor",
                "worker_id": "actor-0",
                "pid": 1,
                "host": "x",
                "counters": {},
                "started_at": 0.0,
            }
        ).encode()
        values.append(lie)
        for value in values:
            subject = f"$KV.{workers}.rollout.atk{self.rounds}x{self._n}"
            self._n += 1
            self.tried["heartbeat"] += 1
            try:
                await js.publish(subject, value, timeout=5)
                self.accepted["heartbeat"] += 1
            except Exception as err:  # tolerated: tallied
                self.errors["heartbeat"] += 1
                self._sample("error:heartbeat", f"{type(err).__name__}: {err}"[:200])

    async def poison(self) -> None:
        assert self.nc is not None
        js = self.nc.jetstream()
        run, version = self.t.run, f"{SCHEMA_MAJOR}.0"
        bodies = [
            b"\xff\x00not msgpack",
            msgpack.packb([1, 2, 3]),
            msgpack.packb(
                {
                    "kind": "metric",
                    "schema_version": version,
                    "run": run,
                    "step": 1,
                    "values": {"version": math.inf, "lag_1": 1e12, "reward_mean": math.nan},
                    "at": 0.0,
                }
            ),
            msgpack.packb(
                {
                    "kind": "metric",
                    "schema_version": version,
                    "run": run,
                    "step": 10**9,
                    "values": {"loss": 1.0},
                    "at": 1.0,
                }
            ),  # within bounds, without reward_mean
            msgpack.packb(
                {
                    "kind": "event",
                    "schema_version": version,
                    "run": run,
                    "event": "x" * 100_000,
                    "fields": {"version": math.inf},
                    "at": 0.0,
                }
            ),
            msgpack.packb({"kind": "event", "schema_version": "99.0", "run": run, "event": "warmup_done"}),
        ]
        for body in bodies:
            self.tried["poison"] += 1
            try:
                await js.publish(self.t.subject("events"), body, timeout=5)
                self.accepted["poison"] += 1
            except Exception as err:  # tolerated: tallied
                self.errors["poison"] += 1
                self._sample("error:poison", f"{type(err).__name__}: {err}"[:200])


def _attack_of(subject: str) -> str:
    """Which attack sent a refused publish, from its subject (nats-py reports it in lower case)."""
    subject = subject.lower()
    if m := TAG.search(subject):
        return m.group(1)
    if subject.startswith("$js.api.consumer.reset."):
        return "reset"
    if subject.startswith("$js.event.advisory."):
        return "advisory"
    if subject.startswith("$kv.") and ".rollout." in subject:
        return "heartbeat"
    return "other"


async def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--env", type=Path, required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--round-s", type=float, default=0.5)
    args = parser.parse_args()
    config = parse_config(yaml.safe_load(args.config.read_text()))
    attacker = Attacker(config, read_env_file(args.env), args.url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await attacker.connect()

    def write() -> None:
        part = args.out.with_suffix(".part")
        part.write_text(json.dumps(attacker.summary(), indent=1, sort_keys=True))
        part.replace(args.out)

    stopped = asyncio.create_task(stop.wait())
    while not stop.is_set():
        current = asyncio.create_task(attacker.round())
        await asyncio.wait({current, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not current.done():  # stopped mid-round (the run's server may be gone, each publish timing out)
            current.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await current
            break
        write()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(stopped), args.round_s)
    await asyncio.sleep(1.0)  # the last answers and violations
    write()
    assert attacker.nc is not None
    with contextlib.suppress(Exception):
        await asyncio.wait_for(attacker.nc.close(), 5)


if __name__ == "__main__":
    asyncio.run(main())
