"""README.md's examples as a new user runs them, on the default model: every script in examples/, the Python blocks
and the server's curl lines, each at a first start (packing the GGUF) and a second one (mapped from the packed-model
cache). The only change made to the README's text is the LoRA adapter's path, which a user supplies."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny_lora

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "num_hidden_layers": 30}


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


@pytest.fixture(scope="module")
def env(smollm2_gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh cache folder (so the first run packs and the second maps), no example overrides."""
    cache = tmp_path_factory.mktemp("readme_cache")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOM_EXAMPLE_")}
    return dict(environ, KVLOOM_CACHE_DIR=str(cache), KVLOOM_PACKED_CACHE="1")


def _run(args: list[str], env: dict[str, str], timeout: int = 600) -> str:
    result = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args} failed:\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_every_example_script_runs_twice(script: str, env: dict[str, str]) -> None:
    assert f"examples/{script}" in README or script == "vision_chat.py" and "examples/vision_chat.py" in README
    for _ in range(2):
        out = _run([sys.executable, f"examples/{script}"], env)
        if script == "offline_inference.py":
            assert len([line for line in out.splitlines() if line.startswith("Prompt: ")]) == 4


def test_the_readme_python_blocks_run_twice(env: dict[str, str], tmp_path: Path) -> None:
    blocks = readme_blocks("python")
    assert len(blocks) >= 2 and "LLM(model=\"SmolLM2-135M-Instruct\"" in blocks[0]
    base = tmp_path / "smollm2_config"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(SMOLLM2))
    adapter = tiny_lora.write_tiny_lora(str(tmp_path / "sql"), str(base), rank=8)
    for number, block in enumerate(blocks):
        code = block.replace('"/adapters/sql"', repr(adapter))
        script = tmp_path / f"block{number}.py"
        script.write_text(code)
        for _ in range(2):
            _run([sys.executable, str(script)], env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_server_and_its_curl_lines(env: dict[str, str]) -> None:
    [block] = [b for b in readme_blocks("bash") if "kvloom serve SmolLM2-135M-Instruct" in b]
    serve = next(line for line in block.splitlines() if "kvloom serve" in line)
    curls = [c.strip() for c in re.split(r"\n(?=curl )", block.split(serve, 1)[1]) if c.strip().startswith("curl ")]
    assert len(curls) == 2
    port = _free_port()
    for _ in range(2):  # a first start, then one mapped from the packed cache
        server = subprocess.Popen(serve.replace(".venv/bin/kvloom", str(Path(sys.executable).parent / "kvloom"))
                                  .replace("--port 8000", f"--port {port}").split(),
                                  env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 300
            while True:
                probe = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{port}/health"], capture_output=True)
                if probe.returncode == 0:
                    break
                assert server.poll() is None, f"the server exited: {server.stderr.read()[-3000:]}"
                assert time.monotonic() < deadline, "the server did not become ready in 300 s"
                time.sleep(0.5)
            completion, chat = (_run(["bash", "-c", c.replace("8000", str(port))], env) for c in curls)
            assert json.loads(completion)["choices"][0]["text"]
            events = [line[len("data: "):] for line in chat.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"
        finally:
            server.terminate()
            server.wait(timeout=60)
