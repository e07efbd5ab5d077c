"""The batched sampler against brute-force, one-row-at-a-time references."""

from __future__ import annotations

import math

import torch

from kvloom.sample.sampler import NONFINITE_TOKEN_ID, Sampler, SamplingMetadata, apply_top_k_top_p

VOCAB = 50


def metadata(batch: int, temperature: float = 1.0, **kwargs) -> SamplingMetadata:
    fields = dict(temperature=torch.full((batch,), temperature), all_greedy=temperature == 0,
                  all_random=temperature > 0, top_k=None, top_p=None, min_p=None)
    fields.update(kwargs)
    return SamplingMetadata(**fields)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, VOCAB)
    out = Sampler()(logits, metadata(6, temperature=0.0))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    md = metadata(4, temperature=1.0, all_random=False)
    md.temperature = torch.tensor([0.0, 1.0, 0.0, 1.0])
    out = Sampler()(logits, md)
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert out.sampled_token_ids[2] == logits[2].argmax()


def brute_top_k_top_p(row: torch.Tensor, k: int, p: float) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: -row[i].item())[:k]
    probs = torch.softmax(row[order], dim=-1)
    kept, mass = [], 0.0
    for token, prob in zip(order, probs.tolist()):
        if mass >= p:
            break
        kept.append(token)
        mass += prob
    return set(kept)


def test_top_k_top_p_keep_exactly_the_brute_force_set() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, VOCAB)
    top_k = torch.tensor([VOCAB, 3, 10, 1, 20])
    top_p = torch.tensor([0.5, 1.0, 0.9, 1.0, 0.3])
    filtered = apply_top_k_top_p(logits, top_k, top_p)
    for row in range(5):
        kept = set(torch.nonzero(filtered[row] > float("-inf")).flatten().tolist())
        assert kept == brute_top_k_top_p(logits[row], int(top_k[row]), float(top_p[row]))
        # Kept logits are unchanged.
        assert torch.equal(filtered[row][list(kept)], logits[row][list(kept)])


def test_sampling_follows_the_distribution() -> None:
    torch.manual_seed(2)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    out = Sampler(torch.Generator().manual_seed(0))(logits, metadata(20000, temperature=1.0))
    freq = torch.bincount(out.sampled_token_ids, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015)


def test_seeded_row_samples_the_same_whatever_the_batch() -> None:
    torch.manual_seed(3)
    row = torch.randn(1, VOCAB)

    def sample(batch_logits: torch.Tensor, seeded_row: int) -> int:
        md = metadata(batch_logits.shape[0], temperature=1.0)
        md.generators = {seeded_row: torch.Generator().manual_seed(1234)}
        return int(Sampler()(batch_logits, md).sampled_token_ids[seeded_row])

    alone = sample(row, 0)
    crowded = sample(torch.cat([torch.randn(3, VOCAB), row, torch.randn(5, VOCAB)]), 3)
    assert alone == crowded


def test_penalties_match_the_definition() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5]])
    md = metadata(1, temperature=0.0,
                  presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
                  repetition_penalty=torch.tensor([2.0]),
                  output_token_ids=torch.tensor([[2, 2, 1, 5]]),  # 5 is padding (vocab size)
                  prompt_token_ids=torch.tensor([[3, 5]]))
    got = Sampler.apply_penalties(logits, md)
    # token 1: seen, negative -> *2, once in output -> -0.25 - 0.5
    # token 2: seen, positive -> /2, twice -> -0.5 - 0.5
    # token 3: prompt only, positive -> /2
    expected = torch.tensor([[1.0, -2.0 - 0.75, 1.0 - 1.0, 0.25, -0.5]])
    torch.testing.assert_close(got, expected)


def test_min_tokens_masks_stop_tokens() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0
    md = metadata(2, temperature=0.0)
    md.min_tokens_masks = [(0, [7])]
    out = Sampler()(logits, md)
    assert out.sampled_token_ids[0] != 7 and out.sampled_token_ids[1] == 7


def test_logprobs_are_raw_and_rank_the_sampled_token() -> None:
    logits = torch.randn(3, VOCAB)
    md = metadata(3, temperature=0.0)
    md.max_num_logprobs = 2
    out = Sampler()(logits, md)
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs.shape == (3, 3)
    torch.testing.assert_close(out.logprobs[:, 0], expected.max(-1).values)
    assert out.sampled_ranks.tolist() == [1, 1, 1]
    assert math.isclose(out.logprobs[0, 1].item(), expected[0].max().item(), rel_tol=1e-6)


def test_rows_with_nan_or_inf_logits_sample_the_nonfinite_marker() -> None:
    """Greedy fast path, the fp32 path with logprobs, and random rows: only the bad rows are marked."""
    torch.manual_seed(3)
    logits = torch.randn(5, VOCAB)
    logits[1, 7] = float("nan")
    logits[3, 0] = float("inf")
    logits[4, 2] = float("-inf")
    bad = torch.tensor([False, True, False, True, True])
    for md in (metadata(5, temperature=0.0), metadata(5, temperature=0.0, max_num_logprobs=2),
               metadata(5, temperature=0.8)):
        out = Sampler(torch.Generator().manual_seed(0))(logits, md)
        assert torch.equal(out.sampled_token_ids == NONFINITE_TOKEN_ID, bad)
        if md.all_greedy:
            assert torch.equal(out.sampled_token_ids[~bad], logits[~bad].argmax(-1))
    bf16 = Sampler()(logits.bfloat16(), metadata(5, temperature=0.0)).sampled_token_ids
    assert torch.equal(bf16 == NONFINITE_TOKEN_ID, bad)
    # fp16 logits whose sum overflows fp16 (50 x 2000 > 65504) are still finite.
    big = torch.full((1, VOCAB), 2000.0, dtype=torch.float16)
    assert Sampler()(big, metadata(1, temperature=0.0)).sampled_token_ids.item() != NONFINITE_TOKEN_ID
