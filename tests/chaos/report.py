"""Accounting tables of the chaos runs, printed at the end of the pytest session."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tests.e2e.cluster import Accounting

REPORTS: list[ChaosReport] = []
SOAK_TABLES: list[list[str]] = []
COLUMNS = ("released", "trained", "dropped", "requeued", "duplicated", "lost", "stuck", "steps", "version")


@dataclass
class ChaosReport:
    name: str
    kills: Counter[str]
    unplanned: Counter[str]
    values: dict[str, int]
    log: list[str]


def figures(acc: Accounting, steps: int, version: int, stuck: int) -> dict[str, int]:
    """The accounting columns of one run (duplicated and lost must be 0)."""
    trained = acc.trained
    settled = set(trained) | set(acc.dropped)
    released = set(acc.released_ids)
    return {
        "released": acc.released,
        "trained": len(trained),
        "dropped": len(set(acc.dropped)),
        "requeued": len(acc.requeued),
        "duplicated": len(trained) - len(set(trained)),
        "lost": len(released - settled),
        "stuck": stuck,
        "steps": steps,
        "version": version,
    }


def render(reports: list[ChaosReport]) -> list[str]:
    lines = ["chaos accounting (SIGKILL at seeded random moments; duplicated and lost must be 0)"]
    head = f"{'run':<22} {'kills':<44} {'unplanned':<12}" + "".join(f"{c:>11}" for c in COLUMNS)
    lines += [head, "-" * len(head)]
    for r in reports:
        kills = ", ".join(f"{k} x{n}" for k, n in sorted(r.kills.items()))
        unplanned = ", ".join(f"{k} x{n}" for k, n in sorted(r.unplanned.items())) or "0"
        lines.append(f"{r.name:<22} {kills:<44} {unplanned:<12}" + "".join(f"{r.values[c]:>11}" for c in COLUMNS))
    for r in reports:
        lines.append(f"{r.name}: " + "; ".join(r.log))
    return lines
