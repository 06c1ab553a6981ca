"""The shared-memory weight transport: exact round trips of every common dtype as views into a
segment, retention of v0 and the newest `keep`, clear errors for a version that is gone or a host
without the segments, a fetch from another process, and no segment left behind by a test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax_bus.errors import BlobNotFound
from workers.weights import SharedMemoryTransport, make_transport

pytestmark = pytest.mark.workers
ROOT = Path(__file__).resolve().parents[2]


def sample_state(version: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes, one non-contiguous, one empty, one scalar."""
    gen = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(17, 8, generator=gen),
        "layer.w_bf16": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "layer.ids": torch.arange(11, dtype=torch.int64) * (version + 1),
        "layer.mask": torch.rand(9, generator=gen) > 0.5,
        "layer.half": torch.randn(3, generator=gen).to(torch.float16),
        "layer.transposed": torch.randn(4, 6, generator=gen).t(),
        "layer.empty": torch.empty(0, 2),
        "scale": torch.tensor(float(version)),
    }


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.fixture
def shm() -> Iterator[SharedMemoryTransport]:
    """A transport on /dev/shm for a fresh run; the test's segments are removed afterwards."""
    transport = SharedMemoryTransport(f"t{uuid.uuid4().hex[:10]}", keep=2)
    yield transport
    transport.remove_run()
    assert not transport.dir.exists()


async def test_a_state_dict_of_several_dtypes_comes_back_exact_as_views(shm):
    state = sample_state()
    announcement = await shm.publish(0, state, step=0)
    assert announcement.transport == "shm" and announcement.location == str(shm.dir / "v0.safetensors")
    assert announcement.size == os.path.getsize(announcement.location)
    fetched = await shm.read(0)
    assert_exact(fetched, state)
    assert_exact(load_file(announcement.location), state)  # a valid safetensors file, too
    fetched["embed.weight"].add_(1.0)  # a write into a view stays in this process
    assert_exact(await shm.read(0), state)


async def test_the_segment_and_its_folder_are_private_to_the_uid(shm):
    await shm.publish(0, sample_state(), step=0)
    assert (shm.dir.stat().st_mode & 0o777, shm.dir.parent.stat().st_mode & 0o777) == (0o700, 0o700)
    assert (shm.dir / "v0.safetensors").stat().st_mode & 0o777 == 0o600
    assert shm.dir.stat().st_uid == os.getuid()


async def test_a_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / f"relax-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    transport = SharedMemoryTransport("r1", keep=1, root=tmp_path)
    with pytest.raises(PermissionError, match="only it can write"):
        await transport.publish(0, sample_state(), step=0)
    shared.chmod(0o700)
    await transport.publish(0, sample_state(), step=0)
    shared.chmod(0o770)  # a segment planted by the group is not read either
    with pytest.raises(PermissionError, match="only it can write"):
        await transport.read(0)


async def test_retention_keeps_v0_and_the_newest_and_gone_versions_raise_blob_not_found(shm):
    states = {v: sample_state(v) for v in range(6)}
    for version, state in states.items():
        await shm.publish(version, state, step=version)
    assert sorted(p.name for p in shm.dir.iterdir()) == ["v0.safetensors", "v4.safetensors", "v5.safetensors"]
    for version in (0, 4, 5):
        assert_exact(await shm.read(version), states[version])
    for version in (1, 3, 9):
        with pytest.raises(BlobNotFound, match=rf"shm weights v{version} .* \(kept: \[0, 4, 5\]\)"):
            await shm.read(version)


async def test_a_pruned_segment_stays_readable_through_views_already_taken(shm):
    await shm.publish(1, sample_state(1), step=1)
    held = await shm.read(1)
    for version in (2, 3, 4):
        await shm.publish(version, sample_state(version), step=version)
    assert not (shm.dir / "v1.safetensors").exists()
    assert_exact(held, sample_state(1))


async def test_temp_segments_of_dead_publishers_are_pruned(shm):
    await shm.publish(0, sample_state(), step=0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = shm.dir / f".v7.safetensors.tmp-{os.uname().nodename}-{int(dead.stdout)}"
    orphan.write_bytes(b"half written")
    await shm.publish(1, sample_state(1), step=1)
    assert not orphan.exists()


async def test_a_host_without_the_segments_gets_one_line_naming_the_transport(shm):
    with pytest.raises(BlobNotFound) as caught:
        await shm.read(0)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"shm weights: no segments of run {shm.run}")
    assert "one host" in message


async def test_another_process_fetches_what_this_one_published_and_the_reverse(shm):
    await shm.publish(3, sample_state(3), step=3)
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.workers.test_shm_weights import assert_exact, sample_state
        from workers.weights import SharedMemoryTransport

        async def main():
            transport = SharedMemoryTransport({shm.run!r}, keep=2)
            assert_exact(await transport.read(3), sample_state(3))
            await transport.publish(4, sample_state(4), step=4)
            print("ok")

        asyncio.run(main())
        """
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr[-2000:]
    assert_exact(await shm.read(4), sample_state(4))  # outlives the process that wrote it


async def test_the_run_config_selects_the_shm_transport_on_a_bus(make_bus):
    bus = await make_bus(weights="shm", bus={"weights_keep": 1})
    transport = make_transport(bus)
    assert isinstance(transport, SharedMemoryTransport)
    assert transport.dir == Path("/dev/shm") / f"relax-{os.getuid()}" / bus.run
    try:
        for version in range(3):
            await transport.publish(version, sample_state(version), step=version)
        assert sorted(p.name for p in transport.dir.iterdir()) == ["v0.safetensors", "v2.safetensors"]
        assert_exact(await transport.read(2), sample_state(2))
    finally:
        transport.remove_run()
    assert not transport.dir.exists()
