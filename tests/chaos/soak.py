"""Sampling a running cluster: RSS of every role process and the depth of every hop."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.cluster import Cluster


def rss_mib(pid: int) -> float | None:
    """Resident set size of a process in MiB (Linux /proc); None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass
class Samples:
    """Time series per role process and per hop."""

    rss: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    depth: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    async def take(self, cluster: Cluster) -> None:
        for role in cluster.roles:
            if role.proc is not None and role.proc.poll() is None:
                value = rss_mib(role.proc.pid)
                if value is not None:
                    self.rss[f"{role.name}-{role.index}"].append(value)
        assert cluster.bus is not None
        for c in cluster.bus.topology.consumers:
            if c.stream_key == "events":
                continue  # the metrics role's durable: events, not groups (the credit rule bounds groups)
            info = await cluster.bus.js.consumer_info(cluster.bus.topology.stream(c.stream_key).name, c.durable)
            self.depth[c.stream_key].append(int(info.num_pending or 0) + int(info.num_ack_pending or 0))

    def growth(self, name: str) -> tuple[float, float]:
        """Median RSS early on (20-40% of the run) and at the end (last 20%)."""
        series = self.rss[name]
        n = len(series)
        early = series[n // 5 : max(n // 5 + 1, 2 * n // 5)]
        late = series[max(0, n - n // 5 - 1) :]
        return statistics.median(early), statistics.median(late)

    def table(self, title: str) -> list[str]:
        lines = [title, f"{'process':<14}{'peak RSS MiB':>14}{'early MiB':>12}{'late MiB':>12}"]
        for name in sorted(self.rss):
            early, late = self.growth(name)
            lines.append(f"{name:<14}{max(self.rss[name]):>14.1f}{early:>12.1f}{late:>12.1f}")
        lines.append(f"{'hop':<14}{'max depth':>14}{'mean depth':>12}")
        for hop in sorted(self.depth):
            series = self.depth[hop]
            lines.append(f"{hop:<14}{max(series):>14}{statistics.mean(series):>12.1f}")
        return lines
