"""Bounded soak of a server: concurrent streams, random disconnects, KV and RSS checked after.

See kvloom/bench/soak.py for what is sent and checked. Exit code 1 when a check fails.

Against a running server (no RSS check: its pid is unknown):
    .venv/bin/python benchmarks/soak.py --base-url http://127.0.0.1:8000 --clients 64 --duration 300
Starting kvloom too (SmolLM2-135M-Instruct, or --model DIR), stopped at the end:
    .venv/bin/python benchmarks/soak.py --server kvloom --clients 64 --duration 300
    .venv/bin/python benchmarks/soak.py --server kvloom --model /tmp/tiny --max-model-len 512 \
        --clients 32 --duration 60
Every other flag is kvloom.bench.soak's (--help lists them).
"""

import sys
from pathlib import Path

from _bootstrap import bench_module

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from servers import MODEL_NAME, Server, launcher_parser  # noqa: E402


def main() -> int:
    launcher = launcher_parser(("kvloom",))
    launcher.add_argument("--model", default=None, help="with --server: a checkpoint folder to serve")
    launcher.add_argument("--max-model-len", type=int, default=1024)
    args, rest = launcher.parse_known_args()
    soak = bench_module("soak", need_engine=False)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return soak.main(rest)
    if args.server is None:
        if args.model is not None:
            rest = ["--model", args.model, *rest]  # the request's model name
        return soak.main(rest)

    server = Server(args.server, port=args.port, num_seqs=args.num_seqs, max_model_len=args.max_model_len,
                    extra=args.server_arg)
    if args.model is not None:
        server.argv[server.argv.index(MODEL_NAME)] = args.model
    with server:
        print(f"{args.server} server ready in {server.startup_s:.1f} s at {server.base_url} "
              f"(pid {server.process.pid}, log {server.log_path})", flush=True)
        return soak.main(["--base-url", server.base_url, *rest], server_pid=server.process.pid)


if __name__ == "__main__":
    sys.exit(main())
