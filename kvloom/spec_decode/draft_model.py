"""Draft-model speculation: a smaller Llama/Mistral with the target's vocabulary guesses the next k tokens.

The model runner owns the proposer and calls ``propose`` after each step, once the target's tokens are
sampled. The draft keeps its own paged KV cache, in the same block layout as the target's and indexed by
the same block tables: one KV cache manager, and a block holds the target's and the draft's keys and values
for its positions. So whatever the manager does to a block (prefix-cache hit, eviction, preemption) it does
to both (whether a block's draft KV is complete is the runner's to know, below). After each step:

    target step        positions [s, s + n) computed; the rejected drafts' tail is dropped: n_valid kept
    draft first pass   the same kept tokens at [s, s + n_valid), then the new token at s + n_valid
                       -> the first guess (argmax of its logits)
    draft steps 2..k   each guess fed back at the next position -> the next guess

A request the policy gives no drafts (spec_decode/policy.py) is left out of the passes:
its draft KV lags, and its next first pass starts where the draft's KV ends (the runner's
``draft_computed``), over every token since. A request that never drafts (most of them in a large batch,
where a draft rarely pays) never runs the draft at all: at 64 sequences on this CPU an EAGLE head's passes
over every token took ~3.5% of the run. EAGLE keeps the target's hidden states of the lagging tokens for its
catch-up (hidden size x 2 bytes a token, x3 for EAGLE-3's three layers); past ``MAX_DRAFT_LAG`` of them it
catches up anyway. A block filled while the draft lagged holds no draft KV, so the runner tracks, per block,
whether its draft KV is complete (kvloom/worker/draft_kv.py): a request whose prefix-cache hit starts
with incomplete blocks starts its draft KV at the first of them (a draft model runs over the tokens from
there; an EAGLE head, which would need the target's hidden states of positions it never computed, guesses
only once the request that filled those blocks has completed them, and drafts no more for it after
``MAX_DRAFT_LAG`` tokens without). Once up to date the draft's KV is valid wherever the target's is (and
one past). The guesses' own KV sits in
slots past the request's tokens, which the scheduler reserves (``num_lookahead_tokens``); a rejected guess's
slot is simply written again later, as the target's is. Guesses are greedy (argmax), so the rejection
sampler treats each as a one-hot draft distribution: sampled requests still get exactly the target's
distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kvloom.config import SpeculativeConfig
from kvloom.layers.quantization import finish_int8, quantize_as_read
from kvloom.loader.model_config import ModelConfig
from kvloom.loader.weights import iter_weights, load_model_config, resolve_model
from kvloom.models.registry import build_model, process_weights_after_loading
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.table import Ops
from kvloom.platform import default_dtype
from kvloom.step_io import ScheduledRequest

# An EAGLE head's KV is brought up to date once it lags this many tokens, though its request proposes no
# drafts: the target's hidden-state rows waiting for it stay bounded (SmolLM2-135M: 0.6 MB a request, an
# 8B model's 4096-wide rows 4 MB). A draft model, which needs only the tokens, lags without bound.
MAX_DRAFT_LAG = 512


class StepInputs(Protocol):
    """What a draft pass reads of the inputs the runner builds (the worker's ``ModelInputs``)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata


# (scheduled items, sliding window) -> (the items in the order of the inputs' rows, the inputs): the runner's
# input preparation, handed in so that this package never imports the worker.
BuildInputs = Callable[[list[ScheduledRequest], "int | None"], tuple[list[ScheduledRequest], StepInputs]]


@dataclass
class DraftRequest:
    """One scheduled request's share of the draft's work after a target step."""

    request_id: str
    start: int  # the position of token_ids[0] (the step's first)
    # The tokens at positions start .. start + num_valid: the ones the target computed and kept this step,
    # then the one after them (the new token it sampled, or a prefill chunk's next prompt token).
    token_ids: list[int]
    num_valid: int
    block_ids: list[int]  # the request's block table, lookahead slots included
    # The rows of positions start .. start + num_valid - 1 in the target's hidden states handed to propose
    # (EAGLE reads them; a draft model does not).
    hidden_rows: list[int]
    max_drafts: int  # 0: only bring the draft's KV up to date


class DraftModelProposer:
    """Proposes with a separate draft model (``speculative_config`` method ``draft_model``)."""

    # EAGLE-3 reads these layers' inputs from the target (none here).
    aux_hidden_state_layers: tuple[int, ...] = ()
    # EAGLE reads the target's hidden states (a draft model only its tokens).
    reads_hidden_states = False

    def __init__(self, speculative: SpeculativeConfig, target_config: ModelConfig, target: nn.Module, ops: Ops,
                 device: torch.device, dtype: torch.dtype, max_model_len: int) -> None:
        self.k = speculative.num_speculative_tokens
        self.device = device
        self.dtype = dtype
        self.ops = ops
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0  # set with the KV cache
        self.config, self.model = self._load(speculative, target_config, target)
        # The draft writes no KV at or past this position (its context length, speculative_max_model_len).
        self.max_position = min(max_model_len, self.config.max_position_embeddings,
                                speculative.max_model_len or max_model_len)
        self.sliding_window = self.config.sliding_window

    def _load(self, speculative: SpeculativeConfig, target_config: ModelConfig, target: nn.Module
              ) -> tuple[ModelConfig, nn.Module]:
        source = resolve_model(speculative.model)
        config = load_model_config(source)
        if config.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model {speculative.model!r} has a vocabulary of "
                             f"{config.vocab_size} tokens, the target model {target_config.vocab_size}; a draft "
                             f"model must share the target's vocabulary (the same tokenizer)")
        with default_dtype(self.dtype), torch.device(self.device):
            model = build_model(config, self.ops)
        if speculative.quantization == "int8":
            model.load_weights(quantize_as_read(iter_weights(source), lm_head=False))
            finish_int8(model, lm_head=False)
        else:
            model.load_weights(iter_weights(source))
        process_weights_after_loading(model, self.ops)
        return config, model.eval()

    # ---- the KV cache: the same blocks as the target's -------------------------------------
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Per draft layer a key and a value cache of num_blocks blocks, in the layout the ops' attention reads."""
        config = self.config
        self.block_size = block_size
        self.kv_caches = self.ops.allocate_kv_caches(config.num_hidden_layers, num_blocks, block_size,
                                                     config.num_key_value_heads, config.head_dim, self.dtype,
                                                     self.device)

    # ---- proposing -------------------------------------------------------------------------
    def first_pass(self, request: DraftRequest) -> tuple[list[int], list[int]]:
        """(tokens from position ``start`` on, rows of the target's hidden states for them) of the first
        pass: the kept tokens, and the new one when proposing (its KV is then needed for the next guess)."""
        count = request.num_valid + (1 if request.max_drafts else 0)
        return request.token_ids[:count], []

    def forward(self, inputs: StepInputs, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden states for the logits [T, H], hidden states fed to the next step [T, H])."""
        out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        return out, out

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy guesses [N] (token ids of the target's vocabulary) from hidden states [N, H]."""
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], target_hidden: torch.Tensor | None,
                build_inputs: BuildInputs) -> dict[str, list[int]]:
        """Run the first pass over every request's kept tokens, then feed the guesses back one position at a
        time; returns each proposing request's guesses. ``target_hidden``: the target's hidden states of
        this step [T, H] (EAGLE-3: the auxiliary ones; read by EAGLE only)."""
        items: list[ScheduledRequest] = []
        rows: dict[str, list[int]] = {}
        num_drafts: dict[str, int] = {}
        for request in requests:
            tokens, hidden_rows = self.first_pass(request)
            count = min(len(tokens), self.max_position - request.start)
            if count <= 0:
                continue
            last = request.start + count - 1
            if request.max_drafts and count == len(tokens):
                # Guess j is fed back at position last + j: only where a slot is reserved and the draft reaches.
                limit = min(len(request.block_ids) * self.block_size, self.max_position)
                wanted = min(request.max_drafts, limit - last)
                if wanted > 0:
                    num_drafts[request.request_id] = wanted
            items.append(ScheduledRequest(request.request_id, request.start, tokens[:count], request.block_ids,
                                          samples=True))
            rows[request.request_id] = hidden_rows[:count]
        if not items:
            return {}
        items, inputs = build_inputs(items, self.sliding_window)
        hidden_in = None
        if self.reads_hidden_states:
            order = [row for item in items for row in rows[item.request_id]]
            hidden_in = self.combine_hidden_states(
                target_hidden.index_select(0, torch.tensor(order, dtype=torch.long, device=self.device)))
        logits_hidden, next_hidden = self.forward(inputs, hidden_in)

        starts = inputs.metadata.query_start_loc
        proposing = [(i, item) for i, item in enumerate(items) if item.request_id in num_drafts]
        if not proposing:
            return {}
        last_rows = torch.tensor([starts[i + 1] - 1 for i, _ in proposing], dtype=torch.long, device=self.device)
        tokens = self.next_tokens(logits_hidden.index_select(0, last_rows))
        carried = next_hidden.index_select(0, last_rows)
        active = [item for _, item in proposing]
        drafts: dict[str, list[int]] = {item.request_id: [] for item in active}
        positions = {item.request_id: item.num_computed_tokens + item.num_new_tokens for item in active}
        for step in range(1, max(num_drafts.values()) + 1):
            token_list = tokens.tolist()  # waits for the pass
            for item, token in zip(active, token_list):
                drafts[item.request_id].append(token)
            keep = [j for j, item in enumerate(active) if num_drafts[item.request_id] > step]
            if not keep:
                break
            steps = [ScheduledRequest(active[j].request_id, positions[active[j].request_id] + step - 1,
                                      [token_list[j]], active[j].block_ids, samples=True) for j in keep]
            _, inputs = build_inputs(steps, self.sliding_window)
            # build_inputs sorts decodes first: every item here is one token, so the order is kept.
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            logits_hidden, carried = self.forward(inputs, carried.index_select(0, index))
            tokens = self.next_tokens(logits_hidden)
            active = [active[j] for j in keep]
        return drafts
