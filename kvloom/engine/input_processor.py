"""The one way into the engine: a prompt and its SamplingParams, tokenized and validated once.

``LLM.generate`` / ``LLM.chat``, ``LLMEngine.add_request``, ``EngineClient.generate`` (AsyncLLM and
the data-parallel router) and the OpenAI server all turn what they were given into an
``EngineRequest`` here (``engine_request``, or ``process`` for a caller with its own id scheme);
``LLMEngine.add_request`` queues it without looking at the prompt again. A prompt is text, token
ids, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``; a chat is rendered to text by its
caller first (the template writes any BOS it wants, so it is tokenized with
``add_special_tokens=False``).

Everything that is wrong with a request is a ``ValueError`` saying what was wrong and what is
allowed: a prompt that is empty, not valid Unicode or holds ids outside the vocabulary; parameters
the vocabulary cannot honour; a prompt and completion that do not fit in the context
(``ContextLengthError``, one message wherever it is raised) or that the whole KV cache could never
hold. The processor reads only the tokenizer and fixed limits, so the server may call it on its
event loop while the engine thread steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvloom.loader.tokenizer import Tokenizer
from kvloom.lora.request import LoRARequest
from kvloom.multimodal.processor import MultiModalProcessor
from kvloom.sampling_params import SamplingParams, StructuredOutputsParams

PromptInput = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class TokenizedPrompt:
    """A checked prompt: its text (None when it came as token ids) and its token ids."""

    text: str | None
    token_ids: tuple[int, ...]
    # A vision-language prompt's images (kvloom.multimodal.inputs.ImageFeature), in prompt order.
    mm_features: tuple[Any, ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    """A request ready for the engine: tokenized and validated, never changed afterwards.

    ``sampling_params`` is the caller's object; the engine reads it and never writes to it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    arrival_time: float
    mm_features: tuple[Any, ...] = ()
    lora_request: LoRARequest | None = None  # None: the base model
    # Streamed outputs also after each prefill chunk, carrying RequestOutput.prompt_progress (llama-server's
    # return_progress); not for FINAL_ONLY outputs.
    return_progress: bool = False
    # The chat template's enable_thinking: false, a reasoning parser's gate puts the reply in its content from the
    # first token (the grammar of a structured output applies at once), whatever the prompt's tags say.
    enable_thinking: bool = True


class InputProcessor:
    """Tokenizes and validates requests against one engine's tokenizer, vocabulary and limits."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 check_fits: Callable[[int, int | None, bool], None],
                 check_structured_outputs: Callable[[StructuredOutputsParams], None] | None = None,
                 multimodal: MultiModalProcessor | None = None) -> None:
        """``check_fits(num_prompt_tokens, max_tokens, max_tokens_must_fit)``: the scheduler's
        refusal of a request that could never be scheduled (context length, whole KV cache).
        ``check_structured_outputs``: the grammar backend's check of a constraint (it starts its compile
        too); None: constraints are refused."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.check_fits = check_fits
        self.check_structured_outputs = check_structured_outputs
        # A vision-language model's image processing (None: a text model, whose prompts take no images).
        self.multimodal = multimodal
        # The engine's check of a LoRARequest (kvloom/lora/registry.py), set by the engine; None: refused.
        self.check_lora_request: Callable[[LoRARequest], object] | None = None

    def tokenize(self, prompt: PromptInput | TokenizedPrompt, add_special_tokens: bool = True
                 ) -> TokenizedPrompt:
        """Text, token ids or a prompt dict -> a checked TokenizedPrompt (one already is one)."""
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError(f"a prompt dict needs exactly one of 'prompt' (text) or "
                                 f"'prompt_token_ids' (list of ints), got keys {sorted(prompt)}")
            if prompt.get("multi_modal_data"):
                return self._tokenize_multimodal(prompt, add_special_tokens)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, list):
                    raise ValueError(f"prompt_token_ids must be a list of ints, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one character or token")
            try:
                token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            except TypeError:  # the tokenizers library's answer to lone surrogates
                raise ValueError("the prompt is not valid Unicode text (it holds a lone surrogate)") from None
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)):
            token_ids = prompt
            text = None
            vocab = self.vocab_size
            for t in token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, "
                             f"got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one character or token")
        return TokenizedPrompt(text, tuple(token_ids))

    def _tokenize_multimodal(self, prompt: dict[str, Any], add_special_tokens: bool) -> TokenizedPrompt:
        """``{"prompt": text with one <image> per image, "multi_modal_data": {"image": image or [images]}}``."""
        if self.multimodal is None:
            raise ValueError("multi_modal_data was given but this model is text-only; images need a "
                             "vision-language model (Idefics3ForConditionalGeneration)")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data must be a dict with the key 'image', got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        if not isinstance(prompt.get("prompt"), str) or not prompt["prompt"]:
            raise ValueError("a prompt with multi_modal_data needs its text as 'prompt' (with one "
                             f"'{self.multimodal.placeholder}' per image); prompt_token_ids are not supported")
        images = data.get("image")
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        token_ids, features = self.multimodal.process(prompt["prompt"], images, add_special_tokens)
        return TokenizedPrompt(prompt["prompt"], tuple(token_ids), features)

    def process(self, request_id: str, prompt: PromptInput | TokenizedPrompt,
                params: SamplingParams | None = None, *, arrival_time: float | None = None,
                add_special_tokens: bool = True, max_tokens_must_fit: bool = False,
                lora_request: LoRARequest | None = None) -> EngineRequest:
        """The EngineRequest for a prompt and its parameters; ValueError if they are not valid.

        ``max_tokens_must_fit``: the prompt plus all of ``max_tokens`` must fit in the context (the
        OpenAI server's rule); otherwise the prompt must leave room for one token and the output
        stops at the context's end (the offline API's, as vLLM's).
        """
        tokenized = self.tokenize(prompt, add_special_tokens)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        self.check_fits(len(tokenized.token_ids), params.max_tokens, max_tokens_must_fit)
        vocab = self.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {t}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}, got {value}")
        if params.has_logits_processors:
            params = self._logits_processor_params(params)
        if params.structured_outputs is not None:
            if self.check_structured_outputs is None:
                raise ValueError("structured_outputs are not available on this engine")
            self.check_structured_outputs(params.structured_outputs)
        if lora_request is not None:
            if self.check_lora_request is None:
                raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True")
            self.check_lora_request(lora_request)
        return EngineRequest(request_id, tokenized.text, tokenized.token_ids, params,
                             time.time() if arrival_time is None else arrival_time, tokenized.mm_features,
                             lora_request)

    def _logits_processor_params(self, params: SamplingParams) -> SamplingParams:
        """logit_bias / allowed_token_ids checked against the vocabulary; bad_words tokenized, each word both
        without and with a leading space (vLLM keeps the spaced form only when it has as many tokens as the
        other; kvloom keeps it whenever it differs, so " Paris" is banned even where "Paris" takes two
        tokens), into a copy of ``params`` (the caller's object is never written to)."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = sorted({t for t in ids if t >= vocab})
            if bad:
                raise ValueError(f"{name} holds token id(s) {bad[:8]} outside the vocabulary [0, {vocab})")
        if not params.bad_words:
            return params
        token_ids: list[list[int]] = []
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens")
            token_ids.append(list(plain))
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced != plain:
                token_ids.append(list(spaced))
        copied = params.clone()
        copied.bad_words_token_ids = token_ids
        return copied

    def engine_request(self, prompt: PromptInput | TokenizedPrompt | EngineRequest, params: SamplingParams | None,
                       request_id: str | None, *, arrival_time: float | None = None) -> EngineRequest:
        """What every entry (``LLMEngine.add_request``, ``EngineClient.generate``) makes of its arguments.

        An EngineRequest passes as it is (its parameters with it; renamed when ``request_id`` differs);
        anything else is ``process``-ed under ``request_id``, which it then needs.
        """
        if isinstance(prompt, EngineRequest):
            if params is not None and params is not prompt.sampling_params:
                raise ValueError("an EngineRequest carries its own sampling_params; pass None")
            if request_id is None or request_id == prompt.request_id:
                return prompt
            return dataclasses.replace(prompt, request_id=request_id)
        if request_id is None:
            raise ValueError("generate() needs a request_id")
        return self.process(request_id, prompt, params, arrival_time=arrival_time)
