"""One answer whatever the load: a greedy request's tokens do not depend on how many other requests share its
steps, nor on how its prompt is split into prefill chunks, for the default model's default (4-bit), bf16 and int8
loads. `make test` runs the default load's test again at every ISA level below the CPU's own (KVLOOM_CPU_ISA)."""

from __future__ import annotations

import os

import pytest

from kvloom import LLM, SamplingParams
from kvloom.cpu_capability import cpu_capability

# Below the CPU's own level (`make test`'s loop over KVLOOM_CPU_ISA, the default load only) the kernels are the
# slower portable ones: fewer tokens there.
CAPPED = bool(os.environ.get("KVLOOM_CPU_ISA")) and cpu_capability().level != cpu_capability().detected
MAX_TOKENS = 8 if CAPPED else 20
TEXTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "Once upon a time, in a land",
    "List three prime numbers:", "The quick brown fox", "Explain why the sky is blue in one sentence.",
    "import numpy as np\n", "My favourite food is", "Translate 'good morning' into Spanish:",
    "The year 1969 is remembered for", "Q: What is 12 times 12?\nA:", "Dear Sir or Madam,",
    "In machine learning, a transformer is", "The recipe calls for two cups of", "Roses are red, violets are",
]
LOADS = {
    "default": {},  # the GGUF's 4-bit weights kept 4-bit
    "bf16": {"quantization": "none"},
    "int8": {"quantization": "int8"},
    # the same with bf16 activations (the table product, on AMX-BF16; KVLOOM_Q4_ACTIVATIONS=bf16 does the same)
    "default-bf16-activations": {"override_backend_config": {"q4_activations": "bf16"}},
}


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("load", sorted(LOADS))
def test_sixteen_requests_together_equal_each_alone(smollm2_gguf_path: str, load: str) -> None:
    # No prefix cache, so each request computes its whole prompt itself in both runs; a 48-token step budget so that
    # together the prompts are split across steps beside other requests' decodes (chunked prefill).
    llm = LLM(model=smollm2_gguf_path, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=48,
              enable_prefix_caching=False, **LOADS[load])
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in TEXTS]
    together = greedy(llm, prompts)
    alone = [greedy(llm, [prompt])[0] for prompt in prompts]
    differing = [i for i in range(len(prompts)) if together[i] != alone[i]]
    assert not differing, (f"{load}: {len(differing)} of {len(prompts)} requests answer differently in a batch of 16 "
                           f"than alone: {[(TEXTS[i], together[i], alone[i]) for i in differing[:2]]}")


def test_a_prompt_split_into_chunks_answers_as_in_one_step(smollm2_gguf_path: str) -> None:
    # The same prompts prefilled in one step each, then in chunks of 8 tokens (with the prefix cache on, a second
    # request's cached blocks split its prefill again).
    whole = LLM(model=smollm2_gguf_path, max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    prompts = [whole.get_tokenizer().encode(text * 3) for text in TEXTS[:4]]
    expected = [greedy(whole, [prompt])[0] for prompt in prompts]
    del whole
    chunked = LLM(model=smollm2_gguf_path, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=8,
                  enable_chunked_prefill=True)
    assert greedy(chunked, prompts) == expected
    assert greedy(chunked, prompts) == expected  # now from the prefix cache's blocks, the rest computed


@pytest.mark.skipif(CAPPED, reason="the default level's run covers the engine; the capped loop checks the products")
@pytest.mark.parametrize("speculation", ["ngram", "draft"])
def test_speculative_decoding_of_the_default_load_equals_plain_greedy(smollm2_gguf_path: str,
                                                                      speculation: str) -> None:
    """A verification step multiplies more rows than a decode step: with every product one formula at every row
    count, n-gram and draft-model speculation on the default (4-bit) load give plain greedy decoding's tokens, four
    prompts decoded together (on an AMX Xeon each changed 1 of 4 while the layer stack took batch-dependent tiles)."""
    texts = [TEXTS[i] for i in (0, 2, 7, 13)]
    plain = LLM(model=smollm2_gguf_path, max_model_len=256, enable_prefix_caching=False)
    tokenizer = plain.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in texts]
    spec = ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}
            if speculation == "ngram" else
            {"speculative_model": smollm2_gguf_path, "num_speculative_tokens": 3})
    speculative = LLM(model=smollm2_gguf_path, max_model_len=256, enable_prefix_caching=False, **spec)
    assert greedy(speculative, prompts) == greedy(plain, prompts)
    stats = speculative.llm_engine.scheduler.stats()
    assert stats.num_draft_tokens > 0, stats


def test_bf16_q4_activations_take_the_table_product_where_the_cpu_has_it(smollm2_gguf_path: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """override_backend_config q4_activations "bf16": the default model's Q4_1 projections take the table product (the
    op's bf16 tiles, one formula at every row count) on a CPU with AMX-BF16, and stay on llama.cpp's product
    elsewhere; by default they keep it everywhere. A value outside int8 / bf16 is refused by name."""
    from kvloom.ops import cpu
    from kvloom.ops.q4 import PackedQ4Weight

    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    monkeypatch.delenv("KVLOOM_Q4_ACTIVATIONS", raising=False)

    def tiles(**kwargs: object) -> set[bool]:
        llm = LLM(model=smollm2_gguf_path, max_model_len=128, **kwargs)
        model = llm.llm_engine.executor.driver.model
        return {m.packed.bf16_tiles for m in model.modules() if isinstance(getattr(m, "packed", None), PackedQ4Weight)}

    assert tiles() == {False}
    assert tiles(override_backend_config={"q4_activations": "bf16"}) == {cpu.q4_table_product()}
    with pytest.raises(ValueError, match="q4_activations must be 'int8', 'bf16'"):
        LLM(model=smollm2_gguf_path, max_model_len=128, override_backend_config={"q4_activations": "fp8"})
