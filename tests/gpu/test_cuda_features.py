"""The third wave's features on CUDA (skipped without a GPU): every model family against transformers, LoRA
adapters against their merged models, structured outputs, 4-bit GGUF and int8 weights against the same engine's
plain-torch path. fp32, so tokens must be equal (the Triton kernels sum in fp32 without TF32).
Run on a GPU machine: ``pytest -m gpu tests``."""

from __future__ import annotations

import json

import jsonschema
import pytest
import tiny_models
import torch
from e2e.test_correctness import hf_greedy, kvloom_greedy, mixed_prompts
from e2e.test_lora import PROMPTS as LORA_PROMPTS
from e2e.test_lora import adapters, expected, greedy  # noqa: F401  (fixtures)
from e2e.test_models_families import FAMILIES, family_dir, family_dirs  # noqa: F401  (fixture)
from e2e.test_structured_output import PROMPTS as JSON_PROMPTS
from e2e.test_structured_output import SCHEMA, json_params

from kvloom import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _llm(model_dir: str, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": "64MiB", **kwargs}
    return LLM(model=model_dir, device="cuda", **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_family_greedy_equals_transformers(family: str, family_dirs: dict[str, str],  # noqa: F811
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen2/3, Phi-3, Gemma 2 (soft-capping in the Triton attention), Gemma 3, and the three MoE layouts
    (experts in the Triton grouped GEMM), with prefill chunks beside decodes."""
    model_dir = family_dir(family, family_dirs, tmp_path_factory)
    prompts = mixed_prompts(400, count=6, seed=1)
    llm = _llm(model_dir, max_num_batched_tokens=64)
    assert llm.llm_engine.executor.driver.ops.name == "triton"
    assert kvloom_greedy(llm, prompts, 12) == hf_greedy(model_dir, prompts, 12)


def test_cuda_lora_mixed_batch_matches_the_merged_models(tiny_llama_dir: str, adapters: list,  # noqa: F811
                                                         expected: dict) -> None:  # noqa: F811
    llm = _llm(tiny_llama_dir, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    loras = [None, *adapters]
    cases = [(lora, index) for index in range(len(LORA_PROMPTS)) for lora in loras]
    got = greedy(llm, [LORA_PROMPTS[index] for _, index in cases], [lora for lora, _ in cases])
    for (lora, index), tokens in zip(cases, got):
        assert tokens == expected[None if lora is None else lora.lora_name][index], (lora, index)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_json_schema_outputs_validate(tiny_llama_dir: str, temperature: float) -> None:
    """The token bitmask applied by the Triton kernel on the device's logits."""
    llm = _llm(tiny_llama_dir, max_num_seqs=8)
    outputs = llm.generate(JSON_PROMPTS, json_params(temperature), use_tqdm=False)
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)


def test_cuda_q4_gguf_equals_the_dequantized_product(tmp_path) -> None:
    """A GGUF whose projections are Q4_0 / Q4_1 keeps them 4-bit (the Triton Q4 GEMM); greedy tokens equal the
    engine's with the weights dequantized at load (fp32: the 4-bit product multiplies the same values)."""
    checkpoint = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", tie_word_embeddings=False)
    gguf = tiny_models.write_tiny_gguf(str(tmp_path / "q4.gguf"), checkpoint, types={"attn": 2, "ffn": 3})
    prompts = mixed_prompts(400, count=6, seed=2)
    kept = _llm(gguf)
    assert kept.llm_engine.config.quantization == "gguf"
    dense = _llm(gguf, quantization="none")
    assert kvloom_greedy(kept, prompts, 8) == kvloom_greedy(dense, prompts, 8)


def test_cuda_int8_weights_stay_close_to_fp32(tiny_llama_dir: str) -> None:
    """int8 weights (the Triton weight-only GEMM): the first greedy token of most prompts equals fp32's."""
    prompts = mixed_prompts(400, count=8, seed=3)
    full = kvloom_greedy(_llm(tiny_llama_dir), prompts, 1)
    int8 = kvloom_greedy(_llm(tiny_llama_dir, quantization="int8"), prompts, 1)
    assert sum(a == b for a, b in zip(full, int8)) >= 6, (full, int8)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_cuda_8bit_kv_cache_holds_more_and_equals_its_reference(tiny_llama_dir: str, kv_cache_dtype: str) -> None:
    """The Triton kernels write and read the 8-bit cache (graphs, chunked prefill beside decodes, prefix cache):
    prompt logprobs equal the plain-torch reference reading the same format, within a few hundredths of fp32's."""
    from e2e.test_int8_kv import prompt_logprobs

    prompts = mixed_prompts(400, count=6, seed=15)
    kwargs = {"max_model_len": 128, "kv_cache_memory": "2MiB", "max_num_batched_tokens": 32,
              "enable_prefix_caching": True}
    full = _llm(tiny_llama_dir, **kwargs)
    quant = _llm(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype, **kwargs)
    assert quant.llm_engine.executor.driver.ops.name == "triton"
    blocks = [llm.llm_engine.kv_cache_manager.num_blocks - 1 for llm in (full, quant)]
    head_dim = full.llm_engine.model_config.head_dim
    expected_ratio = 4 * head_dim / (head_dim + 2) if kv_cache_dtype == "int8" else 4.0  # fp32's 4 bytes
    assert abs(blocks[1] / blocks[0] - expected_ratio) < 0.01, blocks
    reference = _llm(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype,
                     override_backend_config={"attention_backend": "reference"}, **kwargs)
    ours, theirs, exact = (prompt_logprobs(llm, prompts) for llm in (quant, reference, full))
    for a, b, c in zip(ours, theirs, exact):
        # The two engines' keys and values differ in their last bits (other kernels before attention), and a
        # value that close to a rounding boundary takes the next code in one of them: the gap between them is a
        # few such flips, a small share of what the 8-bit format itself moves the logprobs.
        gap = max(abs(x - y) for x, y in zip(a, b))
        noise = max(abs(y - z) for y, z in zip(b, c))
        assert gap <= max(1e-3, 0.25 * noise), (gap, noise)
    # Against the full-precision cache, over every prompt position (as tests/e2e/test_int8_kv.py on the CPU: one
    # 5-token prompt's own mean is too few positions; an fp8 cache gave 0.113 there on an H200).
    diffs = [abs(x - z) for a, c in zip(ours, exact) for x, z in zip(a, c)]
    assert 0 < sum(diffs) / len(diffs) < 0.1 and max(diffs) < 0.5, (sum(diffs) / len(diffs), max(diffs))
    assert kvloom_greedy(quant, prompts, 8) == kvloom_greedy(reference, prompts, 8)


def test_cuda_prompt_logprobs_and_sampling_params(tiny_llama_dir: str) -> None:
    """Penalties, logit_bias, n>1 and logprobs on the device sampler run and keep their shapes."""
    llm = _llm(tiny_llama_dir)
    params = SamplingParams(n=3, temperature=0.9, top_k=20, repetition_penalty=1.3, presence_penalty=0.5,
                            logit_bias={7: 5.0}, logprobs=3, prompt_logprobs=2, max_tokens=6, seed=1,
                            ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 6 for c in out.outputs)
    assert all(len(c.logprobs) == 6 for c in out.outputs) and len(out.prompt_logprobs) == 4


@pytest.mark.parametrize("kwargs", [{}, {"enforce_eager": True}, {"max_num_batched_tokens": 32}],
                         ids=["graphs", "eager", "chunked"])
def test_cuda_async_scheduling_equals_the_synchronous_engine(tiny_llama_dir: str, kwargs: dict) -> None:
    """Step N+1 launched before step N's tokens are read: its placeholder tokens come from step N's output on the
    device (through the graphs' input buffers, or the eager inputs); greedy, seeded sampling and stop tokens
    give the synchronous engine's outputs."""
    prompts = mixed_prompts(400, count=13, seed=3)
    greedy = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)

    def run(llm: LLM, params) -> list:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]

    plain = _llm(tiny_llama_dir, async_scheduling=False, **kwargs)
    assert not plain.llm_engine.async_scheduling
    wanted = run(plain, greedy), run(plain, sampled)
    stop = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[wanted[0][-1][0][5]])
    wanted_stop = run(plain, stop)
    ahead = _llm(tiny_llama_dir, async_scheduling=True, **kwargs)
    assert ahead.llm_engine.async_scheduling
    assert (run(ahead, greedy), run(ahead, sampled)) == wanted
    assert run(ahead, stop) == wanted_stop
    assert not ahead.llm_engine.executor.driver.requests


def test_cuda_lazy_graph_capture_equals_capture_at_start(tiny_llama_dir: str) -> None:
    """graph_capture='lazy' (the default) captures no bucket at start and each one at its first step, between
    steps (async scheduling's step in flight included); the tokens equal those of graphs captured at start."""
    prompts = mixed_prompts(400, count=13, seed=4)
    start = _llm(tiny_llama_dir, async_scheduling=False, override_backend_config={"graph_capture": "start"})
    assert sorted(start.llm_engine.executor.driver.graphs.graphs) == start.llm_engine.executor.driver.graphs.buckets
    wanted = kvloom_greedy(start, prompts, 12)
    for async_scheduling in (False, True):
        lazy = _llm(tiny_llama_dir, async_scheduling=async_scheduling)
        graphs = lazy.llm_engine.executor.driver.graphs
        assert not graphs.graphs
        assert kvloom_greedy(lazy, prompts, 12) == wanted
        assert graphs.graphs and set(graphs.graphs) <= set(graphs.buckets)
