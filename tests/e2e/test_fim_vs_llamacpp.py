"""kvloom's fill-in-the-middle prompts against llama-server's own, token for token, on the same GGUF.

SmolLM2-135M (the default model) has no FIM prefix, suffix or middle token: llama.cpp and kvloom both find only
its repository token (``<reponame>``) and both refuse ``/infill``. So its Q8_0 (llama-quantize's, from the
shipped Q4_1) is relabelled twice, weights byte for byte (tiny_models.relabel_gguf):

- ``keys``: ``tokenizer.ggml.fim_{pre,suf,mid}_token_id`` name ``<issue_start>``, ``<issue_comment>``,
  ``<issue_closed>``; ``fim_rep`` names ``<repo_name>`` (not ``<reponame>``, which the text lookup would find)
  and ``fim_sep`` ``<file_sep>``: Qwen2.5-Coder's repository-level prompt. ``<jupyter_start>`` renamed
  ``<fim_pad>`` is found by its text.
- ``texts``: no keys; those four tokens renamed StarCoder's ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``,
  ``<fim_pad>``, found by text; the repository token is ``<reponame>`` and there is no file separator, so extra
  chunks are joined by llama.cpp's "--- snippet ---".

llama-server's prompt ids are read from its slot file (``POST /slots/0?action=save`` writes the slot's tokens,
the prompt then the generation). kvloom's come from fim.format_prompt_infill with its server's settings (the
whole list), and, for the shorter prompts, from its server on the ``keys`` file: /infill's ``tokens_evaluated``
and ``prompt`` text, and ``suffix`` on /v1/completions with ``prompt_logprobs`` (every id after the first). Greedy
tokens (8, temperature 0) are compared there too, up to a near tie (NEAR_TIE). Both servers have llama-server's
default batch (2048) and a 2304-token context, so the extra context keeps its last 2304 - 2048 + 2 = 258 tokens,
the prefix its last 1536 and the suffix its first 510 - len(prompt).

Runs where llama.cpp's tools are built (``bash benchmarks/peers/setup_llamacpp.sh``, or KVLOOM_LLAMA_CPP_BIN
naming their folder).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tiny_models

from kvloom.entrypoints.openai.fim import (
    LLAMA_SERVER_N_BATCH,
    LLAMA_SERVER_N_PREDICT,
    FimTokens,
    InfillUnsupportedError,
    format_prompt_infill,
)
from kvloom.loader.tokenizer import FIM_TOKEN_TEXTS, Tokenizer, load_tokenizer
from kvloom.loader.weights import default_model_gguf_path, resolve_model

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("KVLOOM_LLAMA_CPP_BIN", ROOT / ".peers" / "llamacpp" / "bin"))
# The vendored sources next to the tools (setup_llamacpp.sh's .peers/llamacpp/src).
SOURCES = TOOLS.parent / "src"

pytestmark = pytest.mark.skipif(not (TOOLS / "llama-server").is_file() or not (TOOLS / "llama-quantize").is_file(),
                                reason=f"llama.cpp's llama-server and llama-quantize are not built in {TOOLS} "
                                       f"(bash benchmarks/peers/setup_llamacpp.sh, or KVLOOM_LLAMA_CPP_BIN)")

N_CTX = 2304
N_PREDICT = 8
# Greedy tokens may part where llama.cpp's first two choices are this close (nats): on these prompts the two
# engines' log-probabilities of a candidate differ by up to about 0.25 (llama.cpp's f16 KV cache and its rounding of
# the Q8_0 activations; kvloom in float32 with the file's int8 blocks), so a gap under twice that can flip.
NEAR_TIE = 0.5
KEYS = {"tokenizer.ggml.fim_pre_token_id": 8, "tokenizer.ggml.fim_suf_token_id": 9,
        "tokenizer.ggml.fim_mid_token_id": 10, "tokenizer.ggml.fim_rep_token_id": 3,
        "tokenizer.ggml.fim_sep_token_id": 5}
STARCODER_TEXTS = {8: "<fim_prefix>", 9: "<fim_suffix>", 10: "<fim_middle>", 11: "<fim_pad>"}

PREFIX = "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    "
SUFFIX = "\n\nfor i in range(10):\n    print(i, fibonacci(i))\n"
EXTRA = [{"filename": "utils.py", "text": "def square(x):\n    return x * x\n"},
         {"text": "PI = 3.14159\n"}]  # no filename: llama.cpp's "tmp"
LONG_EXTRA = [{"filename": f"module{i}.py", "text": f"def helper_{i}(value):\n    return value + {i}\n"}
              for i in range(24)]
LONG_CODE = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(160))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LlamaServer:
    url: str
    log_path: str
    slots_dir: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def fim_token_ids(self) -> dict[str, int]:
        """The FIM tokens llama.cpp found, from its load log (llama-vocab.cpp's print_info)."""
        return {role.lower(): int(token_id)
                for role, token_id in re.findall(r"FIM (PRE|SUF|MID|PAD|REP|SEP) token\s+= (\d+)", self.log())}

    def infill(self, body: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """/infill's answer, greedy with each step's top two, and the prompt's token ids as its slot holds them.
        The prompt is evaluated whole (no cache), so the answer does not depend on the previous request."""
        response = httpx.post(self.url + "/infill", json={**body, "n_predict": N_PREDICT, "temperature": 0,
                                                          "return_tokens": True, "n_probs": 2,
                                                          "cache_prompt": False}, timeout=300)
        assert response.status_code == 200, response.text
        answer = response.json()
        saved = httpx.post(self.url + "/slots/0", params={"action": "save"}, json={"filename": "slot.bin"},
                           timeout=300)
        assert saved.status_code == 200, saved.text
        tokens = read_slot_tokens(os.path.join(self.slots_dir, "slot.bin"))
        prompt = tokens[:answer["tokens_evaluated"]]
        # The slot holds the prompt, then the generation fed back (all but the last token).
        assert tokens[len(prompt):] == answer["tokens"][:len(tokens) - len(prompt)]
        return prompt, answer


def read_slot_tokens(path: str) -> list[int]:
    """The token ids of a slot file: llama_state_seq_save_file's magic, version and count, then the server's
    packed tokens (LLAMA_TOKEN_NULL, SERVER_TOKENS_STATE_VERSION 1, count, ids, media chunks)."""
    with open(path, "rb") as f:
        magic, version, n_packed = struct.unpack("<III", f.read(12))
        packed = struct.unpack(f"<{n_packed}i", f.read(4 * n_packed))
    assert (magic, version) == (0x67677371, 3), "not a llama.cpp slot file (ggsq, version 3)"
    assert packed[:2] == (-1, 1), f"unknown server token state {packed[:2]}"
    return list(packed[3:3 + packed[2]])


@contextlib.contextmanager
def llama_server(gguf_path: str) -> Iterator[LlamaServer]:
    """llama-server on ``gguf_path``: 2 threads, one slot of N_CTX tokens, its default batch; stopped on exit."""
    port = _free_port()
    slots_dir = tempfile.mkdtemp(prefix="llama-slots-")
    log = tempfile.NamedTemporaryFile("w", suffix=".log", prefix="llama-server-", delete=False)
    process = subprocess.Popen([str(TOOLS / "llama-server"), "-m", gguf_path, "-t", "2", "-c", str(N_CTX), "-np", "1",
                                "--host", "127.0.0.1", "--port", str(port), "--slot-save-path", slots_dir,
                                "--no-warmup", "-lv", "4"], stdout=log, stderr=subprocess.STDOUT)
    server = LlamaServer(f"http://127.0.0.1:{port}", log.name, slots_dir)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {process.returncode}:\n{server.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start in 60s:\n{server.log()}")
            time.sleep(0.1)
        props = httpx.get(server.url + "/props", timeout=10).json()
        assert props["default_generation_settings"]["n_ctx"] == N_CTX
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(slots_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The shipped SmolLM2 (no FIM tokens) and its Q8_0 relabelled with FIM tokens by key and by text."""
    try:
        shipped = default_model_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("fim_ggufs")
    q8_0 = str(root / "smollm2-q8_0.gguf")
    subprocess.run([str(TOOLS / "llama-quantize"), "--allow-requantize", shipped, q8_0, "Q8_0", "2"], check=True,
                   capture_output=True, timeout=300)
    return {"shipped": shipped,
            "keys": tiny_models.relabel_gguf(q8_0, str(root / "keys.gguf"), token_texts={11: "<fim_pad>"},
                                             uint32_keys=KEYS),
            "texts": tiny_models.relabel_gguf(q8_0, str(root / "texts.gguf"), token_texts=STARCODER_TEXTS)}


@pytest.fixture(scope="module")
def llama_keys(ggufs: dict[str, str]) -> Iterator[LlamaServer]:
    with llama_server(ggufs["keys"]) as server:
        yield server


@pytest.fixture(scope="module")
def llama_texts(ggufs: dict[str, str]) -> Iterator[LlamaServer]:
    with llama_server(ggufs["texts"]) as server:
        yield server


@pytest.fixture(scope="module")
def kvloom_keys(ggufs: dict[str, str], server_factory: Any) -> Iterator[Any]:
    with server_factory(ggufs["keys"], "--max-model-len", str(N_CTX), "--served-model-name", "smollm2-fim",
                        "--dtype", "float32") as s:
        yield s


def kvloom_prompt(tokenizer: Tokenizer, body: dict[str, Any]) -> list[int]:
    """The prompt kvloom's server builds for an /infill body (serving_engine.infill_prompt's settings)."""
    prompt = body.get("prompt", "")
    return format_prompt_infill(tokenizer, FimTokens.of(tokenizer), body["input_prefix"], body["input_suffix"],
                                body.get("input_extra", []), LLAMA_SERVER_N_BATCH, LLAMA_SERVER_N_PREDICT, N_CTX,
                                False, tokenizer.encode(prompt, add_special_tokens=False) if prompt else [])


def test_both_find_the_same_fim_tokens(ggufs: dict[str, str], llama_texts: LlamaServer) -> None:
    """By text, and none: the shipped file has only a repository token, and both refuse to infill."""
    ours = load_tokenizer(resolve_model(ggufs["texts"])).fim_token_ids
    assert ours == llama_texts.fim_token_ids() == {"pre": 8, "suf": 9, "mid": 10, "pad": 11, "rep": 4}
    shipped = load_tokenizer(resolve_model(ggufs["shipped"]))
    with llama_server(ggufs["shipped"]) as server:
        assert shipped.fim_token_ids == server.fim_token_ids() == {"rep": 4}
        refusal = httpx.post(server.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=60)
    message = refusal.json()["error"]["message"]
    assert refusal.status_code == 501 and message.startswith("Infill is not supported by this model: ")
    with pytest.raises(InfillUnsupportedError) as refused:
        FimTokens.of(shipped)
    assert str(refused.value).startswith(message.strip())


def test_known_spellings_are_llama_cpps(ggufs: dict[str, str], llama_keys: LlamaServer) -> None:
    """kvloom's FIM spellings are the ones llama-vocab.cpp looks for, role by role; the keys file's tokens are
    those its keys name (the repository token by key, not the <reponame> its text lookup would find)."""
    assert load_tokenizer(resolve_model(ggufs["keys"])).fim_token_ids == llama_keys.fim_token_ids() == {
        "pre": 8, "suf": 9, "mid": 10, "pad": 11, "rep": 3, "sep": 5}
    vocab_cpp = SOURCES / "src" / "llama-vocab.cpp"
    if not vocab_cpp.is_file():
        pytest.skip(f"llama.cpp's sources are not in {SOURCES}")
    source = vocab_cpp.read_text(encoding="utf-8")
    blocks = re.findall(r"if \(special_fim_(\w+)_id == LLAMA_TOKEN_NULL\) \{(.*?)\) \{", source, re.S)
    theirs = {role: set(re.findall(r't\.first == "([^"]+)"', block)) for role, block in blocks}
    assert theirs == {role: set(texts) for role, texts in FIM_TOKEN_TEXTS.items()}


def assert_same_greedy_tokens(ours: list[int], answer: dict[str, Any]) -> None:
    """kvloom's greedy tokens are llama-server's, up to a step where llama.cpp's first two choices are within
    NEAR_TIE of each other and kvloom took the second: there the two engines' rounding may pick either."""
    theirs = answer["tokens"]
    for step, (our_token, their_token) in enumerate(zip(ours, theirs)):
        if our_token != their_token:
            first, second = answer["completion_probabilities"][step]["top_logprobs"][:2]
            gap = first["logprob"] - second["logprob"]
            assert our_token == second["id"] and gap < NEAR_TIE, \
                f"greedy tokens part at step {step} where llama.cpp was sure: {ours} != {theirs}"
            print(f"greedy tokens part at step {step}, a near tie ({gap:.3f} nats): {ours} vs {theirs}")
            return
    assert ours == theirs


INFILL_CASES = {
    "prefix-suffix": {"input_prefix": PREFIX, "input_suffix": SUFFIX},
    "prompt": {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "if n"},
    "extra-files": {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "return"},
    # A FIM token's spelling in code stays text; in prompt, llama-server parses it.
    "special-spellings": {"input_prefix": "s = '<issue_start><fim_prefix>'\n", "input_suffix": "<file_sep>\n",
                          "prompt": "t = <file_sep>"},
    "mixed-ids": {"input_prefix": ["x = ", 42, "\ny = "], "input_suffix": [7, "\nprint(x)"]},
    "extra-cut": {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": LONG_EXTRA},
}
# Prompts of hundreds to thousands of tokens: compared with kvloom's prompt builder only, to keep the test fast.
LONG_CASES = {
    "suffix-cut": {"input_prefix": PREFIX, "input_suffix": LONG_CODE[:2400], "prompt": "if n"},
    "prefix-cut": {"input_prefix": LONG_CODE, "input_suffix": SUFFIX},
}


@pytest.mark.parametrize("case", list(INFILL_CASES))
def test_infill_prompt_and_greedy_tokens_are_llama_servers(case: str, ggufs: dict[str, str],
                                                           llama_keys: LlamaServer, kvloom_keys: Any) -> None:
    body = INFILL_CASES[case]
    theirs, answer = llama_keys.infill(body)
    tokenizer = load_tokenizer(resolve_model(ggufs["keys"]))
    assert kvloom_prompt(tokenizer, body) == theirs
    response = httpx.post(kvloom_keys.url + "/infill", json={**body, "n_predict": N_PREDICT, "temperature": 0},
                          timeout=300)
    assert response.status_code == 200, response.text
    ours = response.json()
    assert ours["tokens_evaluated"] == len(theirs)
    assert ours["prompt"] == answer["prompt"]
    assert_same_greedy_tokens(ours["tokens"], answer)
    if case == "extra-cut":  # the extra context's last n_ctx - n_batch - 2 * n_predict tokens, then the prefix
        assert theirs.index(KEYS["tokenizer.ggml.fim_pre_token_id"]) == N_CTX - LLAMA_SERVER_N_BATCH + 2


@pytest.mark.parametrize("case", list(LONG_CASES))
def test_long_inputs_are_cut_as_llama_server_cuts_them(case: str, ggufs: dict[str, str],
                                                       llama_keys: LlamaServer) -> None:
    """The prefix keeps its last 3 * n_batch / 4 tokens; the suffix its first n_batch / 4 - 2 - len(prompt)."""
    body = LONG_CASES[case]
    theirs, _ = llama_keys.infill(body)
    tokenizer = load_tokenizer(resolve_model(ggufs["keys"]))
    assert kvloom_prompt(tokenizer, body) == theirs
    pre, suf = (theirs.index(KEYS[f"tokenizer.ggml.fim_{role}_token_id"]) for role in ("pre", "suf"))
    prompt_len = len(tokenizer.encode(body.get("prompt", ""), add_special_tokens=False))
    if case == "prefix-cut":
        assert suf - pre - 1 == 3 * (LLAMA_SERVER_N_BATCH // 4)
    else:
        assert len(theirs) - 1 - suf - 1 == LLAMA_SERVER_N_BATCH // 4 - 2 - prompt_len


def test_suffix_on_completions_is_llama_servers_infill(llama_keys: LlamaServer, kvloom_keys: Any) -> None:
    """OpenAI's suffix (llama-server's /v1/completions refuses it): /infill's prompt of prompt and suffix; from
    kvloom's server, every id after the first (prompt_logprobs) is llama-server's."""
    theirs, answer = llama_keys.infill({"input_prefix": PREFIX, "input_suffix": SUFFIX})
    client = openai.OpenAI(base_url=kvloom_keys.url + "/v1", api_key="none", max_retries=0, timeout=300)
    completion = client.completions.create(model="smollm2-fim", prompt=PREFIX, suffix=SUFFIX, max_tokens=N_PREDICT,
                                           temperature=0, extra_body={"prompt_logprobs": 0})
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(entry) == 1 for entry in entries[1:])
    assert completion.usage.prompt_tokens == len(theirs)
    assert [int(next(iter(entry))) for entry in entries[1:]] == theirs[1:]
    if completion.choices[0].text != answer["content"]:  # a near tie: the tokens say where
        ours = httpx.post(kvloom_keys.url + "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                                             "n_predict": N_PREDICT, "temperature": 0}, timeout=300)
        assert_same_greedy_tokens(ours.json()["tokens"], answer)


SNIPPET_CASES = {
    "extra-files": {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "return"},
    "extra-cut": {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": LONG_EXTRA},
}


@pytest.mark.parametrize("case", list(SNIPPET_CASES))
def test_snippet_separated_extra_context_is_llama_servers(case: str, ggufs: dict[str, str],
                                                          llama_texts: LlamaServer) -> None:
    """No file separator (the texts file): extra chunks after "--- snippet ---", filenames dropped; the
    repository token and "myproject" first, unless the budget cuts them."""
    body = SNIPPET_CASES[case]
    tokenizer = load_tokenizer(resolve_model(ggufs["texts"]))
    theirs, answer = llama_texts.infill(body)
    assert kvloom_prompt(tokenizer, body) == theirs
    assert tokenizer.decode(theirs, skip_special_tokens=False) == answer["prompt"]
    assert "--- snippet ---" in answer["prompt"]
    assert (theirs[0] == tokenizer.fim_token_ids["rep"]) == (case == "extra-files")
