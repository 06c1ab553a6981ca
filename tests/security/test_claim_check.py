"""A claim-checked payload is content addressed: the claim (`Relax-Claim: sha256:<hex>`) names the digest,
and whoever can write the media store can rewrite both an object and its own record. The reader checks the
bytes against the digest the claim names, so a swapped payload is refused instead of handled."""

from __future__ import annotations

import pytest

from relax_bus.blobs import digest_of
from relax_bus.envelope import CLAIM, open_message
from relax_bus.errors import BlobCorrupt
from schemas import decode, encode
from tests import factories as f

pytestmark = pytest.mark.bus


async def test_a_swapped_payload_behind_a_claim_is_refused(bus):
    honest = f.prompt(bus.run, 1, text="honest")
    digest = await bus.media.put_content(encode(honest))
    assert await open_message(b"", {CLAIM: digest}, bus.media) == honest

    forged = f.prompt(bus.run, 1, text="forged")
    await bus.media.put(digest.removeprefix("sha256:"), encode(forged))  # object and its record, consistent
    with pytest.raises(BlobCorrupt, match="not the sha256 its claim names"):
        await open_message(b"", {CLAIM: digest}, bus.media)


async def test_a_payload_planted_under_its_digest_before_the_honest_put_is_replaced(bus):
    """The attack of finding 7: plant other bytes under the digest an honest payload will have; the honest
    put used to see "already there" and leave them, so every reader of its claim was refused."""
    honest = encode(f.prompt(bus.run, 2, text="honest"))
    digest = digest_of(honest)
    await bus.media.put(digest.removeprefix("sha256:"), encode(f.prompt(bus.run, 2, text="planted")))
    assert await bus.media.put_content(honest) == digest
    assert await open_message(b"", {CLAIM: digest}, bus.media) == decode(honest)
