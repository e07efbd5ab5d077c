"""Shape buckets and CUDA graphs for decode steps (the seeds' token-generation buckets).

A step whose scheduled requests are all decodes (one new token each) is padded up to the smallest
token-generation bucket that holds it and replayed from the CUDA graph captured for that bucket:
one launch for the whole forward instead of hundreds. The graph reads its inputs from persistent
buffers, so a step only copies its ids, positions, slots, context lengths and block-table rows in:

    row:          0 .. n-1 (real requests)          n .. B-1 (padding)
    input_ids     the new token                     0
    positions     its position                      0
    slot_mapping  its cache slot                    -1: the KV write skips it
    seq_lens      context length incl. the token    0: attention reads nothing, writes zeros
    block_table   the request's blocks              whatever an earlier step left (never read)

Padding never changes a request's tokens: padded rows write no cache slot and no real row reads them.

Speculative decoding adds verification steps: each request's last known token and its q - 1 drafts. Where
every request of such a step has the same q, the step replays the graph of (bucket, q), captured on its first
use: request i owns tokens [i * q, (i + 1) * q), and attention runs the prefill kernel over each request's
cached context (its grid fixed by the bucket and q, its offsets read on the device). Padding requests own q
tokens each, with no slot and context length 0. Steps of mixed lengths run eagerly.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from kvloom.ops.metadata import AttentionMetadata

logger = logging.getLogger("kvloom")

# A decode batch is a forward over [B] tokens: (input_ids, positions, metadata) -> hidden [B, H].
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def default_token_gen_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond: padding wastes at most ~12%."""
    buckets, size = [], 1
    while size < 8:
        buckets.append(size)
        size *= 2
    while size <= max_num_seqs:
        buckets.append(size)
        size += 8 if size < 64 else 16 if size < 256 else 32
    if buckets[-1] != max_num_seqs and max_num_seqs > buckets[-1]:
        buckets.append(max_num_seqs)
    return [b for b in buckets if b <= max_num_seqs]


def pick_bucket(size: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``size``, or None when none does."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    return None


class DecodeGraphs:
    """One captured CUDA graph per token-generation bucket, over shared persistent input buffers; with
    speculative decoding also one per (bucket, tokens per request) a verification step has used."""

    def __init__(self, forward: ForwardFn, buckets: list[int], max_blocks_per_seq: int, block_size: int,
                 sliding_window: int | None, device: torch.device, max_query_len: int = 1) -> None:
        self.forward = forward
        self.buckets = sorted(buckets)
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device
        self.max_query_len = max_query_len
        size = self.buckets[-1]
        tokens = size * max_query_len
        # Rows of one buffer: input ids, positions, slot mapping (one entry a token), context lengths (one a
        # request: the first B entries of row 3); one copy per step.
        self.rows = torch.zeros(4, tokens, dtype=torch.long, device=device)
        self.rows[2].fill_(-1)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.rows.unbind(0)
        self.block_table = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        # Pinned host twins, two sets used in turn: steps fill one with numpy, then copy it asynchronously. With
        # async scheduling a step is prepared while the one before still runs, and that one's copies may not have
        # started yet; the set before it is free (its step ended before this one was scheduled).
        self.host_rows_sets = [torch.zeros(5, tokens, dtype=torch.long).pin_memory() for _ in range(2)]
        self.host_block_tables = [torch.zeros(size, max_blocks_per_seq, dtype=torch.int32).pin_memory()
                                  for _ in range(2)]
        self.turn = 0
        # Row 4 of the host rows: where a row's input id comes from in the previous step's sampled tokens (-1:
        # row 0 holds it). On the device it goes to its own buffer.
        self.sources = torch.full((size,), -1, dtype=torch.long, device=device)
        # Request i owns tokens [i * q, (i + 1) * q): one fixed tensor per q (a graph reads it, never a copy).
        self.query_start_locs: dict[int, torch.Tensor] = {}
        # (bucket, tokens per request) -> the graph and its output (hidden states [B * q, H])
        self.captured: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The decode graphs (one token a request) by bucket."""
        return {batch: graph for (batch, q), (graph, _) in self.captured.items() if q == 1}

    def metadata(self, batch: int, query_len: int = 1) -> AttentionMetadata:
        """A bucket's metadata: one-token decodes (the decode kernel) or ``query_len`` tokens a request (the
        prefill kernel over each request's cached context: a verification step's last token and drafts)."""
        query_start_loc = self.query_start_locs.get(query_len)
        if query_start_loc is None:
            size = self.buckets[-1]
            query_start_loc = torch.arange(0, (size + 1) * query_len, query_len, dtype=torch.int32,
                                           device=self.device)
            self.query_start_locs[query_len] = query_start_loc
        tokens = batch * query_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], block_table=self.block_table[:batch],
            seq_lens=self.seq_lens[:batch], query_start_loc=list(range(0, tokens + 1, query_len)),
            seq_lens_host=[query_len] * batch, num_decodes=batch if query_len == 1 else 0,
            block_size=self.block_size, sliding_window=self.sliding_window,
            query_start_loc_tensor=query_start_loc[:batch + 1], max_query_len=query_len)

    @torch.inference_mode()
    def capture(self, buckets: list[int] | None = None, query_len: int = 1) -> None:
        """Capture the buckets (default: every one) for steps of ``query_len`` tokens a request, largest first
        (the smaller ones reuse its memory pool).

        Safe between steps: the device is drained first (a step in flight may still read the input buffers),
        and the buffers are reset to padding rows (no cache slot written, no context read), so the warm-up
        and captured forwards touch no request's KV.
        """
        start = time.perf_counter()
        buckets = sorted(self.buckets if buckets is None else buckets, reverse=True)
        torch.cuda.synchronize(self.device)
        self.rows.zero_()
        self.rows[2].fill_(-1)
        # A garbage collection inside a capture could free CUDA or pinned memory of some earlier
        # engine, which invalidates the capture: collect first, and not again until it is done.
        gc.collect()
        gc.disable()
        try:
            for batch in buckets:
                metadata = self.metadata(batch, query_len)
                tokens = batch * query_len
                inputs = (self.input_ids[:tokens], self.positions[:tokens], metadata)
                self.forward(*inputs)  # compiles the kernels for this shape outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (a server's) cannot break this capture.
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    output = self.forward(*inputs)
                if self.pool is None:
                    self.pool = graph.pool()
                self.captured[(batch, query_len)] = (graph, output)
        finally:
            gc.enable()
        torch.cuda.synchronize(self.device)
        what = "decode" if query_len == 1 else f"{query_len}-token verification"
        logger.log(logging.INFO if len(buckets) > 1 else logging.DEBUG, "Captured CUDA graphs for %d %s "
                   "buckets (%s) in %.2f s", len(buckets), what, ",".join(map(str, buckets)),
                   time.perf_counter() - start)

    def can_run(self, num_requests: int, query_len: int = 1) -> bool:
        """Whether a bucket holds the batch (its graph is captured now if it was not: lazy capture)."""
        return bool(self.buckets) and num_requests <= self.buckets[-1] and 1 <= query_len <= self.max_query_len

    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            block_rows: list[list[int]], sources: list[int] | None = None,
            previous: torch.Tensor | None = None) -> torch.Tensor:
        """One step for n requests of q tokens each (host lists: q entries a request for the ids, positions and
        slots, one a request for the context lengths and block-table rows) -> hidden states [n * q, H].

        The inputs are written into pinned host buffers and copied in two asynchronous transfers. Async
        scheduling (decodes): row i's input id is ``previous[sources[i]]`` where ``sources[i] >= 0``
        (``previous``: the last step's sampled tokens, still on the device).
        """
        n = len(seq_lens)
        query_len = len(input_ids) // n
        batch = pick_bucket(n, self.buckets)
        if (batch, query_len) not in self.captured:
            self.capture([batch], query_len)
        host_rows, host_table = self.host_rows_sets[self.turn], self.host_block_tables[self.turn]
        self.turn ^= 1
        rows = host_rows.numpy()
        used, tokens = n * query_len, batch * query_len
        rows[0, :used], rows[1, :used], rows[2, :used], rows[3, :n] = input_ids, positions, slot_mapping, seq_lens
        if batch > n:  # padding rows: token 0 at position 0, no cache slot, no context
            rows[:2, used:tokens] = 0
            rows[2, used:tokens] = -1
            rows[3, n:batch] = 0
        table = host_table.numpy()
        for i, row in enumerate(block_rows):
            table[i, :len(row)] = row
        self.rows[:, :tokens].copy_(host_rows[:4, :tokens], non_blocking=True)
        self.block_table[:n].copy_(host_table[:n], non_blocking=True)
        if previous is not None and sources is not None:
            rows[4, :n] = sources
            rows[4, n:batch] = -1
            source = self.sources[:batch]
            source.copy_(host_rows[4, :batch], non_blocking=True)
            taken = previous.to(torch.long).index_select(0, source.clamp(min=0))
            self.input_ids[:batch].copy_(torch.where(source >= 0, taken, self.input_ids[:batch]))
        graph, output = self.captured[(batch, query_len)]
        graph.replay()
        return output[:used]
