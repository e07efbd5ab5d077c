"""Run inside a private network namespace (``unshare -n``, loopback up): a real two-node Ray cluster
(``ray.cluster_utils.Cluster``: a head node with no CPUs for tasks, a worker node with two), then
what ``argv[1]`` (JSON) asks for, printed as one JSON line on stdout.

    {"kind": "tp", "model": DIR, "prompts": [[ids]], "max_tokens": N}
        an LLM with tensor_parallel_size=2 on Ray: its greedy token ids and the node of each rank.

Ray's files go to a temporary RAY_TMPDIR so that this cluster is invisible to any other Ray on the
machine (``address="auto"`` reads the newest cluster's address from there).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main() -> None:
    request = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="kvr-", dir="/tmp") as temp_dir:
        os.environ["RAY_TMPDIR"] = temp_dir
        import ray
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=2)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
            result = {"nodes": [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]}
            if request["kind"] == "tp":
                result.update(_tp(request))
            print(json.dumps(result), flush=True)
        finally:
            ray.shutdown()
            cluster.shutdown()


def _tp(request: dict) -> dict:
    import ray

    from kvloom import LLM, SamplingParams

    llm = LLM(model=request["model"], dtype="float32", device="cpu", max_model_len=256, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params, use_tqdm=False)
    ranks = llm.llm_engine.executor.ranks
    result = {"token_ids": [o.outputs[0].token_ids for o in outputs],
              "driver_node": ray.get_runtime_context().get_node_id(),
              "rank_nodes": [node_id for _, node_id in ranks.nodes]}
    llm.llm_engine.shutdown()
    return result


if __name__ == "__main__":
    main()
