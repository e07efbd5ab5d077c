"""KV cache sizing: how many blocks fit the budget (on CUDA, what the largest step leaves).

A block holds ``block_size`` positions of every layer's keys and values, the target's and, with a draft
model or EAGLE head, the draft's too (the same block tables): ``kv_bytes_per_block`` counts both.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvloom.config import ResolvedConfig
from kvloom.config.compat import FP8_KV_CACHE_DTYPES
from kvloom.loader.model_config import ModelConfig
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.reference import INT8_KV_SCALE_BYTES

logger = logging.getLogger("kvloom")

# The KV cache's size on the CPU when kv_cache_memory is not given.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


# kv_cache_dtype -> the cache tensors' dtype ("auto": the model's); an int8 row ends in its fp16 scale.
KV_CACHE_TORCH_DTYPES = {"int8": torch.int8, **dict.fromkeys(FP8_KV_CACHE_DTYPES, torch.float8_e4m3fn)}


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of a model's keys and values, every layer (int8: each row's codes and its scale)."""
    mc = model_config
    element = torch.empty((), dtype=dtype).element_size()
    row = mc.head_dim + INT8_KV_SCALE_BYTES if dtype == torch.int8 else mc.head_dim
    return 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * row * element


def num_kv_blocks(config: ResolvedConfig, per_block: int, budget: int, device: torch.device) -> int:
    """KV blocks that fit ``budget`` bytes, never more than max_num_seqs full-length sequences use, + the null
    block."""
    engine = config.engine
    most_useful = engine.max_num_seqs * config.max_blocks_per_seq
    num_blocks = min(budget // per_block, most_useful)
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget ({budget} bytes) is smaller than one KV block "
                         f"({per_block} bytes of {config.block_size} tokens); raise kv_cache_memory or "
                         f"gpu_memory_utilization, or lower max_num_batched_tokens")
    if device.type == "cuda":
        logger.info("KV cache: %d blocks of %d tokens = %d tokens per sequence set (%.2f GiB)", num_blocks,
                    config.block_size, num_blocks * config.block_size, num_blocks * per_block / 2**30)
    return num_blocks + 1


@torch.inference_mode()
def profile_cuda_budget(model: nn.Module, config: ResolvedConfig, model_config: ModelConfig, device: torch.device,
                        dtype: torch.dtype) -> int:
    """Bytes for the KV cache on CUDA: run the largest step (max_num_batched_tokens tokens, logits for
    max_num_seqs rows) on a one-block scratch cache, then take what gpu_memory_utilization leaves
    beside the peak memory torch reached and what other libraries hold."""
    engine, mc = config.engine, model_config
    block_size = config.block_size
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch = [(torch.zeros(1, block_size, mc.num_key_value_heads, mc.head_dim, dtype=dtype,
                            device=device),) * 2 for _ in range(mc.num_hidden_layers)]
    tokens = config.max_num_batched_tokens
    lengths = [config.max_model_len] * (tokens // config.max_model_len)
    if tokens % config.max_model_len:
        lengths.append(tokens % config.max_model_len)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.long, device=device),  # all into the scratch block
        block_table=torch.zeros(len(lengths), config.max_blocks_per_seq, dtype=torch.long, device=device),
        seq_lens=torch.tensor(lengths, device=device), query_start_loc=starts, seq_lens_host=lengths,
        num_decodes=0, block_size=block_size, sliding_window=mc.sliding_window,
        query_start_loc_tensor=torch.tensor(starts, device=device), max_query_len=max(lengths))
    hidden = model(torch.zeros(tokens, dtype=torch.long, device=device), positions, scratch, metadata)
    if isinstance(hidden, tuple):  # EAGLE-3's target: (hidden states, auxiliary ones)
        hidden = hidden[0]
    rows = min(engine.max_num_seqs, tokens)
    torch.log_softmax(model.compute_logits(hidden[:rows]).float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del scratch, hidden, metadata
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, NCCL, cuBLAS
    budget = int(total * engine.gpu_memory_utilization - peak - max(other, 0))
    logger.info("CUDA memory: %.2f GiB total x %.2f; weights + peak activations %.2f GiB, other %.2f GiB; "
                "%.2f GiB left for the KV cache", total / 2**30, engine.gpu_memory_utilization, peak / 2**30,
                other / 2**30, budget / 2**30)
    return budget
