"""Errors of the bus layer. Each is meant to reach a person as one readable line.

The `relax` command turns each into `relax: error: ...` and its class's exit code, one policy for every
command (`relax worker`, `relax init`, `relax run`, ...) and every supervisor that restarts them:

- `EXIT_REFUSED` (2): the input is wrong (the config, a flag, the credentials) and running the same command
  again fails the same way. `relax run` does not restart a role that exits with it, the Kubernetes init Job
  fails at once (`podFailurePolicy`), compose does not start the roles after an init that exits with it.
- `EXIT_TEMPORARY` (75, sysexits' EX_TEMPFAIL): NATS could not be reached or stayed away, or a write was not
  confirmed, for longer than the command waits: running it again later may succeed, and supervisors do.
"""

from typing import ClassVar

EXIT_REFUSED = 2
"""Exit code of a deterministic error (config, flags, credentials): not worth a restart."""
EXIT_TEMPORARY = 75
"""Exit code of an error that a later attempt may not meet (an outage, an unconfirmed write)."""


class RelaxBusError(Exception):
    """Base class of every error the bus raises on purpose."""

    exit_code: ClassVar[int] = EXIT_REFUSED
    """What the `relax` command exits with when this error ends it."""


class TemporaryError(RelaxBusError):
    """Base class of the errors a later attempt may not meet (they exit with `EXIT_TEMPORARY`)."""

    exit_code: ClassVar[int] = EXIT_TEMPORARY


class ConfigError(RelaxBusError):
    """Raised when a config file or setting is invalid; carries every problem found at once."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config {source} ({len(problems)} problem(s)):\n{lines}")


class NatsUnreachable(TemporaryError):
    """Raised when no NATS server answers at the configured URL(s)."""


class NatsRefused(NatsUnreachable):
    """Raised when the server answered but refused the login (authorization, TLS certificate): the credentials
    are wrong, so it exits with `EXIT_REFUSED`."""

    exit_code: ClassVar[int] = EXIT_REFUSED


class NatsUnavailable(TemporaryError):
    """Raised when NATS stays away (restart, election) longer than a role is willing to wait."""


class PermissionDenied(RelaxBusError):
    """Raised when the server refused an operation for lack of permission (see `relax auth`)."""


class NatsServerNotFound(RelaxBusError):
    """Raised when the nats-server binary cannot be located."""


class NatsServerFailed(RelaxBusError):
    """Raised when an embedded nats-server exits or does not become ready."""


class RunNotFound(RelaxBusError):
    """Raised when a run has not been initialised (`relax init`) on this server."""


class TopologyConflict(RelaxBusError):
    """Raised when `relax init` would change a setting that an existing run cannot change."""


class ProvisionFailed(RelaxBusError):
    """Raised when the server refuses to create part of a run's topology (limits, storage, permissions)."""


class PublishFailed(TemporaryError):
    """Raised when a publish got no acknowledgement within its deadline, retries included."""


class AcksLost(PublishFailed):
    """Raised when the server did not confirm pipelined publishes in time (it may be restarting)."""


class StreamFull(PublishFailed):
    """Raised when a bounded stream (discard=new) stayed full for the whole publish deadline."""


class BlobNotFound(TemporaryError):
    """Raised when a claim-check or media digest names no object in the store."""


class BlobCorrupt(TemporaryError):
    """Raised when a fetched blob does not match its digest."""


class VersionConflict(TemporaryError):
    """Raised when a compare-and-set of the policy version finds another writer got there first."""


class CasConflict(VersionConflict):
    """Raised when a compare-and-set of a KV counter (`relax_bus.kv_counter`) finds another writer got there first."""

    def __init__(self, key: str, current: int | None = None, message: str | None = None) -> None:
        self.key = key
        self.current = current
        """The value the other writer left, when the writer read it back; None otherwise."""
        super().__init__(message or f"{key} was changed by another writer")


class CredentialsExist(RelaxBusError):
    """Raised when `relax auth` would overwrite credentials written before (without --force)."""
