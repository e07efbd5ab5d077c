"""Tool-call parsers (hermes, llama3_json, mistral, pythonic): whole outputs, the same outputs streamed in
small pieces (the deltas must reassemble into the whole result), several calls, malformed output; and the
tools / tool_choice checks and the grammar a forced tool call gets."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from kvloom.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolError,
    check_tools,
    forced_tool_calls,
    forced_tool_constraint,
    get_tool_parser,
    resolve_tool_choice,
)

ROOT = Path(__file__).resolve().parents[2]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

# parser -> (output text, expected content, expected calls as (name, arguments dict))
CASES = {
    "hermes": [
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         "Let me check.\n", [("get_weather", {"city": "Paris"})]),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
         None, [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {"zone": "CET"})]),
        # No closing tag before EOS: the call is still read at the end.
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
        ("Just text, a < sign and <tool but no call.", "Just text, a < sign and <tool but no call.", []),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # malformed: content
         '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "PST"}}; '
         '{"name": "get_weather", "parameters": {"city": "LA"}}',
         None, [("get_time", {"zone": "PST"}), ("get_weather", {"city": "LA"})]),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"name": "get_weather", "parameters": {"ci', '{"name": "get_weather", "parameters": {"ci', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]',
         None, [("get_weather", {"city": "Lyon"}), ("get_time", {"zone": "CET"})]),
        ("No tools needed.", "No tools needed.", []),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci', '[TOOL_CALLS][{"name": "get_weather", '
         '"arguments": {"ci', []),
    ],
    "pythonic": [
        ('[get_weather(city="Nice", unit="c"), get_time(zone="CET")]', None,
         [("get_weather", {"city": "Nice", "unit": "c"}), ("get_time", {"zone": "CET"})]),
        ("Plain answer.", "Plain answer.", []),
        ("[get_weather(city=", "[get_weather(city=", []),
    ],
}


def flat(calls: list) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("parser_name", sorted(CASES))
def test_whole_outputs(parser_name: str) -> None:
    parser = get_tool_parser(parser_name)
    for text, content, calls in CASES[parser_name]:
        got_content, got_calls = parser.extract(text)
        assert (got_content, flat(got_calls)) == (content, calls), text


@pytest.mark.parametrize("parser_name", sorted(CASES))
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_outputs_reassemble(parser_name: str, piece: int) -> None:
    parser = get_tool_parser(parser_name)
    for text, content, calls in CASES[parser_name]:
        stream = ToolCallStream(parser)
        streamed_content, arguments, names, ids = "", {}, {}, {}
        pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
        for number, chunk in enumerate(pieces):
            delta_content, deltas = stream.feed(chunk, final=number == len(pieces) - 1)
            streamed_content += delta_content
            for delta in deltas:
                as_dict = delta.to_dict()
                if "id" in as_dict:
                    assert as_dict["type"] == "function" and as_dict["index"] not in ids
                    ids[as_dict["index"]] = as_dict["id"]
                    names[as_dict["index"]] = as_dict["function"]["name"]
                arguments[as_dict["index"]] = arguments.get(as_dict["index"], "") + as_dict["function"]["arguments"]
        got = [(names[i], json.loads(arguments[i])) for i in sorted(names)]
        assert got == calls, text
        # The whole response's content, or with no call everything; a stream never unsends text.
        expected_content = content if calls else text
        assert streamed_content == (expected_content or streamed_content), text
        if not calls:
            assert streamed_content == text


def test_named_function_arguments_stream_as_generated() -> None:
    stream = ToolCallStream(None, "function:get_weather")
    deltas = []
    for chunk, final in [('{"city"', False), (': "Bern"', False), ("}", True)]:
        content, new = stream.feed(chunk, final)
        assert content == ""
        deltas += [d.to_dict() for d in new]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["index"] == 0
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Bern"}'


def test_tool_and_tool_choice_checks() -> None:
    functions = check_tools([WEATHER, TIME])
    assert resolve_tool_choice(None, functions, auto_enabled=True) == "auto"
    assert resolve_tool_choice("none", functions, auto_enabled=False) == "none"
    assert resolve_tool_choice("required", functions, auto_enabled=False) == "required"
    assert resolve_tool_choice({"type": "function", "function": {"name": "get_time"}}, functions,
                               False) == "function:get_time"
    with pytest.raises(ToolError, match="requires --enable-auto-tool-choice") as error:
        resolve_tool_choice("auto", functions, auto_enabled=False)
    assert error.value.param == "tool_choice"
    with pytest.raises(ToolError, match="'nope', which is not in tools"):
        resolve_tool_choice({"type": "function", "function": {"name": "nope"}}, functions, True)
    with pytest.raises(ToolError, match="tool_choice must be"):
        resolve_tool_choice("sometimes", functions, True)
    with pytest.raises(ToolError, match=r"tools\[0\] must be") as error:
        check_tools([{"type": "function"}])
    assert error.value.param == "tools"
    with pytest.raises(ToolError, match="two functions named"):
        check_tools([WEATHER, WEATHER])


def test_forced_tool_grammars_and_their_calls() -> None:
    functions = check_tools([WEATHER, TIME])
    named = forced_tool_constraint("function:get_weather", functions)
    assert named.json == WEATHER["function"]["parameters"]
    required = forced_tool_constraint("required", functions, parallel_tool_calls=False)
    output = [{"name": "get_time", "parameters": {"zone": "UTC"}}]
    jsonschema.validate(output, required.json)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(output * 2, required.json)  # parallel_tool_calls=False: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "x"}}], required.json)
    assert flat(forced_tool_calls("required", json.dumps(output))) == [("get_time", {"zone": "UTC"})]
    assert flat(forced_tool_calls("function:get_weather", '{"city": "Bern"}')) == [("get_weather", {"city": "Bern"})]
    assert forced_tool_calls("required", '[{"name": "get_ti') == []  # cut by max_tokens
    assert forced_tool_constraint("auto", functions) is None


def test_the_shipped_hermes_template_renders_tools_and_history(smollm2_gguf_path: str) -> None:
    from kvloom.loader.tokenizer import load_tokenizer
    from kvloom.loader.weights import resolve_model

    tokenizer = load_tokenizer(resolve_model(smollm2_gguf_path))
    template = (ROOT / "examples" / "tool_chat_template_hermes.jinja").read_text()
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    prompt = tokenizer.apply_chat_template(history, chat_template=template, tools=[WEATHER])
    assert '<tools>\n{"name": "get_weather", "parameters": {' in prompt  # the tool is described
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 C\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    # Without tools it is the model's own template.
    assert (tokenizer.apply_chat_template(history[:1], chat_template=template)
            == tokenizer.apply_chat_template(history[:1]))
    # What the template asks for is what the hermes parser reads.
    _, calls = get_tool_parser("hermes").extract(prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])
    assert flat(calls) == [("get_weather", {"city": "Paris"})]
