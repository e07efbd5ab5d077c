"""Schemathesis hooks for benchmarks/fuzz_api.py (loaded through SCHEMATHESIS_HOOKS=fuzz_hooks).

Generated bodies rarely get past the first check, so the fuzzer would mostly test error paths:
a generated ``model`` is almost never the served one (404), and the schema allows ``messages: []``,
messages without a role and ``prompt: ""`` (400). In three bodies of four this names the served
model (``KVLOOM_FUZZ_MODEL``) and, where messages or the prompt would be refused, puts in one user
message or one word; every other field stays as generated. The choice is a checksum of the body,
so a seed reproduces the run.
"""

import json
import os
import zlib
from typing import Any

import schemathesis

SERVED_MODEL = os.environ.get("KVLOOM_FUZZ_MODEL", "tiny")
ROLES = ("system", "user", "assistant", "tool")


def _messages_ok(messages: Any) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages)


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    body = case.body
    if not isinstance(body, dict):
        return case
    if zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % 4 == 0:
        return case
    if isinstance(body.get("model"), str):
        body["model"] = SERVED_MODEL
    if "messages" in body and not _messages_ok(body["messages"]):
        body["messages"] = [{"role": "user", "content": "Tell me a story."}]
    if body.get("prompt") in ("", []):
        body["prompt"] = "Once upon a time"
    return case
