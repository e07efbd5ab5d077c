"""Graph-replayed steps (worker/graphs.py) see the inputs an eager step would: a speculative verification
step (a token and its drafts a request) and a decode step, padded to a bucket, through the Triton paged
attention (Triton's interpreter on the CPU; tests/conftest.py sets TRITON_INTERPRET=1) against the plain-torch
reference over the eager step's metadata.

CUDA graphs need a GPU: here a stand-in graph replays the captured forward over the same persistent buffers,
so what is tested is what the buffers hold at a replay (ids, positions, slots, context lengths, block tables,
each request's token offsets, the padding requests); the real capture runs in tests/gpu.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
import torch
from paged_batch import place_requests

from kvloom.ops import cuda as triton_ops
from kvloom.ops.reference import allocate_kv_cache, attention_reference
from kvloom.step_io import ScheduledRequest
from kvloom.worker import graphs as graphs_module
from kvloom.worker.graphs import DecodeGraphs
from kvloom.worker.input_batch import InputBatch
from kvloom.worker.model_runner import ModelRunner

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 4, 2, 16, 50


class FakeGraph:
    """Records the forwards made while it captures; replay() runs them again into the same outputs."""

    capturing: FakeGraph | None = None

    def __init__(self) -> None:
        self.replays: list[Callable[[], None]] = []

    def replay(self) -> None:
        for run in self.replays:
            run()

    def pool(self) -> None:
        return None


class _capture:
    def __init__(self, graph: FakeGraph, pool=None, capture_error_mode: str = "global") -> None:
        self.graph = graph

    def __enter__(self) -> None:
        FakeGraph.capturing = self.graph

    def __exit__(self, *exc) -> None:
        FakeGraph.capturing = None


@pytest.fixture
def fake_cuda_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graphs_module.torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(graphs_module.torch.cuda, "graph", _capture)
    monkeypatch.setattr(graphs_module.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)


class TinyAttention:
    """A one-layer 'model': each token's query, key and value drawn from tables by token id (the query also
    by position), through paged attention -> [T, HEADS * HEAD_DIM]."""

    def __init__(self, num_blocks: int, attention: Callable) -> None:
        generator = torch.Generator().manual_seed(0)
        self.q = torch.randn(VOCAB, HEADS, HEAD_DIM, generator=generator)
        self.q_pos = torch.randn(64, HEADS, HEAD_DIM, generator=generator)
        self.k = torch.randn(VOCAB, KV_HEADS, HEAD_DIM, generator=generator)
        self.v = torch.randn(VOCAB, KV_HEADS, HEAD_DIM, generator=generator)
        self.key_cache, self.value_cache = allocate_kv_cache(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM,
                                                             torch.float32, torch.device("cpu"))
        self.attention = attention

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        query = self.q[input_ids] + self.q_pos[positions]
        out = self.attention(query, self.k[input_ids], self.v[input_ids], self.key_cache, self.value_cache,
                             metadata, HEAD_DIM ** -0.5)
        return out.reshape(len(input_ids), -1)


def _recording(model: TinyAttention) -> Callable:
    """The model as DecodeGraphs' forward: a forward made while a FakeGraph captures is replayed by it."""
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        out = model(input_ids, positions, metadata)
        graph = FakeGraph.capturing
        if graph is not None:
            graph.replays.append(lambda: out.copy_(model(input_ids, positions, metadata)))
        return out
    return forward


def _steps(query_len: int, contexts: list[int], seed: int) -> tuple[list[ScheduledRequest], int]:
    placed = place_requests([query_len] * len(contexts), contexts, BLOCK_SIZE, seed=seed)
    tokens = torch.randint(1, VOCAB, (len(contexts), query_len), generator=torch.Generator().manual_seed(seed))
    items = [ScheduledRequest(request_id=f"r{i}", num_computed_tokens=context, token_ids=tokens[i].tolist(),
                              block_ids=[b for b in placed.block_tables[i] if b], samples=True,
                              num_draft_tokens=query_len - 1)
             for i, context in enumerate(contexts)]
    return items, placed.num_blocks


def _fill_contexts(model: TinyAttention, items: list[ScheduledRequest]) -> None:
    """Keys and values for every request's cached positions (random, as an earlier step would have left)."""
    generator = torch.Generator().manual_seed(1)
    for item in items:
        for position in range(item.num_computed_tokens):
            block, offset = item.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
            model.key_cache[block, offset] = torch.randn(KV_HEADS, HEAD_DIM, generator=generator)
            model.value_cache[block, offset] = torch.randn(KV_HEADS, HEAD_DIM, generator=generator)


@pytest.mark.parametrize("query_len,contexts", [(3, [5, 9, 2]), (4, [7]), (1, [3, 12, 6, 1, 8])],
                         ids=["verify-3-padded", "verify-4-batch-1", "decode-padded"])
def test_graph_step_sees_what_the_eager_step_sees(fake_cuda_graphs: None, query_len: int, contexts: list[int]) -> None:
    items, num_blocks = _steps(query_len, contexts, seed=len(contexts))
    eager = TinyAttention(num_blocks, attention_reference)
    graphed = TinyAttention(num_blocks, triton_ops.attention)
    for model in (eager, graphed):
        _fill_contexts(model, items)
    max_blocks = max(len(item.block_ids) for item in items) + 2
    ordered, inputs = InputBatch(BLOCK_SIZE, max_blocks, torch.device("cpu"), needs_decode_mask=False).prepare(
        items, None, pad=False)
    assert [item.request_id for item in ordered] == [item.request_id for item in items]
    expected = eager(inputs.input_ids, inputs.positions, inputs.metadata)

    graphs = DecodeGraphs(_recording(graphed), [1, 2, 8], max_blocks, BLOCK_SIZE, None, torch.device("cpu"),
                          max_query_len=4)
    assert graphs.can_run(len(items), query_len) and not graphs.can_run(len(items), 5)
    runner = types.SimpleNamespace(block_size=BLOCK_SIZE, graphs=graphs)
    with torch.inference_mode():  # as the runner's steps run
        hidden = ModelRunner._decode_with_graph(runner, items)
    bucket = 1 if len(items) == 1 else 8
    assert list(graphs.captured) == [(bucket, query_len)]
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-4)
    # The step wrote its tokens' keys and values where the eager step did, and the padding wrote none.
    torch.testing.assert_close(graphed.key_cache, eager.key_cache)
    torch.testing.assert_close(graphed.value_cache, eager.value_cache)

    # A second step through the same graph (the buffers keep the first step's rows): the next tokens.
    following = [item._replace(num_computed_tokens=item.num_computed_tokens + query_len,
                               token_ids=[(t + 7) % VOCAB for t in item.token_ids],
                               block_ids=item.block_ids + [num_blocks + i])
                 for i, item in enumerate(items)]
    for model in (eager, graphed):
        for name in ("key_cache", "value_cache"):
            cache = getattr(model, name)
            setattr(model, name, torch.cat([cache, torch.zeros(len(items), *cache.shape[1:])]))
    _, inputs = InputBatch(BLOCK_SIZE, max_blocks, torch.device("cpu"), False).prepare(following, None, pad=False)
    expected = eager(inputs.input_ids, inputs.positions, inputs.metadata)
    with torch.inference_mode():
        hidden = ModelRunner._decode_with_graph(runner, following)
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(graphed.key_cache, eager.key_cache)
