"""Scoring text pairs with a sequence classifier (vLLM's score / rerank): which pairs a call names, the prompt
each pair becomes, and whether the model scores at all; no torch.

A pair (text_1, text_2) is one prompt, run as a classification request (kvloom/pooling.py): the classifier's
one label through a sigmoid is the pair's score. The prompt is

- with a score template (``chat_template`` of ``LLM.score``, the server's ``--chat-template``, or Qwen's reranker
  prompt for a model loaded with ``is_original_qwen3_reranker``): the template rendered with
  ``messages = [{"role": "query", "content": text_1}, {"role": "document", "content": text_2}]`` (vLLM's roles),
  tokenized as written (no special tokens added);
- else the tokenizer's pair encoding of (text_1, text_2), as transformers' ``tokenizer(text_1, text_2)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvloom.loader.model_config import ModelConfig

# Qwen3-Reranker's prompt (its model card; vLLM's examples/pooling/score/template/qwen3_reranker.jinja): the
# model answers "yes" or "no" after it, and the score is the probability of "yes".
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {{ instruction | default(instruct | default(messages | selectattr(\"role\", \"eq\", \"system\") "
    "| map(attribute=\"content\") | first | default(\"Given a web search query, retrieve relevant passages that "
    "answer the query\", true), true), true) }}\n"
    "<Query>: {{ messages | selectattr(\"role\", \"eq\", \"query\") | map(attribute=\"content\") | first }}\n"
    "<Document>: {{ messages | selectattr(\"role\", \"eq\", \"document\") | map(attribute=\"content\") | first }}"
    # The closing newlines as an expression: Jinja drops a template's last newline.
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>{{ '\\n\\n' }}"
)

HF_OVERRIDES_EXAMPLE = ('{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
                        '["no", "yes"], "is_original_qwen3_reranker": true}')


def check_classifier(model_config: ModelConfig, what: str) -> None:
    """ValueError unless the model is a sequence classifier; ``what``: the call refused ("score", ...)."""
    if not model_config.is_classifier:
        raise ValueError(
            f"{what} needs a sequence classifier or reranker, and this model is {model_config.architecture}: "
            f"serve a *ForSequenceClassification checkpoint (one of Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2, "
            f"Gemma3, Mixtral, Qwen2Moe, Qwen3Moe), or load a yes/no reranker such as Qwen3-Reranker with "
            f"hf_overrides={HF_OVERRIDES_EXAMPLE}")


def check_scorer(model_config: ModelConfig, what: str) -> None:
    """ValueError unless the model scores pairs: a classifier with one label (vLLM's rule for score)."""
    check_classifier(model_config, what)
    if model_config.num_labels != 1:
        raise ValueError(f"{what} needs a classifier with one label (a relevance score); this one has "
                         f"{model_config.num_labels} labels: classify with it instead (LLM.classify)")


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str],
                names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """The pairs a score call names (vLLM's rule): one text_1 with each text_2, or the two lists zipped."""
    first = _texts(text_1, names[0])
    second = _texts(text_2, names[1])
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise ValueError(f"{names[0]} and {names[1]} must be one text and a list, or two lists of the same length; "
                         f"got {len(first)} and {len(second)} texts")
    return list(zip(first, second))


def _texts(value: Any, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if texts is None or not all(isinstance(text, str) for text in texts):
        raise ValueError(f"{name} must be a string or a list of strings, got {type(value).__name__}")
    if not texts:
        raise ValueError(f"{name} must not be empty")
    return texts


def default_score_template(model_config: ModelConfig) -> str | None:
    """The template pairs are written into when the caller gives none: Qwen's for an original Qwen3-Reranker."""
    return QWEN3_RERANKER_TEMPLATE if model_config.is_original_qwen3_reranker else None


def score_prompt(tokenizer: Any, text_1: str, text_2: str, template: str | None) -> list[int]:
    """One pair's prompt token ids (the module's docstring says how); ``tokenizer``: kvloom's Tokenizer."""
    from kvloom.loader.tokenizer import _compile_chat_template, _jinja_errors

    if template is None:
        return list(tokenizer.backend.encode(text_1, text_2, add_special_tokens=True).ids)
    messages = [{"role": "query", "content": text_1}, {"role": "document", "content": text_2}]
    try:
        text = _compile_chat_template(template).render(messages=messages, **tokenizer.special_tokens)
    except _jinja_errors() as e:
        raise ValueError(f"the score template failed to render: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)
