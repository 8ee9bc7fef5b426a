"""Start `specdec serve` for tests: in a thread of the test process (fast) or as a subprocess (signals)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


class ThreadServer:
    """uvicorn in a thread (no signal handling there); `state` is the live ServerState."""

    def __init__(self, *argv: str):
        from specdec.cli import build_parser
        from specdec.cli.serve import build_server

        self.port = free_port()
        args = build_parser().parse_args(["serve", *argv, "--port", str(self.port)])
        self.server, self.state = build_server(args)
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_healthy(self.url)

    @property
    def engine(self):
        return self.state.engine.engine

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and no KV block, and no response is in flight."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine.has_unfinished() and self.engine.blocks.num_used == 0 and not self.state.inflight_seqs:
                return
            time.sleep(0.05)
        raise TimeoutError(f"engine still busy: {self.engine.stats()}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class ProcessServer:
    def __init__(self, *argv: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = "import sys; from specdec.cli import main; sys.exit(main())"
        self.proc = subprocess.Popen([sys.executable, "-c", code, "serve", *argv, "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_healthy(self.url, proc=self.proc)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
