"""The packed model kept across restarts (kvloom/worker/packed_cache.py).

A tiny GGUF mixing the products a real Q4_K_M / Q8_0 file takes (Q4_1 and Q6_K code blocks, Q8_0 int8 blocks, a
tied Q6_K table): the first start packs and writes it, the second maps it without decoding a block, with every
token and logprob equal; a changed file or configuration packs anew, a damaged entry is packed again, the oldest
entries of a file go.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import tiny_models
import torch

from e2e.test_correctness import mixed_prompts
from kvloom import LLM, SamplingParams
from kvloom.loader import gguf
from kvloom.ops import cpu, huge_pages
from kvloom.worker import packed_cache
from kvloom.worker.packed_cache import MANIFEST, MODEL_FILE

GGML_Q4_1, GGML_Q8_0, GGML_Q6_K = 3, 8, 14


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels are not built here")
    root = tmp_path_factory.mktemp("packed")
    checkpoint = tiny_models.build_tiny_checkpoint(str(root / "hf"), arch="llama", hidden_size=256,
                                                   intermediate_size=256)
    types = {"embed": GGML_Q6_K, "attn": GGML_Q4_1, "attn_v": GGML_Q6_K, "attn_o": GGML_Q8_0, "ffn": GGML_Q4_1,
             "ffn_down": GGML_Q6_K}
    return tiny_models.write_tiny_gguf(str(root / "mixed.gguf"), checkpoint, types=types)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "1")
    return tmp_path / "cache" / "packed"


def _run(path: str, **kwargs: object) -> list[tuple[list[int], list[float]]]:
    return _generate(LLM(path, max_model_len=256, **kwargs))


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(400, count=4, seed=3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [step[token].logprob for step, token in zip(o.outputs[0].logprobs,
                                                                                  o.outputs[0].token_ids)])
            for o in outputs]


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if (p / MANIFEST).is_file()) if root.exists() else []


def _no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read of the file's blocks fails the test."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF's blocks were decoded on a start the cache should have served")
    monkeypatch.setattr(gguf, "q4_blocks", refuse)
    monkeypatch.setattr(gguf, "read_tensor_bytes", refuse)


def test_a_second_start_maps_the_packed_model_with_the_same_outputs(mixed_gguf: str, cache_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cold = _run(mixed_gguf)
    [entry] = _entries(cache_dir)
    manifest = json.loads((entry / MANIFEST).read_text())
    assert manifest["bytes"] == (entry / MODEL_FILE).stat().st_size > 0
    assert manifest["key"]["file"]["path"] == os.path.realpath(mixed_gguf)
    with monkeypatch.context() as patched:
        _no_decoding(patched)
        warm = _run(mixed_gguf)
    assert warm == cold  # tokens and logprobs bit for bit


def test_the_mapped_model_holds_the_packed_products(mixed_gguf: str, cache_dir: Path) -> None:
    """Every projection comes back as its packed product over mapped storage, with the layer stack rebuilt."""
    from kvloom.ops.q4 import PackedQ4Weight

    _run(mixed_gguf)
    model = LLM(mixed_gguf, max_model_len=256).llm_engine.executor.driver.model
    packed = [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), PackedQ4Weight)]
    assert packed and all(p.scales.untyped_storage().nbytes() > 0 for p in packed)
    assert getattr(model, "layer_stack", None) is None or model.layer_stack._plan is not None


def test_a_changed_file_or_configuration_packs_anew(mixed_gguf: str, cache_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _run(mixed_gguf)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(Path(mixed_gguf).read_bytes())
    _run(str(copy))  # another file: its own entry
    _run(mixed_gguf, max_num_seqs=8)  # another batch hint: another entry
    assert len(_entries(cache_dir)) == 3
    os.utime(copy, ns=(1, 1))  # the same path, changed: read again, not mapped
    decoded = []
    real = gguf.q4_blocks

    def counting(*args: object, **kwargs: object) -> object:
        decoded.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(gguf, "q4_blocks", counting)
    _run(str(copy))
    assert decoded


def test_a_damaged_entry_is_packed_again(mixed_gguf: str, cache_dir: Path) -> None:
    cold = _run(mixed_gguf)
    [entry] = _entries(cache_dir)
    model = entry / MODEL_FILE
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])  # a partial copy
    assert _run(mixed_gguf) == cold
    [again] = _entries(cache_dir)
    assert (again / MODEL_FILE).stat().st_size == json.loads((again / MANIFEST).read_text())["bytes"]
    (again / MANIFEST).write_text("{not json")
    assert _run(mixed_gguf) == cold
    assert len(_entries(cache_dir)) == 1


def test_the_oldest_entries_of_a_file_go_and_the_knob_turns_it_off(mixed_gguf: str, cache_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for seqs in (4, 8, 16):
        _run(mixed_gguf, max_num_seqs=seqs)
    kept = _entries(cache_dir)
    assert len(kept) == packed_cache.KEEP_PER_FILE
    assert {json.loads((e / MANIFEST).read_text())["key"]["batch_hint"] for e in kept} == {8, 16}
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    _run(mixed_gguf, max_num_seqs=32)
    assert len(_entries(cache_dir)) == packed_cache.KEEP_PER_FILE


def test_short_of_space_this_files_older_entries_make_room(mixed_gguf: str, cache_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry of another configuration (or an older kvloom's) gives way when the disk cannot hold both; with no
    entry of the file to remove, the new one is not written."""
    _run(mixed_gguf, max_num_seqs=4)
    [old] = _entries(cache_dir)
    real_usage = shutil.disk_usage
    old_bytes = (old / MODEL_FILE).stat().st_size

    def full_while_old_exists(path: object) -> object:  # room for the new entry only once the old one goes
        usage = real_usage(path)
        return usage._replace(free=packed_cache.FREE_SPACE_MARGIN + old_bytes // 2) if old.exists() else usage
    monkeypatch.setattr(packed_cache.shutil, "disk_usage", full_while_old_exists)
    _run(mixed_gguf, max_num_seqs=8)
    [new] = _entries(cache_dir)
    assert not old.exists() and json.loads((new / MANIFEST).read_text())["key"]["batch_hint"] == 8
    monkeypatch.setattr(packed_cache.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=0))
    _run(mixed_gguf, max_num_seqs=16)  # nothing else of this file to remove: not written, the start goes on
    assert _entries(cache_dir) == [new]


def test_no_cache_off_the_cpu_path_or_for_lora(mixed_gguf: str, cache_dir: Path) -> None:
    """LoRA wraps the model after loading: such a start packs as before and writes nothing."""
    _run(mixed_gguf, enable_lora=True)
    assert not _entries(cache_dir)
    assert torch.ops.kvloom.gemm_q4 is not None


def test_an_unwritable_cache_folder_costs_only_the_entry(mixed_gguf: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(packed_cache, "cache_root", lambda: blocker / "packed")  # a folder that cannot be made
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "1")
    assert len(_run(mixed_gguf)) == 4
    assert not (tmp_path / "packed").exists()


def test_a_dead_writers_partial_entry_is_removed(mixed_gguf: str, cache_dir: Path) -> None:
    """A first start killed while writing leaves tmp.<pid>.<id>: the next write deletes it; a live writer's stays."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    abandoned = cache_dir / f"tmp.{int(dead.stdout)}.0123"
    live = cache_dir / f"tmp.{os.getpid()}.4567"
    for staging in (abandoned, live):
        staging.mkdir(parents=True)
        (staging / MODEL_FILE).write_bytes(b"partial")
    _run(mixed_gguf)
    assert not abandoned.exists() and live.exists()
    assert len(_entries(cache_dir)) == 1


@pytest.mark.parametrize("start", ["mapped", "fresh"])
def test_a_model_moves_onto_huge_pages_over_its_first_steps(mixed_gguf: str, cache_dir: Path, start: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A mapped start serves from the file's pages at once; a fresh one (no packed cache) packs into ordinary memory
    (faulting huge pages in ran at 0.4-0.55 GB/s on a 2-core VM, a third of a 4 KiB pass). Before each step the
    runner moves part of the model (the large storages onto huge pages; this tiny model's count as large here; a
    fresh start leaves the small ones where they are): the same tensors, now on 2 MiB-aligned mappings, and the same
    tokens and logprobs before, during and after the move."""
    from kvloom.ops.q4 import PackedQ4Weight

    cold = _run(mixed_gguf)
    if start == "fresh":
        monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 4096)
    llm = LLM(mixed_gguf, max_model_len=256)
    runner = llm.llm_engine.executor.driver
    rehome = runner.rehome
    assert rehome is not None and not rehome.finished
    packed = [m.packed for m in runner.model.modules() if isinstance(getattr(m, "packed", None), PackedQ4Weight)]
    large = [p.data for p in packed if p.data.untyped_storage().nbytes() >= 4096]
    assert large and not any(t.data_ptr() % huge_pages.HUGE_PAGE == 0 for t in large)
    small = {id(t): (t, t.data_ptr()) for t in packed_cache.held_tensors(runner.model, every_view=True)
             if 0 < t.untyped_storage().nbytes() < 4096}
    monkeypatch.setattr(rehome, "STEP_BYTES", 1)  # a storage a step: the model half moved while it generates
    assert _generate(llm) == cold
    assert not rehome.finished and runner.rehome is rehome
    monkeypatch.setattr(rehome, "STEP_BYTES", 1 << 30)
    assert _generate(llm) == cold
    assert runner.rehome is None and rehome.finished
    assert all(t.data_ptr() % huge_pages.HUGE_PAGE == 0 for t in large)
    if start == "fresh":
        assert small and all(t.data_ptr() == ptr for t, ptr in small.values())
    assert _generate(llm) == cold


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_other_families_map_back_with_the_same_outputs(family: str, tmp_path: Path, cache_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Families whose layers run module by module (q/k/v biases, q/k norms, a window per layer) are pickled whole:
    the mapped start must behave as the cold one (a sentinel object() once came back as another object)."""
    if not cpu.cpu_kernel_available():
        pytest.skip("the CPU kernels are not built here")
    checkpoint = tiny_models.build_tiny_family_checkpoint(str(tmp_path / "hf"), family)
    types = {"attn": GGML_Q4_1, "attn_o": GGML_Q8_0, "ffn": GGML_Q4_1, "ffn_down": GGML_Q8_0}
    if family == "gemma3":
        path = tiny_models.write_tiny_family_gguf(str(tmp_path / f"{family}.gguf"), checkpoint, family, types=types)
    else:
        path = tiny_models.write_tiny_gguf(str(tmp_path / f"{family}.gguf"), checkpoint, arch=family, types=types)
    cold = _run(path)
    assert len(_entries(cache_dir)) == 1
    with monkeypatch.context() as patched:
        _no_decoding(patched)
        warm = _run(path)
    assert warm == cold


@pytest.fixture
def onednn_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 weights packed as an AMX CPU packs them with batch-dependent products allowed: kvloom's panels and
    oneDNN's packing, oneDNN's product from 4 rows (on a CPU without AMX its AVX-512 kernels, or fp32 ones on AVX2)."""
    if not cpu.cpu_kernel_available() or not torch.backends.mkldnn.is_available():
        pytest.skip("needs the CPU kernels and torch's oneDNN")
    monkeypatch.setenv("KVLOOM_CPU_ONEDNN", "force")


def _packed_weights(llm: LLM) -> list[cpu.PackedWeight]:
    return [m.packed for m in llm.llm_engine.executor.driver.model.modules()
            if isinstance(getattr(m, "packed", None), cpu.PackedWeight)]


def test_onednn_packed_bf16_weights_map_back_and_move_onto_huge_pages(mixed_gguf: str, cache_dir: Path,
                                                                    onednn_forced: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 load of a GGUF with oneDNN's packing beside kvloom's (what crashed every bf16 start on an AMX Xeon:
    the packed-model cache pickled oneDNN's opaque tensor): written, mapped back without decoding, moved onto huge
    pages, with the same tokens and logprobs at every start, steps of 4+ rows taking oneDNN's product."""
    cold_llm = LLM(mixed_gguf, max_model_len=256, quantization="none")
    assert {p.format for p in _packed_weights(cold_llm)} == {"hybrid"}
    cold = _generate(cold_llm)
    del cold_llm
    [entry] = _entries(cache_dir)
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 4096)
    with monkeypatch.context() as patched:
        _no_decoding(patched)
        llm = LLM(mixed_gguf, max_model_len=256, quantization="none")
    runner = llm.llm_engine.executor.driver
    rehome = runner.rehome
    assert rehome is not None and not rehome.finished
    assert not any(t.is_mkldnn for t in packed_cache.held_tensors(runner.model, every_view=True))
    assert _generate(llm) == cold
    rehome.finish()
    assert _generate(llm) == cold
    assert all(p.data.data_ptr() % huge_pages.HUGE_PAGE == 0 for p in _packed_weights(llm))


def test_by_default_an_entry_is_written_only_where_packing_took_long(mixed_gguf: str, cache_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """KVLOOM_PACKED_CACHE unset (auto): a start that read and packed the file in less than MIN_PACKING_SECONDS
    writes nothing (the next one packs again as fast); one that took longer writes its entry, which the next maps."""
    monkeypatch.delenv("KVLOOM_PACKED_CACHE")
    assert packed_cache.mode() == "auto"
    monkeypatch.setattr(packed_cache, "MIN_PACKING_SECONDS", 3600.0)
    first = _run(mixed_gguf)
    assert _entries(cache_dir) == []
    monkeypatch.setattr(packed_cache, "MIN_PACKING_SECONDS", 0.0)
    assert _run(mixed_gguf) == first
    assert len(_entries(cache_dir)) == 1
    _no_decoding(monkeypatch)
    assert _run(mixed_gguf) == first
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "0")
    assert packed_cache.mode() == "off" and not packed_cache.enabled()
