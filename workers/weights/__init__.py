"""Weight transports: how the trainer's weights of version v reach the rollout and reference roles.

The default transport keeps one safetensors object per version in the run's `weights` object store
(read back with the bus's chunked reader), so nothing needs a shared filesystem. `filesystem` writes
the same files under a directory every worker mounts, `shm` into shared memory on one host, laid out so
that a fetch builds the tensors as views, without a copy (`workers.weights.files`). `broadcast` pushes each
version over a gloo group to the rollout engines that joined, beside the object store
(`workers.weights.broadcast`). Another transport plugs in the same way: one small class and one registry line.
"""

from workers.weights.broadcast import BroadcastTransport
from workers.weights.files import FilesystemTransport, SharedMemoryTransport
from workers.weights.object_store import ObjectStoreTransport
from workers.weights.registry import TRANSPORTS, make_transport
from workers.weights.serialization import from_buffer, to_bytes
from workers.weights.transport import StateDict, WeightTransport

__all__ = [
    "TRANSPORTS",
    "BroadcastTransport",
    "FilesystemTransport",
    "ObjectStoreTransport",
    "SharedMemoryTransport",
    "StateDict",
    "WeightTransport",
    "from_buffer",
    "make_transport",
    "to_bytes",
]
