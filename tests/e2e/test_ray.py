"""Tensor parallelism on Ray (``distributed_executor_backend="ray"``): TP=2 with its ranks on two
nodes of a real Ray cluster gives TP=1's greedy tokens; a rank that dies fails the step with an
error naming it (never a hang) and the engine reports itself dead; shutdown leaves no actor.

The two-node test runs its cluster in a private network namespace (root, ``unshare -n``) so that
Ray binds 127.0.0.1 only; the others use one local Ray node started in this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from kvloom import LLM, SamplingParams
from kvloom.config import EngineConfig

from .test_correctness import mixed_prompts

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvloom[ray]')")

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TOKENS = 12
needs_two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor_parallel_size=2 needs 2 cores")


def can_make_network_namespace() -> str | None:
    """None when this process can run a command in a private network namespace, else why not."""
    if os.geteuid() != 0:
        return "a private network namespace (unshare -n) needs root"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is not installed"
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -n failed: {probe.stderr.strip()}"
    return None


def run_in_namespace(request: dict, timeout: float = 240.0) -> dict:
    """Run tests/e2e/ray_two_nodes.py in a new network namespace; its JSON answer."""
    command = f"ip link set lo up && exec {sys.executable} {os.path.join(HERE, 'ray_two_nodes.py')} " \
              f"{json.dumps(json.dumps(request))}"
    # json.dumps twice: a JSON string literal is also a valid shell double-quoted word here
    done = subprocess.run(["unshare", "-n", "sh", "-c", command], capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.dirname(HERE)))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray node in this process, its files in a private RAY_TMPDIR."""
    previous = os.environ.get("RAY_TMPDIR")
    with tempfile.TemporaryDirectory(prefix="kvr-", dir="/tmp") as temp_dir:
        os.environ["RAY_TMPDIR"] = temp_dir
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
            if previous is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = previous


def ray_llm(model_dir: str) -> LLM:
    return LLM(model=model_dir, dtype="float32", device="cpu", max_model_len=256, tensor_parallel_size=2,
               distributed_executor_backend="ray")


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


@needs_two_cores
def test_tp2_with_one_rank_on_each_of_two_ray_nodes_equals_tp1(tiny_llama_dir: str) -> None:
    reason = can_make_network_namespace()
    if reason:
        pytest.skip(reason)
    prompts = mixed_prompts(400, count=6, seed=5)
    answer = run_in_namespace({"kind": "tp", "model": tiny_llama_dir, "prompts": prompts, "max_tokens": MAX_TOKENS})
    assert len(answer["nodes"]) == 2 and set(answer["nodes"]) == {"127.0.0.1"}
    assert len(answer["rank_nodes"]) == 1 and answer["rank_nodes"][0] != answer["driver_node"]
    tp1 = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", max_model_len=256)
    assert answer["token_ids"] == greedy(tp1, prompts)


@needs_two_cores
def test_ray_rank_that_dies_fails_the_step_naming_it(tiny_llama_dir: str, local_ray) -> None:
    llm = ray_llm(tiny_llama_dir)
    try:
        assert greedy(llm, [[5, 6, 7]])
        actor = llm.llm_engine.executor.ranks.actors[0]
        ray.kill(actor)
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(Ray actor on node .*\) failed"):
            greedy(llm, [[5, 6, 7, 8]])
        with pytest.raises(RuntimeError, match="cannot continue"):
            greedy(llm, [[8, 9]])
    finally:
        llm.llm_engine.shutdown()


@needs_two_cores
def test_async_engine_on_ray_fails_its_requests_and_reports_dead_when_a_rank_dies(
        tiny_llama_dir: str, local_ray) -> None:
    from kvloom.engine.async_engine import AsyncLLM, EngineDeadError

    config = EngineConfig(model=tiny_llama_dir, dtype="float32", device="cpu", max_model_len=256,
                          tensor_parallel_size=2, distributed_executor_backend="ray")
    engine = AsyncLLM.from_config(config, stats_interval=0)

    async def run(prompt: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        final = None
        async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id=str(prompt)):
            final = output
        return final.outputs[0].token_ids

    async def scenario() -> None:
        assert len(await run([5, 6, 7], 4)) == 4
        long = asyncio.ensure_future(run([9, 10, 11], 250 - 3))
        await asyncio.sleep(0.3)
        ray.kill(engine.engine.executor.ranks.actors[0])
        with pytest.raises(EngineDeadError, match="rank 1"):
            await asyncio.wait_for(long, timeout=60)  # an error, never a hang

    try:
        asyncio.run(scenario())
        assert engine.errored
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()
        engine.engine.shutdown()


@needs_two_cores
def test_ray_shutdown_kills_the_actors_and_frees_the_placement_group(tiny_llama_dir: str, local_ray) -> None:
    from ray.util import placement_group_table

    llm = ray_llm(tiny_llama_dir)
    executor = llm.llm_engine.executor
    watch = list(executor.ranks.watch)
    placement_group = executor.ranks.placement_group
    llm.llm_engine.shutdown()
    ready, _ = ray.wait(watch, num_returns=len(watch), timeout=30)
    assert len(ready) == len(watch)  # wait_forever only ends when its actor is gone
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(watch[0])
    assert placement_group_table(placement_group)["state"] == "REMOVED"
    with pytest.raises(RuntimeError, match="shut down"):
        greedy(llm, [[5, 6]])

