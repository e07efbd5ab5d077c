"""The standard benchmark workload: N prompts as lists of token ids.

A copy of ``shared/bench/workload.py`` so the repository is self-contained; it must stay
identical in output. Fully determined by its arguments, so every engine (kvloom or a peer) gets the
same prompts: lengths uniform in [min_len, max_len], ids uniform in [id_lo, id_hi] (inside
SmolLM2's 49,152-token vocabulary), drawn from ``random.Random(seed)`` — length first, then that
prompt's ids. ``make_workload(8)`` is the first 8 prompts of ``make_workload(64)``.

    make_workload(64)   # 64 prompts, 9,202 tokens at seed 0
    make_workload(8)    # 8 prompts, 1,230 tokens
    python -m kvloom.bench.workload -n 64 --out prompts.json

The ``kvloom bench`` commands take it through ``add_dataset_args`` / ``load_prompts`` (vLLM's flag
names): ``--dataset-name standard`` (the default), ``random`` (every prompt ``--input-len`` tokens,
ids drawn as above), or ``--dataset-path FILE``, a JSON list of token-id lists such as ``--out`` writes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULTS: dict[str, int] = dict(seed=0, min_len=32, max_len=256, id_lo=1000, id_hi=40000)


def make_workload(n: int, seed: int = DEFAULTS["seed"], min_len: int = DEFAULTS["min_len"],
                  max_len: int = DEFAULTS["max_len"], id_lo: int = DEFAULTS["id_lo"],
                  id_hi: int = DEFAULTS["id_hi"]) -> list[list[int]]:
    """``n`` prompts of token ids; the same arguments always give the same prompts."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        prompts.append([rng.randint(id_lo, id_hi) for _ in range(length)])
    return prompts


def left_padded(prompts: list[list[int]], pad_token_id: int):  # -> (input_ids, attention_mask), torch int64
    """The prompts as one batch for HF ``generate``: left-padded with ``pad_token_id`` to the longest (each prompt
    ends at the last column) and their attention mask. torch is imported here: the rest of this module is stdlib."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, ids in enumerate(prompts):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention_mask[i, width - len(ids):] = 1
    return input_ids, attention_mask


DATASETS = ("standard", "random")


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The prompt flags every ``kvloom bench`` command (and the peer runners) share."""
    parser.add_argument("--dataset-name", choices=DATASETS, default=None,
                        help="standard: make_workload(N), 32..256 tokens (default); random: every prompt "
                             "--input-len tokens")
    parser.add_argument("--dataset-path", default=None, metavar="FILE",
                        help="a JSON list of token-id lists (python -m kvloom.bench.workload --out FILE)")
    parser.add_argument("--input-len", type=int, default=None,
                        help="prompt tokens per request (implies --dataset-name random)")


def load_prompts(args: argparse.Namespace, num_prompts: int, seed: int = DEFAULTS["seed"]) -> list[list[int]]:
    """``num_prompts`` prompts as the dataset flags ask; raises ValueError for a bad flag or file.

    A prefix of a longer request is the same prompts: ``load_prompts(args, 8)`` is the first 8 of
    ``load_prompts(args, 64)`` (the latency benchmark's batches rely on it).
    """
    if num_prompts < 1:
        raise ValueError(f"the number of prompts must be positive, got {num_prompts}")
    name = args.dataset_name
    if args.dataset_path is not None:
        if name is not None or args.input_len is not None:
            raise ValueError("--dataset-path excludes --dataset-name and --input-len")
        return read_prompts(args.dataset_path, num_prompts)
    if args.input_len is not None or name == "random":
        if args.input_len is None:
            raise ValueError("--dataset-name random needs --input-len")
        if args.input_len < 1:
            raise ValueError(f"--input-len must be positive, got {args.input_len}")
        return make_workload(num_prompts, seed=seed, min_len=args.input_len, max_len=args.input_len)
    return make_workload(num_prompts, seed=seed)


def warmup_prompt(args: argparse.Namespace, prompts: list[list[int]], seed: int = DEFAULTS["seed"]) -> list[int]:
    """A prompt like the dataset's but outside it, for a request before the timed ones: no prefix-cache help.

    Generated datasets draw it with the next seed; a file's is its first prompt reversed (ids the
    model is known to take, in an order no measured prompt starts with).
    """
    if args.dataset_path is not None:
        return list(reversed(prompts[0]))
    if args.input_len is not None:
        return make_workload(1, seed=seed + 1, min_len=args.input_len, max_len=args.input_len)[0]
    return make_workload(1, seed=seed + 1)[0]


def read_prompts(path: str, num_prompts: int) -> list[list[int]]:
    """The first ``num_prompts`` prompts of a JSON file holding a list of token-id lists."""
    try:
        prompts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: {e}") from None
    if not (isinstance(prompts, list) and prompts
            and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of non-empty lists of token ids")
    if len(prompts) < num_prompts:
        raise ValueError(f"--dataset-path {path} holds {len(prompts)} prompts, {num_prompts} asked for")
    return prompts[:num_prompts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-prompts", type=int, default=64)
    for key, value in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    parser.add_argument("--out", help="write the prompts here as a JSON list of lists")
    args = parser.parse_args(argv)
    prompts = make_workload(args.num_prompts, args.seed, args.min_len, args.max_len, args.id_lo,
                            args.id_hi)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(prompts, f)
    lengths = [len(p) for p in prompts]
    print(f"prompts={len(prompts)} total_tokens={sum(lengths)} min={min(lengths)} max={max(lengths)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
