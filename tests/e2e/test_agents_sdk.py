"""The OpenAI Agents SDK (``openai-agents``) against a kvloom server on a tiny random model, through both of its
OpenAI models: ``OpenAIResponsesModel`` (``/v1/responses``) and ``OpenAIChatCompletionsModel``
(``/v1/chat/completions``). A two-turn tool loop: the first turn's tool choice is forced, so the random model
calls the tool; the SDK runs it and (``reset_tool_choice``, its default) asks again with the choice reset, and
the model's answer is the final output. The oracle for that answer is the server's Chat Completions reply to
the same conversation.

Over Responses the agent has a structured ``output_type``: the SDK takes an ``incomplete`` response (a random
model's text cut by max_tokens) as a failure, and the answer's schema is what ends the turn."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import openai
import pydantic
import pytest

agents = pytest.importorskip("agents")

from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem  # noqa: E402

from .test_structured_output_server import TOOL_SERVER_ARGS, template_file  # noqa: E402

set_tracing_disabled(True)
INSTRUCTIONS = "You answer questions about the weather."
QUESTION = "What is the weather in Paris?"


class Report(pydantic.BaseModel):
    sky: Literal["sunny", "rainy"]
    warm: bool


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with server_factory(tiny_llama_dir, *TOOL_SERVER_ARGS, "--chat-template", template_file(tmp_path_factory)) as s:
        yield s


def weather_agent(model: Any, calls: list[str], structured: bool) -> tuple[Agent, Any]:
    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = Agent(name="weather", instructions=INSTRUCTIONS, model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=80,
                                               parallel_tool_calls=False),
                  output_type=Report if structured else None)
    return agent, get_weather


def chat_oracle(server: Any, model: str, tool: Any, call: ToolCallItem, output: str, agent: Agent) -> str | None:
    """The server's Chat Completions answer after the tool call: the SDK's second turn, in the chat dialect."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    raw = call.raw_item
    call_id = raw.call_id if hasattr(raw, "call_id") else raw["call_id"]
    name = raw.name if hasattr(raw, "name") else raw["name"]
    arguments = raw.arguments if hasattr(raw, "arguments") else raw["arguments"]
    fields: dict[str, Any] = {}
    if agent.output_type is not None:
        schema = agent.output_type.model_json_schema() | {"additionalProperties": False}
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "final_output", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(
        model=model, temperature=0, max_completion_tokens=80, parallel_tool_calls=False, **fields,
        tools=[{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                 "parameters": tool.params_json_schema, "strict": True}}],
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
                  {"role": "tool", "tool_call_id": call_id, "content": output}])
    return reply.choices[0].message.content


@pytest.mark.parametrize("dialect", ["responses", "chat_completions"])
def test_two_turn_tool_loop(server: Any, dialect: str) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model_name = server.model
    model = (OpenAIResponsesModel(model=model_name, openai_client=client) if dialect == "responses"
             else OpenAIChatCompletionsModel(model=model_name, openai_client=client))
    calls: list[str] = []
    agent, tool = weather_agent(model, calls, structured=dialect == "responses")

    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=3))

    assert len(calls) == 1 and calls[0] in ("Paris", "Oslo")
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem]
    assert len(result.raw_responses) == 2  # the forced call, then the answer
    call = result.new_items[0]
    raw = call.raw_item
    arguments = raw.arguments if hasattr(raw, "arguments") else raw["arguments"]
    assert json.loads(arguments) == {"city": calls[0]}
    expected = chat_oracle(server, model_name, tool, call, f"sunny in {calls[0]}", agent)
    if dialect == "responses":
        assert result.final_output == Report.model_validate_json(expected)
    else:
        assert result.final_output == (expected or "")
    if expected:
        assert kinds[2:] == [MessageOutputItem]


def test_streamed_run_over_responses(server: Any) -> None:
    calls: list[str] = []

    async def run() -> tuple[Any, list[str], Any]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = OpenAIResponsesModel(model=server.model, openai_client=client)
        streamed = Runner.run_streamed(weather_agent(model, calls, structured=True)[0], QUESTION, max_turns=3)
        kinds = [event.type async for event in streamed.stream_events()]
        whole = await Runner.run(weather_agent(model, [], structured=True)[0], QUESTION, max_turns=3)
        return streamed, kinds, whole

    streamed, kinds, whole = asyncio.run(run())
    assert len(calls) == 1 and "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert isinstance(streamed.final_output, Report) and streamed.final_output == whole.final_output
