"""The data-parallel router's policy: the replica holding the longest cached prefix of the prompt
within the load cap, else the least loaded; prefix hashes chain over full blocks only; the prefix
index forgets a replica's least recently used blocks beyond its KV cache, as the engine evicts."""

from __future__ import annotations

import random

import pytest

from kvloom.config.backend import DATA_PARALLEL_ROUTING, BackendConfig
from kvloom.engine.data_parallel.router import PrefixIndex, choose_replica, prefix_hashes, request_cap


def test_least_outstanding_tokens_wins_and_ties_go_to_the_lowest_index() -> None:
    assert choose_replica({0: 300, 1: 120, 2: 500}) == 1
    assert choose_replica({0: 0, 1: 0}, {0: 0, 1: 0}, slack=50) == 0
    assert choose_replica({1: 7, 3: 7}) == 1


def test_the_longest_prefix_is_preferred_within_the_slack_only() -> None:
    assert choose_replica({0: 100, 1: 0}, {0: 3}, slack=100) == 0
    assert choose_replica({0: 101, 1: 0}, {0: 3}, slack=100) == 1  # the load cap
    assert choose_replica({0: 0, 1: 5}, {1: 1}, slack=5) == 1
    # The longest match wins over a shorter one, both within the slack.
    assert choose_replica({0: 0, 1: 40, 2: 30}, {0: 2, 1: 9, 2: 5}, slack=50) == 1
    # Beyond the slack the longest is out; the longest of those within it wins.
    assert choose_replica({0: 0, 1: 60, 2: 30}, {0: 2, 1: 9, 2: 5}, slack=50) == 2
    # Equal matches (a system prompt every replica holds): the least loaded.
    assert choose_replica({0: 30, 1: 10}, {0: 4, 1: 4}, slack=100) == 1


def test_a_replica_with_more_requests_in_flight_than_the_cap_is_passed_over() -> None:
    assert [request_cap(n) for n in (0, 1, 4, 7, 8, 40)] == [1, 2, 5, 8, 10, 50]
    # Replica 0 holds the prefix and is within the token slack, but has 2 requests to replica 1's 0.
    assert choose_replica({0: 10, 1: 0}, {0: 5}, slack=1000, in_flight={0: 2, 1: 0}) == 1
    assert choose_replica({0: 10, 1: 0}, {0: 5}, slack=1000, in_flight={0: 1, 1: 0}) == 0
    # Among those within the cap, the longest prefix.
    assert choose_replica({0: 0, 1: 5, 2: 5}, {1: 9, 2: 4}, slack=1000, in_flight={0: 4, 1: 6, 2: 5}) == 2


def test_a_dead_replica_is_not_chosen_and_no_live_replica_is_an_error() -> None:
    assert choose_replica({1: 500}, {0: 8}, slack=10_000) == 1  # replica 0 is out of the rotation
    with pytest.raises(ValueError, match="no live replica"):
        choose_replica({}, None, slack=0)


def test_prefix_hashes_chain_over_full_blocks() -> None:
    a = prefix_hashes(list(range(40)), block_size=16)
    assert len(a) == 2  # 40 tokens: two full blocks; the partial third is not hashed
    b = prefix_hashes(list(range(32)) + [99] * 20, block_size=16)
    assert b[:2] == a  # same first 32 tokens, same hashes
    c = prefix_hashes([1] + list(range(1, 40)), block_size=16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    assert prefix_hashes(list(range(15)), block_size=16) == []
    assert len(prefix_hashes(list(range(1000)), block_size=16)) == 62  # every full block by default
    assert len(prefix_hashes(list(range(1000)), block_size=16, max_blocks=8)) == 8


def test_the_index_finds_the_longest_held_prefix_per_replica() -> None:
    index = PrefixIndex({0: 100, 1: 100})
    system = list(range(64))  # four blocks every conversation starts with
    turn1 = prefix_hashes(system + [500] * 32, 16)
    index.add(0, turn1)
    index.add(1, prefix_hashes(system + [600] * 32, 16))
    turn2 = prefix_hashes(system + [500] * 32 + [7] * 40, 16)  # the same conversation, grown
    assert index.matched_blocks(turn2) == {0: 6, 1: 4}
    # The match stops at the first block a replica lacks, even if later hashes were seen.
    assert index.matched_blocks(prefix_hashes([9] * 16 + system, 16)) == {0: 0, 1: 0}


def test_the_index_forgets_least_recently_used_blocks_beyond_the_capacity_tails_first() -> None:
    index = PrefixIndex({0: 6})
    old = prefix_hashes([1] * 64, 16)  # 4 blocks
    index.add(0, old)
    new = prefix_hashes([2] * 64, 16)
    index.add(0, new)  # 8 blocks > 6: two of the old prompt's go, its tail first
    assert len(index) == 6
    assert index.matched_blocks(old) == {0: 2}
    assert index.matched_blocks(new) == {0: 4}
    index.add(0, old[:2])  # touched again: now the newest
    index.add(0, prefix_hashes([3] * 32, 16))  # two more blocks: the new prompt's tail goes
    assert index.matched_blocks(old) == {0: 2} and index.matched_blocks(new) == {0: 2}
    index.drop(0)
    assert index.matched_blocks(new) == {0: 0}
    with pytest.raises(ValueError, match="capacity of at least one block"):
        PrefixIndex({0: 0})


def simulate(policy: str, sessions: int = 16, turns: int = 10, replicas: int = 2, seed: int = 0
             ) -> tuple[float, list[int]]:
    """Agent conversations over replicas, each replica's cache holding what was computed on it: the
    fraction of turn 2+ prompt blocks found cached on the replica a turn is routed to, and the
    requests each replica served. Load, as the benchmark makes it: every session's turn 1 arrives at
    once (each stays in flight while the rest arrive); from then on a closed loop, where each other
    session has its latest request in flight on the replica it went to. Arrival order is random."""
    rng = random.Random(seed)
    block = 16
    system = [rng.randrange(1000) for _ in range(1504)]
    histories = [system + [rng.randrange(1000) for _ in range(40)] for _ in range(sessions)]
    cache = PrefixIndex(dict.fromkeys(range(replicas), 10_000))
    home: dict[int, tuple[int, int]] = {}  # session -> (replica, charge) of its latest request
    hits = queries = turn = 0
    served = [0] * replicas
    for t in range(turns):
        for s in rng.sample(range(sessions), sessions):
            outstanding = dict.fromkeys(range(replicas), 0)
            in_flight = dict.fromkeys(range(replicas), 0)
            for other, (replica, charge) in home.items():
                if other != s:
                    outstanding[replica] += charge
                    in_flight[replica] += 1
            prompt = histories[s]
            hashes = prefix_hashes(prompt, block)
            matched = cache.matched_blocks(hashes)
            if policy == "round_robin":
                chosen = turn % replicas
            elif policy == "least_loaded":
                chosen = choose_replica(outstanding)
            else:
                chosen = choose_replica(outstanding, matched, slack=len(prompt) + 64, in_flight=in_flight)
            turn += 1
            served[chosen] += 1
            if t > 0:
                hits += matched[chosen]
                queries += len(hashes)
            home[s] = (chosen, len(prompt) - matched[chosen] * block + 64)
            cache.add(chosen, hashes)
            histories[s] = prompt + [rng.randrange(1000) for _ in range(rng.randrange(60, 120))]
    return hits / queries, served


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_agent_sessions_keep_their_prefix_cache_across_replicas(seed: int) -> None:
    """The oracle is one replica: one cache that saw every turn, where only each turn's new blocks
    miss. The prefix policy matches it over 2 and 4 replicas (every history returns to the replica
    that computed it) while spreading the sessions evenly, though every session's turn 1 finds the
    shared system prompt on the first replica; round robin loses the histories' blocks."""
    ideal, _ = simulate("round_robin", replicas=1, seed=seed)
    for replicas in (2, 4):
        rate, served = simulate("prefix", replicas=replicas, seed=seed)
        assert rate == pytest.approx(ideal, abs=1e-9)
        assert max(served) - min(served) <= 160 // replicas // 4, served  # no replica idles while another floods
        assert simulate("round_robin", replicas=replicas, seed=seed)[0] < ideal - 0.03
        assert simulate("least_loaded", replicas=replicas, seed=seed)[0] <= rate


def test_the_routing_knob_is_validated() -> None:
    assert BackendConfig.from_overrides(None).data_parallel_routing == "prefix"
    for policy in DATA_PARALLEL_ROUTING:
        assert BackendConfig.from_overrides({"data_parallel_routing": policy}).data_parallel_routing == policy
    with pytest.raises(ValueError, match="data_parallel_routing must be one of"):
        BackendConfig.from_overrides({"data_parallel_routing": "random"})
