"""Sequence classifiers: a family's decoder with transformers' ``score`` head in place of the LM head.

``<Family>ForSequenceClassification`` (transformers' name) is ``<Family>ForCausalLM`` whose final hidden state
of the last prompt token goes through ``score``, a bias-free Linear [num_labels, H]; there is no LM head. The
engine runs a classification request as an embedding one (kvloom/pooling.py: LAST pooling), and the runner hands
the pooled row to ``classify``.

A causal LM becomes one with vLLM's ``hf_overrides`` (``classifier_from_token`` and ``method``, or
``is_original_qwen3_reranker``): the head is made at load time of the LM head's rows of those tokens, which
``ModelConfig.classifier_token_ids`` names:

    from_2_way_softmax   score = [row("yes") - row("no")]: one label whose sigmoid is softmax([no, yes])[yes],
                         the probability a "yes"/"no" reranker (Qwen3-Reranker) answers "yes"
    no_post_processing   score = the rows themselves, one label per token

The head runs in fp32 (as vLLM's), whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvloom.loader.model_config import ModelConfig
from kvloom.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvloom.models.llama import LlamaForCausalLM, MistralForCausalLM
from kvloom.models.mixtral import MixtralForCausalLM
from kvloom.models.phi3 import Phi3ForCausalLM
from kvloom.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from kvloom.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from kvloom.ops.table import Ops

_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")


class SequenceClassifier(nn.Module):
    """Mixed in before a family's ``...ForCausalLM``: the ``score`` head in place of its LM head."""

    config: ModelConfig

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__(config, ops)  # type: ignore[call-arg]  # the family's causal LM
        del self.lm_head  # the classifier's head is ``score``
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False, dtype=torch.float32)
        self.score.requires_grad_(False)  # inference only, as every kvloom weight (a packed model is remapped)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: final hidden states [N, H] -> label logits [N, num_labels] in fp32."""
        return self.score(hidden.float())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A classifier's logits are its labels' ([N, num_labels]): the one token a pooling request samples (and
        drops) is the top label."""
        return self.classify(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.config.classifier_from_token is not None:
            weights = _with_head_from_tokens(weights, self.config)
        super().load_weights(weights)  # type: ignore[misc]


# Module-level classes (a packed model pickles by class name), one per text family.
class LlamaForSequenceClassification(SequenceClassifier, LlamaForCausalLM):
    pass


class MistralForSequenceClassification(SequenceClassifier, MistralForCausalLM):
    pass


class Qwen2ForSequenceClassification(SequenceClassifier, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassifier, Qwen3ForCausalLM):
    pass


class Phi3ForSequenceClassification(SequenceClassifier, Phi3ForCausalLM):
    pass


class Gemma2ForSequenceClassification(SequenceClassifier, Gemma2ForCausalLM):
    pass


class Gemma3ForSequenceClassification(SequenceClassifier, Gemma3ForCausalLM):
    pass


class MixtralForSequenceClassification(SequenceClassifier, MixtralForCausalLM):
    pass


class Qwen2MoeForSequenceClassification(SequenceClassifier, Qwen2MoeForCausalLM):
    pass


class Qwen3MoeForSequenceClassification(SequenceClassifier, Qwen3MoeForCausalLM):
    pass


SEQUENCE_CLASSIFIERS: dict[str, type[nn.Module]] = {cls.__name__: cls for cls in (
    LlamaForSequenceClassification, MistralForSequenceClassification, Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification, Phi3ForSequenceClassification, Gemma2ForSequenceClassification,
    Gemma3ForSequenceClassification, MixtralForSequenceClassification, Qwen2MoeForSequenceClassification,
    Qwen3MoeForSequenceClassification)}


def _with_head_from_tokens(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without the LM head, then ``score.weight`` made of the LM head's rows of the
    classifier's tokens (the embedding's, where the head is tied to it): the model loads it as a stored head."""
    token_ids = config.classifier_token_ids
    if token_ids is None:
        raise ValueError("classifier_from_token's token ids were not settled (config.resolved."
                         "settle_classifier_tokens runs before loading)")
    rows: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name in _HEAD_NAMES:
            # int8 / 4-bit as read: only the classifier's rows decoded (each field of those holds a row per token)
            picked = tensor[token_ids] if isinstance(tensor, torch.Tensor) else \
                type(tensor)(*(field[token_ids] for field in tensor)).dequantize()
            rows[name] = picked.float()  # [n, H]
            if name == "lm_head.weight":
                continue
        yield name, tensor
    head = rows.get("lm_head.weight")
    if head is None and config.tie_word_embeddings:
        head = rows.get("model.embed_tokens.weight", rows.get("embed_tokens.weight"))
    if head is None:
        raise ValueError(f"hf_overrides classifier_from_token: the checkpoint has no LM head to take the rows of "
                         f"{config.classifier_from_token} from")
    if config.classifier_method == "from_2_way_softmax":
        head = head[1:2] - head[0:1]  # softmax over (no, yes) = sigmoid(yes - no): [1, H]
    yield "score.weight", head
