"""The draft's KV cache beside the target's: which blocks hold it, and what a draft pass runs over.

A draft model's or EAGLE head's KV lives in the target's blocks (spec_decode/draft_model.py). A request the
policy gives no drafts is left out of the draft's passes, so its draft KV lags: ``DraftKV`` keeps, per request
(``RequestState.draft_*``), where the draft's KV ends and, for EAGLE, the target's hidden-state rows waiting
for the catch-up; and, per block, whether its draft KV is complete.
"""

from __future__ import annotations

import torch

from kvloom.spec_decode.draft_model import MAX_DRAFT_LAG, DraftModelProposer, DraftRequest
from kvloom.step_io import ModelRunnerOutput, ScheduledRequest
from kvloom.worker.input_batch import RequestState


class DraftKV:
    """The draft-KV bookkeeping of one runner: ``draft_requests`` after each step gives the draft's work."""

    def __init__(self, proposer: DraftModelProposer, num_blocks: int, block_size: int) -> None:
        self.proposer = proposer
        self.block_size = block_size
        # A block's draft KV is complete when the draft's KV of all its positions was written after the target's
        # last write to it (per block id). A full block may be a prefix-cache hit for another request, which must
        # know whether the draft's KV it finds there is real: a lagging request fills blocks the draft has not
        # run over.
        self.complete = bytearray(num_blocks)
        self.num_disabled = 0  # requests that drafted no more: their hit began with blocks no pass completed

    def draft_requests(self, items: list[ScheduledRequest], query_start_loc: list[int],
                       states: dict[str, RequestState], output: ModelRunnerOutput, num_drafts: dict[str, int],
                       hidden: torch.Tensor) -> tuple[list[DraftRequest], torch.Tensor]:
        """What the draft runs after this step, and the target hidden states its rows index.

        Per request the tokens the target kept (a speculated request's rejected drafts dropped) and the token
        after them, from where the draft's KV ends; guesses for the ``num_drafts`` the policy gave it. A
        request given none is left out: its draft KV lags, and EAGLE keeps its hidden-state rows until then,
        at most ``MAX_DRAFT_LAG`` of them (spec_decode/draft_model.py). A request whose draft KV cannot be
        completed drafts no more (``draft_disabled``)."""
        self._clear_complete(items)
        failed = set(output.failed_request_ids)
        reads_hidden = self.proposer.reads_hidden_states
        # (row in items, item, state, end, guesses asked)
        wanted: list[tuple[int, ScheduledRequest, RequestState, int, int]] = []
        lagging: list[tuple[RequestState, int, int]] = []  # (state, first row in hidden, rows)
        for i, item in enumerate(items):
            new_tokens = output.sampled_token_ids.get(item.request_id)
            if item.request_id in failed or (item.samples and not new_tokens):
                continue
            state = states[item.request_id]
            if state.draft_disabled:
                continue
            start = item.num_computed_tokens
            num_valid = item.num_new_tokens - item.num_draft_tokens
            if item.num_draft_tokens:
                num_valid += len(new_tokens) - 1  # the accepted drafts
            if state.draft_resumes:  # new, or readmitted after preemption: from its prefix-cache hit
                state.draft_resumes = False
                self._resume(state, item.block_ids, start)
            end = start + num_valid  # the draft's KV is to hold positions < end
            max_drafts = num_drafts.get(item.request_id, 0)
            if max_drafts or (reads_hidden and end - state.draft_hidden_start >= MAX_DRAFT_LAG):
                wanted.append((i, item, state, end, max_drafts))
            elif reads_hidden and num_valid:
                lagging.append((state, query_start_loc[i], num_valid))
        included: list[tuple[int, ScheduledRequest, RequestState, int, int]] = []
        # Those whose draft KV is whole first: their passes complete blocks that another's hit may begin with
        # (the same pass writes them before its attention reads them).
        for i, item, state, end, max_drafts in sorted(wanted, key=lambda w: w[2].draft_computed
                                                      < w[2].draft_hidden_start):
            if self._close_gap(state, item.block_ids):
                included.append((i, item, state, end, max_drafts))
                self._mark_complete(item.block_ids, state.draft_computed, end)
                continue
            # A gap at the start of its prefix-cache hit that no pass has filled yet: it cannot guess now.
            if end - state.draft_hidden_start >= MAX_DRAFT_LAG:
                state.draft_disabled, state.draft_hidden = True, []
                self.num_disabled += 1
            elif end > item.num_computed_tokens:
                lagging.append((state, query_start_loc[i], end - item.num_computed_tokens))
        if lagging:
            # One copy of every lagging request's rows (the hidden states may be a reused buffer).
            kept = hidden.index_select(0, torch.tensor([first + j for _, first, n in lagging for j in range(n)],
                                                       dtype=torch.long, device=hidden.device))
            offset = 0
            for state, _, n in lagging:
                state.draft_hidden.append(kept[offset:offset + n])
                offset += n
        if not included:
            return [], hidden
        waiting_rows = [h for _, _, state, _, _ in included for h in state.draft_hidden] if reads_hidden else []
        target_hidden = torch.cat([hidden, *waiting_rows]) if waiting_rows else hidden
        next_row = hidden.shape[0]
        requests = []
        for i, item, state, end, max_drafts in included:
            first = state.draft_computed
            rows: list[int] = []
            if reads_hidden:
                for chunk in state.draft_hidden:
                    rows.extend(range(next_row, next_row + len(chunk)))
                    next_row += len(chunk)
                rows.extend(range(query_start_loc[i], query_start_loc[i] + end - item.num_computed_tokens))
            requests.append(DraftRequest(item.request_id, first, state.token_slice(first, end + 1), end - first,
                                         item.block_ids, rows, max_drafts))
            state.draft_computed = state.draft_hidden_start = end
            state.draft_hidden = []
        return requests, target_hidden

    # ---- which blocks hold the draft's KV ----------------------------------------------------
    def _clear_complete(self, items: list[ScheduledRequest]) -> None:
        """The target wrote this step's positions of every item: their blocks' draft KV is stale."""
        size, complete = self.block_size, self.complete
        for item in items:
            first, last = item.num_computed_tokens // size, (item.num_computed_tokens + item.num_new_tokens - 1) // size
            for index in range(first, min(last + 1, len(item.block_ids))):
                complete[item.block_ids[index]] = 0

    def _mark_complete(self, block_ids: list[int], start: int, end: int) -> None:
        """The draft's KV will hold positions < ``end`` after this step's pass (from ``start`` written in it):
        the blocks wholly below it are complete (not past the positions the draft reaches)."""
        size = self.block_size
        for index in range(start // size, min(end, self.proposer.max_position) // size):
            self.complete[block_ids[index]] = 1

    def _resume(self, state: RequestState, block_ids: list[int], start: int) -> None:
        """Where a new or readmitted request's draft KV starts: after the run of complete blocks its
        prefix-cache hit (positions below ``start``) begins with. A draft model runs over the tokens from
        there. EAGLE also needs the target's hidden states of those positions: a readmitted request may have
        kept some; positions between the complete blocks and its rows are a gap (``draft_computed <
        draft_hidden_start``) that only the pass of the request that filled those blocks can close."""
        complete = self._complete_until(block_ids, 0, start)  # a hit is whole blocks: start is a block's start
        old, rows = state.draft_hidden_start, state.draft_hidden
        if not self.proposer.reads_hidden_states:
            state.draft_hidden_start, state.draft_hidden = complete, []
        elif old is not None and old <= start <= old + _num_rows(rows):
            first = max(old, complete)
            state.draft_hidden_start, state.draft_hidden = first, _row_range(rows, first - old, start - old)
        else:
            state.draft_hidden_start, state.draft_hidden = start, []
        state.draft_computed = complete

    def _close_gap(self, state: RequestState, block_ids: list[int]) -> bool:
        """Whether the draft's KV is whole up to the request's waiting rows (a gap's blocks may have been
        completed since, by their own request's pass)."""
        state.draft_computed = self._complete_until(block_ids, state.draft_computed, state.draft_hidden_start)
        return state.draft_computed == state.draft_hidden_start

    def _complete_until(self, block_ids: list[int], position: int, end: int) -> int:
        """How far from ``position`` (a block's start, or inside a complete run) the blocks' draft KV is
        complete, at most ``end``."""
        size = self.block_size
        while position < end and self.complete[block_ids[position // size]]:
            position = (position // size + 1) * size
        return min(position, end)


def _num_rows(chunks: list[torch.Tensor]) -> int:
    return sum(len(chunk) for chunk in chunks)


def _row_range(chunks: list[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    """Rows [start, end) of the chunks' concatenation, as chunks."""
    kept, offset = [], 0
    for chunk in chunks:
        lo, hi = max(start - offset, 0), min(end - offset, len(chunk))
        if lo < hi:
            kept.append(chunk[lo:hi])
        offset += len(chunk)
    return kept
