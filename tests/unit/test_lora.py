"""LoRA without a model: the delta's three implementations against the reference, the adapter checks (every
bad input a ValueError naming it), the scheduler's adapter cap and its fairness, and the prefix cache's keys."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels' module is imported

from safetensors.torch import save_file  # noqa: E402

from kvloom.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from kvloom.engine.request import Request  # noqa: E402
from kvloom.engine.scheduler import Scheduler  # noqa: E402
from kvloom.lora.peft import ModelShape, check_adapter  # noqa: E402
from kvloom.lora.registry import LoRAChecker  # noqa: E402
from kvloom.lora.request import LoRARequest  # noqa: E402
from kvloom.ops.lora import LoRAGroups, add_lora_grouped, add_lora_reference  # noqa: E402
from kvloom.sampling_params import SamplingParams  # noqa: E402
from kvloom.step_io import ModelRunnerOutput  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = ModelShape("LlamaForCausalLM", num_hidden_layers=2, hidden_size=64, intermediate_size=128, q_size=64,
                   kv_size=32)


# ---- the delta ----------------------------------------------------------------------------------------------
def lora_case(tokens: int, slots: list[int], dtype: torch.dtype, in_features: int = 96, out_features: int = 80,
              num_slots: int = 3, rank: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g).to(dtype)
    y = torch.randn(tokens, out_features, generator=g).to(dtype)
    a = (torch.randn(num_slots, rank, in_features, generator=g) * 0.2).to(dtype)
    b = (torch.randn(num_slots, out_features, rank, generator=g) * 0.2).to(dtype)
    return x, y, a, b, torch.tensor(slots, dtype=torch.long)


SLOT_PATTERNS = {
    "mixed": [0, -1, 2, 2, 1, -1, 0, 0, 1, 2],     # slots interleaved with base tokens: gathers
    "contiguous": [1, 1, 1, 1, -1, -1, 2, 2, 2, 0],  # each slot's rows one range: views
    "one adapter": [0] * 10,
    "base only": [-1] * 10,
}


@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
@pytest.mark.parametrize("dtype, adapter_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "bf16 activations, fp32 slots (the CPU's)"])
def test_grouped_delta_matches_reference(pattern: str, dtype: torch.dtype, adapter_dtype: torch.dtype) -> None:
    slots = SLOT_PATTERNS[pattern]
    x, y, a, b, token_slots = lora_case(len(slots), slots, dtype)
    a, b = a.to(adapter_dtype), b.to(adapter_dtype)
    expected, got = y.clone(), y.clone()
    add_lora_reference(expected, x, a, b, token_slots)
    add_lora_grouped(got, x, a, b, LoRAGroups.from_token_slots(slots, torch.device("cpu")))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tol)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's tokens are untouched
    if pattern != "base only":
        assert not torch.equal(got, y)


@pytest.mark.parametrize("pattern", ["mixed", "base only"])
@pytest.mark.parametrize("shape", [(96, 80, 16), (200, 130, 48)], ids=["small", "tails"])
def test_triton_delta_matches_reference(pattern: str, shape: tuple[int, int, int]) -> None:
    """BGMV shrink + expand (fp32: the interpreter's fp32 sums are exact enough for 1e-5)."""
    from kvloom.ops.triton.lora import add_lora_triton

    in_features, out_features, rank = shape
    slots = SLOT_PATTERNS[pattern]
    x, y, a, b, token_slots = lora_case(len(slots), slots, torch.float32, in_features, out_features, rank=rank)
    expected = y.clone()
    add_lora_reference(expected, x, a, b, token_slots)
    x, y, a, b, token_slots = (t.to(DEVICE) for t in (x, y, a, b, token_slots))
    add_lora_triton(y, x, a, b, token_slots)
    torch.testing.assert_close(y.cpu(), expected, atol=1e-5, rtol=1e-5)


def load_cpu_lora() -> None:
    from kvloom.ops import cpu
    from kvloom.ops.lora import cpu_lora_available

    error = cpu.load_cpu_kernel()
    if error is not None or not cpu_lora_available():
        pytest.skip(f"kvloom's CPU kernels cannot be built here: {error}")


def block_diagonal(b: torch.Tensor, out_offsets: list[int]) -> torch.Tensor:
    """b [S, out, R] with shard j's outputs keeping only shard j's ranks (a fused projection's B)."""
    shards = len(out_offsets) - 1
    rank = b.shape[2] // shards
    mask = torch.zeros_like(b)
    for j in range(shards):
        mask[:, out_offsets[j]:out_offsets[j + 1], j * rank:(j + 1) * rank] = 1
    return b * mask


CPU_SHAPES = {  # (in, out, R, out_offsets)
    "small": (96, 80, 16, [0, 80]),
    "tails": (200, 130, 48, [0, 130]),  # in and out not multiples of a vector or a tile
    "q|k|v": (96, 160, 48, [0, 96, 128, 160]),
    "gate|up": (64, 258, 32, [0, 129, 258]),  # shards whose outputs end mid-tile
}


@pytest.mark.parametrize("pattern", ["mixed", "one adapter", "base only"])
@pytest.mark.parametrize("dtype, adapter_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16 activations, fp32 slots", "bf16"])
@pytest.mark.parametrize("shape", list(CPU_SHAPES))
def test_cpu_kernel_delta_matches_reference(pattern: str, dtype: torch.dtype, adapter_dtype: torch.dtype,
                                            shape: str) -> None:
    """csrc/lora.cpp (B transposed, each shard reading only its own outputs) against the reference."""
    from kvloom.ops.lora import add_lora_cpu

    load_cpu_lora()
    in_features, out_features, rank, out_offsets = CPU_SHAPES[shape]
    slots = SLOT_PATTERNS[pattern] * 3  # 30 tokens: several chunks per slot
    x, y, a, b, token_slots = lora_case(len(slots), slots, dtype, in_features, out_features, rank=rank)
    a, b = a.to(adapter_dtype), block_diagonal(b, out_offsets).to(adapter_dtype)
    expected = y.clone()
    add_lora_reference(expected, x, a, b, token_slots)
    add_lora_cpu(y, x, a, b.transpose(1, 2).contiguous(), token_slots, out_offsets)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y, expected, **tol)


def test_cpu_kernel_refuses_a_slot_beyond_the_compute_slots() -> None:
    from kvloom.ops.lora import add_lora_cpu

    load_cpu_lora()
    x, y, a, b, _ = lora_case(2, [0, 0], torch.float32, num_slots=2)
    with pytest.raises(RuntimeError, match="beyond"):
        add_lora_cpu(y, x, a, b.transpose(1, 2).contiguous(), torch.tensor([0, 2]), [0, 80])


# ---- adapters on disk ---------------------------------------------------------------------------------------
def write_adapter(path: str, rank: int = 4, alpha: float = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                  shape: ModelShape = SHAPE, **config: object) -> str:
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for module in targets:
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            in_features, out_features = shape.projection(module)
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                   "base_model_name_or_path": "tiny"} | config, f)
    return path


def test_scaling_is_alpha_over_r_or_over_sqrt_r_with_rslora(tmp_path) -> None:
    plain = check_adapter(write_adapter(str(tmp_path / "plain"), rank=4, alpha=8), SHAPE, 16)
    rslora = check_adapter(write_adapter(str(tmp_path / "rs"), rank=4, alpha=8, use_rslora=True), SHAPE, 16)
    assert plain.scaling == 2.0 and math.isclose(rslora.scaling, 4.0)
    assert plain.targets == {(layer, m) for layer in range(2) for m in ("q_proj", "v_proj")}


def _corrupt(path: str) -> None:
    file = os.path.join(path, "adapter_model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


BAD_ADAPTERS = {
    "missing path": (lambda p: p + "/nowhere", "no such directory"),
    "pickle": (lambda p: (os.remove(f"{p}/adapter_model.safetensors"),
                          open(f"{p}/adapter_model.bin", "wb").close(), p)[-1], "is a pickle"),
    "rank above max": (lambda p: write_adapter(p, rank=32), "above max_lora_rank=16"),
    "lm_head target": (lambda p: write_adapter(p, target_modules=["q_proj", "lm_head"]), "'lm_head' is not supported"),
    "unknown target": (lambda p: write_adapter(p, target_modules=["c_attn"]), "not a projection this model has"),
    "other base model": (lambda p: write_adapter(p, shape=ModelShape("LlamaForCausalLM", 2, 96, 128, 96, 32)),
                         "another base model"),
    "too many layers": (lambda p: write_adapter(p, shape=ModelShape("LlamaForCausalLM", 3, 64, 128, 64, 32)),
                        "the model has 2 layers"),
    "corrupt": (lambda p: (_corrupt(p), p)[-1], "corrupt"),
    "dora": (lambda p: write_adapter(p, use_dora=True), "DoRA"),
    "bad json": (lambda p: (open(f"{p}/adapter_config.json", "w").write("{r: 4"), p)[-1], "not valid JSON"),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_bad_adapters_are_refused_with_a_message(case: str, tmp_path) -> None:
    make, message = BAD_ADAPTERS[case]
    path = make(write_adapter(str(tmp_path / "adapter")))
    with pytest.raises(ValueError, match=message):
        check_adapter(path, SHAPE, 16)


def test_the_engine_checker_refuses_what_it_cannot_serve(tmp_path) -> None:
    path = write_adapter(str(tmp_path / "a"))
    request = LoRARequest("a", 1, path)
    with pytest.raises(ValueError, match="enable_lora=True"):
        LoRAChecker(False, SHAPE, 16, speculative=False).check(request)
    with pytest.raises(ValueError, match="speculative decoding"):
        LoRAChecker(True, SHAPE, 16, speculative=True).check(request)
    checker = LoRAChecker(True, SHAPE, 16, speculative=False)
    assert checker.check(request).rank == 4
    with pytest.raises(ValueError, match="already names adapter"):
        checker.check(LoRARequest("b", 1, write_adapter(str(tmp_path / "b"))))
    with pytest.raises(ValueError, match="LoRARequest"):
        checker.check("a")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, path)
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        check_adapter(path, ModelShape("GemmaForCausalLM", 2, 64, 128, 64, 32), 16)


# ---- scheduling and the prefix cache --------------------------------------------------------------------------
def lora_request(adapter: int | None, request_id: str, prompt: list[int], max_tokens: int = 3) -> Request:
    request = Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), set(), 1024)
    request.lora_request = None if adapter is None else LoRARequest(f"a{adapter}", adapter, f"/a{adapter}")
    return request


def run(scheduler: Scheduler, on_step=None, max_steps: int = 500) -> list[set[int]]:  # noqa: ANN001
    """Step to the end with a fake model; the distinct adapters of every step's batch."""
    adapters_per_step = []
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return adapters_per_step
        if on_step is not None:
            on_step(step)
        out = scheduler.schedule()
        lora = {scheduler.requests[s.request_id].lora_request for s in out.scheduled}
        adapters_per_step.append({r.lora_int_id for r in lora if r is not None})
        scheduler.update_from_output(out, ModelRunnerOutput(
            sampled_token_ids={s.request_id: [7] for s in out.scheduled if s.samples}))
    pytest.fail("requests did not finish")


def test_a_step_never_holds_more_adapters_than_max_loras() -> None:
    scheduler = Scheduler(KVCacheManager(200, 4), 16, 256, 1024, max_loras=2)
    for i, adapter in enumerate([1, 2, 3, None, 1, 3, 4, None, 2, 4]):
        scheduler.add_request(lora_request(adapter, f"r{i}", [1 + i, 2, 3, 4, 5]))
    steps = run(scheduler)
    assert max(len(s) for s in steps) == 2
    assert set().union(*steps) == {1, 2, 3, 4}


def test_a_waiting_adapter_is_not_starved_by_a_busy_one() -> None:
    """Adapter 1 gets a new request every step; adapter 2's request, queued behind, must still run (with one
    slot, only once adapter 1's running requests drain), and base requests keep flowing meanwhile."""
    scheduler = Scheduler(KVCacheManager(400, 4), 16, 256, 1024, max_loras=1)
    scheduler.add_request(lora_request(1, "first", [1, 2, 3]))
    scheduler.add_request(lora_request(2, "starved?", [4, 5, 6]))
    admitted_at: dict[str, int] = {}

    def arrive(step: int) -> None:
        if step < 40:
            scheduler.add_request(lora_request(1, f"busy{step}", [9, step, 3]))
            scheduler.add_request(lora_request(None, f"base{step}", [8, step, 3]))
        for request in scheduler.running:
            admitted_at.setdefault(request.request_id, step)

    run(scheduler, arrive)
    assert admitted_at["starved?"] < 10
    assert admitted_at["base1"] <= 2  # base requests pass a request waiting for a slot


def test_the_same_prompt_under_two_adapters_shares_no_blocks() -> None:
    kv = KVCacheManager(50, 4)
    prompt = list(range(1, 14))
    first = lora_request(1, "a", prompt)
    assert kv.allocate_slots(first, len(prompt))
    assert kv.get_computed_blocks(lora_request(1, "same adapter", prompt))[1] == 12
    assert kv.get_computed_blocks(lora_request(2, "other adapter", prompt))[1] == 0
    assert kv.get_computed_blocks(lora_request(None, "base", prompt))[1] == 0


# ---- the server's surface -------------------------------------------------------------------------------------
def test_lora_modules_flag_takes_both_forms() -> None:
    from kvloom.entrypoints.openai.serving_lora import parse_lora_modules

    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        ("a", "/x", None), ("b", "/y", "m")]
    for bad in ("a", "=/x", '{"name": "b"}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_runtime_updating_routes_answer_404_unless_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvloom.entrypoints.openai.served_models import ServedModels
    from kvloom.entrypoints.openai.serving_engine import APIError
    from kvloom.entrypoints.openai.serving_lora import LoRAModules, lora_routes

    class Engine:  # what LoRAModules reads of an EngineClient: the input processor's adapter check
        class input_processor:  # noqa: N801
            @staticmethod
            def check_lora_request(request: LoRARequest) -> None:
                raise ValueError(f"LoRA adapter at {request.lora_path!r}: no such directory")

    app = FastAPI()
    app.exception_handler(APIError)(lambda _, error: error.response())
    lora_modules = LoRAModules(Engine(), ["base"], enabled=True)
    pool = ServedModels.single(Engine(), ["base"], lambda engine, model: SimpleNamespace(lora_modules=lora_modules))
    app.include_router(lora_routes(pool))  # the routes reach each model's adapters through the server's pool
    client = TestClient(app)
    body = {"lora_name": "a", "lora_path": "/nowhere"}
    monkeypatch.delenv("KVLOOM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    response = client.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 404 and "KVLOOM_ALLOW_RUNTIME_LORA_UPDATING=1" in response.json()["error"]["message"]
    monkeypatch.setenv("KVLOOM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    response = client.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path"
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": "/x"}).status_code == 400
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    assert client.post("/v1/unload_lora_adapter", content=b"{").status_code == 400
