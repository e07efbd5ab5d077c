"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reasoning model's output split into its reasoning (the
text between ``<think>`` and ``</think>``) and its content (the rest), whole or delta by delta.

Where a reply starts is its *phase*, decided once per request from the prompt (``start_phase``):

- ``REASONING``: the reasoning is open from the first generated token. The prompt's last think tag is an open
  ``<think>`` (the template wrote it), or the parser is ``deepseek_r1``, whose reasoning starts implicitly.
  A ``<think>`` the model writes first anyway is dropped.
- ``BEFORE`` (``qwen3``): reasoning only if the model opens ``<think>``; whitespace before it is dropped, any
  other text before it is content; with no ``<think>`` everything is content.
- ``CONTENT``: no reasoning. ``enable_thinking: false`` in the chat template's kwargs, or a prompt that ends
  with a closed think block (the template's way of turning thinking off: ``<think>\\n\\n</think>\\n\\n``).

The reasoning ends at ``</think>``; a reply cut before it is all reasoning. The same phases at token level
(``ReasoningGate``) tell the grammar of a constrained request where the content starts.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import ClassVar, Protocol

THINK_START = "<think>"
THINK_END = "</think>"
# A think block closed in the prompt turns thinking off when at most this many (whitespace) tokens follow it;
# further back, it is an earlier turn's reasoning kept in the history.
_CLOSED_BLOCK_TAIL_TOKENS = 8


class Phase(enum.Enum):
    BEFORE = "before"
    REASONING = "reasoning"
    CONTENT = "content"


class TokenizerLike(Protocol):
    def token_to_id(self, token: str) -> int | None: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ReasoningParser:
    """A parser for models that think between ``<think>`` and ``</think>``, each a single token of the
    tokenizer. Subclasses give ``name`` and whether the reasoning opens without a start tag."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = THINK_START
    end_tag: ClassVar[str] = THINK_END
    # The reasoning is open at the first generated token although the prompt does not open it.
    implicit_start: ClassVar[bool]

    def __init__(self, tokenizer: TokenizerLike) -> None:
        """ValueError when the tokenizer has no single token for a think tag."""
        ids = {tag: tokenizer.token_to_id(tag) for tag in (self.start_tag, self.end_tag)}
        missing = [tag for tag, token_id in ids.items() if token_id is None]
        if missing:
            raise ValueError(f"reasoning parser {self.name!r} needs the think tags {self.start_tag!r} and "
                             f"{self.end_tag!r} as tokens of the model's tokenizer; it has no "
                             f"{' or '.join(repr(tag) for tag in missing)}")
        self.tokenizer = tokenizer
        self.start_token_id: int = ids[self.start_tag]
        self.end_token_id: int = ids[self.end_tag]

    # ---- token ids -----------------------------------------------------------------------------------------
    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the last think tag among these tokens is ``</think>`` (vLLM's ``is_reasoning_end``)."""
        for token_id in reversed(token_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def start_phase(self, prompt_token_ids: Sequence[int] | None = None, enable_thinking: bool = True) -> Phase:
        """The phase of a reply's first token, from its prompt and the chat template's ``enable_thinking``."""
        last_tag = None
        for index in range(len(prompt_token_ids or ()) - 1, -1, -1):
            if prompt_token_ids[index] in (self.start_token_id, self.end_token_id):
                last_tag = index
                break
        if last_tag is not None and prompt_token_ids[last_tag] == self.start_token_id:
            return Phase.REASONING
        if not enable_thinking:
            return Phase.CONTENT
        if last_tag is not None:
            tail = list(prompt_token_ids[last_tag + 1:])
            if len(tail) <= _CLOSED_BLOCK_TAIL_TOKENS and not self.tokenizer.decode(tail).strip():
                return Phase.CONTENT
        return Phase.REASONING if self.implicit_start else Phase.BEFORE

    def gate(self, prompt_token_ids: Sequence[int] | None = None, enable_thinking: bool = True) -> ReasoningGate:
        """The token-level phase of a request with this prompt (and the template's ``enable_thinking``), for its
        grammar."""
        return ReasoningGate(self.start_token_id, self.end_token_id,
                             self.start_phase(prompt_token_ids, enable_thinking))

    # ---- text ----------------------------------------------------------------------------------------------
    def extract(self, text: str, phase: Phase) -> tuple[str | None, str | None]:
        """A whole reply as (reasoning, content), each None when empty."""
        if phase is Phase.CONTENT:
            return None, text or None
        head = ""
        if phase is Phase.BEFORE:
            head, tag, text = text.partition(self.start_tag)
            if not tag:
                return None, head or None
            if not head.strip():
                head = ""
        elif text.startswith(self.start_tag):
            text = text[len(self.start_tag):]
        reasoning, _, tail = text.partition(self.end_tag)
        return reasoning or None, (head + tail) or None

    def stream(self, phase: Phase) -> ReasoningStream:
        """An incremental ``extract`` for one reply."""
        return ReasoningStream(self.start_tag, self.end_tag, phase)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the template opens ``<think>``, so the reasoning starts at once."""

    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model opens ``<think>`` itself; ``enable_thinking: false`` means no reasoning."""

    name = "qwen3"
    implicit_start = False


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` without being all of it."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReasoningStream:
    """One reply's deltas split into reasoning and content deltas; text that may be the start of a think tag
    is held back until the next delta tells (or the reply ends). The pieces add up to ``extract``'s."""

    def __init__(self, start_tag: str, end_tag: str, phase: Phase) -> None:
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.phase = phase
        self.held = ""
        self.emitted = False  # any text of the current phase sent yet

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for this delta of the reply; ``finished``: it is the last."""
        text, self.held = self.held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.phase is Phase.CONTENT:
                content.append(text)
                break
            if self.phase is Phase.BEFORE:
                index = text.find(self.start_tag)
                if index >= 0:
                    head = text[:index]
                    if self.emitted or head.strip():
                        content.append(head)
                    self.phase, self.emitted = Phase.REASONING, True
                    text = text[index + len(self.start_tag):]
                    continue
                keep = 0 if finished else _partial_tag(text, self.start_tag)
                head = text[:len(text) - keep]
                if not finished and not self.emitted and not head.strip():
                    self.held = text  # whitespace before a <think> that may follow is dropped
                    break
                content.append(head)
                self.emitted = True
                self.held = text[len(head):]
                break
            # REASONING: a <think> the model writes first is dropped.
            if not self.emitted:
                if text.startswith(self.start_tag):
                    text = text[len(self.start_tag):]
                elif self.start_tag.startswith(text) and not finished:
                    self.held = text
                    break
                self.emitted = True
                continue
            index = text.find(self.end_tag)
            if index >= 0:
                reasoning.append(text[:index])
                self.phase, self.emitted = Phase.CONTENT, True
                text = text[index + len(self.end_tag):]
                continue
            keep = 0 if finished else _partial_tag(text, self.end_tag)
            reasoning.append(text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def check_reasoning_parser(name: str) -> str:
    """The name, when a parser has it; ValueError listing the parsers otherwise."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; kvloom has {sorted(REASONING_PARSERS)}")
    return name


def get_reasoning_parser(name: str, tokenizer: TokenizerLike) -> ReasoningParser:
    """The parser ``name`` for this tokenizer (ValueError naming what is wrong)."""
    return REASONING_PARSERS[check_reasoning_parser(name)](tokenizer)


class ReasoningGate:
    """One request's phase at token level: which of its generated tokens come after the reasoning, where a
    grammar (json_schema, tools) constrains them. A ``BEFORE`` request's first token may be ``<think>``,
    which opens the reasoning; any other first token is content."""

    def __init__(self, start_token_id: int, end_token_id: int, phase: Phase) -> None:
        self.start_token_id = start_token_id
        self.end_token_id = end_token_id
        self.phase = phase

    def next_phase(self, phase: Phase, token_id: int) -> tuple[Phase, bool]:
        """The phase after ``token_id`` sampled in ``phase``, and whether the grammar constrains that token."""
        if phase is Phase.REASONING:
            return (Phase.CONTENT if token_id == self.end_token_id else Phase.REASONING), False
        if phase is Phase.BEFORE and token_id == self.start_token_id:
            return Phase.REASONING, False
        return Phase.CONTENT, True
