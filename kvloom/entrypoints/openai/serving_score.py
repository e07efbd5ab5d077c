"""/score and /v1/score (vLLM's), /rerank and /v1/rerank (Jina's, Cohere's and vLLM's shape): relevance scores of
text pairs from a sequence classifier or a yes/no reranker. Each pair is one classification request for the same
engine that embeds and generates (kvloom/pooling.py; its prompt from kvloom/scoring.py); its score is the sigmoid
of the classifier's one label. A model that is not such a classifier gets a 400 saying what would serve."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvloom.engine.input_processor import TokenizedPrompt
from kvloom.entrypoints.openai.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    UsageInfo,
)
from kvloom.entrypoints.openai.request_body import BODY_ERRORS, json_body, parse_body
from kvloom.entrypoints.openai.serving_engine import APIError, OpenAIServing, last_output, run_until_disconnected
from kvloom.outputs import ClassificationRequestOutput
from kvloom.pooling import embedding_sampling_params
from kvloom.pooling_params import PoolingParams
from kvloom.scoring import check_scorer, default_score_template, score_pairs, score_prompt


class OpenAIServingScore(OpenAIServing):
    def __init__(self, *args: Any, runner: str = "auto", **kwargs: Any) -> None:
        """``runner``: the engine's (scoring is refused on a 'generate' one). The server's ``--chat-template`` is
        the score template (vLLM's), else the model's default (kvloom/scoring.py)."""
        super().__init__(*args, **kwargs)
        self.runner = runner

    def generation_refusal(self) -> str | None:
        """Why the served model does not generate (a sequence classifier), or None: for the generating routes."""
        config = self.engine.model_config
        if not config.is_classifier:
            return None
        return (f"this model is a sequence classifier ({config.architecture}): it serves /score and /rerank (and "
                f"/v1/embeddings), not generation")

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        await self._check(request.model, "/score")
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as e:
            raise APIError(str(e), param="text_2" if "text_2" in str(e) and "text_1 and" not in str(e)
                           else "text_1") from None
        request_id = f"score-{uuid.uuid4().hex}"
        model = request.model or self.model_name

        async def collect() -> Response:
            scores, num_tokens = await self._scores(request_id, pairs, request.use_activation, "text_1")
            data = [ScoreData(index=i, score=score) for i, score in enumerate(scores)]
            response = ScoreResponse(id=request_id, model=model, data=data,
                                     usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))
            return JSONResponse(response.model_dump())

        return await run_until_disconnected(collect(), raw_request)

    async def create_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        await self._check(request.model, "/rerank")
        documents = [d.text if isinstance(d, RerankDocument) else d for d in request.documents]
        if not documents:
            raise APIError("documents must not be empty", param="documents")
        top_n = request.top_n
        if top_n is not None and top_n < 0:
            raise APIError(f"top_n must be a positive integer (or 0 / unset: every document), got {top_n}",
                           param="top_n")
        request_id = f"rerank-{uuid.uuid4().hex}"
        model = request.model or self.model_name

        async def collect() -> Response:
            scores, num_tokens = await self._scores(request_id, [(request.query, d) for d in documents],
                                                    request.use_activation, "documents")
            ranked = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
            if top_n:
                ranked = ranked[:top_n]
            results = [RerankResult(index=i, relevance_score=scores[i],
                                    document=RerankDocument(text=documents[i]) if request.return_documents else None)
                       for i in ranked]
            response = RerankResponse(id=request_id, model=model, usage=RerankUsage(total_tokens=num_tokens),
                                      results=results)
            return JSONResponse(response.model_dump(exclude_none=True))

        return await run_until_disconnected(collect(), raw_request)

    async def _check(self, model: str | None, route: str) -> None:
        self.check_model(model)
        self.check_engine()
        if self.runner == "generate":
            raise APIError(f"this server runs with --runner generate: {route} is off (serve with --runner auto "
                           f"or pooling)", param="model")
        try:
            check_scorer(self.engine.model_config, route)
        except ValueError as e:
            raise APIError(str(e), param="model") from None

    async def _scores(self, request_id: str, pairs: list[tuple[str, str]], use_activation: bool | None,
                      param: str) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens they took; a 400 naming ``param`` for a pair that cannot run."""
        if len(pairs) > self.max_num_seqs * 16:
            raise APIError(f"the request holds {len(pairs)} pairs; at most {self.max_num_seqs * 16} per request",
                           param=param)
        template = self.chat_template if self.chat_template is not None else \
            default_score_template(self.engine.model_config)
        prompts = [await self._prompt(first, second, template, param) for first, second in pairs]
        params = embedding_sampling_params(_classify_params(use_activation))
        requests = [self.engine_request(f"{request_id}-{i}", prompt, params, param, None)
                    for i, prompt in enumerate(prompts)]
        outputs = await asyncio.gather(*[last_output(self.engine.generate(r)) for r in requests])
        scores = [ClassificationRequestOutput.from_request_output(output).outputs.probs[0] for output in outputs]
        return scores, sum(len(p.token_ids) for p in prompts)

    async def _prompt(self, first: str, second: str, template: str | None, param: str) -> TokenizedPrompt:
        self.check_prompt_chars(len(first) + len(second), param)
        try:
            token_ids = await asyncio.to_thread(score_prompt, self.tokenizer, first, second, template)
        except ValueError as e:
            raise APIError(str(e), param=param) from None
        return await self.tokenize_prompt(token_ids, False, param)


def _classify_params(use_activation: bool | None) -> PoolingParams:
    params = PoolingParams(use_activation=True if use_activation is None else use_activation)
    params.task = "classify"
    return params


def score_routes(serving: OpenAIServingScore) -> APIRouter:
    """POST /score, /v1/score, /rerank and /v1/rerank."""
    router = APIRouter()

    async def score(raw_request: Request) -> Response:
        return await serving.create_score(await parse_body(raw_request, ScoreRequest), raw_request)

    async def rerank(raw_request: Request) -> Response:
        return await serving.create_rerank(await parse_body(raw_request, RerankRequest), raw_request)

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, score, methods=["POST"], openapi_extra=json_body(ScoreRequest),
                             responses=BODY_ERRORS)
    for path in ("/rerank", "/v1/rerank"):
        router.add_api_route(path, rerank, methods=["POST"], openapi_extra=json_body(RerankRequest),
                             responses=BODY_ERRORS)
    return router
