"""Rejection sampling for speculative decoding: keep draft tokens while the target allows them, so that
the tokens that come out are distributed exactly as the target alone would sample them.

For each request with k draft tokens x_1..x_k, a draft distribution q_i (one-hot on x_i for proposers
without probabilities, such as n-gram lookup) and the target's distributions p_1..p_{k+1} (after the
same temperature / top-k / top-p processing the plain sampler applies):

    for i in 1..k:  accept x_i with probability min(1, p_i(x_i) / q_i(x_i))
                    on the first rejection, emit a token from norm(max(0, p_i - q_i)) and stop
    all accepted:   emit a bonus token from p_{k+1}

Greedy rows accept while x_i equals argmax p_i and emit the target's argmax at the first mismatch (or
as the bonus). The whole batch is tensors: drafts are padded to the longest, rows carry their length.
Rows with a seed draw their uniforms and their resampling from their own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RejectionOutput:
    output_token_ids: torch.Tensor  # [B, K + 1] int64: the emitted tokens, -1 past each row's count
    num_emitted: torch.Tensor  # [B] int64: accepted drafts + 1 (the correction or bonus token)


def _exponential(shape: tuple[int, ...], device: torch.device, generators: dict[int, torch.Generator],
                 generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise [B, ...]; row r from generators[r] when it has one."""
    noise = torch.empty(shape, device=device)
    noise.exponential_(generator=generator)
    for row, row_generator in generators.items():
        noise[row].exponential_(generator=row_generator)
    return noise


def _uniform(shape: tuple[int, int], device: torch.device, generators: dict[int, torch.Generator],
             generator: torch.Generator | None, width: int) -> torch.Tensor:
    """U(0, 1) [B, K]; a row with its own generator draws ``width`` (>= K) values whatever K is, so how far
    its generator advances does not depend on the other rows' drafts."""
    values = torch.rand(shape, device=device, generator=generator)
    for row, row_generator in generators.items():
        values[row] = torch.rand(width, device=device, generator=row_generator)[:shape[1]]
    return values


def rejection_sample(draft_token_ids: torch.Tensor, num_drafts: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None, greedy: torch.Tensor,
                     generators: dict[int, torch.Generator] | None = None,
                     generator: torch.Generator | None = None, max_drafts: int | None = None) -> RejectionOutput:
    """draft_token_ids: [B, K] int64 (padding anything); num_drafts: [B] int64 in 0..K;
    target_probs: [B, K + 1, V] fp32 (row i: the target's distribution for draft i, then the bonus);
    draft_probs: [B, K, V] or None (one-hot drafts); greedy: [B] bool; max_drafts: the most drafts any
    request can have (the configured k; default K), so seeded rows draw the same amount every step.
    (Every row greedy: ``greedy_rejection_sample`` on the argmaxes does the same without the vocabulary.)"""
    generators = generators or {}
    batch, max_k = draft_token_ids.shape
    device = target_probs.device
    positions = torch.arange(max_k, device=device)[None, :]
    valid = positions < num_drafts[:, None]  # [B, K]
    drafts = torch.where(valid, draft_token_ids, torch.zeros_like(draft_token_ids))

    # Acceptance, position by position; a row stops at its first rejection.
    target_of_draft = target_probs[:, :max_k].gather(2, drafts[:, :, None]).squeeze(2)  # [B, K]
    if draft_probs is None:
        ratio = target_of_draft  # q_i(x_i) = 1
    else:
        draft_of_draft = draft_probs.gather(2, drafts[:, :, None]).squeeze(2)
        ratio = target_of_draft / draft_of_draft.clamp_min(1e-30)
    width = max(max_k, max_drafts or 0)
    accepted_random = _uniform((batch, max_k), device, generators, generator, width) < ratio
    accepted_greedy = drafts == target_probs[:, :max_k].argmax(dim=-1)
    accepted = torch.where(greedy[:, None], accepted_greedy, accepted_random) & valid
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]

    # The token after the accepted run: from the residual at a rejection, from p_{k+1} as a bonus.
    stop_probs = target_probs.gather(1, num_accepted[:, None, None].expand(-1, 1, target_probs.shape[2])).squeeze(1)
    rejected = num_accepted < num_drafts
    # q at the stop position (only used where a draft was rejected there, so never past the drafts).
    if max_k == 0:
        draft_at_stop = torch.zeros_like(stop_probs)
    else:
        at = num_accepted.clamp_max(max_k - 1)
        if draft_probs is None:
            draft_at_stop = torch.nn.functional.one_hot(drafts.gather(1, at[:, None]).squeeze(1),
                                                        target_probs.shape[2]).to(stop_probs.dtype)
        else:
            draft_at_stop = draft_probs.gather(1, at[:, None, None].expand(-1, 1, draft_probs.shape[2])).squeeze(1)
    residual = (stop_probs - draft_at_stop).clamp_min(0.0)
    residual_mass = residual.sum(dim=1, keepdim=True)
    # A residual of (numerically) zero mass happens only when p == q there; then p itself is exact.
    residual = torch.where(residual_mass > 0, residual / residual_mass.clamp_min(1e-30), stop_probs)
    stop_dist = torch.where(rejected[:, None], residual, stop_probs)
    noise = _exponential(tuple(stop_dist.shape), device, generators, generator)
    sampled = stop_dist.div(noise).argmax(dim=1)
    next_token = torch.where(greedy, stop_probs.argmax(dim=1), sampled)

    out = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=device)
    keep = positions < num_accepted[:, None]
    out[:, :max_k] = torch.where(keep, drafts, out[:, :max_k])
    out.scatter_(1, num_accepted[:, None], next_token[:, None])
    return RejectionOutput(output_token_ids=out, num_emitted=num_accepted + 1)


def greedy_rejection_sample(draft_token_ids: torch.Tensor, num_drafts: torch.Tensor, target_argmax: torch.Tensor
                            ) -> RejectionOutput:
    """Every row greedy: keep the drafts that equal the target's argmax, then its argmax after them.
    draft_token_ids: [B, K]; num_drafts: [B]; target_argmax: [B, K + 1] (nothing over the vocabulary is drawn
    or normalized)."""
    batch, max_k = draft_token_ids.shape
    positions = torch.arange(max_k, device=draft_token_ids.device)[None, :]
    valid = positions < num_drafts[:, None]
    drafts = torch.where(valid, draft_token_ids, torch.zeros_like(draft_token_ids))
    num_accepted = ((drafts == target_argmax[:, :max_k]) & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    out = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=drafts.device)
    out[:, :max_k] = torch.where(positions < num_accepted[:, None], drafts, out[:, :max_k])
    out.scatter_(1, num_accepted[:, None], target_argmax.gather(1, num_accepted[:, None]))
    return RejectionOutput(output_token_ids=out, num_emitted=num_accepted + 1)
