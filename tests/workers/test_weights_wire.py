"""Deltas against v0 and the bfloat16 wire, over the real transports (`weights.delta`, `weights.wire_dtype`)."""

from __future__ import annotations

import pytest
import torch

from workers.errors import WeightsBaseMismatch
from workers.weights import make_transport
from workers.weights.wire import MANIFEST, WireTransport

pytestmark = pytest.mark.workers


def states(versions: int) -> dict[int, dict[str, torch.Tensor]]:
    """v0..: `frozen` never changes, `w` does every version, `steps` is an int64 counter."""
    gen = torch.Generator().manual_seed(0)
    frozen = torch.randn(64, 64, generator=gen)
    return {
        v: {"frozen": frozen.clone(), "w": torch.randn(16, 8, generator=gen), "steps": torch.tensor([v])}
        for v in range(versions)
    }


@pytest.mark.parametrize("kind", ["object_store", "filesystem"])
async def test_a_delta_leaves_unchanged_tensors_behind_and_rebuilds_them_exactly(kind, make_bus, tmp_path):
    weights = {"type": kind, "delta": True}
    if kind == "filesystem":
        weights["root"] = str(tmp_path / "shared")
    bus = await make_bus(weights=weights)
    writer, reader = make_transport(bus), make_transport(bus)
    assert isinstance(writer, WireTransport)
    sent = states(3)
    sizes = [(await writer.publish(v, s, step=v)).size for v, s in sent.items()]
    assert sizes[1] < sizes[0] / 2  # the 64x64 frozen tensor stays behind
    raw = await writer.inner.read(2)
    assert "frozen" not in raw and MANIFEST in raw
    for v in (2, 0, 1):  # a fresh reader fetches v0 itself the first time it needs it
        got = await reader.read(v)
        assert got.keys() == sent[v].keys()
        assert all(torch.equal(got[k], sent[v][k]) and got[k].dtype == sent[v][k].dtype for k in got)


async def test_the_bfloat16_wire_halves_float32_and_keeps_v0_exact(make_bus):
    bus = await make_bus(weights={"type": "object_store", "wire_dtype": "bfloat16"})
    transport = make_transport(bus)
    sent = states(2)
    full = (await transport.publish(0, sent[0], step=0)).size
    half = (await transport.publish(1, sent[1], step=1)).size
    assert half < 0.6 * full
    v0, v1 = await transport.read(0), await transport.read(1)
    assert all(torch.equal(v0[k], sent[0][k]) for k in v0)
    assert v1["w"].dtype == torch.float32 and torch.equal(v1["w"], sent[1]["w"].to(torch.bfloat16).float())
    assert torch.equal(v1["steps"], sent[1]["steps"])  # integers travel as they are


async def test_a_reader_with_another_runs_v0_refetches_it_and_a_real_mismatch_is_refused(make_bus):
    bus = await make_bus(weights={"type": "object_store", "delta": True})
    writer, reader = make_transport(bus), make_transport(bus)
    sent = states(2)
    for v, s in sent.items():
        await writer.publish(v, s, step=v)
    assert isinstance(reader, WireTransport)
    reader._remember_base({k: t + 1 for k, t in sent[0].items()})  # a stale copy of v0
    got = await reader.read(1)
    assert torch.equal(got["frozen"], sent[1]["frozen"])  # caught by digest, v0 fetched again
    # v0 in the run no longer matches what v1 was built against: refused, never loaded
    await writer.inner.publish(0, {k: t * 2 for k, t in sent[0].items()}, step=0)
    fresh = make_transport(bus)
    with pytest.raises(WeightsBaseMismatch, match="frozen does not match its digest"):
        await fresh.read(1)
