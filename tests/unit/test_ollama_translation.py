"""Ollama's API translation without a server: ``keep_alive`` as Go's durations read it, messages (images, tool
calls and their results) as chat messages, the fill-in-the-middle prompt, and parameter sizes as Ollama writes
them."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import pytest

from kvloom.entrypoints.ollama.protocol import KEEP_ALIVE_FOREVER, OllamaMessage, parse_keep_alive
from kvloom.entrypoints.ollama.serving_chat import _chat_messages, fim_tokens, listed_name
from kvloom.entrypoints.ollama.serving_models import parameter_size
from kvloom.entrypoints.openai.serving_engine import APIError, OpenAIServing


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5), ("300ms", 0.3), ("2h45m10s", 9910.0),
    ("0", 0.0), (0, 0.0), (300, 300.0), (2.5, 2.5), (-1, KEEP_ALIVE_FOREVER), ("-1m", KEEP_ALIVE_FOREVER),
    ("+10s", 10.0), (".5h", 1800.0), ("10us", 1e-5), ("1µs", 1e-6)])
def test_keep_alive_is_read_as_go_durations_in_seconds(value: Any, seconds: float | None) -> None:
    assert parse_keep_alive(value) == (None if seconds is None else pytest.approx(seconds))


# A bare number in a string ("5", "-1") is no Go duration: only 0 goes without a unit.
@pytest.mark.parametrize("value", ["5", "-1", "five minutes", "5 m", "m", "", "1d", True, [5], float("nan")])
def test_keep_alive_refuses_what_is_not_a_duration(value: Any) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


def test_messages_become_chat_messages() -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(16)).decode()
    jpeg = base64.b64encode(b"\xff\xd8\xff\xe0" + bytes(16)).decode()
    messages = [OllamaMessage(role="SYSTEM", content="Be brief."),
                OllamaMessage(role="user", content="What is this?", images=[png, jpeg]),
                OllamaMessage(role="assistant", content="", thinking="Two tools.", tool_calls=[
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"id": "call_t", "function": {"name": "get_time", "arguments": {}}}]),
                OllamaMessage(role="tool", content="12:00", tool_name="get_time"),
                OllamaMessage(role="tool", content="21 C")]
    chat = _chat_messages(messages)
    assert chat[0] == {"role": "system", "content": "Be brief."}
    assert chat[1] == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{jpeg}"}},
        {"type": "text", "text": "What is this?"}]}
    assert chat[2] == {"role": "assistant", "content": "", "reasoning_content": "Two tools.", "tool_calls": [
        {"id": "call_2_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_t", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    # A result names its tool: it answers that call; one that names none answers the oldest unanswered call.
    assert chat[3] == {"role": "tool", "tool_call_id": "call_t", "content": "12:00", "name": "get_time"}
    assert chat[4] == {"role": "tool", "tool_call_id": "call_2_0", "content": "21 C"}
    assert json.loads(chat[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize(("message", "words"), [
    (OllamaMessage(role="robot", content="x"), "role must be one of"),
    (OllamaMessage(role="assistant", content="x", images=["aGVsbG8="]), "only a user message"),
    (OllamaMessage(role="user", content="x", tool_calls=[{"function": {"name": "f"}}]), "only an assistant"),
    (OllamaMessage(role="user", content="x", images=["not base64!"]), "not base64")])
def test_bad_messages_are_refused_naming_where(message: OllamaMessage, words: str) -> None:
    with pytest.raises(APIError, match=words) as error:
        _chat_messages([message])
    assert error.value.status_code == 400 and "messages[0]" in error.value.message


class _Tokenizer:
    """A tokenizer with a BOS, one token per character and, where given, FIM tokens."""

    bos_token_id = 1

    def __init__(self, special: dict[str, int]) -> None:
        self.special = special

    def token_to_id(self, token: str) -> int | None:
        return self.special.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


class _Serving:
    fim_tokens = OpenAIServing.fim_tokens  # the serving's own lookup, over this fake's tokenizer

    def __init__(self, tokenizer: _Tokenizer) -> None:
        self.tokenizer = tokenizer


def test_suffix_takes_the_fim_tokens_infill_takes_or_a_400() -> None:
    """generate's suffix builds its prompt as /infill does (openai/fim.py, llama.cpp's construction); its FIM tokens
    are fim.py's, and a model without them gets a 400 in Ollama's words."""
    class FimTokenizer:
        def __init__(self, ids: dict[str, int]) -> None:
            self.fim_token_ids = ids

    coder = _Serving(FimTokenizer({"pre": 900, "suf": 901, "mid": 902, "pad": 903}))
    fim = fim_tokens(coder, "coder")
    assert (fim.pre, fim.suf, fim.mid) == (900, 901, 902) and 903 in fim.end_of_generation_ids
    with pytest.raises(APIError, match='"chat" does not support insert') as error:
        fim_tokens(_Serving(FimTokenizer({"pre": 900})), "chat")
    assert error.value.status_code == 400 and "suffix token is missing" in error.value.message


def test_names_and_sizes_as_ollama_writes_them() -> None:
    assert listed_name("tiny") == "tiny:latest" and listed_name("llama3:8b") == "llama3:8b"
    assert [parameter_size(n) for n in (134_515_008, 7_615_616_512, 52_000, 12)] == ["134.5M", "7.6B", "52.0K", "12"]
    assert math.isinf(KEEP_ALIVE_FOREVER)
