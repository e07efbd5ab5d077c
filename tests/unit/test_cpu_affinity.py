"""cpu_omp_threads_bind (vLLM's VLLM_CPU_OMP_THREADS_BIND): CPU lists parse or are refused naming the bad
part; the plan gives each local engine process its own cores ("auto": equal contiguous shares, none for
one engine or too few cores; "nobind"; explicit "|"-separated lists that must match the processes, be
usable and disjoint); the setting comes from the argument, else KVLOOM_CPU_OMP_THREADS_BIND; a replica's
ranks get their slice of the host's plan; and bind really pins a process, every thread of it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from kvloom import cpu_affinity
from kvloom.config import EngineConfig, add_engine_args, config_from_args
from kvloom.cpu_affinity import format_cpu_list, format_setting, parse_cpu_list, plan


# ---- CPU lists -----------------------------------------------------------------------------------------
def test_cpu_lists_parse_ranges_and_single_cores_sorted() -> None:
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list(" 5 , 2 ,2") == (2, 5)
    assert parse_cpu_list("7") == (7,)
    assert format_cpu_list((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    assert format_cpu_list([4]) == "4"


@pytest.mark.parametrize(("text", "part"), [("0-", "0-"), ("a", "a"), ("0,,1", ""), ("-1", "-1"), ("1-2-3", "1-2-3"),
                                            ("", ""), ("0;1", "0;1")])
def test_a_bad_cpu_list_names_the_part_and_the_syntax(text: str, part: str) -> None:
    with pytest.raises(ValueError, match=rf"{part!r} is not a core number or a range; write core numbers and "
                                         rf"ranges separated by commas, e\.g\. '0-3,8,10-11'"):
        parse_cpu_list(text)


def test_a_backwards_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the range '3-1' runs backwards"):
        parse_cpu_list("3-1")


def test_settings_parse_to_lists_or_none() -> None:
    assert cpu_affinity.parse_setting("auto") is None
    assert cpu_affinity.parse_setting(" NoBind ") is None
    assert cpu_affinity.parse_setting("0-1|2,3") == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match=r"cpu_omp_threads_bind='0\|x': CPU list 'x': 'x' is not a core number.*"
                                         r"the setting is 'auto', 'nobind', or one CPU list per engine process"):
        cpu_affinity.parse_setting("0|x")
    with pytest.raises(ValueError, match="cpu_omp_threads_bind must be 'auto', 'nobind'"):
        cpu_affinity.parse_setting(" ")
    assert format_setting([(0, 1), (2,)]) == "0-1|2"
    assert format_setting([None, None]) == "nobind"


# ---- the plan --------------------------------------------------------------------------------------------
def test_auto_splits_the_usable_cores_in_equal_contiguous_shares() -> None:
    assert plan("auto", 2, [0, 1]) == [(0,), (1,)]
    assert plan("auto", 3, [0, 1, 2, 3]) == [(0,), (1,), (2,)]  # the leftover core stays unused
    assert plan("auto", 2, list(range(8))) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert plan("auto", 2, [6, 2, 7, 3]) == [(2, 3), (6, 7)]  # a taskset's cores, in order


def test_auto_leaves_one_engine_unpinned() -> None:
    assert plan("auto", 1, list(range(8))) == [None]


def test_auto_with_fewer_cores_than_engines_pins_none_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kvloom")
    logger.addHandler(caplog.handler)  # the server's logging set-up may stop kvloom's records propagating
    try:
        with caplog.at_level(logging.WARNING, logger="kvloom"):
            assert plan("auto", 2, [0]) == [None, None]
    finally:
        logger.removeHandler(caplog.handler)
    warnings = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    assert len(warnings) == 1
    assert "2 engine processes but only 1 usable core(s) (0)" in warnings.pop()


def test_nobind_pins_nothing() -> None:
    assert plan("nobind", 3, list(range(8))) == [None, None, None]


def test_explicit_lists_are_taken_as_given() -> None:
    assert plan("0-1|2-3", 2, [0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert plan("3|0", 2, [0, 1, 2, 3]) == [(3,), (0,)]
    assert plan("2", 1, [0, 1, 2, 3]) == [(2,)]  # one engine, pinned on request


def test_explicit_lists_must_match_the_engine_processes() -> None:
    with pytest.raises(ValueError, match=r"cpu_omp_threads_bind='0\|1\|2' gives 3 CPU list\(s\) but 2 engine "
                                         r"process\(es\) run on this host"):
        plan("0|1|2", 2, [0, 1, 2, 3])


def test_explicit_lists_must_not_overlap() -> None:
    with pytest.raises(ValueError, match=r"core\(s\) 1-2 appear in more than one process's list \(list 1"):
        plan("0-2|1-3", 2, [0, 1, 2, 3])


def test_explicit_lists_must_name_usable_cores() -> None:
    with pytest.raises(ValueError, match=r"core\(s\) 5,9 are not usable by this process; the usable cores are 0-3"):
        plan("0|5,9", 2, [0, 1, 2, 3])


# ---- the setting -----------------------------------------------------------------------------------------
def test_the_setting_defaults_to_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLOOM_CPU_OMP_THREADS_BIND", raising=False)
    assert EngineConfig().cpu_omp_threads_bind == "auto"
    assert EngineConfig(cpu_omp_threads_bind="NOBIND").cpu_omp_threads_bind == "nobind"


def test_the_variable_applies_unless_an_argument_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_CPU_OMP_THREADS_BIND", "0|1")
    assert EngineConfig().cpu_omp_threads_bind == "0|1"
    assert EngineConfig(cpu_omp_threads_bind="auto").cpu_omp_threads_bind == "auto"  # an explicit auto wins too
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).cpu_omp_threads_bind == "0|1"
    args = parser.parse_args(["--cpu-omp-threads-bind", "0-1|2-3"])
    assert config_from_args(args).cpu_omp_threads_bind == "0-1|2-3"


def test_a_bad_setting_is_refused_naming_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLOOM_CPU_OMP_THREADS_BIND", raising=False)
    with pytest.raises(ValueError, match=r"cpu_omp_threads_bind='0-\|1': CPU list '0-': '0-' is not a core"):
        EngineConfig(cpu_omp_threads_bind="0-|1")
    monkeypatch.setenv("KVLOOM_CPU_OMP_THREADS_BIND", "all")
    with pytest.raises(ValueError, match=r"KVLOOM_CPU_OMP_THREADS_BIND: cpu_omp_threads_bind='all'"):
        EngineConfig()


def test_each_replica_gets_its_ranks_slice_of_the_hosts_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """data_parallel_size x tensor_parallel_size processes share the plan; a replica's engine is handed its
    ranks' lists, so its tensor-parallel executor splits the replica's cores exactly so."""
    from kvloom.engine.data_parallel.replica import replica_config
    from kvloom.engine.data_parallel.router import replica_cpus

    monkeypatch.delenv("KVLOOM_CPU_OMP_THREADS_BIND", raising=False)
    config = EngineConfig(data_parallel_size=2, tensor_parallel_size=2)
    ranks = replica_cpus(config, "cpu", False, list(range(8)))
    assert ranks == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    replica = replica_config(config, "cpu", None, format_setting(ranks[1]))
    assert (replica.data_parallel_size, replica.cpu_omp_threads_bind) == (1, "4-5|6-7")
    assert plan(replica.cpu_omp_threads_bind, 2, [4, 5, 6, 7]) == [(4, 5), (6, 7)]
    explicit = EngineConfig(data_parallel_size=2, cpu_omp_threads_bind="1|0")
    assert replica_cpus(explicit, "cpu", False, [0, 1]) == [[(1,)], [(0,)]]
    assert replica_cpus(config, "cuda", False, list(range(8))) == [[None, None], [None, None]]
    assert replica_cpus(config, "cpu", True, list(range(8))) == [[None, None], [None, None]]  # Ray actors


# ---- binding ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="this OS offers no CPU affinity")
def test_bind_pins_a_process_and_the_threads_it_already_runs() -> None:
    core = cpu_affinity.usable_cpus()[0]
    script = textwrap.dedent(f"""
        import json, os, threading
        from kvloom.cpu_affinity import bind
        asked, answer = threading.Event(), {{}}
        def report():  # a thread started before bind: its own mask
            asked.wait()
            answer["thread"] = sorted(os.sched_getaffinity(0))
        thread = threading.Thread(target=report)
        thread.start()
        assert bind(({core},))
        asked.set()
        thread.join()
        print(json.dumps({{"process": sorted(os.sched_getaffinity(0)), **answer}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"process": [core], "thread": [core]}
