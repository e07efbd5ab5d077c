"""Speculative decoding's parts: n-gram prompt lookup, and the rejection sampler against the exact
distributions it must keep (statistically, over many rows in one batch)."""

from __future__ import annotations

import pytest
import torch

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import Request, RequestStatus
from kvloom.engine.scheduler import Scheduler
from kvloom.sample.rejection_sampler import greedy_rejection_sample, rejection_sample
from kvloom.sampling_params import SamplingParams
from kvloom.spec_decode.adaptive import SpeculationController
from kvloom.spec_decode.ngram import NgramProposer
from kvloom.step_io import ModelRunnerOutput


def test_ngram_proposes_the_continuation_of_the_most_recent_match() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    # [7, 8] appears at 0 and at 4; the most recent earlier one (at 4) is followed by 5, 6.
    assert proposer.propose([7, 8, 1, 2, 7, 8, 5, 6, 9, 7, 8]) == [5, 6, 9]
    assert proposer.propose([1, 2, 3, 1, 2]) == [3, 1, 2]  # the longest n (2) matches first
    assert proposer.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert proposer.propose([5]) == []
    assert proposer.propose([4, 4, 4], k=5) == [4]  # the continuation ends at the sequence's end
    only_long = NgramProposer(2, prompt_lookup_max=3, prompt_lookup_min=3)
    assert only_long.propose([1, 2, 9, 1, 2]) == []  # a 2-gram recurs, but 3 are required
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0, 3)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, prompt_lookup_max=1, prompt_lookup_min=2)


def _dist(values: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(values, minlength=vocab).double() / values.numel()


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_probs: bool) -> None:
    """Each emitted position follows the target's distribution there, whatever the drafts proposed."""
    torch.manual_seed(0)
    rows, vocab, k = 200_000, 6, 2
    target = torch.softmax(torch.randn(k + 1, vocab) * 1.5, dim=-1)  # p_1, p_2, p_3
    draft = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)  # q_1, q_2
    generator = torch.Generator().manual_seed(1)
    if with_draft_probs:
        drafts = torch.stack([torch.multinomial(draft[i], rows, replacement=True, generator=generator)
                              for i in range(k)], dim=1)
        draft_probs = draft[None].expand(rows, k, vocab)
    else:  # n-gram style: a fixed guess, one-hot q
        drafts = torch.tensor([[2, 4]]).expand(rows, k)
        draft_probs = None
    out = rejection_sample(drafts, torch.full((rows,), k), target[None].expand(rows, k + 1, vocab), draft_probs,
                           greedy=torch.zeros(rows, dtype=torch.bool), generator=generator)
    assert out.num_emitted.min() >= 1 and out.num_emitted.max() <= k + 1
    for position in range(k + 1):
        emitted = out.output_token_ids[out.num_emitted > position, position]
        assert (emitted >= 0).all()
        total_variation = 0.5 * (_dist(emitted, vocab) - target[position].double()).abs().sum()
        # About five standard deviations of the sampling noise for this many rows (0.008 at 200,000).
        assert emitted.numel() > 500
        assert total_variation < 1.5 * (vocab / emitted.numel()) ** 0.5, (position, emitted.numel(), total_variation)


def test_rejection_sampling_greedy_accepts_the_argmax_prefix() -> None:
    vocab = 5
    target = torch.zeros(3, 4, vocab)
    argmaxes = [[1, 2, 3, 4], [1, 0, 3, 4], [0, 0, 0, 2]]
    for row, ids in enumerate(argmaxes):
        for position, token in enumerate(ids):
            target[row, position, token] = 1.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 0, 9]])
    out = rejection_sample(drafts, torch.tensor([3, 3, 2]), target, None,
                           greedy=torch.ones(3, dtype=torch.bool))
    # Row 0: all three accepted, then the bonus. Row 1: the second is wrong: the target's 0 replaces it.
    # Row 2: two drafts (the padding 9 is not one), both accepted, then the bonus at position 2.
    assert out.num_emitted.tolist() == [4, 2, 3]
    assert out.output_token_ids.tolist() == [[1, 2, 3, 4], [1, 0, -1, -1], [0, 0, 0, -1]]
    # The all-greedy path (argmaxes only, nothing drawn) gives the same.
    fast = greedy_rejection_sample(drafts, torch.tensor([3, 3, 2]), target.argmax(dim=-1))
    assert torch.equal(fast.num_emitted, out.num_emitted) and torch.equal(fast.output_token_ids, out.output_token_ids)


def test_rejection_sampling_seeded_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    vocab, k = 50, 3
    target = torch.softmax(torch.randn(4, k + 1, vocab), dim=-1)
    drafts = torch.randint(0, vocab, (4, k))

    def run(rows: list[int]) -> list[list[int]]:
        generators = {i: torch.Generator().manual_seed(100 + row) for i, row in enumerate(rows)}
        out = rejection_sample(drafts[rows], torch.full((len(rows),), k), target[rows], None,
                               greedy=torch.zeros(len(rows), dtype=torch.bool), generators=generators,
                               generator=torch.Generator().manual_seed(len(rows)))
        return out.output_token_ids.tolist()

    together = run([0, 1, 2, 3])
    assert run([2]) == [together[2]]
    assert run([3, 0]) == [together[3], together[0]]


def test_rejection_sampling_without_drafts_samples_the_target() -> None:
    target = torch.tensor([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])
    out = rejection_sample(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), target, None,
                           greedy=torch.tensor([False, True]))
    assert out.num_emitted.tolist() == [1, 1]
    assert out.output_token_ids.tolist() == [[1], [2]]


def test_scheduler_schedules_the_runners_drafts_and_reserves_lookahead_slots() -> None:
    """With a draft model the runner proposes: the scheduler keeps its drafts for the next step (cut to the
    output limit), reserves slots past the step for the draft's own KV, and rolls back what was rejected."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_lookahead_tokens=3)
    request = Request("a", list(range(10, 16)), SamplingParams(temperature=0, max_tokens=4))
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.scheduled[0].token_ids == list(range(10, 16))
    assert len(request.block_ids) == 3  # 6 prompt tokens + 3 lookahead slots
    scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [20]},
                                                        draft_token_ids={"a": [21, 22, 23]}))
    assert request.spec_token_ids == [21, 22, 23]
    out = scheduler.schedule()
    item = out.scheduled[0]
    # 1 output so far, 4 allowed: the target's own token and 2 drafts at most.
    assert (item.token_ids, item.num_draft_tokens, item.num_computed_tokens) == ([20, 21, 22], 2, 6)
    assert request.spec_token_ids == []
    assert len(request.block_ids) == 3  # 9 tokens + 1 lookahead slot: never past the final length (6 + 4)
    scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [21, 30]},
                                                        draft_token_ids={"a": [31, 32, 33]}))
    assert request.output_token_ids == [20, 21, 30]
    assert request.num_computed_tokens == 8  # the rejected draft (22) is computed again
    assert request.spec_token_ids == [31, 32, 33]
    out = scheduler.schedule()
    assert (out.scheduled[0].token_ids, out.scheduled[0].num_draft_tokens) == ([30], 0)  # one output left


def test_for_eagle_a_block_is_named_with_the_token_after_it() -> None:
    """EAGLE's KV at a block's last position depends on the next token: a block filled by a request that went on
    with another token is no hit (and the last known token is never served from the cache)."""
    for with_next, same_next, diverging in ((False, 8, 8), (True, 8, 4)):
        kv = KVCacheManager(num_blocks=16, block_size=4, name_with_next_token=with_next)
        first = Request("a", list(range(11)), SamplingParams(max_tokens=1))
        assert kv.allocate_slots(first, 11)
        second = Request("b", list(range(10)) + [99], SamplingParams(max_tokens=1))
        assert kv.get_computed_blocks(second)[1] == same_next  # blocks 0-3 and 4-7, each followed as in "a"
        third = Request("c", list(range(8)) + [99, 9, 10], SamplingParams(max_tokens=1))
        assert kv.get_computed_blocks(third)[1] == diverging  # block 4-7 was followed by 8, here by 99


PATTERN = list(range(1, 9))


def _speculating_scheduler(k: int = 4, speculation: SpeculationController | None = None, names: str = "a"
                           ) -> Scheduler:
    """A scheduler with n-gram lookup and decoding requests that repeat PATTERN, so lookup always finds k drafts."""
    kv = KVCacheManager(num_blocks=64, block_size=16)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024,
                          proposer=NgramProposer(k, prompt_lookup_max=2, prompt_lookup_min=1), speculation=speculation)
    for name in names:
        scheduler.add_request(Request(name, PATTERN * 3, SamplingParams(temperature=0, max_tokens=500,
                                                                        ignore_eos=True)))
    _step(scheduler, accept=True)
    return scheduler


def _step(scheduler: Scheduler, accept: bool) -> list[int]:
    """One step whose drafts are all accepted (or all rejected: the target's token is the pattern's next one
    all the same, so lookup keeps finding drafts); the drafts each request had."""
    out = scheduler.schedule()
    sampled = {}
    for item in out.scheduled:
        request = scheduler.requests[item.request_id]
        kept = item.num_draft_tokens if accept else 0
        sampled[item.request_id] = [PATTERN[(request.num_tokens + j) % 8] for j in range(kept + 1)]
    scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return [item.num_draft_tokens for item in out.scheduled]


def _drafts_per_step(scheduler: Scheduler, steps: int, accept: bool) -> list[int]:
    return [_step(scheduler, accept)[0] for _ in range(steps)]


def test_a_request_whose_drafts_are_always_rejected_backs_off_to_rare_probes() -> None:
    scheduler = _speculating_scheduler()
    request = scheduler.requests["a"]
    counts = _drafts_per_step(scheduler, 200, accept=False)
    assert counts[0] == 4  # a new request is tried at k
    assert counts[:8] == sorted(counts[:8], reverse=True)  # fewer as the rejections come in
    backed_off = counts.index(0)
    assert backed_off <= 10
    probes = [i for i, n in enumerate(counts) if i > backed_off and n]
    assert all(counts[i] == 1 for i in probes)  # a probe is one draft
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 4 and gaps == sorted(gaps) and gaps[-1] >= 32  # each failed probe waits longer
    assert sum(counts[100:]) <= 3
    assert request.draft_stats.first_rate < 0.05


def test_a_request_whose_drafts_are_always_accepted_keeps_k() -> None:
    scheduler = _speculating_scheduler()
    assert _drafts_per_step(scheduler, 30, accept=True) == [4] * 30


def test_a_backed_off_request_whose_probe_holds_returns_to_k() -> None:
    scheduler = _speculating_scheduler()
    counts = _drafts_per_step(scheduler, 60, accept=False)
    assert counts[-10:] == [0] * 10
    counts = _drafts_per_step(scheduler, 80, accept=True)
    first_probe = next(i for i, n in enumerate(counts) if n)
    assert counts[first_probe + 12:] == [4] * (len(counts) - first_probe - 12)


def test_a_model_drafters_longer_memory_keeps_a_request_that_often_holds_drafting() -> None:
    """A guess that holds 45% of the time, independently each step (an EAGLE head's, roughly): with n-gram's
    five-step memory a few misses in a row send the request to no drafts; with a model drafter's twenty it
    never falls that low (at batch 1's threshold of ~0.1)."""
    import random

    from kvloom.spec_decode.adaptive import DECAY, MODEL_DECAY, DraftStats, drafts_worth_proposing

    rng = random.Random(0)
    holds = [rng.random() < 0.45 for _ in range(400)]
    steps_without_drafts = {}
    for decay in (DECAY, MODEL_DECAY):
        stats, zeros = DraftStats(), 0
        for held in holds:
            k = drafts_worth_proposing(stats, 0.1, 4)
            zeros += k == 0
            stats.observe(max(k, 1), int(held), decay)  # at 0 a probe of one draft
        steps_without_drafts[decay] = zeros
    assert steps_without_drafts[MODEL_DECAY] == 0 < steps_without_drafts[DECAY], steps_without_drafts


def test_probes_that_hold_but_leave_drafts_unprofitable_grow_rarer() -> None:
    """At 64 sequences (threshold ~0.93 before any measurement) a request whose guesses hold 45% of the time
    never pays for a draft: its probes keep doubling their wait even when they hold, up to the longest; only
    a probe that raises k_eff brings the next one closer (a probe is a head pass for a model drafter)."""
    import random

    from kvloom.spec_decode.adaptive import MAX_PROBE_INTERVAL, MODEL_DECAY, DraftStats, SpeculationController

    controller = SpeculationController(4, decay=MODEL_DECAY)
    stats = DraftStats()
    rng = random.Random(0)
    probes, held = [], 0
    for step in range(700):
        k = controller.num_drafts(stats, num_running=64)
        if k:
            assert k == 1
            probes.append(step)
            accepted = int(rng.random() < 0.45)
            held += accepted
            stats.observe(k, accepted, MODEL_DECAY)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert held >= 2  # some probes held, and still:
    assert gaps == sorted(gaps) and gaps[-1] > MAX_PROBE_INTERVAL
    assert len(probes) <= 6


def test_probes_wait_longer_where_even_a_sure_draft_gains_little() -> None:
    """A probe costs about the threshold in tokens and a draft that always holds gains at most 1 - threshold:
    at 64 sequences (prior threshold 64 / 69) the wait to each probe passes at an eighth of the pace of batch 1
    (the slowest); at batch 1 (prior 1 / 6) at full pace."""
    from kvloom.spec_decode.adaptive import MIN_PROBE_INTERVAL, DraftStats, SpeculationController, probe_pace

    assert probe_pace(1 / 17) == 1.0 and probe_pace(0.8) == pytest.approx(0.25) and probe_pace(0.99) == 0.125
    first_probe = {}
    for num_running in (1, 64):
        controller = SpeculationController(4)
        never = DraftStats(first_held=0.0, first_tried=10.0)
        first_probe[num_running] = next(step for step in range(200)
                                        if controller.num_drafts(never, num_running=num_running))
    assert first_probe == {1: MIN_PROBE_INTERVAL, 64: 8 * MIN_PROBE_INTERVAL}


def test_drafts_pay_when_their_expected_tokens_exceed_the_measured_cost() -> None:
    from kvloom.spec_decode.adaptive import DraftStats, SpeculationController

    controller = SpeculationController(num_speculative_tokens=4)
    # Unmeasured: a step is taken to cost 5 tokens' worth besides one per request.
    assert controller.threshold(num_running=1) == 1 / 6 and controller.threshold(num_running=64) == 64 / 69
    # Batch 1, memory-bound: 10 ms a step and 0.5 ms per extra token, one token out per step.
    for n in (1, 5, 1, 3, 1, 5, 2, 1) * 4:
        controller.record_step(n, 0.010 + 0.0005 * n)
    assert abs(controller.cost_per_token() - 0.0005) < 1e-9
    assert abs(controller.fixed_tokens() - 20) < 1e-6 and abs(controller.threshold() - 1 / 21) < 1e-9
    thirds = DraftStats(first_held=1, first_tried=3, later_held=1, later_tried=3)
    assert controller.num_drafts(thirds, num_running=1) == 2  # 1/3, 1/9 > 0.048 > 1/27
    # At 64 requests, before any step of that size was timed: the prior, not the batch-1 line (nor the tokens
    # per second of the batch-1 steps).
    assert controller.threshold(num_running=64) == 64 / 69
    # Batch 64, compute-bound: every token costs about what a request's share of the step does.
    controller = SpeculationController(num_speculative_tokens=4)
    for n in (64, 128, 64, 96, 64, 192) * 4:
        controller.record_step(n, 0.010 + 0.001 * n)
    assert abs(controller.fixed_tokens(64) - 10) < 1e-6 and abs(controller.threshold(num_running=64) - 64 / 74) < 1e-9
    assert controller.num_drafts(DraftStats(), num_running=64) == 0  # the prior: 2/3
    copying = DraftStats(first_held=99, first_tried=100, later_held=99, later_tried=100)
    assert controller.num_drafts(copying, num_running=64) == 4
    # A loop lookup half-predicts: the first draft nearly always holds, a second one 60% of the time.
    looping = DraftStats(first_held=96, first_tried=100, later_held=6, later_tried=10)
    assert controller.num_drafts(looping, num_running=64) == 1
    # A seeded request does not follow the measurement (its tokens would depend on timing).
    assert controller.num_drafts(DraftStats(), num_running=64, seeded=True) == 4
    # A line with no fixed part at 64 tokens and more: a draft pays only if it always holds. Steps of 1 to 3
    # tokens keep a line of their own (the step's cost is not one line from 1 token to 100).
    controller = SpeculationController(num_speculative_tokens=4)
    for n in (64, 128, 64, 96, 64, 192) * 4:
        controller.record_step(n, 0.001 * n)
        controller.record_step(1 + n % 3, 0.010 + 0.0005 * (1 + n % 3))
    assert controller.fixed_tokens(64) < 1e-6 and controller.threshold(num_running=64) > 0.999
    assert controller.num_drafts(copying, num_running=64) == 0
    assert abs(controller.threshold(num_running=1) - 1 / 21) < 1e-9
    assert controller.step_line(8) is None  # no steps of 4 to 63 tokens: the prior
    assert controller.step_line(40) is controller.steps[6]  # steps of 32 to 127 tokens: those of 64 and 96


def test_a_batch_is_priced_by_the_steps_just_above_its_size() -> None:
    """Memory-bound up to 8 tokens (10 ms, a further token 0.2 ms), compute-bound past that (1.2 ms a
    token): one line through all the steps prices a batch of 8's drafts at ~0.7 ms; the line of steps of 8
    to 31 tokens at 1.2 ms, and batch 1's at 0.2 ms."""
    def seconds(tokens: int) -> float:
        return 0.010 + 0.0002 * min(tokens, 8) + 0.0012 * max(tokens - 8, 0)

    controller = SpeculationController(num_speculative_tokens=4)
    for tokens in (1, 2, 3, 1, 5, 8, 12, 16, 9, 24, 8, 20, 2, 4) * 3:
        controller.record_step(tokens, seconds(tokens))
    assert controller.cost_per_token(1) == pytest.approx(0.0002)
    assert controller.cost_per_token(8) > 0.0009
    assert controller.threshold(8) > 0.5 > 0.2 > controller.threshold(1)
    # Two steps make a slope, mostly noise: the prior prices drafts until the line has a few more.
    controller = SpeculationController(num_speculative_tokens=4)
    controller.record_step(1, 0.010)
    controller.record_step(2, 0.020)
    assert controller.step_line(1) is None and controller.threshold(1) == 1 / 6
    controller.record_step(3, 0.030)
    controller.record_step(1, 0.010)
    assert controller.step_line(1) is not None and controller.threshold(1) == pytest.approx(1.0)


def test_disable_by_batch_size_stops_drafts_while_the_batch_is_that_large() -> None:
    scheduler = _speculating_scheduler(speculation=SpeculationController(4, disable_by_batch_size=2), names="ab")
    assert _step(scheduler, accept=True) == [0, 0]  # two running: off
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert _step(scheduler, accept=True) == [4]  # one running: on


def test_ngram_index_finds_what_a_scan_finds_as_the_sequence_grows() -> None:
    import random

    def scan(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tokens[len(tokens) - n:]:
                    return tokens[start + n:start + n + k]
        return []

    rng = random.Random(0)
    for _ in range(100):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        proposer = NgramProposer(3, max_n, min_n)
        index = proposer.new_index()
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(1, 5))]
        for _ in range(30):
            k = rng.randint(1, 6)
            if rng.random() < 0.7:  # not every step looks up (a backed-off request does not)
                assert proposer.propose(tokens, k, index) == scan(tokens, k, max_n, min_n)
            tokens += [rng.randint(0, 4) for _ in range(rng.randint(1, 3))]


def test_a_step_delayed_by_other_work_does_not_turn_speculation_off() -> None:
    """One step with drafts that the machine held up (5x its time) moves the cost fit by a bounded amount, and
    a request below k is still probed when no draft seems to pay, so the cost keeps being measured."""
    from kvloom.spec_decode.adaptive import DraftStats

    controller = SpeculationController(num_speculative_tokens=4)
    for n in (1, 5, 1, 1, 3, 1) * 5:
        controller.record_step(n, 0.010 + 0.0005 * n)
    controller.record_step(5, 5 * (0.010 + 0.0005 * 5))
    assert controller.threshold() < 0.25
    copying = DraftStats(first_held=9, first_tried=10, later_held=9, later_tried=10)
    assert controller.num_drafts(copying, num_running=1) == 4
    # A threshold no draft can meet: a request below k is probed all the same (at the slowest pace, 1/8).
    controller = SpeculationController(num_speculative_tokens=4)
    for n in (1, 2, 3) * 3:
        controller.record_step(n, 1.0 * n)  # no fixed part: every token costs a whole step
    stats = DraftStats()
    counts = [controller.num_drafts(stats, num_running=1) for _ in range(40)]
    assert [i for i, k in enumerate(counts) if k] == [32] and counts[32] == 1


def _measured_at_64(passes: bool = True) -> SpeculationController:
    """A controller that timed this CPU's steps at 64 sequences (~13 ms fixed, 0.8 ms per token) and, with
    ``passes``, an EAGLE head's passes (1.2 ms fixed, 0.03 ms per row)."""
    controller = SpeculationController(num_speculative_tokens=4)
    for n in (64, 80, 64, 72, 64, 96) * 4:
        pass_times = [(rows, 0.0012 + 0.00003 * rows) for rows in (n - 63, 1)] if passes else []
        controller.record_step(n, 0.013 + 0.0008 * n + sum(t for _, t in pass_times), pass_times)
    return controller


def test_a_model_drafters_passes_are_timed_apart_from_the_target_step() -> None:
    controller = _measured_at_64()
    assert abs(controller.cost_per_token(64) - 0.0008) < 1e-9 and abs(controller.step_line(64).fixed - 0.013) < 1e-9
    assert abs(controller.passes.slope - 0.00003) < 1e-9 and abs(controller.passes.fixed - 0.0012) < 1e-9
    # A guess costs its verified token and a row of a pass: the threshold per request rises by the row's share.
    assert controller._guess_threshold(64) == pytest.approx(controller.threshold(64) * (1 + 0.03 / 0.8))


def test_passes_whose_guesses_do_not_pay_for_the_pass_are_cut() -> None:
    """At 64 sequences a lone request whose guesses always hold gains ~0.2 ms a guess over its verified token,
    less than a head pass's fixed 1.2 ms: no pass runs for it. Thirty-two such requests share the passes, and
    all four pay. At batch 1 (a 14 ms step) one request pays for every pass."""
    from kvloom.spec_decode.adaptive import DraftStats

    controller = _measured_at_64()

    def sure() -> DraftStats:
        return DraftStats(first_held=99, first_tried=100, later_held=99, later_tried=100)

    assert controller.num_drafts(sure(), num_running=64) == 4
    assert controller.passes_worth_running([(sure(), 4, False)], num_running=64) == 0
    assert controller.passes_worth_running([(sure(), 4, False)] * 32, num_running=64) == 4
    assert controller.passes_worth_running([(sure(), 4, False)], num_running=1) == 4
    # Guesses that hold half the time pay for the first pass (shared by 32) but not for the later ones.
    half = DraftStats(first_held=99, first_tried=100, later_held=50, later_tried=100)
    assert controller.passes_worth_running([(half, 4, False)] * 32, num_running=64) == 1
    # A probe, and a seeded request, keep their k_eff: the passes they need run all the same.
    probing = sure()
    probing.probed_from = 1
    assert controller.passes_worth_running([(probing, 2, False), (sure(), 4, False)], num_running=64) == 2
    assert controller.passes_worth_running([(sure(), 3, True)], num_running=64) == 3
    # Without timed passes (n-gram lookup, or before the first) nothing is cut.
    assert _measured_at_64(passes=False).passes_worth_running([(sure(), 4, False)], num_running=64) == 4


def test_the_scheduler_cuts_the_lookahead_to_the_passes_worth_running() -> None:
    """Two requests on a draft model: one whose guesses always hold, one whose guesses never do. With the
    passes' fixed cost as high as a whole step's, the cut leaves neither a guess; without timed passes both
    keep theirs."""
    from kvloom.spec_decode.adaptive import DraftStats

    for pass_seconds, expected in ((None, [4, 0]), (0.05, [0, 0])):
        controller = SpeculationController(num_speculative_tokens=4)
        for n in (2, 4, 3) * 4:
            passes = [(n, pass_seconds + 0.00001 * n)] if pass_seconds else []
            controller.record_step(n, 0.010 + 0.001 * n + sum(t for _, t in passes), passes)
        kv = KVCacheManager(num_blocks=32, block_size=4)
        scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                              num_lookahead_tokens=4, speculation=controller)
        for name, held in (("a", 99.0), ("b", 1.0)):
            request = Request(name, list(range(10, 16)), SamplingParams(temperature=0, max_tokens=20))
            scheduler.add_request(request)
            request.draft_stats = DraftStats(first_held=held, first_tried=100, later_held=99, later_tried=100)
        out = scheduler.schedule()
        assert [item.num_speculative_tokens for item in out.scheduled] == expected


def test_the_first_draft_in_a_step_is_priced_apart_from_the_next_ones() -> None:
    """At batch 8 on this CPU: 13.6 ms a step without drafts, 16.6 ms with one draft, 1 ms for each further:
    the fit finds the jump (3 ms less the 1 ms a token) apart from the slope, and a pass that would bring
    drafts into the step must pay for the jump too."""
    from kvloom.spec_decode.adaptive import DraftStats

    def seconds(drafts: int) -> float:
        return 0.0136 + (0.002 + 0.001 * drafts if drafts else 0.0)

    controller = SpeculationController(num_speculative_tokens=4)
    for drafts in (0, 0, 1, 0, 3, 0, 2, 0, 0, 5, 0, 1) * 3:
        controller.record_step(8 + drafts, seconds(drafts), num_drafts=drafts)
    line = controller.step_line(8)
    assert line.slope == pytest.approx(0.001) and line.jump == pytest.approx(0.002)
    assert line.fixed + 8 * line.slope == pytest.approx(0.0136)  # a step without drafts
    # Half the guesses of all 8 requests hold: each gains 0.5 * 1.7 ms - 1 ms < 0; sure guesses pay for the
    # first pass only together (8 * 0.7 ms > the jump), not alone.
    controller.passes.add(1, 0.0)
    controller.passes.add(2, 0.0)
    controller.passes.add(3, 0.0)
    half = DraftStats(first_held=50, first_tried=100)
    sure = DraftStats(first_held=99, first_tried=100, later_held=99, later_tried=100)
    assert controller.passes_worth_running([(half, 1, False)] * 8, num_running=8) == 0
    assert controller.passes_worth_running([(sure, 1, False)] * 8, num_running=8) == 1
    assert controller.passes_worth_running([(sure, 1, False)] * 2, num_running=8) == 0
    # Where every step drafts (batch 1, copying) there is no jump to fit: the fixed part takes it.
    controller = SpeculationController(num_speculative_tokens=4)
    for drafts in (1, 3, 2, 4) * 4:
        controller.record_step(1 + drafts, 0.010 + 0.0005 * drafts, num_drafts=drafts)
    assert controller.step_line(1).jump == 0.0 and controller.cost_per_token(1) == pytest.approx(0.0005)


def test_a_lagging_model_drafters_probe_is_priced_with_its_catch_up() -> None:
    """A request that has not drafted for a while has a draft KV that trails by its tokens since: its probe
    must first run the drafter over them (at 64 sequences here 200 rows ~ 6 tokens' worth of a step), so the
    wait to it passes that many times slower; with no lag as before. Before the passes are timed a row costs
    ``PRIOR_ROW_COST`` verified tokens."""
    from kvloom.spec_decode.adaptive import PRIOR_ROW_COST, DraftStats, probe_pace

    controller = _measured_at_64()
    per_token = (0.013 + 0.0008 * 64) / 64  # seconds a request's output token costs at 64 sequences
    assert controller.catch_up_tokens(200, 64) == pytest.approx(200 * 0.00003 / per_token)
    assert controller.catch_up_tokens(0, 64) == 0.0
    unpassed = _measured_at_64(passes=False)
    assert unpassed.catch_up_tokens(200, 64) == pytest.approx(200 * PRIOR_ROW_COST * unpassed.threshold(64))
    assert SpeculationController(4).catch_up_tokens(200, 64) == pytest.approx(200 * PRIOR_ROW_COST * 64 / 69)
    assert probe_pace(0.8, 0.8) == pytest.approx(0.125) and probe_pace(0.8) == pytest.approx(0.25)

    def first_probe(lag: int) -> int:
        never = DraftStats(first_held=0.0, first_tried=10.0, lag=lag)
        return next(step for step in range(5000) if controller.num_drafts(never, num_running=64))

    fresh, lagging = first_probe(0), first_probe(200)
    base = controller._guess_threshold(64) + controller.first_draft_tokens(64)  # a probe's cost without lag
    assert lagging / fresh == pytest.approx((base + controller.catch_up_tokens(200, 64)) / base, rel=0.05)


def test_the_scheduler_counts_a_model_drafters_lag_and_drafts_no_more_for_a_disabled_request() -> None:
    """The scheduler counts each request's tokens since it last drafted (its drafter catches up when it next
    does); a request the runner reports as unable to complete its draft KV is given no more drafts."""
    from kvloom.spec_decode.adaptive import DraftStats

    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_lookahead_tokens=3,
                          speculation=SpeculationController(num_speculative_tokens=3))
    sure = DraftStats(first_held=99, first_tried=100, later_held=99, later_tried=100)
    never = DraftStats(first_held=0.0, first_tried=100.0)
    for name, stats, first in (("sure", sure, 10), ("never", never, 30)):
        request = Request(name, list(range(first, first + 6)), SamplingParams(temperature=0, max_tokens=30))
        scheduler.add_request(request)
        request.draft_stats = stats
    out = scheduler.schedule()
    assert [item.num_speculative_tokens for item in out.scheduled] == [3, 0]
    assert (sure.lag, never.lag) == (0, 6)  # the prompt
    scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"sure": [20], "never": [20]},
                                                        draft_disabled_request_ids=["sure"]))
    out = scheduler.schedule()
    assert [item.num_speculative_tokens for item in out.scheduled] == [0, 0]
    assert (sure.disabled, sure.lag, never.lag) == (True, 1, 7)


def test_a_lagging_request_drafts_again_only_if_its_drafts_repay_the_catch_up() -> None:
    """Drafts that pay a little per step (the prior 2/3 against a threshold just below) do not repay a pass
    over 280 lagging tokens within ``CATCH_UP_HORIZON`` steps: no drafts, and no burst of catch-up passes
    when a large batch's threshold dips. Drafts that pay a lot do; a request that does not lag drafts as
    before."""
    from kvloom.spec_decode.adaptive import CATCH_UP_HORIZON, DraftStats

    controller = _measured_at_64()
    threshold = controller._guess_threshold(64)
    sure = DraftStats(first_held=99, first_tried=100, later_held=99, later_tried=100)
    assert controller.num_drafts(DraftStats(lag=280), 64) == 0 and controller.num_drafts(sure, 64) == 4
    dipped = 0.6  # a threshold the batch's step line can dip to
    controller._prices_at(64).guess_threshold = dipped
    assert controller.num_drafts(DraftStats(), 64) == 1  # the prior 2/3 > 0.6
    lagging = DraftStats(lag=280)
    assert (2 / 3 - dipped) * CATCH_UP_HORIZON < controller.catch_up_tokens(280, 64)
    assert controller.num_drafts(lagging, 64) == 0
    sure.lag = 280
    assert controller.num_drafts(sure, 64) == 4
    assert threshold > dipped


@pytest.mark.parametrize("caution", [True, False])
def test_steps_of_nearly_one_size_do_not_fit_a_low_threshold(caution: bool, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """64 sequences, compute-bound (~1 ms a token, ~65 ms a step), the machine's noise +-8 ms, and a draft or
    two in a few steps: a slope through sizes 64-68 is mostly noise. Taken ``CAUTION`` standard errors high it
    keeps the threshold near 1; the bare fit (traced at 0.2 ms a token, 51 ms fixed) made it ~0.3, and then
    every request drafted at once."""
    from kvloom.spec_decode import adaptive

    if not caution:
        monkeypatch.setattr(adaptive, "CAUTION", 0.0)
    noise = [0.0, 6.0, -4.0, 8.0, -7.0, 2.0, -1.0, 5.0, -8.0, 3.0]
    controller = SpeculationController(num_speculative_tokens=4)
    for step in range(40):
        drafts = {13: 2, 27: 4, 33: 1}.get(step, 0)
        # A step with drafts happened to fall on quiet moments: the noise hides their cost.
        seconds = 0.001 * (65 + drafts + (noise[step % 10] if not drafts else -6.0))
        controller.record_step(64 + drafts, seconds, num_drafts=drafts)
    threshold = controller.threshold(64)
    assert threshold > 0.8 if caution else threshold < 0.5, threshold


def test_a_request_admitted_with_a_burst_is_priced_as_the_batch_it_joins() -> None:
    """32 requests arrive at once; those admitted first are priced as the batch the queue is filling (the
    prior threshold at 32: 32 / 37 > the prior 2/3), not as a batch of 1: no drafts, no pass over their
    prompts. A request alone drafts."""
    for count, drafting in ((32, 0), (1, 1)):
        kv = KVCacheManager(num_blocks=256, block_size=4)
        scheduler = Scheduler(kv, max_num_seqs=32, max_num_batched_tokens=64, max_model_len=64,
                              num_lookahead_tokens=3, speculation=SpeculationController(num_speculative_tokens=3))
        for i in range(count):
            scheduler.add_request(Request(str(i), [10 + i, 11, 12], SamplingParams(temperature=0, max_tokens=8)))
        out = scheduler.schedule()
        assert sum(1 for item in out.scheduled if item.num_speculative_tokens) == drafting


def test_a_probe_from_no_drafts_is_priced_with_the_steps_first_draft() -> None:
    """At batch 8 a step's first draft costs a jump (~2 ms) and a model drafter's pass (~1 ms) besides its
    verified token, ~2 tokens' worth: the wait to a probe from k_eff = 0 passes that much slower (a probe
    from k_eff > 0 adds a draft to a step that has them, and waits as before)."""
    from kvloom.spec_decode.adaptive import DraftStats, probe_pace

    controller = SpeculationController(num_speculative_tokens=4)
    for drafts in (0, 0, 1, 0, 3, 0, 2, 0, 0, 5, 0, 1) * 3:
        seconds = 0.0136 + (0.002 + 0.001 * drafts if drafts else 0.0)
        passes = [(8, 0.001 + 0.00003 * 8), (1, 0.001 + 0.00003)] if drafts else []
        controller.record_step(8 + drafts, seconds + sum(t for _, t in passes), passes, num_drafts=drafts)
    line = controller.step_line(8)
    per_token = (line.fixed + 8 * line.slope) / 8
    assert controller.first_draft_tokens(8) == pytest.approx((line.jump + controller.passes.fixed) / per_token)
    assert controller.first_draft_tokens(8) > 1.5
    threshold = controller._guess_threshold(8)
    never = DraftStats(first_held=0.0, first_tried=10.0)
    before = never.steps_to_probe
    assert controller.num_drafts(never, num_running=8) == 0
    assert before - never.steps_to_probe == pytest.approx(
        probe_pace(threshold, controller.first_draft_tokens(8)))
    assert SpeculationController(4).first_draft_tokens(8) == 0.0  # before any step is timed


def test_a_new_request_starts_from_the_rates_the_engines_requests_have_shown() -> None:
    """A model drafter's guesses that hold about half the time at batch 8 should not be offered to each new
    request at the optimistic 2/3 until its own misses teach it: a new request starts from the engine's
    rates (after ~10 first drafts tried); a seeded one at 2/3, so that its tokens do not depend on others."""
    controller = SpeculationController(num_speculative_tokens=4)
    assert controller.new_stats().first_rate == pytest.approx(2 / 3)
    for step in range(200):
        stats = controller.new_stats()
        controller.observe(stats, 2, 1 if step % 10 < 3 else 0)  # the first draft holds 30%, the second never
    fresh = controller.new_stats()
    assert 0.28 < fresh.first_rate < 0.35 and fresh.later_rate < 0.1 and fresh.first_tried == 3.0
    assert controller.new_stats(seeded=True).first_rate == pytest.approx(2 / 3)
    kv = KVCacheManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_lookahead_tokens=3,
                          speculation=controller)
    request = Request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    scheduler.add_request(request)
    assert request.draft_stats.first_rate == pytest.approx(fresh.first_rate)
