"""A grammar behind a reasoning parser: every token is allowed while the request reasons, the grammar takes
over after ``</think>`` with exactly the masks of the same grammar started there (the oracle: a plain matcher
fed the content tokens only), and rollback across the end of the reasoning restores it."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvloom.loader.tokenizer import Tokenizer
from kvloom.reasoning import Phase
from kvloom.sampling_params import StructuredOutputsParams
from kvloom.structured_output import StructuredOutputManager
from kvloom.structured_output.bitmask import unpack_bitmask

PIECES = ["0", "1", "2", "7", "a", "b", "c", "x", "y", "n", "e", "s", "o", '"', "{", "}", ":", ",", "[", "]",
          "\u0120", "-", "ye", "yes", "no", "12", '{"', '":', "ab", "</s>", "r"]
EOS = PIECES.index("</s>")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    backend = HFTokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(PIECES)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(["<think>", "</think>"])  # ids 31 and 32: <think> is bit 31 of the first mask word
    return Tokenizer(backend, eos_token="</s>")


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(manager: StructuredOutputManager, matcher: object) -> set[int]:
    bitmask = torch.zeros((1, (manager.vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_bitmask(bitmask, manager.vocab_size)[0]).flatten().tolist())


def matchers(tokenizer: Tokenizer, parser: str, prompt: list[int], enable_thinking: bool = True
             ) -> tuple[StructuredOutputManager, object, object]:
    """A gated matcher for ``prompt`` and a plain one of the same grammar (the oracle)."""
    params = StructuredOutputsParams(json=SCHEMA)
    manager = StructuredOutputManager(tokenizer, len(PIECES) + 4, [EOS], reasoning_parser=parser)
    plain = StructuredOutputManager(tokenizer, len(PIECES) + 4, [EOS])
    gated_state, plain_state = manager.start(params, prompt, enable_thinking=enable_thinking), plain.start(params)
    manager.compile(params)
    assert manager.ready(gated_state) and plain.ready(plain_state)
    return manager, gated_state.matcher, plain_state.matcher


def test_the_grammar_starts_after_the_end_of_the_reasoning(tokenizer: Tokenizer) -> None:
    manager, gated, plain = matchers(tokenizer, "deepseek_r1", ids(tokenizer, "yes<think>"))
    everything = set(range(manager.vocab_size))
    assert allowed(manager, gated) == everything
    thought = ids(tokenizer, "no, 7 } x ab") + [tokenizer.token_to_id("<think>")]
    assert gated.accept_tokens(thought)  # not JSON: the grammar does not see it
    assert allowed(manager, gated) == everything and not gated.is_terminated()
    assert gated.accept_tokens([tokenizer.token_to_id("</think>")])
    assert gated.reasoning_ended
    assert allowed(manager, gated) == allowed(manager, plain)
    content = ids(tokenizer, '{"a":12}')
    for token in content:
        assert allowed(manager, gated) == allowed(manager, plain)
        assert gated.accept_tokens([token]) and plain.accept_tokens([token])
    assert not gated.accept_tokens(ids(tokenizer, "x"))  # the grammar refuses, nothing moves
    assert gated.accept_tokens([EOS]) and gated.is_terminated()
    # Back over the grammar's tokens and the end of the reasoning: reasoning again, all allowed.
    gated.rollback(len(content) + 2)
    assert gated.gate.phase is Phase.REASONING and allowed(manager, gated) == everything
    assert gated.accept_tokens([tokenizer.token_to_id("</think>"), *content])
    assert json.loads(tokenizer.decode(content)) == {"a": 12}


def test_tokens_in_one_step_across_the_end_reach_the_grammar_from_the_end(tokenizer: Tokenizer) -> None:
    manager, gated, plain = matchers(tokenizer, "deepseek_r1", [])
    end = tokenizer.token_to_id("</think>")
    assert gated.accept_tokens([*ids(tokenizer, "x"), end, *ids(tokenizer, '{"')])
    assert plain.accept_tokens(ids(tokenizer, '{"'))
    assert allowed(manager, gated) == allowed(manager, plain)
    assert not gated.accept_tokens([*ids(tokenizer, "x"), end])  # an end inside the content is a token to refuse


def test_qwen3_may_open_its_reasoning_at_the_first_token(tokenizer: Tokenizer) -> None:
    start = tokenizer.token_to_id("<think>")
    manager, gated, plain = matchers(tokenizer, "qwen3", ids(tokenizer, "yes"))
    assert gated.gate.phase is Phase.BEFORE
    assert allowed(manager, gated) == allowed(manager, plain) | {start}
    assert gated.accept_tokens([start])
    assert allowed(manager, gated) == set(range(manager.vocab_size))
    # Without <think> first, the reply is content from its first token.
    manager, gated, plain = matchers(tokenizer, "qwen3", ids(tokenizer, "yes"))
    assert gated.accept_tokens(ids(tokenizer, '{"')) and plain.accept_tokens(ids(tokenizer, '{"'))
    assert gated.reasoning_ended and allowed(manager, gated) == allowed(manager, plain)


def test_a_prompt_that_closes_the_reasoning_is_constrained_at_once(tokenizer: Tokenizer) -> None:
    prompt = ids(tokenizer, "yes<think>  </think> ")  # the template turned thinking off
    for parser in ("qwen3", "deepseek_r1"):
        manager, gated, plain = matchers(tokenizer, parser, prompt)
        assert gated.reasoning_ended and allowed(manager, gated) == allowed(manager, plain)


def test_thinking_turned_off_constrains_at_once_whatever_the_prompt(tokenizer: Tokenizer) -> None:
    """``enable_thinking: false`` in the chat template's kwargs, with a template that writes no closed think block
    (DeepSeek-R1's reply opens its reasoning implicitly): the reply is content, so the grammar applies from the first
    token, as the server's parser reads it (it was held back, waiting for a ``</think>`` that never comes)."""
    prompt = ids(tokenizer, "yes")
    manager, gated, plain = matchers(tokenizer, "deepseek_r1", prompt)
    assert not gated.reasoning_ended and allowed(manager, gated) == set(range(manager.vocab_size))
    manager, gated, plain = matchers(tokenizer, "deepseek_r1", prompt, enable_thinking=False)
    assert gated.reasoning_ended and allowed(manager, gated) == allowed(manager, plain)
    assert gated.accept_tokens(ids(tokenizer, '{"')) and plain.accept_tokens(ids(tokenizer, '{"'))
    assert allowed(manager, gated) == allowed(manager, plain)


def test_a_tokenizer_without_think_tags_is_refused() -> None:
    backend = HFTokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(PIECES)}, merges=[]))
    with pytest.raises(ValueError, match="'deepseek_r1' needs the think tags"):
        StructuredOutputManager(Tokenizer(backend, eos_token="</s>"), len(PIECES), [EOS],
                                reasoning_parser="deepseek_r1")
