"""CPU affinity for several engine processes on one host: vLLM's ``VLLM_CPU_OMP_THREADS_BIND``.

Tensor-parallel ranks and data-parallel replicas on one machine each run a torch thread pool of their
own; left to the OS, the pools share cores, and each pool's barrier waits for threads that another
process has descheduled. ``plan`` turns the setting (``cpu_omp_threads_bind``, or the variable
``KVLOOM_CPU_OMP_THREADS_BIND``) into one core set per local engine process, in process order
(replica 0's ranks 0..T-1, then replica 1's, ...):

    "auto"       several processes: the usable cores in equal contiguous shares (cores // processes
                 each; the leftover cores stay unused). One process, or fewer cores than processes:
                 none (not pinned; the latter says so once in the log)
    "nobind"     none
    "0-1|2-3"    one CPU list per process, separated by "|": exactly one per process, every core
                 usable, no core in two lists

``bind`` pins the calling process to a core set. Its caller sets torch's thread count to match (this
module imports no torch, so the config can check the setting's syntax without it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Sequence

logger = logging.getLogger("kvloom")

AUTO = "auto"
NO_BIND = "nobind"
_SYNTAX = "'auto', 'nobind', or one CPU list per engine process separated by '|', e.g. '0-3|4-7' or '0,2|1,3'"
_CPU_LIST_SYNTAX = "core numbers and ranges separated by commas, e.g. '0-3,8,10-11'"
_PART = re.compile(r"(\d+)(?:-(\d+))?")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The cores of a CPU list such as "0-3,8,10-11", sorted; ValueError naming the bad part."""
    cores: set[int] = set()
    for part in text.split(","):
        match = _PART.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"CPU list {text!r}: {part.strip()!r} is not a core number or a range; "
                             f"write {_CPU_LIST_SYNTAX}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"CPU list {text!r}: the range {part.strip()!r} runs backwards; write {first}-... "
                             f"with the larger core last ({_CPU_LIST_SYNTAX})")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def format_cpu_list(cores: Iterable[int]) -> str:
    """The shortest CPU list of ``cores``: (0, 1, 2, 3, 8) -> "0-3,8"."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_setting(spec: str) -> list[tuple[int, ...]] | None:
    """The per-process CPU lists of an explicit setting; None for "auto" and "nobind".
    ValueError (naming the allowed syntax) for anything else."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"cpu_omp_threads_bind must be {_SYNTAX}, got {spec!r}")
    if spec.strip().lower() in (AUTO, NO_BIND):
        return None
    try:
        return [parse_cpu_list(part) for part in spec.split("|")]
    except ValueError as error:
        raise ValueError(f"cpu_omp_threads_bind={spec!r}: {error}; the setting is {_SYNTAX}") from None


def format_setting(shares: Sequence[tuple[int, ...] | None]) -> str:
    """The explicit setting that gives exactly ``shares`` (a plan, or part of one); "nobind" when any
    share is None (a plan pins all its processes or none)."""
    if not shares or any(share is None for share in shares):
        return NO_BIND
    return "|".join(format_cpu_list(share) for share in shares if share is not None)


def usable_cpus() -> list[int]:
    """The cores this process may run on (its affinity: a container's or taskset's limit), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan(spec: str, count: int, usable: Sequence[int]) -> list[tuple[int, ...] | None]:
    """One core set per local engine process (``count`` of them), or None for a process left unpinned.
    See the module docstring; ValueError for an explicit setting that does not fit ``count`` processes
    or the ``usable`` cores."""
    if count < 1:
        raise ValueError(f"plan needs at least one engine process, got {count}")
    lists = parse_setting(spec)
    if lists is None:
        if spec.strip().lower() == NO_BIND or count == 1:
            return [None] * count
        cores = sorted(set(usable))
        if len(cores) < count:
            logger.warning("cpu_omp_threads_bind=auto: %d engine processes but only %d usable core(s) (%s): "
                           "the processes are not pinned and will share cores", count, len(cores),
                           format_cpu_list(cores))
            return [None] * count
        share = len(cores) // count
        return [tuple(cores[i * share:(i + 1) * share]) for i in range(count)]
    if len(lists) != count:
        raise ValueError(f"cpu_omp_threads_bind={spec!r} gives {len(lists)} CPU list(s) but {count} engine "
                         f"process(es) run on this host (tensor_parallel_size x data_parallel_size); give "
                         f"exactly one list per process, separated by '|', or 'auto'")
    unavailable = sorted(set().union(*lists) - set(usable))
    if unavailable:
        raise ValueError(f"cpu_omp_threads_bind={spec!r}: core(s) {format_cpu_list(unavailable)} are not usable "
                         f"by this process; the usable cores are {format_cpu_list(usable)}")
    seen: set[int] = set()
    for index, cores_of_process in enumerate(lists):
        overlap = seen & set(cores_of_process)
        if overlap:
            raise ValueError(f"cpu_omp_threads_bind={spec!r}: core(s) {format_cpu_list(overlap)} appear in more "
                             f"than one process's list (list {index} repeats them); the lists must be disjoint")
        seen.update(cores_of_process)
    return list(lists)


def bind(cpus: Iterable[int]) -> bool:
    """Pin this process to ``cpus``: every thread it has now, so every thread it starts later too.
    False where the OS offers no affinity (macOS): nothing is pinned.

    Linux's sched_setaffinity(0) pins only the calling thread; threads already running (torch's
    OpenMP pool once a parallel op ran, a server's event loop) would keep their cores, so each
    thread in /proc/self/task is pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    cores = set(cpus)
    threads = [0]
    with contextlib.suppress(OSError):
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cores)
    return True


def current_cpus() -> tuple[int, ...] | None:
    """The calling thread's cores (what ``bind`` may restore later), or None where there is no affinity."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return tuple(sorted(os.sched_getaffinity(0)))
