"""/tokenize and /detokenize: the model's tokenizer itself, for any text or chat (nothing goes
to the engine)."""

from __future__ import annotations

import asyncio

from kvloom.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvloom.entrypoints.openai.serving_engine import INLINE_TOKENIZE_CHARS, APIError, OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """/tokenize and /detokenize: the tokenizer itself, for any text (nothing goes to the engine)."""

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    def token_ids(self, ids: list[int], param: str) -> list[int]:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise APIError(f"token ids must be integers in [0, {self.vocab_size}), got {t}", param=param)
        return ids

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError("give exactly one of prompt (text) or messages (a chat)", param="prompt")
        if request.messages is not None:
            text = await self.render_chat_checked(request.messages, request.add_generation_prompt)
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt or ""
            add_special = request.add_special_tokens is not False
        self.check_prompt_size(text, "messages" if request.messages is not None else "prompt")
        ids = await self.encode(text, add_special)
        token_strs = [self.tokenizer.id_to_token(t) for t in ids] if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        ids = self.token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(ids, skip_special_tokens=False))
