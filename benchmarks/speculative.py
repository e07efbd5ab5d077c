"""Speculative decoding against the plain engine (greedy): output tok/s, alternated fresh engines, medians,
the drafts accepted and the mean acceptance length (tokens per target step, the unit tools/train_eagle.py prints),
and a check that every method gives the plain engine's tokens.

Workloads (``--workload``): ``copy``, chats asking to copy a passage, or to fix its spelling, that is longer
than the reply's ``--max-tokens`` (n-gram lookup's best case; for an EAGLE head trained on chat replies,
text it may not have seen); ``chat``, chat-templated
questions answered until EOS or ``--max-tokens``, the kind of text tools/train_eagle.py trains and evaluates on;
``standard``, the throughput benchmark's random-token prompts (kvloom/bench/workload.py: nothing to look
up), what speculation must not slow down (at most 3% at 64 sequences).

    .venv/bin/python benchmarks/speculative.py            # n-gram, SmolLM2 on the CPU, batch 1 and 8
    .venv/bin/python benchmarks/speculative.py --batch 1 --repeats 5 --num-speculative-tokens 4
    .venv/bin/python benchmarks/speculative.py --methods ngram draft_model --batch 1
        # draft_model: --draft-model PATH (default: the target itself, which accepts every draft: the upper
        # bound of the acceptance; no smaller SmolLM2 is available offline)
    .venv/bin/python benchmarks/speculative.py --methods eagle --eagle-model HEAD_DIR --workload chat --batch 1
    .venv/bin/python benchmarks/speculative.py --methods eagle --eagle-model HEAD_DIR --workload chat --batch 1 \
        --num-prompts 8 --int8-draft   # the 8 chat questions one after another at batch 1; bf16 and int8 head
    .venv/bin/python benchmarks/speculative.py --workload standard --batch 64 --max-tokens 128 --repeats 3
    .venv/bin/python benchmarks/speculative.py --methods eagle --eagle-model HEAD_DIR --workload standard \
        --batch 64 --max-tokens 128 --repeats 5 --drafts-off-at 32   # and with drafts off: the head's own cost

Figures, with the command that measures each: docs/speculative.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from kvloom import LLM, SamplingParams
from kvloom.bench.workload import make_workload

# Chat questions in the style of tools/train_eagle.py's prompts (not among them).
QUESTIONS = (
    "What is the difference between a comet and an asteroid?", "How do plants make their own food?",
    "Give me three tips for learning a new language.", "Why is the sky blue?",
    "Explain what a Python list comprehension is.", "What causes the seasons on Earth?",
    "Write a short poem about the ocean.", "How can I save money on groceries?",
)
# The copy workload: passages longer than the default 96 output tokens (~115 tokens each), so a reply that
# does what it is asked is copied text to the end. (An earlier version asked a raw prompt to copy a 38-token
# text "twice"; SmolLM2 copied it once and then wrote a new paragraph, 58 of its 96 tokens.)
PASSAGES = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships that passed "
    "in the dark knew the rocks were near when they saw its slow white beam sweep across the water. When the "
    "last keeper retired, the light was made automatic, and the little house beside the tower stood empty. "
    "Today visitors walk up the same stairs to look out over the sea, and on clear evenings they can still "
    "watch the beam turn above their heads.",
    "Our team meets every Monday at nine to plan the week. Each person says what they finished last week, what "
    "they will work on next, and anything that is blocking them. We keep the meeting under thirty minutes, and "
    "longer discussions move to a separate call with only the people who need to be there. Notes are written "
    "in the shared document during the meeting, so that anyone who missed it can read them afterwards. If you "
    "are new to the team, please add your name to the list at the top of the document before your first "
    "meeting.",
)
# Copy and edit requests (an edit that fixes a misspelt word keeps the rest of the text as it is).
COPY_REQUESTS = ("Copy this text exactly:\n\n{text}", "Repeat the following text word for word:\n\n{text}",
                 "Fix the spelling in this text:\n\n{text}")
MISSPELT = {"narrow": "narow", "polished": "polishd", "separate": "seperate", "afterwards": "afterwrds"}


def copy_prompt(i: int) -> list[dict[str, str]]:
    """Row i of the copy workload: a chat asking to copy (or fix the spelling of) one of PASSAGES."""
    text = PASSAGES[i % len(PASSAGES)]
    request = COPY_REQUESTS[i % len(COPY_REQUESTS)]
    if request.startswith("Fix"):
        for right, wrong in MISSPELT.items():
            text = text.replace(right, wrong)
    return [{"role": "user", "content": request.format(text=text)}]


def _same_tokens(ours: list, plain: list) -> str:
    """True, or how many outputs differ and where each first departs from the plain engine's (near-ties in
    bf16: a verification step's product over several rows rounds differently from a one-row decode)."""
    if ours == plain:
        return "True"
    firsts = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(ours, plain) if x != y]
    return f"False ({len(firsts)} of {len(plain)} outputs differ, first at tokens {firsts})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft_model", "eagle", "eagle3"])
    parser.add_argument("--draft-model", default=None, help="the draft model (default: the target itself)")
    parser.add_argument("--eagle-model", default=None, help="the EAGLE head's directory (eagle / eagle3)")
    parser.add_argument("--workload", choices=["copy", "chat", "standard"], default="copy")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the largest --batch")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests per run (default: the batch); more than --batch queue and run --batch at a "
                             "time (--max-num-seqs is then the batch), e.g. all 8 chat questions at batch 1")
    parser.add_argument("--step-times", action="store_true",
                        help="also print each config's median step time by the step's number of tokens")
    parser.add_argument("--int8-draft", action="store_true",
                        help="also run each draft_model / eagle method with its draft stored as int8 "
                             "(speculative_config quantization)")
    parser.add_argument("--fixed-k", action="store_true",
                        help="also run each method with adaptive speculation off (k drafts at every step)")
    parser.add_argument("--drafts-off-at", type=int, default=None, metavar="N",
                        help="also run each method with disable_by_batch_size=N: at batches of N or more no "
                             "drafts, so what remains is the drafter's own cost (a head's KV catching up)")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (LLM(dtype=...))")
    parser.add_argument("--full-warmup", action="store_true",
                        help="warm each fresh engine up on the whole workload, not 4 tokens of one prompt (on a GPU: "
                             "the kernels of every step shape compiled and graphs captured before the timed run)")
    args = parser.parse_args()
    k = args.num_speculative_tokens
    print(f"load average at start: {os.getloadavg()}", flush=True)
    configs: dict[str, dict | None] = {"plain": None}
    for method in args.methods:
        if method == "ngram":
            configs[method] = {"method": "ngram", "num_speculative_tokens": k,
                               "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
        elif method == "draft_model":
            configs[method] = {"method": method, "model": args.draft_model or args.model, "num_speculative_tokens": k}
        else:
            if args.eagle_model is None:
                parser.error(f"--methods {method} needs --eagle-model")
            configs[method] = {"method": method, "model": args.eagle_model, "num_speculative_tokens": k}
    if args.int8_draft:
        for method in args.methods:
            if method != "ngram":
                configs[f"{method}-int8"] = {**configs[method], "quantization": "int8"}
    if args.fixed_k:
        for method in args.methods:
            configs[f"{method}-fixed-k"] = configs[method]
    if args.drafts_off_at is not None:
        for method in args.methods:
            configs[f"{method}-off-at-{args.drafts_off_at}"] = {**configs[method],
                                                                "disable_by_batch_size": args.drafts_off_at}
    names = [name for name in configs if name != "plain"]
    # The standard workload runs to max_tokens; copies and chat answers stop at EOS (tok/s counts the tokens made).
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.workload == "standard")
    for batch in args.batch:
        count = args.num_prompts or batch
        # With --num-prompts the batch is the engine's limit; else every batch runs in one engine size.
        max_num_seqs = batch if args.num_prompts is not None else args.max_num_seqs or max(args.batch)
        if args.workload == "copy":
            prompts = [copy_prompt(i) for i in range(count)]
        elif args.workload == "standard":
            prompts = [{"prompt_token_ids": p} for p in make_workload(count)]  # random ids: nothing to look up
        else:
            prompts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]
        rates: dict[str, list[float]] = {name: [] for name in configs}
        step_times: dict[str, dict[int, list[float]]] = {}
        tokens: dict[str, list] = {}
        acceptance: dict[str, str] = {}
        drafter_shares: dict[str, list[tuple[float, int]]] = {}  # per run: (the drafter's share of it, its rows)
        for repeat in range(args.repeats):
            # Alternated: A B C, C B A, ... so slow drift of the shared machine falls on every config alike.
            order = list(configs.items())
            for name, config in (order if repeat % 2 == 0 else order[::-1]):
                llm = LLM(model=args.model, max_model_len=512 if args.workload != "standard" else 1024,
                          max_num_seqs=max_num_seqs, speculative_config=config, dtype=args.dtype)
                if name.endswith("-fixed-k"):
                    llm.llm_engine.executor.driver.speculator.policy.adaptive = False
                generate = llm.generate if args.workload == "standard" else llm.chat
                if args.full_warmup:
                    generate(prompts, params, use_tqdm=False)
                else:
                    generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
                before = llm.llm_engine.scheduler.stats()
                if args.step_times:
                    _time_steps(llm, step_times.setdefault(name, {}))
                drafter = _time_drafter(llm)
                start = time.perf_counter()
                outputs = generate(prompts, params, use_tqdm=False)
                made = sum(len(o.outputs[0].token_ids) for o in outputs)
                seconds = time.perf_counter() - start
                rates[name].append(made / seconds)
                if drafter is not None:
                    drafter_shares.setdefault(name, []).append((drafter["seconds"] / seconds, drafter["rows"]))
                print(f"  batch {batch} repeat {repeat + 1} {name}: {rates[name][-1]:.1f} tok/s, load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
                tokens[name] = [o.outputs[0].token_ids for o in outputs]
                if config is not None:
                    stats = llm.llm_engine.scheduler.stats()
                    drafted = stats.num_draft_tokens - before.num_draft_tokens
                    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
                    # Each request's first token comes from its prefill; every later target step gives the
                    # drafts it accepted and one token of its own.
                    decoded = made - len(outputs)
                    length = decoded / max(decoded - accepted, 1)
                    steps = stats.num_drafts - before.num_drafts
                    per_position = [(a - b) / max(steps, 1) for a, b in zip(
                        stats.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos)]
                    acceptance[name] = (f"{accepted} of {drafted} drafts accepted in {steps} speculated steps "
                                        f"(per position {', '.join(f'{r:.2f}' for r in per_position)}), mean "
                                        f"acceptance length {length:.2f}")
        plain = statistics.median(rates["plain"])
        line = [f"batch {batch}: plain {plain:.1f} tok/s ({' / '.join(f'{r:.1f}' for r in rates['plain'])})"]
        for name in names:
            rate = statistics.median(rates[name])
            # Each repeat's ratio to the plain engine's run beside it: robust to the machine's slow drift.
            pairs = [r / p for r, p in zip(rates[name], rates["plain"])]
            line.append(f"{name} {rate:.1f} ({' / '.join(f'{r:.1f}' for r in rates[name])}): {rate / plain:.2f}x "
                        f"(per pair {' / '.join(f'{r:.2f}' for r in pairs)}, median {statistics.median(pairs):.2f}x), "
                        f"{acceptance[name]}, same tokens: {_same_tokens(tokens[name], tokens['plain'])}")
            if name in drafter_shares:
                shares = drafter_shares[name]
                line[-1] += (f", the drafter's passes {100 * statistics.median(s for s, _ in shares):.1f}% of the run "
                             f"over {statistics.median(r for _, r in shares):.0f} rows (medians)")
        print("; ".join(line), flush=True)
        for name, by_size in step_times.items():
            # Medians resist the steps the machine's other work delayed; sizes: tokens in the step, drafts included.
            print(f"  {name} step times by tokens in the step: " + ", ".join(
                f"{n}: {1000 * statistics.median(v):.2f} ms ({len(v)})" for n, v in sorted(by_size.items())),
                flush=True)
        step_times.clear()
    print(f"load average at end: {os.getloadavg()}", flush=True)
    return 0


def _time_drafter(llm: LLM) -> dict[str, float] | None:
    """Time a draft model's / EAGLE head's work after each step (its passes, and their rows: the tokens
    it runs over), or None without one."""
    runner = llm.llm_engine.executor.driver
    proposer = getattr(runner, "proposer", None)
    if proposer is None:
        return None
    totals = {"seconds": 0.0, "rows": 0}
    propose = proposer.propose

    def timed(requests, *args):
        start = time.perf_counter()
        drafts = propose(requests, *args)
        totals["seconds"] += time.perf_counter() - start
        totals["rows"] += sum(r.num_valid for r in requests)
        return drafts

    proposer.propose = timed
    return totals


def _time_steps(llm: LLM, by_size: dict[int, list[float]]) -> None:
    """Record each engine step's wall time under its number of batched tokens."""
    engine = llm.llm_engine
    schedule, step = engine.scheduler.schedule, engine.step
    sizes: list[int] = []

    def scheduling() -> object:
        out = schedule()
        sizes.append(out.num_batched_tokens)
        return out

    def timed() -> list:
        start = time.perf_counter()
        outputs = step()
        if sizes:
            by_size.setdefault(sizes.pop(), []).append(time.perf_counter() - start)
        return outputs

    engine.scheduler.schedule, engine.step = scheduling, timed


if __name__ == "__main__":
    raise SystemExit(main())
