"""The engine's prefill progress (EngineRequest.return_progress) and prefix-cache hits in RequestOutput.

A 16-token step budget splits a 70-token prompt into five prefill chunks: a request that asked for progress gets
an output after each (no completions, ``prompt_progress`` set), the last with its first token; the oracle is the
chunking rule itself (every step computes min(budget, rest) of the prompt).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvloom.engine.llm_engine import LLMEngine
from kvloom.outputs import RequestOutput
from kvloom.sampling_params import RequestOutputKind, SamplingParams

BUDGET = 16
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> LLMEngine:
    return LLMEngine.from_kwargs(model=tiny_llama_dir, dtype="float32", max_model_len=256, max_num_seqs=4,
                                 max_num_batched_tokens=BUDGET, block_size=BLOCK_SIZE)


def run(engine: LLMEngine, request_id: str, prompt: list[int], kind: RequestOutputKind,
        return_progress: bool, **params: Any) -> list[RequestOutput]:
    sampling = SamplingParams(max_tokens=3, temperature=0, output_kind=kind, **params)
    request = engine.input_processor.process(request_id, prompt, sampling)
    engine.add_request(request_id, dataclasses.replace(request, return_progress=return_progress))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_an_output_after_each_prefill_chunk(engine: LLMEngine) -> None:
    prompt = [(7 * i) % 300 + 3 for i in range(70)]
    outputs = run(engine, "progress", prompt, RequestOutputKind.DELTA, True)
    progress = [o.prompt_progress for o in outputs if o.prompt_progress is not None]
    assert [p.processed for p in progress] == [16, 32, 48, 64, 70]
    assert all(p.total == 70 and p.cache == 0 for p in progress)
    assert [p.time_ms for p in progress] == sorted(p.time_ms for p in progress)
    # Chunks that sample nothing give outputs with no completions; the last chunk's comes with the first token.
    assert all(not o.outputs for o in outputs[:4]) and outputs[4].outputs[0].token_ids
    assert sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs) == 3

    # The same prompt again: the prefix cache serves whole blocks, and only the rest is prefilled.
    again = run(engine, "again", prompt, RequestOutputKind.DELTA, True)
    hit = (70 - 1) // BLOCK_SIZE * BLOCK_SIZE
    progress = [o.prompt_progress for o in again if o.prompt_progress is not None]
    assert [p.processed for p in progress] == [70] and progress[0].cache == hit
    assert all(o.num_cached_tokens == hit for o in again)


@pytest.mark.parametrize(("kind", "return_progress"), [(RequestOutputKind.DELTA, False),
                                                      (RequestOutputKind.FINAL_ONLY, True)])
def test_no_progress_unless_asked_and_streamed(engine: LLMEngine, kind: RequestOutputKind,
                                               return_progress: bool) -> None:
    prompt = [(11 * i) % 300 + 3 for i in range(50)]
    outputs = run(engine, f"quiet-{kind.name}", prompt, kind, return_progress)
    assert all(o.prompt_progress is None and o.outputs for o in outputs)


def test_n_completions_report_their_shared_prompt_once(engine: LLMEngine) -> None:
    prompt = [(13 * i) % 300 + 3 for i in range(40)]
    outputs = run(engine, "pair", prompt, RequestOutputKind.DELTA, True, n=2)
    assert [o.prompt_progress.processed for o in outputs if o.prompt_progress is not None] == [16, 32, 40]
