"""Rewards: the registry and the `Scorer` (`scorer`), what a reward function may return (`values`), the math
verifier (`verifiers`) and the sandbox user reward code runs in (`sandbox`).

Nothing is imported here: the sandbox's child imports this package before it confines itself, standard
library only.
"""
