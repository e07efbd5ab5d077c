"""``kvloom bench serve`` against a server this script starts and stops: kvloom, vLLM or llama.cpp.

Starting the server (see peers/servers.py for each one's flags; its start-up time and peak RSS are printed):
    .venv/bin/python benchmarks/serve.py --server vllm --concurrency 64
    .venv/bin/python benchmarks/serve.py --server llamacpp --request-rate 4
    .venv/bin/python benchmarks/serve.py --server kvloom --concurrency 8
Without --server it is ``kvloom bench serve`` against --base-url. Every other flag is ``kvloom bench
serve``'s (--help lists them).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from servers import Server, launcher_parser  # noqa: E402

from kvloom.bench import serve  # noqa: E402


def main() -> int:
    launcher = launcher_parser(("kvloom", "vllm", "llamacpp"))
    launcher.add_argument("--gguf", default=None, help="llamacpp: bf16 (default), f16, q8_0, q4_1 or a path")
    args, rest = launcher.parse_known_args()
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return serve.main(rest)
    if args.server is None:
        return serve.main(rest)

    with Server(args.server, port=args.port, num_seqs=args.num_seqs, gguf=args.gguf,
                extra=args.server_arg) as server:
        print(f"{args.server} server ready in {server.startup_s:.1f} s at {server.base_url} "
              f"(log {server.log_path})", flush=True)
        extra_body = []
        if args.server == "llamacpp" and "--extra-body" not in rest:
            # llama-server reuses a slot's cached prompt prefix by default; measure full prefills.
            extra_body = ["--extra-body", '{"cache_prompt": false}']
        code = serve.main(["--base-url", server.base_url, *extra_body, *rest])
        rss = server.peak_rss_mib()
        print(f"server peak RSS {rss:.0f} MiB" if rss else "server peak RSS n/a")
        return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        sys.exit(f"serve.py: error: {e}")
