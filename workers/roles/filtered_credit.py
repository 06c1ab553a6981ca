"""Credit for filtered groups: a scored group whose rewards are all equal is dropped before the trainer and
replaced by the feeder, within the over-sampling bound (`sampling` in the run config).

Why a set, not a counter. The reward role records a filtered group by setting the bit of its release index
in one KV value, `groups.filtered` (a bitmap: bit i of byte i // 8, low bit first), with compare-and-set.
The value is JSON, as every run-state value is (`nats kv get` shows it): `{"count": n, "bits": base64}`.
Adding an index that is already there writes nothing, so a reward worker killed after recording a group
(or after publishing its event) but before acking it counts it once when the group is redelivered, and so
does a second copy of the group (the feeder, or a rollout worker, published it again after a crash). The
credit and its deduplication are one atomic write: there is no window, as there would be between a
per-group marker and a separate counter, in which a crash loses a credit (the run would wait forever) or
counts one twice. The feeder reads the one value on every poll and counts the bits below its cursor; its
size is one bit per release (8 KiB for 64k groups).

The bound. With `T = trainer.steps x groups_per_step` groups to train and ratio `r = max_oversample`, the
feeder replaces at most `cap = floor((r - 1) x T)` filtered groups (stale and dead-lettered ones are
replaced as before). While `filtered <= cap` the run can finish; once `filtered > cap`, the groups the
feeder may ever release that are not filtered, stale or dead-lettered number at most
`T + cap - filtered < T`: the run cannot finish within the bound, and the feeder says so and fails
(`OversampleExhausted`) instead of waiting forever.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Sequence

import nats.js.errors
from nats.js.kv import KeyValue

from relax_bus.errors import RelaxBusError, VersionConflict
from relax_bus.run_state import RunState
from workers.state_keys import GROUPS_FILTERED

FILTERED_KEY = GROUPS_FILTERED
"""State KV key of the filtered set (the reward role writes it; the feeder reads it)."""


class OversampleExhausted(RelaxBusError):
    """Raised by the feeder when more groups were filtered than `sampling.max_oversample` lets it replace."""


# ---- pure pieces ----------------------------------------------------------------------------------------


def is_uniform(rewards: Sequence[float]) -> bool:
    """True when every sample of a group got the same reward (exact equality; an empty group is uniform).

    Such a group has r - mean(r) = 0 for every sample, so its GRPO (and Dr. GRPO) advantages are exactly
    zero and it adds nothing to the policy gradient.
    """
    return all(r == rewards[0] for r in rewards[1:]) if rewards else True


def with_index(bitmap: bytes, index: int) -> bytes:
    """`bitmap` with release `index` added (grown with zero bytes as needed)."""
    if index < 0:
        raise ValueError(f"release index {index} is negative")
    byte, bit = divmod(index, 8)
    out = bytearray(bitmap)
    if len(out) <= byte:
        out.extend(bytes(byte + 1 - len(out)))
    out[byte] |= 1 << bit
    return bytes(out)


def holds(bitmap: bytes, index: int) -> bool:
    """Whether release `index` is in `bitmap`."""
    byte, bit = divmod(index, 8)
    return 0 <= byte < len(bitmap) and bool(bitmap[byte] >> bit & 1)


def count_below(bitmap: bytes, released: int) -> int:
    """How many release indices below `released` are in `bitmap` (the feeder credits only what it released)."""
    whole, rest = divmod(max(0, released), 8)
    count = sum(b.bit_count() for b in bitmap[:whole])
    if rest and whole < len(bitmap):
        count += (bitmap[whole] & ((1 << rest) - 1)).bit_count()
    return count


def oversample_cap(max_oversample: float, to_train: int) -> int:
    """Filtered groups the feeder may replace over a run that trains `to_train` groups: floor((r - 1) x T)."""
    if max_oversample < 1.0 or to_train < 0:
        raise ValueError(f"max_oversample >= 1 and groups to train >= 0 (got {max_oversample}, {to_train})")
    return math.floor((max_oversample - 1.0) * to_train + 1e-9)  # 1e-9: (1.1 - 1) x 10 is 0.99999...


def exhausted(filtered: int, cap: int) -> bool:
    """True when more groups were filtered than the bound replaces: the run can no longer finish."""
    return filtered > cap


# ---- the KV value ---------------------------------------------------------------------------------------


def encode(bitmap: bytes) -> bytes:
    """The KV value of `bitmap`: JSON with the set's size (for people) and the bits (base64)."""
    count = count_below(bitmap, len(bitmap) * 8)
    return json.dumps({"count": count, "bits": base64.b64encode(bitmap).decode()}).encode()


def decode(value: bytes) -> bytes:
    """The bitmap of a KV value written by `encode`."""
    return base64.b64decode(json.loads(value)["bits"]) if value else b""


async def filtered_now(state: RunState) -> bytes:
    """The filtered set as the feeder polls it (riding through a NATS outage); `b""` before the first filtered group."""
    return decode(await state.get(FILTERED_KEY) or b"")


async def read_filtered(kv: KeyValue) -> tuple[bytes, int]:
    """`(bitmap, revision)` of the filtered set; `(b"", 0)` before the first filtered group."""
    try:
        entry = await kv.get(FILTERED_KEY)
    except nats.js.errors.KeyNotFoundError:
        return b"", 0
    return decode(bytes(entry.value or b"")), int(entry.revision or 0)


async def record_filtered(kv: KeyValue, index: int, attempts: int = 50) -> int:
    """Add release `index` to the filtered set (compare-and-set; a no-op when it is there); return the set's size."""
    for _ in range(attempts):
        bitmap, revision = await read_filtered(kv)
        if holds(bitmap, index):
            return count_below(bitmap, len(bitmap) * 8)
        new = with_index(bitmap, index)
        try:
            if revision == 0:
                await kv.create(FILTERED_KEY, encode(new))
            else:
                await kv.update(FILTERED_KEY, encode(new), last=revision)
            return count_below(new, len(new) * 8)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            continue  # another reward worker wrote first: read again
        except nats.js.errors.APIError as err:
            if err.err_code == 10071:  # create raced with another writer
                continue
            raise
    raise VersionConflict(f"{FILTERED_KEY} kept changing under {attempts} compare-and-set attempts")
