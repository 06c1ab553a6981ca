"""Errors of the omni-modal package."""

from __future__ import annotations


class OmniError(ValueError):
    """Base of the omni-modal errors: a user-facing problem reported in one line."""


class MediaError(OmniError):
    """Raised when a media part cannot be decoded or exceeds the configured media limits."""


class UnsupportedModelError(OmniError):
    """Raised when a multimodal model's family has no position rule wired here (only Qwen2.5-Omni so far)."""
