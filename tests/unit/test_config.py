"""EngineConfig: the seeds' spellings and vLLM's engine arguments map to kvloom's knobs (or are refused with
the reason), the CLI shows the knobs by group, and the seeds' bucket knobs on a CPU only warn."""

from __future__ import annotations

import argparse
import logging

import pytest

from kvloom.config import GROUPS, EngineConfig, add_engine_args, config_from_args
from kvloom.config.compat import VLLM_ARGUMENT_LIMITS
from kvloom.config.resolved import settle_buckets

NEURON_VARIABLES = ("NEURON_TOKEN_GEN_BUCKETS", "NEURON_CONTEXT_LENGTH_BUCKETS", "NEURON_COMPILED_ARTIFACTS",
                    "NEURON_QUANT_DTYPE", "KVLOOM_TOKEN_GEN_BUCKETS", "KVLOOM_QUANT_DTYPE")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NEURON_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_the_seeds_speculative_decoding_arguments_are_accepted() -> None:
    """shared/seeds/000's speculative example, less device="neuron"."""
    config = EngineConfig.from_kwargs(
        model="SmolLM2-135M-Instruct", speculative_model="/models/draft", max_model_len=128, block_size=128,
        speculative_max_model_len=128, dtype="bfloat16", max_num_seqs=4, num_speculative_tokens=4,
        tensor_parallel_size=32, use_v2_block_manager=True)
    assert config.speculative is not None
    assert (config.speculative.method, config.speculative.model) == ("draft_model", "/models/draft")
    assert (config.speculative.num_speculative_tokens, config.speculative.max_model_len) == (4, 128)


def test_override_neuron_config_is_override_backend_config() -> None:
    config = EngineConfig.from_kwargs(override_neuron_config={"enable_bucketing": False, "num_threads": 2})
    assert config.override_backend_config == {"enable_bucketing": False, "num_threads": 2}
    assert config.backend.enable_bucketing is False and config.backend.num_threads == 2
    shorthand = EngineConfig.from_kwargs(override_neuron_config="num_threads:3")
    assert shorthand.backend.num_threads == 3


def test_override_neuron_config_and_override_backend_config_together_are_refused() -> None:
    with pytest.raises(ValueError, match="give override_backend_config or override_neuron_config"):
        EngineConfig.from_kwargs(override_neuron_config={"num_threads": 2}, override_backend_config={})


@pytest.mark.parametrize("kwargs", [
    {"quantization": "s8"},
    {"quantization": "INT8"},
    {"override_backend_config": {"quantized": True, "quantization_dtype": "s8"}},
])
def test_every_int8_spelling_is_quantization_int8(kwargs: dict) -> None:
    assert EngineConfig.from_kwargs(**kwargs).quantization == "int8"


def test_neuron_variables_are_read_and_kvloom_ones_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_QUANT_DTYPE", "s8")
    monkeypatch.setenv("NEURON_TOKEN_GEN_BUCKETS", "1,4,2")
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", "/tmp/artifacts")
    config = EngineConfig()
    assert config.quantization == "int8"
    assert config.backend.token_gen_buckets == [1, 2, 4]
    assert config.backend.compiled_artifacts == "/tmp/artifacts"
    monkeypatch.setenv("KVLOOM_TOKEN_GEN_BUCKETS", "8")
    assert EngineConfig().backend.token_gen_buckets == [8]


def test_a_bad_neuron_variable_is_named_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_CONTEXT_LENGTH_BUCKETS", "128,big")
    with pytest.raises(ValueError, match="NEURON_CONTEXT_LENGTH_BUCKETS='128,big' must be comma-separated"):
        EngineConfig()


def test_hardware_kvloom_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="'neuron' is not supported"):
        EngineConfig.from_kwargs(device="neuron")


@pytest.mark.parametrize("kwargs", [
    {"enable_chunked_prefill": True}, {"enable_chunked_prefill": None}, {"max_num_batched_tokens": 512},
    {"enforce_eager": True}, {"gpu_memory_utilization": 0.5}, {"tokenizer": "/models/tok"},
    {"disable_log_stats": True}, {"trust_remote_code": True}, {"seed": 7}, {"swap_space": 4},
    {"revision": None}, {"tokenizer_mode": "auto"}, {"max_logprobs": 5}, {"disable_custom_all_reduce": True},
    {"kv_cache_dtype": "auto"}, {"use_v2_block_manager": False}, {"pipeline_parallel_size": 1},
    {"load_format": "auto"}, {"cpu_offload_gb": 0}, {"max_seq_len_to_capture": 8192}, {"enable_lora": False},
])
def test_vllm_arguments_users_pass_are_accepted(kwargs: dict) -> None:
    config = EngineConfig.from_kwargs(**kwargs)
    for name, value in kwargs.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize("kwargs, why", [
    ({"enable_chunked_prefill": False}, "always splits a prompt longer than the step's remaining token budget"),
    ({"revision": "main"}, "never reaches a model hub"),
    ({"tokenizer_revision": "v2"}, "never reaches a model hub"),
    ({"tokenizer_mode": "slow"}, "one tokenizer implementation"),
    ({"load_format": "dummy"}, "reads what the model path holds"),
    ({"download_dir": "/tmp/hub"}, "never downloads weights"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "no e5m2 KV cache"),
    ({"pipeline_parallel_size": 2}, "no pipeline parallelism"),
    ({"cpu_offload_gb": 4}, "keeps every weight on the device"),
    ({"max_lora_rank": 0}, "max_lora_rank must be an integer >= 1"),
    ({"swap_space": -1}, "preempts by recomputation"),
    ({"max_seq_len_to_capture": 0}, "cover every sequence length"),
    ({"use_v2_block_manager": "yes"}, "one block manager"),
    ({"disable_log_stats": "no"}, "disable_log_stats must be True or False"),
    ({"max_logprobs": -1}, "max_logprobs must be an integer >= 0"),
])
def test_vllm_arguments_kvloom_cannot_honour_are_refused_with_the_reason(kwargs: dict, why: str) -> None:
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=rf"{name}") as error:
        EngineConfig.from_kwargs(**kwargs)
    assert why in str(error.value)


@pytest.mark.parametrize("kwargs, why", [
    ({"enable_lora": True, "tensor_parallel_size": 2}, "not sharded across ranks"),
    ({"enable_lora": True, "data_parallel_size": 2}, "not routed to replicas"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "must be at least max_loras"),
])
def test_lora_settings_that_cannot_run_are_refused(kwargs: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        EngineConfig.from_kwargs(**kwargs)
    assert EngineConfig.from_kwargs(enable_lora=True, max_loras=3).max_cpu_loras == 3


def test_every_limited_vllm_argument_is_a_knob() -> None:
    assert set(VLLM_ARGUMENT_LIMITS) <= set(EngineConfig.field_names())


def test_every_knob_has_a_group_and_help() -> None:
    for group, knobs in EngineConfig.fields_by_group().items():
        assert group in GROUPS
        for f in knobs:
            assert f.metadata["help"], f.name
    assert sum(len(knobs) for knobs in EngineConfig.fields_by_group().values()) == len(EngineConfig.field_names())


def test_the_cli_help_shows_the_knobs_by_group(capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser(prog="kvloom serve")
    add_engine_args(parser)
    parser.print_help()
    text = capsys.readouterr().out
    text = text[text.index("options:"):]  # past the usage lines
    positions = [text.index(f"{title}:") for title in GROUPS.values()]
    assert positions == sorted(positions)
    assert text.index("--max-num-seqs") > text.index(f"{GROUPS['scheduler']}:")
    assert "--max-logprobs" not in text  # the server's own flag sets it


def test_cli_flags_take_vllm_and_seed_spellings() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args([
        "--enable-chunked-prefill", "--use-v2-block-manager", "--swap-space", "4", "--kv-cache-dtype", "auto",
        "--override-neuron-config", "enable_bucketing:false", "--disable-log-stats"]))
    assert config.enable_chunked_prefill is True and config.disable_log_stats is True
    assert config.backend.enable_bucketing is False and config.swap_space == 4.0
    with pytest.raises(ValueError, match="enable_chunked_prefill=False is not supported"):
        config_from_args(parser.parse_args(["--no-enable-chunked-prefill"]))


def test_to_dict_round_trips() -> None:
    config = EngineConfig.from_kwargs(quantization="s8", kv_cache_memory="1GiB", speculative_model="[ngram]",
                                      num_speculative_tokens=3, override_neuron_config={"num_threads": 1})
    again = EngineConfig.from_kwargs(**config.to_dict())
    assert again == config and again.speculative == config.speculative and again.backend == config.backend


@pytest.mark.parametrize("backend", [
    {"enable_bucketing": True},
    {"token_gen_buckets": [1, 2, 4]},
    {"enable_bucketing": True, "context_length_buckets": [128, 512]},
])
def test_bucket_knobs_on_a_cpu_warn_once_and_turn_bucketing_off(backend: dict,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig.from_kwargs(override_neuron_config=backend)
    with caplog.at_level(logging.WARNING, logger="kvloom"):
        settle_buckets(config, "cpu")
        settle_buckets(config, "cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "applies to CUDA" in warnings[0]
    assert all(key in warnings[0] for key in backend)
    assert config.backend.enable_bucketing is False


def test_bucket_knobs_on_cuda_are_kept(caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig.from_kwargs(override_backend_config={"enable_bucketing": True, "token_gen_buckets": [1]})
    with caplog.at_level(logging.WARNING, logger="kvloom"):
        settle_buckets(config, "cuda")
    assert not caplog.records and config.backend.enable_bucketing is True


def test_bucketing_turned_off_on_a_cpu_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig.from_kwargs(override_neuron_config={"enable_bucketing": False})
    with caplog.at_level(logging.WARNING, logger="kvloom"):
        settle_buckets(config, "cpu")
    assert not caplog.records
