"""Errors of the bus layer. Each is meant to reach a person as one readable line."""


class RelaxBusError(Exception):
    """Base class of every error the bus raises on purpose."""


class ConfigError(RelaxBusError):
    """Raised when a config file or setting is invalid; carries every problem found at once."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config {source} ({len(problems)} problem(s)):\n{lines}")


class NatsUnreachable(RelaxBusError):
    """Raised when no NATS server answers at the configured URL(s)."""


class NatsUnavailable(RelaxBusError):
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


class PublishFailed(RelaxBusError):
    """Raised when a publish got no acknowledgement within its deadline, retries included."""


class AcksLost(PublishFailed):
    """Raised when the server did not confirm pipelined publishes in time (it may be restarting)."""


class StreamFull(PublishFailed):
    """Raised when a bounded stream (discard=new) stayed full for the whole publish deadline."""


class BlobNotFound(RelaxBusError):
    """Raised when a claim-check or media digest names no object in the store."""


class BlobCorrupt(RelaxBusError):
    """Raised when a fetched blob does not match its digest."""


class VersionConflict(RelaxBusError):
    """Raised when a compare-and-set of the policy version finds another writer got there first."""


class CredentialsExist(RelaxBusError):
    """Raised when `relax auth` would overwrite credentials written before (without --force)."""
