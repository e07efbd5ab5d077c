"""Memory read bandwidth: a streaming read over a buffer far larger than the last-level cache.

    python -m kvloom.bench.membw --threads 1,2 --size-mib 1024   # kvloom bench realsize calls it too

Each of T threads sums its own contiguous 1/T of a ``--size-mib`` buffer of 64-bit words (the compiler
vectorizes the loop to full-width loads; the sum is kept so the reads cannot be dropped), ``--repeats``
times; the figure is the best pass, in GB/s (10^9 bytes). The buffer is on transparent huge pages where
Linux offers them (``madvise``), as kvloom's packed weights and KV cache are. The loop is C, compiled once
with the system C compiler (``cc -O3 -march=native``) into ``KVLOOM_CACHE_DIR/extensions/membw-<hash>.so``
and called through ctypes, so nothing of torch's is in the way. The buffer is written once before timing (its pages
are faulted in) and the threads start together at a barrier.

This is the bound of decode at small batch: a step that reads B bytes of weights and KV cache cannot run
faster than B / bandwidth.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE ((size_t)2 << 20)

typedef struct { const uint64_t *p; size_t n; int repeats; pthread_barrier_t *bar; double *best; uint64_t sink; } job_t;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static uint64_t sum_words(const uint64_t *p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    for (; i < n; i++) a0 += p[i];
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (int r = 0; r < j->repeats; r++) {
        pthread_barrier_wait(j->bar);
        double t = now();
        j->sink += sum_words(j->p, j->n);
        pthread_barrier_wait(j->bar);
        double dt = now() - t;
        if (dt < j->best[r]) j->best[r] = dt;
    }
    return 0;
}

/* Seconds of each pass (the slowest thread's) over n_words 64-bit words, read by threads in parallel. */
int membw_read(size_t n_words, int threads, int repeats, double *seconds) {
    /* On 2 MiB pages where Linux offers them (as kvloom's weights and KV cache are, ops/huge_pages.py): on 4 KiB
       pages a stream is slowed by TLB misses and prefetchers stopping at every page, and the bound would be the
       pages', not the memory's. */
    size_t bytes = (n_words * 8 + HUGE - 1) / HUGE * HUGE;
    uint64_t *buf = (uint64_t *)aligned_alloc(HUGE, bytes);
    if (!buf) return -1;
#ifdef MADV_HUGEPAGE
    madvise(buf, bytes, MADV_HUGEPAGE);
#endif
    for (size_t i = 0; i < n_words; i++) buf[i] = i;
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, 0, threads);
    pthread_t tid[256];
    job_t jobs[256];
    double *times = (double *)calloc((size_t)threads * repeats, sizeof(double));
    size_t per = n_words / threads;
    for (int t = 0; t < threads; t++) {
        for (int r = 0; r < repeats; r++) times[t * repeats + r] = 1e30;
        jobs[t] = (job_t){buf + t * per, per, repeats, &bar, times + t * repeats, 0};
        pthread_create(&tid[t], 0, worker, &jobs[t]);
    }
    uint64_t sink = 0;
    for (int t = 0; t < threads; t++) { pthread_join(tid[t], 0); sink += jobs[t].sink; }
    for (int r = 0; r < repeats; r++) {
        double worst = 0;
        for (int t = 0; t < threads; t++) if (times[t * repeats + r] > worst) worst = times[t * repeats + r];
        seconds[r] = worst;
    }
    pthread_barrier_destroy(&bar);
    free(times);
    free(buf);
    return (int)(sink & 1) * 0;  /* the sums are used: the reads stay */
}
"""

MAX_THREADS = 256


def _library() -> ctypes.CDLL:
    """The probe compiled once for this CPU (cached by source hash); RuntimeError when no C compiler."""
    from kvloom import envs

    key = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    out_dir = envs.cache_dir() / "extensions"
    path = out_dir / f"membw-{key}.so"
    if not path.is_file():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("the bandwidth probe needs a C compiler (cc or gcc on PATH, or CC)")
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "membw.c"
            source.write_text(_SOURCE)
            built = Path(tmp) / "membw.so"
            subprocess.run([compiler, "-O3", "-march=native", "-shared", "-fPIC", "-pthread", str(source),
                            "-o", str(built)], check=True, capture_output=True)
            os.replace(built, path)
    lib = ctypes.CDLL(str(path))
    lib.membw_read.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    lib.membw_read.restype = ctypes.c_int
    return lib


def read_bandwidth(threads: int, size_mib: int = 1024, repeats: int = 5) -> dict[str, Any]:
    """Best and median read GB/s of ``threads`` threads over a ``size_mib`` MiB buffer."""
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be 1..{MAX_THREADS}, got {threads}")
    if size_mib < 64 or repeats < 1:
        raise ValueError(f"size_mib must be >= 64 (far above the caches) and repeats >= 1, got {size_mib}, "
                         f"{repeats}")
    n_words = size_mib * (1 << 20) // 8 // threads * threads
    seconds = (ctypes.c_double * repeats)()
    if _library().membw_read(n_words, threads, repeats, seconds) != 0:
        raise MemoryError(f"could not allocate {size_mib} MiB for the bandwidth probe")
    rates = sorted(n_words * 8 / s / 1e9 for s in seconds)
    return {"threads": threads, "size_mib": size_mib, "best_gb_s": rates[-1],
            "median_gb_s": rates[len(rates) // 2], "passes_gb_s": rates}


def build_parser(prog: str = "python -m kvloom.bench.membw") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def parse_threads(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--threads must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--threads must be positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for threads in parse_threads(args.threads):
        r = read_bandwidth(threads, args.size_mib, args.repeats)
        print(f"read bandwidth, {threads} thread(s), {args.size_mib} MiB: best {r['best_gb_s']:.1f} GB/s, "
              f"median {r['median_gb_s']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
