"""The ``kvloom`` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import json
import sys

from kvloom.config import DEFAULT_MODEL, add_engine_args, config_from_args


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object per completion")


def _sampling_params(args: argparse.Namespace):
    from kvloom.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed, n=args.n, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def _print_outputs(outputs, as_json: bool) -> None:
    for output in outputs:
        for completion in output.outputs:
            if as_json:
                print(json.dumps({"prompt": output.prompt, "index": completion.index, "text": completion.text,
                                  "token_ids": completion.token_ids,
                                  "finish_reason": completion.finish_reason}))
            else:
                print(f"{output.prompt!r} -> {completion.text!r} [{completion.finish_reason}]")


def cmd_generate(args: argparse.Namespace) -> int:
    from kvloom.llm import LLM

    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    if not prompts:
        print("kvloom generate: give at least one prompt (or --prompts-file)", file=sys.stderr)
        return 2
    config = config_from_args(args)
    llm = LLM(**config.to_dict())
    _print_outputs(llm.generate(prompts, _sampling_params(args), use_tqdm=not args.json), args.json)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvloom.llm import LLM

    llm = LLM(**config_from_args(args).to_dict())
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.message:
        messages.append({"role": "user", "content": args.message})
        _print_outputs(llm.chat(messages, params, use_tqdm=False), args.json)
        return 0
    print("kvloom chat: type a message, an empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> int:
    from kvloom.entrypoints.openai.api_server import run_server

    return run_server(args) or 0


BENCHMARKS = {
    "throughput": "offline LLM.generate over a workload: tok/s, GFLOP/s, start-up, memory (--peer vllm|hf|llamacpp)",
    "latency": "one batch of B requests: time to first token and decode step time (--peer vllm|hf)",
    "serve": "load generator for an OpenAI-compatible server: TTFT, TPOT, ITL, throughput "
             "(--server kvloom|vllm|llamacpp)",
    "agent": "agent conversations with tool calls against a chat server: TTFT per turn, sessions/min, "
             "prefix-cache hit rate",
    "realsize": "one GGUF at a real size (1B-8B): decode, prefill, N-sequence decode, memory, ready time, "
                "fraction of the memory-bandwidth bound",
}


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"kvloom.bench.{args.bench_kind}").execute(args)


def _add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """``kvloom bench throughput|latency|serve|agent`` (vLLM's ``vllm bench``): each takes its module's flags.

    The modules import neither torch nor the engine at import time, so building these parsers is cheap.
    """
    import importlib

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, agent",
                           description="kvloom's benchmarks (docs/benchmarks.md); peers and studies are in "
                                       "benchmarks/ of the repository")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="BENCHMARK", required=True)
    for kind, help_text in BENCHMARKS.items():
        module = importlib.import_module(f"kvloom.bench.{kind}")
        kinds.add_parser(kind, help=help_text, description=module.__doc__, add_help=False,
                         parents=[module.build_parser(prog=f"kvloom bench {kind}")],
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.set_defaults(func=cmd_bench)


def cmd_env(args: argparse.Namespace) -> int:
    from kvloom.collect_env import main as collect_env

    return collect_env(as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvloom", description="kvloom: LLM inference and serving "
                                     "with continuous batching over a paged KV cache")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete prompts offline and print the results")
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (one message, or interactive)")
    chat.add_argument("message", nargs="?", help="one user message (omit for an interactive chat)")
    chat.add_argument("--system", help="a system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model_tag", nargs="*", default=None, metavar="MODEL",
                       help=f"model(s) to serve (default {DEFAULT_MODEL}), each [NAME=]MODEL: a HF directory, a "
                       ".gguf file, a Hugging Face cache folder or a folder of models; several are loaded on demand "
                       "(docs/serving.md, Many models)")
    from kvloom.entrypoints.openai.args import add_server_args

    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    _add_bench_parsers(sub)

    env = sub.add_parser("env", help="report the machine (CPU ISA level, torch, kernels, ops chosen) for bug reports")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kvloom {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
