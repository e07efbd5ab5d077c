"""ModelRunner: a SchedulerOutput in, sampled tokens out.

It owns the model, the KV cache tensors and the per-request sampling state (seeded generators),
turns the scheduled requests into flat tensors, runs the model, computes logits only where a
token is sampled (or prompt logprobs were asked), and samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kvloom.attention import AttentionMetadata, get_attention_backend
from kvloom.attention.native import attention_native
from kvloom.config import EngineConfig
from kvloom.engine.request import Request
from kvloom.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvloom.layers.embedding import LMHead
from kvloom.layers.linear import Linear, fast_linear_format
from kvloom.loader.model_config import ModelConfig
from kvloom.loader.weights import ModelSource, iter_weights
from kvloom.models.registry import build_model
from kvloom.sample.sampler import Sampler, SamplingMetadata, compute_logprobs_top

# (token ids, logprobs, rank of the first id): column 0 is the sampled/actual token, then the top-k.
LogprobsRow = tuple[list[int], list[float], int]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, LogprobsRow] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobsRow]] = field(default_factory=dict)


@dataclass
class ModelInputs:
    """One step's model inputs: all a tensor-parallel worker needs to run its shard."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, block_size: int, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.vocab_size = model_config.vocab_size
        self.sliding_window = model_config.sliding_window
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.seed)
        self.sampler = Sampler(self.generator)
        self.request_generators: dict[str, torch.Generator] = {}
        self.load_seconds = 0.0
        self.builds_decode_mask = True
        # Set by a tensor-parallel executor: sends each step's inputs to the other ranks.
        self.broadcast_inputs: Callable[[ModelInputs], None] | None = None

    # ---- set-up ----------------------------------------------------------------------------
    def load_model(self, source: ModelSource) -> None:
        start = time.perf_counter()
        attention = get_attention_backend(self.config.backend.attention_backend, self.device)
        # Only the 'native' backend's batched decode reads a padded block table and a mask.
        self.builds_decode_mask = attention is attention_native
        with _default_dtype(self.dtype), torch.device(self.device):
            model = build_model(self.model_config, attention)
        model.load_weights(iter_weights(source))
        if self.device.type == "cpu" and self.config.backend.attention_backend != "reference":
            from kvloom.attention.cpu import cpu_kernel_available

            if cpu_kernel_available():
                for module in model.modules():
                    if hasattr(module, "fused_cpu"):
                        module.fused_cpu = True
                self.sampler.fast_argmax = _argmax_rows_cpu
        linear_format = (fast_linear_format(self.dtype, self.device)
                         if self.config.backend.attention_backend != "reference" else None)
        if linear_format is not None:
            for module in model.modules():
                if isinstance(module, (Linear, LMHead)):
                    module.fast_format = linear_format
                    module.batch_hint = min(self.config.max_num_seqs, 256)
        self.model = model.eval()
        self.load_seconds = time.perf_counter() - start

    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * element

    def init_kv_cache(self, num_blocks: int) -> None:
        """Per layer a key and a value tensor of [num_blocks, block_size, num_kv_heads, head_dim]."""
        mc = self.model_config
        shape = (num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(mc.num_hidden_layers)]

    def release_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.request_generators.pop(request_id, None)

    # ---- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        items, inputs = self._prepare_inputs(scheduler_output.scheduled)
        if self.broadcast_inputs is not None:
            self.broadcast_inputs(inputs)
        hidden = self.forward(inputs)
        metadata = inputs.metadata

        output = ModelRunnerOutput()
        sampling_rows = [i for i, item in enumerate(items) if item.samples]
        if sampling_rows:
            last_token_index = torch.tensor([metadata.query_start_loc[i + 1] - 1 for i in sampling_rows],
                                            device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, last_token_index))
            requests = [items[i].request for i in sampling_rows]
            sampler_output = self.sampler(logits, self._sampling_metadata(requests))
            sampled = sampler_output.sampled_token_ids.tolist()
            for request, token_id in zip(requests, sampled):
                output.sampled_token_ids[request.request_id] = token_id
            if sampler_output.logprobs is not None:
                ids = sampler_output.logprob_token_ids.tolist()
                values = sampler_output.logprobs.tolist()
                ranks = sampler_output.sampled_ranks.tolist()
                for row, request in enumerate(requests):
                    num = request.sampling_params.logprobs
                    if num is not None:
                        output.logprobs[request.request_id] = (ids[row][:num + 1], values[row][:num + 1],
                                                               ranks[row])
        for i, item in enumerate(items):
            if item.request.sampling_params.prompt_logprobs is not None:
                rows = self._prompt_logprobs(item, hidden, metadata.query_start_loc[i])
                if rows:
                    output.prompt_logprobs[item.request.request_id] = rows
        return output

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Final hidden states [T, H]; every tensor-parallel rank runs this on the same inputs."""
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    def _prepare_inputs(self, scheduled: list[ScheduledRequest]
                        ) -> tuple[list[ScheduledRequest], ModelInputs]:
        """Flat input ids and positions [T], and the attention metadata, decodes first."""
        # Decodes first: they share one batched attention call.
        items = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        num_decodes = 0
        for item in items:
            request = item.request
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = request.block_ids
            slot_mapping.extend(block_ids[p // block_size] * block_size + p % block_size
                                for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.num_new_tokens == 1:
                num_decodes += 1
        max_blocks = max(-(-n // block_size) for n in seq_lens)
        decode_num_blocks = 0
        if num_decodes and self.builds_decode_mask:
            # Round the longest decode context up to 64 tokens, so few distinct shapes occur.
            needed = -(-max(seq_lens[:num_decodes]) // block_size)
            step = max(1, 64 // block_size)
            decode_num_blocks = min(-(-needed // step) * step, self.max_blocks_per_seq)
            max_blocks = max(max_blocks, decode_num_blocks)
        block_table = [request_blocks + [0] * (max_blocks - len(request_blocks))
                       for request_blocks in (item.request.block_ids[:max_blocks] for item in items)]

        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_table=torch.tensor(block_table, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            query_start_loc=query_start_loc,
            query_start_loc_tensor=torch.tensor(query_start_loc, dtype=torch.long, device=device),
            seq_lens_host=seq_lens,
            num_decodes=num_decodes,
            block_size=block_size,
            sliding_window=self.sliding_window,
            decode_num_blocks=decode_num_blocks,
        )
        if num_decodes and self.builds_decode_mask:
            key_pos = torch.arange(decode_num_blocks * block_size, device=device)[None, :]
            lens = metadata.seq_lens[:num_decodes, None]
            mask = key_pos < lens
            if self.sliding_window is not None:
                mask &= key_pos > lens - 1 - self.sliding_window
            metadata.decode_mask = mask[:, None, None, :]
        return items, ModelInputs(torch.tensor(input_ids, dtype=torch.long, device=device),
                                  torch.tensor(positions, dtype=torch.long, device=device), metadata)

    def _generator_for(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self.request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # negative seeds map into uint64
            self.request_generators[request.request_id] = generator
        return generator

    def _sampling_metadata(self, requests: list[Request]) -> SamplingMetadata:
        device = self.device
        params = [r.sampling_params for r in requests]
        temperature = [0.0 if p.greedy else float(p.temperature) for p in params]
        all_greedy = all(t == 0.0 for t in temperature)
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params]
        top_p = [float(p.top_p) for p in params]
        min_p = [float(p.min_p) for p in params]
        metadata = SamplingMetadata(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            all_greedy=all_greedy,
            all_random=all(t > 0.0 for t in temperature),
            top_k=None if all(k == self.vocab_size for k in top_k)
            else torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=None if all(p == 1.0 for p in top_p) else torch.tensor(top_p, device=device),
            min_p=None if all(p == 0.0 for p in min_p) else torch.tensor(min_p, device=device),
        )
        if not all_greedy:
            for row, request in enumerate(requests):
                generator = self._generator_for(request)
                if generator is not None:
                    metadata.generators[row] = generator
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
            metadata.presence_penalty = torch.tensor([float(p.presence_penalty) for p in params], device=device)
            metadata.frequency_penalty = torch.tensor([float(p.frequency_penalty) for p in params],
                                                      device=device)
            metadata.repetition_penalty = torch.tensor([float(p.repetition_penalty) for p in params],
                                                       device=device)
            metadata.output_token_ids = _pad([r.output_token_ids for r in requests], self.vocab_size, device)
            metadata.prompt_token_ids = _pad([r.prompt_token_ids for r in requests], self.vocab_size, device)
        for row, request in enumerate(requests):
            p = request.sampling_params
            if request.num_output_tokens < p.min_tokens:
                masked = sorted((request.eos_token_ids | p.all_stop_token_ids) - {None})
                masked = [t for t in masked if 0 <= t < self.vocab_size]
                if masked:
                    metadata.min_tokens_masks.append((row, masked))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        metadata.max_num_logprobs = max(wanted) if wanted else None
        return metadata

    def _prompt_logprobs(self, item: ScheduledRequest, hidden: torch.Tensor, offset: int
                         ) -> list[LogprobsRow]:
        """Logprobs of prompt tokens predicted inside this chunk (position p predicts token p+1)."""
        request = item.request
        start = item.num_computed_tokens
        end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
        if end <= start:
            return []
        index = torch.arange(offset, offset + end - start, device=self.device)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, index)).float(), dim=-1)
        targets = torch.tensor(request.prompt_token_ids[start + 1:end + 1], device=self.device)
        ids, values, ranks = compute_logprobs_top(logprobs, targets, request.sampling_params.prompt_logprobs)
        return list(zip(ids.tolist(), values.tolist(), ranks.tolist()))


def _argmax_rows_cpu(logits: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.long)
    torch.ops.kvloom.argmax_rows(out, logits.contiguous())
    return out


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
