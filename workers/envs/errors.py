"""Errors of an episode's environment, as the rollout's client (`workers.envs.client`) raises them."""


class EnvError(Exception):
    """Base of the environment errors: the episode cannot go on; `reason` says why in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EnvLost(EnvError):
    """Raised when no environment server holds the episode any more (a server died, timed out or forgot it) and
    it cannot be replayed on another: the environment is not deterministic, or the retries are spent."""


class EnvFailed(EnvError):
    """Raised when the environment itself failed an action (an exception, a call past its time limit, a bad
    request): the server's error reply, with its one-line text."""
