"""torchrun's command line for a role that runs as several ranks, and `relax worker` re-executing under it.

    one node      python -m torch.distributed.run --standalone --nproc-per-node=M -m workers.cli worker ROLE ...
    several       python -m torch.distributed.run --nnodes=N --nproc-per-node=M --rdzv-backend=c10d
                      --rdzv-endpoint=HOST:PORT --rdzv-id=ID -m workers.cli worker ROLE ...

With the c10d backend the rendezvous numbers the nodes as they join (no --node-rank): the torchrun agent
on the endpoint's machine hosts the store, the others connect to it. Only the trainer spans nodes, so
the rendezvous settings are the trainer section's (`trainer.distributed.rdzv_endpoint`,
`trainer.distributed.rdzv_id`, default the run id). Nothing here imports torch: `relax run` builds these lines
without loading it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from relax_bus.errors import ConfigError
from workers.config import PipelineConfig

TORCHRUN = ("-m", "torch.distributed.run")


def launcher(config: PipelineConfig, ranks: int, nodes: int, endpoint: str | None) -> list[str]:
    """torchrun's module and flags for one node of a role with `ranks` per node on `nodes` nodes."""
    if nodes == 1:
        return [*TORCHRUN, "--standalone", f"--nproc-per-node={ranks}"]
    if endpoint is None:
        raise ConfigError(
            "trainer",
            [
                f"trainer.distributed.nnodes is {nodes}, so every node needs trainer.distributed.rdzv_endpoint: "
                "host:port of the rendezvous store on the first node, reachable from the others (only `relax run`, "
                "which starts every node on one machine, picks one itself)"
            ],
        )
    return [
        *TORCHRUN,
        f"--nnodes={nodes}",
        f"--nproc-per-node={ranks}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={config.trainer.distributed.rdzv_id or config.run}",
    ]


def worker_arguments(argv: Sequence[str]) -> list[str]:
    """`relax` arguments as torchrun must pass them on: the `worker` command first (torchrun hands the
    script everything from its first positional argument on), the options given before it after the
    role, and `--run` spelled `--run-id` (torchrun's parser would take it for an abbreviation of its
    own `--run-path`)."""
    at = list(argv).index("worker")
    before, rest = list(argv[:at]), list(argv[at:])
    rest = ["--run-id" if a == "--run" else "--run-id=" + a[6:] if a.startswith("--run=") else a for a in rest]
    return [*rest[:2], *before, *rest[2:]]


def reexec_under_torchrun(config: PipelineConfig, ranks: int, nodes: int) -> None:
    """Replace this `relax worker` process by a torchrun agent that runs it as this node's ranks.

    The process keeps its PID, so whatever supervises it (systemd, Kubernetes, `relax run`) stops the
    agent, which stops its ranks. Raises ConfigError when the config names no rendezvous endpoint."""
    args = [*launcher(config, ranks, nodes, config.trainer.distributed.rdzv_endpoint), "-m", "workers.cli"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *args, *worker_arguments(sys.argv[1:])])
