"""The offline API's long tail against transformers: logit_bias, allowed_token_ids and bad_words steer greedy
decoding exactly as the definition applied to HF's logits does; every field of vLLM's SamplingParams is
either honoured (a behaviour check each) or refused with a ValueError; embeddings (LAST, MEAN, CLS, a
sentence-transformers directory, chunked prefill, prefix caching) equal HF's hidden states pooled."""

from __future__ import annotations

import ast
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from vllm_fields import VLLM_SAMPLING_FIELDS

from kvloom import LLM, PoolingParams, SamplingParams
from kvloom.sampling_params import RequestOutputKind, StructuredOutputsParams

PROMPT = "The quick brown fox"
EOS = 2  # tests/tiny_models.py: <|im_end|>, the tiny model's EOS

PEER_VLLM = Path(__file__).resolve().parents[2] / ".peers" / "vllm"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, max_model_len=256)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def run(llm: LLM, **kwargs) -> list:
    params = SamplingParams(**{"temperature": 0, "max_tokens": 8, **kwargs})
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs


def hf_greedy(hf, prompt_ids: list[int], steps: int, processor: Callable[[torch.Tensor, list[int]], torch.Tensor]
              ) -> list[int]:
    """HF greedy decoding with ``processor(logits [V], output so far)`` applied to each step's logits."""
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            token = int(processor(logits, out).argmax())
            out.append(token)
            ids.append(token)
    return out


def test_logit_bias_allowed_token_ids_and_bad_words_equal_the_definition_on_transformers(llm: LLM, hf) -> None:
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    base = run(llm)[0].token_ids
    bias = {base[0]: -100.0, 17: 4.0, 33: 2.5}

    def biased(logits: torch.Tensor, _: list[int]) -> torch.Tensor:
        for token, value in bias.items():
            logits[token] += value
        return logits

    assert run(llm, logit_bias=bias)[0].token_ids == hf_greedy(hf, prompt_ids, 8, biased)
    allowed = [40, 41, 42, 300]

    def only_allowed(logits: torch.Tensor, _: list[int]) -> torch.Tensor:
        kept = torch.full_like(logits, float("-inf"))
        kept[allowed] = logits[allowed]
        return kept

    assert run(llm, allowed_token_ids=allowed)[0].token_ids == hf_greedy(hf, prompt_ids, 8, only_allowed)
    sampled = run(llm, allowed_token_ids=allowed, temperature=1.0, seed=3, max_tokens=16)[0].token_ids
    assert set(sampled) <= set(allowed)
    # bad_words: a word of two tokens (the greedy output's first two) bans its second after its first.
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode(base[:2])
    words = [tokenizer.encode(word.lstrip(), add_special_tokens=False),
             tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)]

    def no_bad_words(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for seq in words:
            if len(seq) == 1 or out[-(len(seq) - 1):] == seq[:-1]:
                logits[seq[-1]] = float("-inf")
        return logits

    got = run(llm, bad_words=[word])[0].token_ids
    assert got == hf_greedy(hf, prompt_ids, 8, no_bad_words) and got != base


def test_vllm_field_list_is_complete_for_the_peer_vllm() -> None:
    """The list above covers every init field of the peers' vLLM, where it is installed."""
    source = PEER_VLLM / "lib" / "python3.11" / "site-packages" / "vllm" / "sampling_params.py"
    if not source.is_file():
        pytest.skip(f"the peers' vLLM is not installed here ({source})")
    tree = ast.parse(source.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
             and not n.target.id.startswith("_")}
    assert names <= set(VLLM_SAMPLING_FIELDS), sorted(names - set(VLLM_SAMPLING_FIELDS))


def _honoured_checks(llm: LLM) -> dict[str, Callable[[], bool]]:
    """A check per field kvloom accepts: True when the field changed the output as vLLM's does."""
    base = run(llm)[0]
    tokens, text = base.token_ids, base.text
    force_eos = {EOS: 100.0}

    def delta_outputs() -> bool:
        engine = llm.llm_engine
        engine.add_request("delta-check", PROMPT, SamplingParams(temperature=0, max_tokens=4,
                                                                output_kind=RequestOutputKind.DELTA))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += [o.outputs[0].token_ids for o in engine.step() if o.request_id == "delta-check"]
        return [t for d in deltas for t in d] == tokens[:4] and all(len(d) <= 1 for d in deltas)

    return {
        "n": lambda: len(run(llm, n=3, temperature=1.0, seed=1)) == 3,
        "presence_penalty": lambda: run(llm, presence_penalty=2.0)[0].token_ids != tokens,
        "frequency_penalty": lambda: run(llm, frequency_penalty=2.0)[0].token_ids != tokens,
        "repetition_penalty": lambda: run(llm, repetition_penalty=3.0)[0].token_ids != tokens,
        "temperature": lambda: run(llm, temperature=5.0, seed=0)[0].token_ids != tokens,
        "top_p": lambda: run(llm, temperature=1.0, top_p=1e-6, seed=0)[0].token_ids == tokens,
        "top_k": lambda: run(llm, temperature=1.0, top_k=1, seed=0)[0].token_ids == tokens,
        "min_p": lambda: run(llm, temperature=1.0, min_p=1.0, seed=0)[0].token_ids == tokens,
        "seed": lambda: (run(llm, temperature=1.0, seed=7)[0].token_ids
                         == run(llm, temperature=1.0, seed=7)[0].token_ids
                         != run(llm, temperature=1.0, seed=8)[0].token_ids),
        "stop": lambda: run(llm, stop=[text[3:6]])[0].text == text[:3],
        "stop_token_ids": lambda: run(llm, stop_token_ids=[tokens[2]])[0].token_ids
        == tokens[:tokens.index(tokens[2]) + 1],
        "bad_words": lambda: run(llm, bad_words=[llm.get_tokenizer().decode(tokens[:1])])[0].token_ids[0]
        != tokens[0],
        "ignore_eos": lambda: (len(run(llm, logit_bias=force_eos)[0].token_ids) == 1
                               and len(run(llm, logit_bias=force_eos, ignore_eos=True)[0].token_ids) == 8),
        "max_tokens": lambda: len(run(llm, max_tokens=3)[0].token_ids) == 3,
        "min_tokens": lambda: len(run(llm, logit_bias=force_eos, min_tokens=4)[0].token_ids) == 5,
        "logprobs": lambda: len(run(llm, logprobs=2)[0].logprobs) == 8,
        "prompt_logprobs": lambda: (llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1),
                                                 use_tqdm=False)[0].prompt_logprobs[0] is None),
        "detokenize": lambda: run(llm, detokenize=False)[0].text == "",
        "skip_special_tokens": lambda: ("<|im_start|>" in run(llm, allowed_token_ids=[1], skip_special_tokens=False,
                                                             max_tokens=2)[0].text
                                        and run(llm, allowed_token_ids=[1], max_tokens=2)[0].text == ""),
        "include_stop_str_in_output": lambda: run(llm, stop=[text[3:6]], include_stop_str_in_output=True)[0].text
        == text[:6],
        "output_kind": delta_outputs,
        "structured_outputs": lambda: run(llm, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
                                          max_tokens=4)[0].text in ("yes", "no"),
        "logit_bias": lambda: run(llm, logit_bias={5: 100.0})[0].token_ids == [5] * 8,
        "allowed_token_ids": lambda: set(run(llm, allowed_token_ids=[6, 7])[0].token_ids) <= {6, 7},
    }


def test_every_vllm_sampling_field_is_honoured_or_refused(llm: LLM) -> None:
    checks = _honoured_checks(llm)
    accepted = []
    for name in VLLM_SAMPLING_FIELDS:
        try:
            SamplingParams(**{name: None if name in ("best_of",) else _some_value(name)})
        except ValueError as e:
            assert name in str(e), f"{name}: the refusal does not name it: {e}"
            assert name not in checks, f"{name} is refused but has an honoured check"
            continue
        accepted.append(name)
        assert name in checks, f"SamplingParams accepts {name!r} but no check shows it is honoured"
    failed = [name for name in accepted if not checks[name]()]
    assert not failed, f"accepted but not honoured: {failed}"
    assert set(accepted) == set(checks)


def _some_value(name: str) -> object:
    """A value for a field that asks for something (for the refused ones: anything but their default)."""
    values = {"n": 2, "seed": 1, "stop": ["x"], "stop_token_ids": [1], "bad_words": ["x"], "max_tokens": 4,
              "min_tokens": 1, "logprobs": 1, "prompt_logprobs": 1, "logit_bias": {1: 1.0},
              "allowed_token_ids": [1], "output_kind": RequestOutputKind.DELTA, "top_k": 2, "top_p": 0.5,
              "min_p": 0.1, "temperature": 0.5, "presence_penalty": 0.5, "frequency_penalty": 0.5,
              "repetition_penalty": 1.1, "structured_outputs": StructuredOutputsParams(choice=["a"])}
    return values.get(name, True)


# ---- embeddings -------------------------------------------------------------------------------------

EMBED_PROMPTS = ["The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs away.",
                 "Once upon a time", "def fibonacci(n: int) -> int:"]


@pytest.fixture(scope="module")
def hf_hidden(tiny_llama_dir: str) -> Callable[[list[int]], torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]

    return hidden


def _pool(hidden: torch.Tensor, kind: str) -> torch.Tensor:
    vector = hidden.mean(0) if kind == "MEAN" else hidden[0] if kind == "CLS" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=-1)


def _cosines(outputs: list, hf_hidden: Callable, kind: str) -> list[float]:
    return [torch.nn.functional.cosine_similarity(torch.tensor(o.outputs.embedding),
                                                  _pool(hf_hidden(o.prompt_token_ids), kind), dim=0).item()
            for o in outputs]


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_hidden_states_pooled(tiny_llama_dir: str, hf_hidden, kind: str) -> None:
    # A 16-token budget splits the long prompt over several steps; the prompt twice: a prefix-cache hit for
    # LAST, a full recomputation for MEAN and CLS.
    embedder = LLM(tiny_llama_dir, runner="pooling", pooling_type=kind, max_num_batched_tokens=16,
                   max_model_len=128, enable_chunked_prefill=True)
    outputs = embedder.embed(EMBED_PROMPTS + EMBED_PROMPTS[:1], use_tqdm=False)
    assert min(_cosines(outputs, hf_hidden, kind)) >= 0.999
    assert torch.allclose(torch.tensor(outputs[0].outputs.embedding), torch.tensor(outputs[-1].outputs.embedding),
                          atol=1e-5)
    assert abs(torch.tensor(outputs[0].outputs.embedding).norm().item() - 1) < 1e-5
    [again] = embedder.embed(EMBED_PROMPTS[:1], use_tqdm=False)  # its blocks are cached now
    assert (again.num_cached_tokens > 0) == (kind == "LAST")
    assert torch.allclose(torch.tensor(again.outputs.embedding), torch.tensor(outputs[0].outputs.embedding),
                          atol=1e-5)
    with pytest.raises(ValueError, match="runner='pooling'"):
        embedder.generate(["hi"], use_tqdm=False)


def test_sentence_transformers_directory_sets_the_pooling(tiny_llama_dir: str, hf_hidden, tmp_path: Path) -> None:
    model_dir = tmp_path / "st"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 64]}))
    embedder = LLM(str(model_dir), task="embed", max_model_len=128)
    [out] = embedder.embed(EMBED_PROMPTS[0], use_tqdm=False)
    # No Normalize module: the mean itself, as sentence-transformers returns it.
    expected = hf_hidden(out.prompt_token_ids).mean(0)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-4, rtol=1e-4)
    [short] = embedder.embed([EMBED_PROMPTS[0]], PoolingParams(dimensions=16, normalize=True), use_tqdm=False)
    assert short.outputs.hidden_size == 16
    torch.testing.assert_close(torch.tensor(short.outputs.embedding),
                               torch.nn.functional.normalize(expected[:16], dim=-1), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 64\]"):
        embedder.embed("x", PoolingParams(dimensions=8), use_tqdm=False)


def test_sentence_transformers_itself_agrees_where_installed(tiny_llama_dir: str, tmp_path: Path) -> None:
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed here")
    model = st.SentenceTransformer(tiny_llama_dir, device="cpu")
    expected = model.encode(EMBED_PROMPTS, normalize_embeddings=True)
    embedder = LLM(tiny_llama_dir, runner="pooling", pooling_type="MEAN", max_model_len=128)
    got = [o.outputs.embedding for o in embedder.embed(EMBED_PROMPTS, use_tqdm=False)]
    assert torch.nn.functional.cosine_similarity(torch.tensor(got), torch.tensor(expected)).min() >= 0.999


def test_the_default_runner_generates_and_embeds_and_generate_refuses_embed(tiny_llama_dir: str, llm: LLM) -> None:
    [out] = llm.embed([EMBED_PROMPTS[1]], use_tqdm=False)
    assert out.outputs.hidden_size == 64
    generator = LLM(tiny_llama_dir, runner="generate", max_model_len=128)
    with pytest.raises(ValueError, match="runner='generate'"):
        generator.embed("x", use_tqdm=False)
    with pytest.raises(ValueError, match="runner must be 'auto', 'generate' or 'pooling'"):
        LLM(tiny_llama_dir, runner="reward")
    with pytest.raises(ValueError, match="task must be one of"):
        LLM(tiny_llama_dir, task="classify")
    assert os.path.isdir(tiny_llama_dir)


def test_n_completions_fork_after_the_prompts_prefill(llm: LLM) -> None:
    """n=4: the prompt is computed once (the others compute only its last partial block), and each completion
    is the one its own seed gives alone."""
    prompt = {"prompt_token_ids": list(range(3, 200))}  # 197 tokens: 12 full blocks of 16 and 5 more
    engine = llm.llm_engine
    schedule = engine.scheduler.schedule
    batched: list[int] = []

    def counting_schedule():
        out = schedule()
        batched.append(out.num_batched_tokens)
        return out

    engine.scheduler.schedule = counting_schedule
    try:
        [out] = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6), use_tqdm=False)
    finally:
        engine.scheduler.schedule = schedule
    # One prefill, three partial last blocks (5 tokens each), then 5 decode tokens per completion (without the
    # fork: 4 * 197 + 20).
    assert sum(batched) == 197 + 3 * 5 + 4 * 5
    alone = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6),
                          use_tqdm=False)[0].outputs[0].token_ids for i in range(4)]
    assert [c.token_ids for c in out.outputs] == alone
