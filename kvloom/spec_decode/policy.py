"""Which requests take drafts (``can_speculate``), and how many a request gets this step: 0 ..
``num_speculative_tokens``. No torch: the scheduler reads ``can_speculate`` too.

The model runner asks this after each step, for every request that sampled, before a proposer runs; the
answer is how many tokens the proposer drafts for it (a request given 0 costs no lookup and no draft pass).
Three parts, nothing else:

1. **Per-request acceptance.** ``Acceptance.rate``: the chance that a draft holds once the one before it
   did, a ratio of the request's accepted drafts to the drafts the target tried (a step with ``k`` drafts
   that accepts ``m`` tried ``min(m + 1, k)``), with the prior ``PRIOR_RATE`` weighing ``PRIOR_TRIES`` tries.
   Every step the request samples, old counts are scaled by ``DECAY``, drafted or not: the rate follows the
   last ~10 steps, and a request that stopped drafting drifts back to the prior until it is tried again
   (that is how a request whose text turns repetitive gets drafts again). So ``rate ** j`` is the chance that
   drafts 1 .. j all hold: what draft ``j`` adds, in expected tokens.

2. **One cost model.** A decode step of ``n`` requests, one token each, takes ``c * (FIXED_TOKENS + n)``:
   the weights' read, worth ``FIXED_TOKENS`` tokens, plus ``c`` for each token verified. A draft adds ``c``
   to the step, during which the batch would have made ``n / (FIXED_TOKENS + n)`` tokens. So draft ``j``
   pays when

       rate ** j  >  threshold(n) = n / (FIXED_TOKENS + n)

   With ``FIXED_TOKENS`` = 8 (the CPU): 0.11 at batch 1 (a request at the prior drafts 4), 0.5 at batch 8
   (1 draft at the prior), 0.89 at batch 64: above the prior, so a large batch drafts only for the requests
   whose drafts have kept holding (a rate earned while the batch was smaller). On a GPU
   (``FIXED_TOKENS_CUDA`` = 64): 0.015 at batch 1 (up to 8 drafts at the prior), 0.5 at batch 64.
   A draft model's or EAGLE head's own passes are not priced: pick a drafter much smaller than the target,
   and set ``disable_by_batch_size`` where its passes still cost too much.

3. **A batch-size cutoff.** ``disable_by_batch_size`` (vLLM's key): no drafts while that many requests or more
   share the step.

A request with a ``seed`` is priced as if alone in the batch: its drafts, and so its random draws, do not
depend on what shares the batch, so neither do its tokens (unless ``disable_by_batch_size`` cuts them).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvloom.sampling_params import SamplingParams

# A decode step's fixed cost (reading the weights) in verified tokens' worth. On the CPU a step is
# memory-bound up to ~8 tokens (the GEMM reads each weight panel once per 8 rows): ~10 ms at batch 1,
# ~1 ms for each further token past that.
FIXED_TOKENS = 8.0
# On a GPU a step's fixed cost is far larger against its per-token cost: at small batches a step (a captured
# graph, also for verification: worker/graphs.py) takes about as long with 1 token a request as with 8.
FIXED_TOKENS_CUDA = 64.0
# The acceptance rate a request starts from, and how many tries that prior weighs.
PRIOR_RATE = 0.6
PRIOR_TRIES = 2.0
# Each step a request samples, its counts are scaled by this: the rate follows about the last 10 steps.
DECAY = 0.9



def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request takes drafts: not when its sampling needs every position's logits in order
    (logprobs, penalties, min_tokens still to reach, a grammar, logit_bias / allowed_token_ids / bad_words).
    One rule for the scheduler and the runner."""
    return not (params.logprobs is not None or params.prompt_logprobs is not None or params.presence_penalty
                or params.frequency_penalty or params.repetition_penalty != 1.0
                or num_output_tokens < params.min_tokens
                # constrained: no drafts (docs/structured_outputs.md)
                or params.structured_outputs is not None or params.has_logits_processors)


@dataclass
class Acceptance:
    """How a request's drafts have fared: discounted counts of drafts tried and accepted."""

    tried: float = 0.0
    accepted: float = 0.0

    @property
    def rate(self) -> float:
        """The chance that a draft holds once the one before it did."""
        return (self.accepted + PRIOR_RATE * PRIOR_TRIES) / (self.tried + PRIOR_TRIES)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """The target checked ``num_drafts`` drafts and kept the first ``num_accepted``."""
        self.tried += min(num_accepted + 1, num_drafts)
        self.accepted += num_accepted

    def forget(self) -> None:
        """One step older: the counts so far weigh ``DECAY`` as much."""
        self.tried *= DECAY
        self.accepted *= DECAY


class SpeculationPolicy:
    """``num_drafts``: how many drafts a request gets this step. ``adaptive = False`` gives every request
    ``num_speculative_tokens`` at every step (tests, and ``benchmarks/speculative.py --fixed-k``)."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None = None,
                 fixed_tokens: float = FIXED_TOKENS) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.fixed_tokens = fixed_tokens
        self.adaptive = True

    def threshold(self, batch_size: int) -> float:
        """The expected tokens a draft must add to pay for itself in a step of ``batch_size`` requests."""
        return batch_size / (self.fixed_tokens + batch_size)

    def num_drafts(self, acceptance: Acceptance, batch_size: int, seeded: bool = False) -> int:
        if self.disable_by_batch_size is not None and batch_size >= self.disable_by_batch_size:
            return 0
        if seeded:
            batch_size = 1
        if not self.adaptive:
            return self.k
        rate, threshold = acceptance.rate, self.threshold(batch_size)
        chance, k = rate, 0
        while k < self.k and chance > threshold:
            k += 1
            chance *= rate
        return k
