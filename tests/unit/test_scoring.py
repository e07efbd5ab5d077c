"""The plain parts of scoring: which pairs a call names (vLLM's rule), how a classifier's config is read (labels,
vLLM's hf_overrides for yes/no rerankers) and what is refused, and the activation of label logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvloom.loader.model_config import ModelConfig
from kvloom.pooling import PoolingState, finish_classification
from kvloom.pooling_params import PoolerConfig, PoolingParams
from kvloom.scoring import check_scorer, score_pairs

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4}


def config(**keys: Any) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, **keys}, "config.json")


def test_pairs_are_one_text_against_each_or_two_lists_zipped() -> None:
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q"], "a") == [("q", "a")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    with pytest.raises(ValueError, match="same length"):
        score_pairs(["q", "r"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="text_2 must not be empty"):
        score_pairs("q", [])
    with pytest.raises(ValueError, match="text_1 must be a string"):
        score_pairs(3, "a")


def test_a_classifier_config_keeps_its_family_facts_and_reads_its_labels() -> None:
    qwen3 = config(architectures=["Qwen3ForSequenceClassification"], id2label={"0": "LABEL_0"}, head_dim=16)
    assert qwen3.architecture == "Qwen3ForSequenceClassification" and qwen3.num_labels == 1
    assert qwen3.qk_norm and qwen3.head_dim == 16  # Qwen3's own facts, read as for its causal LM
    assert config(architectures=["LlamaForSequenceClassification"]).num_labels == 2  # transformers' default
    assert not config(architectures=["LlamaForCausalLM"]).is_classifier
    with pytest.raises(ValueError, match="sequence classifiers run on"):
        config(architectures=["BertForSequenceClassification"])


def test_hf_overrides_make_a_yes_no_reranker_of_a_causal_lm() -> None:
    reranker = config(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["no", "yes"],
                      is_original_qwen3_reranker=True)
    assert (reranker.num_labels, reranker.classifier_method) == (1, "from_2_way_softmax")
    assert reranker.is_original_qwen3_reranker
    three = config(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["a", "b", "c"],
                   method="no_post_processing")
    assert three.num_labels == 3
    with pytest.raises(ValueError, match="needs method"):
        config(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["no", "yes"])
    with pytest.raises(ValueError, match="two tokens"):
        config(architectures=["Qwen3ForSequenceClassification"], classifier_from_token=["no"],
               method="from_2_way_softmax")
    with pytest.raises(ValueError, match="one label"):
        check_scorer(three, "score")
    with pytest.raises(ValueError, match="hf_overrides"):
        check_scorer(config(architectures=["LlamaForCausalLM"]), "score")


def test_label_logits_are_activated_as_vllm_does() -> None:
    on, off = PoolerConfig().resolve(None, task="classify"), PoolerConfig().resolve(
        PoolingParams(use_activation=False), task="classify")
    assert on.task == "classify" and on.pooling_type == "LAST"
    one, three = torch.tensor([0.3]), torch.tensor([0.1, 2.0, -1.0])
    assert torch.allclose(finish_classification(one, on), torch.sigmoid(one))
    assert torch.allclose(finish_classification(three, on), torch.softmax(three, dim=0))
    assert torch.equal(finish_classification(three, off), three)
    with pytest.raises(ValueError, match="dimensions"):
        PoolerConfig(matryoshka_dimensions=()).resolve(PoolingParams(dimensions=8), task="classify")
    # The runner's pool, chunk by chunk: the last row through the head.
    state = PoolingState(on)
    hidden = torch.randn(5, 4)
    state.add(hidden[:3], 0)
    state.add(hidden[3:], 3)
    head = torch.randn(1, 4)
    assert torch.allclose(state.result(lambda rows: rows @ head.T), torch.sigmoid(hidden[-1] @ head.T))
