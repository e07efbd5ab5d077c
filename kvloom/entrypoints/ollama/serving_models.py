"""Ollama's model listings (``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/version``) and embeddings
(``/api/embed``, and the older ``/api/embeddings``).

A model's facts (``ModelFacts``) are read once, off the event loop, from the served files' headers: the GGUF's
metadata and tensor directory, or a HF directory's ``config.json`` and safetensors headers; no weight is read.
Its ``digest`` names the files (their paths, sizes and modification times), not their contents, which would take
a read of every byte. One model is served and stays loaded for the server's life: ``/api/ps`` lists it (with its
LoRA adapters) as never expiring, and ``size_vram`` is its size on a CUDA device, 0 on a CPU.

Embeddings run through the embeddings serving: each input is tokenized here, and cut to the context where
``truncate`` (Ollama's default) allows, else refused; ``dimensions`` is for Matryoshka models only (a 400
otherwise), as on ``/v1/embeddings``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import os
import struct
import time
from collections import Counter
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvloom import __version__
from kvloom.entrypoints.ollama.protocol import (
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaListedModel,
    OllamaModelDetails,
    OllamaRunningModel,
    OllamaShowRequest,
    OllamaShowResponse,
    rfc3339,
)
from kvloom.entrypoints.ollama.serving_chat import (
    Timing,
    keep_alive_seconds,
    listed_name,
    served_name,
)
from kvloom.entrypoints.openai.fim import FimTokens
from kvloom.entrypoints.openai.protocol import EmbeddingRequest
from kvloom.entrypoints.openai.serving_chat import OpenAIServingChat
from kvloom.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from kvloom.entrypoints.openai.serving_engine import APIError

# Go's time.Duration(math.MaxInt64) from now: how Ollama dates a model kept loaded for ever.
FOREVER_SECONDS = (2**63 - 1) / 1e9


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What Ollama's listings tell of a model, read from its files."""

    format: str  # "gguf" or "safetensors"
    family: str  # the architecture: general.architecture, or config.json's model_type
    parameter_count: int
    quantization_level: str  # the GGUF's file type (Q8_0, Q4_K_M, ...), or the weights' main dtype (BF16, ...)
    size: int  # bytes of the weight files
    digest: str
    modified_at: float
    model_info: dict[str, Any]  # the architecture's numbers, under "<family>." as GGUF names them


def read_model_facts(model: str, max_model_len: int) -> ModelFacts:
    """The facts of the model ``--model`` names (a HF directory, a .gguf file or the default model)."""
    from kvloom.loader.weights import load_model_config, resolve_model

    source = resolve_model(model)
    config = load_model_config(source)
    if source.kind == "gguf":
        files = [source.path]
        family, count, quantization = _gguf_facts(source.path)
        file_format = "gguf"
    else:
        from kvloom.loader.safetensors import read_config_json, safetensors_files

        files = safetensors_files(source.path)
        raw = read_config_json(source.path)
        family = str(raw.get("model_type") or config.architecture)
        count, quantization = _safetensors_facts(files)
        file_format = "safetensors"
    stats = [os.stat(path) for path in files]
    digest = hashlib.sha256("\n".join(f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
                                      for path, stat in zip(files, stats)).encode()).hexdigest()
    info: dict[str, Any] = {"general.architecture": family, "general.parameter_count": count,
                            f"{family}.context_length": max_model_len,
                            f"{family}.embedding_length": config.hidden_size,
                            f"{family}.block_count": config.num_hidden_layers,
                            f"{family}.feed_forward_length": config.intermediate_size,
                            f"{family}.attention.head_count": config.num_attention_heads,
                            f"{family}.attention.head_count_kv": config.num_key_value_heads,
                            f"{family}.attention.key_length": config.head_dim,
                            f"{family}.rope.freq_base": config.rope_theta,
                            f"{family}.vocab_size": config.vocab_size}
    return ModelFacts(file_format, family, count, quantization, sum(stat.st_size for stat in stats), digest,
                      max(stat.st_mtime for stat in stats), info)


def _gguf_facts(path: str) -> tuple[str, int, str]:
    """(architecture, parameter count, file type) of a GGUF file, from its metadata and tensor directory."""
    import gguf

    from kvloom.loader.gguf import read_gguf

    file = read_gguf(path)
    count = sum(math.prod(info.shape) for info in file.tensors.values())
    file_type = file.metadata.get("general.file_type")
    try:
        quantization = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        types = Counter({gguf.GGMLQuantizationType(info.ggml_type).name: math.prod(info.shape)
                         for info in file.tensors.values()})
        quantization = types.most_common(1)[0][0] if types else "unknown"
    return str(file.metadata.get("general.architecture", "unknown")), count, quantization


def _safetensors_facts(files: list[str]) -> tuple[int, str]:
    """(parameter count, main dtype) of safetensors files, from their headers."""
    count = 0
    dtypes: Counter[str] = Counter()
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                elements = math.prod(tensor["shape"])
                count += elements
                dtypes[tensor["dtype"]] += elements
    return count, dtypes.most_common(1)[0][0] if dtypes else "unknown"


def parameter_size(count: int) -> str:
    """A parameter count as Ollama writes it: 135.0M, 7.6B."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


@functools.lru_cache(maxsize=64)
def _unloaded_facts(model: str) -> ModelFacts:
    """A model's facts read once per server, as a loaded model's are (the context length is not among the tags)."""
    return read_model_facts(model, 0)


async def unloaded_tags(model: str, names: list[str]) -> list[dict[str, Any]]:
    """/api/tags's entries of a served model whose engine is not loaded (several models behind one server): its
    names, with the facts read from its files' headers."""
    facts = await asyncio.to_thread(_unloaded_facts, model)
    return [OllamaListedModel(name=listed_name(name), model=listed_name(name), modified_at=rfc3339(facts.modified_at),
                              size=facts.size, digest=facts.digest, details=model_details(facts)).model_dump()
            for name in names]


def model_details(facts: ModelFacts, parent: str = "") -> OllamaModelDetails:
    return OllamaModelDetails(parent_model=parent, format=facts.format, family=facts.family, families=[facts.family],
                              parameter_size=parameter_size(facts.parameter_count),
                              quantization_level=facts.quantization_level)


class OllamaServingModels:
    """The listings and embeddings over the chat and embeddings servings; ``model``: the server's ``--model``."""

    def __init__(self, chat: OpenAIServingChat, embedding: OpenAIServingEmbedding, model: str,
                 device: str = "auto") -> None:
        """``device``: the server's ``--device`` (auto, cpu, cuda, cuda:N)."""
        self.chat = chat
        self.embedding = embedding
        self.model = model
        self.device = device
        self.started = time.time()
        self._facts: ModelFacts | None = None

    async def facts(self) -> ModelFacts:
        if self._facts is None:
            self._facts = await asyncio.to_thread(read_model_facts, self.model, self.chat.max_model_len)
            if self.device == "auto":
                from kvloom.platform import resolve_device

                self.device = str(resolve_device("auto"))
        return self._facts

    def _parents(self) -> dict[str, str]:
        """Each name this server answers to -> its base model's listed name ("" for a base model)."""
        parents = {name: "" for name in self.chat.served_model_names}
        if self.chat.lora_modules is not None:
            for card in self.chat.lora_modules.model_cards(self.chat.max_model_len):
                parents[card.id] = listed_name(card.parent or self.chat.model_name)
        return parents

    def capabilities(self) -> list[str]:
        """Ollama's capabilities of the served model, from how this server runs it."""
        chat, runner = self.chat, self.chat.runner
        capabilities = [] if runner == "pooling" else ["completion"]
        if runner != "pooling" and chat.enable_auto_tools and chat.tool_parser is not None:
            capabilities.append("tools")
        if runner != "pooling" and FimTokens.supported(chat.tokenizer):
            capabilities.append("insert")
        if chat.engine.input_processor.multimodal is not None:
            capabilities.append("vision")
        if runner != "generate":
            capabilities.append("embedding")
        if runner != "pooling" and chat.reasoning_parser is not None:
            capabilities.append("thinking")
        return capabilities

    # ---- routes --------------------------------------------------------------------------------
    async def tags(self) -> dict[str, Any]:
        facts = await self.facts()
        models = [OllamaListedModel(name=listed_name(name), model=listed_name(name),
                                    modified_at=rfc3339(facts.modified_at), size=facts.size, digest=facts.digest,
                                    details=model_details(facts, parent)).model_dump()
                  for name, parent in self._parents().items()]
        return {"models": models}

    async def ps(self) -> dict[str, Any]:
        facts = await self.facts()
        size_vram = facts.size if self.device.startswith("cuda") else 0
        models = [OllamaRunningModel(name=listed_name(name), model=listed_name(name), size=facts.size,
                                     digest=facts.digest, details=model_details(facts, parent),
                                     expires_at=rfc3339(self.started + FOREVER_SECONDS), size_vram=size_vram,
                                     context_length=self.chat.max_model_len).model_dump()
                  for name, parent in self._parents().items()]
        return {"models": models}

    async def show(self, request: OllamaShowRequest) -> dict[str, Any]:
        model = request.model or request.name
        if not model:
            raise APIError("model is required")
        name = served_name(self.chat, model)
        facts = await self.facts()
        template = self.chat.chat_template if self.chat.chat_template is not None else (
            self.chat.tokenizer.chat_template or "")
        parameters = f"num_ctx {self.chat.max_model_len}"
        modelfile = (f"# Modelfile of the model kvloom serves as {listed_name(name)}\nFROM {self.model}\n"
                     f"PARAMETER {parameters}\n")
        return OllamaShowResponse(modelfile=modelfile, parameters=parameters, template=template,
                                  details=model_details(facts, self._parents()[name]), model_info=facts.model_info,
                                  capabilities=self.capabilities(), modified_at=rfc3339(facts.modified_at)
                                  ).model_dump()

    @staticmethod
    def version() -> dict[str, str]:
        return {"version": __version__}

    async def embed(self, request: OllamaEmbedRequest, raw_request: Request) -> Response:
        timing = Timing()
        model = served_name(self.embedding, request.model)
        raw_request.state.keep_alive = keep_alive_seconds(request.keep_alive)
        texts = [request.input] if isinstance(request.input, str) else list(request.input)
        if not texts:
            return JSONResponse({"model": request.model, "embeddings": []})
        if request.dimensions is not None and request.dimensions < 1:
            raise APIError(f"dimensions must be at least 1, got {request.dimensions}")
        token_ids = [await self._input_tokens(text, request.truncate) for text in texts]
        result = await self._embeddings(model, token_ids, request.dimensions, raw_request)
        if not isinstance(result, list):
            return result
        body = {"model": request.model, "embeddings": result}
        fields = timing.fields(sum(map(len, token_ids)), 0)
        body.update({name: fields[name] for name in ("total_duration", "load_duration", "prompt_eval_count")})
        return JSONResponse(body)

    async def embeddings(self, request: OllamaEmbeddingsRequest, raw_request: Request) -> Response:
        """The older ``/api/embeddings``: ``{"embedding": [...]}`` of one prompt (an empty one for an empty one)."""
        model = served_name(self.embedding, request.model)
        raw_request.state.keep_alive = keep_alive_seconds(request.keep_alive)
        if not request.prompt:
            return JSONResponse({"embedding": []})
        result = await self._embeddings(model, [await self._input_tokens(request.prompt, True)], None, raw_request)
        return JSONResponse({"embedding": result[0]}) if isinstance(result, list) else result

    async def _input_tokens(self, text: str, truncate: bool) -> list[int]:
        """An input's tokens, cut to the longest prompt an embedding can take where ``truncate``, else refused."""
        serving = self.embedding
        limit = serving.max_model_len - 1  # the prompt, then the one token that ends an embedding request
        if truncate:
            text = text[:serving.max_prompt_chars]  # more characters can only be more than ``limit`` tokens
        tokens = list((await serving.tokenize_prompt(text, True, "input")).token_ids)
        if len(tokens) > limit:
            if not truncate:
                raise APIError(f"the input length exceeds the context length: {len(tokens)} tokens, and an input "
                               f"may have at most {limit} (--max-model-len {serving.max_model_len}); send "
                               f"truncate: true to cut it")
            tokens = tokens[:limit]
        return tokens

    async def _embeddings(self, model: str, token_ids: list[list[int]], dimensions: int | None,
                          raw_request: Request) -> list[list[float]] | Response:
        """The embeddings of token-id inputs from the embeddings serving (or its answer, when it is not one)."""
        response = await self.embedding.create_embedding(
            EmbeddingRequest(model=model, input=token_ids, dimensions=dimensions), raw_request)
        if response.status_code != 200 or not isinstance(response, JSONResponse):
            return response
        return [item["embedding"] for item in json.loads(response.body)["data"]]


