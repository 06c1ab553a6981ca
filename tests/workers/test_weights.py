"""Both weight transports through the run config: publish versions, fetch them back bit for bit, keep v0
and the newest `bus.weights_keep`."""

import pytest
import torch

from relax_bus.errors import BlobNotFound
from workers.weights import FilesystemTransport, ObjectStoreTransport, make_transport

pytestmark = pytest.mark.workers


@pytest.mark.parametrize("kind", ["object_store", "filesystem"])
async def test_the_configured_transport_publishes_fetches_and_prunes(kind, make_bus, tmp_path):
    weights = {"type": "filesystem", "root": str(tmp_path / "shared")} if kind == "filesystem" else kind
    bus = await make_bus(weights=weights, bus={"weights_keep": 2})
    transport = make_transport(bus)
    assert isinstance(transport, FilesystemTransport if kind == "filesystem" else ObjectStoreTransport)
    states = {v: {"w": torch.full((3, 4), float(v)), "b": torch.arange(5, dtype=torch.int64) + v} for v in range(5)}
    for version, state in states.items():
        announcement = await transport.publish(version, state, step=version)
        assert announcement.version == version and announcement.size > 0
    for version in (0, 3, 4):  # v0 and the newest two stay
        fetched = await transport.read(version)
        assert fetched.keys() == states[version].keys()
        assert all(torch.equal(fetched[k], states[version][k]) for k in fetched)
    for version in (1, 2):
        with pytest.raises(BlobNotFound):
            await transport.read(version)
    if kind == "filesystem":
        assert sorted(p.name for p in (tmp_path / "shared" / bus.run).iterdir()) == [
            "v0.safetensors",
            "v3.safetensors",
            "v4.safetensors",
        ]
