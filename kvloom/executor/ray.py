"""The Ray executor: tensor parallelism across the machines of a Ray cluster.

    driver (rank 0, the engine's process)          Ray actor (rank r, any node)
    ─────────────────────────────────────          ────────────────────────────
    join the cluster (or start a local one)
    placement group: bundle 0 on this node, one bundle per other rank (PACK: same node first)
    one actor per rank r >= 1 in bundle r ──────> node_ip()
    TCPStore on this node's address (port 0) + process group (gloo on CPU, NCCL on CUDA) <─> start()
    load full weights, shard                        load full weights, shard
    init_kv_cache(n) ─────────────────────────────> init_kv_cache(n)
    each step: prepare inputs, forward.remote() ──> forward(inputs)
               forward  <── all-reduce x2 per layer ──> forward
               sample (rank 0 only)
    shutdown: kill the actors, remove the placement group

The same design as the multiprocess executor (``multiproc.py``), with Ray doing the placement and
the transport: rank 0 runs in the engine's process (as vLLM's Ray executor did), so a step costs
one actor call per other rank (about 0.2 ms to submit on 2 busy cores; the reply is not waited for)
on top of the collectives. Bundle 0 reserves the driver's accelerator on its node so that Ray
hands the actors the others.

Failures: every actor also runs ``wait_forever`` in a concurrency group of its own; that call
only ever ends when the actor dies, so one ``ray.wait`` before each step tells whether a rank is
gone (killed, its node lost, an error in its forward), and a failed collective is turned into a
RuntimeError naming the rank (``LockstepExecutor``'s rules, in ``base.py``, as the multiprocess
executor's). After a failure the executor refuses every further step, so the
engine fails its requests and reports itself dead instead of hanging. The actors belong to the
process that made them: Ray kills them when it exits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import pickle
import threading
from typing import Any

import torch
import torch.distributed as dist

from kvloom import ray_cluster
from kvloom.config import ResolvedConfig
from kvloom.executor.base import LockstepExecutor
from kvloom.executor.multiproc import (
    COLLECTIVE_TIMEOUT,
    build_rank_runner,
    dumps_message,
    move_tensors,
    new_process_group,
    threads_per_rank,
)
from kvloom.layers.quantization import holds_blocks
from kvloom.layers.tensor_parallel import ProcessGroupLike, validate_tensor_parallel
from kvloom.worker.model_runner import ModelInputs, ModelRunner

logger = logging.getLogger("kvloom")

ray = ray_cluster.require_ray("distributed_executor_backend='ray'")

# How long the cluster may take to find room for every rank before start-up fails.
PLACEMENT_TIMEOUT_S = 120.0


class RankWorker:
    """Tensor-parallel rank ``r >= 1`` inside a Ray actor: a ModelRunner holding its shard.

    Everything that touches torch runs in the actor's default concurrency group (one thread), so
    the model loads and steps on one OpenMP pool (see AsyncLLM's note on why that matters).
    """

    def __init__(self) -> None:
        self.runner: ModelRunner | None = None
        self.group: ProcessGroupLike | None = None
        self.device = torch.device("cpu")
        self._never = threading.Event()

    def node(self) -> tuple[str, str]:
        """(address, Ray node id) of the node this actor runs on."""
        return ray_cluster.node_ip_address(), ray.get_runtime_context().get_node_id()

    def start(self, config: ResolvedConfig, rank: int, world_size: int, store_host: str, store_port: int,
              backend: str, threads: int) -> None:
        if config.device.type == "cuda":
            self.device = torch.device("cuda", 0)  # Ray makes the bundle's GPU the only visible one
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(threads)
        store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        hostname = ray_cluster.node_ip_address() if backend == "gloo" else None
        self.group = new_process_group(backend, store, rank, world_size, hostname)
        self.runner = build_rank_runner(config, self.device, rank, world_size, self.group)

    def determine_num_kv_blocks(self) -> int:
        return self._runner().determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self._runner().init_kv_cache(num_blocks)

    def forward(self, payload: bytes) -> None:
        inputs: ModelInputs = pickle.loads(payload)[1]
        if self.device.type != "cpu":
            move_tensors(inputs, self.device)
        self._runner().forward(inputs)

    @ray.method(concurrency_group="watch")
    def wait_forever(self) -> None:
        """Returns only by the actor's death (then its reference raises RayActorError)."""
        self._never.wait()

    def stop(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.shutdown()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the rank's model is not loaded (start() did not run)")
        return self.runner


_RemoteRankWorker = ray.remote(concurrency_groups={"watch": 1})(RankWorker)


class _Ranks:
    """The driver's view of its actors; module-level state the finalizer holds (not the executor)."""

    def __init__(self) -> None:
        self.actors: list[Any] = []  # rank i + 1
        self.nodes: list[tuple[str, str]] = []
        self.watch: dict[Any, int] = {}  # wait_forever reference -> rank
        self.pending: list[Any] = []  # forward references not yet known to have finished
        self.placement_group: Any = None
        self.groups: list[ProcessGroupLike] = []

    def describe(self, rank: int) -> str:
        if rank - 1 < len(self.nodes):
            ip, node_id = self.nodes[rank - 1]
            return f"rank {rank} (Ray actor on node {ip}, id {node_id[:12]})"
        return f"rank {rank} (Ray actor)"

    def failure(self, wait_s: float = 0.0) -> str | None:
        """What went wrong with the actors (a death, an error in a call), or None if all are well."""
        refs = list(self.watch) + self.pending
        if not refs:
            return None
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if not ready and wait_s > 0:
            ready, _ = ray.wait(list(self.watch), num_returns=1, timeout=wait_s)
        problems = []
        for ref in ready:
            rank = self.watch.get(ref)
            if rank is None:
                self.pending.remove(ref)
            try:
                ray.get(ref)
            except Exception as error:  # noqa: BLE001 - RayActorError, RayTaskError: reported
                rank_name = self.describe(rank) if rank is not None else "a rank's step"
                problems.append(f"{rank_name} failed: {_short(error)}")
            else:
                if rank is not None:
                    problems.append(f"{self.describe(rank)} ended")
        return "tensor-parallel " + "; ".join(problems) if problems else None


def _short(error: BaseException) -> str:
    text = str(error).strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _stop(ranks: _Ranks) -> None:
    """Kill the actors, free their placement group, drop the process group (module-level: the
    finalizer and atexit hold it, and it must not hold the executor)."""
    if not ray.is_initialized():
        return
    for actor in ranks.actors:
        with contextlib.suppress(Exception):
            ray.kill(actor)
    ranks.actors.clear()
    ranks.watch.clear()
    ranks.pending.clear()
    if ranks.placement_group is not None:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(ranks.placement_group)
        ranks.placement_group = None
    for group in ranks.groups:
        with contextlib.suppress(Exception):
            group.shutdown()
    ranks.groups.clear()


def _bundles(config: ResolvedConfig, world_size: int, driver_ip: str) -> list[dict[str, float]]:
    """Bundle 0 pins the driver's share to its node (and its GPU, unless the driver is itself a Ray
    actor that holds one: a data-parallel replica); one CPU (or GPU) bundle per other rank."""
    accelerator = "GPU" if config.device.type == "cuda" else "CPU"
    driver: dict[str, float] = {f"node:{driver_ip}": 0.001}
    if accelerator == "GPU" and not ray.get_gpu_ids():
        driver["GPU"] = 1
    return [driver] + [{accelerator: 1} for _ in range(world_size - 1)]


class RayExecutor(LockstepExecutor):
    """Tensor parallelism over ``config.tensor_parallel_size`` ranks; rank 0 is the driver, the
    others are Ray actors placed by one placement group."""

    # A killed actor's death reaches the driver through Ray's control store, later than its gloo
    # sockets close.
    failure_report_s = 5.0

    def __init__(self, config: ResolvedConfig) -> None:
        world_size = config.engine.tensor_parallel_size
        device = config.device
        blocks = holds_blocks(config.engine.quantization, config.source, config.engine.backend)
        validate_tensor_parallel(config.model, world_size, device, int8_blocks=blocks)
        ray_cluster.connect("distributed_executor_backend='ray'")
        self.world_size = world_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        threads = threads_per_rank(config, world_size)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        self.ranks = ranks = _Ranks()
        self._replies: list[Any] = []  # the references of the last _send's calls
        self._own_stop(_stop, ranks)
        try:
            self._start(config, backend, threads)
        except BaseException:
            self.shutdown()
            raise
        self._start_lockstep()
        logger.info("tensor parallelism on Ray: %d ranks (%s) on nodes %s", world_size, backend,
                    ", ".join([ray_cluster.node_ip_address()] + [ip for ip, _ in ranks.nodes]))

    def _start(self, config: ResolvedConfig, backend: str, threads: int) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ranks, world_size = self.ranks, self.world_size
        driver_ip = ray_cluster.node_ip_address()
        bundles = _bundles(config, world_size, driver_ip)
        ranks.placement_group = ray.util.placement_group(bundles, strategy="PACK")
        try:
            ray.get(ranks.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the Ray cluster found no room for {world_size} tensor-parallel ranks in "
                f"{PLACEMENT_TIMEOUT_S:.0f}s: they need {bundles} (bundle 0 is this process's node); "
                f"the cluster has {ray.cluster_resources()}, {ray.available_resources()} free") from None
        gpus = 1 if config.device.type == "cuda" else 0
        for rank in range(1, world_size):
            strategy = PlacementGroupSchedulingStrategy(ranks.placement_group, placement_group_bundle_index=rank)
            actor = _RemoteRankWorker.options(num_cpus=0 if gpus else 1, num_gpus=gpus,
                                              scheduling_strategy=strategy).remote()
            ranks.actors.append(actor)
        ranks.nodes = ray.get([actor.node.remote() for actor in ranks.actors], timeout=PLACEMENT_TIMEOUT_S)
        ranks.watch = {actor.wait_forever.remote(): rank for rank, actor in enumerate(ranks.actors, start=1)}

        # Port 0: the OS picks a free port for the rendezvous store; the actors are told which.
        store = dist.TCPStore(driver_ip, 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        starts = [actor.start.remote(config, rank, world_size, driver_ip, store.port, backend, threads)
                  for rank, actor in enumerate(ranks.actors, start=1)]
        hostname = driver_ip if backend == "gloo" else None
        # The group forms only when every rank joins: wait for it on a thread while watching for
        # an actor that fails before it joins (an import error, a bad checkpoint).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joined = pool.submit(new_process_group, backend, store, 0, world_size, hostname)
            while not joined.done():
                ready, _ = ray.wait(starts, num_returns=len(starts), timeout=0.1)
                for ref in ready:
                    ray.get(ref)  # raises the actor's error (a ValueError stays a ValueError)
            group = joined.result()
        ranks.groups.append(group)
        self._store = store
        self.driver = build_rank_runner(config, config.device, 0, world_size, group)
        ray.get(starts)

    # ---- the Executor interface -----------------------------------------------------------------
    def determine_num_kv_blocks(self) -> int:
        """The fewest blocks any rank's memory holds (the nodes may differ)."""
        self._check_ranks()
        self._send("determine_num_kv_blocks")
        return min([self.driver.determine_num_kv_blocks(), *self._collect()])

    # ---- LockstepExecutor's hooks ---------------------------------------------------------------
    def _send(self, method: str, *args: Any) -> None:
        if method == "forward":  # its tensors as numpy arrays: ~10x faster than Ray's own pickling
            args = (dumps_message(("forward", *args)),)
        self._replies = [getattr(actor, method).remote(*args) for actor in self.ranks.actors]
        if method == "forward":  # not waited for: failure() reads them before the next step
            self.ranks.pending.extend(self._replies)

    def _collect(self) -> list[Any]:
        replies, self._replies = self._replies, []
        return ray.get(replies)

    def _rank_failure(self, wait_s: float) -> str | None:
        return self.ranks.failure(wait_s)
