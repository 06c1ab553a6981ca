"""Errors of the roles and the launcher."""

from relax_bus.errors import RelaxBusError, TemporaryError


class RunFailed(RelaxBusError):
    """Raised by `relax run` when a role keeps dying (more restarts than the launcher allows)."""


class RoleRefused(RunFailed):
    """Raised by `relax run` when a role exits with `EXIT_REFUSED` (its config cannot work here): the run ends
    at once with the role's reason, since a restart would fail the same way."""


class RoleNotInRun(RelaxBusError):
    """Raised by `relax worker ROLE` when the run's chain has no such role (reference while kl_coef is 0)."""


class ReplayFailed(RelaxBusError):
    """Raised by `relax replay` when a step cannot be recomputed (no record, no checkpoint, data expired)."""


class ExportFailed(RelaxBusError):
    """Raised by `relax export` when a run's checkpoint cannot be written out (none kept, wrong model, busy target)."""


class CheckpointRefused(RelaxBusError):
    """Raised when a checkpoint holds anything but tensors, containers and numbers (a planted pickle, say), or a
    sharded one misses a part: it is not loaded, and nothing in it runs."""


class CheckpointWriteFailed(TemporaryError):
    """Raised when a rank could not write its shards of a sharded checkpoint (`trainer.checkpoint.dir`): the
    checkpoint is not recorded, and the actor fails as after any crash."""


class WeightsBaseMismatch(TemporaryError):
    """Raised when a delta weights version cannot be rebuilt: a tensor left to v0 that this reader's v0 does not
    match, or a tensor whose bytes do not match the version's manifest (`workers.weights.wire`)."""
