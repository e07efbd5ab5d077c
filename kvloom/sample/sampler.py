"""Batched sampling on the device.

The steps, in order, for logits [B, V] (fp32), after the grammar masks of constrained rows (structured
outputs) are applied in place:
  1. logprobs (if asked) from the raw logits, as vLLM returns them;
  2. min_tokens: EOS and stop tokens masked until a request has produced enough tokens; then the logits
     processors of vLLM's fields, each one batched op over every row that has it: allowed_token_ids
     (the rest masked), bad_words (banned tokens masked), logit_bias (added);
  3. penalties: repetition (prompt + output tokens), then frequency and presence (output tokens);
  4. greedy rows take the argmax here;
  5. temperature, then top-k, top-p and min-p filtering;
  6. a sample by the exponential race: argmax(p / q), q ~ Exp(1). Rows with a seed draw q from
     their own generator, so a seeded request samples the same whatever shares its batch.
A row whose raw logits hold a NaN or an infinity samples NONFINITE_TOKEN_ID instead: its request
must end with an error, not emit garbage. No host sync happens before the token ids exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvloom.structured_output.bitmask import TokenBitmask, apply_token_bitmask_


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # [B] fp32, 0 for greedy rows; None when every row is plain greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where off; None when no row filters
    top_p: torch.Tensor | None  # [B] fp32, 1.0 where off
    min_p: torch.Tensor | None  # [B] fp32, 0.0 where off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    # Penalties (None when no row has any):
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_token_ids: torch.Tensor | None = None  # [B, max_out] int64, padded with vocab_size
    prompt_token_ids: torch.Tensor | None = None  # [B, max_prompt] int64, padded with vocab_size
    # min_tokens: (row, token ids to mask) pairs
    min_tokens_masks: list[tuple[int, list[int]]] = field(default_factory=list)
    max_num_logprobs: int | None = None  # most top logprobs any row asked for; None: none asked
    # Structured outputs: the rows' grammar masks, applied to the logits in place before anything else reads
    # them (so logprobs, greedy and random rows all see only the allowed tokens).
    token_bitmask: TokenBitmask | None = None
    # Logits processors (None when no row has one). allowed_token_ids: the rows that have them [R] and the
    # (index into those rows, token id) pairs they allow [A]; bad_words: the (row, token id) pairs banned this
    # step [W]; logit_bias: (row, token id, bias) triples [N].
    allowed_rows: torch.Tensor | None = None
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def has_logits_processors(self) -> bool:
        return self.allowed is not None or self.banned is not None or self.logit_bias is not None


# What a row whose logits are not all finite samples (read back with the tokens: no extra sync).
NONFINITE_TOKEN_ID = -1


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64; NONFINITE_TOKEN_ID where the row's logits had a NaN/inf
    # When logprobs were asked: top ids/logprobs [B, K+1] (the sampled token first) and its rank [B]
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def compute_logprobs_top(logprobs: torch.Tensor, token_ids: torch.Tensor, num: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs: [N, V]; token_ids: [N]. Returns ids [N, num+1], values [N, num+1] and ranks [N].

    Column 0 is the given token; columns 1.. are the top-num tokens in order.
    """
    token_logprobs = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > token_logprobs).sum(-1) + 1
    if num > 0:
        top_values, top_ids = logprobs.topk(num, dim=-1)
        ids = torch.cat([token_ids[:, None], top_ids], dim=1)
        values = torch.cat([token_logprobs, top_values], dim=1)
    else:
        ids, values = token_ids[:, None], token_logprobs
    return ids, values, ranks


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _mark_nonfinite(sampled: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """sampled: [B] token ids; finite: [B] bool. NONFINITE_TOKEN_ID where a row is not finite."""
    return torch.where(finite, sampled, NONFINITE_TOKEN_ID)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.generator = generator  # draws for rows without a seed of their own
        # A platform argmax over low-precision logits (bf16 -> fp32 is exact, so it picks what
        # torch.argmax of the upcast logits picks), used when nothing else needs fp32.
        self.argmax = argmax if argmax is not None else _argmax

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] in any float dtype."""
        # One reduction over the raw logits: a row's sum is finite only when all its logits are. torch
        # accumulates in fp32; bf16 and fp32 have the range to hold the sum of any sane row (~1e33 per
        # logit to overflow), fp16 does not, so its sum is taken in fp32.
        finite = logits.sum(dim=-1, dtype=torch.float32 if logits.dtype == torch.float16 else None).isfinite()
        if metadata.token_bitmask is not None:  # after the finite check: the masked logits are -inf on purpose
            apply_token_bitmask_(logits, metadata.token_bitmask)
        if (metadata.all_greedy and metadata.max_num_logprobs is None and not metadata.min_tokens_masks
                and metadata.repetition_penalty is None and not metadata.has_logits_processors):
            return SamplerOutput(sampled_token_ids=_mark_nonfinite(self.argmax(logits), finite))
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.apply_min_tokens(logits, metadata)
        logits = apply_logits_processors(logits, metadata)
        logits = self.apply_penalties(logits, metadata)
        greedy = logits.argmax(dim=-1)
        if metadata.all_greedy:
            sampled = greedy
        else:
            random = self.sample_random(logits, metadata, self.generator)
            sampled = random if metadata.all_random else torch.where(
                metadata.temperature == 0, greedy, random)
        out = SamplerOutput(sampled_token_ids=_mark_nonfinite(sampled, finite))
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = compute_logprobs_top(
                raw_logprobs, sampled, metadata.max_num_logprobs)
        return out

    @staticmethod
    def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if not metadata.min_tokens_masks:
            return logits
        logits = logits.clone()
        for row, token_ids in metadata.min_tokens_masks:
            logits[row, token_ids] = float("-inf")
        return logits

    @staticmethod
    def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.repetition_penalty is None:
            return logits
        batch, vocab = logits.shape
        # Count tensors get one spare column for the padding id (vocab), dropped afterwards.
        output_counts = torch.zeros(batch, vocab + 1, device=logits.device, dtype=logits.dtype)
        output_counts.scatter_add_(1, metadata.output_token_ids,
                                   torch.ones_like(metadata.output_token_ids, dtype=logits.dtype))
        output_counts = output_counts[:, :vocab]
        seen = torch.zeros(batch, vocab + 1, device=logits.device, dtype=torch.bool)
        seen.scatter_(1, metadata.prompt_token_ids, True)
        seen = seen[:, :vocab] | (output_counts > 0)
        repetition = metadata.repetition_penalty[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
        logits = logits - metadata.frequency_penalty[:, None] * output_counts
        logits = logits - metadata.presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def probabilities(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row samples from: temperature, then top-k / top-p, softmax, min-p
        (min-p leaves the rest unnormalized: the samplers only compare ratios). logits: [B, V] fp32."""
        temperature = torch.where(metadata.temperature == 0, torch.ones_like(metadata.temperature),
                                  metadata.temperature)
        logits = logits / temperature[:, None]
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = torch.softmax(logits, dim=-1)
        if metadata.min_p is not None:
            max_prob = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < metadata.min_p[:, None] * max_prob, 0.0)
        return probs

    @staticmethod
    def sample_random(logits: torch.Tensor, metadata: SamplingMetadata,
                      generator: torch.Generator | None = None) -> torch.Tensor:
        probs = Sampler.probabilities(logits, metadata)
        q = torch.empty_like(probs)
        if len(metadata.generators) < probs.shape[0]:
            q.exponential_(generator=generator)
        for row, row_generator in metadata.generators.items():
            q[row].exponential_(generator=row_generator)
        return probs.div(q).argmax(dim=-1)


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, bad_words and logit_bias over the whole batch: one masked fill or indexed write per
    field, whatever the number of rows (no loop over requests). logits: [B, V] fp32, changed in place (the
    sampler owns them: the runner's fresh logits, or their fp32 copy) and returned."""
    if not metadata.has_logits_processors:
        return logits
    if metadata.allowed is not None:
        rows = metadata.allowed_rows
        local_rows, token_ids = metadata.allowed
        blocked = torch.ones(rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
        blocked[local_rows, token_ids] = False
        logits.index_put_((rows,), logits.index_select(0, rows).masked_fill_(blocked, float("-inf")))
    if metadata.banned is not None:
        rows, token_ids = metadata.banned
        logits.index_put_((rows, token_ids), logits.new_full(rows.shape, float("-inf")))
    if metadata.logit_bias is not None:
        rows, token_ids, bias = metadata.logit_bias
        logits.index_put_((rows, token_ids), bias, accumulate=True)
    return logits


def apply_logits_processors_reference(logits: torch.Tensor, allowed: list[list[int] | None],
                                      banned: list[list[int]], bias: list[dict[int, float]]) -> torch.Tensor:
    """The plain per-row definition ``apply_logits_processors`` is tested against. logits: [B, V]."""
    out = logits.clone()
    for row in range(out.shape[0]):
        if allowed[row] is not None:
            keep = out[row, allowed[row]].clone()
            out[row] = float("-inf")
            out[row, allowed[row]] = keep
        for token_id in banned[row]:
            out[row, token_id] = float("-inf")
        for token_id, value in bias[row].items():
            out[row, token_id] += value
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
                      ) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's top-k and its top-p nucleus. logits: [B, V]."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token when the mass strictly before it is below top_p: the first always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)
