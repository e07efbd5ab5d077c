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
with a trained EAGLE head at batch 1). A new request starts from the rates the engine's requests have shown
(``new_stats``: about their last 100 speculated steps, weighing three tries; 2/3 each until ~10 first drafts
were tried, and always for a seeded request): an EAGLE head whose first guess holds ~50% was offered to each
new request of a batch of 8 at 2/3 until its own misses taught it (EAGLE at batch 8 on chat: 453 -> 126
speculated request-steps, 0.89x -> 0.91x, median pair 0.88x -> 0.96x).

**Per step: what a draft costs.** Each draft is one more token the target verifies (and, for a draft model,
one more guess). The engine reports every decode step's tokens and seconds; a least-squares line through
the recent ones, ``seconds = fixed + cost_per_token * tokens``, gives the cost of one more token. One more
draft delays every request in the step by ``cost_per_token`` seconds; a step of the ``n`` requests now
running, one token each, makes ``n`` tokens in ``fixed + cost_per_token * n`` seconds, so the delay would
have made ``cost_per_token * n / (fixed + cost_per_token * n)`` tokens: that is ``threshold``, the expected
tokens a draft must add to pay. It is ``n / (n + fixed_tokens)``, with ``fixed_tokens = fixed /
cost_per_token`` the step's fixed cost in tokens' worth. (It was ``cost_per_token`` times the recent steps'
measured tokens per second, which is the batch that ran before: a 64-request burst after a batch-1 warm-up
started with batch 1's threshold, 0.11 instead of ~0.9, and every request drafted 4 through its first
steps.) A step's cost is not one line from 1 token to 100: on this CPU the weights are read once per block
of 8 rows, so up to ~8 tokens a step is memory-bound (~10 ms at batch 1, each further token ~0.1-0.6 ms),
and past that compute-bound (~1 ms a token). So the steps are fitted by the batch's size (line b through
the steps of batches of 2^(b-1) to 2^(b+1) - 1 requests, drafts included in their tokens), and a batch
of n is priced by the line from n; before that line has a slope and ~3 steps, a neighbouring one, before
either the prior. And the first draft in a step costs more than the next ones (at batch 8: 13.6 ms without
drafts, 16.7 with one, ~1 ms for each further: the 9th row's pass over the weights, the verification): the
fit is ``seconds = fixed + cost_per_token * tokens + jump * [the step has drafts]`` (``jump`` 0 while every
step drafts, or none), ``fixed + cost_per_token * n`` is the step without drafts, and a model drafter's
first pass must pay for ``jump`` too (below). (One line through every step priced a batch of 8's drafts at
~0.6 ms: EAGLE at batch 8 ran at 0.75-0.80x the plain engine; 0.87x with this fit.) So

    k_eff = the largest j <= num_speculative_tokens with first * later ** (j - 1) >= threshold

The arithmetic on this 2-core CPU (SmolLM2-135M, bf16): at batch 1 a decode step is ~10 ms and each extra
token ~0.6 ms: fixed_tokens ~16 and threshold ~0.06, so a copying request (rates ~0.9) keeps k = 4 and one
whose drafts hold a third of the time gets 2. At batch 64 the step is compute-bound: ~0.8-0.9 ms per token
and ~10-15 tokens' fixed cost, so the threshold is ~0.85: only drafts that nearly always hold are
proposed; the batch-size cut-off emerges from the measurement (``disable_by_batch_size``, vLLM's key, is
the explicit one).

**A model drafter's passes.** A draft model or EAGLE head guesses in passes after the target's step: the
first over each proposing request's new tokens, then one per further guess over the requests still
guessing. The runner times each (``ModelRunnerOutput.draft_passes``); the controller takes them out of the
step's time and fits them a line of their own, ``seconds = pass_fixed + per_row * rows``. A guess costs its
row besides its verified token, so the per-request threshold is ``threshold * (1 + per_row /
cost_per_token)``. A pass's fixed cost is shared by the requests guessing that deep, so it is weighed per
step (``passes_worth_running``): pass j runs only if its requests' expected tokens at j, each worth a
request's share of a step (``fixed / n + cost_per_token`` seconds), less what their guesses cost, exceed
``pass_fixed``; the deepest passes that do not are cut for everyone. At 64 sequences on this CPU an EAGLE
head's pass costs ~1.2 ms fixed (~1.4 tokens' verification) and a guess that always holds gains ~0.2 ms
over its verified token, so a lone request that guesses well pays for no pass (it ran 4 passes a step, ~10
ms, before this rule), while a third of the batch copying pays for all four. At batch 1 a token is worth
the whole ~10 ms step and nothing is cut.

**Backing off and probing.** A request below k makes no observations of the drafts it does not get, so
every so often it gets one more than worth it: at ``k_eff = 0`` one draft (n-gram lookup is skipped
meanwhile), above it ``k_eff + 1``. The first probe comes ``MIN_PROBE_INTERVAL`` steps after a request falls
below k (or starts there); each probe doubles the wait (to ``MAX_PROBE_INTERVAL``) unless what it saw
raises the request's ``k_eff`` above what it had: then the wait starts again from the shortest. (Resetting
on any probe that held was too eager for a model drafter at a large batch: its guesses hold ~45% of the time
there too, never enough to pay, yet every other probe held and brought the next one four steps closer; each
probe is a head pass, and SmolLM2 with an EAGLE head lost 14-18% at 64 sequences on random prompts.)
Probes go on even when no draft seems to pay, so the cost keeps being measured (with steps of different
sizes). But a probe costs about ``threshold`` tokens (its verified token, for a model drafter a row of a
pass) and a draft that always holds gains at most ``1 - threshold`` over its cost, so the wait passes at
``(1 - threshold) / threshold`` steps a step (``probe_pace``, between ``MIN_PROBE_PACE`` and 1): at batch 1
(threshold ~0.06) at full pace, at 64 sequences (~0.85) about six times slower. (At full pace each of 64
requests probed ~5 times in 128 steps, the requests that started together in waves: an EAGLE head's probes
cost 3-5% there, measured.) A model drafter runs only for requests that guess, so a request that has not
guessed for a while has a draft KV that trails by its tokens since (``DraftStats.lag``, counted by the
scheduler), and its probe first runs the drafter over them: ``catch_up_tokens`` prices that pass in output
tokens' worth, and the wait passes ``threshold / (threshold + catch_up)`` times slower again. (At 64
sequences on this CPU 200 tokens of an EAGLE head's catch-up cost ~6 tokens' worth; with probes priced
without it, nearly every request probed within its first ~100 tokens and the head still ran over ~all of
them.) A lagging request whose drafts would pay does not draft either unless what they gain over
``CATCH_UP_HORIZON`` steps repays its catch-up: as a batch of 64 filled up, or emptied as its requests
finished, the threshold fell below the new requests' prior 2/3 and up to 55 of them drafted at once, each
after a pass over its whole prompt (a 125 ms step where 67 ms was usual). And a probe from ``k_eff`` = 0
brings a draft into a step that may have none: it pays the step line's ``jump`` and, for a model drafter,
a pass's fixed cost too (``first_draft_tokens``, ~2 tokens' worth at batch 8 on this CPU), so its wait
passes slower by that as well (EAGLE at batch 8 on chat questions: 0.82x -> 0.89x, drafts half as often).
Until the passes are timed a row costs ``PRIOR_ROW_COST`` verified tokens (else the 64 requests that
started together probed together, at step ~36, after a 9,200-row pass). A step's time enters the cost fit
within 1.5x of what the line predicts: the machine's other work delays steps at random, and one delayed step with drafts
must not make drafts look ruinous.

Before the engine has timed decode steps of different sizes (at start-up, through the prompts' prefill),
``fixed_tokens`` is ``PRIOR_FIXED_TOKENS`` (5): the threshold is 0.17 at batch 1, 0.62 at 8 and 0.93 at 64,
what this CPU measures past ~8 tokens a step and cautious below (a batch-1 line is measured within a few
steps). (It was 16, batch 1's measure: a batch of 8 then started at 0.33, every request drafting two, and
its first steps cost up to 3x a plain one.)

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
# Before a measurement: a step costs as much as this many tokens besides one token per request (this CPU past
# ~8 tokens a step: 2-13 ms fixed against ~1 ms a token; its batch-1 step is ~16 tokens' worth, measured
# within a few steps).
PRIOR_FIXED_TOKENS = 5
MIN_THRESHOLD = 0.02  # noise can make a draft look free; none is (a lookup, a longer step)
MIN_PROBE_INTERVAL = 4
MAX_PROBE_INTERVAL = 128
MIN_PROBE_PACE = 0.125  # the wait to a probe passes at least this fast (steps per step)
STEP_DECAY = 0.97  # the weight of older steps in the cost fit (about the last 30 steps)
MIN_TOKEN_VARIANCE = 0.05  # the fit's tokens must vary at least this much to give a slope
# A jump is fitted only where steps with and without drafts are both this common (p(1-p): a tenth of either)
# and their sizes tell it from the slope (the squared correlation of size and flag at most MAX_FLAG_CORRELATION).
# At 64 sequences with drafts in 2 of ~30 recent steps, a jump fitted through them priced a token at 0.2 ms
# and a step's fixed cost at 51 ms (1.3 ms and ~0 measured), and the threshold fell to 0.23 for a step.
MIN_FLAG_VARIANCE = 0.09
MAX_FLAG_CORRELATION = 0.75
MIN_STEPS = 3.0  # a step line prices drafts once this many (discounted) steps went into it
# A fitted slope is taken this many standard errors high: steps of nearly one size (64 sequences, a draft or
# two in a few of them) with the machine's noise (+-8 ms on ~65 ms) gave slopes of 0.2 ms a token where
# 1.2 ms was right, and a threshold of 0.3 where ~1 was; a larger slope means a higher threshold.
CAUTION = 1.5
OUTLIER = 1.5  # a step's time enters the fit within [1 / OUTLIER, OUTLIER] times the line's prediction
# Before a model drafter's passes are timed, a row of one costs this many verified tokens (a draft model is
# often a tenth of its target; an EAGLE head on this CPU measured 0.03 ms a row against 0.8 ms a token).
PRIOR_ROW_COST = 0.1
# A new request's rates start from what the engine's requests have shown (about their last 100 speculated
# steps), weighing as much as this many tries (2/3 each until ~10 first drafts were tried).
POPULATION_DECAY = 0.99
PRIOR_TRIES = 3.0
MIN_POPULATION_TRIES = 10.0
CATCH_UP_HORIZON = 16  # steps of drafts that must repay a model drafter's catch-up (a probe's is paced instead)


@dataclass
class DraftStats:
    """One request's record of how its drafts fared (kept on its Request)."""

    # Discounted (holds, tries) of its first drafts and of its later ones; the prior (2/3 each) tries a new
    # request at k = 4 with the prior threshold at batch 1, 1 at batch 8 and none at 64.
    first_held: float = 2.0
    first_tried: float = 3.0
    later_held: float = 2.0
    later_tried: float = 3.0
    steps_to_probe: float = MIN_PROBE_INTERVAL  # below k: steps before the next probe (at pace 1)
    probe_interval: int = MIN_PROBE_INTERVAL
    probed_from: int = -1  # the k_eff a probe was given one more than, until the next choice (-1: none)
    # A model drafter's: the tokens its KV trails the target's by (since the request last drafted; the
    # scheduler's count, an upper bound), which its next guess must first run over.
    lag: int = 0
    disabled: bool = False  # its draft KV cannot be completed (model_runner.py): no more drafts

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


class Line:
    """A least-squares fit ``seconds = fixed + slope * size + jump * flag`` through recent timings, older ones
    weighing ``STEP_DECAY`` times less at each new one. ``flag`` (0 or 1) marks a step with drafts: on this
    CPU the first draft in a step costs more than the next ones (module docstring), so ``fixed + slope * n``
    is a step without drafts and ``jump`` what having any adds; while the flag does not vary (every step
    drafts, or none) ``jump`` is 0 and ``fixed`` takes it in. A timing enters within ``OUTLIER`` times what
    the fit predicts: the machine's other work delays steps at random, and one delayed step must not make
    drafts look ruinous."""

    def __init__(self) -> None:
        # Discounted sums: weight, sizes, flags, seconds, sizes^2, sizes*flags, flags^2 (= flags),
        # sizes*seconds, flags*seconds, seconds^2.
        self._w = self._x = self._f = self._y = self._xx = self._xf = self._xy = self._fy = self._yy = 0.0
        # Seconds per unit of size, once sizes varied: the fitted slope plus CAUTION standard errors.
        self.slope: float | None = None
        self.jump = 0.0  # seconds a flagged timing adds

    @property
    def weight(self) -> float:
        """How many timings went in (discounted)."""
        return self._w

    @property
    def fixed(self) -> float:
        """Seconds at size 0, unflagged (0 before any timing)."""
        if not self._w:
            return 0.0
        return (self._y - (self.slope or 0.0) * self._x - self.jump * self._f) / self._w

    def add(self, size: float, seconds: float, flag: int = 0) -> None:
        if self.slope is not None:
            predicted = self.fixed + self.slope * size + self.jump * flag
            if predicted > 0:
                seconds = min(max(seconds, predicted / OUTLIER), predicted * OUTLIER)
        d = STEP_DECAY
        self._w = d * self._w + 1.0
        self._x = d * self._x + size
        self._f = d * self._f + flag
        self._y = d * self._y + seconds
        self._xx = d * self._xx + size * size
        self._xf = d * self._xf + size * flag
        self._xy = d * self._xy + size * seconds
        self._fy = d * self._fy + flag * seconds
        self._yy = d * self._yy + seconds * seconds
        w = self._w
        mean_x, mean_f, mean_y = self._x / w, self._f / w, self._y / w
        sxx = self._xx / w - mean_x * mean_x
        sff = mean_f - mean_f * mean_f  # flags are 0 or 1
        sxf = self._xf / w - mean_x * mean_f
        sxy = self._xy / w - mean_x * mean_y
        sfy = self._fy / w - mean_f * mean_y
        syy = self._yy / w - mean_y * mean_y
        if sxx < MIN_TOKEN_VARIANCE:
            return  # keep the last fit: every timing had the same size
        det = sxx * sff - sxf * sxf
        if sff >= MIN_FLAG_VARIANCE and det >= (1 - MAX_FLAG_CORRELATION) * sxx * sff:
            slope = (sff * sxy - sxf * sfy) / det
            jump = (sxx * sfy - sxf * sxy) / det
            if slope >= 0 and jump >= 0:
                # The slope's variance: residual variance / (effective timings - 3) * sff / det.
                variance = _residual(syy, slope * sxy + jump * sfy) * sff / det / max(w - 3, 1.0)
                self.slope, self.jump = slope + CAUTION * variance ** 0.5, jump
                return
        slope = max(sxy / sxx, 0.0)
        variance = _residual(syy, slope * sxy) / sxx / max(w - 2, 1.0)
        self.slope, self.jump = slope + CAUTION * variance ** 0.5, 0.0


@dataclass
class Prices:
    """What speculation costs at one batch size, in output tokens' worth (SpeculationController._prices_at)."""

    guess_threshold: float  # the expected tokens a model drafter's guess must add: its verified token and row
    row_tokens: float  # a row of a drafter's pass (what one lagging token's catch-up costs)
    first_draft_tokens: float  # a step's first draft besides its verified token: the jump, a pass's fixed cost


class SpeculationController:
    """Chooses ``k_eff`` per request and step (module docstring); no torch, owned by the scheduler."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None = None,
                 decay: float = DECAY) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.decay = decay  # of each request's acceptance counts (DraftStats.observe)
        self.adaptive = True  # False: always k (what tests of a proposer's drafts and benchmarks compare with)
        # The target's decode steps, seconds against tokens (drafts included), one fit per range of batch sizes
        # (batch_bucket): a step's cost is not one line from 1 token to 100 (module docstring), and only the
        # slope just above the running batch's tokens says what its drafts cost.
        self.steps: dict[int, Line] = {}
        self.passes = Line()  # a draft model's / EAGLE head's passes: seconds against rows
        self.population = DraftStats()  # every request's drafts, for a new request's prior (new_stats)
        # Prices per batch size, asked for every request of a step: kept until the next timing (_prices_at).
        self._prices: dict[int, Prices] = {}

    # ---- acceptance -----------------------------------------------------------------------------
    def observe(self, stats: DraftStats, num_drafts: int, num_accepted: int) -> None:
        """A request's step verified ``num_drafts`` drafts and accepted ``num_accepted``: its own rates, and the
        engine's."""
        stats.observe(num_drafts, num_accepted, self.decay)
        self.population.observe(num_drafts, num_accepted, POPULATION_DECAY)

    def new_stats(self, seeded: bool = False) -> DraftStats:
        """A new request's rates: the engine's requests' so far, weighing ``PRIOR_TRIES`` tries (a seeded
        request starts at 2/3, so that its drafts, and so its tokens, do not depend on other requests)."""
        population = self.population
        if seeded or population.first_tried < MIN_POPULATION_TRIES:
            return DraftStats()
        return DraftStats(first_held=PRIOR_TRIES * population.first_rate, first_tried=PRIOR_TRIES,
                          later_held=PRIOR_TRIES * population.later_rate, later_tried=PRIOR_TRIES)

    # ---- cost -----------------------------------------------------------------------------------
    def record_step(self, num_tokens: int, seconds: float, passes: list[tuple[int, float]] = (),
                    num_drafts: int = 0) -> None:
        """A decode step (no prompt tokens) computed ``num_tokens`` tokens (``num_drafts`` of them drafts) in
        ``seconds``, of which the draft's ``passes`` (rows, seconds each) took their share."""
        for rows, pass_seconds in passes:
            self.passes.add(rows, pass_seconds)
            seconds -= pass_seconds
        bucket = batch_bucket(num_tokens - num_drafts)  # a decode step: one known token per request
        for line in (bucket - 1, bucket):  # line b holds the steps of buckets b and b + 1
            self.steps.setdefault(line, Line()).add(num_tokens, seconds, 1 if num_drafts else 0)
        self._prices.clear()

    def step_line(self, num_running: int = 1) -> Line | None:
        """The fitted step line for a batch of ``num_running`` (one token each, and their drafts): the line
        through steps of batches of ``num_running`` to ~4x as many, else a neighbouring one; None before
        either has a slope and ``MIN_STEPS`` steps (the prior then: a slope through two steps is mostly
        noise)."""
        bucket = batch_bucket(num_running)
        for b in (bucket, bucket - 1, bucket + 1):
            line = self.steps.get(b)
            if line is not None and line.slope is not None and line.weight >= MIN_STEPS:
                return line
        return None

    def cost_per_token(self, num_running: int = 1) -> float | None:
        """Seconds one more token adds to a target step at a batch of ``num_running``, once measured."""
        line = self.step_line(num_running)
        return None if line is None else line.slope

    def fixed_tokens(self, num_running: int = 1) -> float:
        """A decode step's fixed cost in tokens' worth at a batch of ``num_running`` (``PRIOR_FIXED_TOKENS``
        before a measurement; 0 where the line has none, as at a compute-bound batch)."""
        line = self.step_line(num_running)
        if line is None:
            return PRIOR_FIXED_TOKENS
        if not line.slope:
            return float("inf")  # tokens are free
        return max(line.fixed / line.slope, 0.0)

    def threshold(self, num_running: int = 1) -> float:
        """Expected tokens a draft must add to pay for the token the target verifies, while ``num_running``
        requests run: ``num_running / (num_running + fixed_tokens)`` (module docstring)."""
        return max(num_running / (num_running + self.fixed_tokens(num_running)), MIN_THRESHOLD)

    def catch_up_tokens(self, lag: int, num_running: int) -> float:
        """What a model drafter's pass over ``lag`` tokens its KV trails by costs, in output tokens' worth at a
        batch of ``num_running`` (``Prices.row_tokens`` a token)."""
        return lag * self._prices_at(num_running).row_tokens if lag else 0.0

    def first_draft_tokens(self, num_running: int) -> float:
        """What a step's first draft costs besides its verified token, in output tokens' worth at a batch of
        ``num_running`` (``Prices.first_draft_tokens``)."""
        return self._prices_at(num_running).first_draft_tokens

    def _guess_threshold(self, num_running: int) -> float:
        """The threshold for a model drafter's draft, which also costs a row in one of its passes (for n-gram
        lookup, no passes: ``threshold``)."""
        return self._prices_at(num_running).guess_threshold

    def _prices_at(self, num_running: int) -> Prices:
        """The prices at a batch of ``num_running``, computed once per batch size between timings."""
        prices = self._prices.get(num_running)
        if prices is not None:
            return prices
        line = self.step_line(num_running)
        threshold = self.threshold(num_running)
        cost = None if line is None else line.slope
        # A row of a pass in verified tokens: measured, or PRIOR_ROW_COST; a verified token is worth threshold.
        row_cost = self.passes.slope / cost if self.passes.slope and cost else PRIOR_ROW_COST
        first_draft = 0.0
        if cost:
            seconds = line.jump + (max(self.passes.fixed, 0.0) if self.passes.weight else 0.0)
            first_draft = seconds / _token_seconds(line, num_running)
        guess = threshold * (1 + row_cost) if self.passes.slope and cost else threshold
        prices = self._prices[num_running] = Prices(guess, row_cost * threshold, first_draft)
        return prices

    # ---- choice ---------------------------------------------------------------------------------
    def num_drafts(self, stats: DraftStats, num_running: int, seeded: bool = False) -> int:
        """``k_eff`` for one request this step; call once per request and step (it counts the wait to a
        probe)."""
        if stats.disabled or (self.disable_by_batch_size is not None
                              and num_running >= self.disable_by_batch_size):
            return 0
        if not self.adaptive:
            return self.k
        threshold = PRIOR_THRESHOLD if seeded else self._guess_threshold(num_running)
        k = drafts_worth_proposing(stats, threshold, self.k)
        if k and stats.lag and not seeded:
            # Drafting again first runs the drafter over the tokens it lags by: worth it only if the drafts'
            # gain over the next steps repays it.
            gain = sum(stats.expected_tokens(j) - threshold for j in range(1, k + 1))
            if gain * CATCH_UP_HORIZON < self.catch_up_tokens(stats.lag, num_running):
                k = 0
        if stats.probed_from >= 0:
            if k > stats.probed_from:  # the probe showed more drafts pay: probe again soon if it falls back
                stats.probe_interval = MIN_PROBE_INTERVAL
            stats.probed_from = -1
        if k == self.k:
            stats.steps_to_probe = MIN_PROBE_INTERVAL  # the wait starts when it falls below k
            return k
        # Probes go on even where no draft seems to pay: they are rare, and they keep measuring (a threshold
        # that noise pushed up would otherwise stop speculation for good). The wait passes slower where even a
        # draft that always holds would gain little over its cost (module docstring).
        if stats.steps_to_probe > 1e-9:  # (a pace of 0.2 / 0.8 sums to a hair above 0)
            extra = self.catch_up_tokens(stats.lag, num_running) + (self.first_draft_tokens(num_running) if k == 0
                                                                     else 0.0)
            stats.steps_to_probe -= probe_pace(threshold, extra)
            return k
        stats.steps_to_probe = stats.probe_interval
        stats.probe_interval = min(2 * stats.probe_interval, MAX_PROBE_INTERVAL)
        stats.probed_from = k
        return k + 1

    def passes_worth_running(self, choices: list[tuple[DraftStats, int, bool]], num_running: int) -> int:
        """How many passes a model drafter runs this step, given each drafting request's (stats, ``k_eff``,
        seeded): the deepest pass whose guesses are worth more than the pass's fixed cost (module
        docstring). Probes and seeded requests keep their ``k_eff`` (a probe measures; a seeded request's
        tokens must not depend on its batch): the passes they need run whatever the rest is worth."""
        deepest = max((k for _, k, _ in choices), default=0)
        line = self.step_line(num_running)
        if not self.adaptive or not self.passes.weight or line is None or not line.slope:
            return deepest
        floor = max((k for stats, k, seeded in choices if seeded or stats.probed_from >= 0), default=0)
        cost = line.slope
        # An output token is worth a request's share of a step (seconds); a guess costs the token the target
        # verifies and a row of the pass.
        worth = _token_seconds(line, num_running)
        per_guess = cost + (self.passes.slope or 0.0)
        pass_cost = max(self.passes.fixed, 0.0)
        depth = deepest
        while depth > floor:
            gain = sum(stats.expected_tokens(depth) * worth - per_guess
                       for stats, k, _ in choices if k >= depth)
            # The first pass also brings drafts into a step that had none: the step's jump.
            if gain >= pass_cost + (line.jump if depth == 1 else 0.0):
                break
            depth -= 1
        return depth


def _token_seconds(line: Line, num_running: int) -> float:
    """What an output token is worth in seconds at a batch of ``num_running``: a request's share of a step
    without drafts (``line`` has a slope)."""
    return max(line.fixed, 0.0) / num_running + line.slope


def _residual(total: float, explained: float) -> float:
    """The variance a fit leaves, 0 where it is the rounding of the difference (an exact line)."""
    residual = total - explained
    return residual if residual > 1e-9 * total else 0.0


def batch_bucket(num_requests: int) -> int:
    """The step fits' bucket of a batch size: 1, 2-3, 4-7, ..., 64-127, ... (the bit length)."""
    return max(num_requests, 1).bit_length()


def probe_pace(threshold: float, catch_up: float = 0.0) -> float:
    """Steps of the wait to a probe that one step counts for: a draft that always holds gains ``1 -
    threshold`` tokens over its cost, a probe costs about ``threshold``; the wait passes at their ratio, at
    most one step a step and at least ``MIN_PROBE_PACE``. A model drafter's probe first runs over the tokens
    its KV trails by (``catch_up`` tokens' worth): that many times slower again."""
    return min(max((1 - threshold) / threshold, MIN_PROBE_PACE), 1.0) * threshold / (threshold + catch_up)


def drafts_worth_proposing(stats: DraftStats, threshold: float, max_drafts: int) -> int:
    """The largest j <= max_drafts whose draft adds at least ``threshold`` expected tokens (0 if none)."""
    k = 0
    while k < max_drafts and stats.expected_tokens(k + 1) >= threshold:
        k += 1
    return k
