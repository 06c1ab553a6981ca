"""The `broadcast` weight transport on a real nats-server and real gloo groups over the loopback: readers that joined
get each version by broadcast bit for bit, a reader that joins mid-run gets the current version from the object
store and the next ones by broadcast, a reader SIGKILLed inside a round costs that round only (the others read that
version from the store and get the next one by broadcast, with no restart), readers follow a restarted trainer to
its new rendezvous, and a bucket whose bytes differ from the digest its publisher sent is refused. (The contract
every transport keeps, broadcast included, is in test_weight_contract.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import workers.weights.broadcast as wb
from tests.waiting import until
from tests.workers.test_shm_weights import assert_exact, sample_state
from tests.workers.test_weight_contract import reader_script
from workers.weights import make_transport
from workers.weights.broadcast import BroadcastTransport, pack, unpack

pytestmark = pytest.mark.workers
ROOT = Path(__file__).resolve().parents[2]


def big_state(version: int) -> dict[str, torch.Tensor]:
    """Several buckets of 1 MiB: tensors packed together, one larger than a bucket, mixed dtypes."""
    gen = torch.Generator().manual_seed(100 + version)
    return {
        **sample_state(version),
        "big": torch.randn(3 << 18, generator=gen),  # 3 MiB: a bucket of its own
        "mid.a": torch.randn(100_000, generator=gen),
        "mid.b": torch.randn(100_000, generator=gen).to(torch.bfloat16),
        "mid.c": torch.randint(0, 1 << 30, (50_000,), generator=gen),
    }


async def make_run(make_bus, **weights):
    bus = await make_bus(weights={"type": "broadcast", "bucket_mb": 1, "timeout_s": 5, **weights})
    publisher = make_transport(bus)
    assert isinstance(publisher, BroadcastTransport)
    for version in (0, 1):
        await publisher.publish(version, sample_state(version), step=version)
    return bus, publisher


async def join(publisher: BroadcastTransport, *readers: BroadcastTransport) -> None:
    """Each reader fetches v0 (from the store, without joining), then v1 (from the store, joining); then wait until
    the publisher counts them all as live."""
    for reader in readers:
        assert_exact(await reader.read(0), sample_state(0))
        assert reader.receiver is None
        assert_exact(await reader.read(1), sample_state(1))
        assert reader.received == 0
    await members(publisher, len(readers))


async def members(publisher: BroadcastTransport, n: int, timeout_s: float = 60) -> None:
    sender = publisher.sender
    assert sender is not None
    await until(lambda: len(sender.live_members()), lambda got: got == n, timeout_s, f"{n} live members")


async def test_readers_that_joined_get_every_version_by_broadcast_bit_for_bit(make_bus):
    bus, publisher = await make_run(make_bus)
    readers = [make_transport(bus) for _ in range(2)]
    await join(publisher, *readers)
    for version in (2, 3):
        await publisher.publish(version, big_state(version), step=version)
        for reader in readers:
            assert_exact(await reader.read(version), big_state(version))
    assert [r.received for r in readers] == [2, 2]  # neither touched the object store after joining


async def test_a_reader_joining_mid_run_gets_the_current_version_then_broadcasts(make_bus):
    bus, publisher = await make_run(make_bus)
    first = make_transport(bus)
    await join(publisher, first)
    await publisher.publish(2, big_state(2), step=2)
    assert_exact(await first.read(2), big_state(2))
    late = make_transport(bus)
    assert_exact(await late.read(2), big_state(2))  # the current version, from the object store
    assert late.received == 0
    await members(publisher, 2)
    await publisher.publish(3, big_state(3), step=3)
    for reader in (first, late):
        assert_exact(await reader.read(3), big_state(3))
    assert (first.received, late.received) == (2, 1)


async def test_a_reader_killed_inside_a_round_costs_that_round_only(make_bus, nats_server):
    bus, publisher = await make_run(make_bus, timeout_s=3)
    survivor = make_transport(bus)
    await join(publisher, survivor)
    child = subprocess.Popen(
        [sys.executable, "-c", reader_script(nats_server.url, bus.run, 1, repeat=False)],  # joins on v1
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        await members(publisher, 2, timeout_s=120)
        sender = publisher.sender
        rounds_before = sender.round
        task = asyncio.ensure_future(publisher.publish(2, big_state(2), step=2))
        await until(lambda: sender.round, lambda r: r > rounds_before, what="the round of v2 posted")
        os.kill(child.pid, signal.SIGKILL)  # inside the round: forming its group or receiving its buckets
        await task
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert_exact(await survivor.read(2), big_state(2))  # by broadcast if it finished first, else from the store
    await members(publisher, 1)  # the dead reader left out
    received = survivor.received
    await publisher.publish(3, big_state(3), step=3)
    assert_exact(await survivor.read(3), big_state(3))
    assert survivor.received == received + 1  # the next round reached the survivor by broadcast again


async def test_readers_follow_a_new_publisher_after_the_trainer_restarts(make_bus):
    bus, publisher = await make_run(make_bus)
    reader = make_transport(bus)
    await join(publisher, reader)
    await publisher.publish(2, big_state(2), step=2)
    assert_exact(await reader.read(2), big_state(2))
    publisher.close()  # the trainer is gone, and its rendezvous store with it
    restarted = make_transport(bus)
    await restarted.publish(3, big_state(3), step=3)  # a new store, named in the KV; nobody has joined it yet
    assert_exact(await reader.read(3), big_state(3))  # from the object store: the reader joins the new store
    await members(restarted, 1)
    await restarted.publish(4, big_state(4), step=4)
    assert_exact(await reader.read(4), big_state(4))
    assert reader.received == 2  # v2 from the first trainer, v4 from the second


async def test_a_bucket_that_differs_from_its_published_digest_is_refused(make_bus, monkeypatch):
    bus, publisher = await make_run(make_bus, verify=True)
    reader = make_transport(bus)
    await join(publisher, reader)
    real = wb.sha256

    def receiver_sees_other_bytes(buf: torch.Tensor) -> str:
        digest = real(buf)
        return digest[::-1] if threading.current_thread().name == "weights-broadcast" else digest

    monkeypatch.setattr(wb, "sha256", receiver_sees_other_bytes)
    await publisher.publish(2, big_state(2), step=2)
    assert_exact(await reader.read(2), big_state(2))  # refused by broadcast: the object store's copy
    assert reader.received == 0
    monkeypatch.setattr(wb, "sha256", real)
    await publisher.publish(3, big_state(3), step=3)
    assert_exact(await reader.read(3), big_state(3))
    assert reader.received == 1  # a refused bucket fails that round only


def test_buckets_pack_and_unpack_every_dtype_and_shape():
    state = big_state(3)
    layout = pack(state, 1 << 20)
    assert len(layout) >= 2 and any(len(b) > 1 for b in layout)
    got: dict[str, torch.Tensor] = {}
    for bucket in layout:
        assert all(spec["offset"] % 64 == 0 for spec in bucket)
        got.update(unpack(bucket, wb.fill(bucket, state).clone()))
    assert_exact(got, state)
