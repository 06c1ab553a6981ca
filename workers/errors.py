"""Errors of the roles and the launcher."""

from relax_bus.errors import RelaxBusError


class RunFailed(RelaxBusError):
    """Raised by `relax run` when a role keeps dying (more restarts than the launcher allows)."""
