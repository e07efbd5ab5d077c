"""ModelRunner: a SchedulerOutput in, sampled tokens out.

It owns the model, the KV cache tensors and what it keeps of each request (worker/input_batch.py's
``RequestState``), turns the scheduled work into flat tensors (``InputBatch``), runs the model (a captured
CUDA graph for decode steps where there is one: worker/graphs.py), computes logits only where a token is
sampled (or prompt logprobs were asked), and samples. With speculative decoding, ``Speculator``
(worker/speculator.py) verifies the step's drafts and proposes the next step's. KV sizing is
worker/kv_cache.py. It reads nothing but the plain data of kvloom.step_io.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvloom.config import ResolvedConfig
from kvloom.layers.embedding import VocabEmbedding
from kvloom.layers.tensor_parallel import ProcessGroupLike, shard_model_for_tensor_parallel, sharded_model_config
from kvloom.lora.model_manager import LoRAModelManager
from kvloom.lora.peft import model_shape
from kvloom.lora.request import LoRARequest
from kvloom.models.registry import build_model, load_model_weights, process_weights_after_loading
from kvloom.ops import huge_pages
from kvloom.ops.huge_pages import StepwiseRehome
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.table import Ops, select_ops
from kvloom.platform import default_dtype, release_freed_heap
from kvloom.pooling import PoolingState
from kvloom.sample.sampler import NONFINITE_TOKEN_ID, Sampler, compute_logprobs_top
from kvloom.spec_decode.draft_model import DraftModelProposer
from kvloom.step_io import (
    PLACEHOLDER_TOKEN_ID,
    LogprobsRow,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from kvloom.worker.compiled_artifacts import ArtifactStore
from kvloom.worker.encoder_cache import BUDGET_ROWS_PER_BATCHED_TOKEN, EncoderCache, multimodal_embeddings
from kvloom.worker.graphs import DecodeGraphs, default_token_gen_buckets
from kvloom.worker.input_batch import HostCopy, InputBatch, ModelInputs, RequestState, sampling_metadata, to_device
from kvloom.worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KV_CACHE_TORCH_DTYPES,
    kv_bytes_per_block,
    num_kv_blocks,
    profile_cuda_budget,
)
from kvloom.worker.packed_cache import PackedModelCache, held_tensors
from kvloom.worker.speculator import Speculator, build_model_proposer

__all__ = ["ModelInputs", "ModelRunner", "RequestState"]  # ModelInputs: the executors send it to other ranks

logger = logging.getLogger("kvloom")


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
        self.input_batch: InputBatch | None = None  # with the op table (load_model)
        # Set by a tensor-parallel executor: sends each step's inputs to the other ranks.
        self.broadcast_inputs: Callable[[ModelInputs], None] | None = None
        # Speculative decoding: verifies each step's drafts and proposes the next (worker/speculator.py);
        # ``proposer`` is its draft model / EAGLE head, when it has one (rank 0 only).
        self.speculator: Speculator | None = None
        self.proposer: DraftModelProposer | None = None
        self.num_pooling_requests = 0  # embedding requests held: the step pools only while there are some
        # Set by a caller that records every step's final hidden states (tools/train_eagle.py, its training
        # features while the target generates): called with the step's items, their rows' starts in the
        # hidden states (query_start_loc) and the hidden states [T, H].
        self.hidden_state_sink: Callable[[list[ScheduledRequest], list[int], torch.Tensor], None] | None = None
        # A vision-language model's image rows by content hash (worker/encoder_cache.py); None: a text model.
        self.encoder_cache: EncoderCache | None = None
        # With enable_lora: the adapters' compute slots, host cache and per-layer deltas (kvloom/lora/).
        self.lora: LoRAModelManager | None = None
        self.rehome: StepwiseRehome | None = None  # a mapped packed model moving onto huge pages
        # Async scheduling: the last step's sampled tokens, still on the device, and each request's row in them;
        # a step's placeholder tokens are read from there.
        self.async_scheduling = config.async_scheduling
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None

    # ---- set-up ----------------------------------------------------------------------------
    def _defers_huge_pages(self, world_size: int) -> bool:
        """Whether a start packs into ordinary memory and moves the weights onto huge pages step by step: one CPU
        process without LoRA or speculative decoding (which wrap or share the model after loading), as the packed
        model cache's mapped starts."""
        engine = self.config.engine
        return (world_size == 1 and self.device.type == "cpu" and huge_pages.available() and not engine.enable_lora
                and engine.speculative is None)

    def load_model(self, rank: int = 0, world_size: int = 1, group: ProcessGroupLike | None = None) -> None:
        """Build the model with the platform's ops, load it, keep rank's shard, then prepare the weights."""
        start = time.perf_counter()
        engine = self.config.engine
        self.ops = select_ops(self.device, self.dtype, engine.backend.attention_backend,
                              batch_hint=min(engine.max_num_seqs, 256),
                              int8_activations=engine.backend.int8_activations,
                              q4_activations=engine.backend.q4_activations)
        if self.ops.name == "triton":
            self.artifacts = ArtifactStore.for_config(self.config, self._token_gen_buckets())
            self.artifacts.open()  # before the first kernel compiles
        # A GGUF packed at an earlier start is mapped from disk instead of read and packed (worker/packed_cache.py).
        packed = PackedModelCache.for_config(self.config, self.ops, world_size)
        model = packed.load(self.ops) if packed is not None else None
        # A mapped model moves onto huge pages over the first steps (execute_async, before each).
        self.rehome = packed.rehome if model is not None else None
        if model is None:
            packing = time.perf_counter()
            with default_dtype(self.dtype), torch.device(self.device):
                model = build_model(self.model_config, self.ops)
            load_model_weights(model, self.config)
            release_freed_heap()  # what reading and converting the weights freed, before packing allocates again
            if world_size > 1:
                shard_model_for_tensor_parallel(model, rank, world_size, group)
                self.model_config = sharded_model_config(self.model_config, world_size)
            # One CPU process: packed into ordinary memory, onto huge pages over the first steps (ops/huge_pages.py)
            defer = self._defers_huge_pages(world_size)
            with huge_pages.deferred() if defer else contextlib.nullcontext():
                process_weights_after_loading(model, self.ops)
            release_freed_heap()
            if packed is not None:
                packed.save(model, time.perf_counter() - packing)
            if defer:  # the products' weights; a table only looked up (rows a step) stays where it is
                lookups = tuple(m for m in model.modules() if isinstance(m, VocabEmbedding))
                self.rehome = StepwiseRehome.start(held_tensors(model, every_view=True, skip=lookups),
                                                   min_bytes=huge_pages.MIN_BYTES)
        self.sampler = Sampler(self.generator, argmax=self.ops.argmax)
        self.model = model.eval()
        if hasattr(model, "embed_images"):
            self.encoder_cache = EncoderCache(BUDGET_ROWS_PER_BATCHED_TOKEN * self.config.max_num_batched_tokens)
        if engine.enable_lora:
            self.lora = LoRAModelManager(model, model_shape(self.model_config), engine.max_loras,
                                         engine.max_lora_rank, engine.max_cpu_loras, self.device, self.dtype,
                                         self.ops.name)
        self.input_batch = InputBatch(self.block_size, self.config.max_blocks_per_seq, self.device,
                                      self.ops.needs_decode_mask)
        speculative = engine.speculative
        if rank == 0 and speculative is not None:
            if speculative.uses_draft_model:
                # Unsharded on the driver, which holds the whole hidden states after each step.
                self.proposer = build_model_proposer(speculative, self.config.model, model, self.ops, self.device,
                                                     self.dtype, self.config.max_model_len)
                # EAGLE-3 reads some layers' inputs: the target returns them beside its hidden states.
                model.aux_hidden_state_layers = self.proposer.aux_hidden_state_layers
            self.speculator = Speculator(speculative, self.config.max_model_len, self.vocab_size, self.device,
                                         self.generator, self.proposer)
        self.load_seconds = time.perf_counter() - start

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The target's KV cache dtype: the model's, int8 codes with a scale per row (kv_cache_dtype="int8"), or
        float8 e4m3 ("fp8")."""
        return KV_CACHE_TORCH_DTYPES.get(self.config.engine.kv_cache_dtype, self.dtype)

    def kv_bytes_per_block(self) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.kv_cache_dtype)
        # A block holds the draft's keys and values for its positions too (same block tables).
        if self.proposer is not None:
            per_block += kv_bytes_per_block(self.proposer.config, self.block_size, self.dtype)
        return per_block

    def determine_num_kv_blocks(self) -> int:
        """KV blocks that fit the budget (worker/kv_cache.py), + the null block. The budget is kv_cache_memory;
        on CUDA without it, what gpu_memory_utilization leaves after the weights and the peak activations of
        the largest step (measured by running one)."""
        budget = self.config.engine.kv_cache_memory
        if budget is None:
            budget = (profile_cuda_budget(self.model, self.config, self.model_config, self.device, self.dtype)
                      if self.device.type == "cuda" else DEFAULT_CPU_KV_CACHE_BYTES)
        return num_kv_blocks(self.config, self.kv_bytes_per_block(), budget, self.device)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Per layer a key and a value cache of num_blocks blocks, in the layout the ops' attention reads
        (ops/reference.py allocate_kv_caches)."""
        mc = self.model_config
        self.kv_caches = self.ops.allocate_kv_caches(mc.num_hidden_layers, num_blocks, self.block_size,
                                                     mc.num_key_value_heads, mc.head_dim, self.kv_cache_dtype,
                                                     self.device)
        if self.speculator is not None:
            self.speculator.init_kv_cache(num_blocks, self.block_size)
        self.capture_graphs()
        if self.artifacts is not None:
            self.artifacts.close()

    def capture_graphs(self) -> None:
        """After the KV cache exists: on CUDA with the Triton ops, capture a CUDA graph per decode bucket
        (unless enforce_eager or bucketing is off, or the ranks are tensor-parallel)."""
        engine, backend = self.config.engine, self.config.engine.backend
        # Left to the platform: on where it can run (CUDA with the Triton ops); asked for (turned on, or buckets
        # named) where it cannot: the error below.
        bucketing = self.device.type == "cuda" and (self.ops.name == "triton" or backend.sets_buckets())
        if backend.enable_bucketing is not None:
            bucketing = backend.enable_bucketing
        if not bucketing:
            return
        if self.device.type != "cuda" or self.ops.name != "triton":
            raise ValueError("enable_bucketing needs CUDA with the Triton ops (attention_backend 'auto' or "
                             f"'triton'); this engine runs the {self.ops.name!r} ops on {self.device}")
        self.input_batch.context_length_buckets = backend.context_length_buckets
        # EAGLE-3's target returns auxiliary hidden states too: its decode steps run eagerly.
        if engine.enforce_eager or engine.tensor_parallel_size > 1 or self.model.aux_hidden_state_layers:
            return
        # With speculation, verification steps (a token and up to k drafts a request) replay graphs too.
        max_query_len = 1 + (0 if self.speculator is None else self.speculator.k)
        self.graphs = DecodeGraphs(self._forward_tokens, self._token_gen_buckets(), self.config.max_blocks_per_seq,
                                   self.block_size, self.sliding_window, self.device, max_query_len)
        if backend.graph_capture == "start":
            self.graphs.capture()

    def _token_gen_buckets(self) -> list[int]:
        engine = self.config.engine
        buckets = engine.backend.token_gen_buckets or default_token_gen_buckets(engine.max_num_seqs)
        return [b for b in buckets if b <= engine.max_num_seqs] or [engine.max_num_seqs]

    def _forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, metadata)

    def prefetch_lora(self, lora_request: LoRARequest) -> Future | None:
        """The adapter's host copy, read on the LoRA manager's loader thread (None: LoRA off)."""
        return None if self.lora is None else self.lora.prefetch(lora_request)

    def release_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None and state.pooling is not None:
                self.num_pooling_requests -= 1
        if self.lora is not None:
            self.lora.release_requests(request_ids)

    # ---- the step --------------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(scheduler_output)()

    @torch.inference_mode()
    def execute_async(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Launch the step on the device; the returned function waits for it and reads the tokens back.

        Everything copied to the device (inputs, sampling parameters) is copied before the launch: a copy
        from pageable host memory waits for the device's queue, so none may follow the forward pass.
        """
        if self.rehome is not None:  # no step runs now: part of the mapped model moves onto huge pages
            self.rehome.step()
            if self.rehome.finished:
                self.rehome = None
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = self._request_state(new)
            if self.lora is not None:
                self.lora.add_request(new.request_id, new.lora_request)
        for request_id in scheduler_output.preempted_request_ids:
            state = self.requests.get(request_id)
            if state is not None:
                state.draft_resumes = True
        scheduled = scheduler_output.scheduled
        # A graph runs a step whose requests all have the same number of new tokens: one (a decode), or a
        # verification's token and drafts. A vision-language model's steps run eagerly: a one-token chunk may be
        # an image row.
        query_len = scheduled[0].num_new_tokens if scheduled else 0
        previous, self._last_sampled = self._last_sampled, None
        use_graph = (self.graphs is not None and self.graphs.can_run(len(scheduled), query_len)
                     and self.encoder_cache is None and all(item.num_new_tokens == query_len for item in scheduled)
                     and (query_len == 1 or previous is None)
                     and (self.lora is None or not self.lora.any_adapter([item.request_id for item in scheduled])))
        if use_graph:
            items, inputs = scheduled, None
            query_start_loc = list(range(0, (len(items) + 1) * query_len, query_len))
        else:
            items, inputs = self.input_batch.prepare(scheduled, self.sliding_window)
            query_start_loc = inputs.metadata.query_start_loc
            if previous is not None:
                self._fill_placeholders(items, query_start_loc, inputs.input_ids, previous)
        sampling_rows = [i for i, item in enumerate(items) if item.samples and not item.num_draft_tokens]
        speculator = self.speculator
        speculative = None if speculator is None else speculator.prepare(items, query_start_loc, self.requests)
        ids = [items[i].request_id for i in sampling_rows]
        states = [self.requests[request_id] for request_id in ids]
        sampling = sampling_metadata(states, self.vocab_size, self.device) if ids else None
        last_token_index = None
        if ids and len(sampling_rows) != query_start_loc[-1]:  # else: one token per request, each sampling
            last_token_index = to_device([query_start_loc[i + 1] - 1 for i in sampling_rows], torch.long, self.device)

        aux_hidden = None
        images = None
        if use_graph:
            hidden = self._decode_with_graph(scheduled, previous)
        else:
            if self.broadcast_inputs is not None:
                self.broadcast_inputs(inputs)
            images = None
            if self.encoder_cache is not None:
                images, image_hits, image_misses = multimodal_embeddings(
                    items, query_start_loc, lambda request_id: self.requests[request_id].mm_features,
                    self.encoder_cache, self.model.embed_images, self.device)
            with self._lora_step(items, query_start_loc, inputs):
                hidden, aux_hidden = self._split(self.forward(inputs, images))
        if self.hidden_state_sink is not None:
            self.hidden_state_sink(items, query_start_loc, hidden)
        pooled = self._pool(items, query_start_loc, hidden) if self.num_pooling_requests else []
        sampler_output = None
        if ids and scheduler_output.grammar_bitmask is not None:
            # Structured outputs: the masks are filled now, with the forward launched (on CUDA the GPU runs it
            # meanwhile), and applied to the logits before sampling.
            bitmask = scheduler_output.grammar_bitmask()
            if bitmask is not None:
                sampling.token_bitmask = bitmask.for_rows(ids, self.device)
        if ids:
            last_hidden = hidden if last_token_index is None else hidden.index_select(0, last_token_index)
            sampler_output = self.sampler(self.model.compute_logits(last_hidden), sampling)
            if self.async_scheduling:
                self._last_sampled = (sampler_output.sampled_token_ids, {rid: row for row, rid in enumerate(ids)})
        verified = None if speculative is None else speculator.verify(hidden, speculative, self.model.compute_logits)
        # On CUDA the sampled tokens (and logprobs) come back through pinned memory, copied behind this step:
        # reading them waits for this step alone, not for one launched after it (async scheduling).
        readback = None if sampler_output is None else HostCopy(
            [sampler_output.sampled_token_ids] + ([] if sampler_output.logprobs is None else [
                sampler_output.logprob_token_ids, sampler_output.logprobs, sampler_output.sampled_ranks]))

        @torch.inference_mode()
        def finish() -> ModelRunnerOutput:
            output = ModelRunnerOutput()
            if images is not None:
                output.encoder_cache_hits, output.encoder_cache_misses = image_hits, image_misses
            if sampler_output is not None:
                host = readback.wait()
                sampled = host[0].tolist()
                for request_id, state, token_id in zip(ids, states, sampled):
                    if token_id == NONFINITE_TOKEN_ID:
                        output.failed_request_ids.append(request_id)
                        continue
                    output.sampled_token_ids[request_id] = [token_id]
                    state.output_token_ids.append(token_id)
                if sampler_output.logprobs is not None:
                    top_ids, values, ranks = (t.tolist() for t in host[1:])
                    for row, (request_id, state) in enumerate(zip(ids, states)):
                        num = state.sampling_params.logprobs
                        if num is not None and request_id in output.sampled_token_ids:
                            output.logprobs[request_id] = [(top_ids[row][:num + 1], values[row][:num + 1],
                                                            ranks[row])]
            for request_id, vector in pooled:
                output.pooler_output[request_id] = vector.tolist()
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
            if speculator is not None:
                speculator.propose(items, query_start_loc, self.requests, output,
                                   hidden if aux_hidden is None else aux_hidden, self._draft_inputs)
            return output

        return finish

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, multimodal_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [T, H] (and, for EAGLE-3, the auxiliary ones [T, A * H]); every
        tensor-parallel rank runs this on the same inputs. ``multimodal_embeddings``: a vision-language model's
        image rows for this step, (flat token indices [M], rows [M, H])."""
        if multimodal_embeddings is not None:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata,
                              multimodal_embeddings=multimodal_embeddings)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    def _lora_step(self, items: list[ScheduledRequest], query_start_loc: list[int], inputs: ModelInputs
                   ) -> contextlib.AbstractContextManager:
        """Around a forward: the step's adapters in their compute slots and each token's slot (LoRA on)."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.activate([item.request_id for item in items], query_start_loc,
                                  inputs.input_ids.shape[0])

    @staticmethod
    def _split(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return out if isinstance(out, tuple) else (out, None)

    def _draft_inputs(self, items: list[ScheduledRequest], sliding_window: int | None
                      ) -> tuple[list[ScheduledRequest], ModelInputs]:
        """The draft's inputs for its passes: as the target's, never padded to a bucket."""
        return self.input_batch.prepare(items, sliding_window, pad=False)

    def _decode_with_graph(self, items: list[ScheduledRequest],
                           previous: tuple[torch.Tensor, dict[str, int]] | None = None) -> torch.Tensor:
        """A step of n requests with q new tokens each (decodes, or verifications) through the captured graph of
        its bucket and q -> hidden states [n * q, H]. ``previous`` (async scheduling, decodes): the last step's
        sampled tokens, where the placeholder tokens are read."""
        block_size = self.block_size
        block_rows = [item.block_ids for item in items]
        if items[0].num_new_tokens == 1:
            positions = [item.num_computed_tokens for item in items]
            input_ids = [item.token_ids[0] for item in items]
            slot_mapping = [row[p // block_size] * block_size + p % block_size for row, p in zip(block_rows, positions)]
            seq_lens = [p + 1 for p in positions]
        else:
            input_ids, positions, slot_mapping, seq_lens = [], [], [], []
            for item, row in zip(items, block_rows):
                start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
                input_ids.extend(item.token_ids)
                positions.extend(range(start, end))
                slot_mapping.extend(row[p // block_size] * block_size + p % block_size for p in range(start, end))
                seq_lens.append(end)
        sources = None
        if previous is not None and PLACEHOLDER_TOKEN_ID in input_ids:
            rows = previous[1]
            sources = [rows[item.request_id] if token == PLACEHOLDER_TOKEN_ID else -1
                       for item, token in zip(items, input_ids)]
        return self.graphs.run(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, seq_lens=seq_lens,
            block_rows=block_rows, sources=sources, previous=None if sources is None else previous[0])

    def _fill_placeholders(self, items: list[ScheduledRequest], query_start_loc: list[int], input_ids: torch.Tensor,
                           previous: tuple[torch.Tensor, dict[str, int]]) -> None:
        """Async scheduling, a step run eagerly: each placeholder token takes the last step's sampled token of its
        request, on the device."""
        targets, sources = [], []
        for i, item in enumerate(items):
            if item.token_ids[-1 - item.num_draft_tokens] == PLACEHOLDER_TOKEN_ID:
                targets.append(query_start_loc[i] + item.num_new_tokens - 1 - item.num_draft_tokens)
                sources.append(previous[1][item.request_id])
        if targets:
            index = to_device(targets, torch.long, input_ids.device)
            input_ids.index_copy_(0, index, previous[0].to(input_ids.dtype).index_select(
                0, to_device(sources, torch.long, input_ids.device)))

    def _request_state(self, new: NewRequestData) -> RequestState:
        stop_ids = sorted(t for t in new.min_tokens_stop_ids if 0 <= t < self.vocab_size)
        state = RequestState(new.prompt_token_ids, new.sampling_params, stop_ids, mm_features=new.mm_features)
        if new.sampling_params.pooling is not None:
            state.pooling = PoolingState(new.sampling_params.pooling)
            self.num_pooling_requests += 1
        return state

    def _pool(self, items: list[ScheduledRequest], query_start_loc: list[int], hidden: torch.Tensor
              ) -> list[tuple[str, torch.Tensor]]:
        """Embedding requests: each one's rows of this step's hidden states [T, H] added to its pool; the
        embeddings of those whose prompt is now complete (on the device: read back in ``finish``)."""
        done = []
        for i, item in enumerate(items):
            state = self.requests[item.request_id]
            if state.pooling is None:
                continue
            start = query_start_loc[i]
            state.pooling.add(hidden[start:start + item.num_new_tokens], item.num_computed_tokens)
            if item.num_computed_tokens + item.num_new_tokens >= len(state.prompt_token_ids):
                done.append((item.request_id, state.pooling.result(getattr(self.model, "classify", None))))
        return done

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
