"""The offline API as a vLLM user drives it: outputs, chat, stop strings, sampling, bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvloom import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, max_num_seqs=8)


def test_outputs_have_vllms_fields_in_input_order(llm: LLM) -> None:
    prompts = ["The quick brown fox", "Once upon a time", "def fibonacci"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                           use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    tokenizer = llm.get_tokenizer()
    for output in outputs:
        assert output.finished
        assert output.prompt_token_ids == tokenizer.encode(output.prompt)
        completion = output.outputs[0]
        assert completion.index == 0
        assert len(completion.token_ids) == 5
        assert completion.finish_reason == "length" and completion.stop_reason is None
        full = tokenizer.decode(completion.token_ids)
        if "\ufffd" not in full:  # a random tiny model may emit bytes that are not UTF-8
            assert completion.text == full
        assert completion.cumulative_logprob is None and completion.logprobs is None


def test_token_prompts_and_per_prompt_params(llm: LLM) -> None:
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, [8, 9]],
                           [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 4]
    assert outputs[0].prompt is None and outputs[0].prompt_token_ids == [5, 6, 7]


def test_stop_strings_stop_tokens_and_eos(llm: LLM) -> None:
    base = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[3:6]
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            stop=[stop], include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:text.index(stop) + len(stop)]
    stop_token = base.token_ids[4]
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            stop_token_ids=[stop_token]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(stop_token) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    # min_tokens keeps a stop token from ending the request early.
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                            stop_token_ids=[stop_token], min_tokens=8),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8


def test_n_completions_seeds_and_logprobs(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=2, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    # The same seed gives the same samples, whatever else is in the batch.
    crowd = ["The quick brown fox", "Once upon a time", "def fibonacci"]
    again = llm.generate(crowd, [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True), params,
                                 SamplingParams(temperature=0.5, max_tokens=9, ignore_eos=True)],
                         use_tqdm=False)[1]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    for completion in first.outputs:
        assert len(completion.logprobs) == 6
        total = 0.0
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert token_id in entry and 2 <= len(entry) <= 3
            total += entry[token_id].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_chat_uses_the_chat_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert out.prompt == rendered
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert len(llm.chat([messages, messages], use_tqdm=False)) == 2


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.generate("", use_tqdm=False), "empty"),
    (lambda llm: llm.generate({"prompt_token_ids": []}, use_tqdm=False), "empty"),
    (lambda llm: llm.generate({"prompt_token_ids": [1] * 200}, use_tqdm=False), "maximum context length"),
    (lambda llm: llm.generate({"prompt_token_ids": [10 ** 6]}, use_tqdm=False), r"\[0, 400\)"),
    (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda llm: llm.generate("hi", SamplingParams(temperature=-0.5)), "temperature"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
    (lambda llm: llm.generate("hi", SamplingParams(bogus=1)), "bogus"),
    (lambda llm: llm.generate("hi", use_tqdm=False, bogus=1), "bogus"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()]), "one per prompt"),
    (lambda llm: llm.generate("bad \ud800 text"), "Unicode"),
    (lambda llm: llm.generate("hi", SamplingParams(seed=2 ** 64)), "seed"),
    (lambda llm: llm.generate(None), "prompts must be a prompt .* or a list of prompts, got NoneType"),
    (lambda llm: llm.generate(5), "prompts must be a prompt .* or a list of prompts, got int"),
    (lambda llm: llm.generate([None]), "a prompt must be a string, a list of token ids or a dict, got NoneType"),
    (lambda llm: llm.generate(["ok"], sampling_params=5), "sampling_params must be a SamplingParams .* got int"),
    (lambda llm: llm.generate(["ok"], sampling_params=[5]), "sampling_params must be a SamplingParams"),
    (lambda llm: llm.chat("not a list"), "messages must be a non-empty list"),
    (lambda llm: llm.chat([1]), "messages must be a non-empty list"),
    (lambda llm: llm.generate("hi", SamplingParams(logprobs=1000)), "logprobs must be at most max_logprobs=20"),
    (lambda llm: llm.generate("hi", SamplingParams(prompt_logprobs=21)),
     "prompt_logprobs must be at most max_logprobs=20"),
    (lambda llm: llm.generate("hi", SamplingParams(n=9)), "n=9 is more than max_num_seqs=8"),
    (lambda llm: llm.generate("hi", SamplingParams(n=10000)), "n=10000 is more than max_num_seqs=8"),
])
def test_bad_input_is_a_clear_value_error_and_the_engine_keeps_working(llm: LLM, call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(llm)
    out = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, match", [
    ({"bogus_arg": 1}, "bogus_arg"),
    ({"device": "neuron"}, "neuron"),
    ({"block_size": 0}, "block_size"),
    ({"dtype": "int3"}, "dtype"),
    ({"max_model_len": 10 ** 6}, "max_model_len"),
    ({"override_backend_config": {"nope": 1}}, "nope"),
    ({"enable_chunked_prefill": False}, "enable_chunked_prefill=False is not supported"),
    ({"pipeline_parallel_size": 2}, "no pipeline parallelism"),
])
def test_bad_engine_arguments_are_clear_value_errors(tiny_llama_dir: str, kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(model=tiny_llama_dir, **kwargs)


def test_corrupt_checkpoint_is_one_line_and_exit_2_from_the_cli(tiny_llama_dir: str, tmp_path,
                                                               capsys: pytest.CaptureFixture) -> None:
    import shutil

    from kvloom.entrypoints.cli import main

    broken = shutil.copytree(tiny_llama_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{weights} is not a valid safetensors file"):
        LLM(model=str(broken))
    assert main(["generate", "--model", str(broken), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"kvloom generate: error: {weights} is not a valid")


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(model="no-such-model")


def test_seed_offline_example_runs(tiny_llama_dir: str) -> None:
    env = dict(os.environ, KVLOOM_EXAMPLE_MODEL=tiny_llama_dir)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "offline_inference.py")],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("Prompt: ")]
    assert len(lines) == 4
    assert lines[2].startswith("Prompt: 'The capital of France is', Generated text: ")


def test_a_seeds_engine_arguments_run_on_a_cpu_with_one_bucket_warning(
        tiny_llama_dir: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """shared/seeds/002's override_neuron_config and NEURON_* buckets with vLLM's usual arguments: the
    buckets (CUDA graphs) are ignored on the CPU with one warning; max_logprobs is honoured."""
    import logging

    monkeypatch.setenv("NEURON_CONTEXT_LENGTH_BUCKETS", "32,64")
    with caplog.at_level(logging.WARNING, logger="kvloom"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, block_size=128, max_num_seqs=4,
                  device="cpu", override_neuron_config={"enable_bucketing": True}, enable_chunked_prefill=True,
                  use_v2_block_manager=True, disable_log_stats=True, swap_space=4, max_logprobs=2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "CUDA" in r.getMessage()]
    assert len(warnings) == 1 and "enable_bucketing, context_length_buckets" in warnings[0]
    out = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="logprobs must be at most max_logprobs=2, got 3"):
        llm.generate("The quick", SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)

