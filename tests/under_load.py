"""Run a command beside one busy process per core, as a loaded machine would run it.

    python tests/under_load.py [--hogs N] -- pytest -m e2e

Each hog is a plain `while True: pass` interpreter. They start before the command, are stopped by
their PIDs when it ends (or when this script is interrupted), and the command's exit code is returned.
`make test-stress` runs the e2e, chaos and compose tiers this way; `.ci/run` does not.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    print(f"under_load: {len(hogs)} busy process(es), pids {' '.join(str(h.pid) for h in hogs)}", flush=True)
    started = time.monotonic()
    child: subprocess.Popen[bytes] | None = None
    try:
        child = subprocess.Popen(command)
        return child.wait()
    except KeyboardInterrupt:
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGINT)
            child.wait()
        return 130
    finally:
        for hog in hogs:
            hog.kill()  # by PID: these are the processes this script started
            hog.wait()
        print(f"under_load: {' '.join(command)} took {time.monotonic() - started:.0f}s beside the busy processes")


if __name__ == "__main__":
    sys.exit(main())
