"""Incremental detokenization: the text each step's new tokens add, without re-decoding the whole output.

Built on `tokenizers.decoders.DecodeStream`, which keeps a short window of ids and emits text only once
it no longer ends in an incomplete UTF-8 character (U+FFFD), so a character split across tokens, an
emoji or a CJK character never shows up half-decoded. The window starts with the prompt's last ids,
so the first output token is decoded as a continuation: SentencePiece tokenizers keep its leading
space (" Paris", not "Paris"), the way vLLM streams.

Invariant: "".join(step(...) for each step) + flush() == decode(prompt + output)[len(decode(prompt)):],
which for byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM) is simply decode(output) (and so is it
for a prompt, given as ids, that ends inside a character).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kvloom.loader.tokenizer import Tokenizer

# Prompt ids the window starts with: enough context for the decoder, cheap to decode (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The last few ids already turned into text (the decoder's context), and those still held back.
        self._context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._pending: list[int] = []
        self._stream = self._new_stream()
        self._text = ""

    def _new_stream(self) -> DecodeStream:
        if self._context and self.tokenizer.decode(self._context, self.skip_special_tokens).endswith(
                _REPLACEMENT_CHAR):
            # Context that ends inside a character (a prompt given as ids): DecodeStream would emit the
            # context's own text as output, so decode what follows on its own instead.
            self._context = []
        return DecodeStream(ids=self._context or None, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        """Text added by these tokens; "" while they end inside a character (it comes with a later step)."""
        if not new_token_ids:
            return ""
        text = self._stream.step(self.tokenizer.backend, list(new_token_ids))
        self._pending.extend(new_token_ids)
        if text is None:
            return ""
        self._context = (self._context + self._pending)[-PROMPT_CONTEXT_TOKENS:]
        self._pending.clear()
        self._text += text
        return text

    def flush(self) -> str:
        """Text of the tokens still held back, rendered as decode() renders them (U+FFFD for a character
        the output ends inside of). Call once when the request finishes."""
        if not self._pending:
            return ""
        context_text = self.tokenizer.decode(self._context, self.skip_special_tokens)
        text = self.tokenizer.decode(self._context + self._pending, self.skip_special_tokens)
        if text.startswith(context_text):
            text = text[len(context_text):]
        else:
            text = self.tokenizer.decode(self._pending, self.skip_special_tokens)
        self._context = (self._context + self._pending)[-PROMPT_CONTEXT_TOKENS:]
        self._pending.clear()
        self._stream = self._new_stream()
        self._text += text
        return text

    @property
    def output_text(self) -> str:
        """All text emitted so far (by step() and flush())."""
        return self._text
