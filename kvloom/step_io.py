"""Plain data across the engine / runner seam: what a step computes, and what it sampled.

    Scheduler ──SchedulerOutput──> Executor ─> ModelRunner ──ModelRunnerOutput──> engine

Both sides import this module and it imports neither (nor torch): the runner never sees a live
``Request``, and what it keeps of a request (prompt, sampling parameters, the tokens it sampled, a
seeded generator) it keeps by request id from ``NewRequestData``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvloom.lora.request import LoRARequest
from kvloom.sampling_params import SamplingParams

# Async scheduling: a scheduled token the previous step is still sampling; the runner takes it from that step's
# output on the device.
PLACEHOLDER_TOKEN_ID = -1

# (token ids, logprobs, rank of the first id): column 0 is the sampled/actual token, then the top-k.
LogprobsRow = tuple[list[int], list[float], int]


@dataclass(frozen=True)
class NewRequestData:
    """Sent on the step that first schedules a request; the runner keeps it until the request ends."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Masked out of the logits while fewer than min_tokens were generated: EOS and the stop ids.
    min_tokens_stop_ids: frozenset[int] = frozenset()
    # A vision-language prompt's images (kvloom.multimodal.inputs.ImageFeature): where each one's rows go and
    # its preprocessed tiles; the runner encodes them (or finds them in its encoder cache) as chunks reach them.
    mm_features: tuple[Any, ...] = ()
    # The LoRA adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None


class ScheduledRequest(NamedTuple):
    """One request's share of a step: compute ``token_ids`` at positions num_computed_tokens onwards.

    ``block_ids`` is the request's whole block table (its cache slots). ``samples`` is True when the
    step reaches the request's last known token (and its drafts), so new tokens come out of it. (A named tuple: one
    is made per request per step, and it is cheaper to build than a frozen dataclass.)
    """

    request_id: str
    num_computed_tokens: int
    token_ids: list[int]
    block_ids: list[int]
    samples: bool
    # Speculative decoding: the last num_draft_tokens of token_ids are proposed, not yet accepted; the
    # runner scores them all and returns the accepted ones plus one token of its own.
    num_draft_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    # Structured outputs: the function that fills the token bitmask of the constrained requests that sample this
    # step (-> kvloom.structured_output.GrammarBitmask; typed loosely, this module holds no torch), which the runner
    # calls once the step's forward is launched.
    grammar_bitmask: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Per request that sampled: its new token ids (one each today; a speculative step may accept several),
    a logprobs row per new token where asked, and the rows of prompt logprobs computed this step.
    ``failed_request_ids``: requests whose logits held a NaN or an infinity; they sampled nothing
    (no entry in ``sampled_token_ids``) and the engine must end them with an error.
    ``draft_token_ids``: with speculative decoding, the runner's drafts to follow each request's new tokens
    (every proposer runs in the runner), for the scheduler to have the target check them next step."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[LogprobsRow]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobsRow]] = field(default_factory=dict)
    failed_request_ids: list[str] = field(default_factory=list)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Images this step needed: found in the runner's encoder cache (by content hash), or encoded.
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    # Embedding requests whose prompt this step finished: the pooled vector (kvloom/pooling.py) as floats.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
