"""Speculative decoding with a second model (a draft model, EAGLE heads): greedy outputs equal the plain
engine's under every batching mode, a draft that is the target itself has every guess accepted (so its KV
cache stays in step through chunked prefill, prefix-cache hits and preemption), and bad configs are refused."""

from __future__ import annotations

import pytest

from kvloom import LLM, SamplingParams


def varied_prompts(count: int = 10) -> list[list[int]]:
    """Prompts that share a 24-token head in pairs (prefix-cache hits), of many lengths."""
    head = [7 + (j * 11) % 290 for j in range(24)]
    return [(head if i % 2 else [])[:24] + [5 + (i * 13 + j * 7) % 300 for j in range(6 + 3 * i)]
            for i in range(count)]


def greedy_params(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=6 + 4 * (i % 5), ignore_eos=True) for i in range(count)]


def run(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[list[int]]) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def plain_outputs() -> dict[str, list]:
    """The target alone (greedy), per engine setting and prompts; each computed once (by ``plain``)."""
    return {}


def plain(tiny_llama3_dir: str, cache: dict[str, list], engine_args: dict, prompts: list[list[int]]) -> list:
    key = repr((sorted(engine_args.items()), prompts))
    if key not in cache:
        cache[key] = run(LLM(model=tiny_llama3_dir, max_model_len=256, **engine_args),
                         greedy_params(len(prompts)), prompts)
    return cache[key]


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 20},  # chunked prefill, and drafts cut to the budget
    {"kv_cache_memory": 60 * 2048, "block_size": 4},  # preemption (a block holds target and draft KV)
])
def test_greedy_with_a_draft_model_equals_plain_greedy(tiny_llama3_dir: str, tiny_mistral_dir: str,
                                                      plain_outputs: dict, engine_args: dict) -> None:
    """A different model (a Mistral) drafts for the Llama target: few guesses hold, the output is the same."""
    prompts = varied_prompts()
    expected = plain(tiny_llama3_dir, plain_outputs, engine_args, prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_model=tiny_mistral_dir, num_speculative_tokens=3,
              **engine_args)
    assert run(llm, greedy_params(len(prompts)), prompts) == expected
    assert run(llm, greedy_params(len(prompts)), prompts) == expected  # again: prefix-cache hits
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_draft_tokens > 0, stats
    if "kv_cache_memory" in engine_args:
        assert stats.num_preemptions > 0
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 20, "block_size": 4},  # chunked prefill
    {"kv_cache_memory": 60 * 2048, "block_size": 4},  # preemption
])
def test_the_target_as_its_own_draft_has_every_guess_accepted(tiny_llama3_dir: str, plain_outputs: dict,
                                                              engine_args: dict) -> None:
    """The draft's KV cache is the target's, token for token: through chunked prefill, prefix-cache hits
    (the second run) and preemption no guess is ever rejected."""
    prompts = varied_prompts()
    expected = plain(tiny_llama3_dir, plain_outputs, engine_args, prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_config={
        "method": "draft_model", "model": tiny_llama3_dir, "num_speculative_tokens": 4}, **engine_args)
    llm.llm_engine.executor.driver.speculator.policy.adaptive = False  # k = 4 at every step
    for _ in range(2):
        assert run(llm, greedy_params(len(prompts)), prompts) == expected
    stats = llm.llm_engine.scheduler.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens, stats


@pytest.mark.parametrize("engine_args", [{"block_size": 8}, {"max_num_batched_tokens": 20, "block_size": 8}])
def test_requests_given_no_drafts_cost_no_draft_pass_and_catch_up_exactly(tiny_llama3_dir: str, plain_outputs: dict,
                                                                         engine_args: dict) -> None:
    """Requests the policy gives no drafts are left out of the draft's passes, so most steps run
    none; a request that drafts again first catches the draft's KV up over every token since (and at each
    filled block). With the target as its own draft, any gap in that KV would show as a rejected guess."""
    prompts = varied_prompts()
    expected = plain(tiny_llama3_dir, plain_outputs, engine_args, prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_config={
        "method": "draft_model", "model": tiny_llama3_dir, "num_speculative_tokens": 3}, **engine_args)
    engine = llm.llm_engine
    calls = iter(range(1 << 30))
    runner = engine.executor.driver
    # Every 7th choice drafts k (2 or 3 at a time), the rest none: requests lag by varying amounts.
    runner.speculator.policy.num_drafts = lambda acceptance, batch_size, seeded=False: (
        2 + next(calls) % 2 if next(calls) % 7 == 0 else 0)
    drafting, steps = [], []  # the draft's work of each step that had some; the steps
    propose, execute = runner.proposer.propose, engine.executor.execute
    runner.proposer.propose = lambda requests, *args: drafting.append(requests) or propose(requests, *args)
    engine.executor.execute = lambda out: steps.append(out) or execute(out)
    for _ in range(2):  # the second time with prefix-cache hits
        assert run(llm, greedy_params(len(prompts)), prompts) == expected
    stats = engine.scheduler.stats()
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens, stats
    assert stats.prefix_cache_hits > 0
    requests = [r for step in drafting for r in step]
    # A lagging request is in a pass only when a block of it fills (or it drafts again).
    assert len(requests) < 0.6 * sum(len(out.scheduled) for out in steps), (len(requests), len(steps))
    # Catch-up: a request's first pass over several decoded tokens at once.
    assert any(r.max_drafts and r.num_valid > 1 and r.start >= len(prompts[int(r.request_id) % len(prompts)])
               for r in requests)


def test_draft_model_in_mixed_batches(tiny_llama3_dir: str, tiny_mistral_dir: str) -> None:
    """n > 1, logprobs (not speculated), seeded sampling and greedy requests share batches; greedy and logprob
    requests match the plain engine, seeded sampled ones are reproducible whatever shares the batch."""
    prompts = varied_prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)] * 2
    expected = run(LLM(model=tiny_llama3_dir, max_model_len=256), params, prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_config={"model": tiny_mistral_dir,
                                                                          "num_speculative_tokens": 2})
    assert llm.llm_engine.config.speculative.method == "draft_model"  # vLLM's shorthand: a model, no method
    got = run(llm, params, prompts)
    for i in (0, 1, 3, 4):
        assert got[i] == expected[i]
    assert run(llm, params[2], prompts[2:3]) == got[2:3]
    assert llm.llm_engine.scheduler.stats().num_draft_tokens > 0


def test_no_drafts_past_speculative_max_model_len(tiny_llama3_dir: str) -> None:
    prompts = [p for p in varied_prompts() if len(p) > 20][:3]
    expected = run(LLM(model=tiny_llama3_dir, max_model_len=256), greedy_params(3), prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_model=tiny_llama3_dir, num_speculative_tokens=2,
              speculative_max_model_len=20)
    assert run(llm, greedy_params(3), prompts) == expected
    assert llm.llm_engine.scheduler.stats().num_draft_tokens == 0


@pytest.mark.parametrize("spec, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "ngram' only"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "takes no 'model'"),
    ({"model": "x", "num_speculative_tokens": 2, "max_model_len": 0}, "max_model_len"),
    ({"model": "x", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"model": "x", "num_speculative_tokens": 2, "quantization": "fp8"}, "quantization must be 'int8'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "takes no 'quantization'"),
])
def test_bad_draft_model_configs_are_value_errors(spec: dict, message: str) -> None:
    from kvloom.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama3_dir: str, tmp_path) -> None:
    import tiny_models

    draft = tiny_models.build_tiny_checkpoint(str(tmp_path / "draft"), arch="llama", vocab_size=512)
    with pytest.raises(ValueError, match=r"vocabulary of 512 tokens, the target model 4\d\d"):
        LLM(model=tiny_llama3_dir, max_model_len=256, speculative_model=draft, num_speculative_tokens=2)


# ---- EAGLE ------------------------------------------------------------------------------------------
def _rms_norm(x, weight, eps: float):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_eagle_guesses(target, weights: dict, config: dict, method: str, tokens: list[int], k: int
                             ) -> list[int]:
    """The head's k chained guesses after ``tokens`` in plain torch over whole sequences (no paging, no cache):
    the head at position p reads (the target's hidden state at p, token p + 1); HF transformers gives the
    target's hidden states."""
    import torch

    heads, kv_heads, hidden = config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]
    dim, eps, theta = hidden // heads, config["rms_norm_eps"], config["rope_theta"]
    w = {name.removeprefix("model.").replace("midlayer.", "layers.0."): t.float() for name, t in weights.items()}
    embed = w.get("embed_tokens.weight", target.model.embed_tokens.weight)
    lm_head = w.get("lm_head.weight", target.lm_head.weight)

    def rope(x, positions):
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
        freqs = positions[:, None].float() * inv_freq[None]
        cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
        rotated = torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1)
        return x * cos + rotated * sin

    def layer(x, residual):
        n = x.shape[0]
        positions = torch.arange(n)
        q = rope((x @ w["layers.0.self_attn.q_proj.weight"].T).view(n, heads, dim), positions)
        key = rope((x @ w["layers.0.self_attn.k_proj.weight"].T).view(n, kv_heads, dim), positions)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(n, kv_heads, dim)
        key, v = key.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, key) / dim ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
        residual = attn @ w["layers.0.self_attn.o_proj.weight"].T + residual
        x = _rms_norm(residual, w["layers.0.post_attention_layernorm.weight"], eps)
        gate, up = x @ w["layers.0.mlp.gate_proj.weight"].T, x @ w["layers.0.mlp.up_proj.weight"].T
        x = torch.nn.functional.silu(gate) * up
        return x @ w["layers.0.mlp.down_proj.weight"].T, residual

    with torch.no_grad():
        states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        if method == "eagle3":
            aux = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            features = torch.cat([states[i][0] for i in aux], -1) @ w["fc.weight"].T
        else:
            features = states[-1][0]
        hidden_in, ids, guesses = list(features), list(tokens[1:]), []
        for _ in range(k):
            h, e = torch.stack(hidden_in), embed[torch.tensor(ids)]
            if method == "eagle3":
                x = torch.cat([_rms_norm(e, w["layers.0.input_layernorm.weight"], eps),
                               _rms_norm(h, w["layers.0.hidden_norm.weight"], eps)], -1)
                x, residual = layer(x, h)
                out = x + residual
                draft = int((_rms_norm(out, w["norm.weight"], eps)[-1] @ lm_head.T).argmax())
                guess = draft + int(w["d2t"][draft])
            else:
                x = torch.cat([e, h], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
                x, residual = layer(x, x)
                out = x + residual
                guess = int((out[-1] @ lm_head.T).argmax())
            guesses.append(guess)
            hidden_in.append(out[-1])
            ids.append(guess)
    return guesses


EAGLE_HEADS = {
    "eagle": {"method": "eagle"},  # the target's embedding and LM head
    "eagle-own-embedding": {"method": "eagle", "own_embedding": True, "fc_bias": True},
    "eagle3": {"method": "eagle3", "draft_vocab_size": 160},  # its own LM head over a draft vocabulary
}


@pytest.fixture(scope="module")
def eagle_heads(tiny_llama3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import tiny_models

    root = tmp_path_factory.mktemp("eagle_heads")
    return {name: tiny_models.build_tiny_eagle(str(root / name), tiny_llama3_dir, **spec)
            for name, spec in EAGLE_HEADS.items()}


@pytest.fixture(scope="module")
def hf_target(tiny_llama3_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama3_dir, dtype="float32").eval()


TIGHT = {"max_num_batched_tokens": 20, "kv_cache_memory": 70 * 1536, "block_size": 4}  # chunks, preemption


@pytest.mark.parametrize("head, engine_args", [
    ("eagle", {}), ("eagle", TIGHT), ("eagle3", {}), ("eagle3", TIGHT), ("eagle-own-embedding", {})])
def test_eagle_guesses_equal_a_plain_torch_head_and_greedy_output_is_unchanged(
        tiny_llama3_dir: str, eagle_heads: dict, plain_outputs: dict, hf_target, head: str, engine_args: dict
) -> None:
    """Every chain of guesses the paged head proposes (its KV cache kept in the target's blocks through
    chunked prefill, prefix-cache hits and preemption) is what the head computes over the whole sequence;
    the random head's guesses are rarely right, and the greedy output stays the target's."""
    import json

    from safetensors.torch import load_file

    method = EAGLE_HEADS[head]["method"]
    prompts = varied_prompts(6)
    expected = plain(tiny_llama3_dir, plain_outputs, engine_args, prompts)
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_config={
        "method": method, "model": eagle_heads[head], "num_speculative_tokens": 3}, **engine_args)
    runner = llm.llm_engine.executor.driver
    records = []
    propose = runner.proposer.propose

    def recording(requests, hidden, build_inputs):
        drafts = propose(requests, hidden, build_inputs)
        for request_id, guesses in drafts.items():
            state = runner.requests[request_id]
            records.append((state.prompt_token_ids + state.output_token_ids, guesses))
        return drafts

    runner.proposer.propose = recording
    # Every third choice drafts 3, the rest none: requests lag and catch up by varying amounts.
    calls = iter(range(1 << 30))
    runner.speculator.policy.num_drafts = lambda acceptance, batch_size, seeded=False: (
        3 if next(calls) % 3 == 0 else 0)
    for _ in range(2):  # the second time with prefix-cache hits
        assert run(llm, greedy_params(len(prompts)), prompts) == expected
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_draft_tokens > 0 and stats.prefix_cache_hits > 0
    if "kv_cache_memory" in engine_args:
        assert stats.num_preemptions > 0
    with open(f"{eagle_heads[head]}/config.json") as f:
        config = json.load(f)
    weights = load_file(f"{eagle_heads[head]}/model.safetensors")
    # A request's first pass after steps without drafts catches the head's KV up over the tokens since its
    # last one, and must guess as the whole sequence does.
    assert len(records) >= 16
    for tokens, guesses in records[len(records) // 2 - 4:len(records) // 2 + 4]:  # prefix hits among them
        assert guesses == _reference_eagle_guesses(hf_target, weights, config, method, tokens, 3)[:len(guesses)]


@pytest.mark.parametrize("head", ["draft_model", "eagle", "eagle3"])
def test_an_int8_draft_or_head_keeps_greedy_output_and_guesses_alike(tiny_llama3_dir: str, eagle_heads: dict,
                                                                    plain_outputs: dict, head: str) -> None:
    """``quantization: "int8"``: the draft's projections (and a head's own LM head) are int8 per row, the
    target's are untouched, the output is the target's, and the guesses mostly those of the bf16 draft (the
    target as its own draft: int8 rounding may flip a near tie, rarely)."""
    from kvloom.layers.linear import Linear

    prompts = varied_prompts(6)
    expected = plain(tiny_llama3_dir, plain_outputs, {}, prompts)
    model = tiny_llama3_dir if head == "draft_model" else eagle_heads[head]
    method = EAGLE_HEADS[head]["method"] if head != "draft_model" else head
    accepted = []
    for quantization in (None, "int8"):
        spec = {"method": method, "model": model, "num_speculative_tokens": 3}
        if quantization:
            spec["quantization"] = quantization
        llm = LLM(model=tiny_llama3_dir, max_model_len=256, speculative_config=spec)
        llm.llm_engine.executor.driver.speculator.policy.adaptive = False
        runner = llm.llm_engine.executor.driver
        drafter = runner.proposer.model
        linears = [m for m in drafter.modules() if isinstance(m, Linear)]
        # Packing hands the int8 weights to the platform's int8 product (and drops them from the Linear).
        assert linears and all(("Int8" in type(m.packed).__name__) == (quantization == "int8") for m in linears)
        assert not any("Int8" in type(m.packed).__name__ for m in runner.model.modules() if isinstance(m, Linear))
        if head == "eagle3":  # its own LM head over a draft vocabulary
            assert (drafter.lm_head.qweight is not None) == (quantization == "int8")
        assert run(llm, greedy_params(len(prompts)), prompts) == expected
        stats = llm.llm_engine.scheduler.stats()
        assert stats.num_draft_tokens > 0
        accepted.append(stats.num_accepted_tokens / stats.num_draft_tokens)
    if head == "draft_model":
        assert accepted[1] > 0.9 * accepted[0], accepted


def _rewrite_head(path: str, drop: tuple[str, ...] = (), replace: dict | None = None, config: dict | None = None
                  ) -> None:
    import json

    from safetensors.torch import load_file, save_file

    tensors = {name: t for name, t in load_file(f"{path}/model.safetensors").items() if name not in drop}
    save_file({**tensors, **(replace or {})}, f"{path}/model.safetensors")
    with open(f"{path}/config.json") as f:
        values = json.load(f)
    for key, value in (config or {}).items():
        if isinstance(value, dict):
            values[key] = {**values.get(key, {}), **value}
        else:
            values[key] = value
    with open(f"{path}/config.json", "w") as f:
        json.dump(values, f)


@pytest.mark.parametrize("method, change, message", [
    ("eagle", {"replace": {"fc.weight": "wide"}}, r"'fc.weight' has shape \(64, 129\), expected \(64, 128\)"),
    ("eagle", {"replace": {"layers.0.self_attn.k_proj.weight": "wide"}}, "'layers.0.self_attn.k_proj.weight'"),
    ("eagle", {"drop": ("layers.0.mlp.down_proj.weight",)}, r"missing 1 tensor.*mlp.down_proj"),
    ("eagle", {"config": {"vocab_size": 1000}}, "vocab_size is 1000, the target model's 4"),
    ("eagle3", {"config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}},
     r"eagle_aux_hidden_state_layer_ids must name 3 of the target's layers \(0..1\)"),
    ("eagle3", {"drop": ("lm_head.weight",)}, "needs its own LM head"),
    ("eagle3", {"config": {"target_hidden_size": 32}}, "target_hidden_size is 32"),
])
def test_a_mismatched_eagle_head_is_a_value_error_naming_what(tiny_llama3_dir: str, tmp_path, method: str,
                                                              change: dict, message: str) -> None:
    import tiny_models
    import torch

    path = tiny_models.build_tiny_eagle(str(tmp_path / "head"), tiny_llama3_dir, method,
                                        draft_vocab_size=100 if method == "eagle3" else None)
    replace = {name: torch.zeros(64, 129) if name == "fc.weight" else torch.zeros(32, 65)
               for name in change.get("replace", {})}
    _rewrite_head(path, change.get("drop", ()), replace, change.get("config"))
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama3_dir, max_model_len=256,
            speculative_config={"method": method, "model": path, "num_speculative_tokens": 2})


def test_a_prefix_hit_on_blocks_filled_while_the_head_lagged_drafts_only_once_their_head_kv_exists(
        tiny_llama3_dir: str, eagle_heads: dict, hf_target, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request given no drafts never runs the EAGLE head, so the blocks it fills hold no head KV. A later
    request whose prefix-cache hit begins with them cannot guess (the head would attend to stale KV, and the
    target's hidden states of those positions are gone): it gets no drafts, and once it has waited
    ``MAX_DRAFT_LAG`` tokens it is given none for good. Two requests sharing a new prefix in one step both
    guess: the first's pass writes the blocks the second's hit begins with, and each guess is what the head
    computes over the whole sequence."""
    import json

    from safetensors.torch import load_file

    import kvloom.worker.draft_kv as draft_kv

    head = [7 + (j * 11) % 290 for j in range(24)]
    prompts = {name: head + [5 + (seed * 13 + j * 7) % 300 for j in range(5)]
               for seed, name in enumerate(("lagging", "hit", "hit-again"))}
    plain_llm = LLM(model=tiny_llama3_dir, max_model_len=256, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = {name: run(plain_llm, params, [prompt]) for name, prompt in prompts.items()}
    llm = LLM(model=tiny_llama3_dir, max_model_len=256, block_size=4, speculative_config={
        "method": "eagle", "model": eagle_heads["eagle"], "num_speculative_tokens": 3})
    engine = llm.llm_engine
    runner = engine.executor.driver
    speculation = runner.speculator.policy
    records = []
    propose = runner.proposer.propose

    def recording(requests, hidden, build_inputs):
        drafts = propose(requests, hidden, build_inputs)
        for request_id, guesses in drafts.items():
            state = runner.requests[request_id]
            records.append((request_id, state.prompt_token_ids + state.output_token_ids, guesses))
        return drafts

    runner.proposer.propose = recording
    speculation.adaptive = False  # k = 3 at every step, but none for the first request
    num_drafts = speculation.num_drafts
    speculation.num_drafts = lambda *args, **kwargs: 0
    assert run(llm, params, [prompts["lagging"]]) == expected["lagging"]
    assert not records
    speculation.num_drafts = num_drafts
    monkeypatch.setattr(draft_kv, "MAX_DRAFT_LAG", 12)  # the hits below wait at most 12 tokens
    for name in ("hit", "hit-again"):  # hits on the lagging request's blocks: no guess, then disabled
        assert run(llm, params, [prompts[name]]) == expected[name]
        assert not records
    assert runner.speculator.draft_kv.num_disabled == 2
    # 5 blocks of the shared 24 tokens each (EAGLE names a block with the token after it, which differs in the 6th).
    assert engine.scheduler.stats().prefix_cache_hits == 2 * 20

    shared = [11 + (j * 17) % 280 for j in range(16)]
    together = [shared + [40 + i, 50 + i, 60 + i] for i in range(2)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in together], params, use_tqdm=False)
    assert [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs] == [
        run(plain_llm, params, [p])[0] for p in together]
    assert runner.speculator.draft_kv.num_disabled == 2
    assert engine.scheduler.stats().prefix_cache_hits == 2 * 20 + 12  # the second's hit: the first's 3 blocks
    ids = [o.request_id for o in outputs]
    assert {request_id for request_id, _, _ in records} == set(ids)
    with open(f"{eagle_heads['eagle']}/config.json") as f:
        config = json.load(f)
    weights = load_file(f"{eagle_heads['eagle']}/model.safetensors")
    for _, tokens, guesses in [r for r in records if r[0] == ids[1]][:4]:
        assert guesses == _reference_eagle_guesses(hf_target, weights, config, "eagle", tokens, 3)[:len(guesses)]
