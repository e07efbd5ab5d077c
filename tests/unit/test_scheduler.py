"""Scheduler and KV cache manager, without a model: a fake step appends deterministic tokens."""

from __future__ import annotations

import random

import pytest

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.scheduler import Scheduler
from kvloom.sampling_params import SamplingParams
from kvloom.step_io import ModelRunnerOutput


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, eos: int | None = None,
                 max_model_len: int = 1024) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(request_id, prompt, params, {eos} if eos is not None else set(), max_model_len)


def runner_output(sampled: dict[str, int]) -> ModelRunnerOutput:
    """What the runner returns for one sampled token per request."""
    return ModelRunnerOutput(sampled_token_ids={request_id: [token] for request_id, token in sampled.items()})


def next_token(request: Request) -> int:
    """Deterministic, depends only on the request's tokens: any schedule must give the same output."""
    return (sum(request.all_token_ids) * 31 + len(request.all_token_ids)) % 97 + 3


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    tracked = dict(scheduler.requests)
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        assert not out.is_empty, "the scheduler stalled with requests pending"
        assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        for item in out.scheduled:
            request = tracked[item.request_id]
            # Every scheduled token has a slot.
            assert len(request.block_ids) * scheduler.kv.block_size >= request.num_computed_tokens
        sampled = {s.request_id: next_token(tracked[s.request_id]) for s in out.scheduled if s.samples}
        scheduler.update_from_output(out, runner_output(sampled))
        scheduler.kv.check_integrity()
    else:
        pytest.fail("requests did not finish")
    for request_id, request in tracked.items():
        outputs[request_id] = request.output_token_ids
    return outputs


def assert_no_leak(kv: KVCacheManager) -> None:
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"


def test_allocate_and_free_round_trip() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=4)
    request = make_request("a", list(range(10)))
    assert kv.allocate_slots(request, 10)
    assert len(request.block_ids) == 3
    assert 0 not in request.block_ids  # the null block is never handed out
    assert kv.num_free_blocks == 5
    kv.free(request)
    assert request.block_ids == []
    assert_no_leak(kv)


def test_allocation_fails_cleanly_when_out_of_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    request = make_request("a", list(range(12)))
    assert not kv.allocate_slots(request, 12)
    assert request.block_ids == []
    assert_no_leak(kv)


def test_prefix_hits_share_full_blocks_and_never_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.allocate_slots(first, 12)
    second = make_request("b", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(second)
    # 12 tokens = 3 full blocks, but the last token must be recomputed: 2 blocks hit.
    assert num_hit == 8
    assert [b.block_id for b in blocks] == first.block_ids[:2]
    second.num_computed_tokens = 0
    assert kv.allocate_slots(second, 4, blocks)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert kv.blocks[first.block_ids[0]].ref_count == 2
    kv.free(first)
    kv.free(second)
    assert_no_leak(kv)


def test_different_prefix_does_not_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(first, 9)
    other = make_request("b", [1, 2, 3, 5, 5, 6, 7, 8, 9])
    _, num_hit = kv.get_computed_blocks(other)
    assert num_hit == 0
    kv.free(first)
    assert_no_leak(kv)


def test_freed_cached_blocks_are_reused_in_lru_order_and_evicted() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=2)  # 4 usable blocks
    a = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)  # 3 blocks: [1,2] [3,4] [5]
    head, second, partial = a.block_ids
    kv.free(a)
    # The unnamed partial block is handed out first; of the cached ones, the tail before the head.
    order = list(kv.free_queue)
    assert order[0] == partial
    assert order.index(second) < order.index(head)
    b = make_request("b", [1, 2, 3, 4, 9])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4  # the freed blocks stay findable
    assert kv.allocate_slots(b, 1, blocks)
    kv.free(b)
    # Fill the whole cache with something else: the cached blocks are evicted.
    c = make_request("c", [7] * 8)
    assert kv.allocate_slots(c, 8)
    assert a.block_hashes and not set(a.block_hashes) & set(kv.cached)  # a's blocks were evicted for c's
    d = make_request("d", [1, 2, 3, 4, 9])
    kv.free(c)
    _, num_hit = kv.get_computed_blocks(d)
    assert num_hit == 0
    assert_no_leak(kv)


def test_budget_and_max_num_seqs_are_respected_and_prompts_chunked() -> None:
    kv = KVCacheManager(num_blocks=200, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=10, max_model_len=256)
    for i in range(6):
        scheduler.add_request(make_request(str(i), [i + 1] * (5 + 7 * i), max_tokens=3))
    out = scheduler.schedule()
    assert out.num_batched_tokens == 10
    assert sum(s.num_new_tokens for s in out.scheduled) == 10
    assert len(out.scheduled) <= 3
    scheduler.update_from_output(out, runner_output({s.request_id: 5 for s in out.scheduled if s.samples}))
    run_to_completion(scheduler)
    assert_no_leak(kv)


def test_decode_and_prefill_share_a_step() -> None:
    kv = KVCacheManager(num_blocks=100, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    scheduler.add_request(make_request("a", [1] * 5, max_tokens=5))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output({"a": 7}))
    scheduler.add_request(make_request("b", [2] * 9, max_tokens=5))
    out = scheduler.schedule()
    news = {s.request_id: s.num_new_tokens for s in out.scheduled}
    assert news == {"a": 1, "b": 9}
    scheduler.update_from_output(out, runner_output({"a": 7, "b": 8}))
    run_to_completion(scheduler)
    assert_no_leak(kv)


def test_preemption_recomputes_and_gives_the_same_tokens() -> None:
    prompts = [[(i * 7 + j) % 50 + 1 for j in range(6 + i)] for i in range(6)]

    def run(num_blocks: int, budget: int) -> tuple[dict[str, list[int]], int]:
        kv = KVCacheManager(num_blocks=num_blocks, block_size=2)
        scheduler = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=64)
        for i, prompt in enumerate(prompts):
            scheduler.add_request(make_request(str(i), prompt, max_tokens=12))
        outputs = run_to_completion(scheduler)
        assert_no_leak(kv)
        return outputs, scheduler.num_preemptions

    roomy, roomy_preemptions = run(num_blocks=200, budget=256)
    tight, tight_preemptions = run(num_blocks=13, budget=256)
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    assert tight == roomy


def test_preempts_the_newest_running_request() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=2)  # 4 usable blocks
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    old = make_request("old", [1, 2, 3], max_tokens=5)
    new = make_request("new", [4, 5, 6], max_tokens=5)
    scheduler.add_request(old)
    scheduler.add_request(new)
    out = scheduler.schedule()  # 2 blocks each
    scheduler.update_from_output(out, runner_output({"old": 9, "new": 9}))  # 4 tokens each: still fits
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output({"old": 9, "new": 9}))  # 5 tokens each: needs a 3rd block
    out = scheduler.schedule()
    assert out.preempted_request_ids == ["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new
    scheduler.update_from_output(out, runner_output({s.request_id: 9 for s in out.scheduled if s.samples}))
    run_to_completion(scheduler)
    assert_no_leak(kv)


def test_random_workloads_never_deadlock_or_leak() -> None:
    rng = random.Random(0)
    for trial in range(20):
        block_size = rng.choice([1, 2, 4, 16])
        max_model_len = 64
        kv = KVCacheManager(num_blocks=rng.randint(max_model_len // block_size + 2, 80), block_size=block_size,
                            enable_prefix_caching=rng.random() < 0.7)
        scheduler = Scheduler(kv, max_num_seqs=rng.randint(1, 8),
                              max_num_batched_tokens=rng.randint(1, 40), max_model_len=max_model_len)
        for i in range(rng.randint(1, 12)):
            prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, 30))]
            request = make_request(f"{trial}-{i}", prompt, max_tokens=rng.randint(1, 20), eos=50,
                                   max_model_len=max_model_len)
            scheduler.check_fits(len(prompt), request.sampling_params.max_tokens)
            scheduler.add_request(request)
        run_to_completion(scheduler)
        assert_no_leak(kv)


def test_request_that_can_never_fit_is_refused() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 16 tokens of cache
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        scheduler.check_fits(64, 1)
    with pytest.raises(ValueError, match="KV cache"):
        scheduler.check_fits(10, 20)
    scheduler.check_fits(10, 6)


def test_abort_frees_blocks_at_once() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    scheduler.add_request(make_request("a", [1] * 9, max_tokens=10))
    scheduler.add_request(make_request("b", [2] * 9, max_tokens=10))
    scheduler.schedule()
    finished = scheduler.finish_requests(["a", "b", "missing"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"a", "b"}
    assert not scheduler.has_unfinished_requests()
    assert_no_leak(kv)
