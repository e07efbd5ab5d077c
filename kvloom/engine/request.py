"""Request: one sequence's state as the scheduler sees it (token ids, progress, blocks)."""

from __future__ import annotations

import enum
import time
from typing import Any

from kvloom.sampling_params import SamplingParams


class ContextLengthError(ValueError):
    """A prompt and its completion that do not fit in the model's context (the one message for it)."""

    def __init__(self, max_model_len: int, num_prompt_tokens: int, num_output_tokens: int,
                 prompt_name: str = "prompt") -> None:
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        super().__init__(self.message(prompt_name))

    def message(self, prompt_name: str = "prompt") -> str:
        """vLLM's wording; ``prompt_name`` is what the prompt was given as ("prompt", "messages")."""
        return (f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {self.num_prompt_tokens + self.num_output_tokens} tokens "
                f"({self.num_prompt_tokens} in the {prompt_name}, {self.num_output_tokens} in the "
                f"completion). Please reduce the length of the {prompt_name} or completion.")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the model's logits held NaN or inf: nothing it sampled could be trusted

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """A single sequence to generate. Parallel sampling (n > 1) makes one Request per completion.

    The scheduler's one rule: close the gap between ``num_computed_tokens`` and ``num_tokens``.
    A new request's gap is its prompt (minus prefix-cache hits); a decoding request's gap is the
    token sampled last step; after preemption the gap is everything again.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | None = None,
        max_model_len: int | None = None,
        arrival_time: float | None = None,
        mm_features: tuple[Any, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set() if sampling_params.ignore_eos else set(eos_token_ids or ())
        self.max_model_len = max_model_len
        # Output tokens allowed: max_tokens, and never past max_model_len (both fixed: settled once, read each step).
        limit = sampling_params.max_tokens
        room = (max_model_len - len(prompt_token_ids)) if max_model_len else None
        self.max_tokens = (room if room is not None else 1 << 30) if limit is None else (
            limit if room is None else min(limit, room))
        # Choosing its next token reads the tokens so far (penalties, bad words): async scheduling waits for them.
        self.reads_its_tokens = bool(sampling_params.presence_penalty or sampling_params.frequency_penalty
                                     or sampling_params.repetition_penalty != 1.0 or sampling_params.bad_words)
        self.arrival_time = time.time() if arrival_time is None else arrival_time

        # A vision-language prompt's images (kvloom.multimodal.inputs.ImageFeature); the prefix cache names
        # the blocks they cover by their content hashes.
        self.mm_features = mm_features
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Async scheduling: tokens a step in flight is sampling (scheduled, not known yet): 0 or 1.
        self.num_pending_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        # KV cache state, owned by the KVCacheManager.
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0  # leading blocks already named in the prefix cache
        self.first_scheduled_time: float | None = None
        # Drafts the model runner proposed after the last step (any method), for the next one.
        self.spec_token_ids: list[int] = []
        # Structured outputs: its grammar and matcher (structured_output/manager.py's
        # StructuredOutputRequest; not imported here, which must stay free of torch); None: unconstrained.
        self.structured_output: Any = None
        # Its LoRA adapter (kvloom.lora.request.LoRARequest; None: the base model): the scheduler counts the
        # distinct ones a step holds, and the prefix cache keys its blocks on it.
        self.lora_request: Any = None
        # The text, logprobs and timings of the output live in the engine's OutputProcessor.

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def needs_last_token(self) -> bool:
        """Whether choosing its next token reads the last one's value: a grammar's mask, penalties and bad words
        read the tokens, min_tokens counts them (async scheduling cannot run such a request ahead of it)."""
        return (self.reads_its_tokens or self.structured_output is not None
                or len(self.output_token_ids) < self.sampling_params.min_tokens)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Token-level stop checks after a new token; sets status and stop_reason. True if done.

        Stop strings are checked on the detokenized text, by the OutputProcessor.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        num_output_tokens = len(self.output_token_ids)
        if num_output_tokens >= params.min_tokens:
            if last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.all_stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
