"""The compiled-artifacts store (worker/compiled_artifacts.py) shared by engines and processes: one folder per
configuration, never emptied under another start's feet. Plain files stand in for Triton's kernels, so this runs
without a GPU; the GPU tests and benchmarks/gpu_start.py run it with real kernels."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

from kvloom.worker.compiled_artifacts import MANIFEST, ArtifactStore, _checksums

KEY_A = {"model": {"hidden_size": 64}, "dtype": "float32"}
KEY_B = {"model": {"hidden_size": 128}, "dtype": "float32"}


def _kernel(store: ArtifactStore, name: str, data: bytes = b"binary") -> Path:
    path = store.kernels / name / "kernel.cubin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_a_start_compiles_once_and_the_next_reuses(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    first = ArtifactStore(tmp_path, KEY_A)
    first.open()
    assert first.status == "created" and os.environ["TRITON_CACHE_DIR"] == str(first.kernels)
    _kernel(first, "decode")
    first.close()
    assert list(json.loads((first.directory / MANIFEST).read_text())["files"]) == ["decode/kernel.cubin"]
    second = ArtifactStore(tmp_path, KEY_A)
    second.open()
    assert second.status == "reused" and (second.kernels / "decode" / "kernel.cubin").exists()


def test_another_configuration_never_touches_the_first_store(tmp_path: Path) -> None:
    a = ArtifactStore(tmp_path, KEY_A)
    a.open()
    kernel = _kernel(a, "decode")
    a.close()
    b = ArtifactStore(tmp_path, KEY_B)
    b.open()
    assert b.status == "created" and b.directory != a.directory
    _kernel(b, "prefill")
    b.close()
    assert kernel.read_bytes() == b"binary"
    again = ArtifactStore(tmp_path, KEY_A)
    again.open()
    assert again.status == "reused"


def test_a_start_beside_one_still_compiling_keeps_its_kernels(tmp_path: Path) -> None:
    """Two starts of one configuration at once (data-parallel replicas): the second compiles into the store the
    first has not finished, and both manifests list every whole kernel."""
    first = ArtifactStore(tmp_path, KEY_A)
    first.open()
    kernel = _kernel(first, "decode")
    second = ArtifactStore(tmp_path, KEY_A)
    second.open()
    assert second.status == "resumed" and kernel.exists()
    _kernel(second, "prefill")
    first.close()
    second.close()
    listed = json.loads((first.directory / MANIFEST).read_text())["files"]
    assert sorted(listed) == ["decode/kernel.cubin", "prefill/kernel.cubin"]
    assert not [p for p in first.directory.iterdir() if p.name.endswith(".tmp")]


def test_a_corrupt_store_is_set_aside_and_compiled_anew(tmp_path: Path) -> None:
    a = ArtifactStore(tmp_path, KEY_A)
    a.open()
    _kernel(a, "decode").write_bytes(b"binary")
    a.close()
    b = ArtifactStore(tmp_path, KEY_B)
    b.open()
    other = _kernel(b, "prefill")
    b.close()
    _kernel(a, "decode", b"truncat")  # a file that no longer matches its checksum
    again = ArtifactStore(tmp_path, KEY_A)
    again.open()
    assert again.status == "replaced"
    assert not (again.kernels / "decode").exists() and again.kernels.is_dir()
    assert other.read_bytes() == b"binary"  # the other configuration's store is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.directory.name, b.directory.name])
    (a.directory / MANIFEST).write_text("{not json")
    unreadable = ArtifactStore(tmp_path, KEY_A)
    unreadable.open()
    assert unreadable.status == "replaced"


def test_checksums_leave_out_triton_temporary_folders(tmp_path: Path) -> None:
    (tmp_path / "k1").mkdir()
    (tmp_path / "k1" / "a.cubin").write_bytes(b"x")
    (tmp_path / "tmp.pid_12_abc").mkdir()
    (tmp_path / "tmp.pid_12_abc" / "half.cubin").write_bytes(b"y")
    assert list(_checksums(tmp_path)) == ["k1/a.cubin"]


def _start(root: str, index: int) -> None:
    store = ArtifactStore(Path(root), KEY_A)
    store.open()
    for kernel in range(20):
        # Triton writes a kernel into a temporary folder and renames it into place.
        tmp = store.kernels / f"tmp.pid_{os.getpid()}_{kernel}"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "kernel.cubin").write_bytes(b"k" * 1000)
        final = store.kernels / f"kernel{kernel}"
        try:
            os.rename(tmp, final)
        except OSError:  # another process put the same kernel there first
            (tmp / "kernel.cubin").unlink()
            tmp.rmdir()
    store.close()


def test_processes_starting_at_once_leave_one_whole_store(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_start, args=(str(tmp_path), i)) for i in range(4)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0, 0, 0, 0]
    store = ArtifactStore(tmp_path, KEY_A)
    store.open()
    assert store.status == "reused"
    assert len(json.loads((store.directory / MANIFEST).read_text())["files"]) == 20
