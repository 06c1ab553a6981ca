"""The contract every registered weight transport keeps, run against each one on a real nats-server (the control
plane; the bytes go where the transport puts them): a version comes back bit for bit (also when a reader said it
expected it before it was published), a version never published or
already reclaimed is a clear one-line BlobNotFound, bytes that differ from what was published are refused, readers
may fetch at once, a reader SIGKILLed mid-fetch leaves nothing that stops the next publish or fetch, v0 and the
newest `bus.weights_keep` versions stay, and a publisher killed mid-write leaves nothing behind its next publish."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_bus.errors import BlobCorrupt, BlobNotFound
from tests.workers.test_shm_weights import assert_exact, sample_state
from workers.weights import TRANSPORTS, SharedMemoryTransport, WeightTransport, make_transport
from workers.weights.serialization import read_header

pytestmark = pytest.mark.workers
ROOT = Path(__file__).resolve().parents[2]
KINDS = sorted(TRANSPORTS)


def weights_config(kind: str, tmp_path: Path) -> dict[str, Any]:
    if kind == "filesystem":
        return {"type": "filesystem", "root": str(tmp_path / "shared")}
    if kind == "shm":
        return {"type": "shm", "verify": True}  # the check is opt-in on shm (it costs a pass over the segment)
    if kind == "broadcast":  # a reader killed mid-round costs that round this long
        return {"type": "broadcast", "timeout_s": 3}
    return {"type": kind}


@pytest.fixture(params=KINDS)
async def case(request, make_bus, tmp_path) -> AsyncIterator[tuple[str, Any, WeightTransport]]:
    """(kind, bus, transport) for a fresh run whose weights go through transport `kind`, keeping v0 and the newest 2."""
    bus = await make_bus(weights=weights_config(request.param, tmp_path), bus={"weights_keep": 2})
    transport = make_transport(bus)
    yield request.param, bus, transport
    if isinstance(transport, SharedMemoryTransport):
        transport.remove_run()


def reader_script(settings_url: str, run: str, version: int, repeat: bool = True) -> str:
    """A child that attaches to the run and fetches `version` until killed, printing `fetching` before each; with
    `repeat` off, it fetches once, prints `fetched` and waits (a broadcast reader then takes part in every round)."""
    fetches = (
        f"while True:\n        print('fetching', flush=True)\n        await transport.read({version})"
        if repeat
        else f"await transport.read({version})\n    print('fetched', flush=True)\n    await asyncio.Event().wait()"
    )
    return textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(ROOT)!r})
        from relax_bus.bus import Bus
        from relax_bus.connection import connect
        from relax_bus.settings import ConnectionSettings
        from workers.config import PipelineConfig
        from workers.weights import make_transport
        """
    ) + (
        "\nasync def main():\n"
        f"    nc = await connect(ConnectionSettings(nats_url=[{settings_url!r}]), name='reader')\n"
        f"    transport = make_transport(await Bus.attach(nc, {run!r}, PipelineConfig))\n"
        f"    {fetches}\n\nasyncio.run(main())\n"
    )


async def test_a_published_version_comes_back_bit_for_bit(case):
    _, _, transport = case
    for version in (0, 1):
        announcement = await transport.publish(version, sample_state(version), step=version)
        assert announcement.version == version and announcement.size > 0
    assert_exact(await transport.read(0), sample_state(0))
    assert_exact(await transport.read(1), sample_state(1))


async def test_a_version_expected_ahead_comes_back_bit_for_bit_and_a_wrong_guess_costs_nothing(case):
    _, _, transport = case
    await transport.expect(1)  # the hint a rollout worker gives before the version exists
    await transport.publish(0, sample_state(0), step=0)
    await transport.publish(1, sample_state(1), step=1)
    assert_exact(await transport.read(1), sample_state(1))
    await transport.expect(5)  # never published: the fetch of another version is not held up
    assert_exact(await asyncio.wait_for(transport.read(0), 30), sample_state(0))


async def test_a_version_never_published_is_a_one_line_blob_not_found(case):
    _, _, transport = case
    await transport.publish(0, sample_state(0), step=0)
    with pytest.raises(BlobNotFound) as caught:
        await transport.read(7)
    message = str(caught.value)
    assert "\n" not in message and "v7" in message, message


async def test_bytes_that_differ_from_what_was_published_are_refused(case):
    kind, bus, transport = case
    announcement = await transport.publish(3, sample_state(3), step=3)
    if kind in ("object_store", "broadcast"):  # the object's record names a digest its chunks do not have
        # (a broadcast reader gets the version from the store unless it received it: its own check is in
        # test_broadcast_weights.py)
        data = await bus.weights.get("v3")
        await bus.weights.put("v3", data, sha256=hashlib.sha256(b"other bytes").digest())
    else:  # one byte of the data section flipped in place
        path = Path(announcement.location)
        raw = bytearray(path.read_bytes())
        raw[read_header(raw)[1] + 5] ^= 0xFF
        path.write_bytes(raw)
    with pytest.raises(BlobCorrupt):
        await transport.read(3)


async def test_readers_fetch_the_same_version_at_once(case):
    _, _, transport = case
    state = {"w": torch.randn(256, 1024), "b": torch.arange(4096, dtype=torch.int64)}
    await transport.publish(1, state, step=1)
    fetched = await asyncio.gather(*(transport.read(1) for _ in range(4)))
    for got in fetched:
        assert_exact(got, state)


async def test_a_reader_killed_mid_fetch_leaves_nothing_that_blocks_the_next_publish_or_fetch(case, nats_server):
    _, bus, transport = case
    big = {"w": torch.randn(8 << 20)}  # 32 MB: a fetch takes long enough to be killed inside it
    await transport.publish(1, big, step=1)
    child = subprocess.Popen(
        [sys.executable, "-c", reader_script(nats_server.url, bus.run, 1)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert child.stdout is not None
        seen = 0
        while seen < 2:  # the second `fetching` line: the child is past one whole fetch and inside another
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), timeout=120)
            assert line, f"the reader ended: {child.stderr.read()[-2000:]}"
            seen += line.strip() == "fetching"  # (its log lines come on stdout too)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    for version in (2, 3, 4):  # reclaiming v1 (the killed reader's) included
        await transport.publish(version, sample_state(version), step=version)
    assert_exact(await transport.read(4), sample_state(4))
    with pytest.raises(BlobNotFound):
        await transport.read(1)


async def test_v0_and_the_newest_versions_are_kept_and_the_others_reclaimed(case):
    _, _, transport = case
    for version in range(6):
        await transport.publish(version, sample_state(version), step=version)
    for version in (0, 4, 5):
        assert_exact(await transport.read(version), sample_state(version))
    for version in (1, 2, 3):
        with pytest.raises(BlobNotFound):
            await transport.read(version)


@pytest.mark.parametrize("kind", ["filesystem", "shm"])
async def test_temp_files_of_a_publisher_killed_mid_write_are_gone_after_the_next_publish(kind, make_bus, tmp_path):
    """The object store's counterpart (chunks of a cut-off upload) is cleared by the actor at start-up:
    tests/bus/test_publish.py -k cut_off and tests/chaos/test_checkpoint_kill.py."""
    bus = await make_bus(weights=weights_config(kind, tmp_path), bus={"weights_keep": 2})
    transport = make_transport(bus)
    try:
        await transport.publish(0, sample_state(0), step=0)
        folder = Path((await transport.publish(1, sample_state(1), step=1)).location).parent
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        host = os.uname().nodename
        left = [
            folder / f".v9.safetensors.tmp-{host}-{int(dead.stdout)}",  # a process of this host that is gone
            folder / f".v2.safetensors.tmp-otherhost-{os.getpid()}",  # a version the next publish passes
        ]
        live = folder / f".v9.safetensors.tmp-otherhost-{os.getpid()}"  # another host's, of a version still ahead
        for path in [*left, live]:
            path.write_bytes(b"half written")
        await transport.publish(2, sample_state(2), step=2)
        assert not any(path.exists() for path in left)
        assert live.exists()
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
            "v0.safetensors",
            "v1.safetensors",
            "v2.safetensors",
        ]
    finally:
        if isinstance(transport, SharedMemoryTransport):
            transport.remove_run()
