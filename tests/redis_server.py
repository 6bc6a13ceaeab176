"""A private `redis-server` on a free 127.0.0.1 port, without persistence (tests, benches)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass


@dataclass
class RedisServer:
    """A `redis-server` process we own."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """Stop the server at once (SIGKILL), as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis_server(*extra_args: str) -> RedisServer:
    """Start a server; it answers PING when this returns. FileNotFoundError without the binary."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (scripts/test.sh installs it)")
    for _ in range(5):  # another process may take the free port before the server binds it
        port = _free_port()
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        process = subprocess.Popen(
            [binary, *args, *extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            if _answers_ping(port):
                return RedisServer(process, port)
            time.sleep(0.02)
        process.kill()
        process.wait()
    raise RuntimeError("redis-server did not start")
