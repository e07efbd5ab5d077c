"""Speculative decoding in the model runner: verify this step's drafts, then propose the next step's.

vLLM V1's shape: every proposer runs here, after the step's tokens are sampled; the scheduler only carries
the drafts (``ModelRunnerOutput.draft_token_ids``) into the next step, reserves their slots and rolls
``num_computed_tokens`` back past the rejected ones. A step:

    before the launch   ``prepare``: the rows of each speculated request's last known token and its drafts
    after the forward   ``verify``: the target's logits at those rows -> rejection sampling (on the device)
    after the readback  ``propose``: each request that sampled updates its acceptance, the policy gives it
                        0 .. k drafts (spec_decode/policy.py), and the proposer drafts them: n-gram lookup
                        in its tokens, or a draft model / EAGLE head over the tokens it kept
                        (worker/draft_kv.py: its KV lags for the requests given none)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kvloom.config import SpeculativeConfig
from kvloom.loader.model_config import ModelConfig
from kvloom.ops.table import Ops
from kvloom.sample.rejection_sampler import RejectionOutput, greedy_rejection_sample, rejection_sample
from kvloom.sample.sampler import Sampler, SamplingMetadata
from kvloom.spec_decode.draft_model import BuildInputs, DraftModelProposer
from kvloom.spec_decode.eagle import EagleProposer
from kvloom.spec_decode.ngram import NgramProposer
from kvloom.spec_decode.policy import FIXED_TOKENS, FIXED_TOKENS_CUDA, SpeculationPolicy, can_speculate
from kvloom.step_io import ModelRunnerOutput, ScheduledRequest
from kvloom.worker.draft_kv import DraftKV
from kvloom.worker.input_batch import RequestState, generator_for, sampling_metadata


def build_model_proposer(speculative: SpeculativeConfig, target_config: ModelConfig, target: nn.Module, ops: Ops,
                         device: torch.device, dtype: torch.dtype, max_model_len: int) -> DraftModelProposer:
    """The runner's proposer for ``speculative.method`` (draft_model, eagle, eagle3), loaded."""
    proposer = DraftModelProposer if speculative.method == "draft_model" else EagleProposer
    return proposer(speculative, target_config, target, ops, device, dtype, max_model_len)


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


class Speculator:
    """One runner's speculation: ``proposer`` is the draft model / EAGLE head (None for n-gram lookup)."""

    def __init__(self, speculative: SpeculativeConfig, max_model_len: int, vocab_size: int, device: torch.device,
                 generator: torch.Generator, proposer: DraftModelProposer | None = None) -> None:
        self.k = speculative.num_speculative_tokens
        self.vocab_size = vocab_size
        self.device = device
        self.generator = generator
        self.proposer = proposer
        self.ngram = None if proposer is not None else NgramProposer(
            self.k, speculative.prompt_lookup_max, speculative.prompt_lookup_min)
        self.policy = SpeculationPolicy(self.k, speculative.disable_by_batch_size,
                                        FIXED_TOKENS_CUDA if device.type == "cuda" else FIXED_TOKENS)
        # No drafts at or past this position (the draft's own context length).
        self.max_model_len = min(speculative.max_model_len or max_model_len, max_model_len)
        self.draft_kv: DraftKV | None = None  # with the KV cache

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        if self.proposer is not None:
            self.proposer.init_kv_cache(num_blocks, block_size)
            self.draft_kv = DraftKV(self.proposer, num_blocks, block_size)

    def prepare(self, items: list[ScheduledRequest], query_start_loc: list[int], states: dict[str, RequestState]
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
        request_states = [states[request_id] for request_id in ids]
        greedy = [state.sampling_params.greedy for state in request_states]
        batch = SpeculativeBatch(
            request_ids=ids, states=request_states, max_k=max_k,
            positions=torch.tensor(positions, device=device), padded=torch.tensor(padded, device=device),
            draft_token_ids=torch.tensor(drafts, dtype=torch.long, device=device),
            num_drafts=torch.tensor(counts, dtype=torch.long, device=device),
            greedy=torch.tensor(greedy, device=device))
        if not all(greedy):
            # Every position of a request samples with its parameters: one metadata row per position.
            expanded = [state for state in request_states for _ in range(max_k + 1)]
            batch.metadata = sampling_metadata(expanded, self.vocab_size, device)
            batch.greedy_positions = batch.greedy.repeat_interleave(max_k + 1)
            batch.generators = {row: g for row, state in enumerate(request_states)
                                if (g := generator_for(state, device))}
        return batch

    def verify(self, hidden: torch.Tensor, batch: SpeculativeBatch,
               compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> RejectionOutput:
        """Score every draft with the target's logits and keep what rejection sampling allows (on the device)."""
        # The LM head runs on the real positions only [R, V]: with k_eff varying across the batch, padding every
        # request to the longest would multiply its cost (at batch 64 on the CPU it is ~1/5 of a step).
        logits = compute_logits(hidden.index_select(0, batch.positions)).float()
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
                                max_drafts=self.k)

    def propose(self, items: list[ScheduledRequest], query_start_loc: list[int], states: dict[str, RequestState],
                output: ModelRunnerOutput, hidden: torch.Tensor, build_inputs: BuildInputs) -> None:
        """Each request that sampled: its acceptance updated, then its drafts for the next step into
        ``output.draft_token_ids``. ``hidden``: the target's hidden states of this step [T, H] (EAGLE-3:
        the auxiliary ones), which an EAGLE head reads."""
        num_drafts: dict[str, int] = {}
        batch_size = len(items)
        for item in items:
            new_tokens = output.sampled_token_ids.get(item.request_id)
            if not new_tokens:
                continue
            state = states[item.request_id]
            state.acceptance.forget()
            if item.num_draft_tokens:
                state.acceptance.observe(item.num_draft_tokens, len(new_tokens) - 1)
            params = state.sampling_params
            if not can_speculate(params, len(state.output_token_ids)):
                continue
            # Not past the draft's context length; the scheduler cuts them to the output limit and the budget
            # (a draft model's guesses also stop at the slots it reserved).
            room = self.max_model_len - state.num_tokens
            k = min(room, self.policy.num_drafts(state.acceptance, batch_size, params.seed is not None))
            if k > 0:
                num_drafts[item.request_id] = k
        if self.ngram is not None:
            for request_id, k in num_drafts.items():
                state = states[request_id]
                if state.ngram_index is None:
                    state.ngram_index = self.ngram.new_index()
                drafts = state.ngram_index.lookup(state.token_slice(0, state.num_tokens), k)
                if drafts:
                    output.draft_token_ids[request_id] = drafts
            return
        requests, target_hidden = self.draft_kv.draft_requests(items, query_start_loc, states, output, num_drafts,
                                                               hidden)
        if requests:
            output.draft_token_ids = self.proposer.propose(requests, target_hidden, build_inputs)
