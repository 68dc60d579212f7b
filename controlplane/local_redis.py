"""Start a private `redis-server` on a free loopback port with its own directory.

For the demo, benchmarks and tests (synchronous; call it at process setup, not from a
running event loop). Production points at a managed Redis through `RedisConfig.url`.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType


class LocalRedisError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """One `redis-server` process. `persistent=True` (the default, and what the demo and
    tests run) keeps an append-only file in `directory` (`appendonly yes`, fsync every
    second), so tenants, API keys and reservations survive `restart()` (graceful SIGTERM,
    then start on the same port) and even `kill()` (SIGKILL: at most the last second of
    writes is lost); `persistent=False` keeps nothing on disk (benchmarks only)."""

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        password: str | None = None,
        persistent: bool = True,
        executable: str = "redis-server",
    ) -> None:
        path = shutil.which(executable)
        if path is None:
            raise LocalRedisError(
                f"{executable!r} not found on PATH; install it (e.g. apt-get install redis-server)"
            )
        self.directory = directory
        self.port = port if port is not None else free_port()
        self.password = password
        self.persistent = persistent
        self._executable = path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        if self.running:
            raise LocalRedisError(f"redis-server on port {self.port} is already running")
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [self._executable, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.directory), "--save", "", "--daemonize", "no"]
        args += ["--logfile", str(self.directory / "redis.log")]
        args += ["--appendonly", "yes" if self.persistent else "no"]
        if self.persistent:
            args += ["--appendfsync", "everysec"]
        if self.password:
            args += ["--requirepass", self.password]
        with open(self.directory / "redis.stderr", "ab") as stderr:
            self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise LocalRedisError(
                    f"redis-server exited with {self._process.returncode}; "
                    f"see {self.directory / 'redis.log'} and redis.stderr there"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    auth = f"AUTH {self.password}\r\n" if self.password else ""
                    sock.sendall(f"{auth}PING\r\n".encode())
                    if b"PONG" in sock.recv(256) or (auth and b"PONG" in sock.recv(256)):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise LocalRedisError(f"redis-server on port {self.port} not ready in {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGTERM flushes the append-only file); kill if it hangs."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no final flush of the append-only file."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> LocalRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
