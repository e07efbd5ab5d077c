"""Reasoning models through the server (``--reasoning-parser``), with the official ``openai`` client, on a tiny
random model whose tokenizer has ``<think>`` / ``</think>`` tokens. A logit bias on ``</think>`` makes the
model end its reasoning after a few tokens. The oracle is the raw text of the same sampling through
/v1/completions (which no reasoning parser touches), split at the first ``</think>``."""

from __future__ import annotations

import json
import os
from typing import Any

import jsonschema
import openai
import pytest
import tiny_models
from tokenizers import Tokenizer

# A bias on </think> (id 401): the tiny model writes a few tokens of reasoning, then closes it.
END_BIAS = {str(tiny_models.TOKENIZER_VOCAB_SIZE + 1): 6.0}
SEEDS = range(4)
QUESTION = "Why is the sky blue?"
# Qwen3's way: the generation prompt opens <think> (Qwen3.5 / thinking-2507 templates), or, with
# enable_thinking false, holds an empty closed block (unless `bare` is given: a template that writes none).
# DeepSeek-R1's: nothing opened, the reasoning is implicit.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking and bare is not defined %}<think>\n\n</think>\n\n"
            "{% elif opens_think %}<think>\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"topic": {"enum": ["sky", "sea"]}}, "required": ["topic"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def reasoning_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with <think> and </think> added to its tokenizer (ids 400, 401; non-special, as Qwen3's)."""
    path = str(tmp_path_factory.mktemp("tiny_reasoning"))
    tiny_models.build_tiny_checkpoint(path, arch="llama", vocab_size=tiny_models.TOKENIZER_VOCAB_SIZE + 2)
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    return path


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def server(request: pytest.FixtureRequest, reasoning_model_dir: str, server_factory: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Any:
    parser = request.param
    template = tmp_path_factory.mktemp("template") / f"{parser}.jinja"
    template.write_text(("{% set opens_think = true %}" if parser == "qwen3" else "{% set opens_think = false %}")
                        + TEMPLATE)
    # No free whitespace in JSON: the reasoning's newlines are text a JSON grammar would refuse.
    with server_factory(reasoning_model_dir, "--max-model-len", "512", "--chat-template", str(template),
                        "--reasoning-parser", parser, "--structured-outputs-config",
                        '{"disable_any_whitespace": true}') as s:
        s.parser = parser
        yield s


@pytest.fixture
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def prompt_text(server: Any, enable_thinking: bool = True) -> str:
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    if not enable_thinking:
        return prompt + "<think>\n\n</think>\n\n"
    return prompt + ("<think>\n" if server.parser == "qwen3" else "")


def raw_reply(client: openai.OpenAI, server: Any, seed: int, enable_thinking: bool = True,
              max_tokens: int = 24) -> str:
    return client.completions.create(model=server.model, prompt=prompt_text(server, enable_thinking),
                                     max_tokens=max_tokens,
                                     temperature=0.8, seed=seed, logit_bias=END_BIAS).choices[0].text


def split(raw: str) -> tuple[str | None, str | None]:
    reasoning, _, content = raw.partition("</think>")
    return reasoning or None, content or None


def chat(client: openai.OpenAI, server: Any, seed: int, max_tokens: int = 24, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=max_tokens, temperature=0.8, seed=seed, logit_bias=END_BIAS,
                                          **kwargs)


def streamed(client: openai.OpenAI, server: Any, seed: int, **kwargs: Any) -> tuple[str | None, str | None]:
    reasoning, content = [], []
    for chunk in chat(client, server, seed, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning) or None, "".join(content) or None


def test_reasoning_goes_to_reasoning_content_whole_and_streamed(client: openai.OpenAI, server: Any) -> None:
    both = 0
    for seed in SEEDS:
        expected = split(raw_reply(client, server, seed))
        message = chat(client, server, seed).choices[0].message
        assert (message.reasoning_content, message.content) == expected, seed
        assert streamed(client, server, seed) == expected, seed
        both += all(expected)
    assert both, "no seed gave both reasoning and content: the test would not tell them apart"


def test_enable_thinking_false_means_no_reasoning(client: openai.OpenAI, server: Any) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed in SEEDS:
        raw = raw_reply(client, server, seed, enable_thinking=False)
        message = chat(client, server, seed, extra_body=off).choices[0].message
        assert message.reasoning_content is None
        assert message.content == raw
        assert streamed(client, server, seed, extra_body=off) == (None, raw or None)


def test_json_schema_constrains_only_the_content_after_the_reasoning(client: openai.OpenAI, server: Any) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    ended = 0
    for seed in SEEDS:
        raw = raw_reply(client, server, seed, max_tokens=64)
        reasoning, _ = split(raw)
        if "</think>" not in raw:  # still reasoning at max_tokens: nothing constrained it
            reply = chat(client, server, seed, response_format=response_format, max_tokens=64).choices[0]
            assert (reply.message.reasoning_content, reply.message.content) == (raw, None)
            assert reply.finish_reason == "length"
            continue
        # Tokens enough for the JSON after a reasoning of at most 64.
        reply = chat(client, server, seed, response_format=response_format, max_tokens=128).choices[0]
        # The reasoning is the unconstrained sampling's (not JSON: the grammar would have made it start with
        # '{'), and the content after it follows the schema.
        assert reply.message.reasoning_content == reasoning and reasoning and not reasoning.startswith("{")
        ended += 1
        jsonschema.validate(json.loads(reply.message.content), SCHEMA)
        assert reply.finish_reason == "stop"
        # Streamed: the same split.
        assert streamed(client, server, seed, response_format=response_format, max_tokens=128) == (
            reasoning, reply.message.content)
    assert ended, "no seed ended its reasoning: the grammar was never tried"


def test_thinking_off_constrains_the_content_at_once_whatever_the_template(client: openai.OpenAI,
                                                                          server: Any) -> None:
    """enable_thinking false with a template that writes no closed think block into the prompt (DeepSeek-R1's reply
    reasons implicitly): the reply is all content, and the JSON schema constrains it from its first token (the
    grammar's reasoning gate used to wait for a ``</think>`` that this reply never writes)."""
    if server.parser != "deepseek_r1":
        pytest.skip("Qwen3's template opens <think> in the prompt itself")
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    off = {"chat_template_kwargs": {"enable_thinking": False, "bare": True}}
    for seed in SEEDS:
        reply = chat(client, server, seed, response_format=response_format, max_tokens=64, extra_body=off).choices[0]
        assert reply.message.reasoning_content is None
        jsonschema.validate(json.loads(reply.message.content), SCHEMA)
        assert reply.finish_reason == "stop"


def test_a_forced_tool_call_is_read_from_the_content_after_the_reasoning(client: openai.OpenAI,
                                                                        server: Any) -> None:
    reasoning, _ = split(raw_reply(client, server, 0, max_tokens=64))
    assert reasoning and "</think>" in raw_reply(client, server, 0, max_tokens=64)
    reply = chat(client, server, 0, tools=[TOOL], max_tokens=128,
                 tool_choice={"type": "function", "function": {"name": "lookup"}}).choices[0]
    assert reply.message.reasoning_content == reasoning
    [call] = reply.message.tool_calls
    assert call.function.name == "lookup"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    # Streamed: the reasoning deltas, then the call's deltas, which add up to the same call.
    thought, arguments, names = [], [], []
    for chunk in chat(client, server, 0, tools=[TOOL], max_tokens=128, stream=True,
                      tool_choice={"type": "function", "function": {"name": "lookup"}}):
        for choice in chunk.choices:
            thought.append(getattr(choice.delta, "reasoning_content", None) or "")
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or ():
                names.append(delta.function.name or "")
                arguments.append(delta.function.arguments or "")
    assert "".join(thought) == reasoning
    assert "".join(names) == "lookup" and "".join(arguments) == call.function.arguments
