"""Speculative decoding: proposers that guess a request's next tokens cheaply, for the target model to
check all at once. Every proposer runs in the model runner after a step's tokens are sampled
(kvloom/worker/speculator.py); the scheduler only carries the drafts into the next step and reserves their
slots. The rejection sampler that keeps the target's distribution exact is kvloom/sample/rejection_sampler.py.

    policy.py       how many drafts a request gets this step (acceptance, one cost model, a batch cutoff)
    ngram.py        n-gram prompt lookup (no model, no torch)
    draft_model.py  a smaller Llama/Mistral with the target's vocabulary
    eagle.py        an EAGLE-1 / EAGLE-3 head fed with the target's hidden states

This package imports nothing from kvloom.worker: the runner hands a draft model the function that builds
its inputs (``draft_model.BuildInputs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kvloom.config import SpeculativeConfig
    from kvloom.loader.model_config import ModelConfig
    from kvloom.ops.table import Ops
    from kvloom.spec_decode.draft_model import DraftModelProposer


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request takes drafts: not when its sampling needs every position's logits in order
    (logprobs, penalties, min_tokens still to reach, a grammar, logit_bias / allowed_token_ids / bad_words).
    One rule for the scheduler and the runner."""
    return not (params.logprobs is not None or params.prompt_logprobs is not None or params.presence_penalty
                or params.frequency_penalty or params.repetition_penalty != 1.0
                or num_output_tokens < params.min_tokens
                # constrained: no drafts (docs/structured_outputs.md)
                or params.structured_outputs is not None or params.has_logits_processors)


def build_model_proposer(speculative: SpeculativeConfig, target_config: ModelConfig, target: nn.Module, ops: Ops,
                         device: torch.device, dtype: torch.dtype, max_model_len: int) -> DraftModelProposer:
    """The model runner's proposer for ``speculative.method`` (draft_model, eagle, eagle3), loaded.

    Imported here, not at the top: the scheduler imports this package (``can_speculate``) and must not
    load torch.
    """
    if speculative.method == "draft_model":
        from kvloom.spec_decode.draft_model import DraftModelProposer as proposer
    else:  # eagle, eagle3
        from kvloom.spec_decode.eagle import EagleProposer as proposer
    return proposer(speculative, target_config, target, ops, device, dtype, max_model_len)
