// kvloom's own thread pool for its kernels: parallel loops that never wait for a thread that has not
// started.
//
// at::parallel_for (OpenMP) splits a loop into one static share per thread and ends with a barrier.
// When another process holds one of the cores (the HTTP server, a tokenizer, a build), the share of
// a descheduled thread waits for the scheduler to run it again, and every parallel region of a step
// pays that wait: measured on the 2-core box with one busy process beside, a decode step's GEMMs
// took 2-9x longer on two OpenMP threads than on one.
//
// Here a loop is cut into chunks that the calling thread and the pool's workers claim one at a time
// from a shared counter. The caller works from the first chunk on and returns when every chunk is
// done; a worker that is asleep or descheduled simply claims nothing, so the caller waits only for
// chunks already running elsewhere, never for a thread that is not there. On a quiet machine the
// workers are already spinning and the loop splits as OpenMP's would.
//
//     kvloom::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { ... });
//     kvloom::parallel_chunks(items, [&](int64_t item) { ... });  // one chunk each, in order claimed
//
// The pool has at::get_num_threads() - 1 workers (so torch.set_num_threads applies); a nested call, a
// call while another thread holds the pool, or a single-thread setting runs inline.
//
// It is off by default (KVLOOM_CPU_THREAD_POOL=1 turns it on, through the op kvloom::use_thread_pool):
// on a quiet box a decode step measured 5-15% slower on it than on OpenMP, for reasons not yet found
// (the GEMMs alone, on hot weights, are as fast). Off, the same calls run on torch's OpenMP threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace kvloom {

// Runs fn(ctx, c) for every c in [0, num_chunks), spread over the pool; returns when all are done.
// An exception thrown by a chunk is rethrown here (the first one; the others are dropped).
void run_chunks(int64_t num_chunks, void (*fn)(void*, int64_t), void* ctx);

// The threads a loop may use: the caller plus the workers (or torch's OpenMP threads).
int pool_threads();

// Whether loops run on the pool (true) or on OpenMP.
bool pool_enabled();

// Most chunks a loop is cut into per thread: enough to even out a descheduled or slower thread.
constexpr int64_t kChunksPerThread = 4;

template <class F>
void parallel_chunks(int64_t num_chunks, const F& f) {
  if (num_chunks <= 0) return;
  if (!pool_enabled()) {
    const int threads = static_cast<int>(std::min<int64_t>(pool_threads(), num_chunks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t c = 0; c < num_chunks; ++c) f(c);
    return;
  }
  run_chunks(num_chunks, [](void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); },
             const_cast<void*>(static_cast<const void*>(&f)));
}

// at::parallel_for's contract: f(b, e) over disjoint ranges covering [begin, end), each at least
// `grain` long, all of it inline when the range is shorter than two grains.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  if (!pool_enabled()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  grain = std::max<int64_t>(grain, 1);
  const int threads = pool_threads();
  if (threads <= 1 || n < 2 * grain) {
    f(begin, end);
    return;
  }
  // Near-equal chunks (the first n % num_chunks one longer), claimed longest first, so that two
  // threads of equal speed end within one chunk of each other.
  const int64_t num_chunks = std::min<int64_t>(n / grain, threads * kChunksPerThread);
  const int64_t base = n / num_chunks, longer = n % num_chunks;
  parallel_chunks(num_chunks, [&](int64_t c) {
    const int64_t b = begin + c * base + std::min(c, longer);
    f(b, b + base + (c < longer ? 1 : 0));
  });
}

}  // namespace kvloom
