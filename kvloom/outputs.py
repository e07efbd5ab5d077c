"""What generate() returns: vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class PromptProgress:
    """How far a request's prompt has been computed, after a prefill chunk (llama-server's prompt_progress): the
    prompt's tokens, those the prefix cache held, those in the KV cache now (the cached included), and the
    milliseconds since the request was first scheduled."""

    total: int
    cache: int
    processed: int
    time_ms: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # With EngineRequest.return_progress: the prompt's progress after this step's prefill chunk (an output with no
    # new tokens may carry only this).
    prompt_progress: PromptProgress | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one (vLLM's ``RequestOutput.add``).

        ``aggregate``: the outputs are deltas (``RequestOutputKind.DELTA``), so each completion's
        new text, token ids and logprobs are appended to this one's; otherwise the newer completion
        replaces the older. A completion this output lacks (n > 1) is added.
        """
        self.finished = next_output.finished
        if next_output.metrics is not None:  # a progress-only output carries none
            self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.prompt_progress is not None:
            self.prompt_progress = next_output.prompt_progress
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        for next_completion in next_output.outputs:
            for i, completion in enumerate(self.outputs):
                if completion.index != next_completion.index:
                    continue
                if aggregate:
                    completion.text += next_completion.text
                    completion.token_ids = [*completion.token_ids, *next_completion.token_ids]
                    if next_completion.logprobs is not None:
                        completion.logprobs = [*(completion.logprobs or []), *next_completion.logprobs]
                    completion.cumulative_logprob = next_completion.cumulative_logprob
                    completion.finish_reason = next_completion.finish_reason
                    completion.stop_reason = next_completion.stop_reason
                else:
                    self.outputs[i] = next_completion
                break
            else:
                self.outputs.append(next_completion)


def pooler_output(output: RequestOutput, what: str) -> list[float]:
    """The pooled row a finished pooling request's RequestOutput carries (extra["pooler_output"]); ``what`` names it
    in the error where it has none."""
    row = output.extra.get("pooler_output")
    if row is None:
        raise ValueError(f"request {output.request_id} finished without {what}")
    return list(row)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's name): a list of floats, hidden_size long (or ``dimensions``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's fields): ``outputs.embedding`` is the vector."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True

    @staticmethod
    def from_request_output(output: RequestOutput) -> EmbeddingRequestOutput:
        """The embedding a finished RequestOutput of an embedding request carries (extra["pooler_output"])."""
        vector = pooler_output(output, "an embedding")
        return EmbeddingRequestOutput(output.request_id, EmbeddingOutput(vector),
                                      list(output.prompt_token_ids), output.num_cached_tokens, output.finished)


@dataclass
class ClassificationOutput:
    """One prompt's label scores (vLLM's name): probabilities (a softmax, or a sigmoid for one label)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What ``LLM.classify`` returns per prompt (vLLM's fields): ``outputs.probs`` are the label scores."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True

    @staticmethod
    def from_request_output(output: RequestOutput) -> ClassificationRequestOutput:
        """The label scores a finished RequestOutput of a classification request carries (extra["pooler_output"])."""
        scores = pooler_output(output, "label scores")
        return ClassificationRequestOutput(output.request_id, ClassificationOutput(scores),
                                           list(output.prompt_token_ids), output.num_cached_tokens, output.finished)


@dataclass
class ScoringOutput:
    """One pair's relevance (vLLM's name): the classifier's one label through a sigmoid, in (0, 1)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's fields): ``outputs.score`` is the pair's score."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True

    @staticmethod
    def from_request_output(output: RequestOutput) -> ScoringRequestOutput:
        """The score a finished RequestOutput of a one-label classification request carries."""
        classified = ClassificationRequestOutput.from_request_output(output)
        return ScoringRequestOutput(classified.request_id, ScoringOutput(classified.outputs.probs[0]),
                                    classified.prompt_token_ids, classified.num_cached_tokens, classified.finished)
