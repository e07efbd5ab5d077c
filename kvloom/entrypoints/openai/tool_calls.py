"""Tool calling: checking ``tools`` / ``tool_choice``, the grammar that forces a tool call, and the parsers
that find tool calls in a model's text (vLLM's ``--tool-call-parser`` names).

``tool_choice``:
- ``"none"``: the tools go to the chat template, the text comes back as content.
- ``"auto"`` (the default when tools are given): the model decides; the parser of
  ``--tool-call-parser`` (with ``--enable-auto-tool-choice``) finds the calls in its text.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects, each
  ``parameters`` valid against its function's schema (vLLM's shape).
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's arguments object.
The forced grammars are written without free whitespace: arguments are a JSON string anyway, and a small
model would otherwise spend tokens on it.

Streaming: content streams as it comes, holding back only text that may begin a tool-call marker; a tool
call is sent when it is complete, as OpenAI sends one (a first delta with its index, id, type and name
and empty arguments, then the arguments). A named function's arguments stream as they are generated.
Either way the concatenated argument fragments equal the non-streamed ``arguments``.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvloom.sampling_params import StructuredOutputsParams


class ToolError(ValueError):
    """A tools / tool_choice problem; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


# ---- the request -----------------------------------------------------------------------------------

def check_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The functions by name; ToolError naming ``tools`` for anything but OpenAI's function tools."""
    functions: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ..., "
                            f"'parameters': {{...}}}}}}, got {tool!r:.120}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(f"tools[{index}].function.name must be 1 to 64 letters, digits, '_', '.' or '-', "
                            f"got {name!r}", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"tools[{index}].function.parameters must be a JSON schema object", "tools")
        if name in functions:
            raise ToolError(f"tools holds two functions named {name!r}", "tools")
        functions[name] = {**function, "parameters": parameters}
    return functions


def resolve_tool_choice(tool_choice: str | dict[str, Any] | None, functions: dict[str, dict[str, Any]],
                        auto_enabled: bool) -> str:
    """'none', 'auto', 'required' or the forced function's name; ToolError naming ``tool_choice``."""
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                            f"'function': {{'name': ...}}}}, got {tool_choice!r:.120}", "tool_choice")
        if name not in functions:
            raise ToolError(f"tool_choice names the function {name!r}, which is not in tools "
                            f"(defined: {sorted(functions)})", "tool_choice")
        return "function:" + name
    if tool_choice not in ("none", "auto", "required"):
        raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                        f"'function': {{'name': ...}}}}, got {tool_choice!r}", "tool_choice")
    if tool_choice != "none" and not functions:
        raise ToolError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    if tool_choice == "auto" and not auto_enabled:
        raise ToolError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                        "tool_choice")
    return tool_choice


def forced_tool_constraint(choice: str, functions: dict[str, dict[str, Any]],
                           parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The grammar of a 'required' or named tool choice (None for 'none' and 'auto')."""
    if choice.startswith("function:"):
        return StructuredOutputsParams(json=functions[choice[len("function:"):]]["parameters"],
                                       disable_any_whitespace=True)
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": function["parameters"]},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, function in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def forced_tool_calls(choice: str, text: str) -> list[ParsedToolCall]:
    """The calls of a forced output. A named function's arguments are the text itself, also when it was cut short
    (as its streamed arguments were). 'required' gives a JSON array of {"name", "parameters"}: the calls
    complete in it, so an array cut by max_tokens gives the calls before the cut."""
    if choice.startswith("function:"):
        return [ParsedToolCall(choice[len("function:"):], text)] if text else []
    return [ParsedToolCall(call["name"], _dumps(call["parameters"])) for call in _complete_items(text)
            if isinstance(call, dict) and isinstance(call.get("name"), str) and "parameters" in call]


def _complete_items(text: str) -> list[Any]:
    """The complete values at the start of the JSON array ``text``, which may be cut anywhere."""
    decoder, items = json.JSONDecoder(), []
    position = len(text) - len(text.lstrip())
    if not text.startswith("[", position):
        return items
    position += 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return items
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return items
        items.append(item)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---- parsers of a model's own tool-call format -------------------------------------------------------

class ToolParser:
    """Finds tool calls in generated text. ``split`` is the one method a format writes."""

    name = ""

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall], bool]:
        """(the content before the tool calls, the complete calls so far, whether a tool-call section has
        begun). ``final``: the text is whole (an unterminated last call may be taken if it parses)."""
        raise NotImplementedError

    def held_back(self, text: str) -> int:
        """How many characters at the end of ``text`` may be the start of a tool-call marker."""
        return 0

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a whole output; no call found: all of it is content."""
        content, calls, _ = self.split(text, final=True)
        if not calls:
            return text, []
        return (content if content.strip() else None), calls


def _marker_prefix_length(text: str, marker: str) -> int:
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def _call_from_json(obj: Any) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ParsedToolCall(obj["name"], _dumps(arguments))


def _json_values(text: str) -> tuple[list[Any], str]:
    """The JSON values at the start of ``text`` separated by whitespace, ';' or ','; and what follows."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;,":
            position += 1
        if position >= len(text):
            return values, ""
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return values, text[position:]
        values.append(value)


class HermesToolParser(ToolParser):
    """Hermes / Qwen / ChatML models: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall], bool]:
        first = text.find(self.start)
        if first < 0:
            return text, [], False
        calls, position = [], first
        while True:
            begin = text.find(self.start, position)
            if begin < 0:
                break
            stop = text.find(self.end, begin)
            body = text[begin + len(self.start):stop if stop >= 0 else len(text)]
            if stop < 0 and not final:
                break
            values, _ = _json_values(body.strip())
            call = _call_from_json(values[0]) if values else None
            if call is not None:
                calls.append(call)
            if stop < 0:
                break
            position = stop + len(self.end)
        return text[:first], calls, True

    def held_back(self, text: str) -> int:
        return _marker_prefix_length(text, self.start)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally after
    ``<|python_tag|>``), several separated by ';'."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall], bool]:
        body = text.lstrip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].lstrip()
        elif not body.startswith("{"):
            return text, [], bool(body) and self.tag.startswith(body)
        values, _ = _json_values(body)
        calls = [call for call in map(_call_from_json, values) if call is not None]
        return "", calls, True

    def held_back(self, text: str) -> int:
        # Before the first non-space character it is not known whether this is a call.
        return len(text) if not text.strip() else 0


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

    name = "mistral"
    marker = "[TOOL_CALLS]"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall], bool]:
        first = text.find(self.marker)
        if first < 0:
            return text, [], False
        values, _ = _json_values(text[first + len(self.marker):])
        calls = []
        for value in values:
            for item in value if isinstance(value, list) else [value]:
                call = _call_from_json(item)
                if call is not None:
                    calls.append(call)
        return text[:first], calls, True

    def held_back(self, text: str) -> int:
        return _marker_prefix_length(text, self.marker)


class PythonicToolParser(ToolParser):
    """Llama 3.2 / 4 pythonic calls: the output is ``[get_weather(city="Paris"), f(x=1)]``."""

    name = "pythonic"

    def split(self, text: str, final: bool) -> tuple[str, list[ParsedToolCall], bool]:
        body = text.strip()
        if not body.startswith("["):
            return text, [], False
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return "", [], True
        if not isinstance(tree, ast.List):
            return "", [], True
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return "", [], True
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return "", [], True
            calls.append(ParsedToolCall(node.func.id, _dumps(arguments)))
        return "", calls, True

    def held_back(self, text: str) -> int:
        return len(text) if not text.strip() else 0


TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not available; choose one of {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


# ---- streaming -------------------------------------------------------------------------------------

@dataclass
class ToolCallDelta:
    """One element of ``delta.tool_calls``: the first for a call carries id, type and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


class ToolCallStream:
    """Turns a completion's text deltas into content deltas and tool-call deltas (one per choice)."""

    def __init__(self, parser: ToolParser | None, forced: str | None = None, max_calls: int | None = None) -> None:
        """``parser``: for tool_choice 'auto'; ``forced``: 'required' or 'function:NAME'; ``max_calls``: 1 where
        ``parallel_tool_calls`` is false (the grammar bounds forced calls; 'auto' keeps the first)."""
        self.parser = parser
        self.forced = forced
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = 0
        self.calls: list[ParsedToolCall] = []
        self.sent_arguments = 0  # a named function's: the characters of arguments sent

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """(content delta, tool-call deltas) after ``delta``; ``final``: the completion has ended."""
        self.text += delta
        if self.forced is not None and self.forced.startswith("function:"):
            return "", self._named_deltas()
        if self.forced == "required":
            # A call is sent once its object closes, so a list cut by max_tokens has sent its complete calls.
            calls = forced_tool_calls(self.forced, self.text) if final or "}" in delta else []
            return "", self._new_calls(calls)
        content, calls, started = self.parser.split(self.text, final)
        if final and not calls:
            content = self.text  # no call could be read: everything is content, as the whole response says
        elif not started and not final:
            content = content[:len(content) - self.parser.held_back(content)]
        content_delta = content[self.sent_content:] if len(content) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(content))
        return content_delta, self._new_calls(calls)

    def _named_deltas(self) -> list[ToolCallDelta]:
        deltas = []
        if not self.calls:
            self.calls.append(ParsedToolCall(self.forced[len("function:"):], ""))
            deltas.append(ToolCallDelta(0, "", self.calls[0].id, self.calls[0].name))
        if len(self.text) > self.sent_arguments:
            deltas.append(ToolCallDelta(0, self.text[self.sent_arguments:]))
            self.sent_arguments = len(self.text)
        self.calls[0].arguments = self.text
        return deltas

    def _new_calls(self, calls: list[ParsedToolCall]) -> list[ToolCallDelta]:
        deltas = []
        for call in calls[len(self.calls):self.max_calls]:
            index = len(self.calls)
            self.calls.append(call)
            deltas.append(ToolCallDelta(index, "", call.id, call.name))
            deltas.append(ToolCallDelta(index, call.arguments))
        return deltas
