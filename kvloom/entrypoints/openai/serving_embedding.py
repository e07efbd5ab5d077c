"""/v1/embeddings: one embedding per input (a string, a list of strings, token ids or a list of token-id
lists), in OpenAI's shape. Each input is an embedding request for the same engine that generates: a
prefill whose final hidden states the runner pools (kvloom/pooling.py), batched with the rest of the step.
``encoding_format="base64"`` sends each vector as base64 of little-endian float32; ``dimensions`` is for
Matryoshka models only (a 400 otherwise), as vLLM."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvloom.engine.input_processor import TokenizedPrompt
from kvloom.entrypoints.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from kvloom.entrypoints.openai.serving_engine import APIError, OpenAIServing, last_output, run_until_disconnected
from kvloom.outputs import EmbeddingRequestOutput
from kvloom.pooling import embedding_sampling_params
from kvloom.pooling_params import PoolerConfig, PoolingParams, load_pooler_config


class OpenAIServingEmbedding(OpenAIServing):
    def __init__(self, *args: Any, pooler: Callable[[], PoolerConfig], runner: str = "auto", **kwargs: Any) -> None:
        """``pooler``: reads the model's pooling (kvloom/pooling_params.py load_pooler_config) at the first
        embedding request; ``runner``: the engine's (embeddings are refused on a 'generate' one)."""
        super().__init__(*args, **kwargs)
        self.load_pooler = pooler
        self._pooler: PoolerConfig | None = None
        self.runner = runner
        self.registry = CollectorRegistry(auto_describe=True)
        counter = Counter("kvloom:embedding_requests", "Count of /v1/embeddings requests served, and of the "
                          "inputs they embedded.", labelnames=["model_name", "kind"], registry=self.registry)
        self.requests_served = counter.labels(self.model_name, "requests")
        self.inputs_embedded = counter.labels(self.model_name, "inputs")

    def metrics_text(self) -> bytes:
        """This family's Prometheus counters (appended to /metrics)."""
        return generate_latest(self.registry)

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_engine()
        if self.runner == "generate":
            raise APIError("this server runs with --runner generate: embeddings are off (serve with --runner auto "
                           "or pooling)", param="model")
        self.check_refused_fields(request)
        if self._pooler is None:
            self._pooler = await asyncio.to_thread(self.load_pooler)
        try:
            pooling = self._pooler.resolve(PoolingParams(normalize=request.normalize, dimensions=request.dimensions,
                                                        use_activation=request.use_activation))
        except ValueError as e:
            param = "dimensions" if "dimensions" in str(e) else "normalize"
            raise APIError(str(e), param=param) from None
        prompts = await self._prompts(request)
        request_id = f"embd-{uuid.uuid4().hex}"
        params = embedding_sampling_params(pooling)
        requests = [self.engine_request(f"{request_id}-{i}", prompt, params, "input", None)
                    for i, prompt in enumerate(prompts)]
        model = request.model or self.model_name
        generators = [self.engine.generate(r) for r in requests]

        async def collect() -> Response:
            outputs = await asyncio.gather(*[last_output(g) for g in generators])
            data = []
            for index, output in enumerate(outputs):
                vector = EmbeddingRequestOutput.from_request_output(output).outputs.embedding
                data.append(EmbeddingData(index=index, embedding=_encode(vector, request.encoding_format)))
            num_tokens = sum(len(p.token_ids) for p in prompts)
            self.requests_served.inc()
            self.inputs_embedded.inc(len(prompts))
            response = EmbeddingResponse(id=request_id, created=int(time.time()), model=model, data=data,
                                         usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
            return JSONResponse(response.model_dump())

        return await run_until_disconnected(collect(), raw_request)

    async def _prompts(self, request: EmbeddingRequest) -> list[TokenizedPrompt]:
        value = request.input
        if isinstance(value, str):
            items: list[Any] = [value]
        elif value and isinstance(value[0], int):
            items = [value]
        else:
            items = list(value)
        if not items:
            raise APIError("input must not be empty", param="input")
        if len(items) > self.max_num_seqs * 16:
            raise APIError(f"input holds {len(items)} items; at most {self.max_num_seqs * 16} per request",
                           param="input")
        return [await self.tokenize_prompt(item, request.add_special_tokens, "input") for item in items]


def runner_of(args: Any) -> str:
    """The engine's runner from the server's flags (vLLM's older --task spelling included)."""
    task = getattr(args, "task", None)
    if task in ("embed", "embedding"):
        return "pooling"
    if task == "generate":
        return "generate"
    return getattr(args, "runner", None) or "auto"


def embedding_pooler_config(args: Any) -> Callable[[], PoolerConfig]:
    """What reads the served model's pooling, from the server's arguments (its directory's sentence-transformers
    files, ``--pooling-type``), on the server's side: the engine may run in another process."""
    from kvloom.loader.weights import load_model_config, resolve_model

    def load() -> PoolerConfig:
        model = getattr(args, "model", None)
        pooling_type = getattr(args, "pooling_type", None)
        source = resolve_model(model)
        return load_pooler_config(source.path, load_model_config(source).hidden_size, pooling_type)

    return load


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """floats as they are, or base64 of little-endian float32 (OpenAI's base64 format)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
