"""ModelRunner: a SchedulerOutput in, sampled tokens out.

It owns the model, the KV cache tensors and what it keeps of each request (prompt, sampling
parameters, the tokens it sampled, a seeded generator), turns the scheduled work into flat
tensors, runs the model, computes logits only where a token is sampled (or prompt logprobs were
asked), and samples. It reads nothing but the plain data of kvloom.step_io.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvloom.config import ResolvedConfig
from kvloom.layers.tensor_parallel import ProcessGroupLike, shard_model_for_tensor_parallel, sharded_model_config
from kvloom.models.registry import build_model, load_model_weights, process_weights_after_loading
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.table import Ops, select_ops
from kvloom.platform import default_dtype
from kvloom.sample.rejection_sampler import RejectionOutput, greedy_rejection_sample, rejection_sample
from kvloom.sample.sampler import NONFINITE_TOKEN_ID, Sampler, SamplingMetadata, compute_logprobs_top
from kvloom.sampling_params import SamplingParams
from kvloom.spec_decode import build_model_proposer, can_speculate
from kvloom.spec_decode.draft_model import MAX_DRAFT_LAG, DraftModelProposer, DraftRequest
from kvloom.step_io import LogprobsRow, ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from kvloom.worker.compiled_artifacts import ArtifactStore
from kvloom.worker.graphs import DecodeGraphs, default_token_gen_buckets, pick_bucket

logger = logging.getLogger("kvloom")

_DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


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
    # A draft model / EAGLE head: its KV holds positions < draft_computed (None: not yet scheduled); while it
    # lags, EAGLE's inputs for the positions from there on (the target's hidden-state rows) wait here.
    draft_computed: int | None = None
    draft_hidden: list[torch.Tensor] = field(default_factory=list)
    draft_hidden_start: int | None = None  # the position of draft_hidden's first row (past draft_computed: a gap)
    draft_resumes: bool = True  # new or preempted: its next step starts from a prefix-cache hit
    # Its prefix-cache hit held no draft KV where EAGLE cannot compute it: it drafts no more.
    draft_disabled: bool = False


@dataclass
class SpeculativeBatch:
    """This step's speculative requests: where their positions' hidden states are, and their drafts."""

    request_ids: list[str]
    states: list[RequestState]
    max_k: int
    positions: torch.Tensor  # [R] rows of the hidden states: each request's last known token and its drafts
    padded: torch.Tensor  # [S * (K + 1)] for each request's K + 1 slots, its row in positions (the last one repeated)
    draft_token_ids: torch.Tensor  # [S, K], padded
    num_drafts: torch.Tensor  # [S]
    greedy: torch.Tensor  # [S] bool
    metadata: SamplingMetadata | None = None  # per position, when some row samples at random
    greedy_positions: torch.Tensor | None = None  # [S * (K + 1)] bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    finite: torch.Tensor | None = None  # [S] bool, set when the drafts are scored


class ModelRunner:
    def __init__(self, config: ResolvedConfig, device: torch.device | None = None) -> None:
        self.config = config
        self.model_config = config.model  # a tensor-parallel rank's view after load_model
        self.device = config.device if device is None else device
        self.dtype = config.dtype
        self.block_size = config.block_size
        self.vocab_size = config.model.vocab_size
        self.sliding_window = config.model.sliding_window
        self.model: torch.nn.Module | None = None
        self.ops: Ops | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.engine.seed)
        self.sampler = Sampler(self.generator)
        self.requests: dict[str, RequestState] = {}
        self.load_seconds = 0.0
        self.graphs: DecodeGraphs | None = None
        self.artifacts: ArtifactStore | None = None  # compiled kernels kept across restarts (CUDA)
        # Prefill steps are padded to these token counts (None: run at their own size).
        self.context_length_buckets: list[int] | None = None
        # Set by a tensor-parallel executor: sends each step's inputs to the other ranks.
        self.broadcast_inputs: Callable[[ModelInputs], None] | None = None
        # Speculative decoding with a draft model or EAGLE: proposes after each step (rank 0 only).
        self.proposer: DraftModelProposer | None = None
        # Set by a caller that records every step's final hidden states (train_eagle.py, its training
        # features while the target generates): called with the step's items, their rows' starts in the
        # hidden states (query_start_loc) and the hidden states [T, H].
        self.hidden_state_sink: Callable[[list[ScheduledRequest], list[int], torch.Tensor], None] | None = None

    # ---- set-up ----------------------------------------------------------------------------
    def load_model(self, rank: int = 0, world_size: int = 1, group: ProcessGroupLike | None = None) -> None:
        """Build the model with the platform's ops, load it, keep rank's shard, then prepare the weights."""
        start = time.perf_counter()
        engine = self.config.engine
        self.ops = select_ops(self.device, self.dtype, engine.backend.attention_backend,
                              batch_hint=min(engine.max_num_seqs, 256),
                              int8_activations=engine.backend.int8_activations)
        if self.ops.name == "triton":
            self.artifacts = ArtifactStore(self.config, self._token_gen_buckets())
            self.artifacts.open()  # before the first kernel compiles
        with default_dtype(self.dtype), torch.device(self.device):
            model = build_model(self.model_config, self.ops)
        load_model_weights(model, self.config)
        if world_size > 1:
            shard_model_for_tensor_parallel(model, rank, world_size, group)
            self.model_config = sharded_model_config(self.model_config, world_size)
        process_weights_after_loading(model, self.ops)
        self.sampler = Sampler(self.generator, argmax=self.ops.argmax)
        self.model = model.eval()
        speculative = engine.speculative
        if rank == 0 and speculative is not None and speculative.uses_draft_model:
            # Unsharded on the driver, which holds the whole hidden states after each step.
            self.proposer = build_model_proposer(speculative, self.config.model, model, self.ops, self.device,
                                                 self.dtype, self.config.max_model_len)
            # EAGLE-3 reads some layers' inputs: the target returns them beside its hidden states.
            model.aux_hidden_state_layers = self.proposer.aux_hidden_state_layers
        self.load_seconds = time.perf_counter() - start

    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        element = torch.empty((), dtype=self.dtype).element_size()
        target = 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * element
        # A block holds the draft's keys and values for its positions too (same block tables).
        return target + (self.proposer.kv_bytes_per_block(self.block_size) if self.proposer is not None else 0)

    def determine_num_kv_blocks(self) -> int:
        """KV blocks that fit the budget, never more than max_num_seqs full-length sequences use, + the null
        block. The budget is kv_cache_memory; on CUDA without it, what gpu_memory_utilization leaves after
        the weights and the peak activations of the largest step (measured by running one)."""
        engine = self.config.engine
        per_block = self.kv_bytes_per_block()
        budget = engine.kv_cache_memory
        if budget is None:
            budget = self._profile_cuda_budget() if self.device.type == "cuda" else _DEFAULT_CPU_KV_CACHE_BYTES
        most_useful = engine.max_num_seqs * self.config.max_blocks_per_seq
        num_blocks = min(budget // per_block, most_useful)
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({budget} bytes) is smaller than one KV block "
                             f"({per_block} bytes of {self.block_size} tokens); raise kv_cache_memory or "
                             f"gpu_memory_utilization, or lower max_num_batched_tokens")
        if self.device.type == "cuda":
            logger.info("KV cache: %d blocks of %d tokens = %d tokens per sequence set (%.2f GiB)", num_blocks,
                        self.block_size, num_blocks * self.block_size, num_blocks * per_block / 2**30)
        return num_blocks + 1

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> int:
        """Bytes for the KV cache on CUDA: run the largest step (max_num_batched_tokens tokens, logits for
        max_num_seqs rows) on a one-block scratch cache, then take what gpu_memory_utilization leaves
        beside the peak memory torch reached and what other libraries hold."""
        engine, mc = self.config.engine, self.model_config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch = [(torch.zeros(1, self.block_size, mc.num_key_value_heads, mc.head_dim, dtype=self.dtype,
                                device=self.device),) * 2 for _ in range(mc.num_hidden_layers)]
        tokens = self.config.max_num_batched_tokens
        lengths = [self.config.max_model_len] * (tokens // self.config.max_model_len)
        if tokens % self.config.max_model_len:
            lengths.append(tokens % self.config.max_model_len)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.zeros(tokens, dtype=torch.long, device=device),  # all into the scratch block
            block_table=torch.zeros(len(lengths), self.config.max_blocks_per_seq, dtype=torch.long, device=device),
            seq_lens=torch.tensor(lengths, device=device), query_start_loc=starts, seq_lens_host=lengths,
            num_decodes=0, block_size=self.block_size, sliding_window=self.sliding_window,
            query_start_loc_tensor=torch.tensor(starts, device=device), max_query_len=max(lengths))
        hidden, _ = self._split(self.model(torch.zeros(tokens, dtype=torch.long, device=device), positions,
                                           scratch, metadata))
        rows = min(engine.max_num_seqs, tokens)
        torch.log_softmax(self.model.compute_logits(hidden[:rows]).float(), dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, hidden, metadata
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        other = (total - free) - torch.cuda.memory_reserved(self.device)  # CUDA context, NCCL, cuBLAS
        budget = int(total * engine.gpu_memory_utilization - peak - max(other, 0))
        logger.info("CUDA memory: %.2f GiB total x %.2f; weights + peak activations %.2f GiB, other %.2f GiB; "
                    "%.2f GiB left for the KV cache", total / 2**30, engine.gpu_memory_utilization, peak / 2**30,
                    other / 2**30, budget / 2**30)
        return budget

    def init_kv_cache(self, num_blocks: int) -> None:
        """Per layer a key and a value cache of num_blocks blocks, in the layout the ops' attention reads
        (ops/reference.py allocate_kv_cache)."""
        mc = self.model_config
        self.kv_caches = [self.ops.allocate_kv_cache(num_blocks, self.block_size, mc.num_key_value_heads,
                                                     mc.head_dim, self.dtype, self.device)
                          for _ in range(mc.num_hidden_layers)]
        if self.proposer is not None:
            self.proposer.init_kv_cache(num_blocks, self.block_size)
            self.draft_complete = bytearray(num_blocks)  # per block id (see _clear_draft_complete)
        self.capture_graphs()
        if self.artifacts is not None:
            self.artifacts.close()

    def capture_graphs(self) -> None:
        """After the KV cache exists: on CUDA with the Triton ops, capture a CUDA graph per decode bucket
        (unless enforce_eager or bucketing is off, or the ranks are tensor-parallel)."""
        engine, backend = self.config.engine, self.config.engine.backend
        bucketing = backend.enable_bucketing if backend.enable_bucketing is not None else self.device.type == "cuda"
        if not bucketing:
            return
        if self.device.type != "cuda" or self.ops.name != "triton":
            raise ValueError("enable_bucketing needs CUDA with the Triton ops (attention_backend 'auto' or "
                             f"'triton'); this engine runs the {self.ops.name!r} ops on {self.device}")
        self.context_length_buckets = backend.context_length_buckets
        # EAGLE-3's target returns auxiliary hidden states too: its decode steps run eagerly.
        if engine.enforce_eager or engine.tensor_parallel_size > 1 or self.model.aux_hidden_state_layers:
            return
        self.graphs = DecodeGraphs(self._forward_tokens, self._token_gen_buckets(), self.config.max_blocks_per_seq,
                                   self.block_size, self.sliding_window, self.device)
        self.graphs.capture()

    def _token_gen_buckets(self) -> list[int]:
        engine = self.config.engine
        buckets = engine.backend.token_gen_buckets or default_token_gen_buckets(engine.max_num_seqs)
        return [b for b in buckets if b <= engine.max_num_seqs] or [engine.max_num_seqs]

    def _forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, metadata)

    def release_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    # ---- the step --------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(scheduler_output)()

    @torch.inference_mode()
    def execute_async(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Launch the step on the device; the returned function waits for it and reads the tokens back.

        Everything copied to the device (inputs, sampling parameters) is copied before the launch: a copy
        from pageable host memory waits for the device's queue, so none may follow the forward pass.
        """
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = self._request_state(new)
        for request_id in scheduler_output.preempted_request_ids:
            state = self.requests.get(request_id)
            if state is not None:
                state.draft_resumes = True
        scheduled = scheduler_output.scheduled
        use_graph = (self.graphs is not None and self.graphs.can_run(len(scheduled))
                     and all(item.num_new_tokens == 1 for item in scheduled))
        if use_graph:
            items, inputs = scheduled, None
            query_start_loc = list(range(len(items) + 1))
        else:
            items, inputs = self._prepare_inputs(scheduled, self.sliding_window)
            query_start_loc = inputs.metadata.query_start_loc
        sampling_rows = [i for i, item in enumerate(items) if item.samples and not item.num_draft_tokens]
        speculative = self._prepare_speculative(items, query_start_loc)
        ids = [items[i].request_id for i in sampling_rows]
        states = [self.requests[request_id] for request_id in ids]
        sampling_metadata = self._sampling_metadata(states) if ids else None
        if ids and scheduler_output.grammar_bitmask is not None:  # structured outputs: masked before sampling
            sampling_metadata.token_bitmask = scheduler_output.grammar_bitmask.for_rows(ids, self.device)
        last_token_index = None
        if ids and len(sampling_rows) != query_start_loc[-1]:  # else: one token per request, each sampling
            last_token_index = torch.tensor([query_start_loc[i + 1] - 1 for i in sampling_rows], device=self.device)

        aux_hidden = None
        if use_graph:
            hidden = self._decode_with_graph(scheduled)
        else:
            if self.broadcast_inputs is not None:
                self.broadcast_inputs(inputs)
            hidden, aux_hidden = self._split(self.forward(inputs))
        if self.hidden_state_sink is not None:
            self.hidden_state_sink(items, query_start_loc, hidden)
        sampler_output = None
        if ids:
            last_hidden = hidden if last_token_index is None else hidden.index_select(0, last_token_index)
            sampler_output = self.sampler(self.model.compute_logits(last_hidden), sampling_metadata)
        verified = None if speculative is None else self._verify_drafts(hidden, speculative)

        @torch.inference_mode()
        def finish() -> ModelRunnerOutput:
            output = ModelRunnerOutput()
            if sampler_output is not None:
                sampled = sampler_output.sampled_token_ids.tolist()  # waits for the device
                for request_id, state, token_id in zip(ids, states, sampled):
                    if token_id == NONFINITE_TOKEN_ID:
                        output.failed_request_ids.append(request_id)
                        continue
                    output.sampled_token_ids[request_id] = [token_id]
                    state.output_token_ids.append(token_id)
                if sampler_output.logprobs is not None:
                    top_ids = sampler_output.logprob_token_ids.tolist()
                    values = sampler_output.logprobs.tolist()
                    ranks = sampler_output.sampled_ranks.tolist()
                    for row, (request_id, state) in enumerate(zip(ids, states)):
                        num = state.sampling_params.logprobs
                        if num is not None and request_id in output.sampled_token_ids:
                            output.logprobs[request_id] = [(top_ids[row][:num + 1], values[row][:num + 1],
                                                            ranks[row])]
            if verified is not None:
                emitted, counts = verified.output_token_ids.tolist(), verified.num_emitted.tolist()
                finite = speculative.finite.tolist()
                for request_id, state, tokens, count, ok in zip(speculative.request_ids, speculative.states, emitted,
                                                                counts, finite):
                    if not ok:
                        output.failed_request_ids.append(request_id)
                        continue
                    output.sampled_token_ids[request_id] = tokens[:count]
                    state.output_token_ids.extend(tokens[:count])
            for i, item in enumerate(items):
                state = self.requests[item.request_id]
                if state.sampling_params.prompt_logprobs is not None:
                    rows = self._prompt_logprobs(item, state, hidden, query_start_loc[i])
                    if rows:
                        output.prompt_logprobs[item.request_id] = rows
            if self.proposer is not None:
                requests, target_hidden = self._draft_requests(items, query_start_loc, output,
                                                               hidden if aux_hidden is None else aux_hidden)
                if requests:
                    output.draft_token_ids = self.proposer.propose(requests, target_hidden, self._draft_inputs)
                    output.draft_passes = self.proposer.passes
            return output

        return finish

    def _prepare_speculative(self, items: list[ScheduledRequest], query_start_loc: list[int]
                             ) -> SpeculativeBatch | None:
        """The device tensors for scoring this step's draft tokens (made before the launch), or None."""
        rows = [i for i, item in enumerate(items) if item.num_draft_tokens]
        if not rows:
            return None
        device = self.device
        max_k = max(items[i].num_draft_tokens for i in rows)
        positions, padded, drafts, counts = [], [], [], []
        for i in rows:
            k = items[i].num_draft_tokens
            end = query_start_loc[i + 1]
            # The k + 1 positions from the last known token on; the slots past them repeat the last one.
            first = len(positions)
            positions.extend(range(end - k - 1, end))
            padded.extend([*range(first, first + k + 1), *([first + k] * (max_k - k))])
            drafts.append(items[i].token_ids[-k:] + [0] * (max_k - k))
            counts.append(k)
        ids = [items[i].request_id for i in rows]
        states = [self.requests[request_id] for request_id in ids]
        greedy = [state.sampling_params.greedy for state in states]
        batch = SpeculativeBatch(
            request_ids=ids, states=states, max_k=max_k,
            positions=torch.tensor(positions, device=device), padded=torch.tensor(padded, device=device),
            draft_token_ids=torch.tensor(drafts, dtype=torch.long, device=device),
            num_drafts=torch.tensor(counts, dtype=torch.long, device=device),
            greedy=torch.tensor(greedy, device=device))
        if not all(greedy):
            # Every position of a request samples with its parameters: one metadata row per position.
            expanded = [state for state in states for _ in range(max_k + 1)]
            batch.metadata = self._sampling_metadata(expanded)
            batch.greedy_positions = batch.greedy.repeat_interleave(max_k + 1)
            batch.generators = {row: g for row, state in enumerate(states) if (g := self._generator_for(state))}
        return batch

    def _verify_drafts(self, hidden: torch.Tensor, batch: SpeculativeBatch) -> RejectionOutput:
        """Score every draft with the target's logits and keep what rejection sampling allows (on the device)."""
        # The LM head runs on the real positions only [R, V]: with k_eff varying across the batch, padding every
        # request to the longest would multiply its cost (at batch 64 on the CPU it is ~1/5 of a step).
        logits = self.model.compute_logits(hidden.index_select(0, batch.positions)).float()
        # As the plain sampler does: a request whose logits hold a NaN or an infinity emits nothing.
        batch.finite = (logits.sum(dim=-1).isfinite().index_select(0, batch.padded)
                        .view(len(batch.request_ids), -1).all(dim=1))
        if batch.metadata is None:  # all greedy: only the argmaxes, gathered into the padded slots
            argmax = logits.argmax(dim=-1).index_select(0, batch.padded).view(len(batch.request_ids), -1)
            return greedy_rejection_sample(batch.draft_token_ids, batch.num_drafts, argmax)
        logits = logits.index_select(0, batch.padded)  # [S * (K + 1), V]
        probs = Sampler.probabilities(logits, batch.metadata)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves them unnormalized
        # Greedy rows read only the argmax: their logits serve as they are.
        logits = torch.where(batch.greedy_positions[:, None], logits, probs)
        target = logits.view(len(batch.request_ids), batch.max_k + 1, -1)
        return rejection_sample(batch.draft_token_ids, batch.num_drafts, target, None, batch.greedy,
                                generators=batch.generators, generator=self.generator,
                                max_drafts=self.config.engine.speculative.num_speculative_tokens)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [T, H] (and, for EAGLE-3, the auxiliary ones [T, A * H]); every
        tensor-parallel rank runs this on the same inputs."""
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    @staticmethod
    def _split(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return out if isinstance(out, tuple) else (out, None)

    def _draft_requests(self, items: list[ScheduledRequest], query_start_loc: list[int],
                        output: ModelRunnerOutput, hidden: torch.Tensor
                        ) -> tuple[list[DraftRequest], torch.Tensor]:
        """What the draft runs after this step, and the target hidden states its rows index.

        Per request the tokens the target kept (a speculated request's rejected drafts dropped) and the token
        after them, from where the draft's KV ends; guesses for the ``num_speculative_tokens`` the scheduler
        asked. A request asked for none is left out: its draft KV lags, and EAGLE keeps its hidden-state rows
        until then, at most ``MAX_DRAFT_LAG`` of them (spec_decode/draft_model.py). A request whose draft KV
        cannot be completed is reported in ``output.draft_disabled_request_ids``."""
        self._clear_draft_complete(items)
        failed = set(output.failed_request_ids)
        reads_hidden = self.proposer.reads_hidden_states
        # (row in items, item, state, end, guesses asked)
        wanted: list[tuple[int, ScheduledRequest, RequestState, int, int]] = []
        lagging: list[tuple[RequestState, int, int]] = []  # (state, first row in hidden, rows)
        for i, item in enumerate(items):
            new_tokens = output.sampled_token_ids.get(item.request_id)
            if item.request_id in failed or (item.samples and not new_tokens):
                continue
            state = self.requests[item.request_id]
            if state.draft_disabled:
                continue
            start = item.num_computed_tokens
            num_valid = item.num_new_tokens - item.num_draft_tokens
            if item.num_draft_tokens:
                num_valid += len(new_tokens) - 1  # the accepted drafts
            if state.draft_resumes:  # new, or readmitted after preemption: from its prefix-cache hit
                state.draft_resumes = False
                self._resume_draft(state, item.block_ids, start)
            end = start + num_valid  # the draft's KV is to hold positions < end
            speculates = item.samples and can_speculate(state.sampling_params, len(state.output_token_ids))
            max_drafts = item.num_speculative_tokens if speculates else 0
            if max_drafts or (reads_hidden and end - state.draft_hidden_start >= MAX_DRAFT_LAG):
                wanted.append((i, item, state, end, max_drafts))
            elif reads_hidden and num_valid:
                lagging.append((state, query_start_loc[i], num_valid))
        included: list[tuple[int, ScheduledRequest, RequestState, int, int]] = []
        # Those whose draft KV is whole first: their passes complete blocks that another's hit may begin with
        # (the same pass writes them before its attention reads them).
        for i, item, state, end, max_drafts in sorted(wanted, key=lambda w: w[2].draft_computed
                                                      < w[2].draft_hidden_start):
            if self._close_gap(state, item.block_ids):
                included.append((i, item, state, end, max_drafts))
                self._mark_draft_complete(item.block_ids, state.draft_computed, end)
                continue
            # A gap at the start of its prefix-cache hit that no pass has filled yet: it cannot guess now.
            if end - state.draft_hidden_start >= MAX_DRAFT_LAG:
                state.draft_disabled, state.draft_hidden = True, []
                output.draft_disabled_request_ids.append(item.request_id)
            elif end > item.num_computed_tokens:
                lagging.append((state, query_start_loc[i], end - item.num_computed_tokens))
        if lagging:
            # One copy of every lagging request's rows (the hidden states may be a reused buffer).
            kept = hidden.index_select(0, torch.tensor([first + j for _, first, n in lagging for j in range(n)],
                                                       dtype=torch.long, device=self.device))
            offset = 0
            for state, _, n in lagging:
                state.draft_hidden.append(kept[offset:offset + n])
                offset += n
        if not included:
            return [], hidden
        waiting_rows = [h for _, _, state, _, _ in included for h in state.draft_hidden] if reads_hidden else []
        target_hidden = torch.cat([hidden, *waiting_rows]) if waiting_rows else hidden
        next_row = hidden.shape[0]
        requests = []
        for i, item, state, end, max_drafts in included:
            first = state.draft_computed
            rows: list[int] = []
            if reads_hidden:
                for chunk in state.draft_hidden:
                    rows.extend(range(next_row, next_row + len(chunk)))
                    next_row += len(chunk)
                rows.extend(range(query_start_loc[i], query_start_loc[i] + end - item.num_computed_tokens))
            requests.append(DraftRequest(item.request_id, first, _token_slice(state, first, end + 1), end - first,
                                         item.block_ids, rows, max_drafts))
            state.draft_computed = state.draft_hidden_start = end
            state.draft_hidden = []
        return requests, target_hidden

    # ---- which blocks hold the draft's KV ----------------------------------------------------
    # A block's draft KV is complete when the draft's KV of all its positions was written after the target's
    # last write to it (``draft_complete``, per block id). A full block may be a prefix-cache hit for another
    # request, which must know whether the draft's KV it finds there is real: a lagging request fills blocks
    # the draft has not run over.
    def _clear_draft_complete(self, items: list[ScheduledRequest]) -> None:
        """The target wrote this step's positions of every item: their blocks' draft KV is stale."""
        size, complete = self.block_size, self.draft_complete
        for item in items:
            first, last = item.num_computed_tokens // size, (item.num_computed_tokens + item.num_new_tokens - 1) // size
            for index in range(first, min(last + 1, len(item.block_ids))):
                complete[item.block_ids[index]] = 0

    def _mark_draft_complete(self, block_ids: list[int], start: int, end: int) -> None:
        """The draft's KV will hold positions < ``end`` after this step's pass (from ``start`` written in it):
        the blocks wholly below it are complete (not past the positions the draft reaches)."""
        size = self.block_size
        for index in range(start // size, min(end, self.proposer.max_position) // size):
            self.draft_complete[block_ids[index]] = 1

    def _resume_draft(self, state: RequestState, block_ids: list[int], start: int) -> None:
        """Where a new or readmitted request's draft KV starts: after the run of complete blocks its
        prefix-cache hit (positions below ``start``) begins with. A draft model runs over the tokens from
        there. EAGLE also needs the target's hidden states of those positions: a readmitted request may have
        kept some; positions between the complete blocks and its rows are a gap (``draft_computed <
        draft_hidden_start``) that only the pass of the request that filled those blocks can close."""
        complete = self._complete_until(block_ids, 0, start)  # a hit is whole blocks: start is a block's start
        old, rows = state.draft_hidden_start, state.draft_hidden
        if not self.proposer.reads_hidden_states:
            state.draft_hidden_start, state.draft_hidden = complete, []
        elif old is not None and old <= start <= old + _num_rows(rows):
            first = max(old, complete)
            state.draft_hidden_start, state.draft_hidden = first, _row_range(rows, first - old, start - old)
        else:
            state.draft_hidden_start, state.draft_hidden = start, []
        state.draft_computed = complete

    def _close_gap(self, state: RequestState, block_ids: list[int]) -> bool:
        """Whether the draft's KV is whole up to the request's waiting rows (a gap's blocks may have been
        completed since, by their own request's pass)."""
        state.draft_computed = self._complete_until(block_ids, state.draft_computed, state.draft_hidden_start)
        return state.draft_computed == state.draft_hidden_start

    def _complete_until(self, block_ids: list[int], position: int, end: int) -> int:
        """How far from ``position`` (a block's start, or inside a complete run) the blocks' draft KV is
        complete, at most ``end``."""
        size = self.block_size
        while position < end and self.draft_complete[block_ids[position // size]]:
            position = (position // size + 1) * size
        return min(position, end)

    def _draft_inputs(self, items: list[ScheduledRequest], sliding_window: int | None
                      ) -> tuple[list[ScheduledRequest], ModelInputs]:
        """The draft's inputs for its passes: as the target's, never padded to a bucket."""
        return self._prepare_inputs(items, sliding_window, pad=False)

    def _decode_with_graph(self, items: list[ScheduledRequest]) -> torch.Tensor:
        """A decode-only step through the captured graph of its bucket -> hidden states [n, H]."""
        block_size = self.block_size
        positions = [item.num_computed_tokens for item in items]
        block_rows = [item.block_ids for item in items]
        return self.graphs.run(
            input_ids=[item.token_ids[0] for item in items], positions=positions,
            slot_mapping=[row[p // block_size] * block_size + p % block_size for row, p in zip(block_rows, positions)],
            seq_lens=[p + 1 for p in positions], block_rows=block_rows)

    def _request_state(self, new: NewRequestData) -> RequestState:
        stop_ids = sorted(t for t in new.min_tokens_stop_ids if 0 <= t < self.vocab_size)
        return RequestState(new.prompt_token_ids, new.sampling_params, stop_ids)

    def _prepare_inputs(self, scheduled: list[ScheduledRequest], sliding_window: int | None,
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
        needs_decode_mask = num_decodes and self.ops.needs_decode_mask
        if needs_decode_mask:
            # Round the longest decode context up to 64 tokens, so few distinct shapes occur.
            needed = -(-max(seq_lens[:num_decodes]) // block_size)
            step = max(1, 64 // block_size)
            decode_num_blocks = min(-(-needed // step) * step, self.config.max_blocks_per_seq)
            max_blocks = max(max_blocks, decode_num_blocks)
        block_table = [request_blocks + [0] * (max_blocks - len(request_blocks))
                       for request_blocks in (item.block_ids[:max_blocks] for item in items)]

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
        return items, ModelInputs(torch.tensor(input_ids, dtype=torch.long, device=device),
                                  torch.tensor(positions, dtype=torch.long, device=device), metadata)

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
        metadata.slot_mapping = torch.tensor(slot_mapping, dtype=torch.long, device=device)
        # Its block-table row covers its whole (pad-token) context with the null block.
        table = metadata.block_table
        width = max(table.shape[1], -(-pad // self.block_size))
        padded = table.new_zeros(table.shape[0] + 1, width)
        padded[:table.shape[0], :table.shape[1]] = table
        metadata.block_table = padded
        metadata.seq_lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
        metadata.query_start_loc_tensor = torch.tensor(query_start_loc, dtype=torch.long, device=device)
        metadata.max_query_len = max(metadata.max_query_len, pad)

    def _generator_for(self, state: RequestState) -> torch.Generator | None:
        seed = state.sampling_params.seed
        if seed is None:
            return None
        if state.generator is None:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # negative seeds map into uint64
        return state.generator

    def _sampling_metadata(self, states: list[RequestState]) -> SamplingMetadata:
        device = self.device
        params = [state.sampling_params for state in states]
        if all(p.greedy and p.logprobs is None and not p.presence_penalty and not p.frequency_penalty
               and p.repetition_penalty == 1.0 for p in params) and not any(
                s.min_tokens_stop_ids and len(s.output_token_ids) < s.sampling_params.min_tokens for s in states):
            # Plain greedy rows: the sampler takes the argmax and reads nothing else (no device copies).
            return SamplingMetadata(temperature=None, all_greedy=True, all_random=False, top_k=None, top_p=None,
                                    min_p=None)
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
            for row, state in enumerate(states):
                generator = self._generator_for(state)
                if generator is not None:
                    metadata.generators[row] = generator
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
            metadata.presence_penalty = torch.tensor([float(p.presence_penalty) for p in params], device=device)
            metadata.frequency_penalty = torch.tensor([float(p.frequency_penalty) for p in params],
                                                      device=device)
            metadata.repetition_penalty = torch.tensor([float(p.repetition_penalty) for p in params],
                                                       device=device)
            metadata.output_token_ids = _pad([s.output_token_ids for s in states], self.vocab_size, device)
            metadata.prompt_token_ids = _pad([s.prompt_token_ids for s in states], self.vocab_size, device)
        for row, state in enumerate(states):
            if state.min_tokens_stop_ids and len(state.output_token_ids) < state.sampling_params.min_tokens:
                metadata.min_tokens_masks.append((row, state.min_tokens_stop_ids))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        metadata.max_num_logprobs = max(wanted) if wanted else None
        return metadata

    def _prompt_logprobs(self, item: ScheduledRequest, state: RequestState, hidden: torch.Tensor, offset: int
                         ) -> list[LogprobsRow]:
        """Logprobs of prompt tokens predicted inside this chunk (position p predicts token p+1)."""
        start = item.num_computed_tokens
        end = min(start + item.num_new_tokens, len(state.prompt_token_ids) - 1)
        if end <= start:
            return []
        index = torch.arange(offset, offset + end - start, device=self.device)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, index)).float(), dim=-1)
        targets = torch.tensor(state.prompt_token_ids[start + 1:end + 1], device=self.device)
        ids, values, ranks = compute_logprobs_top(logprobs, targets, state.sampling_params.prompt_logprobs)
        return list(zip(ids.tolist(), values.tolist(), ranks.tolist()))


def _token_slice(state: RequestState, start: int, end: int) -> list[int]:
    """The request's tokens (prompt, then what it sampled) at positions [start, end)."""
    prompt, outputs = state.prompt_token_ids, state.output_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return outputs[start - n:end - n]
    return prompt[start:] + outputs[:end - n]


def _num_rows(chunks: list[torch.Tensor]) -> int:
    return sum(len(chunk) for chunk in chunks)


def _row_range(chunks: list[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    """Rows [start, end) of the chunks' concatenation, as chunks."""
    kept, offset = [], 0
    for chunk in chunks:
        lo, hi = max(start - offset, 0), min(end - offset, len(chunk))
        if lo < hi:
            kept.append(chunk[lo:hi])
        offset += len(chunk)
    return kept


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
