"""A GGUF's embedding table and LM head kept in the file's blocks on a CPU (layers/embedding.py).

A Q4_K_M file's tied Q6_K table is kept as code blocks (the head takes the code-block product, the lookup reads rows of
the same packed blocks), a Q8_0 file's as int8 blocks (the W8A8-on-blocks product, its scales streamed as the file's
fp16). The oracle for each: the same model written with its table in F32 holding exactly the values the blocks
decode to, so only the head's product differs (activations quantized to 8 bits per block of 32, as llama.cpp does).
"""

from __future__ import annotations

import os

import pytest
import tiny_models
import torch
from safetensors.torch import load_file, save_file

from e2e.test_correctness import kvloom_greedy, mixed_prompts
from e2e.test_gguf_4bit import worst_prompt_logprob_gap
from kvloom import LLM
from kvloom.layers.embedding import LMHead, VocabEmbedding
from kvloom.layers.quantization import keep_tables_in_blocks
from kvloom.loader.weights import iter_weights, resolve_model
from kvloom.ops import cpu
from kvloom.ops.int8 import Int8Blocks, quantize_per_block
from kvloom.ops.q4 import PackedQ4Weight, Q4Blocks
from kvloom.ops.q4k import PackedKQuantWeight

GGML_F32, GGML_Q4_1, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K = 0, 3, 8, 12, 14
TABLE = "model.embed_tokens.weight"


def _file_table(path: str, name: str = TABLE) -> torch.Tensor:
    """A tensor of the file as the loader dequantizes it (fp32, exactly the blocks' values)."""
    return dict(iter_weights(resolve_model(path)))[name]


def _twin_files(root: str, types: dict[str, int], tied: bool) -> tuple[str, str]:
    """(the file with its table in ``types["embed"]``, the same model with that table's decoded values in F32)."""
    checkpoint = tiny_models.build_tiny_checkpoint(os.path.join(root, "hf"), arch="llama", hidden_size=256,
                                                   intermediate_size=256, tie_word_embeddings=tied)
    blocks = tiny_models.write_tiny_gguf(os.path.join(root, "blocks.gguf"), checkpoint, types=types)
    names = [name for name in os.listdir(checkpoint) if name.endswith(".safetensors")]
    for name in names:  # the table's decoded values into the checkpoint, then written in F32
        path = os.path.join(checkpoint, name)
        tensors = load_file(path)
        if TABLE in tensors:
            tensors[TABLE] = _file_table(blocks).contiguous()
            save_file(tensors, path, metadata={"format": "pt"})
    floats = tiny_models.write_tiny_gguf(os.path.join(root, "floats.gguf"), checkpoint, types={**types, "embed": 0})
    return blocks, floats


def _tokens_agree(ours: LLM, theirs: LLM, seed: int) -> None:
    """Greedy tokens equal the twin's on most prompts; logprobs within the 8-bit activations' rounding."""
    prompts = mixed_prompts(400, count=6, seed=seed)
    same = sum(a == b for a, b in zip(kvloom_greedy(ours, prompts, 8), kvloom_greedy(theirs, prompts, 8)))
    assert same >= len(prompts) - 1
    # The head's logits move by the activations' per-block rounding (up to 0.4% of a block's largest value): on this
    # random model's prompt tokens 0.078 (Q6_K) and 0.097 (Q8_0) at worst; a wrong table or scale is whole logprobs.
    assert worst_prompt_logprob_gap(ours, theirs, prompts) < 0.15


@pytest.fixture(scope="module")
def kernels() -> None:
    if not cpu.cpu_kernel_available() or not torch.ops.kvloom.q4_gemm_kernel():
        pytest.skip("the CPU kernels are not built here")


@pytest.mark.parametrize("super_blocks", [True, False])
def test_a_tied_q6_k_table_is_kept_once_in_its_code_blocks(kernels: None, tmp_path, super_blocks: bool) -> None:
    """A Q4_K_M-like file (Q4_1 projections here, a tied Q6_K table): the head packs the table as the file's Q6_K
    super-blocks for the k-quant product (``gguf_super_blocks``: exactly the file's bytes, 6.5625 bits a weight), or
    without it as 6-bit code blocks; the embedding reads its rows back there (no float copy, none row-major), the
    lookup gives exactly the file's values and the tokens are the F32 twin's."""
    blocks, floats = _twin_files(str(tmp_path), {"embed": GGML_Q6_K, "attn": GGML_Q4_1, "attn_o": GGML_Q4_1,
                                                 "ffn": GGML_Q4_1, "ffn_down": GGML_Q4_1}, tied=True)
    llm = LLM(model=blocks, dtype="float32", max_model_len=128,
              override_backend_config={"gguf_super_blocks": super_blocks})
    model = llm.llm_engine.executor.driver.model
    embedding, head = model.embed_tokens, model.lm_head
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    if super_blocks:
        assert isinstance(head.packed, PackedKQuantWeight) and head.packed.q4_k.numel() == 0
        assert head.packed.q6_k.numel() == -(-vocab // 8) * 8 * hidden // 256 * 210  # the file's bytes, padded
    else:
        assert isinstance(head.packed, PackedQ4Weight) and head.packed.high is not None  # 6-bit codes
    assert head.blocks is None and embedding.blocks is None and embedding.weight.numel() == 0
    assert embedding.table == head.packed.rows
    ids = torch.tensor([[5, 0], [vocab - 1, 5]])
    assert torch.equal(embedding(ids), _file_table(blocks)[ids])
    twin = LLM(model=floats, dtype="float32", max_model_len=128)
    assert twin.llm_engine.executor.driver.model.lm_head.blocks is None
    _tokens_agree(llm, twin, seed=5)


def test_a_q8_0_files_tied_table_stays_in_blocks_with_fp16_scales(kernels: None, tmp_path) -> None:
    """The Q8_0 default (``quantization="int8"``, the file's blocks kept) keeps the tied Q8_0 table too: the head's
    W8A8-on-blocks product streams the file's fp16 scales, the lookup reads the same blocks exactly."""
    q8 = {"embed": GGML_Q8_0, "attn": GGML_Q8_0, "attn_o": GGML_Q8_0, "ffn": GGML_Q8_0, "ffn_down": GGML_Q8_0}
    blocks, floats = _twin_files(str(tmp_path), q8, tied=True)
    llm = LLM(model=blocks, dtype="float32", max_model_len=128)
    assert llm.llm_engine.config.quantization == "int8"
    model = llm.llm_engine.executor.driver.model
    embedding, head = model.embed_tokens, model.lm_head
    assert isinstance(head.packed, cpu.PackedInt8BlocksWeight) and head.packed.scale.dtype == torch.float16
    assert embedding.qweight is None and embedding.weight.numel() == 0 and embedding.table == head.packed.rows
    ids = torch.tensor([3, model.config.vocab_size - 1, 3])
    assert torch.equal(embedding(ids), _file_table(blocks)[ids])
    _tokens_agree(llm, LLM(model=floats, dtype="float32", max_model_len=128), seed=6)


def test_an_untied_q6_k_head_and_its_embedding_stay_in_blocks(kernels: None, tmp_path) -> None:
    """An 8B Q4_K_M's layout: an untied Q6_K head (the k-quant product on the file's super-blocks) beside a Q4_1 table
    packed as code blocks (4 bits a weight, not a byte) and looked up there; both give exactly the file's values."""
    checkpoint = tiny_models.build_tiny_checkpoint(str(tmp_path / "hf"), arch="llama", hidden_size=256,
                                                   intermediate_size=256, tie_word_embeddings=False)
    path = tiny_models.write_tiny_gguf(str(tmp_path / "untied.gguf"), checkpoint,
                                       types={"embed": GGML_Q4_1, "output": GGML_Q6_K, "attn": GGML_Q4_1,
                                              "attn_o": GGML_Q4_1, "ffn": GGML_Q4_1, "ffn_down": GGML_Q4_1})
    llm = LLM(model=path, dtype="float32", max_model_len=128, override_backend_config={"gguf_super_blocks": True})
    model = llm.llm_engine.executor.driver.model
    embedding, head = model.embed_tokens, model.lm_head
    assert isinstance(head.packed, PackedKQuantWeight) and isinstance(embedding.packed_table, PackedQ4Weight)
    assert embedding.blocks is None and embedding.table == embedding.packed_table.rows
    assert embedding.weight.numel() == 0 and head.weight.numel() == 0
    ids = torch.tensor([2, model.config.vocab_size - 1])
    assert torch.equal(embedding(ids), _file_table(path)[ids])
    head_rows = head.packed.rows(ids)
    assert torch.equal(head_rows.dequantize(), _file_table(path, "lm_head.weight")[ids])
    floats = LLM(model=path, dtype="float32", max_model_len=128, quantization="none")
    prompts = mixed_prompts(400, count=4, seed=7)
    assert worst_prompt_logprob_gap(llm, floats, prompts) < 0.25  # 4-bit projections dominate (as in test_gguf_4bit)


def test_an_untied_k_quant_table_is_looked_up_in_the_files_bytes(kernels: None, tmp_path) -> None:
    """An 8B Q4_K_M's untied Q4_K table on the file's super-blocks is not packed: a lookup decodes its rows from the
    file's bytes as read (only the rows looked up are touched), exactly the file's values; the tokens are those of
    the twin whose table is those values in F32."""
    from kvloom.ops.q4k import Q4KBlocks

    types = {"embed": GGML_Q4_K, "output": GGML_Q6_K, "attn": GGML_Q4_K, "attn_o": GGML_Q4_K, "ffn": GGML_Q4_K,
             "ffn_down": GGML_Q6_K}
    blocks, floats = _twin_files(str(tmp_path), types, tied=False)
    llm = LLM(model=blocks, dtype="float32", max_model_len=128, override_backend_config={"gguf_super_blocks": True})
    model = llm.llm_engine.executor.driver.model
    embedding = model.embed_tokens
    assert isinstance(embedding.blocks, Q4KBlocks) and embedding.packed_table is None
    assert embedding.blocks.data.numel() == model.config.vocab_size * model.config.hidden_size // 256 * 144
    ids = torch.tensor([[7, 0], [model.config.vocab_size - 1, 7]])
    assert torch.equal(embedding(ids), _file_table(blocks)[ids])
    twin = LLM(model=floats, dtype="float32", max_model_len=128, override_backend_config={"gguf_super_blocks": True})
    _tokens_agree(llm, twin, seed=8)


def _tied_tables(device: str, table: Q4Blocks | Int8Blocks) -> torch.nn.Module:
    """An embedding and a head tied as a model builds them, on ``device``, the embedding loaded with ``table``."""
    model = torch.nn.Module()
    with torch.device(device):
        model.embed_tokens = VocabEmbedding(*table.shape)
        model.lm_head = LMHead(*table.shape)
    model.lm_head.weight = model.embed_tokens.weight
    model.embed_tokens.load_shard("weight", 0, table)
    return model


def test_tables_in_blocks_are_kept_on_a_cpu_and_dequantized_for_a_gpu() -> None:
    """keep_tables_in_blocks: on a CPU the tied head takes the embedding's code blocks (or Q8_0 ones) and the
    embedding reads its rows there; placed elsewhere (here "meta", standing for a GPU: only where the tensors are is
    read) code blocks become a float table the head shares, Q8_0 ones too unless ``q8_0_on_gpu``."""
    torch.manual_seed(0)
    code_blocks = Q4Blocks.quantize(torch.randn(40, 64), 6, 16)
    model = _tied_tables("cpu", code_blocks)
    assert keep_tables_in_blocks(model, q8_0_on_gpu=False)
    assert torch.equal(model.lm_head.blocks.codes, code_blocks.codes) and model.embed_tokens.blocks is None
    ids = torch.tensor([3, 39, 3])
    assert torch.equal(model.embed_tokens(ids), code_blocks.dequantize()[ids])
    q8 = Int8Blocks(*quantize_per_block(torch.randn(40, 64)))
    for table, q8_0_on_gpu, kept in ((code_blocks, True, False), (q8, False, False), (q8, True, True)):
        model = _tied_tables("meta", table)
        keep_tables_in_blocks(model, q8_0_on_gpu)
        embedding, head = model.embed_tokens, model.lm_head
        assert embedding.holds_blocks() == kept and (head.qweight is not None) == kept
        assert head.blocks is None and embedding.table is None and head.weight is embedding.weight
        assert tuple(embedding.weight.shape) == ((0, 64) if kept else (40, 64))
