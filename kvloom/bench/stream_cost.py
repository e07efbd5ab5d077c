"""The host cost of a streamed completion's output path, early in the stream and late in it.

The study's command is ``benchmarks/stream_cost.py``; ``measure_paired`` is kept here because
``tests/e2e/test_output_processor.py`` pins the output path's flatness with it.

A request runs with ``ignore_eos`` to ``--max-tokens`` tokens through ``LLMEngine.step()``, asking
for per-step outputs (``output_kind``: ``delta``, as the server streams, by default), with
logprobs and a stop string that never matches (so text is held back and searched). Two
measurements, both per decode step:

- ``single``: one request alone; the output processor's time (detokenizing, stop strings, logprobs,
  building the outputs) and the step's time outside the model (the step minus
  ``executor.execute``: the output processor plus the scheduler and the KV cache manager), first
  ``--window`` steps against the last. Simple, but on a shared machine the load can change between
  the two windows.
- ``paired``: a second, fresh request joins for the long one's last ``--window`` tokens; in each
  of those steps the output processor's time for the long request (tokens N-window..N) is divided
  by its time for the fresh one (tokens 0..window). Both see the same load, so the median of the
  ratios is steady however busy the machine is.

An output path that copies a request's whole output at every step costs more per token at the
end than at the start (ratios that grow with ``--max-tokens``); a flat one gives ratios near 1.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


class _Timer:
    """Wraps methods of an object so the seconds spent in them add up, in total and per key."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_key: dict[str, float] = {}
        self._wrapped: list[tuple[Any, str]] = []

    def wrap(self, target: Any, name: str, key: Any = None) -> None:
        """``key(args)``: what to file each call's time under (None: the total only)."""
        method = getattr(target, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds += elapsed
                if key is not None:
                    k = key(args)
                    self.by_key[k] = self.by_key.get(k, 0.0) + elapsed

        setattr(target, name, timed)
        self._wrapped.append((target, name))

    def reset(self) -> None:
        self.seconds = 0.0
        self.by_key.clear()

    def unwrap(self) -> None:
        for target, name in self._wrapped:
            delattr(target, name)  # the class's method again
        self._wrapped.clear()


def _summary_us(steps: list[float]) -> dict[str, float]:
    """Median and 10th percentile in microseconds (the 10th percentile: a step no other process
    got in the way of)."""
    ordered = sorted(steps)
    return {"median_us": statistics.median(ordered) * 1e6, "p10_us": ordered[len(ordered) // 10] * 1e6}


def _params(max_tokens: int, kind: str, logprobs: int | None, stop: str | None) -> Any:
    from kvloom.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                          stop=[stop] if stop else None, output_kind=RequestOutputKind[kind.upper()])


def measure_single(engine: Any, max_tokens: int = 4000, window: int = 500, kind: str = "delta",
                   logprobs: int | None = 1, stop: str | None = "<never-seen stop>",
                   prompt: str = "Once upon a time") -> dict[str, Any]:
    """One request alone: microseconds per decode step over its first and its last ``window`` steps."""
    engine.add_request("stream-cost-single", prompt, _params(max_tokens, kind, logprobs, stop))
    model, output = _Timer(), _Timer()
    model.wrap(engine.executor, "execute")
    for name in ("add_prompt_logprobs", "process_tokens", "make_outputs"):
        output.wrap(engine.output_processor, name)
    host_steps: list[float] = []
    output_steps: list[float] = []
    num_outputs = 0
    try:
        while engine.has_unfinished_requests():
            model.reset()
            output.reset()
            start = time.perf_counter()
            num_outputs += len(engine.step())
            host_steps.append(time.perf_counter() - start - model.seconds)
            output_steps.append(output.seconds)
    finally:
        model.unwrap()
        output.unwrap()
    if len(host_steps) - 1 < 2 * window:
        raise ValueError(f"{len(host_steps) - 1} decode steps is fewer than two windows of {window}")
    result: dict[str, Any] = {"num_outputs": num_outputs}
    for name, steps in (("output", output_steps), ("host", host_steps)):
        decode = steps[1:]  # the first step is the prefill
        first, last = _summary_us(decode[:window]), _summary_us(decode[-window:])
        result[name] = {"first": first, "last": last,
                        "ratio_median": last["median_us"] / first["median_us"],
                        "ratio_p10": last["p10_us"] / first["p10_us"]}
    return result


def measure_paired(engine: Any, max_tokens: int = 4000, window: int = 500, kind: str = "delta",
                   logprobs: int | None = 1, stop: str | None = "<never-seen stop>",
                   prompt: str = "Once upon a time") -> dict[str, Any]:
    """A long request's output-processor time per step over its last ``window`` tokens, divided by a
    fresh request's over its first ``window`` tokens, in the same steps."""
    lead_id, long_id, fresh_id = "stream-cost-lead", "stream-cost-long", "stream-cost-fresh"
    # The first request a step processes pays for caches the model's forward left cold; a lead
    # request, processed first in every step, takes that cost from the two compared.
    engine.add_request(lead_id, prompt, _params(max_tokens + 1, kind, logprobs, stop))
    engine.add_request(long_id, prompt, _params(max_tokens, kind, logprobs, stop))
    for _ in range(max_tokens - window):
        engine.step()
    engine.add_request(fresh_id, prompt, _params(window, kind, logprobs, stop))
    timer = _Timer()
    timer.wrap(engine.output_processor, "process_tokens", key=lambda args: args[0].request_id)
    timer.wrap(engine.output_processor, "_make_output", key=lambda args: args[0].request_id)
    late: list[float] = []
    early: list[float] = []
    try:
        while engine.has_unfinished_requests():
            timer.reset()
            engine.step()
            if long_id in timer.by_key and fresh_id in timer.by_key:
                late.append(timer.by_key[long_id])
                early.append(timer.by_key[fresh_id])
    finally:
        timer.unwrap()
    ratios = [a / b for a, b in zip(late, early, strict=True)]
    return {"num_pairs": len(ratios), "early": _summary_us(early), "late": _summary_us(late),
            "ratio": statistics.median(ratios)}
