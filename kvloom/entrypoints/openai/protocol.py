"""The OpenAI API's request and response bodies, with vLLM's extra sampling fields.

Requests accept unknown fields (ignored, as vLLM does) so newer clients keep working; numbers must
be finite. Ranges that only the engine knows (the context length, the vocabulary) are checked by
the serving layer; the sampling fields are checked again by SamplingParams.
"""

from __future__ import annotations

import time
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from kvloom.loader.tokenizer import CHAT_ROLES

# torch.Generator seeds are 64-bit.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 128  # OpenAI's limit on completions per prompt


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """A null for a field that cannot be null (``"ignore_eos": null``) means its default."""
        if not isinstance(data, dict):
            return data
        nulls = [name for name, value in data.items() if value is None and name in cls.model_fields
                 and not cls.model_fields[name].is_required()
                 and type(None) not in get_args(cls.model_fields[name].annotation)]
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors ---------------------------------------------------------------------------------

class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


# ---- shared ---------------------------------------------------------------------------------

class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (whole blocks)


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class Timings(ResponseModel):
    """llama-server's ``timings``: the prompt's tokens computed (those the prefix cache did not hold) and the
    tokens generated, each with its time. ``cache_n``: prompt tokens served from the prefix cache."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class PromptProgress(ResponseModel):
    """llama-server's ``prompt_progress`` (``return_progress``): the prompt's tokens, those the prefix cache held,
    those in the KV cache so far (the cached ones included), and the milliseconds since its prefill began."""

    total: int
    cache: int
    processed: int
    time_ms: int


class SamplingFields(RequestModel):
    """Sampling fields common to completions and chat: OpenAI's, then vLLM's extras (extra_body)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Accepted for vLLM clients and ignored: it changes only HF's slow tokenizers; kvloom decodes as the fast ones.
    spaces_between_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format ({"type": "text" | "json_object" | "json_schema"}), or
    # vLLM's structured_outputs (one of json, regex, choice, grammar, structural_tag).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's logits processors and prompt logprobs (logit_bias above is OpenAI's: token id -> -100..100).
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    # llama-server's extras: timings on every streamed chunk (the last one has them anyway), and
    # prompt_progress events while a long prompt is prefilled (stream only).
    timings_per_token: bool = False
    return_progress: bool = False


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


# What /openapi.json promises of a chat message; the server checks it itself (serving.py), with messages
# that name the field, so this only documents it.
_MESSAGES_SCHEMA = {"minItems": 1, "items": {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": list(CHAT_ROLES)},
    "content": {"anyOf": [{"type": "string"}, {"type": "array"}, {"type": "null"}]}}}}


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(json_schema_extra=_MESSAGES_SCHEMA)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's extras.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class InfillRequest(SamplingFields):
    """llama-server's ``POST /infill`` body: the code before and after the gap, other files as context, and the text
    already typed after the prefix; llama.cpp's names for the length and the repetition penalty."""

    input_prefix: StrictStr | list[StrictStr | StrictInt]
    input_suffix: StrictStr | list[StrictStr | StrictInt]
    input_extra: list[dict[str, Any]] | None = None
    prompt: StrictStr = ""
    n_predict: int | None = None  # llama.cpp's max_tokens (-1: no limit but the context)
    max_tokens: int | None = None
    repeat_penalty: float | None = None


# ---- completions ----------------------------------------------------------------------------

class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """One token's entry in vLLM's prompt_logprobs (keyed by its token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position, token id -> its logprob (None at the first position).
PromptLogprobsField = list[dict[str, PromptLogprob] | None]


class CompletionResponseChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField | None = None  # vLLM's extra, when the request asked


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    timings: Timings | None = None  # llama-server's


class CompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None
    prompt_progress: PromptProgress | None = None


# ---- chat -----------------------------------------------------------------------------------

class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionLogProb] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(ResponseModel):
    role: str
    content: str | None = None
    # --reasoning-parser: the reply's reasoning (vLLM's and DeepSeek's field name).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsField | None = None  # vLLM's extra, when the request asked
    timings: Timings | None = None  # llama-server's


class ChatCompletionResponseStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None
    prompt_progress: PromptProgress | None = None


# ---- embeddings -----------------------------------------------------------------------------

class EmbeddingRequest(RequestModel):
    """OpenAI's /v1/embeddings body (vLLM's extras: add_special_tokens, normalize / use_activation)."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    use_activation: bool | None = None


class EmbeddingData(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# ---- models, tokenizer ----------------------------------------------------------------------

class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvloom"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """Either a prompt or chat messages (rendered with the chat template)."""

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(ResponseModel):
    prompt: str


# ---- scoring (/score, /v1/score) and reranking (/rerank, /v1/rerank): serving_score.py ----------------------

class ScoreRequest(RequestModel):
    """vLLM's /score body: text_1 scored against text_2 (one text and a list, or two lists of one length)."""

    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    use_activation: bool | None = None  # False: the raw logit instead of its sigmoid
    user: str | None = None


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: StrictStr


class RerankRequest(RequestModel):
    """The rerank body of Jina, Cohere and vLLM: a query, documents (strings or {"text": ...}), top_n (0 or
    unset: every document), return_documents."""

    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: StrictInt | None = None
    return_documents: bool = True
    use_activation: bool | None = None


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(ResponseModel):
    total_tokens: int


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
