"""LLM: vLLM's offline API — ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvloom.config import DEFAULT_MODEL, EngineConfig
from kvloom.engine.input_processor import EngineRequest, PromptInput
from kvloom.engine.llm_engine import LLMEngine
from kvloom.engine.output_processor import raise_if_failed
from kvloom.loader.tokenizer import Tokenizer
from kvloom.lora.request import LoRARequest
from kvloom.multimodal.chat import chat_prompt
from kvloom.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
from kvloom.pooling import embedding_sampling_params
from kvloom.pooling_params import PoolerConfig, PoolingParams, load_pooler_config
from kvloom.sampling_params import RequestOutputKind, SamplingParams
from kvloom.scoring import check_classifier, check_scorer, default_score_template, score_pairs, score_prompt

# vLLM generate() keywords that kvloom accepts when they ask for nothing it lacks.
_IGNORED_GENERATE_KWARGS = ("priority", "prompt_adapter_request")

Message = dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    >>> llm = LLM(model="SmolLM2-135M-Instruct", max_model_len=512)
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 **kwargs: Any) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order. ``lora_request``: the
        adapter of every prompt, or one per prompt (None: the base model); needs ``enable_lora=True``."""
        for key, value in kwargs.items():
            if key not in _IGNORED_GENERATE_KWARGS or value is not None:
                raise ValueError(f"generate() got an unsupported keyword argument {key!r}; it takes "
                                 f"prompts, sampling_params and use_tqdm")
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt (a string, a list of token ids or a prompt dict) "
                             f"or a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        if self.llm_engine.config.runner == "pooling":
            raise ValueError("this LLM was built with runner='pooling' (embeddings only): call LLM.embed, or "
                             "build it with runner='auto' to generate too")
        self._check_generates()
        return self._run(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _check_generates(self) -> None:
        model_config = self.llm_engine.model_config
        if model_config.is_classifier:
            raise ValueError(f"this model is a sequence classifier ({model_config.architecture}): it scores and "
                             f"classifies (LLM.score, LLM.classify) and does not generate")

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the model's chat template;
        ``lora_request`` as in ``generate``."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts "
                             "(or a list of such lists)")
        self._check_generates()
        conversations = [messages] if isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        # Text conversations render to text; ones with image parts to a prompt dict with their images.
        multimodal = self.llm_engine.input_processor.multimodal
        load_url = None if multimodal is None else multimodal.media.load_image
        prompts: list[PromptInput] = [
            chat_prompt(tokenizer, conversation, multimodal, load_url, add_generation_prompt=add_generation_prompt,
                        chat_template=chat_template)
            for conversation in conversations]
        # The template already wrote any BOS it wants.
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False, lora_request=lora_request)

    def _run(self, prompts: list[PromptInput],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
             add_special_tokens: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        lora_requests = _per_prompt_lora_requests(lora_request, len(prompts))
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                                 f"give one SamplingParams or one per prompt")
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                             f"got {type(sampling_params).__name__}")
        for params in params_list:
            self._check_limits(params)
        # Each request's outputs come back once, whole, when it finishes. The caller's
        # SamplingParams are left as they were: each distinct one is copied once.
        final_params: dict[int, SamplingParams] = {}
        for params in params_list:
            if isinstance(params, SamplingParams) and id(params) not in final_params:
                final_params[id(params)] = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        # Process everything before queueing anything, so a bad prompt leaves no half-done batch.
        processor = engine.input_processor
        if processor.multimodal is not None:  # every prompt's images preprocessed on the pool at once
            prompts = processor.multimodal.prefetch(prompts)
        requests: list[EngineRequest] = [
            processor.process(engine.next_request_id(), prompt, final_params.get(id(params), params),
                              add_special_tokens=add_special_tokens, lora_request=lora)
            for prompt, params, lora in zip(prompts, params_list, lora_requests)]
        request_ids = []
        try:
            for request in requests:
                engine.add_request(request.request_id, request)
                request_ids.append(request.request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise

    def _check_limits(self, params: SamplingParams) -> None:
        """The engine's per-request caps (vLLM's max_logprobs, and n within max_num_seqs)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                             f"got a list holding {type(params).__name__}")
        config = self.llm_engine.config
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > config.max_logprobs:
                raise ValueError(f"{name} must be at most max_logprobs={config.max_logprobs}, got {value}")
        max_num_seqs = config.max_num_seqs
        if params.n > max_num_seqs:
            raise ValueError(f"n={params.n} is more than max_num_seqs={max_num_seqs}, the most sequences the "
                             f"engine runs at once; ask for at most {max_num_seqs} completions per prompt "
                             f"or raise max_num_seqs")

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(finished) < len(wanted) and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        raise_if_failed(output)
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return [finished[r] for r in request_ids]

    # ---- embeddings, classification, scoring ---------------------------------------------------
    def embed(self, prompts: PromptInput | Sequence[PromptInput],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``): the prompt's final hidden states pooled (LAST,
        MEAN or CLS: ``pooling_type``, or the model's sentence-transformers config), normalized by default."""
        self._check_pooling_runner("embed")
        prompts = _prompt_list(prompts)
        pooler = self.pooler_config()
        params = [pooler.resolve(p) for p in _per_prompt_pooling_params(pooling_params, len(prompts))]
        outputs = self._run_pooling(prompts, params, use_tqdm)
        return [EmbeddingRequestOutput.from_request_output(output) for output in outputs]

    def classify(self, prompts: PromptInput | Sequence[PromptInput],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Label scores per prompt (vLLM's ``LLM.classify``) from a sequence classifier: its ``score`` head on the
        last token's final hidden state, softmaxed (a sigmoid for one label; ``use_activation=False``: logits)."""
        self._check_pooling_runner("classify")
        check_classifier(self.llm_engine.model_config, "LLM.classify")
        prompts = _prompt_list(prompts)
        params = [self.pooler_config().resolve(p, task="classify")
                  for p in _per_prompt_pooling_params(pooling_params, len(prompts))]
        outputs = self._run_pooling(prompts, params, use_tqdm)
        return [ClassificationRequestOutput.from_request_output(output) for output in outputs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: LoRARequest | None = None,
              chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """Relevance scores of text pairs (vLLM's ``LLM.score``) from a one-label classifier or reranker: one
        ``text_1`` against each ``text_2``, or two lists pair by pair. Each pair is one prompt (kvloom/scoring.py:
        the score template ``chat_template``, Qwen's reranker prompt for an original Qwen3-Reranker, else the
        tokenizer's pair encoding); its score is the sigmoid of the label's logit."""
        if truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens is not supported by kvloom's score; leave it None (a pair "
                             "longer than max_model_len is refused)")
        if lora_request is not None:
            raise ValueError("lora_request is not supported for scoring; leave it None")
        self._check_pooling_runner("score")
        model_config = self.llm_engine.model_config
        check_scorer(model_config, "LLM.score")
        template = chat_template if chat_template is not None else default_score_template(model_config)
        tokenizer = self.get_tokenizer()
        prompts: list[PromptInput] = [score_prompt(tokenizer, first, second, template)
                                      for first, second in score_pairs(text_1, text_2)]
        params = self.pooler_config().resolve(pooling_params, task="classify")
        outputs = self._run_pooling(prompts, [params] * len(prompts), use_tqdm)
        return [ScoringRequestOutput.from_request_output(output) for output in outputs]

    def _check_pooling_runner(self, what: str) -> None:
        if self.llm_engine.config.runner == "generate":
            raise ValueError(f"this LLM was built with runner='generate': build it with runner='pooling' "
                             f"(or 'auto') to {what}")

    def _run_pooling(self, prompts: list[PromptInput], params: list[PoolingParams], use_tqdm: bool
                     ) -> list[RequestOutput]:
        """Pooling requests (embeddings, label scores), every prompt processed before any is queued."""
        engine = self.llm_engine
        requests = [engine.input_processor.process(engine.next_request_id(), prompt, embedding_sampling_params(p))
                    for prompt, p in zip(prompts, params)]
        request_ids = []
        try:
            for request in requests:
                engine.add_request(request.request_id, request)
                request_ids.append(request.request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise

    def pooler_config(self) -> PoolerConfig:
        """The model's pooling (its directory's sentence-transformers config, the pooling_type knob)."""
        engine = self.llm_engine
        if getattr(self, "_pooler_config", None) is None:
            self._pooler_config = load_pooler_config(engine.source.path, engine.model_config.hidden_size,
                                                     engine.config.pooling_type)
        return self._pooler_config


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt (text, token ids, a prompt dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _per_prompt_pooling_params(pooling_params: PoolingParams | Sequence[PoolingParams] | None,
                               num_prompts: int) -> list[PoolingParams | None]:
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        return [pooling_params] * num_prompts
    params = list(pooling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} pooling_params for {num_prompts} prompts; give one PoolingParams "
                         f"or one per prompt")
    return params


def _per_prompt_lora_requests(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                              num_prompts: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"got {len(lora_request)} lora_requests for {num_prompts} prompts; give one "
                             f"LoRARequest (or None) or one per prompt")
        for item in lora_request:
            if item is not None and not isinstance(item, LoRARequest):
                raise ValueError(f"lora_request must hold LoRARequest or None, got {type(item).__name__}")
        return list(lora_request)
    raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, "
                     f"got {type(lora_request).__name__}")
