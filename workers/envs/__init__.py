"""Environments and tools of agentic episodes: the `Environment` protocol, the built-in environments, and the
service that puts an environment class on the bus (`relax env serve`, the `env` role)."""
