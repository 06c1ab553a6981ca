"""`relax inspect RUN`: what a run looks like on the server, for people (`render`) and scripts (`gather`)."""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from relax_bus.heartbeat import live_workers
from relax_bus.kv_keys import kv_keys
from relax_bus.provision import CONFIG_KEY, read_config, state_kv
from relax_bus.staleness import POLICY_VERSION
from relax_bus.topology import build_topology, env_subjects
from schemas import DeadLetter, decode

DLQ_SAMPLE = 200
ENV_STATS_WAIT_S = 0.5
"""How long `relax inspect` collects the environment servers' replies to `$SRV.STATS`."""


async def env_instances(nc: NATS, run: str, wait_s: float = ENV_STATS_WAIT_S) -> list[dict[str, Any]]:
    """The run's environment server instances as their `$SRV.STATS` replies say within `wait_s`: instance,
    environment, service id, and per endpoint its requests, errors and average latency. Another run's servers (a server
    shared without per-run accounts) and replies that are not stats are left out."""
    subjects = env_subjects(run)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found = []
    try:
        await nc.publish(subjects.stats, b"", reply=inbox)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except (TimeoutError, nats.errors.TimeoutError):
                break
            try:
                stats = json.loads(msg.data)
                meta = stats.get("metadata") or {}
                if meta.get("run") != run:
                    continue
                endpoints = {
                    e["name"]: {
                        "requests": int(e["num_requests"]),
                        "errors": int(e["num_errors"]),
                        "average_ms": round(int(e["average_processing_time"]) / 1e6, 3),
                        "last_error": e.get("last_error") or "",
                    }
                    for e in stats.get("endpoints") or []
                }
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # tolerated: a reply that is not a service's stats says nothing about the run
            found.append(
                {
                    "instance": meta.get("instance", ""),
                    "environment": meta.get("environment", ""),
                    "id": stats.get("id", ""),
                    "name": stats.get("name", ""),
                    "endpoints": endpoints,
                }
            )
    finally:
        await sub.unsubscribe()
    return sorted(found, key=lambda i: str(i["instance"]))


async def gather(js: JetStreamContext, run: str, nc: NATS | None = None) -> dict[str, Any]:
    """Collect streams, consumers, KV state, live workers, stores and a dead-letter summary; with `nc`, the
    environment servers' figures too (`env_instances`)."""
    config = await read_config(js, run)
    assert config is not None
    t = build_topology(config)
    state = await state_kv(js, run)
    stored = json.loads((await state.get(CONFIG_KEY)).value or b"{}")
    streams = []
    for s in t.streams:
        try:
            info = await js.stream_info(s.name)
            streams.append(
                {
                    "key": s.key,
                    "name": s.name,
                    "subject": s.subject,
                    "retention": s.retention,
                    "messages": info.state.messages,
                    "bytes": info.state.bytes,
                    "first_seq": info.state.first_seq,
                    "last_seq": info.state.last_seq,
                    "max_msgs": s.max_msgs,
                }
            )
        except nats.js.errors.NotFoundError:
            streams.append({"key": s.key, "name": s.name, "subject": s.subject, "missing": True})
    consumers = []
    for c in t.consumers:
        stream = t.stream(c.stream_key).name
        try:
            ci = await js.consumer_info(stream, c.durable)
            consumers.append(
                {
                    "stream": stream,
                    "durable": c.durable,
                    "pending": ci.num_pending,
                    "ack_pending": ci.num_ack_pending,
                    "redelivered": ci.num_redelivered,
                    "waiting": ci.num_waiting,
                    "delivered": ci.delivered.stream_seq if ci.delivered else 0,
                    "ack_floor": ci.ack_floor.stream_seq if ci.ack_floor else 0,
                }
            )
        except nats.js.errors.NotFoundError:
            consumers.append({"stream": stream, "durable": c.durable, "missing": True})
    kv: dict[str, str] = {}
    for key in await kv_keys(state):
        if key != CONFIG_KEY:
            try:
                kv[key] = (await state.get(key)).value.decode(errors="replace")  # type: ignore[union-attr]
            except nats.js.errors.KeyNotFoundError:
                pass  # deleted or expired: its marker is all that is left
    workers = [w.model_dump(mode="json") for w in await live_workers(await js.key_value(t.bucket("workers")))]
    now = time.time()
    for w in workers:
        w["seen_s_ago"] = round(now - w["at"], 1)
    stores = []
    for o in t.object_stores:
        try:
            info = await js.stream_info(f"OBJ_{o.name}")
            stores.append({"key": o.key, "name": o.name, "bytes": info.state.bytes})
        except nats.js.errors.NotFoundError:
            stores.append({"key": o.key, "name": o.name, "missing": True})
    return {
        "run": run,
        "config": stored,  # as `relax init` stored it: the pipeline's sections too
        "policy_version": int(kv.get(POLICY_VERSION, "0")),
        "streams": streams,
        "consumers": consumers,
        "state": kv,
        "workers": workers,
        "object_stores": stores,
        "dlq": await _dlq_summary(js, t.stream("dlq").name),
        "environments": await env_instances(nc, run) if nc is not None else [],
    }


async def _dlq_summary(js: JetStreamContext, stream: str) -> dict[str, Any]:
    try:
        st = (await js.stream_info(stream)).state
    except nats.js.errors.NotFoundError:
        return {"count": 0, "reasons": [], "recent": []}
    reasons: collections.Counter[str] = collections.Counter()
    recent = []
    first = max(st.first_seq, st.last_seq - DLQ_SAMPLE + 1)
    for seq in range(first, st.last_seq + 1) if st.messages else ():
        try:
            raw = await js.get_msg(stream, seq)
            letter = decode(raw.data or b"", DeadLetter)
        except Exception:  # tolerated: a gap (deleted message) or a foreign payload in the dlq
            continue
        reasons[_reason_class(letter.reason)] += 1
        recent.append(
            {
                "seq": seq,
                "source": letter.source_subject,
                "source_seq": letter.stream_seq,
                "deliveries": letter.deliveries,
                "reason": letter.reason,
            }
        )
    return {
        "count": st.messages,
        "reasons": [{"reason": r, "count": n} for r, n in reasons.most_common(10)],
        "recent": recent[-5:],
    }


def _env_section(instances: list[dict[str, Any]]) -> list[str]:
    out = ["", f"environment servers ({len(instances)})"]
    if not instances:
        return [*out, "  (none answered $SRV.STATS)"]
    rows = [["instance", "environment", "service id", "resets", "steps", "errors", "avg step"]]
    for i in instances:
        ends = i["endpoints"]
        step = ends.get("step", {})
        rows.append(
            [
                i["instance"],
                i["environment"],
                i["id"],
                str(ends.get("reset", {}).get("requests", 0)),
                str(step.get("requests", 0)),
                str(sum(e["errors"] for e in ends.values())),
                f"{step.get('average_ms', 0):.1f} ms",
            ]
        )
    return out + _table(rows)


def _reason_class(reason: str) -> str:
    return reason.split(":", 1)[0][:80]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def render(info: dict[str, Any]) -> str:
    """A person's view of `gather`'s result."""
    cfg = info["config"]
    stal = cfg["staleness"]["max_staleness"]
    out = [
        f"run {info['run']}   policy version {info['policy_version']}   "
        f"max_staleness {'unbounded' if stal is None else stal}   groups/step {cfg['groups_per_step']}   "
        f"samples/group {cfg['samples_per_group']}",
        "",
        "streams",
    ]
    rows = [["subject", "stream", "retention", "messages", "bytes"]]
    for s in info["streams"]:
        if s.get("missing"):
            rows.append([s["subject"], s["name"], "MISSING", "-", "-"])
        else:
            rows.append([s["subject"], s["name"], s["retention"], str(s["messages"]), _size(s["bytes"])])
    out += _table(rows)
    out += ["", "consumers"]
    rows = [["stream", "durable", "pending", "ack-pending", "redelivered", "ack floor"]]
    for c in info["consumers"]:
        if c.get("missing"):
            rows.append([c["stream"], c["durable"], "MISSING", "-", "-", "-"])
        else:
            rows.append(
                [
                    c["stream"],
                    c["durable"],
                    str(c["pending"]),
                    str(c["ack_pending"]),
                    str(c["redelivered"]),
                    str(c["ack_floor"]),
                ]
            )
    out += _table(rows)
    out += ["", "state (KV)"]
    out += [f"  {k} = {v}" for k, v in info["state"].items()] or ["  (empty)"]
    out += ["", f"live workers ({len(info['workers'])})"]
    if info["workers"]:
        rows = [["role", "worker", "pid", "version", "processed", "failed", "seen"]]
        for w in info["workers"]:
            ctr = w.get("counters", {})
            v = w.get("policy_version")
            rows.append(
                [
                    w["role"],
                    w["worker_id"],
                    str(w["pid"]),
                    "-" if v is None else str(v),
                    str(ctr.get("processed", 0)),
                    str(ctr.get("failed", 0)),
                    f"{w['seen_s_ago']}s ago",
                ]
            )
        out += _table(rows)
    else:
        out.append("  (none)")
    out += ["", "object stores"]
    out += [
        f"  {o['key']:8} {o['name']}  {'MISSING' if o.get('missing') else _size(o['bytes'])}"
        for o in info["object_stores"]
    ]
    if info.get("environments") or cfg.get("agent"):
        out += _env_section(info.get("environments", []))
    dlq = info["dlq"]
    out += ["", f"dead letters: {dlq['count']}"]
    out += [f"  {r['count']:5}  {r['reason']}" for r in dlq["reasons"]]
    if dlq["recent"]:
        out.append("  most recent:")
        out += [
            f"    #{r['seq']} from {r['source']}#{r['source_seq']} after {r['deliveries']} deliveries: {r['reason']}"
            for r in dlq["recent"]
        ]
    return "\n".join(out)
