"""Chaos by a stolen credential: a `relax run` (secured by default) beside an attacker process that holds the
rollout user's credentials (`<run dir>/auth/rollout.env`) and, for the whole run, tries consumer resets by
delivery, forged reaper advisories, amplification loops between the KV buckets, events and dlq, forged dead
letters the feeder would credit, heartbeat floods and poison events (`tests/chaos/attacker.py`).

The run completes (exit 0, no role restarted, no traceback), every released group is trained once or dropped
with a reason (a dead letter a role really wrote, as its log shows, counts as one), the feeder released no
more than its budget, `steps x groups_per_step` plus the groups dropped as stale (the actor's `groups.dropped`)
plus those a role really dead-lettered: the forged letters add nothing. And the attacker really attacked:
every attack was sent, the server refused what the rollout may not do, and no consumer was made for it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from relax_bus.bus import Bus
from relax_bus.connection import connect
from relax_bus.envelope import open_message
from relax_bus.topology import build_topology
from schemas import GROUP_MESSAGES, DeadLetter, Message, SchemaError
from tests.chaos.attacker import ATTACKS
from tests.chaos.test_relax_run import ROOT, RelaxRun
from tests.e2e.cluster import Accounting, Cluster
from tests.waiting import until
from workers.config import PipelineConfig
from workers.launch.embedded import serve_run_dir
from workers.launch.processes import RunProcesses
from workers.state_keys import FEEDER_CURSOR, GROUPS_DROPPED

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

STEPS = 200
"""About 15 s of training on two cores, the attacker at it all along; start-up and the check take a minute."""
CONSUMER_ATTACKS = ("reset", "advisory", "amplification")
"""Attacks that need a consumer the rollout may not make, or a subject it may not publish to."""


@dataclass
class Settled:
    """Where the run's released groups went, as its store and its roles' logs tell."""

    acc: Accounting
    released: int
    stale: int
    """Groups the actor dropped as stale (`groups.dropped`, written by the actor alone)."""
    dead_lettered: list[str]
    """Groups a role really dead-lettered: letters whose (subject, sequence) a role's log names."""
    letters: int
    """Every dead letter stored, forged ones included."""
    undecodable: int
    """Events that are no message (the attacker's poison)."""
    letters_seen: int
    """Release indices below the final cursor that the feeder took a dead letter for (`dead_letter_seen` in its
    log): the most its dead-letter credit can have reached."""


async def test_an_attacker_with_the_rollout_credentials_for_the_whole_run(tmp_path):
    run = RelaxRun(tmp_path, trainer={"steps": STEPS, "checkpoint": {"every": 50}, "warmup": {"max_steps": 0}})
    out = tmp_path / "attack.json"
    attacker: subprocess.Popen[bytes] | None = None
    try:
        await run.wait_line("NATS ", 0, timeout_s=120)
        url = next(line for line in run.lines if " NATS " in line).split(" NATS ", 1)[1].split()[0]
        env = run.run_dir / "auth" / "rollout.env"
        await until(env.is_file, bool, 30, f"{env} written")
        with open(tmp_path / "attacker.log", "wb") as log:
            command = ["-m", "tests.chaos.attacker", "--config", str(tmp_path / "run.yaml"), "--env", str(env)]
            attacker = subprocess.Popen(
                [sys.executable, *command, "--url", url, "--out", str(out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        code = run.wait_exit(timeout_s=480)
    finally:
        if attacker is not None:
            _stop(attacker)
        run.stop()
    assert out.is_file(), (tmp_path / "attacker.log").read_text()
    attack = json.loads(out.read_text())
    settled = await _settle(run, tmp_path)
    summary = json.loads((run.run_dir / "summary.json").read_text()) if code == 0 else {}
    print(_figures(run, attack, settled, summary))

    assert code == 0, run.output
    assert "Traceback" not in run.output, run.output
    assert summary["steps"] == STEPS, summary
    assert summary["restarts"] == {} and "restarted" not in run.output, run.output

    steps_at = [json.loads(line)["at"] for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert attack["first_round_at"] < min(steps_at) and attack["last_round_at"] > max(steps_at), (
        f"the attacker did not attack through the whole run: rounds {attack['first_round_at']}..."
        f"{attack['last_round_at']}, steps {min(steps_at)}..{max(steps_at)}"
    )
    for kind in ATTACKS:
        assert attack["tried"].get(kind, 0) > 0, f"the attacker never tried {kind}: {attack}"
    for kind in CONSUMER_ATTACKS:
        assert attack["refused"].get(kind, 0) > 0, f"nothing refused of {kind}: {attack}"
        assert attack["accepted"].get(kind, 0) == 0, f"a consumer made for the attacker ({kind}): {attack}"
    assert attack["accepted"].get("dead_letter", 0) > 0, f"no forged dead letter stored: {attack}"

    # The feeder's own bound at the run's end (workers.roles.feeder): its read-ahead, (max_staleness + 1) x
    # groups_per_step, only bounds releases ahead of the trainer, and the trainer has reached the last step.
    config = run.config
    budget = config.trainer.steps * config.groups_per_step + settled.stale + len(set(settled.dead_lettered))
    assert settled.released <= budget, (
        f"the feeder released {settled.released} groups, its budget is {budget} "
        f"(the feeder took dead letters for {settled.letters_seen} released indices, {len(settled.dead_lettered)} "
        "of them real)"
    )
    settled.acc.check_exactly_once(config.trainer.steps, config.groups_per_step)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM by its PID (it writes its summary and exits), SIGKILL if it does not."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _settle(run: RelaxRun, tmp_path: Path) -> Settled:
    """Serve the ended run's store again and read where every released group went; messages that do not
    decode (poison) are counted and passed over."""
    config = run.config
    server, settings = serve_run_dir(run.run_dir)
    with server:
        nc = await connect(settings, name="after")
        bus = await Bus.attach(nc, config.run, PipelineConfig)
        unstarted = RunProcesses(config, server.url, tmp_path / "w", tmp_path / "l")
        record = Cluster(server.url, config, tmp_path, unstarted, bus)
        try:
            events, undecodable = await _decodable(bus, "events")
            train, _ = await _decodable(bus, "train")
            letters, _ = await _decodable(bus, "dlq")
            released = await record.kv_int(FEEDER_CURSOR)
            stale = await record.kv_int(GROUPS_DROPPED)
            acc = Accounting.from_events(events, released, train, record.released_ids(released))
            real = _logged_dead_letters(run)
            dead = []
            for letter in letters:
                assert isinstance(letter, DeadLetter) and letter.reason, f"a dead letter without a reason: {letter}"
                if (letter.source_subject, letter.stream_seq) in real:
                    group = await open_message(letter.payload, letter.headers, bus.media)
                    if isinstance(group, GROUP_MESSAGES):
                        dead.append(group.prompt.group_id)
            acc.dropped.extend(dead)  # dropped with the letter's reason
        finally:
            await nc.close()
    seen = _log_events(run.run_dir / "logs", "feeder", "dead_letter_seen")
    letters_seen = len({r["release_index"] for r in seen if int(r["release_index"]) < released})  # type: ignore[call-overload]
    return Settled(acc, released, stale, dead, len(letters), undecodable, letters_seen)


async def _decodable(bus: Bus, key: str) -> tuple[list[Message], int]:
    """Every message still in one of the run's streams that decodes, and how many did not."""
    stream = bus.topology.stream(key).name
    st = (await bus.js.stream_info(stream)).state
    out, bad = [], 0
    for seq in range(st.first_seq, st.last_seq + 1) if st.messages else ():
        raw = await bus.js.get_msg(stream, seq)
        try:
            out.append(await open_message(raw.data or b"", raw.headers, bus.media))
        except SchemaError:
            bad += 1
    return out, bad


def _log_events(logs: Path, role: str, name: str) -> list[dict[str, object]]:
    """The JSON log records called `name` of every process of `role`."""
    found = []
    for path in sorted(logs.glob(f"{role}-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == name:
                found.append(record)
    return found


def _logged_dead_letters(run: RelaxRun) -> set[tuple[str, int]]:
    """(subject, stream sequence) of every message a role dead-lettered, from the roles' own logs: the settle
    path names the subject, the reaper its role (whose input hop it reaps)."""
    topology = build_topology(run.config)
    real = set()
    for role in topology.roles:
        for record in _log_events(run.run_dir / "logs", role.name, "message_dead_lettered"):
            subject = record.get("subject") or (topology.subject(role.input) if role.input else None)
            real.add((str(subject), int(record["seq"])))  # type: ignore[call-overload]
    return real


def _figures(run: RelaxRun, attack: dict[str, object], settled: Settled, summary: dict[str, object]) -> str:
    acc, config = settled.acc, run.config
    trained = acc.trained
    lost = set(acc.released_ids) - set(trained) - set(acc.dropped) - set(acc.filtered)
    target = config.trainer.steps * config.groups_per_step
    return (
        f"attacker: {attack['rounds']} rounds in {attack['seconds']}s; tried {attack['tried']}; "
        f"refused {attack['refused']}; api refused {attack['api_refused']}; accepted {attack['accepted']}; "
        f"errors {attack['errors']}; letters forged for indices < {attack['forged_letters_up_to_index']}\n"
        f"run: exit summary {summary}\n"
        f"released {settled.released} (target {target}, stale drops {settled.stale}, real dead letters "
        f"{len(settled.dead_lettered)}); trained {len(trained)} ({len(set(trained))} distinct); dropped "
        f"{len(set(acc.dropped))}; filtered {len(acc.filtered)}; lost {len(lost)}; dlq {settled.letters} letters; "
        f"letters the feeder took for released indices {settled.letters_seen}; undecodable events {settled.undecodable}"
    )
