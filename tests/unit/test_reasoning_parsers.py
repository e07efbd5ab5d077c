"""Reasoning parsers (kvloom/reasoning): whole replies split as vLLM's qwen3 / deepseek_r1 parsers split them,
the same split delta by delta for random delta boundaries, the start phase from the prompt and the
token-level end of the reasoning."""

from __future__ import annotations

import random

import pytest
import tiny_models

from kvloom.loader.tokenizer import Tokenizer
from kvloom.reasoning import (
    REASONING_PARSERS,
    Phase,
    ReasoningGate,
    check_reasoning_parser,
    get_reasoning_parser,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The tiny test tokenizer with <think> and </think> added as (non-special) tokens, as Qwen3's has them."""
    backend = tiny_models.train_tokenizer()
    backend.add_tokens(["<think>", "</think>"])
    return Tokenizer(backend, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def qwen3(tokenizer: Tokenizer):
    return get_reasoning_parser("qwen3", tokenizer)


@pytest.fixture(scope="module")
def deepseek(tokenizer: Tokenizer):
    return get_reasoning_parser("deepseek_r1", tokenizer)


# (text, phase, expected reasoning, expected content), written out by hand.
CASES = [
    # deepseek_r1 / an open <think> in the prompt: reasoning until </think>.
    ("I think.</think>The answer.", Phase.REASONING, "I think.", "The answer."),
    ("<think>I think.</think>The answer.", Phase.REASONING, "I think.", "The answer."),
    ("cut before the end", Phase.REASONING, "cut before the end", None),
    ("</think>", Phase.REASONING, None, None),
    ("a</think>b</think>c", Phase.REASONING, "a", "b</think>c"),
    ("a<think>b</think>", Phase.REASONING, "a<think>b", None),
    ("\n<think>x</think>y", Phase.REASONING, "\n<think>x", "y"),
    ("a </thin", Phase.REASONING, "a </thin", None),
    # qwen3: reasoning only where the model opens <think>.
    ("<think>\nhmm\n</think>\n\n{\"a\": 1}", Phase.BEFORE, "\nhmm\n", "\n\n{\"a\": 1}"),
    ("\n <think>x</think>y", Phase.BEFORE, "x", "y"),
    ("plain answer", Phase.BEFORE, None, "plain answer"),
    ("I know. <think>x</think> y", Phase.BEFORE, "x", "I know.  y"),
    ("<think>truncated", Phase.BEFORE, "truncated", None),
    ("x</think>y", Phase.BEFORE, None, "x</think>y"),
    ("   ", Phase.BEFORE, None, "   "),
    ("<thin", Phase.BEFORE, None, "<thin"),
    # thinking off: all content.
    ("<think>x</think>y", Phase.CONTENT, None, "<think>x</think>y"),
    ("", Phase.CONTENT, None, None),
]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize(("text", "phase", "reasoning", "content"), CASES)
def test_whole_reply_split(request: pytest.FixtureRequest, name: str, text: str, phase: Phase,
                           reasoning: str | None, content: str | None) -> None:
    parser = request.getfixturevalue("deepseek" if name == "deepseek_r1" else "qwen3")
    assert parser.extract(text, phase) == (reasoning, content)


def _streamed(parser, text: str, phase: Phase, cuts: list[int]) -> tuple[str | None, str | None]:
    stream = parser.stream(phase)
    reasoning, content = [], []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for index, piece in enumerate(pieces):
        r, c = stream.feed(piece, finished=index == len(pieces) - 1)
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning) or None, "".join(content) or None


RANDOM_ALPHABET = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", ">", "a", "b", " ", "\n", "é", "😀"]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_streamed_deltas_add_up_to_the_whole_split(request: pytest.FixtureRequest, name: str) -> None:
    """Every way of cutting a reply into deltas gives the whole reply's reasoning and content: a partial think
    tag at a delta's end is held back, never sent as text."""
    parser = request.getfixturevalue("deepseek" if name == "deepseek_r1" else "qwen3")
    rng = random.Random(0)
    texts = [text for text, *_ in CASES]
    texts += ["".join(rng.choice(RANDOM_ALPHABET) for _ in range(rng.randrange(0, 12))) for _ in range(300)]
    for text in texts:
        for phase in Phase:
            expected = parser.extract(text, phase)
            for _ in range(6):
                cuts = sorted(rng.sample(range(1, len(text)), max(0, min(len(text) - 1, rng.randrange(0, 6)))))
                assert _streamed(parser, text, phase, cuts) == expected, (text, phase, cuts)
            # one character at a time
            assert _streamed(parser, text, phase, list(range(1, len(text)))) == expected, (text, phase)


def test_partial_tags_are_held_back_until_the_next_delta(qwen3) -> None:
    stream = qwen3.stream(Phase.REASONING)
    assert stream.feed("step one </th") == ("step one ", "")
    assert stream.feed("ink>{") == ("", "{")
    assert stream.feed("}", finished=True) == ("", "}")
    stream = qwen3.stream(Phase.BEFORE)
    assert stream.feed("\n") == ("", "")  # whitespace before a <think> that may come
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>why") == ("why", "")
    stream = qwen3.stream(Phase.BEFORE)
    assert stream.feed("\n") == ("", "")
    assert stream.feed("Hi") == ("", "\nHi")
    stream = qwen3.stream(Phase.REASONING)
    assert stream.feed("a </thi", finished=True) == ("a </thi", "")


def test_is_reasoning_end_reads_the_last_think_tag(tokenizer: Tokenizer, deepseek) -> None:
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    text = tokenizer.encode("hello", add_special_tokens=False)
    assert deepseek.start_token_id == start and deepseek.end_token_id == end
    assert not deepseek.is_reasoning_end(text)
    assert not deepseek.is_reasoning_end([*text, start, *text])
    assert deepseek.is_reasoning_end([*text, end, *text])
    assert deepseek.is_reasoning_end([start, *text, end])
    assert not deepseek.is_reasoning_end([start, end, *text, start])


def test_start_phase_from_the_prompt_and_enable_thinking(tokenizer: Tokenizer, qwen3, deepseek) -> None:
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    plain = ids("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    opened = plain + ids("<think>\n")
    closed = plain + ids("<think>\n\n</think>\n\n")  # Qwen3's template with enable_thinking false
    history = ids("<|im_start|>assistant\n<think>\nearlier reasoning\n</think>\n\nearlier answer<|im_end|>\n"
                  "<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.token_to_id("</think>") in closed
    assert qwen3.start_phase(plain) is Phase.BEFORE
    assert deepseek.start_phase(plain) is Phase.REASONING
    for parser in (qwen3, deepseek):
        assert parser.start_phase(opened) is Phase.REASONING
        assert parser.start_phase(closed) is Phase.CONTENT
        assert parser.start_phase(plain, enable_thinking=False) is Phase.CONTENT
        assert parser.start_phase(opened, enable_thinking=False) is Phase.REASONING  # the template opened it
    # An earlier turn's reasoning in the history does not turn thinking off.
    assert qwen3.start_phase(history) is Phase.BEFORE
    assert deepseek.start_phase(history) is Phase.REASONING
    assert qwen3.start_phase(None) is Phase.BEFORE


def test_gate_constrains_only_the_tokens_after_the_reasoning(qwen3) -> None:
    start, end, other = qwen3.start_token_id, qwen3.end_token_id, 5
    gate = ReasoningGate(start, end, Phase.REASONING)
    assert gate.next_phase(Phase.REASONING, other) == (Phase.REASONING, False)
    assert gate.next_phase(Phase.REASONING, start) == (Phase.REASONING, False)
    assert gate.next_phase(Phase.REASONING, end) == (Phase.CONTENT, False)
    assert gate.next_phase(Phase.CONTENT, end) == (Phase.CONTENT, True)
    assert gate.next_phase(Phase.BEFORE, start) == (Phase.REASONING, False)
    assert gate.next_phase(Phase.BEFORE, other) == (Phase.CONTENT, True)


def test_unknown_parser_and_missing_tags_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'qwen2'.*\['deepseek_r1', 'qwen3'\]"):
        check_reasoning_parser("qwen2")
    plain = Tokenizer(tiny_models.train_tokenizer(), eos_token="<|im_end|>")
    with pytest.raises(ValueError, match=r"'qwen3' needs the think tags.*no '<think>' or '</think>'"):
        get_reasoning_parser("qwen3", plain)


def test_reasoning_parser_config_and_flag() -> None:
    import argparse

    from kvloom.config import EngineConfig, add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--reasoning-parser", "deepseek_r1"])).reasoning_parser == "deepseek_r1"
    assert EngineConfig().reasoning_parser is None
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'r1'; kvloom has \['deepseek_r1', 'qwen3'\]"):
        EngineConfig(reasoning_parser="r1")
