"""Fill-in-the-middle prompts, token for token as llama.cpp's server builds them.

A code model trained for FIM completes the gap between a prefix and a suffix when it reads them between its
FIM tokens; the server, not the client, writes those tokens (llama-server's ``/infill``, and OpenAI's
``suffix`` on ``/v1/completions``). Which tokens a model has comes from its tokenizer
(``Tokenizer.fim_token_ids``: a GGUF's ``tokenizer.ggml.fim_*_token_id`` keys, else the known spellings).

The prompt is llama.cpp's ``format_prompt_infill`` (tools/server/server-common.cpp), prefix-suffix-middle
with the repository-level pattern of Qwen2.5-Coder (https://arxiv.org/pdf/2409.12186)::

    [FIM_REP]myproject\\n                     (when the model has a repo token)
    [FIM_SEP]filename0\\n extra chunk 0       (per input_extra chunk: a file separator and its name, or
    [FIM_SEP]filename1\\n extra chunk 1        "\\n\\n--- snippet ---\\n\\n" without one)
    [FIM_SEP]filename\\n                      (when the model has a file separator)
    [BOS][FIM_PRE]prefix prompt[FIM_SUF]suffix[FIM_MID]

with llama.cpp's budget: the prefix keeps its last ``3 * n_batch / 4`` tokens, the suffix its first
``n_batch / 4 - 2 - len(prompt)``, and the extra context its last ``n_ctx - n_batch - 2 * n_predict``. kvloom
passes llama-server's defaults (``--batch-size 2048``, ``--n-predict -1``) and the served context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvloom.loader.tokenizer import Tokenizer

# llama-server's defaults for the two sizes format_prompt_infill budgets with: --batch-size and --n-predict.
LLAMA_SERVER_N_BATCH = 2048
LLAMA_SERVER_N_PREDICT = -1
# llama.cpp's separator of input_extra chunks for a model without a file separator token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


class InfillUnsupportedError(ValueError):
    """The model has no prefix, suffix or middle token (llama-server's message)."""


@dataclass(frozen=True)
class FimTokens:
    """A model's fill-in-the-middle token ids: prefix, suffix and middle, and where it has them the padding,
    repository and file-separator tokens (llama.cpp's fim_pre / fim_suf / fim_mid / fim_pad / fim_rep / fim_sep)."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> FimTokens:
        """The tokenizer's FIM tokens; InfillUnsupportedError naming each missing one, in llama-server's words."""
        found = tokenizer.fim_token_ids
        missing = "".join(f"{word} token is missing. " for role, word in
                          (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle")) if role not in found)
        if missing:
            raise InfillUnsupportedError(f"Infill is not supported by this model: {missing}(it has no fill-in-the-"
                                         f"middle tokens: serve a code model trained for FIM, such as "
                                         f"Qwen2.5-Coder, StarCoder or CodeLlama)")
        return cls(found["pre"], found["suf"], found["mid"], found.get("pad"), found.get("rep"), found.get("sep"))

    @staticmethod
    def supported(tokenizer: Tokenizer) -> bool:
        """Whether the tokenizer has the prefix, suffix and middle tokens a FIM prompt needs."""
        return all(role in tokenizer.fim_token_ids for role in ("pre", "suf", "mid"))

    @property
    def end_of_generation_ids(self) -> list[int]:
        """The FIM tokens llama.cpp ends generation at (it adds pad, rep and sep to its end-of-generation set)."""
        return [t for t in (self.pad, self.rep, self.sep) if t is not None]


def tokenize_mixed(tokenizer: Tokenizer, value: str | Sequence[str | int]) -> list[int]:
    """llama.cpp's tokenize_mixed with add_special=false, parse_special=false: a string, or a list of strings and
    token ids laid end to end."""
    if isinstance(value, str):
        return tokenizer.encode_plain(value)
    tokens: list[int] = []
    for piece in value:
        if isinstance(piece, str):
            tokens += tokenizer.encode_plain(piece)
        else:
            tokens.append(piece)
    return tokens


def format_prompt_infill(tokenizer: Tokenizer, fim: FimTokens, input_prefix: str | Sequence[str | int],
                         input_suffix: str | Sequence[str | int], input_extra: Sequence[dict[str, Any]],
                         n_batch: int, n_predict: int, n_ctx: int, spm_infill: bool,
                         prompt_tokens: Sequence[int]) -> list[int]:
    """The FIM prompt's token ids, as llama.cpp's format_prompt_infill builds them (module docstring).

    ``input_extra``: ``{"filename": str, "text": str}`` chunks of other files (filename defaults to "tmp").
    ``prompt_tokens``: the tokens that follow the prefix (llama-server's ``prompt``, tokenized with special
    tokens parsed and none added). ``spm_infill``: suffix-prefix-middle order (llama-server's --spm-infill).
    """
    tokens_prefix = tokenize_mixed(tokenizer, input_prefix)
    tokens_suffix = tokenize_mixed(tokenizer, input_suffix)

    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep, *tokenizer.encode_plain("myproject\n")]
    for chunk in input_extra:
        if fim.sep is not None:
            filename = chunk.get("filename")
            extra_tokens += [fim.sep, *tokenizer.encode_plain(("tmp" if filename is None else filename) + "\n")]
        else:
            extra_tokens += tokenizer.encode_plain(SNIPPET_SEPARATOR)
        extra_tokens += tokenizer.encode_plain(chunk.get("text", ""))
    if fim.sep is not None:
        extra_tokens += [fim.sep, *tokenizer.encode_plain("filename\n")]

    # The FIM context fits a batch, prefix to suffix 3:1; the extra context fills the rest of the window.
    n_prefix_take = min(len(tokens_prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(tokens_suffix), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))

    prefix = [fim.pre, *tokens_prefix[len(tokens_prefix) - n_prefix_take:], *prompt_tokens]
    suffix = [fim.suf, *tokens_suffix[:n_suffix_take]]
    first, last = (suffix, prefix) if spm_infill else (prefix, suffix)
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token else []
    extra = extra_tokens[len(extra_tokens) - n_extra_take:]
    return [*extra, *bos, *first, *last, fim.mid]


def check_input_extra(input_extra: Any) -> list[dict[str, Any]]:
    """input_extra as llama-server accepts it (a ValueError in its words otherwise): a list of
    ``{"text": str, "filename": str}``, filename optional."""
    if input_extra is None:
        return []
    if not isinstance(input_extra, list):
        raise ValueError('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in input_extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise ValueError('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise ValueError('extra_context chunk\'s "filename" field must be a string')
    return input_extra
