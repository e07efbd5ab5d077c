"""Adaptive speculation: how many drafts each request gets this step (``k_eff``, 0 .. num_speculative_tokens).

One mechanism for every method. The scheduler asks it before n-gram lookup, and before the runner's draft
model / EAGLE head guesses (the scheduler sends each request's ``k_eff`` with the step, so a request at 0
costs no draft pass and the passes are the batch's largest ``k_eff``).

**Per request: what its drafts are worth.** Draft ``j`` is emitted only if drafts 1 .. j all hold. Two
rates per request model that chance: ``first``, that its first draft holds, and ``later``, that a later draft
holds given the one before it did (copying is all-or-nothing: both high; a loop that lookup half-predicts:
``first`` high, ``later`` lower). So draft j adds ``first * later ** (j - 1)`` expected tokens. Each rate is
a ratio of discounted counts (each observation scales the old ones by ``DECAY``: about the last five steps
with drafts count), starting from two holds in three tries (2/3). A step with ``k`` drafts that accepts
``m`` tried the first draft once and later drafts ``min(m, k - 1)`` times. A draft model's or EAGLE head's
rates keep about the last twenty steps (``MODEL_DECAY``): n-gram lookup's chances jump where a copied span
starts or ends, a model's drift with the text's kind, and with five steps' memory a request whose guesses
hold 45% of the time fell to no drafts after a few misses in a row (a quarter of its steps, measured: SmolLM2
with a trained EAGLE head at batch 1).

**Per step: what a draft costs.** Each draft is one more token the target verifies (and, for a draft model,
one more guess). The engine reports every decode step's tokens and seconds; a least-squares line through
the recent ones, ``seconds = fixed + cost_per_token * tokens``, gives the cost of one more token, and the
same steps give the tokens per second the engine is making, ``throughput``. One more draft delays every
request in the step by ``cost_per_token`` seconds, which would have made ``cost_per_token * throughput``
tokens: that is ``threshold``, the expected tokens a draft must add to pay. So

    k_eff = the largest j <= num_speculative_tokens with first * later ** (j - 1) >= threshold

The arithmetic on this 2-core CPU (SmolLM2-135M, bf16): at batch 1 a decode step is ~10 ms and each extra
token ~0.6 ms, at ~100 tok/s: threshold ~0.06, so a copying request (rates ~0.9) keeps k = 4 and one whose
drafts hold a third of the time gets 2. At batch 64 the step is compute-bound: ~1 ms per token at ~850
tok/s gives a threshold of ~0.8, so only drafts that nearly always hold are proposed; the batch-size
cut-off emerges from the measurement (``disable_by_batch_size``, vLLM's key, is the explicit one).

**Backing off and probing.** A request below k makes no observations of the drafts it does not get, so
every so often it gets one more than worth it: at ``k_eff = 0`` one draft (n-gram lookup is skipped
meanwhile), above it ``k_eff + 1``. The first probe comes ``MIN_PROBE_INTERVAL`` steps after a request falls
below k (or starts there); each probe doubles the wait (to ``MAX_PROBE_INTERVAL``) unless what it saw
raises the request's ``k_eff`` above what it had: then the wait starts again from the shortest. (Resetting
on any probe that held was too eager for a model drafter at a large batch: its guesses hold ~45% of the time
there too, never enough to pay, yet every other probe held and brought the next one four steps closer; each
probe is a head pass, and SmolLM2 with an EAGLE head lost 14-18% at 64 sequences on random prompts.)
Probes go on even when no draft seems to pay, so the cost keeps being measured (with steps of different
sizes). A step's time enters the cost fit within 1.5x of
what the line predicts: the machine's other work delays steps at random, and one delayed step with drafts
must not make drafts look ruinous.

Before the engine has timed decode steps of different sizes (at start-up, through the prompts' prefill), the
threshold is that of a step costing ``PRIOR_FIXED_TOKENS`` tokens' worth plus one per request:
``num_running / (num_running + 16)``, 0.06 at batch 1 and 0.8 at 64.

**Seeded requests.** Which drafts a sampled request is offered changes its tokens (not their distribution),
and the measured threshold depends on timing and on the batch; so a request with a seed uses the fixed
``PRIOR_THRESHOLD`` (0.1) and its own history only, and stays reproducible whatever shares its batch
(greedy tokens never depend on drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.8  # the weight of the older observations at each new one (n-gram lookup)
MODEL_DECAY = 0.95  # the same for a draft model or EAGLE head, whose chances change slowly
PRIOR_THRESHOLD = 0.1  # for seeded requests
# Before a measurement: a step costs as much as this many tokens besides one token per request (this CPU's
# batch-1 decode step is ~16 tokens' worth: 10 ms against ~0.6 ms per extra token).
PRIOR_FIXED_TOKENS = 16
MIN_THRESHOLD = 0.02  # noise can make a draft look free; none is (a lookup, a longer step)
MIN_PROBE_INTERVAL = 4
MAX_PROBE_INTERVAL = 128
STEP_DECAY = 0.97  # the weight of older steps in the cost fit (about the last 30 steps)
MIN_TOKEN_VARIANCE = 0.05  # the fit's tokens must vary at least this much to give a slope
OUTLIER = 1.5  # a step's time enters the fit within [1 / OUTLIER, OUTLIER] times the line's prediction


@dataclass
class DraftStats:
    """One request's record of how its drafts fared (kept on its Request)."""

    # Discounted (holds, tries) of its first drafts and of its later ones; the prior (2/3 each) tries a new
    # request at k = 3..4 with the prior threshold at batch 1, and at none at large batches.
    first_held: float = 2.0
    first_tried: float = 3.0
    later_held: float = 2.0
    later_tried: float = 3.0
    steps_to_probe: int = MIN_PROBE_INTERVAL  # below k: steps before the next probe
    probe_interval: int = MIN_PROBE_INTERVAL
    probed_from: int = -1  # the k_eff a probe was given one more than, until the next choice (-1: none)

    @property
    def first_rate(self) -> float:
        return self.first_held / self.first_tried

    @property
    def later_rate(self) -> float:
        return self.later_held / self.later_tried

    def expected_tokens(self, j: int) -> float:
        """The chance that drafts 1 .. j all hold: what draft j adds."""
        return self.first_rate * self.later_rate ** (j - 1)

    def observe(self, num_drafts: int, num_accepted: int, decay: float = DECAY) -> None:
        """A step verified ``num_drafts`` drafts and accepted the first ``num_accepted``; older observations
        weigh ``decay`` times less."""
        if num_drafts <= 0:
            return
        self.first_held = decay * self.first_held + (1 if num_accepted else 0)
        self.first_tried = decay * self.first_tried + 1
        later = min(num_accepted, num_drafts - 1)  # drafts 2.. tried: those after a held one
        self.later_held = decay * self.later_held + max(num_accepted - 1, 0)
        self.later_tried = decay * self.later_tried + later


class SpeculationController:
    """Chooses ``k_eff`` per request and step (module docstring); no torch, owned by the scheduler."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None = None,
                 decay: float = DECAY) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.decay = decay  # of each request's acceptance counts (DraftStats.observe)
        self.adaptive = True  # False: always k (what tests of a proposer's drafts and benchmarks compare with)
        # Discounted sums over decode steps: weight, tokens, seconds, tokens^2, tokens*seconds, outputs.
        self._w = self._x = self._y = self._xx = self._xy = self._out = 0.0
        self.cost_per_token: float | None = None  # seconds, once measured
        self.throughput: float | None = None  # output tokens per second of the recent decode steps

    # ---- cost -----------------------------------------------------------------------------------
    def record_step(self, num_tokens: int, num_output_tokens: int, seconds: float) -> None:
        """A decode step (no prompt tokens) computed ``num_tokens`` tokens (drafts included) and emitted
        ``num_output_tokens`` in ``seconds``."""
        if self.cost_per_token is not None:
            # A step the machine's other work held up (or a lucky one) moves the line by a bounded amount: the
            # fit takes it as at most OUTLIER times (at least 1 / OUTLIER of) what the line predicts.
            predicted = (self._y - self.cost_per_token * self._x) / self._w + self.cost_per_token * num_tokens
            if predicted > 0:
                seconds = min(max(seconds, predicted / OUTLIER), predicted * OUTLIER)
        d = STEP_DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + num_tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_tokens * num_tokens
        self._xy = d * self._xy + num_tokens * seconds
        self._out = d * self._out + num_output_tokens
        mean_x = self._x / self._w
        variance = self._xx / self._w - mean_x * mean_x
        if variance >= MIN_TOKEN_VARIANCE:  # else keep the last slope: all steps had the same size
            slope = (self._xy / self._w - mean_x * self._y / self._w) / variance
            self.cost_per_token = max(slope, 0.0)
        if self._y > 0:
            self.throughput = self._out / self._y

    def threshold(self, num_running: int = 1) -> float:
        """Expected tokens a draft must add to pay for itself (module docstring). Until decode steps of more
        than one size were timed: a step of ``PRIOR_FIXED_TOKENS``' worth of fixed cost plus one token's per
        request, i.e. ``num_running / (num_running + PRIOR_FIXED_TOKENS)``."""
        if self.cost_per_token is None or self.throughput is None:
            return max(num_running / (num_running + PRIOR_FIXED_TOKENS), MIN_THRESHOLD)
        return max(self.cost_per_token * self.throughput, MIN_THRESHOLD)

    # ---- choice ---------------------------------------------------------------------------------
    def num_drafts(self, stats: DraftStats, num_running: int, seeded: bool = False) -> int:
        """``k_eff`` for one request this step; call once per request and step (it counts the wait to a
        probe)."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return 0
        if not self.adaptive:
            return self.k
        threshold = PRIOR_THRESHOLD if seeded else self.threshold(num_running)
        k = drafts_worth_proposing(stats, threshold, self.k)
        if stats.probed_from >= 0:
            if k > stats.probed_from:  # the probe showed more drafts pay: probe again soon if it falls back
                stats.probe_interval = MIN_PROBE_INTERVAL
            stats.probed_from = -1
        if k == self.k:
            stats.steps_to_probe = MIN_PROBE_INTERVAL  # the wait starts when it falls below k
            return k
        # Probes go on even where no draft seems to pay: they are rare, and they keep measuring (a threshold
        # that noise pushed up would otherwise stop speculation for good).
        if stats.steps_to_probe > 0:
            stats.steps_to_probe -= 1
            return k
        stats.steps_to_probe = stats.probe_interval
        stats.probe_interval = min(2 * stats.probe_interval, MAX_PROBE_INTERVAL)
        stats.probed_from = k
        return k + 1


def drafts_worth_proposing(stats: DraftStats, threshold: float, max_drafts: int) -> int:
    """The largest j <= max_drafts whose draft adds at least ``threshold`` expected tokens (0 if none)."""
    k = 0
    while k < max_drafts and stats.expected_tokens(k + 1) >= threshold:
        k += 1
    return k
