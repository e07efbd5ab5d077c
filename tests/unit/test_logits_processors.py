"""logit_bias, allowed_token_ids and bad_words: the batched sampler op against its per-row definition,
vLLM's bad_words rule, and SamplingParams' checks; pooling chunk by chunk against the whole-prompt reference
and the model directory's sentence-transformers pooling config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvloom.pooling import PoolingState, pool_reference
from kvloom.pooling_params import PoolerConfig, PoolingParams, load_pooler_config
from kvloom.sample.sampler import Sampler, apply_logits_processors, apply_logits_processors_reference
from kvloom.sampling_params import SamplingParams
from kvloom.worker.input_batch import RequestState, banned_tokens, sampling_metadata


def states_with(params: list[SamplingParams], outputs: list[list[int]]) -> list[RequestState]:
    states = []
    for p, out in zip(params, outputs):
        state = RequestState([1, 2, 3], p, [])
        state.output_token_ids = list(out)
        states.append(state)
    return states


def test_batched_logits_processors_equal_the_per_row_definition() -> None:
    vocab, generator = 50, torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0, logit_bias={3: 5.0, 7: -100.0}),
              SamplingParams(temperature=0.7),
              SamplingParams(temperature=0, allowed_token_ids=[4, 9, 11], logit_bias={9: -2.5}),
              SamplingParams(temperature=1.0, bad_words=["x"]),
              SamplingParams(temperature=0, allowed_token_ids=[0, 1])]
    params[3].bad_words_token_ids = [[12], [20, 21], [22, 23]]  # as the InputProcessor tokenizes them
    outputs = [[], [5], [], [4, 20], [2]]
    states = states_with(params, outputs)
    logits = torch.randn(len(params), vocab, generator=generator)
    metadata = sampling_metadata(states, vocab, torch.device("cpu"))
    got = apply_logits_processors(logits.clone(), metadata)
    expected = apply_logits_processors_reference(
        logits, [p.allowed_token_ids for p in params],
        [banned_tokens(p.bad_words_token_ids, out) for p, out in zip(params, outputs)],
        [p.logit_bias or {} for p in params])
    assert torch.equal(got, expected)
    # Row 3 ended with 20, so 21 is banned with the one-token word 12, and 23 (its prefix 22 not seen) is not.
    assert banned_tokens(params[3].bad_words_token_ids, outputs[3]) == [12, 21]
    sampled = Sampler()(logits.clone(), metadata).sampled_token_ids.tolist()
    assert sampled[0] == int(expected[0].argmax())
    assert sampled[2] in (4, 9, 11) and sampled[4] in (0, 1) and sampled[3] not in (12, 21)


def test_bad_words_rule_is_vllms_prefix_match() -> None:
    words = [[5], [6, 7], [1, 2, 3]]
    assert banned_tokens(words, []) == [5]
    assert banned_tokens(words, [9, 6]) == [5, 7]
    assert banned_tokens(words, [1, 2]) == [5, 3]
    assert banned_tokens(words, [2]) == [5]  # [1, 2, 3]'s prefix is two tokens: [2] alone is not it


def test_a_batch_without_logits_processors_stays_on_the_plain_greedy_path() -> None:
    metadata = sampling_metadata(states_with([SamplingParams(temperature=0)] * 2, [[], []]), 10,
                                 torch.device("cpu"))
    assert metadata.all_greedy and metadata.temperature is None and not metadata.has_logits_processors


@pytest.mark.parametrize("kwargs, match", [
    ({"logit_bias": {5: 100.5}}, r"logit_bias values must be numbers in \[-100, 100\]"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be non-negative integer token ids"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys"),
    ({"logit_bias": [5]}, "logit_bias must be a dict"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be"),
    ({"bad_words": "Paris"}, "bad_words must be a list of non-blank strings"),
    ({"bad_words": ["  "]}, "bad_words must be"),
])
def test_bad_logits_processor_values_are_value_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("normalize, dimensions", [(True, None), (False, 5)])
def test_pooling_chunk_by_chunk_equals_the_whole_prompt(kind: str, normalize: bool, dimensions: int | None) -> None:
    hidden = torch.randn(11, 8, generator=torch.Generator().manual_seed(1))
    params = PoolingParams(normalize=normalize, dimensions=dimensions)
    params.pooling_type = kind
    state = PoolingState(params)
    state.add(hidden[:3] * 7, 0)  # a run that was preempted and recomputed from position 0 counts once
    for start, end in ((0, 4), (4, 9), (9, 11)):
        state.add(hidden[start:end], start)
    torch.testing.assert_close(state.result(), pool_reference(hidden, params))
    assert state.result().shape == (dimensions or 8,)


def test_sentence_transformers_files_set_pooling_and_normalize(tmp_path: Path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [4, 8]}))
    config = load_pooler_config(str(tmp_path), 8)
    assert (config.pooling_type, config.normalize, config.matryoshka_dimensions) == ("MEAN", False, (4, 8))
    assert load_pooler_config(str(tmp_path), 8, "cls").pooling_type == "CLS"
    assert config.resolve(PoolingParams(dimensions=4)).dimensions == 4
    with pytest.raises(ValueError, match=r"dimensions must be one of \[4, 8\]"):
        config.resolve(PoolingParams(dimensions=5))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        load_pooler_config(str(tmp_path), 8)


def test_dimensions_is_refused_without_matryoshka() -> None:
    config = PoolerConfig("LAST", True, 64, None)
    with pytest.raises(ValueError, match="dimensions is only allowed for a model trained for Matryoshka"):
        config.resolve(PoolingParams(dimensions=8))
    resolved = config.resolve(PoolingParams(use_activation=False))
    assert resolved.normalize is False and resolved.pooling_type == "LAST"
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
