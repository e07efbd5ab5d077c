"""Structured outputs below the engine: constraint parameters, the backend's masks against a brute-force
reference on a tiny vocabulary, the matcher's accept / rollback / termination, the grammar cache, the
bitmask op (torch, and the Triton kernel under TRITON_INTERPRET=1) and the backend flag."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvloom.config import EngineConfig
from kvloom.loader.tokenizer import Tokenizer
from kvloom.sampling_params import SamplingParams, StructuredOutputsParams
from kvloom.structured_output import StructuredOutputManager
from kvloom.structured_output.bitmask import (
    TokenBitmask,
    apply_token_bitmask_,
    apply_token_bitmask_torch,
    unpack_bitmask,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A byte-level vocabulary small enough to check every token: digits, a few letters, JSON punctuation.
PIECES = ["0", "1", "2", "7", "a", "b", "c", "x", "y", "n", "e", "s", "o", '"', "{", "}", ":", ",", "[", "]", " ",
          "-", "ye", "yes", "no", "12", '{"', '":', "ab", "</s>"]
EOS = len(PIECES) - 1


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    byte_map = pre_tokenizers.ByteLevel.alphabet()
    assert byte_map  # the byte-level alphabet: " " is stored as "Ġ"
    encode = {" ": "\u0120"}
    vocab = {"".join(encode.get(ch, ch) for ch in piece) if piece != "</s>" else piece: i
             for i, piece in enumerate(PIECES)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, eos_token="</s>")


@pytest.fixture(scope="module")
def manager(tokenizer: Tokenizer) -> StructuredOutputManager:
    # A model vocabulary wider than the tokenizer's: the padded ids must never be allowed.
    return StructuredOutputManager(tokenizer, len(PIECES) + 3, [EOS])


def allowed_tokens(manager: StructuredOutputManager, matcher: object) -> set[int]:
    bitmask = torch.full((1, (manager.vocab_size + 31) // 32), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_bitmask(bitmask, manager.vocab_size)[0]).flatten().tolist())


def reference_allowed(prefix: str, is_complete: callable, is_prefix: callable) -> set[int]:
    """Brute force: a token is allowed when the text after it is still a prefix of the language; EOS when
    the text so far is complete."""
    allowed = {i for i, piece in enumerate(PIECES[:-1]) if is_prefix(prefix + piece)}
    if is_complete(prefix):
        allowed.add(EOS)
    return allowed


def test_exactly_one_constraint_is_required() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"exactly one of .*\['json', 'regex'\]"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")).structured_outputs.kind == "regex"


def test_bad_constraints_name_the_problem(manager: StructuredOutputManager) -> None:
    cases = [(StructuredOutputsParams(json={"type": "nope"}), r"json is not valid: .*nope"),
             (StructuredOutputsParams(json="{not json"), "json is not valid JSON"),
             (StructuredOutputsParams(regex="(("), r"regex is not valid: .*parenthesis"),
             (StructuredOutputsParams(grammar="root ::= foo"), r"grammar is not valid: .*foo"),
             (StructuredOutputsParams(structural_tag="{}"), "structural_tag is not valid")]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            manager.validate(params)


@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_masks_match_a_brute_force_reference(manager: StructuredOutputManager, kind: str) -> None:
    if kind == "regex":
        params, pattern, alphabet = StructuredOutputsParams(regex=r"(ab|x)[0-2]{1,3}"), r"(ab|x)[0-2]{1,3}", "abx012"
    else:
        choices = ["yes", "no", "ye"]
        params, pattern, alphabet = StructuredOutputsParams(choice=choices), "|".join(choices), "yesno"
    language = _strings(pattern, alphabet)
    state = manager.start(params)
    assert manager.compile(params) is not None and manager.ready(state)
    matcher, text = state.matcher, ""
    for piece in language[-1]:  # the longest string, one character (a token of its own) at a time
        expected = reference_allowed(text, lambda t: t in language, lambda t: any(s.startswith(t) for s in language))
        assert allowed_tokens(manager, matcher) == expected, text
        assert matcher.accept_tokens([PIECES.index(piece)])
        text += piece
    assert EOS in allowed_tokens(manager, matcher)
    assert matcher.accept_tokens([EOS]) and matcher.is_terminated()


def _strings(pattern: str, alphabet: str) -> list[str]:
    """Every string over ``alphabet`` up to 5 long that fully matches ``pattern``, shortest first."""
    found = [""] if re.fullmatch(pattern, "") else []
    for length in range(1, 6):
        found += ["".join(p) for p in itertools.product(alphabet, repeat=length) if re.fullmatch(pattern, "".join(p))]
    return found


def test_matcher_refuses_rolls_back_and_json_terminates(manager: StructuredOutputManager) -> None:
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False},
                                     disable_any_whitespace=True)
    state = manager.start(params)
    manager.compile(params)
    assert manager.ready(state)
    matcher = state.matcher
    # Without free whitespace xgrammar writes JSON's usual separators: ": " and ", ".
    ids = [PIECES.index(p) for p in ['{"', "a", '":', " ", "7"]]
    assert matcher.accept_tokens(ids)
    assert not matcher.accept_tokens([PIECES.index("a")])  # a letter where a digit or '}' must come
    assert PIECES.index("}") in allowed_tokens(manager, matcher)
    assert EOS not in allowed_tokens(manager, matcher)  # the object is not closed yet
    matcher.rollback(1)
    assert PIECES.index("7") in allowed_tokens(manager, matcher)
    assert matcher.accept_tokens([PIECES.index("7"), PIECES.index("}")])
    assert allowed_tokens(manager, matcher) == {EOS}
    assert not any(t >= len(PIECES) for t in allowed_tokens(manager, matcher))
    assert matcher.accept_tokens([EOS]) and matcher.is_terminated()


def test_compiled_grammars_are_cached_per_spec_and_tokenizer(manager: StructuredOutputManager,
                                                             tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"b": {"type": "string"}}}
    first = manager.compile_async(StructuredOutputsParams(json=schema))
    assert manager.compile_async(StructuredOutputsParams(json=json.dumps(schema, sort_keys=True))) is first
    assert manager.compile_async(StructuredOutputsParams(json=schema, disable_any_whitespace=True)) is not first
    other_vocab = StructuredOutputManager(tokenizer, len(PIECES) + 5, [EOS])
    assert other_vocab.compile_async(StructuredOutputsParams(json=schema)) is not first


def test_a_compiled_constraint_is_not_parsed_again(manager: StructuredOutputManager,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached grammar's request skips the schema parse (it is most of a cached request's admission cost);
    a constraint not yet compiled, or one that failed, is still checked."""
    parsed = []
    validate = manager.backend.validate
    monkeypatch.setattr(manager.backend, "validate", lambda params: parsed.append(params) or validate(params))
    params = StructuredOutputsParams(json={"type": "object", "properties": {"q": {"type": "integer"}}})
    assert not manager.is_compiled(params)
    manager.validate(params)
    manager.compile(params)
    assert manager.is_compiled(params) and len(parsed) == 1
    manager.validate(StructuredOutputsParams(json={"type": "object", "properties": {"q": {"type": "integer"}}}))
    assert len(parsed) == 1
    broken = StructuredOutputsParams(grammar="root ::= missing_rule")
    with pytest.raises(ValueError):
        manager.compile(broken)
    assert not manager.is_compiled(broken)
    with pytest.raises(ValueError):
        manager.validate(broken)


def test_compile_timeout_is_a_clear_error(manager: StructuredOutputManager) -> None:
    impatient = StructuredOutputManager(manager.tokenizer, manager.vocab_size, [EOS], compile_timeout=1e-9)
    state = impatient.start(StructuredOutputsParams(regex="[a-c]{1,40}x{2,30}" + "y" * 5))
    if not state.future.done():
        with pytest.raises(ValueError, match="did not compile within"):
            impatient.ready(state)


def test_bitmask_op_masks_only_the_constrained_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)
    rows = torch.tensor([2, 0])
    out = logits.clone()
    apply_token_bitmask_torch(out, bitmask, rows)
    for r, row in enumerate(rows.tolist()):
        for j in range(70):
            allowed = (int(bitmask[r, j // 32]) >> (j % 32)) & 1
            assert out[row, j] == (logits[row, j] if allowed else float("-inf"))
    assert torch.equal(out[[1, 3]], logits[[1, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_the_torch_op(dtype: torch.dtype) -> None:
    """kvloom's C++ kernel (word at a time) where it is built, else xgrammar's: random words, words of all zeros
    and all ones (the kernel's two shortcuts), and a bitmask narrower than the vocabulary."""
    torch.manual_seed(1)
    for vocab, rows, width in ((70, [2, 0], None), (1000, [0, 1, 2, 3], None), (65, [3], None), (100, [1, 2], 2)):
        logits = torch.randn(4, vocab).to(dtype)
        words = width or (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32)
        bitmask[0, 0] = 0
        bitmask[-1, -1] = -1
        expected, got = logits.clone(), logits.clone()
        apply_token_bitmask_torch(expected, bitmask, torch.tensor(rows))
        apply_token_bitmask_(got, TokenBitmask(bitmask, torch.tensor(rows)))
        assert torch.equal(expected, got), (vocab, rows)


def test_cpu_kernel_refuses_a_row_outside_the_batch() -> None:
    from kvloom.ops import cpu

    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.kvloom.apply_token_bitmask(torch.zeros(2, 40), torch.zeros(1, 2, dtype=torch.int32),
                                             torch.tensor([5]))


def test_triton_bitmask_kernel_matches_torch_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    script = (
        "import torch\n"
        "from kvloom.structured_output.bitmask import apply_token_bitmask_torch\n"
        "from kvloom.structured_output.triton_bitmask import apply_token_bitmask_triton\n"
        "torch.manual_seed(0)\n"
        "for vocab, dtype in ((70, torch.float32), (5000, torch.bfloat16), (33, torch.float16)):\n"
        "    logits = torch.randn(5, vocab).to(dtype)\n"
        "    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)\n"
        "    rows = torch.tensor([4, 1, 2])\n"
        "    expected, got = logits.clone(), logits.clone()\n"
        "    apply_token_bitmask_torch(expected, bitmask, rows)\n"
        "    apply_token_bitmask_triton(got, bitmask, rows)\n"
        "    assert torch.equal(expected, got), vocab\n"
        "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_bitmask_kernel_matches_torch_at_model_sizes() -> None:
    from kvloom.structured_output.triton_bitmask import apply_token_bitmask_triton
    torch.manual_seed(0)
    for vocab, dtype, batch, constrained in ((49152, torch.bfloat16, 64, 40), (151936, torch.float32, 8, 8),
                                            (1000, torch.float16, 3, 1)):
        logits = torch.randn(batch, vocab, device="cuda").to(dtype)
        bitmask = torch.randint(-2**31, 2**31 - 1, (constrained, (vocab + 31) // 32), dtype=torch.int32)
        rows = torch.randperm(batch)[:constrained]
        expected = logits.cpu()
        apply_token_bitmask_torch(expected, bitmask, rows)
        apply_token_bitmask_triton(logits, bitmask.cuda(), rows.cuda())
        assert torch.equal(expected, logits.cpu()), (vocab, dtype)


def test_backend_flag_takes_only_xgrammar_and_auto() -> None:
    assert EngineConfig(structured_outputs_config={"backend": "xgrammar"}).structured_outputs.backend == "xgrammar"
    assert EngineConfig().structured_outputs.backend == "auto"
    for name in ("guidance", "outlines", "lm-format-enforcer"):
        with pytest.raises(ValueError, match=r"backend '.+' is not available: kvloom supports \['auto', 'xgrammar'\]"):
            EngineConfig(structured_outputs_config={"backend": name})
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(structured_outputs_config='{"backnd": "auto"}')


def test_dotted_backend_flag_as_vllm() -> None:
    import argparse

    from kvloom.config import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--structured-outputs-config.backend", "xgrammar"])
    assert config_from_args(args).structured_outputs.backend == "xgrammar"
    args = parser.parse_args(["--structured-outputs-config.backend", "guidance"])
    with pytest.raises(ValueError, match="not available"):
        config_from_args(args)


@pytest.mark.parametrize("string", [{"maxLength": 6}, {"minLength": 1}, {}])
def test_json_strings_never_take_a_raw_control_character(string: dict) -> None:
    """JSON allows no unescaped character below 0x20 in a string; xgrammar's length-bounded strings let them
    through, so the schema's grammar is rewritten (a sampled tab made output json.loads refused on a GPU)."""
    import xgrammar as xgr

    from kvloom.structured_output.xgrammar_backend import json_schema_grammar

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", **string}},
                         "required": ["name"], "additionalProperties": False})
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\t", "\x01", "\n"]))
    compiled = compiler.compile_grammar(json_schema_grammar(schema, any_whitespace=False))
    for text, valid in (('{"name": "ab"}', True), ('{"name": "a\tb"}', False), ('{"name": "a\x01"}', False),
                        ('{"name": "a\nb"}', False)):
        assert xgr.GrammarMatcher(compiled).accept_string(text) == valid, (string, text)
        if valid:
            json.loads(text)
