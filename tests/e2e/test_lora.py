"""LoRA adapters end to end: each adapter's greedy tokens equal transformers' on the merged model
(W + scaling * B A, fp32), alone and in a batch mixing adapters and the base with fewer compute slots than
adapters (swaps); the prefix cache never shares KV across adapters; int8 weights; what is refused."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from tiny_lora import hf_greedy, merged_hf_model, write_tiny_lora

from kvloom import LLM, LoRARequest, SamplingParams
from kvloom.lora import model_manager

MAX_TOKENS = 10
PROMPTS = [[5, 17, 33, 99, 120, 7, 8, 250], [44, 45, 46, 300, 12, 13], [200, 201, 202, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    """Three adapters: every target at rank 8; rank 4 rsLoRA on a few targets; rank 2 on one layer."""
    root = str(tmp_path_factory.mktemp("adapters"))
    paths = [write_tiny_lora(os.path.join(root, "all"), tiny_llama_dir, rank=8, alpha=16, seed=1),
             write_tiny_lora(os.path.join(root, "rs"), tiny_llama_dir, rank=4, alpha=8, seed=2, use_rslora=True,
                             targets=("q_proj", "v_proj", "o_proj", "down_proj")),
             write_tiny_lora(os.path.join(root, "one"), tiny_llama_dir, rank=2, alpha=4, seed=3,
                             targets=("k_proj", "gate_proj", "up_proj"), layers=(1,), std=0.3)]
    return [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(zip(("all", "rs", "one"), paths))]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: str, adapters: list[LoRARequest]) -> dict[str | None, list[list[int]]]:
    """transformers' greedy tokens per adapter (None: the base) and prompt."""
    result = {}
    for adapter in [None, *adapters]:
        model = merged_hf_model(tiny_llama_dir, None if adapter is None else adapter.lora_path)
        result[None if adapter is None else adapter.lora_name] = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return result


def greedy(llm: LLM, prompts: list[list[int]], lora: list[LoRARequest | None] | LoRARequest | None) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outputs]


def test_a_mixed_batch_with_fewer_slots_than_adapters_matches_the_merged_models(
        tiny_llama_dir: str, adapters: list[LoRARequest], expected: dict) -> None:
    """3 adapters and the base, every prompt under each, in one generate with max_loras=2: the scheduler
    holds some back and the runner swaps slots; each output is its merged model's."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=2)
    loras = [None, *adapters]
    cases = [(lora, index) for index in range(len(PROMPTS)) for lora in loras]
    got = greedy(llm, [PROMPTS[index] for _, index in cases], [lora for lora, _ in cases])
    for (lora, index), tokens in zip(cases, got):
        assert tokens == expected[None if lora is None else lora.lora_name][index], (lora, index)
    assert len({tuple(tokens) for tokens in got[:len(loras)]}) == len(loras)  # the adapters change the output
    # One adapter for every prompt, then the base alone (the layer stack's path where it is built), then chat.
    assert greedy(llm, PROMPTS, adapters[1]) == expected["rs"]
    assert greedy(llm, PROMPTS, None) == expected[None]
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4),
                    use_tqdm=False, lora_request=adapters[0])
    assert len(chat[0].outputs[0].token_ids) == 4


def test_mistral_adapter_matches_the_merged_model(tiny_mistral_dir: str, tmp_path) -> None:
    path = write_tiny_lora(str(tmp_path / "mistral"), tiny_mistral_dir, rank=8, alpha=32, seed=4)
    llm = LLM(tiny_mistral_dir, dtype="float32", max_model_len=128, enable_lora=True)
    model = merged_hf_model(tiny_mistral_dir, path)
    assert greedy(llm, PROMPTS, LoRARequest("m", 1, path)) == [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def test_prefix_cache_is_shared_within_an_adapter_never_across(tiny_llama_dir: str,
                                                               adapters: list[LoRARequest]) -> None:
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8,
              block_size=4)
    kv = llm.llm_engine.kv_cache_manager
    prompt = list(range(20, 60))

    def hits(lora: LoRARequest | None) -> int:
        before = kv.prefix_hits
        greedy(llm, [prompt], lora)
        return kv.prefix_hits - before

    assert hits(adapters[0]) == 0
    assert hits(adapters[1]) == 0   # the same tokens under another adapter: its own KV
    assert hits(None) == 0          # nor the base
    assert hits(adapters[0]) == 36  # the same adapter: every full block before the last token
    assert hits(None) == 36


def test_the_layer_stack_adds_the_deltas_as_the_modules_do(tiny_llama_dir: str, adapters: list[LoRARequest],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on kvloom's C++ ops: a step with adapter tokens stays on the C++ layer stack, which adds each
    projection's delta with the kernel the per-op path's hooks call; the two paths give the same tokens. (With
    oneDNN's products allowed, steps of 4+ tokens would leave the stack for them: kvloom's GEMM alone here.)"""
    monkeypatch.setenv("KVLOOM_CPU_ONEDNN", "0")
    llm = LLM(tiny_llama_dir, dtype="bfloat16", max_model_len=128, enable_lora=True, max_loras=3, max_lora_rank=8,
              enable_prefix_caching=False)
    manager = llm.llm_engine.executor.driver.lora
    if manager.layer_stack is None:
        pytest.skip("no C++ layer stack here (kvloom's CPU library not built, or no bf16 GEMM)")
    loras = [None, *adapters] * len(PROMPTS)
    prompts = [PROMPTS[k // 4] for k in range(len(loras))]
    hook_calls = []
    add_lora_cpu = model_manager.add_lora_cpu
    monkeypatch.setattr(model_manager, "add_lora_cpu", lambda *args: hook_calls.append(1) or add_lora_cpu(*args))
    on_stack = greedy(llm, prompts, loras)
    assert not hook_calls  # no step left the stack for the modules
    monkeypatch.setattr(manager, "layer_stack", None)  # adapter steps now run module by module, through the hooks
    per_op = greedy(llm, prompts, loras)
    assert hook_calls
    assert on_stack == per_op
    assert len({tuple(t) for t in on_stack[:4]}) == 4  # each adapter changes the output


def test_an_adapter_loads_off_the_engine_thread(tiny_llama_dir: str, adapters: list[LoRARequest], expected: dict,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """While an adapter is read from disk (a loader held until the test lets it go), its request waits and a
    base request keeps decoding, step after step; once read, the adapter's tokens are its merged model's."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    release = threading.Event()
    read = model_manager.load_lora_weights
    loader_threads = []

    def slow_read(*args: object) -> object:
        loader_threads.append(threading.current_thread())
        release.wait(timeout=20)  # a synchronous load would hold the step here for 20 s
        return read(*args)

    monkeypatch.setattr(model_manager, "load_lora_weights", slow_read)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    processor = engine.input_processor
    engine.add_request("base", processor.process("base", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True)))
    engine.add_request("tuned", processor.process("tuned", {"prompt_token_ids": PROMPTS[1]}, params,
                                                  lora_request=adapters[0]))
    start = time.perf_counter()
    base_tokens = 0
    while base_tokens < 8:
        for output in engine.step():
            assert output.request_id == "base"
            base_tokens = len(output.outputs[0].token_ids)
        assert time.perf_counter() - start < 10, "the steps waited for the adapter's load"
    while not loader_threads and time.perf_counter() - start < 10:  # 8 steps can finish before the loader starts
        time.sleep(0.01)
    assert loader_threads and threading.current_thread() not in loader_threads
    release.set()
    tuned = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "tuned" and output.finished:
                tuned = output.outputs[0].token_ids
    assert tuned == expected["all"][1]


def test_an_adapter_that_cannot_be_read_ends_its_request_not_the_engine(tiny_llama_dir: str,
                                                                        tmp_path) -> None:  # noqa: ANN001
    """Its tensors hold NaN (the header checks pass; the loader thread's read refuses them): that request ends
    with the reason (a ValueError offline, as a grammar that fails), and the engine goes on serving."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_lora(str(tmp_path / "nan"), tiny_llama_dir, rank=8, alpha=16, seed=5)
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    next(iter(tensors.values()))[0, 0] = float("nan")
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="NaN or infinite"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False,
                     lora_request=[LoRARequest("nan", 7, path), None])
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_int8_base_weights_take_adapters(tiny_llama_dir: str, adapters: list[LoRARequest], expected: dict) -> None:
    """The delta is added to the int8 product's output (int8 quantized without SmoothQuant smoothing, whose
    rescaled activations the adapter was not trained on): an adapter's first tokens under int8 equal its fp32
    merged model's (int8 rounding may flip a later greedy choice), and differ from int8's base."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, quantization="int8", enable_lora=True,
              max_lora_rank=8)
    tuned = greedy(llm, PROMPTS, adapters[0])
    assert tuned != greedy(llm, PROMPTS, None)
    assert all(t[:3] == r[:3] for t, r in zip(tuned, expected["all"]))


def test_requests_for_adapters_are_refused_where_they_cannot_run(tiny_llama_dir: str,
                                                                 adapters: list[LoRARequest]) -> None:
    params = SamplingParams(max_tokens=2)
    plain = LLM(tiny_llama_dir, dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate("hi", params, lora_request=adapters[0], use_tqdm=False)
    speculative = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=8,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="speculative decoding does not run with LoRA"):
        speculative.generate("hi", params, lora_request=adapters[0], use_tqdm=False)
    assert speculative.generate("hi", params, use_tqdm=False)[0].outputs[0].token_ids  # the base still runs
    with pytest.raises(ValueError, match="above max_lora_rank=4"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=4).generate(
            "hi", params, lora_request=adapters[0], use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        speculative.generate(["a", "b"], params, lora_request=[None], use_tqdm=False)


def test_server_serves_adapters_by_model_name(tiny_llama_dir: str, adapters: list[LoRARequest], expected: dict,
                                              server_factory) -> None:  # noqa: ANN001
    """--lora-modules (both forms), /v1/models with parents, a request's model picking its adapter (greedy
    tokens as the merged model's), adapters loaded and unloaded at run time, and the errors of each."""
    import httpx
    import openai

    all_, rs, one = adapters
    flags = ["--dtype", "float32", "--max-model-len", "128", "--enable-lora", "--max-loras", "2",
             "--max-lora-rank", "8", "--lora-modules", f"all={all_.lora_path}",
             json.dumps({"name": "rs", "path": rs.lora_path, "base_model_name": tiny_llama_dir})]
    with server_factory(tiny_llama_dir, *flags, env={"KVLOOM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {tiny_llama_dir, "all", "rs"}
        assert cards["all"].parent == tiny_llama_dir and cards["rs"].root == rs.lora_path

        offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, enable_lora=True, max_loras=3,
                      max_lora_rank=8)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

        def complete(model: str, index: int = 0) -> str:
            response = client.completions.create(model=model, prompt=PROMPTS[index], max_tokens=MAX_TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True})
            assert response.model == model
            return response.choices[0].text

        def oracle(lora: LoRARequest | None, index: int) -> str:
            output = offline.generate({"prompt_token_ids": PROMPTS[index]}, params, lora_request=lora,
                                      use_tqdm=False)[0].outputs[0]
            assert output.token_ids == expected[None if lora is None else lora.lora_name][index]
            return output.text

        for model, lora in ((tiny_llama_dir, None), ("all", all_), ("rs", rs)):
            assert complete(model, 1) == oracle(lora, 1), model
        chat = client.chat.completions.create(model="all", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3)
        assert chat.model == "all"

        post = lambda route, body: httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)  # noqa: E731
        assert post("load_lora_adapter", {"lora_name": "one", "lora_path": one.lora_path}).status_code == 200
        assert complete("one", 2) == oracle(one, 2)
        bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": one.lora_path + "/nowhere"})
        assert bad.status_code == 400 and "no such directory" in bad.json()["error"]["message"]
        assert post("load_lora_adapter", {"lora_name": "one", "lora_path": one.lora_path}).status_code == 400
        assert post("load_lora_adapter", {"lora_name": "x"}).json()["error"]["param"] == "lora_path"
        assert post("unload_lora_adapter", {"lora_name": "one"}).status_code == 200
        assert post("unload_lora_adapter", {"lora_name": "one"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("one")
        assert complete("all", 0) == oracle(all_, 0)  # the server keeps going
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'kvloom:lora_requests_info{max_lora="2"' in metrics

