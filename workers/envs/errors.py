"""Errors of environments served on the bus."""

from __future__ import annotations


class EnvFailed(Exception):
    """Raised when an environment answered a request with an error (its own exception, said in one line)."""


class EnvLost(Exception):
    """Raised when no environment instance holds an episode any more and it cannot be replayed on another."""
