"""The documented chat-message schema says what the server enforces: a non-empty list of messages with a role
from the chat roles (the server's own check gives the 400s; the schema tells clients)."""

from __future__ import annotations

import pytest

from kvloom.entrypoints.openai.protocol import ChatCompletionRequest
from kvloom.loader.tokenizer import CHAT_ROLES, _validate_messages


def test_messages_schema_matches_the_server_rules() -> None:
    schema = ChatCompletionRequest.model_json_schema()["properties"]["messages"]
    assert schema["minItems"] == 1
    assert schema["items"]["required"] == ["role"]
    assert schema["items"]["properties"]["role"]["enum"] == list(CHAT_ROLES)
    # What the schema documents is what the check refuses.
    with pytest.raises(ValueError, match="non-empty list"):
        _validate_messages([])
    with pytest.raises(ValueError, match="allowed roles"):
        _validate_messages([{"content": "no role"}])
    for role in CHAT_ROLES:
        _validate_messages([{"role": role, "content": "hi"}])
