"""The data-parallel router's policy: the least loaded replica, unless one holding the prompt's
prefix is at most a request's worth busier; prefix hashes chain over full blocks only."""

from __future__ import annotations

import pytest

from kvloom.engine.data_parallel.router import choose_replica, prefix_hashes


def test_least_outstanding_tokens_wins_and_ties_go_to_the_lowest_index() -> None:
    assert choose_replica({0: 300, 1: 120, 2: 500}, holder=None, slack=50) == 1
    assert choose_replica({0: 0, 1: 0}, holder=None, slack=50) == 0
    assert choose_replica({1: 7, 3: 7}, holder=None, slack=0) == 1


def test_prefix_holder_is_preferred_within_the_slack_only() -> None:
    assert choose_replica({0: 100, 1: 0}, holder=0, slack=100) == 0
    assert choose_replica({0: 101, 1: 0}, holder=0, slack=100) == 1
    assert choose_replica({0: 0, 1: 5}, holder=1, slack=5) == 1


def test_a_dead_holder_is_not_chosen_and_no_live_replica_is_an_error() -> None:
    assert choose_replica({1: 500}, holder=0, slack=10_000) == 1  # replica 0 is out of the rotation
    with pytest.raises(ValueError, match="no live replica"):
        choose_replica({}, holder=None, slack=0)


def test_prefix_hashes_chain_over_full_blocks() -> None:
    a = prefix_hashes(list(range(40)), block_size=16)
    assert len(a) == 2  # 40 tokens: two full blocks; the partial third is not hashed
    b = prefix_hashes(list(range(32)) + [99] * 20, block_size=16)
    assert b[:2] == a  # same first 32 tokens, same hashes
    c = prefix_hashes([1] + list(range(1, 40)), block_size=16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    assert prefix_hashes(list(range(15)), block_size=16) == []
    assert len(prefix_hashes(list(range(1000)), block_size=16, max_blocks=8)) == 8
