"""Mixture-of-experts policies: the `tiny-moe` model source and routing replay (R3; docs/r3.md)."""
