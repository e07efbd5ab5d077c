"""Input preparation: what the runner keeps of each request, and one step's flat model inputs.

``RequestState`` is the runner's record of a request (from its ``NewRequestData``, plus what it sampled).
``InputBatch.prepare`` lays a step's scheduled tokens end to end, decodes first, with each token's cache slot
from its block table and the attention metadata; ``sampling_metadata`` turns the sampling parameters of the
rows that sample into the sampler's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvloom.ops.metadata import AttentionMetadata
from kvloom.pooling import PoolingState
from kvloom.sample.sampler import SamplingMetadata
from kvloom.sampling_params import SamplingParams
from kvloom.spec_decode.ngram import NgramIndex
from kvloom.spec_decode.policy import Acceptance
from kvloom.step_io import ScheduledRequest
from kvloom.worker.graphs import pick_bucket


@dataclass
class ModelInputs:
    """One step's model inputs: all a tensor-parallel worker needs to run its shard."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata


@dataclass
class RequestState:
    """What the runner keeps of a request between steps (from its NewRequestData, plus what it sampled)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    min_tokens_stop_ids: list[int]  # masked while fewer than min_tokens outputs exist
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # the request's own, when it has a seed
    # Speculative decoding (worker/speculator.py): how its drafts fared; n-gram lookup's index of its tokens.
    acceptance: Acceptance = field(default_factory=Acceptance)
    ngram_index: NgramIndex | None = None
    # A draft model / EAGLE head (worker/draft_kv.py): its KV holds positions < draft_computed (None: not yet
    # scheduled); while it lags, EAGLE's inputs for the positions from there on (the target's hidden-state
    # rows) wait here.
    draft_computed: int | None = None
    draft_hidden: list[torch.Tensor] = field(default_factory=list)
    draft_hidden_start: int | None = None  # the position of draft_hidden's first row (past draft_computed: a gap)
    draft_resumes: bool = True  # new or preempted: its next step starts from a prefix-cache hit
    # Its prefix-cache hit held no draft KV where EAGLE cannot compute it: it drafts no more.
    draft_disabled: bool = False
    # logit_bias's token ids and values, and allowed_token_ids, as device tensors (made at first use).
    logit_bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed_tensor: torch.Tensor | None = None
    # An embedding request: its prompt's hidden states pooled as its chunks run (kvloom/pooling.py).
    pooling: PoolingState | None = None
    # A vision-language prompt's images (kvloom.multimodal.inputs.ImageFeature), from its NewRequestData.
    mm_features: tuple[Any, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """The request's tokens (prompt, then what it sampled) at positions [start, end)."""
        prompt, outputs = self.prompt_token_ids, self.output_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return outputs[start - n:end - n]
        return prompt[start:] + outputs[:end - n]


class InputBatch:
    """Builds a step's ``ModelInputs`` for the target or a draft (the same block tables, its own window)."""

    def __init__(self, block_size: int, max_blocks_per_seq: int, device: torch.device, needs_decode_mask: bool,
                 context_length_buckets: list[int] | None = None) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.needs_decode_mask = needs_decode_mask
        # Prefill steps are padded to these token counts (None: run at their own size).
        self.context_length_buckets = context_length_buckets

    def prepare(self, scheduled: list[ScheduledRequest], sliding_window: int | None,
                        pad: bool = True) -> tuple[list[ScheduledRequest], ModelInputs]:
        """Flat input ids and positions [T], and the attention metadata, decodes first. ``sliding_window``:
        the model's that runs them (the target's or a draft's); ``pad``: to a context-length bucket."""
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
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(item.token_ids)
            positions.extend(range(start, end))
            block_ids = item.block_ids
            slot_mapping.extend(block_ids[p // block_size] * block_size + p % block_size
                                for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.num_new_tokens == 1:
                num_decodes += 1
        max_blocks = max(-(-n // block_size) for n in seq_lens)
        decode_num_blocks = 0
        needs_decode_mask = num_decodes and self.needs_decode_mask
        if needs_decode_mask:
            # Round the longest decode context up to 64 tokens, so few distinct shapes occur.
            needed = -(-max(seq_lens[:num_decodes]) // block_size)
            step = max(1, 64 // block_size)
            decode_num_blocks = min(-(-needed // step) * step, self.max_blocks_per_seq)
            max_blocks = max(max_blocks, decode_num_blocks)
        block_table = [request_blocks + [0] * (max_blocks - len(request_blocks))
                       for request_blocks in (item.block_ids[:max_blocks] for item in items)]

        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, torch.long, device),
            block_table=to_device(block_table, torch.long, device),
            seq_lens=to_device(seq_lens, torch.long, device),
            query_start_loc=query_start_loc,
            query_start_loc_tensor=to_device(query_start_loc, torch.long, device),
            seq_lens_host=seq_lens,
            num_decodes=num_decodes,
            block_size=block_size,
            sliding_window=sliding_window,
            decode_num_blocks=decode_num_blocks,
            max_query_len=max(item.num_new_tokens for item in items),
        )
        if pad and self.context_length_buckets is not None and num_decodes < len(items):
            self._pad_to_context_bucket(input_ids, positions, slot_mapping, query_start_loc, seq_lens, metadata)
        if needs_decode_mask:
            key_pos = torch.arange(decode_num_blocks * block_size, device=device)[None, :]
            lens = metadata.seq_lens[:num_decodes, None]
            mask = key_pos < lens
            if sliding_window is not None:
                mask &= key_pos > lens - 1 - sliding_window
            metadata.decode_mask = mask[:, None, None, :]
        return items, ModelInputs(to_device(input_ids, torch.long, device),
                                  to_device(positions, torch.long, device), metadata)

    def _pad_to_context_bucket(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
                               query_start_loc: list[int], seq_lens: list[int], metadata: AttentionMetadata) -> None:
        """Pad a prefill step's tokens up to its context-length bucket with one dummy request that writes
        no cache slot (slot -1) and reads only the null block: no real request sees it."""
        total = len(input_ids)
        bucket = pick_bucket(total, self.context_length_buckets)
        if bucket is None or bucket == total:
            return
        pad = bucket - total
        input_ids.extend([0] * pad)
        positions.extend([0] * pad)  # any position in the rotary table: its output is never used
        slot_mapping.extend([-1] * pad)
        query_start_loc.append(bucket)
        seq_lens.append(pad)
        device = self.device
        metadata.slot_mapping = to_device(slot_mapping, torch.long, device)
        # Its block-table row covers its whole (pad-token) context with the null block.
        table = metadata.block_table
        width = max(table.shape[1], -(-pad // self.block_size))
        padded = table.new_zeros(table.shape[0] + 1, width)
        padded[:table.shape[0], :table.shape[1]] = table
        metadata.block_table = padded
        metadata.seq_lens = to_device(seq_lens, torch.long, device)
        metadata.query_start_loc_tensor = to_device(query_start_loc, torch.long, device)
        metadata.max_query_len = max(metadata.max_query_len, pad)



def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``. On CUDA through pinned memory without waiting: torch's plain copy
    from pageable memory waits for the device's queue, which with async scheduling still holds the last step."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor if device.type == "cpu" else tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors read back behind the work queued so far: on CUDA copied into pinned memory with an event
    recorded after, so ``wait`` waits for that work alone and not for a step launched later."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event = None
        self.tensors = tensors
        if tensors and tensors[0].device.type == "cuda":
            self.tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                            for t in tensors]
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


def generator_for(state: RequestState, device: torch.device) -> torch.Generator | None:
    """The request's own generator when it has a seed (made at first use), else None."""
    seed = state.sampling_params.seed
    if seed is None:
        return None
    if state.generator is None:
        state.generator = torch.Generator(device=device)
        state.generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # negative seeds map into uint64
    return state.generator


def sampling_metadata(states: list[RequestState], vocab_size: int, device: torch.device) -> SamplingMetadata:
    """The sampler's view of the rows that sample (one per state, in order)."""
    params = [state.sampling_params for state in states]
    if all(p.greedy and p.logprobs is None and not p.presence_penalty and not p.frequency_penalty
           and p.repetition_penalty == 1.0 and not p.has_logits_processors for p in params) and not any(
            s.min_tokens_stop_ids and len(s.output_token_ids) < s.sampling_params.min_tokens for s in states):
        # Plain greedy rows: the sampler takes the argmax and reads nothing else (no device copies).
        return SamplingMetadata(temperature=None, all_greedy=True, all_random=False, top_k=None, top_p=None,
                                min_p=None)
    temperature = [0.0 if p.greedy else float(p.temperature) for p in params]
    all_greedy = all(t == 0.0 for t in temperature)
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [float(p.top_p) for p in params]
    min_p = [float(p.min_p) for p in params]
    metadata = SamplingMetadata(
        temperature=to_device(temperature, torch.float32, device),
        all_greedy=all_greedy,
        all_random=all(t > 0.0 for t in temperature),
        top_k=None if all(k == vocab_size for k in top_k)
        else to_device(top_k, torch.long, device),
        top_p=None if all(p == 1.0 for p in top_p) else to_device(top_p, torch.float32, device),
        min_p=None if all(p == 0.0 for p in min_p) else to_device(min_p, torch.float32, device),
    )
    if not all_greedy:
        for row, state in enumerate(states):
            generator = generator_for(state, device)
            if generator is not None:
                metadata.generators[row] = generator
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        metadata.presence_penalty = torch.tensor([float(p.presence_penalty) for p in params], device=device)
        metadata.frequency_penalty = torch.tensor([float(p.frequency_penalty) for p in params],
                                                  device=device)
        metadata.repetition_penalty = torch.tensor([float(p.repetition_penalty) for p in params],
                                                   device=device)
        metadata.output_token_ids = _pad([s.output_token_ids for s in states], vocab_size, device)
        metadata.prompt_token_ids = _pad([s.prompt_token_ids for s in states], vocab_size, device)
    for row, state in enumerate(states):
        if state.min_tokens_stop_ids and len(state.output_token_ids) < state.sampling_params.min_tokens:
            metadata.min_tokens_masks.append((row, state.min_tokens_stop_ids))
    if any(p.has_logits_processors for p in params):
        _add_logits_processors(metadata, states, device)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    metadata.max_num_logprobs = max(wanted) if wanted else None
    return metadata


def _add_logits_processors(metadata: SamplingMetadata, states: list[RequestState], device: torch.device) -> None:
    """The batch's allowed_token_ids, bad_words bans and logit_bias as index tensors for one op each
    (sample/sampler.py apply_logits_processors); each request's own tensors are made once and reused."""
    bias_rows, bias_ids, bias_values = [], [], []
    allowed_rows: list[int] = []
    allowed_local, allowed_ids = [], []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for row, state in enumerate(states):
        params = state.sampling_params
        if params.logit_bias:
            if state.logit_bias_tensors is None:
                state.logit_bias_tensors = (
                    torch.tensor(list(params.logit_bias), dtype=torch.long, device=device),
                    torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device))
            ids, values = state.logit_bias_tensors
            bias_rows.append(torch.full_like(ids, row))
            bias_ids.append(ids)
            bias_values.append(values)
        if params.allowed_token_ids is not None:
            if state.allowed_tensor is None:
                state.allowed_tensor = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)
            allowed_local.append(torch.full_like(state.allowed_tensor, len(allowed_rows)))
            allowed_ids.append(state.allowed_tensor)
            allowed_rows.append(row)
        for token_id in banned_tokens(params.bad_words_token_ids, state.output_token_ids):
            banned_rows.append(row)
            banned_ids.append(token_id)
    if bias_rows:
        metadata.logit_bias = (torch.cat(bias_rows), torch.cat(bias_ids), torch.cat(bias_values))
    if allowed_rows:
        metadata.allowed_rows = to_device(allowed_rows, torch.long, device)
        metadata.allowed = (torch.cat(allowed_local), torch.cat(allowed_ids))
    if banned_rows:
        metadata.banned = (to_device(banned_rows, torch.long, device),
                           to_device(banned_ids, torch.long, device))


def banned_tokens(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """vLLM's bad_words rule: a word's last token is banned where the output ends with the word's other
    tokens (a one-token word is always banned)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or output_token_ids[-prefix:] == word[:-1]:
            banned.append(word[-1])
    return banned


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
