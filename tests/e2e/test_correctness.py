"""kvloom against HF transformers (the oracle): logits and greedy tokens, under every batching mode."""

from __future__ import annotations

import random

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.ops import cpu
from kvloom.outputs import Logprob

MAX_TOKENS = 20


def mixed_prompts(vocab_size: int, count: int = 16, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (3..60), ids away from the special tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 60))] for _ in range(count)]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                 min_new_tokens=max_tokens, pad_token_id=0, eos_token_id=None)
            results.append(out[0, len(prompt):].tolist())
    return results


def kvloom_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_blocks_held(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.fixture(scope="module")
def llama_expected(tiny_llama_dir: str) -> tuple[list[list[int]], list[list[int]]]:
    prompts = mixed_prompts(400)
    return prompts, hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir", "tiny_mistral_dir"])
def test_prompt_logprobs_match_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    """Logits, seen through logprobs at every prompt position (fp32; tolerance 1e-4: the sums run
    in a different order than transformers', nothing else differs)."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256)
    prompt = mixed_prompts(400, count=1, seed=5)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=10, logprobs=10),
                       use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        assert prompt[position] in entry
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - expected[position - 1, token_id].item()) < 1e-4
    last = out.outputs[0].logprobs[0]
    for token_id, logprob in last.items():
        assert abs(logprob.logprob - expected[-1, token_id].item()) < 1e-4
    assert out.outputs[0].token_ids[0] == int(expected[-1].argmax())


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_mistral_dir", "tiny_llama3_dir"])
def test_greedy_batch_equals_transformers_generate(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    prompts = mixed_prompts(400, count=16, seed=1)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256)
    assert kvloom_greedy(llm, prompts) == expected
    assert_no_blocks_held(llm)


def test_sliding_window_mistral_equals_transformers(tmp_path) -> None:
    from tiny_models import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(str(tmp_path / "mistral-sw"), arch="mistral", sliding_window=16)
    prompts = mixed_prompts(400, count=4, seed=2)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128)
    assert kvloom_greedy(llm, prompts) == expected


BATCHING_MODES = {
    "one_at_a_time": {},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "preemption": {"kv_cache_memory": 24 * 2 * 2 * 16 * 2 * 16 * 4, "max_num_seqs": 16},
    "every_prompt_chunked": {"max_num_batched_tokens": 7},
    "contiguous_blocks": {"block_size": 128},
    "block_size_1": {"block_size": 1},
    # Every attention backend gives the oracle's tokens too ('auto' is the C++ kernel on the CPU).
    "native_attention": {"override_backend_config": {"attention_backend": "native"}},
    "reference_attention": {"override_backend_config": {"attention_backend": "reference"}},
    "native_attention_chunked": {"override_backend_config": {"attention_backend": "native"},
                                 "max_num_batched_tokens": 7},
}


@pytest.mark.parametrize("mode", sorted(BATCHING_MODES))
def test_greedy_tokens_do_not_depend_on_batching(mode: str, tiny_llama_dir: str, llama_expected) -> None:
    prompts, expected = llama_expected
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, **BATCHING_MODES[mode])
    if mode == "one_at_a_time":
        got = [kvloom_greedy(llm, [p])[0] for p in prompts]
    else:
        got = kvloom_greedy(llm, prompts)
    assert got == expected
    if mode == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_no_blocks_held(llm)


def test_prefix_cache_hits_give_the_same_tokens(tiny_llama_dir: str, llama_expected) -> None:
    prompts, expected = llama_expected
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128)
    kvloom_greedy(llm, prompts)
    hits_before = llm.llm_engine.kv_cache_manager.prefix_hits
    # A shared 32-token prefix, then the same prompts again: both hit the cache.
    assert kvloom_greedy(llm, prompts) == expected
    assert llm.llm_engine.kv_cache_manager.prefix_hits > hits_before
    assert_no_blocks_held(llm)


_UNRANKED = Logprob(logprob=float("-inf"))  # a token outside the top two
TEXT_PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
                "The quick brown fox jumps over the", "In 1492, Columbus", "Water boils at a temperature of"]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "smollm2", "smollm2-4bit"])
def test_bf16_fast_path_greedy_equals_the_reference_path(model: str, request: pytest.FixtureRequest) -> None:
    """bf16 on the CPU: the C++ kernels and packed linears against plain torch everywhere.

    SmolLM2 gets text prompts: on random token ids its next-token distributions are nearly flat.
    Even on text, bf16 rounding (in either path: the sums run in another order) can flip a
    near-tie, so a SmolLM2 prompt may part ways where both paths see the two candidates within
    two bf16 steps of each other (0.25 at its logit scale), and only there; most must not part.
    """
    quantization = None
    if model.startswith("smollm2"):
        # "smollm2": the file's 4-bit weights dequantized (the bf16 GEMM); "smollm2-4bit": kept 4-bit (the Q4 GEMM
        # against torch's Q4 product).
        request.getfixturevalue("smollm2_gguf_path")
        model_dir, prompts, near_tie = "SmolLM2-135M-Instruct", TEXT_PROMPTS, 0.25
        quantization = "gguf" if model == "smollm2-4bit" else "none"
        if quantization == "gguf" and not (cpu.cpu_kernel_available() and torch.ops.kvloom.q4_gemm_kernel()):
            # The plain-loop Q4 product (a build without AVX2) is checked op by op in tests/unit/test_q4_ops.py;
            # through the whole model it takes minutes.
            pytest.skip("this build's Q4 product runs on plain loops")
        if quantization == "gguf":
            # The head multiplies the Q8_0 table by the final hidden state quantized per block of 32: one code
            # apart (the two paths' bf16 roundings on either side of a code's edge) moves a logit by a few bf16
            # steps more.
            near_tie = 0.5
    else:
        model_dir, prompts, near_tie = request.getfixturevalue(model), mixed_prompts(400, count=16, seed=4), 0.0
    results = []
    for backend in ("auto", "reference"):
        llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=128, quantization=quantization,
                  override_backend_config={"attention_backend": backend})
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        outputs = llm.generate([p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        results.append([o.outputs[0] for o in outputs])
    parted = 0
    for fast, reference in zip(*results):
        if fast.token_ids == reference.token_ids:
            continue
        parted += 1
        step = next(i for i, (a, b) in enumerate(zip(fast.token_ids, reference.token_ids)) if a != b)
        for ours, theirs in ((fast, reference), (reference, fast)):
            chosen, other = ours.token_ids[step], theirs.token_ids[step]
            gap = ours.logprobs[step][chosen].logprob - ours.logprobs[step].get(other, _UNRANKED).logprob
            assert gap <= near_tie, f"the paths part at step {step} where one path's margin is {gap:.3f}"
    # 4-bit: both paths quantize each activation block to int8 codes, and a bf16 rounding difference that moves a
    # value across a code's rounding edge moves the product by a whole code step, so near ties tip more often
    # (each parting is still checked above to be a near tie).
    assert parted <= len(prompts) // (2 if quantization == "gguf" else 4)
