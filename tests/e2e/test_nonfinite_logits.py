"""A model whose logits hold NaN or inf: the runner reports the requests it happens to, and samples nothing
for them (the engine is to end them with an error), while the other requests of the batch go on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kvloom import SamplingParams
from kvloom.engine.llm_engine import LLMEngine
from kvloom.step_io import ModelRunnerOutput

POISONED_TOKEN = 7  # its embedding row is NaN: a prompt holding it gets NaN logits
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _poisoned_copy(model_dir: str, tmp_path: Path, name: str, rows: slice | int) -> str:
    """The checkpoint with rows of `name` overwritten with NaN."""
    copy = Path(shutil.copytree(model_dir, tmp_path / "poisoned"))
    weights = load_file(copy / "model.safetensors")
    weights[name][rows] = float("nan")
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return str(copy)


def _one_step(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY
              ) -> ModelRunnerOutput:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    output = engine.executor.execute(engine.scheduler.schedule())
    engine.abort_request(list(prompts))
    return output


def test_nan_weights_fail_every_request_and_sample_nothing(tiny_mistral_dir: str, tmp_path: Path) -> None:
    model = _poisoned_copy(tiny_mistral_dir, tmp_path, "model.norm.weight", slice(None))
    engine = LLMEngine.from_kwargs(model=model, dtype="float32", max_model_len=64)
    output = _one_step(engine, {"a": [1, 2, 3], "b": [4, 5]})
    assert sorted(output.failed_request_ids) == ["a", "b"]
    assert output.sampled_token_ids == {}


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=1, max_tokens=4, logprobs=2)])
def test_only_the_request_with_nan_logits_fails(tiny_mistral_dir: str, tmp_path: Path,
                                                params: SamplingParams) -> None:
    clean = LLMEngine.from_kwargs(model=tiny_mistral_dir, dtype="float32", max_model_len=64)
    expected = _one_step(clean, {"ok": [1, 2, 3]}, params)
    model = _poisoned_copy(tiny_mistral_dir, tmp_path, "model.embed_tokens.weight", POISONED_TOKEN)
    engine = LLMEngine.from_kwargs(model=model, dtype="float32", max_model_len=64)
    output = _one_step(engine, {"ok": [1, 2, 3], "bad": [1, POISONED_TOKEN, 3]}, params)
    assert output.failed_request_ids == ["bad"]
    assert output.sampled_token_ids == expected.sampled_token_ids
    assert "bad" not in output.logprobs and output.logprobs.keys() == expected.logprobs.keys()


# ---- the engine ends a failed request with finish_reason "error"; LLM raises a ValueError naming it


def test_llm_generate_raises_naming_the_request_and_frees_everything(tiny_mistral_dir: str,
                                                                     tmp_path: Path) -> None:
    from kvloom import LLM

    model = _poisoned_copy(tiny_mistral_dir, tmp_path, "model.embed_tokens.weight", POISONED_TOKEN)
    llm = LLM(model=model, dtype="float32", max_model_len=64)
    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, POISONED_TOKEN, 3]}]
    with pytest.raises(ValueError, match="request 1: the model produced NaN or infinite logits"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0
    out = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("n, overlap", [(1, False), (2, False), (2, True)])
def test_engine_finishes_the_failed_request_with_error_and_the_others_normally(
        tiny_mistral_dir: str, tmp_path: Path, n: int, overlap: bool) -> None:
    """Every output kind, n > 1, and the overlapped postprocess of CUDA (forced on here)."""
    from kvloom.sampling_params import RequestOutputKind

    model = _poisoned_copy(tiny_mistral_dir, tmp_path, "model.embed_tokens.weight", POISONED_TOKEN)
    engine = LLMEngine.from_kwargs(model=model, dtype="float32", max_model_len=64)
    engine.overlap_postprocess = overlap
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0.7, seed=0, max_tokens=4, ignore_eos=True, n=n, output_kind=kind)
        engine.add_request("ok", {"prompt_token_ids": [1, 2, 3]}, params)
        engine.add_request("bad", {"prompt_token_ids": [1, POISONED_TOKEN, 3]}, params)
        final = {}
        for _ in range(20):
            for output in engine.step():
                if output.finished:
                    final[output.request_id] = output
            if not engine.has_unfinished_requests():
                break
        assert final.keys() == {"ok", "bad"}
        assert final["bad"].outputs and all(c.finish_reason == "error" for c in final["bad"].outputs)
        if kind != RequestOutputKind.DELTA:
            assert [c.finish_reason for c in final["ok"].outputs] == ["length"] * n
            assert all(len(c.token_ids) == 4 for c in final["ok"].outputs)
            assert all(c.token_ids == [] for c in final["bad"].outputs)
        assert engine.kv_cache_manager.usage == 0
        assert not engine.executor.driver.requests  # the runner let go of every request


def test_the_server_answers_a_request_with_nan_logits_with_an_error(tiny_mistral_dir: str, tmp_path: Path,
                                                                     server_factory) -> None:
    """Whole and streamed: an error naming the NaN logits, never a hang; the next request is served."""
    import httpx

    model = _poisoned_copy(tiny_mistral_dir, tmp_path, "model.embed_tokens.weight", POISONED_TOKEN)
    with server_factory(model, "--dtype", "float32", "--max-model-len", "64") as server:
        body = {"model": server.model, "prompt": [1, POISONED_TOKEN, 3], "max_tokens": 4, "temperature": 0}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 500  # the model's fault, not the request's
        error = response.json()["error"]
        assert error["type"] == "server_error" and "NaN or infinite logits" in error["message"]
        streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=30).text
        assert "NaN or infinite logits" in streamed and streamed.rstrip().endswith("data: [DONE]")
        ok = httpx.post(server.url + "/v1/completions", json={**body, "prompt": [1, 2, 3]}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
