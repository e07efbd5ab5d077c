"""SamplingParams: every wrong value or type is a ValueError naming the argument and what is allowed."""

from __future__ import annotations

import pytest

from kvloom.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, match", [
    ({"stop": 5}, "stop must be a non-empty string or a list of non-empty strings, got 5"),
    ({"stop": [1]}, "stop must be a non-empty string or a list of non-empty strings"),
    ({"stop": {"a": 1}}, "stop must be"),
    ({"stop": ""}, "stop must be"),
    ({"stop": ["ok", ""]}, "stop must be"),
    ({"max_tokens": "8"}, "max_tokens must be an integer, got '8'"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ({"temperature": float("nan")}, "temperature must be a number"),
    ({"stop_token_ids": "x"}, "stop_token_ids must be a list of non-negative integers, got 'x'"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of non-negative integers, got 5"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids must be a list of non-negative integers"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of non-negative integers"),
    ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"n": "2"}, "n must be an integer"),
    ({"n": 0}, "n must be at least 1"),
    ({"top_k": 1.5}, "top_k must be"),
    ({"top_p": "x"}, "top_p must be a number"),
    ({"logprobs": "5"}, "logprobs must be an integer"),
    ({"logprobs": -1}, "logprobs must be at least 0"),
    ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
    ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind"),
    ({"nonsense": 1}, "unknown argument"),
])
def test_bad_values_and_types_are_value_errors_naming_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_and_stop_token_ids_accept_their_vllm_forms() -> None:
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    params = SamplingParams(stop_token_ids=(3, 4))
    assert params.stop_token_ids == [3, 4] and params.all_stop_token_ids == {3, 4}
