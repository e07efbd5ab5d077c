"""Server fixtures: a real ``kvloom`` server process (uvicorn) on 127.0.0.1 with a tiny model.

``start_server`` runs ``python -m kvloom.entrypoints.openai.api_server --model DIR --port P`` and
waits for ``/health``; tests drive it with the official ``openai`` package and httpx. The server's
log is printed when a test module that used it fails to start it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    model: str  # the served model name
    log_path: str
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics (parsed by prometheus_client) by name, labels dropped."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                reason = sample.labels.get("finished_reason")
                if reason:
                    key += f"[{reason}]"
                if "le" not in sample.labels:
                    samples[key] = sample.value
        return samples

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if metrics["kvloom:num_requests_running"] == 0 and metrics["kvloom:num_requests_waiting"] == 0:
                return metrics
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle: {metrics}")
            time.sleep(0.02)


@contextlib.contextmanager
def start_server(model_dir: str, *args: str, api_key: str | None = None,
                 env: dict[str, str] | None = None, timeout: float = 120.0) -> Iterator[Server]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", prefix="kvloom-server-", delete=False)
    command = [sys.executable, "-m", "kvloom.entrypoints.openai.api_server", "--model", model_dir,
               "--port", str(port), *args]
    if api_key:
        command += ["--api-key", api_key]
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})})
    server = Server(process, port, model_dir, log.name, api_key)
    match = re.search(r"--served-model-name\s+(\S+)", " ".join(args))
    if match:
        server.model = match.group(1)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {timeout}s:\n{server.log()}")
            time.sleep(0.1)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


@pytest.fixture(scope="session")
def server_factory():
    """``start_server`` as a fixture: ``with server_factory(model_dir, *flags, api_key=...) as s``."""
    return start_server


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir: str):
    """An offline LLM on the same tiny model and settings as the servers: the greedy oracle."""
    from kvloom import LLM

    return LLM(model=tiny_llama_dir)
