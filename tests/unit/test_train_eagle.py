"""The EAGLE-1 training script (tools/train_eagle.py, outside the serving package) on a tiny random Llama: the layout it
saves, the features it trains on, and that training lowers the loss."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from kvloom.loader.weights import resolve_model


def _load_script() -> types.ModuleType:
    """tools/train_eagle.py, a script rather than a module of the package."""
    path = Path(__file__).resolve().parents[2] / "tools" / "train_eagle.py"
    spec = importlib.util.spec_from_file_location("train_eagle", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_eagle"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


train_eagle = _load_script()


def _expected_layout(config: dict) -> dict[str, tuple[int, ...]]:
    """The docstring's table: vLLM's llama_eagle.py layout."""
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (q, h),
        "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h),
        "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (i, h),
        "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
    }


def test_target_features_equal_transformers_final_hidden_states(tiny_llama_dir: str) -> None:
    """Features are the hidden states after the final norm (what the LM head reads), one sequence or many."""
    from transformers import AutoModelForCausalLM

    target = train_eagle.Target(resolve_model(tiny_llama_dir), dtype=torch.float32)
    oracle = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 400, (n,), generator=generator) for n in (37, 5, 60)]
    with torch.no_grad():
        for ids, features in zip(sequences, target.forward(sequences)):
            expected = oracle.model(input_ids=ids[None]).last_hidden_state[0]
            torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-4)


def test_features_recorded_while_generating_equal_a_prefill_of_the_reply(tiny_llama_dir: str) -> None:
    """The recorder (the model runner's hidden-state sink) keeps every computed position's final hidden state:
    through chunked prefill and decode steps they equal one prefill of prompt + reply, but for the final
    token, which the engine never runs (a zero row, never read by training)."""
    from kvloom import LLM, SamplingParams

    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 400, (n,), generator=generator).tolist() for n in (9, 45)]
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False,
              max_num_batched_tokens=32)  # the 45-token prompt is prefilled in two chunks
    recorder = train_eagle.FeatureRecorder()
    llm.llm_engine.executor.driver.hidden_state_sink = recorder
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    target = train_eagle.Target(resolve_model(tiny_llama_dir), dtype=torch.float32)
    for prompt, output in zip(prompts, outputs):
        ids = prompt + list(output.outputs[0].token_ids)
        recorded = recorder.features(output.request_id, len(ids))
        assert recorded is not None and recorded.dtype == torch.bfloat16
        expected = target.forward([torch.tensor(ids)])[0].to(torch.bfloat16)
        torch.testing.assert_close(recorded[:-1], expected[:-1], rtol=1e-2, atol=1e-2)
        assert not recorded[-1].any()
        assert recorder.features(output.request_id, len(ids)) is None  # forgotten once read
    assert not recorder.rows


def test_head_with_cache_equals_head_on_whole_sequence(tiny_llama_dir: str) -> None:
    """The evaluation's step-by-step drafting (KV cache) computes what one causal pass does."""
    config = train_eagle.load_model_config(resolve_model(tiny_llama_dir))
    torch.manual_seed(0)
    head = train_eagle.EagleHead(config)
    embeds, features = torch.randn(1, 9, config.hidden_size), torch.randn(1, 9, config.hidden_size)
    with torch.no_grad():
        whole = head(embeds, features, torch.arange(9))
        cache = [torch.zeros(1, config.num_key_value_heads, 0, config.head_dim) for _ in range(2)]
        first = head(embeds[:, :5], features[:, :5], torch.arange(5), cache)
        rest = [head(embeds[:, t:t + 1], features[:, t:t + 1], torch.tensor([t]), cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), whole, rtol=1e-5, atol=1e-5)


def test_evaluated_head_keeps_float32_rotary_frequencies(tiny_llama_dir: str, tmp_path) -> None:
    """A head loaded in bfloat16 for the evaluation rotates as the runtime does (a float32 table): its
    rotary frequencies are not rounded with the weights."""
    from kvloom.layers.rotary import rope_inverse_frequencies

    target = train_eagle.Target(resolve_model(tiny_llama_dir), dtype=torch.float32)
    train_eagle.save_head(train_eagle.EagleHead(target.config), target, tmp_path)
    head = train_eagle.load_head(tmp_path, target.config, dtype=torch.bfloat16)
    config = target.config
    expected = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).float()
    assert head.rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(head.rotary.inv_freq, expected, rtol=0, atol=0)


@pytest.mark.parametrize("draft_vocab", [None, 3])  # the tiny model replies with ~4 distinct tokens
def test_runtime_drafts_equal_the_trainers_simulation(tiny_llama_dir: str, tmp_path, draft_vocab) -> None:
    """The trainer/runtime convention check (issue 10): a head made by the trainer's code, briefly trained,
    saved and loaded by the engine's EAGLE proposer, drafts after every prefix exactly what the trainer's
    simulation drafts. Pins everything the two must agree on: the feature (the target's final hidden state
    after its norm), the pairing (f_t with x_{t+1} at position t guesses x_{t+2}), fc's [embedding | feature]
    order, layer 0 without an input norm, no final norm, the rotary table, the chain's positions, and the
    first pass over the kept tokens after accepted and rejected drafts; with a draft vocabulary, its saved
    LM head rows and d2t."""
    import math

    from kvloom import LLM, SamplingParams

    target = train_eagle.Target(resolve_model(tiny_llama_dir), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 400, (n,), generator=generator).tolist() for n in (9, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def replies(llm: LLM) -> list[train_eagle.TrainingSequence]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [train_eagle.TrainingSequence(torch.tensor(p + list(o.outputs[0].token_ids)), len(p))
                for p, o in zip(prompts, outputs)]

    # The head learns these very replies for a moment (8 epochs: about half its drafts hold, so the
    # engine's steps after accepted drafts and after rejected ones are both compared).
    sequences = replies(LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256))
    target.features(sequences, max_batch_tokens=4096)
    torch.manual_seed(0)
    head = train_eagle.EagleHead(target.config)
    if draft_vocab is not None:
        head.vocab = train_eagle.draft_vocabulary(sequences, draft_vocab, target.config.vocab_size)
        assert len(head.vocab) == draft_vocab
        assert 0.5 < train_eagle.vocabulary_coverage(sequences, head.vocab) < 1.0
    train_eagle.train_head(head, target, sequences, math.inf, lr=3e-3, max_batch_tokens=1024, max_epochs=8,
                           noise=0.0, seed=0, log_every_s=math.inf)
    train_eagle.save_head(head, target, tmp_path)
    simulation = train_eagle.simulate_speculation(train_eagle.load_head(tmp_path, target.config, torch.float32),
                                                  target, sequences, k=3)

    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=256, speculative_config={
        "method": "eagle", "model": str(tmp_path), "num_speculative_tokens": 3})
    llm.llm_engine.executor.driver.speculator.policy.adaptive = False  # k = 3 at every step, as simulated
    runner = llm.llm_engine.executor.driver
    proposed: dict[tuple[int, ...], list[int]] = {}  # the tokens known when drafting -> the drafts
    propose = runner.proposer.propose

    def recording(requests, hidden, build_inputs):
        drafts = propose(requests, hidden, build_inputs)
        for request_id, guesses in drafts.items():
            state = runner.requests[request_id]
            proposed[tuple(state.prompt_token_ids + state.output_token_ids)] = guesses
        return drafts

    runner.proposer.propose = recording
    assert [s.token_ids.tolist() for s in replies(llm)] == [s.token_ids.tolist() for s in sequences]

    compared = 0
    for sequence, steps in zip(sequences, simulation.drafts):
        for known, drafts in steps:
            prefix = tuple(sequence.token_ids[:known].tolist())
            if prefix in proposed:  # the engine drafts nothing once no output token is left to speculate
                assert proposed[prefix][:len(drafts)] == drafts, f"after {known} tokens"
                compared += 1
    # The same steps too (the engine accepted what the simulation did), but for each request's last, where
    # the engine drafts no further than its output limit.
    assert compared >= sum(len(steps) for steps in simulation.drafts) - len(sequences)
    assert 0 < simulation.num_accepted_tokens < simulation.num_draft_tokens


def test_training_saves_vllm_eagle_layout_and_lowers_loss(tiny_llama_dir: str, tmp_path) -> None:
    out = tmp_path / "head"
    result = train_eagle.main(["--model", tiny_llama_dir, "--out", str(out), "--minutes", "0.25",
                               "--num-prompts", "12", "--eval-prompts", "3", "--max-tokens", "24",
                               "--batch-tokens", "1024", "--threads", "1", "--lr", "3e-3"])
    with open(os.path.join(tiny_llama_dir, "config.json"), encoding="utf-8") as f:
        target_config = json.load(f)
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == _expected_layout(target_config)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    with open(out / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 1
    assert config["hidden_size"] == target_config["hidden_size"]
    assert config["vocab_size"] == target_config["vocab_size"]

    losses = result["losses"]
    assert len(losses) >= 10, f"too few training steps in the budget: {result['timings']}"
    window = len(losses) // 5
    assert sum(losses[-window:]) / window < sum(losses[:window]) / window
    assert 1.0 <= result["mean_acceptance_length"] <= 1 + 4


def test_draft_vocabulary_is_the_most_frequent_reply_tokens_and_saves_as_eagle3_spells_it(
        tiny_llama_dir: str, tmp_path) -> None:
    target = train_eagle.Target(resolve_model(tiny_llama_dir), dtype=torch.float32)
    vocab_size = target.config.vocab_size
    # Prompt tokens do not count; 7 most often, then 5 and 9 tied (the lower id first), then 3.
    sequences = [train_eagle.TrainingSequence(torch.tensor([11, 11, 11, 7, 7, 9, 5, 3]), 3),
                 train_eagle.TrainingSequence(torch.tensor([12, 7, 9, 5, 7]), 1)]
    assert train_eagle.draft_vocabulary(sequences, 2, vocab_size).tolist() == [5, 7]
    assert train_eagle.draft_vocabulary(sequences, 3, vocab_size).tolist() == [5, 7, 9]
    assert train_eagle.draft_vocabulary(sequences, vocab_size, vocab_size) is None
    assert train_eagle.vocabulary_coverage(sequences, torch.tensor([5, 7])) == pytest.approx(6 / 9)

    head = train_eagle.EagleHead(target.config)
    head.vocab = torch.tensor([3, 5, 7, 9, 40])
    assert head.to_draft_ids(torch.tensor([7, 8, 40])).tolist() == [2, -100, 4]
    train_eagle.save_head(head, target, tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["d2t"].tolist() == [3, 4, 5, 6, 36]  # draft id d is target id d + d2t[d]
    assert torch.equal(tensors["lm_head.weight"], target.lm_head_weight[head.vocab].to(torch.bfloat16))
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        assert json.load(f)["draft_vocab_size"] == 5
    assert train_eagle.load_head(tmp_path, target.config).vocab.tolist() == [3, 5, 7, 9, 40]


@pytest.mark.parametrize("native_bf16", [False, True])
def test_training_autocasts_to_bf16_only_where_the_cpu_multiplies_bf16(tiny_llama_dir: str, monkeypatch,
                                                                       native_bf16: bool) -> None:
    """On a CPU without native bf16 products (AVX2) torch emulates them ~15x slower than float32, so the
    trainer must not autocast there; where oneDNN has them it does."""
    import math

    target = train_eagle.Target(resolve_model(tiny_llama_dir), dtype=torch.float32)
    sequences = [train_eagle.TrainingSequence(torch.arange(3, 40), 8)]
    target.features(sequences, max_batch_tokens=4096)
    head = train_eagle.EagleHead(target.config)
    seen: list[bool] = []
    losses = train_eagle.head_losses

    def spy(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return losses(*args, **kwargs)

    capability = types.SimpleNamespace(onednn_bf16=native_bf16)
    monkeypatch.setattr(train_eagle, "cpu_capability", lambda: capability)
    monkeypatch.setattr(train_eagle, "head_losses", spy)
    train_eagle.train_head(head, target, sequences, math.inf, lr=1e-3, max_batch_tokens=1024, max_epochs=1,
                           noise=0.0, seed=0, log_every_s=math.inf)
    assert seen == [native_bf16]
