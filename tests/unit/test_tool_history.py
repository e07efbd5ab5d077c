"""Tool-loop histories (assistant tool calls with content null / "" / absent, several calls a turn, tool results)
rendered by the chat templates kvloom ships or reads: a template with a tool section renders them as transformers
does; one without renders them as the documented Hermes text; a section that refuses the history (Llama 3.1's, one
call a turn) falls back to that text. And forced tool calls cut by max_tokens give their complete calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tiny_models

from kvloom.entrypoints.openai.tool_calls import ToolCallStream, forced_tool_calls, get_tool_parser
from kvloom.loader.tokenizer import Tokenizer, load_tokenizer, template_tool_sections
from kvloom.loader.weights import resolve_model

ROOT = Path(__file__).resolve().parents[2]
HERMES_TEMPLATE = (ROOT / "examples" / "tool_chat_template_hermes.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALLS = [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
# Llama 3.1's tool section in short: one call a turn, tool results as "ipython".
LLAMA31_LIKE = (
    "{% for m in messages %}{% if 'tool_calls' in m %}{% if m.tool_calls | length != 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{{ m.tool_calls[0].function | tojson }}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Mistral-style: user and assistant must alternate.
ALTERNATING = (
    "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")


def _history(content: Any) -> list[dict[str, Any]]:
    assistant: dict[str, Any] = {"role": "assistant", "tool_calls": CALLS}
    if content != "absent":
        assistant["content"] = content
    return [{"role": "user", "content": "Weather in Paris and Rome?"}, assistant,
            {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "21 C"}]}]


def _as_transformers_takes_it(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history in transformers' convention: arguments as dicts, content strings."""
    out = []
    for message in history:
        message = dict(message)
        if "tool_calls" in message:
            message["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in message["tool_calls"]]
            message["content"] = message.get("content") or ""
        if isinstance(message.get("content"), list):
            message["content"] = "\n".join(part["text"] for part in message["content"])
        out.append(message)
    return out


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path: str) -> Tokenizer:
    return load_tokenizer(resolve_model(smollm2_gguf_path))


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir: str) -> tuple[Tokenizer, Any]:
    """(ours, transformers') for the tiny model: the template renders alike whatever the vocabulary."""
    from transformers import AutoTokenizer

    return load_tokenizer(resolve_model(tiny_llama_dir)), AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize("content", [None, "", "absent"])
def test_hermes_template_renders_the_history_as_transformers_does(tiny_pair: tuple[Tokenizer, Any],
                                                                   content: Any) -> None:
    ours, reference = tiny_pair
    history = _history(content)
    expected = reference.apply_chat_template(_as_transformers_takes_it(history), tools=[WEATHER],
                                             chat_template=HERMES_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(history, chat_template=HERMES_TEMPLATE, tools=[WEATHER]) == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in expected
    assert template_tool_sections(HERMES_TEMPLATE) == (True, True)


@pytest.mark.parametrize("content", [None, "", "absent", [{"type": "text", "text": "Looking."}]])
def test_smollm2_gguf_template_without_a_tool_section_renders_hermes_text(smollm2: Tokenizer, content: Any) -> None:
    assert template_tool_sections(smollm2.chat_template) == (False, False)
    said = "Looking.\n" if isinstance(content, list) else ""
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        f"<|im_start|>assistant\n{said}<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    prompt = smollm2.apply_chat_template(_history(content))
    assert prompt == expected
    # The calls written into the history are the ones the hermes parser reads back.
    _, calls = get_tool_parser("hermes").extract(expected.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Rome"})]


def test_tiny_models_template_and_a_user_turn_after_the_results(tiny_llama_dir: str) -> None:
    tokenizer = load_tokenizer(resolve_model(tiny_llama_dir))
    assert tokenizer.chat_template == tiny_models.CHATML_TEMPLATE
    history = [*_history(None), {"role": "user", "content": "And Oslo?"}]
    prompt = tokenizer.apply_chat_template(history, chat_template=ALTERNATING)
    # One user turn holds both results and the question, so roles alternate as the template demands.
    assert prompt.endswith("[INST] <tool_response>\n18 C\n</tool_response>\n<tool_response>\n21 C\n"
                           "</tool_response>\nAnd Oslo? [/INST]")
    assert "<|im_start|>tool" not in tokenizer.apply_chat_template(history)


def test_a_tool_section_that_refuses_the_history_falls_back_to_text(smollm2: Tokenizer) -> None:
    assert template_tool_sections(LLAMA31_LIKE) == (True, True)
    one_call = _history(None)[:3]
    one_call[1] = {**one_call[1], "tool_calls": CALLS[:1]}
    own = smollm2.apply_chat_template(one_call, chat_template=LLAMA31_LIKE)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}<|eot_id|>' in own  # its own section
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18 C<|eot_id|>" in own
    two_calls = smollm2.apply_chat_template(_history(None), chat_template=LLAMA31_LIKE)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|eot_id|>'
            in two_calls)
    assert "<|start_header_id|>user<|end_header_id|>\n\n<tool_response>\n18 C\n</tool_response>" in two_calls


def test_tool_calls_must_be_function_calls(smollm2: Tokenizer) -> None:
    history = _history(None)
    history[1] = {**history[1], "tool_calls": [{"id": "x", "type": "function"}]}
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\] must be"):
        smollm2.apply_chat_template(history)


# ---- forced calls cut by max_tokens ------------------------------------------------------------------

LIST = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}]')


def test_a_cut_required_list_gives_its_complete_calls() -> None:
    first_end = LIST.index("}}") + 2
    for cut in range(len(LIST) + 1):
        names = [(c.name, json.loads(c.arguments)) for c in forced_tool_calls("required", LIST[:cut])]
        complete = json.loads(LIST)[:(cut >= first_end) + (cut >= len(LIST) - 1)]
        assert names == [(c["name"], c["parameters"]) for c in complete], LIST[:cut]


def test_a_streamed_required_list_sends_each_call_as_it_closes() -> None:
    stream = ToolCallStream(None, "required")
    pieces = [LIST[i:i + 7] for i in range(0, len(LIST) - 20, 7)]  # cut before the second call closes
    sent = []
    for piece in pieces:
        content, deltas = stream.feed(piece, final=False)
        assert content == ""
        sent += deltas
    _, last = stream.feed("", final=True)
    assert [d.name for d in sent if d.name] == ["get_weather"] and not last
    assert json.loads("".join(d.arguments for d in sent)) == {"city": "Paris"}


def test_a_cut_named_call_keeps_its_streamed_arguments() -> None:
    calls = forced_tool_calls("function:get_weather", '{"city": "Par')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Par')]


def test_auto_with_parallel_tool_calls_false_streams_the_first_call_only() -> None:
    text = ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    stream = ToolCallStream(get_tool_parser("hermes"), max_calls=1)
    content, deltas = "", []
    for start in range(0, len(text), 5):
        piece, new = stream.feed(text[start:start + 5], final=False)
        content, deltas = content + piece, deltas + new
    piece, new = stream.feed("", final=True)
    content, deltas = content + piece, deltas + new
    assert content == "Sure." and [d.name for d in deltas if d.name] == ["get_weather"]
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris"}


# ---- forced calls end when their list closes -------------------------------------------------------------

def _allowed_after(tokenizer: Tokenizer, choice: str, text: str, parallel_tool_calls: bool = True) -> set[str]:
    """The tokens xgrammar allows after ``text`` under the forced grammar of ``choice``."""
    import torch

    from kvloom.entrypoints.openai.tool_calls import check_tools, forced_tool_constraint
    from kvloom.structured_output.xgrammar_backend import XgrammarBackend

    eos = sorted(tokenizer.eos_token_ids)
    backend = XgrammarBackend(tokenizer, tokenizer.vocab_size, eos)
    constraint = forced_tool_constraint(choice, check_tools([WEATHER]), parallel_tool_calls)
    matcher = backend.new_matcher(backend.compile(constraint))
    assert matcher.matcher.accept_string(text)
    bitmask = torch.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return {tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size) if (bitmask[0, i // 32] >> (i % 32)) & 1}


def test_a_closed_call_list_or_arguments_object_allows_only_eos(tiny_pair: tuple[Tokenizer, Any]) -> None:
    tokenizer, _ = tiny_pair
    eos = {tokenizer.id_to_token(i) for i in tokenizer.eos_token_ids}
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert _allowed_after(tokenizer, "required", f"[{call}]") == eos
    assert _allowed_after(tokenizer, "function:get_weather", '{"city": "Paris"}') == eos
    assert _allowed_after(tokenizer, "required", f"[{call}", parallel_tool_calls=False) == {"]"}
    assert _allowed_after(tokenizer, "required", f"[{call}") >= {",", "]"}
