"""Speculative decoding's parts: n-gram prompt lookup, the rejection sampler against the exact
distributions it must keep (statistically, over many rows in one batch), the policy that gives each
request its drafts, and the scheduler carrying the runner's drafts."""

from __future__ import annotations

import pytest
import torch

from kvloom.engine.kv_cache_manager import KVCacheManager
from kvloom.engine.request import Request
from kvloom.engine.scheduler import Scheduler
from kvloom.sample.rejection_sampler import greedy_rejection_sample, rejection_sample
from kvloom.sampling_params import SamplingParams
from kvloom.spec_decode.ngram import NgramProposer
from kvloom.spec_decode.policy import FIXED_TOKENS, PRIOR_RATE, Acceptance, SpeculationPolicy
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
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_speculative_tokens=3,
                          num_lookahead_tokens=3)
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


def test_scheduler_cuts_drafts_to_the_budget_and_counts_acceptance_per_position() -> None:
    """n-gram drafts too come from the runner: no lookahead slots, drafts cut to the step's budget."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=3, max_model_len=64, num_speculative_tokens=4)
    request = Request("a", [5], SamplingParams(temperature=0, max_tokens=20))
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert len(request.block_ids) == 1  # no lookahead without a draft model
    scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [6]},
                                                        draft_token_ids={"a": [7, 8, 9, 10]}))
    out = scheduler.schedule()
    item = out.scheduled[0]
    assert (item.token_ids, item.num_draft_tokens) == ([6, 7, 8], 2)  # a budget of 3: its own token + 2
    scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [7, 4]}))
    stats = scheduler.stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 2, 1)
    assert stats.num_accepted_tokens_per_pos == (1, 0, 0, 0)
    assert request.num_computed_tokens == 3  # 5, 6 and the accepted 7; the rejected 8 is computed again


def test_a_request_whose_drafts_hold_gets_k_and_one_whose_drafts_fail_gets_none() -> None:
    policy = SpeculationPolicy(4)
    holding, failing = Acceptance(), Acceptance()
    assert policy.num_drafts(Acceptance(), batch_size=1) == 4  # the prior (0.6) pays all 4 at batch 1
    for _ in range(20):
        holding.forget()
        holding.observe(4, 4)
        failing.forget()
        failing.observe(policy.num_drafts(failing, 1) or 1, 0)
    assert holding.rate > 0.95 and policy.num_drafts(holding, 1) == 4
    assert failing.rate < 0.15 and policy.num_drafts(failing, 1) <= 1


def test_a_request_that_stopped_drafting_is_tried_again_as_its_rate_returns_to_the_prior() -> None:
    policy = SpeculationPolicy(4)
    acceptance = Acceptance(tried=20.0, accepted=0.0)
    assert policy.num_drafts(acceptance, 1) == 0
    steps = 0
    while policy.num_drafts(acceptance, 1) == 0:
        acceptance.forget()
        steps += 1
    assert 3 <= steps <= 20  # a few steps of rest, then a probe


def test_drafts_pay_when_their_chance_exceeds_what_the_batch_makes_in_their_time() -> None:
    policy = SpeculationPolicy(4)
    assert policy.threshold(1) == pytest.approx(1 / (FIXED_TOKENS + 1))
    assert policy.threshold(64) == pytest.approx(64 / (FIXED_TOKENS + 64))
    prior = Acceptance()
    assert prior.rate == pytest.approx(PRIOR_RATE)
    assert policy.num_drafts(prior, 8) == 1  # 0.6 > 0.5; 0.36 < 0.5
    assert policy.num_drafts(prior, 64) == 0  # a large batch drafts only for requests that have shown they copy
    sure = Acceptance(tried=50.0, accepted=50.0)
    assert policy.num_drafts(sure, 64) == 4
    assert policy.num_drafts(Acceptance(tried=10.0, accepted=5.0), 1) == 3  # 0.5 ** 3 > 0.11 > 0.5 ** 4


def test_disable_by_batch_size_stops_drafts_and_a_seeded_request_is_priced_as_if_alone() -> None:
    policy = SpeculationPolicy(4, disable_by_batch_size=2)
    assert policy.num_drafts(Acceptance(), 2) == 0
    assert policy.num_drafts(Acceptance(), 2, seeded=True) == 0
    assert policy.num_drafts(Acceptance(), 1) == 4
    # What shares the batch never changes a seeded request's drafts (nor so its tokens).
    assert SpeculationPolicy(4).num_drafts(Acceptance(), 64, seeded=True) == 4
    policy.adaptive = False
    assert policy.num_drafts(Acceptance(tried=50.0), 1) == 4


def test_spec_decode_never_imports_the_worker() -> None:
    """The runner uses the proposers, never the other way round (draft_model.BuildInputs is handed in)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "kvloom" / "spec_decode"
    bad = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name} imports {n}" for n in names if n.startswith(("kvloom.worker", "kvloom.engine"))]
    assert not bad


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
