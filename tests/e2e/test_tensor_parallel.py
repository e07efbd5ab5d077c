"""Tensor parallelism on the CPU (gloo): TP=2 gives TP=1's tokens (and transformers'), refuses what
cannot be split, and never leaves a worker process behind."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvloom import LLM, SamplingParams

from .test_correctness import hf_greedy, mixed_prompts

MAX_TOKENS = 16
needs_two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 needs 2 cores")


def make_llm(model_dir: str, tensor_parallel_size: int) -> LLM:
    return LLM(model=model_dir, dtype="float32", device="cpu", max_model_len=256,
               tensor_parallel_size=tensor_parallel_size)


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
              ) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def worker_processes(llm: LLM) -> list[multiprocessing.Process]:
    return llm.llm_engine.executor.workers.processes


def is_running(pid: int) -> bool:
    """True while pid runs; a zombie (exited, not yet reaped by its new parent) counts as gone."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after waiting up to timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if is_running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tp1(tiny_llama_dir: str) -> LLM:
    return make_llm(tiny_llama_dir, 1)


@pytest.fixture(scope="module")
def tp2(tiny_llama_dir: str):
    llm = make_llm(tiny_llama_dir, 2)
    yield llm
    llm.llm_engine.shutdown()


def thread_cores(pid: int) -> set[tuple[int, ...]]:
    """The distinct core sets of a process's threads (/proc/<pid>/task/*/status Cpus_allowed_list)."""
    from kvloom.cpu_affinity import parse_cpu_list

    cores = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/status") as f:
            line = next(line for line in f if line.startswith("Cpus_allowed_list:"))
            cores.add(parse_cpu_list(line.split(":", 1)[1].strip()))
    return cores


@needs_two_cores
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread affinities from /proc")
def test_ranks_run_on_disjoint_cores_and_rank_0_gets_its_cores_back(tiny_llama_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cpu_omp_threads_bind ("auto"): each rank pinned to its own half of the usable cores
    (rank 0 is this process: every thread of it), a torch thread per core; shutdown gives rank 0's process
    its cores back. First in the module: the module's tp2 engine pins this process while it lives."""
    from kvloom.cpu_affinity import usable_cpus

    monkeypatch.delenv("KVLOOM_CPU_OMP_THREADS_BIND", raising=False)
    usable = usable_cpus()
    if len(usable) < 2:
        pytest.skip(f"this process may use only core(s) {usable}")
    share = len(usable) // 2
    before = os.sched_getaffinity(0)
    llm = make_llm(tiny_llama_dir, 2)
    try:
        worker = worker_processes(llm)[0]
        assert thread_cores(os.getpid()) == {tuple(usable[:share])}
        assert thread_cores(worker.pid) == {tuple(usable[share:2 * share])}
        assert torch.get_num_threads() == share
        assert token_ids(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    finally:
        llm.llm_engine.shutdown()
    assert os.sched_getaffinity(0) == before


@needs_two_cores
def test_tp2_greedy_equals_tp1_and_transformers(tiny_llama_dir: str, tp1: LLM, tp2: LLM) -> None:
    prompts = mixed_prompts(400, count=10, seed=3)  # one batch of mixed prefill lengths, then decodes
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    assert token_ids(tp1, prompts, params) == expected
    assert token_ids(tp2, prompts, params) == expected


@needs_two_cores
def test_tp2_seeded_sampling_and_logprobs_equal_tp1(tp1: LLM, tp2: LLM) -> None:
    prompts = mixed_prompts(400, count=8, seed=4)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True, logprobs=3) for i in range(len(prompts))]
    out1 = tp1.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out2 = tp2.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(out1, out2):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step1, step2 in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step1.keys() == step2.keys()
            for token_id in step1:
                # fp32; the all-reduce sums the two halves of each projection in another order
                assert abs(step1[token_id].logprob - step2[token_id].logprob) < 1e-4


@needs_two_cores
def test_each_rank_holds_half_the_heads_and_half_the_kv_cache(tp1: LLM, tp2: LLM) -> None:
    executor1, executor2 = tp1.llm_engine.executor, tp2.llm_engine.executor
    assert executor2.driver.kv_bytes_per_block() * 2 == executor1.driver.kv_bytes_per_block()
    attention = executor2.driver.model.layers[0].self_attn
    full = executor1.driver.model.layers[0].self_attn
    assert (attention.num_heads, attention.num_kv_heads) == (full.num_heads // 2, full.num_kv_heads // 2)
    assert attention.qkv_proj.weight.shape[0] * 2 == full.qkv_proj.weight.shape[0]
    assert attention.o_proj.weight.shape[1] * 2 == full.o_proj.weight.shape[1]
    # Rank 0 keeps the first q heads, the first k heads and the first v heads.
    q, kv = full.q_size, full.kv_size
    rows = [full.qkv_proj.weight[:q // 2], full.qkv_proj.weight[q:q + kv // 2],
            full.qkv_proj.weight[q + kv:q + kv + kv // 2]]
    assert torch.equal(attention.qkv_proj.weight, torch.cat(rows))


@needs_two_cores
def test_shutdown_joins_every_worker(tiny_llama_dir: str) -> None:
    llm = make_llm(tiny_llama_dir, 2)
    processes = worker_processes(llm)
    assert len(processes) == 1 and processes[0].is_alive()
    pids = [p.pid for p in processes]
    assert token_ids(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    llm.llm_engine.shutdown()
    assert [p.exitcode for p in processes] == [0]  # left on request, not terminated
    assert not [p for p in multiprocessing.active_children() if p in processes]
    assert wait_gone(pids, timeout=0) == []
    llm.llm_engine.shutdown()  # a second shutdown is harmless
    with pytest.raises(RuntimeError, match="shut down"):
        token_ids(llm, [[5, 6, 7]], SamplingParams(max_tokens=2))


@needs_two_cores
def test_dead_worker_raises_instead_of_hanging(tiny_llama_dir: str) -> None:
    llm = make_llm(tiny_llama_dir, 2)
    process = worker_processes(llm)[0]
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(RuntimeError, match="rank 1 exited with code -9"):
        token_ids(llm, [[5, 6, 7]], params)
    with pytest.raises(RuntimeError, match="cannot continue"):
        token_ids(llm, [[8, 9]], params)
    llm.llm_engine.shutdown()


@needs_two_cores
def test_workers_exit_when_the_driver_process_is_killed(tiny_llama_dir: str) -> None:
    script = textwrap.dedent(f"""
        import time
        from kvloom import LLM, SamplingParams
        llm = LLM(model={tiny_llama_dir!r}, dtype="float32", device="cpu", max_model_len=128,
                  tensor_parallel_size=2)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        print(*[p.pid for p in llm.llm_engine.executor.workers.processes], flush=True)
        time.sleep(60)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 1
    finally:
        driver.kill()
        driver.wait()
    assert wait_gone(pids, timeout=10) == []


@needs_two_cores
@needs_two_cores
def test_tp2_shards_the_experts(tmp_path) -> None:
    """Qwen2-MoE (routed experts cut along their intermediate dimension, the shared expert as a dense MLP):
    TP=2 gives transformers' greedy tokens. (int8 experts are cut alike: tests/unit/test_moe.py.)"""
    from tiny_models import build_tiny_family_checkpoint

    model_dir = build_tiny_family_checkpoint(str(tmp_path / "moe"), "qwen2_moe")
    prompts = mixed_prompts(400, count=3, seed=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    try:
        assert token_ids(llm, prompts, params) == hf_greedy(model_dir, prompts, 8)
    finally:
        llm.llm_engine.shutdown()


def test_heads_that_do_not_divide_are_refused(tmp_path) -> None:
    """SmolLM2-135M's shape: 9 heads, 3 KV heads; vLLM refuses tensor_parallel_size=2 too."""
    from tiny_models import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(str(tmp_path / "nine-heads"), hidden_size=72, num_attention_heads=9,
                                      num_key_value_heads=3, intermediate_size=96,
                                      num_hidden_layers=1)
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible by tensor_parallel_size "
                                         r"\(2\).*one of \[1, 3\]"):
        make_llm(model_dir, 2)
    assert multiprocessing.active_children() == before  # refused before any worker started


def test_more_ranks_than_cores_are_refused(tiny_llama_dir: str) -> None:
    cores = os.cpu_count() or 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size={cores + 1} is larger than this "
                                         f"machine's {cores} CPU cores"):
        make_llm(tiny_llama_dir, cores + 1)


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry))
    return children


@needs_two_cores
def test_served_rank_that_dies_fails_the_stream_and_health_says_503(tiny_llama_dir: str, server_factory) -> None:
    """A TP worker killed mid-stream: the stream ends with an error event within seconds (never a hang),
    /health answers 503, and new requests get a 503 naming the dead rank."""
    import json
    import threading

    import httpx

    with server_factory(tiny_llama_dir, "--tensor-parallel-size", "2", "--max-model-len", "256") as server:
        body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
        received: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
                received.extend(response.iter_lines())

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 30
        while not any(line.startswith("data: {") for line in received) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = [pid for pid in _children(server.process.pid)
                   if "kvloom-tp-worker" in open(f"/proc/{pid}/cmdline").read() or
                   "multiprocessing" in open(f"/proc/{pid}/cmdline").read()]
        assert workers, "no worker process found"
        killed_at = time.monotonic()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after its rank died"
        assert time.monotonic() - killed_at < 15
        errors = [json.loads(line[6:])["error"] for line in received if line.startswith("data: {\"error\"")]
        assert errors and "rank 1 exited" in errors[0]["message"]
        assert errors and [line for line in received if line][-1] == "data: [DONE]"
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        response = httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert response.status_code == 503 and "rank" in response.json()["error"]["message"]
