"""The default model, SmolLM2-135M-Instruct (GGUF), against HF transformers loading the same file."""

from __future__ import annotations

import os

import pytest
import torch

from kvloom import LLM, SamplingParams

from .test_correctness import kvloom_greedy, mixed_prompts

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf_path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf_path),
                                                 gguf_file=os.path.basename(smollm2_gguf_path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(smollm2_gguf_path: str) -> LLM:
    # quantization="none": the file's 4-bit weights dequantized, as transformers loads them (the default keeps them
    # 4-bit: tests/e2e/test_gguf_4bit.py).
    return LLM(model="SmolLM2-135M-Instruct", dtype="float32", max_model_len=256, max_num_seqs=16,
               quantization="none")


def test_smollm2_logprobs_match_transformers(llm: LLM, hf_model) -> None:
    prompt = llm.get_tokenizer().encode("The capital of France is Paris, and the capital of Italy is")
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position in range(1, len(prompt)):
        for token_id, logprob in out.prompt_logprobs[position].items():
            # fp32 through 30 layers: sums in another order drift by ~1e-4.
            assert abs(logprob.logprob - expected[position - 1, token_id].item()) < 2e-3
    assert out.outputs[0].token_ids[0] == int(expected[-1].argmax())


def test_smollm2_greedy_batch_equals_transformers_generate(llm: LLM, hf_model) -> None:
    prompts = mixed_prompts(49152, count=16, seed=3)
    prompts = [p[:24] for p in prompts]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    min_new_tokens=MAX_TOKENS, pad_token_id=0, eos_token_id=None)
            expected.append(out[0, len(prompt):].tolist())
    assert kvloom_greedy(llm, prompts, MAX_TOKENS) == expected


def test_smollm2_chat_answers(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_smollm2_as_its_own_draft_model_gives_the_same_tokens(llm: LLM) -> None:
    """Draft-model speculation on the real model (the target drafting for itself: no smaller SmolLM2 ships
    offline): the greedy tokens of the plain engine, and (fp32, the same weights) the guesses accepted."""
    prompts = [p[:24] for p in mixed_prompts(49152, count=4, seed=5)]
    speculative = LLM(model="SmolLM2-135M-Instruct", dtype="float32", max_model_len=256, max_num_seqs=16,
                      quantization="none", speculative_model="SmolLM2-135M-Instruct", num_speculative_tokens=3)
    assert kvloom_greedy(speculative, prompts, MAX_TOKENS) == kvloom_greedy(llm, prompts, MAX_TOKENS)
    stats = speculative.llm_engine.scheduler.stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats
