"""A GGUF's 4- and 5-bit weights kept in their code blocks (``quantization="gguf"``, the default for such a file).

The file's Q4_0 / Q4_1 / Q4_K (4-bit) and Q5_1 / Q5_K (5-bit) blocks arrive as ``Q4Blocks`` with exactly the values
the file's dequantization gives, stay in blocks in the projections (csrc/gemm_q4.cpp's product for 4-bit codes and
csrc/gemm_int8.cpp's on blocks for 5-bit ones on the CPU, torch's under the reference backend), and
``quantization="none"`` dequantizes them at load as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models
import torch

from e2e.test_correctness import kvloom_greedy, mixed_prompts
from kvloom import LLM, SamplingParams
from kvloom.bench.int8_quality import weight_bytes
from kvloom.layers.linear import Linear
from kvloom.loader import gguf
from kvloom.loader.weights import iter_weights, resolve_model
from kvloom.ops import cpu
from kvloom.ops.q4 import NativeQ4Linear, PackedQ4Weight, Q4Blocks
from kvloom.ops.table import REFERENCE_OPS

GGML_Q4_0, GGML_Q4_1, GGML_F16, GGML_Q8_0, GGML_Q5_1 = 2, 3, 1, 8, 7
# The k-quant product on the file's super-blocks, asked for (the default turns it on where measured: AVX2, portable).
SUPER_BLOCKS = {"gguf_super_blocks": True}


def _tiny_gguf(factory: pytest.TempPathFactory, name: str, tied: bool, down: int) -> str:
    """A tiny Llama GGUF with Q4_0 q/k/v/o and Q4_1 gate/up, down_proj of type ``down`` and a Q8_0 embedding."""
    root = factory.mktemp(name)
    checkpoint = tiny_models.build_tiny_checkpoint(str(root / "hf"), arch="llama", tie_word_embeddings=tied)
    return tiny_models.write_tiny_gguf(str(root / f"{name}.gguf"), checkpoint,
                                       types={"attn": GGML_Q4_0, "ffn": GGML_Q4_1, "ffn_down": down})


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama whose q/k/v are Q4_0 and MLP Q4_1, o_proj Q4_0, down_proj F16 (a float layer beside them)."""
    return _tiny_gguf(tmp_path_factory, "q4_gguf", tied=False, down=GGML_F16)



def worst_prompt_logprob_gap(ours: LLM, theirs: LLM, prompts: list[list[int]]) -> float:
    """The largest difference between two engines' logprobs of the prompts' own tokens."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    worst = 0.0
    for a_out, b_out in zip(ours.generate(requests, params, use_tqdm=False),
                            theirs.generate(requests, params, use_tqdm=False)):
        for a, b in zip(a_out.prompt_logprobs[1:], b_out.prompt_logprobs[1:]):
            worst = max(worst, abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob))
    return worst

def test_kept_4bit_blocks_hold_exactly_the_files_values(q4_gguf: str) -> None:
    source = resolve_model(q4_gguf)
    floats = dict(iter_weights(source))
    kept = dict(iter_weights(source, keep_q4=True))
    blocks = {name: t for name, t in kept.items() if isinstance(t, Q4Blocks)}
    assert {name.rsplit(".", 2)[-2] for name in blocks} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj"}
    for name, tensor in blocks.items():  # q/k rows in HF's rotary order, like the floats
        assert torch.equal(tensor.dequantize(), floats[name]), name


def test_q5_0_weights_are_kept_with_exactly_the_files_values(tmp_path) -> None:
    """Q5_0 q/k/v (write_tiny_gguf's default for attention) beside a Q4_1 MLP: as int8 blocks (codes q - 16, the
    block's scale) for the int8 products, as 5-bit code blocks (codes q, offset -16 d) for quantization="gguf",
    both equal to the file's values; the model runs the 5-bit code-block product by default (the int8 one with
    gguf_5bit_blocks off), and stays close to its dequantized load either way."""
    from kvloom.ops.int8 import Int8Blocks

    checkpoint = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", tie_word_embeddings=False)
    path = tiny_models.write_tiny_gguf(str(tmp_path / "q5.gguf"), checkpoint, types={"ffn_down": GGML_F16})
    source = resolve_model(path)
    floats = dict(iter_weights(source))
    as_int8 = {name: t for name, t in iter_weights(source, keep_q8_0=True) if isinstance(t, Int8Blocks)}
    as_codes = {name: t for name, t in iter_weights(source, keep_q8_0=True, keep_q4=True, keep_q5=True)
                if isinstance(t, Q4Blocks) and name in as_int8}
    assert {name.rsplit(".", 2)[-2] for name in as_int8 if ".layers." in name} == {"q_proj", "k_proj", "v_proj"}
    assert {name.rsplit(".", 2)[-2] for name in as_codes} == {"q_proj", "k_proj", "v_proj"}
    for name, blocks in as_int8.items():
        if ".layers." in name:
            assert blocks.qweight.min() >= -16 and blocks.qweight.max() <= 15
        assert torch.equal(blocks.dequantize(), floats[name]), name
    for name, blocks in as_codes.items():
        assert int(blocks.codes.max()) <= 31 and torch.equal(blocks.m, -16 * blocks.d)
        assert torch.equal(blocks.dequantize(), floats[name]), name
    floats_llm = LLM(model=path, dtype="float32", max_model_len=128, quantization="none")
    prompts = mixed_prompts(400, count=4, seed=5)
    for backend, kind in (({}, "PackedQ4Weight"), ({"gguf_5bit_blocks": False}, "Int8Blocks")):
        llm = LLM(model=path, dtype="float32", max_model_len=128, override_backend_config=backend)
        model = llm.llm_engine.executor.driver.model
        if cpu.cpu_kernel_available():
            assert all(kind in type(layer.self_attn.qkv_proj.packed).__name__ for layer in model.layers)
        assert worst_prompt_logprob_gap(llm, floats_llm, prompts) < 0.05
        del llm, model


@pytest.mark.parametrize(("name", "block_bytes", "top_code"), [("Q4_K", 144, 15), ("Q5_K", 176, 31)])
def test_k_quant_blocks_equal_the_gguf_packages_dequantization(name: str, block_bytes: int, top_code: int) -> None:
    """Q4_K and Q5_K (no Python quantizer exists): random super-blocks, decoded by kvloom and by gguf.quants; their
    codes take all 4 or 5 bits."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(block_bytes)
    n, k = 3, 512
    count = n * k // 256
    raw = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    for offset in (0, 2):  # d and dmin: positive fp16 scales
        raw[:, offset:offset + 2] = rng.uniform(1e-3, 0.05, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    ggml_type = GGMLQuantizationType[name]
    expected = dequantize(raw.reshape(n, -1), ggml_type)
    blocks = gguf.q4_blocks(torch.from_numpy(raw.reshape(-1).copy()), int(ggml_type), (n, k))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))
    assert int(blocks.codes.max()) == top_code
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf.q4_blocks(torch.zeros(block_bytes * 2, dtype=torch.uint8), int(ggml_type), (2, 320))


def test_q6_k_blocks_equal_the_gguf_packages_dequantization() -> None:
    """Q6_K: random super-blocks decoded by kvloom (codes 0..63, a scale and an offset per 16) and by gguf.quants."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(6)
    n, k = 3, 512
    count = n * k // 256
    raw = rng.integers(0, 256, size=(count, 210), dtype=np.uint8)
    raw[:, 208:210] = rng.uniform(1e-3, 0.05, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    expected = dequantize(raw.reshape(n, -1), GGMLQuantizationType.Q6_K)
    blocks = gguf.q4_blocks(torch.from_numpy(raw.reshape(-1).copy()), gguf.GGML_Q6_K, (n, k))
    assert blocks.group == 16 and int(blocks.codes.max()) == 63
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf.q4_blocks(torch.zeros(210 * 2, dtype=torch.uint8), gguf.GGML_Q6_K, (2, 320))


def test_q6_k_projections_stay_in_blocks_beside_4bit_ones(tmp_path) -> None:
    """A tiny Llama (width 256) whose v and down are Q6_K and the rest 4-bit, as llama.cpp's Q4_K_M has them (Q4_1
    here for Q4_K, which the gguf package cannot write; both are 4-bit codes with a scale and offset per 32): the
    fused q|k|v holds all three in groups of 16 (the 4-bit blocks' repeated), every projection stays in code blocks
    (the CPU's 6-bit form where a Q6_K shard is), as close to the dequantized load as the reference backend's torch
    product on the same blocks; gguf_6bit_blocks false dequantizes the layers with Q6_K shards."""
    q4_1, q6_k = 3, 14
    checkpoint = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden_size=256,
                                                   intermediate_size=256, tie_word_embeddings=False)
    path = tiny_models.write_tiny_gguf(str(tmp_path / "q4_k_m.gguf"), checkpoint,
                                       types={"attn": q4_1, "attn_o": q4_1, "ffn": q4_1, "attn_v": q6_k,
                                              "ffn_down": q6_k})
    llm = LLM(model=path, dtype="float32", max_model_len=128)
    assert llm.llm_engine.config.quantization == "gguf"
    projections = _projections(llm)
    if cpu.cpu_kernel_available():
        # down (Q6_K alone) on the file's super-blocks (ops/q4k.py, the default), q|k|v (Q4_1 beside Q6_K) as code
        # blocks
        assert {type(m.packed).__name__ for m in projections} == {"PackedQ4Weight", "PackedKQuantWeight"}
        six = [m for m in projections if getattr(m.packed, "high", None) is not None and m.packed.high.shape[2] == 2]
        supers = sum(getattr(m.packed, "q6_k", torch.empty(0)).numel() > 0 for m in projections)
        # q|k|v of both layers as code blocks, down of both on super-blocks
        assert (len(six), supers) == (2, 2)
    reference = LLM(model=path, dtype="float32", max_model_len=128,
                    override_backend_config={"attention_backend": "reference"})
    floats_llm = LLM(model=path, dtype="float32", max_model_len=128, quantization="none")
    prompts = mixed_prompts(400, count=4, seed=11)
    # The C++ and torch products are the same (tests/unit/test_q4_ops.py pins them to fp32 rounding), but a last-bit
    # difference can move an activation's int8 code at a rounding tie, and this random 4-bit model amplifies that
    # (0.042 here, as with no Q6_K at all: 0.039); both stand as far from the floats (0.118 and 0.116).
    to_floats, reference_to_floats = (worst_prompt_logprob_gap(ours, floats_llm, prompts) for ours in (llm, reference))
    assert worst_prompt_logprob_gap(llm, reference, prompts) < 0.08
    assert to_floats < 0.2 and abs(to_floats - reference_to_floats) < 0.01
    off = LLM(model=path, dtype="float32", max_model_len=128, override_backend_config={"gguf_6bit_blocks": False})
    kept = [m for m in _projections(off) if type(m.packed).__name__ == "PackedQ4Weight"]
    if cpu.cpu_kernel_available():
        assert len(kept) == 4  # o and gate|up of both layers; the ones with a Q6_K shard dequantized


def test_q5_1_projections_stay_in_blocks_and_close_to_the_float_load(tmp_path) -> None:
    """A tiny Llama whose attention and MLP are Q5_1: the blocks hold exactly the file's values (5-bit codes); the
    default keeps them (quantization resolves to 'gguf'; on the CPU the 4-bit product with the fifth bits beside
    the nibbles), override gguf_5bit_blocks false dequantizes them; kept, the model is close to the dequantized
    load and to the reference backend's torch product on the same blocks."""
    checkpoint = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", tie_word_embeddings=False)
    path = tiny_models.write_tiny_gguf(str(tmp_path / "q5_1.gguf"), checkpoint,
                                       types={"attn": GGML_Q5_1, "attn_o": GGML_Q5_1, "ffn": GGML_Q5_1,
                                              "ffn_down": GGML_Q5_1})
    source = resolve_model(path)
    floats = dict(iter_weights(source))
    assert not any(isinstance(t, Q4Blocks) for _, t in iter_weights(source, keep_q4=True))
    kept = {name: t for name, t in iter_weights(source, keep_q4=True, keep_q5=True) if isinstance(t, Q4Blocks)}
    assert any(not t.fits_4_bits() for t in kept.values())
    for name, tensor in kept.items():
        assert torch.equal(tensor.dequantize(), floats[name]), name
    off = LLM(model=path, dtype="float32", max_model_len=128, override_backend_config={"gguf_5bit_blocks": False})
    assert off.llm_engine.config.quantization is None
    del off
    llm = LLM(model=path, dtype="float32", max_model_len=128)
    assert llm.llm_engine.config.quantization == "gguf"
    kinds = {type(m.packed).__name__ for m in _projections(llm)}
    if cpu.cpu_kernel_available():
        assert kinds == {"PackedQ4Weight"}, kinds
    reference = LLM(model=path, dtype="float32", max_model_len=128, quantization="gguf",
                    override_backend_config={"attention_backend": "reference"})
    assert {type(m.packed).__name__ for m in _projections(reference)} == {"NativeQ4Linear"}
    prompts = mixed_prompts(400, count=4, seed=9)
    floats_llm = LLM(model=path, dtype="float32", max_model_len=128, quantization="none")
    # The C++ and torch products are the same product (x quantized per block, llama.cpp's), up to fp32 rounding
    # (1e-6 apart here); both 0.026 from the floats.
    assert worst_prompt_logprob_gap(llm, floats_llm, prompts) < 0.04
    assert worst_prompt_logprob_gap(llm, reference, prompts) < 1e-4


def _projections(llm: LLM) -> list[Linear]:
    model = llm.llm_engine.executor.driver.model
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_keeps_4bit_and_equals_the_torch_reference(q4_gguf: str, dtype: str) -> None:
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    prompts = mixed_prompts(400, count=6, seed=2)
    fast = LLM(model=q4_gguf, dtype=dtype, max_model_len=128)
    assert fast.llm_engine.config.quantization == "gguf"
    kinds = [type(m.packed).__name__ for m in _projections(fast)]
    # qkv, o, gate_up 4-bit per layer; down_proj (F16 in the file) packed float
    assert kinds.count("PackedQ4Weight") == 3 * kinds.count("PackedWeight") or "PackedWeight" not in kinds
    assert kinds.count("PackedQ4Weight") >= 3
    reference = LLM(model=q4_gguf, dtype=dtype, max_model_len=128,
                    override_backend_config={"attention_backend": "reference"})
    assert all(type(m.packed).__name__ == "NativeQ4Linear" for m in _projections(reference)
               if m.packed is not None and "Q4" in type(m.packed).__name__)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for ours, theirs in zip(fast.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False),
                            reference.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        a = [next(iter(lp.values())).logprob for lp in ours.prompt_logprobs[1:]]
        b = [next(iter(lp.values())).logprob for lp in theirs.prompt_logprobs[1:]]
        # An activation whose int8 code sits at a rounding tie may land one step apart in the two quantizers (C++
        # and torch), which moves that token's logprob, and later ones through its keys and values, by up to
        # ~1e-2 in this tiny model; bf16 also rounds the model's activations in other places.
        diff = np.abs(np.subtract(a, b))
        assert diff.max() < (2e-2 if dtype == "float32" else 6e-2), diff
    if dtype == "float32":
        assert kvloom_greedy(fast, prompts, 8) == kvloom_greedy(reference, prompts, 8)


def test_none_dequantizes_and_gguf_stays_close_to_it(q4_gguf: str) -> None:
    """quantization='none': the dequantized floats as before; the 4-bit product (activations quantized per block
    of 32, as llama.cpp does) stays within a small distance of it."""
    dense = LLM(model=q4_gguf, dtype="float32", max_model_len=128, quantization="none")
    assert dense.llm_engine.config.quantization is None
    assert not any("Q4" in type(m.packed).__name__ for m in _projections(dense))
    kept = LLM(model=q4_gguf, dtype="float32", max_model_len=128)
    worst = worst_prompt_logprob_gap(kept, dense, mixed_prompts(400, count=4, seed=7))
    assert worst < 0.05, worst


def test_a_fused_layer_partly_4bit_is_held_in_float() -> None:
    """q in 4-bit beside k in float (a Q4_K_M file's Q6_K tensors): the layer is dequantized whole."""
    layer = Linear(64, [32, 32])
    q = Q4Blocks.quantize(torch.randn(32, 64))
    k = torch.randn(32, 64)
    layer.load_shard("weight", 0, q)
    layer.load_shard("weight", 1, k)
    layer.process_weights_after_loading(REFERENCE_OPS)
    assert layer.q4 is None and layer.packed is None
    assert torch.equal(layer.weight.data, torch.cat((q.dequantize(), k)))


@pytest.mark.parametrize("int8_first", [False, True])
def test_a_fused_layer_partly_int8_is_held_in_float(int8_first: bool) -> None:
    """v in Q8_0 blocks beside q and k in float (llama.cpp's Q4_K_M of a 576-wide model: Q5_0 q/k, Q8_0 v), in
    either order: the layer is held in float with every shard exact (the float shards were once lost: zeros)."""
    from kvloom.ops.int8 import Int8Blocks, Int8Rows

    layer = Linear(64, [32, 16, 16])
    q, k = torch.randn(32, 64), torch.randn(16, 64)
    v = Int8Blocks(torch.randint(-127, 128, (16, 64), dtype=torch.int8), torch.rand(16, 2))
    order = [(2, v), (0, q), (1, k)] if int8_first else [(0, q), (1, k), (2, v)]
    for shard, tensor in order:
        layer.load_shard("weight", shard, tensor)
    layer.process_weights_after_loading(REFERENCE_OPS)
    assert layer.qweight is None
    assert torch.equal(layer.weight.data, torch.cat((q, k, v.dequantize())))
    rows = Int8Rows.quantize(torch.randn(16, 64))  # an int8 checkpoint's per-row shard beside a float one
    layer = Linear(64, [16, 16])
    layer.load_shard("weight", 0, torch.ones(16, 64))
    layer.load_shard("weight", 1, rows)
    layer.process_weights_after_loading(REFERENCE_OPS)
    assert torch.equal(layer.weight.data, torch.cat((torch.ones(16, 64), rows.dequantize())))
    # Read as float, then every shard read again as int8 (SmoothQuant's second pass): the layer ends int8.
    layer = Linear(64, [16, 16])
    for shard in (0, 1):
        layer.load_shard("weight", shard, torch.randn(16, 64))
    for shard in (0, 1):
        layer.load_shard("weight", shard, rows)
    assert layer.quantized and not layer.float_shards and layer.weight.numel() == 0


@pytest.mark.parametrize("int8_first", [False, True])
def test_q5_0_code_blocks_beside_a_q8_0_v_join_its_int8_blocks(int8_first: bool) -> None:
    """llama.cpp's Q4_K_M of a 576-wide model: Q5_0 q and k (code blocks, offset -16 d) beside a Q8_0 v (int8
    blocks). Q5_0's values are int8 codes q - 16 times d, so the layer holds all three as int8 blocks, exactly, and
    packs one int8 product (it was dequantized whole); code blocks with offsets of their own (Q4_1) beside Q8_0
    still make the layer float."""
    from kvloom.ops.int8 import Int8Blocks, w8a8_blocks_linear_reference

    g = torch.Generator().manual_seed(4)

    def q5_0(rows: int) -> Q4Blocks:
        d = (torch.rand(rows, 2, generator=g) * 0.02).half().float()  # fp16 scales, as a file has
        return Q4Blocks(torch.randint(0, 32, (rows, 64), generator=g, dtype=torch.uint8), d, -16 * d)

    q, k = q5_0(32), q5_0(16)
    v = Int8Blocks(torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8), torch.rand(16, 2, generator=g))
    layer = Linear(64, [32, 16, 16])
    order = [(2, v), (0, q), (1, k)] if int8_first else [(0, q), (1, k), (2, v)]
    for shard, tensor in order:
        layer.load_shard("weight", shard, tensor)
    layer.process_weights_after_loading(REFERENCE_OPS)
    assert layer.q4 is None and layer.weight.numel() == 0
    assert "Int8Blocks" in type(layer.packed).__name__
    expected = torch.cat((q.dequantize(), k.dequantize(), v.dequantize()))
    held = Int8Blocks(layer.packed.qweight, layer.packed.scale)
    assert torch.equal(held.dequantize(), expected)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(layer(x), w8a8_blocks_linear_reference(x, *held), rtol=1e-5, atol=1e-4)
    q4_1 = Q4Blocks.quantize(torch.randn(32, 64, generator=g))
    assert q4_1.as_int8_blocks() is None and q.as_int8_blocks() is not None
    assert Q4Blocks(q.codes, q.d, q.d * 1e6).as_int8_blocks() is None  # a whole but far too large offset
    layer = Linear(64, [32, 16])
    layer.load_shard("weight", 0, q4_1)
    layer.load_shard("weight", 1, Int8Blocks(v.qweight, v.scale))
    layer.process_weights_after_loading(REFERENCE_OPS)
    assert layer.qweight is None and torch.equal(layer.weight.data, torch.cat((q4_1.dequantize(), v.dequantize())))


def test_a_gguf_with_a_q8_0_v_beside_q5_0_q_and_k_runs_the_int8_product(tmp_path) -> None:
    checkpoint = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", tie_word_embeddings=False)
    path = tiny_models.write_tiny_gguf(str(tmp_path / "mixed.gguf"), checkpoint,
                                       types={"attn_v": GGML_Q8_0, "ffn_down": GGML_F16})
    kept = LLM(model=path, dtype="float32", max_model_len=128)
    assert kept.llm_engine.config.quantization == "gguf"
    if cpu.cpu_kernel_available():
        model = kept.llm_engine.executor.driver.model
        assert all(type(layer.self_attn.qkv_proj.packed).__name__ == "PackedInt8BlocksWeight"
                   for layer in model.layers)
    floats = LLM(model=path, dtype="float32", max_model_len=128, quantization="none")
    worst = worst_prompt_logprob_gap(kept, floats, mixed_prompts(400, count=4, seed=3))
    assert worst < 0.05, worst


def test_a_gguf_with_a_q8_0_v_beside_float_q_and_k_stays_close_to_its_float_load(tmp_path) -> None:
    """The file's 4-bit MLP makes quantization 'gguf' (Q8_0 kept as blocks); the attention's q/k/v (F16, F16,
    Q8_0) are held in float, so the model stays as close to its dequantized load as the 4-bit product allows."""
    checkpoint = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", tie_word_embeddings=False)
    path = tiny_models.write_tiny_gguf(str(tmp_path / "mixed.gguf"), checkpoint,
                                       types={"attn": GGML_F16, "attn_v": GGML_Q8_0, "attn_o": GGML_F16,
                                              "ffn": GGML_Q4_1, "ffn_down": GGML_F16})
    kept = LLM(model=path, dtype="float32", max_model_len=128)
    assert kept.llm_engine.config.quantization == "gguf"
    model = kept.llm_engine.executor.driver.model
    assert all(layer.self_attn.qkv_proj.qweight is None for layer in model.layers)
    floats = LLM(model=path, dtype="float32", max_model_len=128, quantization="none")
    worst = worst_prompt_logprob_gap(kept, floats, mixed_prompts(400, count=4, seed=3))
    assert worst < 0.05, worst


def test_a_layer_all_4bit_packs_the_platforms_q4_product() -> None:
    layer = Linear(64, [32, 32])
    halves = [Q4Blocks.quantize(torch.randn(32, 64)) for _ in range(2)]
    for shard, blocks in enumerate(halves):
        layer.load_shard("weight", shard, blocks)
    layer.process_weights_after_loading(REFERENCE_OPS)
    assert layer.weight.numel() == 0 and layer.q4 is None
    assert torch.equal(layer.packed.weight.codes, torch.cat([h.codes for h in halves]))
    with pytest.raises(ValueError, match="expected"):
        Linear(64, [32]).load_shard("weight", 0, Q4Blocks.quantize(torch.randn(16, 64)))
    with pytest.raises(ValueError, match="only fill a weight"):
        Linear(64, [32], bias=True).load_shard("bias", 0, halves[0])


def test_quantization_values_are_checked(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=tiny_llama_dir, quantization="gguf")
    with pytest.raises(ValueError, match="'gguf'.*'none'|'none'.*'gguf'"):
        LLM(model=tiny_llama_dir, quantization="q4")


def test_the_default_model_keeps_its_4bit_weights(smollm2_gguf_path: str) -> None:
    """SmolLM2's Q4_1 projections stay 4-bit, 5/16 of the bytes bf16 would hold (the codes are a quarter, the fp16
    block scales and offsets a sixteenth), and it still answers."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    llm = LLM(model="SmolLM2-135M-Instruct", max_model_len=256)
    products = [m.packed for m in _projections(llm)]
    assert products and all(isinstance(p, PackedQ4Weight) for p in products)
    q4_bytes = sum(p.data.numel() + p.scales.numel() * p.scales.element_size() for p in products)
    bf16_bytes = sum(2 * p.in_features * p.out_features for p in products)
    assert q4_bytes <= 0.32 * bf16_bytes, (q4_bytes, bf16_bytes)
    # The Q8_0 embedding stays int8 blocks, held once: the tied head multiplies by them and the embedding looks its
    # rows up in the head's packing. Everything held: 36.5% of bf16's bytes (the file itself is 36%).
    model = llm.llm_engine.executor.driver.model
    assert type(model.lm_head.packed).__name__ == "PackedInt8BlocksWeight"
    assert model.embed_tokens.qweight is None and model.embed_tokens.table is not None
    bf16_model_bytes = 2 * sum(p.in_features * p.out_features for p in products + [model.lm_head.packed])
    assert weight_bytes(llm) <= 0.37 * bf16_model_bytes, (weight_bytes(llm), bf16_model_bytes)
    # (Asked only "What is the capital of France?", the 4-bit model answers "L'Étoile, la Marseillaise, ..." greedily,
    # as llama.cpp does from the same file: its first token is a near tie that 4 bits tip.)
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama with tied embeddings: a Q8_0 table (embedding and head), Q4_0 / Q4_1 projections."""
    return _tiny_gguf(tmp_path_factory, "tied_gguf", tied=True, down=GGML_Q4_1)


def _file_table(path: str) -> torch.Tensor:
    return dict(iter_weights(resolve_model(path), keep_q8_0=True))["model.embed_tokens.weight"].dequantize()


def test_a_tied_q8_0_table_is_held_once_and_looked_up_exactly(tied_gguf: str) -> None:
    """The head packs the table for its product and the embedding reads its rows there: no second copy, the same
    values (the torch reference, whose head keeps the row-major table, gives the same tokens)."""
    if not cpu.int8_kernels_available():
        pytest.skip("the C++ int8 kernels are not built here")
    llm = LLM(model=tied_gguf, dtype="float32", max_model_len=128)
    model = llm.llm_engine.executor.driver.model
    embedding, head = model.embed_tokens, model.lm_head
    assert isinstance(head.packed, cpu.PackedInt8BlocksWeight) and head.qweight is None
    assert embedding.qweight is None and embedding.weight.numel() == 0 and embedding.table is not None
    ids = torch.tensor([[5, 0], [model.config.vocab_size - 1, 5]])
    assert torch.equal(embedding(ids), _file_table(tied_gguf)[ids])
    reference = LLM(model=tied_gguf, dtype="float32", max_model_len=128,
                    override_backend_config={"attention_backend": "reference"})
    assert reference.llm_engine.executor.driver.model.embed_tokens.qweight is not None
    prompts = mixed_prompts(400, count=4, seed=3)
    assert kvloom_greedy(llm, prompts, 8) == kvloom_greedy(reference, prompts, 8)


@pytest.mark.parametrize("bits", [4, 5])
def test_requantize_lm_head_holds_the_table_as_code_blocks(tied_gguf: str, bits: int) -> None:
    """requantize_lm_head: the tied Q8_0 table becomes code blocks (Q4_1's / Q5_1's min and max per 32) that the
    head multiplies by with the 4-bit product and the embedding looks up; close to the file's own values."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    backend = {"requantize_lm_head": bits}
    llm = LLM(model=tied_gguf, dtype="float32", max_model_len=128, override_backend_config=backend)
    model = llm.llm_engine.executor.driver.model
    embedding, head = model.embed_tokens, model.lm_head
    assert isinstance(head.packed, PackedQ4Weight) and head.blocks is None and head.qweight is None
    assert embedding.qweight is None and embedding.table == head.packed.rows
    table = _file_table(tied_gguf)
    expected = Q4Blocks.quantize(table, bits)
    ids = torch.tensor([5, 0, model.config.vocab_size - 1, 5])
    assert torch.equal(embedding(ids), expected.dequantize()[ids])
    assert (embedding(ids) - table[ids]).abs().max() <= 0.6 * expected.d[ids].max()
    # The head's product against the torch one (NativeQ4Linear on the same blocks) on the same hidden states (two
    # whole engines differ in their attention's fp32 noise, which the products' int8 activation codes can amplify
    # past any small bound: on an AVX2 EPYC a code flip moved a prompt logprob by 0.067), and the file's own values.
    reference = LLM(model=tied_gguf, dtype="float32", max_model_len=128,
                    override_backend_config={**backend, "attention_backend": "reference"})
    reference_head = reference.llm_engine.executor.driver.model.lm_head.packed
    assert isinstance(reference_head, NativeQ4Linear)
    hidden = torch.randn(40, head.packed.in_features, generator=torch.Generator().manual_seed(bits))
    for rows in (1, 3, 17, 40):
        torch.testing.assert_close(head.packed(hidden[:rows]), reference_head(hidden[:rows]), rtol=1e-5, atol=1e-4)
    prompts = mixed_prompts(400, count=4, seed=4)
    kept = LLM(model=tied_gguf, dtype="float32", max_model_len=128)
    # This tiny model's random table is far more sensitive than a trained one's: 1.12 / 0.73 (4 / 5 bits) at
    # worst over the prompts' tokens; SmolLM2's perplexity moves by 4.7% / 1.3% (docs/quantization.md).
    assert 0 < worst_prompt_logprob_gap(llm, kept, prompts) < (1.5 if bits == 4 else 1.0)


def test_requantize_lm_head_names_what_it_takes(tied_gguf: str, tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="requantize_lm_head must be 4 or 5.*got 8"):
        LLM(model=tied_gguf, max_model_len=128, override_backend_config={"requantize_lm_head": 8})
    with pytest.raises(ValueError, match="requantize_lm_head re-quantizes.*quantization=None"):
        LLM(model=tied_gguf, max_model_len=128, quantization="none", override_backend_config={"requantize_lm_head": 5})
    with pytest.raises(ValueError, match="requantize_lm_head re-quantizes.*'int8'"):
        LLM(model=tiny_llama_dir, max_model_len=128, quantization="int8",
            override_backend_config={"requantize_lm_head": 4})
    # On CUDA (the check comes before anything is loaded or placed: no GPU needed to see it)
    import dataclasses

    from kvloom.config import EngineConfig
    from kvloom.config.resolved import resolve_config
    from kvloom.models.registry import load_model_weights

    config = resolve_config(EngineConfig(model=tied_gguf, max_model_len=128,
                                         override_backend_config={"requantize_lm_head": 5}))
    with pytest.raises(ValueError, match="requantize_lm_head runs on the CPU's products only.*cuda"):
        load_model_weights(None, dataclasses.replace(config, device=torch.device("cuda")))


def test_an_embedding_of_q8_0_blocks_looks_up_their_exact_values() -> None:
    from kvloom.layers.embedding import VocabEmbedding
    from kvloom.ops.int8 import Int8Blocks, quantize_per_block

    table = Int8Blocks(*quantize_per_block(torch.randn(10, 64)))
    embedding = VocabEmbedding(10, 64)
    embedding.load_shard("weight", 0, table)
    ids = torch.tensor([3, 0, 9, 3])
    assert torch.equal(embedding(ids), table.dequantize()[ids])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_gguf_files_load_like_their_checkpoints(family: str, tmp_path) -> None:
    """llama.cpp's qwen2 / qwen3 GGUFs (HF's q/k row order, q/k/v biases or q/k norms): F32 tensors give
    transformers' greedy tokens; 4-bit ones stay 4-bit."""
    from e2e.test_correctness import hf_greedy

    checkpoint = tiny_models.build_tiny_family_checkpoint(str(tmp_path / "hf"), family)
    kinds = ("embed", "attn", "attn_o", "ffn", "ffn_down", "output", "norm")
    f32 = tiny_models.write_tiny_gguf(str(tmp_path / "f32.gguf"), checkpoint, arch=family,
                                      types=dict.fromkeys(kinds, 0))
    prompts = mixed_prompts(400, count=3, seed=5)
    llm = LLM(model=f32, dtype="float32", max_model_len=128)
    assert llm.llm_engine.model_config.architecture == tiny_models._FAMILIES[family][1]
    assert kvloom_greedy(llm, prompts, 6) == hf_greedy(checkpoint, prompts, 6)
    if not cpu.cpu_kernel_available():
        return
    q4 = tiny_models.write_tiny_gguf(str(tmp_path / "q4.gguf"), checkpoint, arch=family,
                                     types={"attn": GGML_Q4_0, "attn_o": GGML_Q4_0, "ffn": GGML_Q4_1,
                                            "ffn_down": GGML_Q4_1})
    kept = LLM(model=q4, dtype="float32", max_model_len=128)
    assert {type(m.packed).__name__ for m in _projections(kept)} == {"PackedQ4Weight"}
    assert len(kvloom_greedy(kept, prompts, 6)[0]) == 6


def test_llamacpp_style_perplexity_scores_the_second_half_of_whole_windows(tiny_llama_dir: str) -> None:
    """``perplexity(score_from=W//2+1, whole_windows=True)`` is llama-perplexity's measure: whole windows of W
    tokens (the tail that makes no window is dropped), in each the tokens from W/2+1 on; checked against
    transformers scoring the same windows."""
    from transformers import AutoModelForCausalLM

    from kvloom.bench.int8_quality import perplexity

    window = 32
    ids = torch.randint(3, 200, (3 * window + 7,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=64)
    ours = perplexity(llm, ids, window, score_from=window // 2 + 1, whole_windows=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    windows = torch.tensor(ids[:3 * window]).view(3, window)
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(windows).logits.float(), dim=-1)
    targets = windows[:, window // 2 + 1:]
    nll = -logprobs[:, window // 2:-1].gather(-1, targets.unsqueeze(-1)).mean().item()
    assert ours == pytest.approx(float(np.exp(nll)), rel=1e-4)
    with pytest.raises(ValueError, match="no window"):
        perplexity(llm, ids[:window - 1], window, score_from=window // 2 + 1, whole_windows=True)


def test_the_default_models_perplexity_equals_llama_cpps(smollm2_gguf_path: str) -> None:
    """kvloom's perplexity of tests/data/perplexity.txt from the Q4_1 GGUF, llama-perplexity's way (-c 512),
    within 1% of llama.cpp's own ``llama-perplexity`` on the same file. Runs where llama.cpp's tools are built
    (``bash benchmarks/peers/setup_llamacpp.sh``, or KVLOOM_LLAMA_CPP_BIN naming their folder)."""
    import os
    import re
    import subprocess
    from pathlib import Path

    from kvloom.bench.int8_quality import perplexity

    root = Path(__file__).resolve().parents[2]
    tools = Path(os.environ.get("KVLOOM_LLAMA_CPP_BIN", root / ".peers" / "llamacpp" / "build" / "bin"))
    if not (tools / "llama-perplexity").is_file():
        pytest.skip(f"llama.cpp's llama-perplexity is not built in {tools}")
    text = root / "tests" / "data" / "perplexity.txt"
    proc = subprocess.run([str(tools / "llama-perplexity"), "-m", smollm2_gguf_path, "-f", str(text), "-c", "512",
                           "-b", "512", "-t", "2"], capture_output=True, text=True, timeout=600)
    theirs = float(re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr).group(1))
    llm = LLM(model=smollm2_gguf_path, max_model_len=528, max_num_seqs=8)
    ids = llm.get_tokenizer().encode(text.read_text())
    assert len(ids) == 4482
    ours = perplexity(llm, ids, 512, score_from=257, whole_windows=True)
    print(f"perplexity of the Q4_1 GGUF, -c 512: kvloom {ours:.4f}, llama.cpp {theirs:.4f}")
    assert ours == pytest.approx(theirs, rel=0.01)


def _k_quant_gguf(factory: pytest.TempPathFactory, name: str, v_type: int) -> str:
    """A tiny Llama (width 256) shaped as llama.cpp's Q4_K_M: Q4_K projections, a Q6_K down, v of ``v_type``, an
    untied Q4_K embedding and Q6_K head."""
    root = factory.mktemp(name)
    checkpoint = tiny_models.build_tiny_checkpoint(str(root / "hf"), arch="llama", hidden_size=256,
                                                   intermediate_size=256, tie_word_embeddings=False)
    return tiny_models.write_tiny_gguf(str(root / f"{name}.gguf"), checkpoint,
                                       types={"attn": gguf.GGML_Q4_K, "attn_o": gguf.GGML_Q4_K, "ffn": gguf.GGML_Q4_K,
                                              "ffn_down": gguf.GGML_Q6_K, "attn_v": v_type,
                                              "embed": gguf.GGML_Q4_K, "output": gguf.GGML_Q6_K})


@pytest.fixture(scope="module")
def q4_k_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every layer of one k-quant: Q4_K q|k|v, o and gate|up, a Q6_K down."""
    return _k_quant_gguf(tmp_path_factory, "q4_k", gguf.GGML_Q4_K)


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """As Q4_K_M's layers with more bits: Q4_K q and k beside a Q6_K v."""
    return _k_quant_gguf(tmp_path_factory, "q4_k_m", gguf.GGML_Q6_K)


def test_k_quant_weights_arrive_as_the_files_super_blocks(q4_k_m_gguf: str) -> None:
    """keep_super_blocks: a Q4_K or Q6_K projection comes as the file's bytes (q and k rows in HF's order), decoding
    to the values of the code blocks read without it; the tables as code blocks."""
    from kvloom.ops.q4k import SUPER_BLOCK_TYPES

    source = resolve_model(q4_k_m_gguf)
    blocks = dict(iter_weights(source, keep_q4=True, keep_q6=True))
    raw = dict(iter_weights(source, keep_q4=True, keep_q6=True, keep_super_blocks=True))
    kinds = {name: type(t).__name__ for name, t in raw.items() if name.endswith(".weight")}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "Q4KBlocks"
    assert kinds["model.layers.0.self_attn.v_proj.weight"] == "Q6KBlocks"
    for name, tensor in raw.items():
        if isinstance(tensor, SUPER_BLOCK_TYPES):
            assert all(torch.equal(a, b) for a, b in zip(tensor.to_blocks(), blocks[name])), name


def _packed_kinds(llm: LLM) -> dict[str, str]:
    model = llm.llm_engine.executor.driver.model
    return {name: type(m.packed).__name__ for name, m in model.named_modules() if isinstance(m, Linear)}


def _logprobs_and_greedy(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[float]], list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    logprobs = [[next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]] for out in outputs]
    return logprobs, kvloom_greedy(llm, prompts, 6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_super_blocks_give_the_code_block_products_results_exactly(q4_k_gguf: str, dtype: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection on the file's super-blocks; its prompt logprobs and greedy tokens equal those
    of the load with gguf_super_blocks false (code blocks) exactly, through the layer stack and module by module."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    prompts = mixed_prompts(300, count=4, seed=5)
    new = LLM(model=q4_k_gguf, dtype=dtype, max_model_len=128, override_backend_config=SUPER_BLOCKS)
    assert set(_packed_kinds(new).values()) == {"PackedKQuantWeight"}
    if cpu.layer_stack_available():
        assert new.llm_engine.executor.driver.model.layer_stack is not None
    expected = _logprobs_and_greedy(new, prompts)
    old = LLM(model=q4_k_gguf, dtype=dtype, max_model_len=128, override_backend_config={"gguf_super_blocks": False})
    assert set(_packed_kinds(old).values()) == {"PackedQ4Weight"}
    assert _logprobs_and_greedy(old, prompts) == expected
    monkeypatch.setenv("KVLOOM_CPU_LAYER_STACK", "0")
    again = LLM(model=q4_k_gguf, dtype=dtype, max_model_len=128, override_backend_config=SUPER_BLOCKS)
    assert _logprobs_and_greedy(again, prompts) == expected


def test_super_blocks_are_the_default_at_every_isa_level(q4_k_gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf_super_blocks None (the default): the k-quant product on the file's super-blocks, whatever the level the
    kernels are built for (AVX-512 included: VNNI kernels of its own, AMX-INT8 tiles from 16 rows)."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    kinds = set(_packed_kinds(LLM(model=q4_k_gguf, dtype="float32", max_model_len=128)).values())
    assert kinds == {"PackedKQuantWeight"}


def test_a_decode_token_reads_the_files_bytes(q4_k_gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the file's super-blocks, projections and tables alike (an untied Q4_K embedding, a Q6_K head), the weights a
    decode token reads (``kvloom bench realsize``'s count, from the loaded model) are the file's bytes, to within the
    panels' padding, and no table is held twice (an untied head's blocks are dropped once packed); decoded into code
    blocks (gguf_super_blocks false) they are more."""
    from kvloom.bench.realsize import gguf_traffic, weights_read_per_token

    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    file_bytes = gguf_traffic(q4_k_gguf)["weight_bytes_per_token"]
    read = {}
    for super_blocks in (True, False):
        llm = LLM(model=q4_k_gguf, dtype="float32", max_model_len=128,
                  override_backend_config={"gguf_super_blocks": super_blocks})
        read[super_blocks] = weights_read_per_token(llm.llm_engine.executor.driver.model)
    assert file_bytes <= read[True] <= 1.02 * file_bytes, (read, file_bytes)
    assert read[False] > read[True], (read, file_bytes)


def test_q4_k_rows_beside_a_q6_k_v_keep_their_own_bits(q4_k_m_gguf: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """q|k|v of Q4_K q and k and a Q6_K v: one product on the file's super-blocks (4.5 and 6.56 bits a weight where
    the code blocks held all three at 7.125), q and k rows summed per 32 inputs where the code blocks summed them per
    16 (the fp32 rounding differs): close to the code blocks' results, the stack equal to the modules'."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    prompts = mixed_prompts(300, count=4, seed=6)
    new = LLM(model=q4_k_m_gguf, dtype="float32", max_model_len=128, override_backend_config=SUPER_BLOCKS)
    model = new.llm_engine.executor.driver.model
    qkv = model.layers[0].self_attn.qkv_proj.packed
    assert type(qkv).__name__ == "PackedKQuantWeight" and qkv.q4_k.numel() and qkv.q6_k.numel()
    old = LLM(model=q4_k_m_gguf, dtype="float32", max_model_len=128,
              override_backend_config={"gguf_super_blocks": False})
    old_qkv = old.llm_engine.executor.driver.model.layers[0].self_attn.qkv_proj.packed
    new_bytes = qkv.q4_k.numel() + qkv.q6_k.numel()
    old_bytes = sum(t.numel() * t.element_size() for t in (old_qkv.data, old_qkv.high, old_qkv.scales))
    assert new_bytes < 0.75 * old_bytes
    # A last-bit difference can move an activation's int8 code at a rounding tie, which this random 4-bit model
    # amplifies (as test_q6_k_projections_stay_in_blocks_beside_4bit_ones finds between the C++ and torch products);
    # both stand as far from the dequantized floats.
    floats = LLM(model=q4_k_m_gguf, dtype="float32", max_model_len=128, quantization="none")
    assert worst_prompt_logprob_gap(new, old, prompts) < 0.08
    to_floats = [worst_prompt_logprob_gap(llm, floats, prompts) for llm in (new, old)]
    assert max(to_floats) < 0.2 and abs(to_floats[0] - to_floats[1]) < 0.02, to_floats
    expected = _logprobs_and_greedy(new, prompts)
    monkeypatch.setenv("KVLOOM_CPU_LAYER_STACK", "0")
    assert _logprobs_and_greedy(LLM(model=q4_k_m_gguf, dtype="float32", max_model_len=128,
                                    override_backend_config=SUPER_BLOCKS), prompts) == expected


@pytest.fixture(scope="module")
def smollm2_q4_k_down(smollm2_gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default model with its down projections (the only ones whose 1,536 inputs fit super-blocks of 256; the
    rest are 576 wide) re-quantized from its Q4_1 values to Q4_K, the rest of the file as it is."""
    import gguf as gguf_package
    from gguf.quants import dequantize

    reader = gguf_package.GGUFReader(smollm2_gguf_path)
    path = str(tmp_path_factory.mktemp("smollm2_q4_k") / "smollm2-q4_k-down.gguf")
    writer = gguf_package.GGUFWriter(path, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf_package.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.endswith("ffn_down.weight"):
            values = dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, tiny_models.quantize_q4_k(values),
                              raw_dtype=gguf_package.GGMLQuantizationType.Q4_K)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_smollm2_with_q4_k_downs_answers_as_with_code_blocks(smollm2_q4_k_down: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A real model's Q4_K down projections on the file's super-blocks: the same prompt logprobs and greedy tokens,
    exactly, as the code blocks give."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    prompts = mixed_prompts(2000, count=3, seed=8)
    new = LLM(model=smollm2_q4_k_down, max_model_len=256, override_backend_config=SUPER_BLOCKS)
    assert _packed_kinds(new)["layers.0.mlp.down_proj"] == "PackedKQuantWeight"
    expected = _logprobs_and_greedy(new, prompts)
    del new
    old = LLM(model=smollm2_q4_k_down, max_model_len=256, override_backend_config={"gguf_super_blocks": False})
    assert _packed_kinds(old)["layers.0.mlp.down_proj"] == "PackedQ4Weight"
    assert _logprobs_and_greedy(old, prompts) == expected
