"""The Llama layer stack (csrc/decoder.cpp: every decoder layer in one native call) against the layers run
module by module, its reference: the same hidden states bit for bit, on a mixed batch (decodes, a chunk
with a cached prefix, a whole prompt) in both KV-cache layouts and with int8 weights (per row, weight-only
or W8A8, and Q8_0 blocks) or 5-bit code blocks (Q5_K), and the same tokens through the engine; an EAGLE-1
head's layer likewise."""

from __future__ import annotations

import pytest
import torch
from paged_batch import place_requests
from tiny_models import build_tiny_checkpoint

from kvloom.cpu_capability import cpu_capability
from kvloom.layers.linear import Linear
from kvloom.loader.weights import iter_weights, load_model_config, resolve_model
from kvloom.models.registry import build_model, process_weights_after_loading
from kvloom.ops import cpu
from kvloom.ops.int8 import Int8Blocks, Int8Rows
from kvloom.ops.metadata import AttentionMetadata
from kvloom.ops.q4 import Q4Blocks
from kvloom.ops.table import select_ops

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def stack_kernel() -> None:
    if not cpu.cpu_kernel_available() or not cpu.layer_stack_available():
        pytest.skip("the layer stack needs the CPU kernels built with AVX512-BF16 or AVX2")


def _model(path: str, int8: str | None = None):
    """The model in bf16 as the engine prepares it; ``int8``: its projections quantized per row ("rows",
    weight-only products; "rows-w8a8", W8A8 from 2 rows) or held as blocks of 32 ("blocks", as a Q8_0)."""
    source = resolve_model(path)
    config = load_model_config(source)
    ops = select_ops(torch.device("cpu"), torch.bfloat16, int8_activations=int8 == "rows-w8a8")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_model(config, ops)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(iter_weights(source))
    if int8 == "q5":  # every projection as 5-bit code blocks (a GGUF's Q5_K), random codes, scales and offsets
        generator = torch.Generator().manual_seed(5)
        for module in model.layers.modules():
            if isinstance(module, Linear):
                n, k = module.weight.shape
                module.q4 = Q4Blocks(torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=generator),
                                     torch.rand(n, k // 32, generator=generator) * 0.01,
                                     -torch.rand(n, k // 32, generator=generator) * 0.16)
                module.q4_shards = set(range(len(module.output_sizes)))
    elif int8 is not None:
        for module in model.layers.modules():
            if isinstance(module, Linear):
                module.quantize()
                if int8 == "blocks":
                    blocks = Int8Blocks.from_rows(Int8Rows(module.qweight, module.weight_scale))
                    module.set_int8(blocks.qweight, blocks.scale)
    process_weights_after_loading(model, ops)
    return model.eval(), config, ops


def _forward_both_ways(model, config, ops, query_lens, context_lens):
    """Hidden states of one step, with the stack and module by module, each on its own copy of caches
    that hold the same random context."""
    batch = place_requests(query_lens, context_lens, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(config.num_hidden_layers):
        k, v = ops.allocate_kv_cache(batch.num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                                     torch.bfloat16, "cpu")
        k[1:] = torch.randn(k[1:].shape, generator=generator).to(torch.bfloat16)
        v[1:] = torch.randn(v[1:].shape, generator=generator).to(torch.bfloat16)
        caches.append((k, v))
    ids = torch.randint(3, config.vocab_size, (sum(query_lens),), generator=generator)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    outputs, written = [], []
    for use_stack in (True, False):
        kv = [(k.clone(), v.clone()) for k, v in caches]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(batch.slot_mapping), block_table=torch.tensor(batch.block_tables),
            seq_lens=torch.tensor(batch.seq_lens), query_start_loc=batch.query_start_loc,
            seq_lens_host=batch.seq_lens, num_decodes=batch.num_decodes, block_size=BLOCK_SIZE,
            sliding_window=config.sliding_window, max_query_len=max(query_lens))
        stack = model.layer_stack
        if not use_stack:
            model.layer_stack = None
        try:
            with torch.inference_mode():
                outputs.append(model(ids, positions, kv, metadata))
        finally:
            model.layer_stack = stack
        written.append(kv)
    return outputs, written


@pytest.mark.parametrize("arch,head_dim", [
    ("llama", 16),  # the rows layout of the caches
    ("llama", 32),  # the pairs layout
    ("mistral", 32),  # a sliding window (8 tokens), which the contexts below outgrow
])
def test_stack_equals_the_layers_module_by_module(stack_kernel: None, tmp_path, arch: str, head_dim: int) -> None:
    extra = {"sliding_window": 8} if arch == "mistral" else {}
    path = build_tiny_checkpoint(str(tmp_path / "tiny"), arch, hidden_size=4 * head_dim, num_hidden_layers=3,
                                 **extra)
    model, config, ops = _model(path)
    assert model.layer_stack is not None
    (stacked, plain), (stacked_kv, plain_kv) = _forward_both_ways(
        model, config, ops, query_lens=[1, 1, 1, 7, 20], context_lens=[5, 40, 17, 9, 0])
    assert torch.equal(stacked, plain)
    for (k1, v1), (k2, v2) in zip(stacked_kv, plain_kv):  # the same keys and values written
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("int8", ["rows", "rows-w8a8", "blocks", "q5"])
def test_stack_equals_the_layers_module_by_module_with_int8_weights(stack_kernel: None, tiny_llama_dir: str,
                                                                    int8: str) -> None:
    if not cpu.int8_kernels_available():
        pytest.skip("the int8 GEMMs need the CPU kernels built for AVX2 or AVX-512")
    model, config, ops = _model(tiny_llama_dir, int8=int8)
    assert model.layer_stack is not None
    if int8 == "q5":  # the 4-bit product's kernel with the fifth bits beside the nibbles (csrc/decoder.cpp kQ4)
        assert model.layers[0].mlp.down_proj.packed.high is not None
    # Decodes alone (one row: the weight-only product where W8A8 starts at 2 rows, W8A8 on AVX2), then a mixed batch.
    for query_lens, context_lens in (([1], [12]), ([1, 1, 9, 20], [30, 3, 16, 0])):
        (stacked, plain), _ = _forward_both_ways(model, config, ops, query_lens, context_lens)
        assert torch.equal(stacked, plain), (query_lens, context_lens)


@pytest.mark.parametrize("int8", ["rows", "blocks", "q5"])
@pytest.mark.parametrize("invariant", ["1", "0"])
def test_the_stack_multiplies_with_each_weights_own_bf16_tiles(stack_kernel: None, tiny_llama_dir: str, int8: str,
                                                               invariant: str, monkeypatch) -> None:
    """The plan calls each product with the weight's own bf16_tiles, which the op table sets from
    KVLOOM_BATCH_INVARIANT: on an AMX-BF16 CPU the stack took the batch-dependent tiles while the module path did not,
    so a prompt's tokens changed with the others in its step. The plumbing is checked on every CPU; the products'
    equality at every row count runs where the tiles exist (test_stack_equals_the_layers_module_by_module_...)."""
    if not cpu.int8_kernels_available():
        pytest.skip("the int8 GEMMs need the CPU kernels built for AVX2 or AVX-512")
    monkeypatch.setenv("KVLOOM_BATCH_INVARIANT", invariant)
    model, _, _ = _model(tiny_llama_dir, int8=int8)
    packed = [p.packed for layer in model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert {p.bf16_tiles for p in packed} == {invariant == "0"}
    tiles = model.layer_stack._plan_args[4]
    assert tiles == [int(p.bf16_tiles) for p in packed]


def test_stack_keeps_out_what_it_cannot_run(stack_kernel: None, tiny_llama_dir: str, monkeypatch) -> None:
    model, _, _ = _model(tiny_llama_dir)
    assert model.layer_stack is not None
    # A forward hook between the modules (tensor parallelism's all-reduce is one): module by module.
    handle = model.layers[1].self_attn.o_proj.register_forward_hook(lambda *args: None)
    model.prepare_layer_stack()
    assert model.layer_stack is None
    handle.remove()
    model.prepare_layer_stack()
    assert model.layer_stack is not None
    # A product it cannot call (torch's int8 ops), and the switch.
    from kvloom.ops.int8 import NativeInt8Linear

    packed = model.layers[0].mlp.down_proj.packed
    model.layers[0].mlp.down_proj.packed = NativeInt8Linear(torch.zeros(64, 128, dtype=torch.int8),
                                                            torch.ones(64), None)
    model.prepare_layer_stack()
    assert model.layer_stack is None
    model.layers[0].mlp.down_proj.packed = packed
    monkeypatch.setenv("KVLOOM_CPU_LAYER_STACK", "0")
    model.prepare_layer_stack()
    assert model.layer_stack is None


def test_stack_leaves_large_steps_to_onednn_where_weights_are_hybrid(stack_kernel: None, tiny_llama_dir: str,
                                                                     monkeypatch) -> None:
    """bf16 weights holding oneDNN's packing beside kvloom's (KVLOOM_CPU_ONEDNN=force, on any CPU): a step of
    AMX_MIN_ROWS tokens or more runs module by module, where oneDNN's products take it. Otherwise, batch-dependent
    products allowed or not, the stack takes every step (on an AMX CPU kvloom's GEMM runs on AMX tiles itself)."""
    model, _, _ = _model(tiny_llama_dir)
    assert cpu.linear_format(torch.bfloat16) == "kvloom" and model.layer_stack.takes(4096)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    for env in ({"KVLOOM_CPU_ONEDNN": "force"}, {"KVLOOM_BATCH_INVARIANT": "0"}):
        with monkeypatch.context() as patched:
            for name, value in env.items():
                patched.setenv(name, value)
            if "KVLOOM_BATCH_INVARIANT" in env:
                assert cpu.linear_format(torch.bfloat16) == "kvloom"  # oneDNN's product is no longer faster
                continue
            model, _, _ = _model(tiny_llama_dir)
            assert model.layers[0].mlp.down_proj.packed.format == "hybrid"
            stack = model.layer_stack
            assert stack.takes(cpu.AMX_MIN_ROWS - 1) and not stack.takes(cpu.AMX_MIN_ROWS)


def test_engine_tokens_equal_with_and_without_the_stack(stack_kernel: None, tiny_llama_dir: str,
                                                         monkeypatch) -> None:
    from kvloom import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 30, 70)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = []
    for setting in ("1", "0"):
        monkeypatch.setenv("KVLOOM_CPU_LAYER_STACK", setting)
        # A small token budget: prompts are chunked and share steps with decodes.
        llm = LLM(model=tiny_llama_dir, dtype="bfloat16", max_model_len=256, max_num_batched_tokens=32)
        assert (llm.llm_engine.executor.driver.model.layer_stack is not None) == (setting == "1")
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]


def test_eagle1_head_on_the_stack_equals_its_layer_module_by_module(stack_kernel: None, tiny_llama_dir: str,
                                                                    tmp_path) -> None:
    """EAGLE-1's first layer has no input norm: the stack runs it reading its input as is, bit-identical to
    the module path, keys and values included; EAGLE-3 heads stay module by module."""
    from tiny_models import build_tiny_eagle

    from kvloom.models.eagle import load_eagle_head

    model, config, ops = _model(tiny_llama_dir)
    heads = {}
    for method in ("eagle", "eagle3"):
        path = build_tiny_eagle(str(tmp_path / method), tiny_llama_dir, method)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            heads[method] = load_eagle_head(path, method, config, model, ops)
        finally:
            torch.set_default_dtype(previous)
        process_weights_after_loading(heads[method], ops)
    assert heads["eagle3"].layer_stack is None
    head = heads["eagle"]
    assert head.layer_stack is not None
    query_lens, context_lens = [1, 1, 6], [9, 30, 4]
    batch = place_requests(query_lens, context_lens, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    k, v = ops.allocate_kv_cache(batch.num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim,
                                 torch.bfloat16, "cpu")
    k[1:] = torch.randn(k[1:].shape, generator=generator).to(torch.bfloat16)
    v[1:] = torch.randn(v[1:].shape, generator=generator).to(torch.bfloat16)
    ids = torch.randint(3, config.vocab_size, (sum(query_lens),), generator=generator)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    features = torch.randn(sum(query_lens), config.hidden_size, generator=generator).to(torch.bfloat16)
    results = []
    stack = head.layer_stack
    for use_stack in (True, False):
        kv = [(k.clone(), v.clone())]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(batch.slot_mapping), block_table=torch.tensor(batch.block_tables),
            seq_lens=torch.tensor(batch.seq_lens), query_start_loc=batch.query_start_loc,
            seq_lens_host=batch.seq_lens, num_decodes=batch.num_decodes, block_size=BLOCK_SIZE,
            sliding_window=None, max_query_len=max(query_lens))
        head.layer_stack = stack if use_stack else None
        with torch.inference_mode():
            results.append((head(ids, positions, features.clone(), kv, metadata)[0], kv[0]))
    head.layer_stack = stack
    (stacked, (k1, v1)), (plain, (k2, v2)) = results
    assert torch.equal(stacked, plain)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_the_cpu_runs_the_build_for_its_isa_level() -> None:
    """A compile error in one source sends the library to its portable build, which has no bf16 GEMM and no
    stack: every test of those would then skip instead of failing. A CPU with AVX2 or AVX-512 (or a level capped
    to one by KVLOOM_CPU_ISA) must load the build for that level, and with it the bf16 GEMM and the stack."""
    capability = cpu_capability()
    if not cpu.cpu_kernel_available():
        pytest.skip("no compiler builds the kernels here")
    assert cpu.loaded_variant == capability.level
    assert cpu.compiled_isa().split()[0] == capability.level
    if capability.level in ("avx2", "avx512"):
        assert cpu.layer_stack_available() and cpu.linear_format(torch.bfloat16) in ("kvloom", "hybrid")
    if capability.has("avx512_bf16"):
        assert "avx512_bf16" in cpu.compiled_isa()
    else:
        assert "avx512_bf16" not in cpu.compiled_isa()
