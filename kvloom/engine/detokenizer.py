"""Incremental detokenization: the text each step's new tokens add, without re-decoding the whole output.

Built on `tokenizers.decoders.DecodeStream`, which keeps a short window of ids and emits text only once
it no longer ends in an incomplete UTF-8 character (U+FFFD), so a character split across tokens, an
emoji or a CJK character never shows up half-decoded. The window starts with the prompt's last ids,
so the first output token is decoded as a continuation: SentencePiece tokenizers keep its leading
space (" Paris", not "Paris"), the way vLLM streams.

Invariant: "".join(step(...) for each step) + flush() == decode(prompt + output)[len(decode(prompt)):],
which for byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM) is simply decode(output) (and so is it
for a prompt, given as ids, that ends inside a character).

Every step costs the same however long the output is: the decoder's window holds a few ids. Bytes
that never become a character (a random model's output, a broken sequence) would otherwise stay
in the window, and be decoded again at every step, until a valid character follows them; once
more than ``MAX_PENDING_TOKENS`` ids are held, the text of all but the last few (U+FFFD for each
broken sequence, as decode() renders it) is emitted.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kvloom.loader.tokenizer import Tokenizer

# Prompt ids the window starts with: enough context for the decoder, cheap to decode (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# A character that is still incomplete spans at most 3 bytes, so at most 3 ids: ids held back beyond
# MAX_PENDING_TOKENS contain broken bytes, and all but the last _UNSETTLED_TOKENS of them are settled.
MAX_PENDING_TOKENS = 8
_UNSETTLED_TOKENS = 4
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
        self._pieces: list[str] = []  # the text emitted so far, in pieces (joined only when asked for)

    def _new_stream(self) -> DecodeStream:
        self._context = self._usable_context(self._context)
        return DecodeStream(ids=self._context or None, skip_special_tokens=self.skip_special_tokens)

    def _usable_context(self, ids: list[int]) -> list[int]:
        """The last ids as the decoder's context; none if they end inside a character (a prompt given
        as ids, broken bytes): DecodeStream would emit the context's own text as output."""
        ids = ids[-PROMPT_CONTEXT_TOKENS:]
        if ids and self._decode(ids).endswith(_REPLACEMENT_CHAR):
            return []
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        """Text added by these tokens; "" while they end inside a character (it comes with a later step)."""
        if not new_token_ids:
            return ""
        text = self._stream.step(self.tokenizer.backend, list(new_token_ids))
        self._pending.extend(new_token_ids)
        if text is None:
            return self._emit_settled() if len(self._pending) > MAX_PENDING_TOKENS else ""
        self._context = (self._context + self._pending)[-PROMPT_CONTEXT_TOKENS:]
        self._pending.clear()
        self._pieces.append(text)
        return text

    def _emit_settled(self) -> str:
        """Emit the text of the held ids that no later id can change: all but the last few.

        A cut is good when decoding the two sides apart gives the text of decoding them together
        (no character, and no broken sequence, spans it).
        """
        context_text = self._decode(self._context)
        all_text = self._decode(self._context + self._pending)
        first_cut = len(self._pending) - _UNSETTLED_TOKENS
        for cut in range(first_cut, max(first_cut - _UNSETTLED_TOKENS, 0), -1):
            settled = self._context + self._pending[:cut]
            text = self._decode(settled)
            next_context = self._usable_context(settled)
            next_context_text = self._decode(next_context)
            rest = self._decode(next_context + self._pending[cut:])
            if (text.startswith(context_text) and rest.startswith(next_context_text)
                    and all_text == text + rest[len(next_context_text):]):
                break
        else:
            return ""  # no good cut yet: wait for more ids
        text = text[len(context_text):]
        unsettled = self._pending[cut:]
        self._context = settled
        self._pending = []
        self._stream = self._new_stream()
        self._pieces.append(text)
        return text + self.step(unsettled)

    def flush(self) -> str:
        """Text of the tokens still held back, rendered as decode() renders them (U+FFFD for a character
        the output ends inside of). Call once when the request finishes."""
        if not self._pending:
            return ""
        context_text = self._decode(self._context)
        text = self._decode(self._context + self._pending)
        if text.startswith(context_text):
            text = text[len(context_text):]
        else:
            text = self._decode(self._pending)
        self._context = (self._context + self._pending)[-PROMPT_CONTEXT_TOKENS:]
        self._pending.clear()
        self._stream = self._new_stream()
        self._pieces.append(text)
        return text

    @property
    def output_text(self) -> str:
        """All text emitted so far (by step() and flush())."""
        text = "".join(self._pieces)
        self._pieces = [text]
        return text
