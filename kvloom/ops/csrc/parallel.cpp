// kvloom's thread pool (parallel.h says why and how it is used).
//
// One 64-bit word holds a loop's whole claimable state: [generation:24][next chunk:20][chunks:20].
// The caller publishes a loop by storing a new generation with next = 0; a thread claims chunk
// `next` by a compare-and-swap that bumps it. Because the generation and the chunk count are in the
// same word, a claim can only succeed for the loop that is current and not yet fully claimed, so a
// worker that wakes up late, holding an old generation, can never run a chunk of a loop that has
// ended (or of the next one with the old one's function). The caller returns once `done` reaches the
// chunk count, i.e. it waits for chunks that have been claimed, never for threads.
#include "cpu_capability.h"

#include "parallel.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVLOOM_PAUSE() _mm_pause()
#else
#define KVLOOM_PAUSE() std::this_thread::yield()
#endif

namespace kvloom {
namespace {

constexpr int kChunkBits = 20;
constexpr uint64_t kChunkMask = (uint64_t{1} << kChunkBits) - 1;
constexpr int64_t kMaxChunks = static_cast<int64_t>(kChunkMask);  // a longer loop runs in rounds
constexpr uint64_t kNextOne = uint64_t{1} << kChunkBits;
constexpr int kGenerationShift = 2 * kChunkBits;
// A worker spins this long for the next loop before it sleeps: the gaps between a step's kernels
// are microseconds; between steps (Python) milliseconds, where a sleeping worker costs nothing.
constexpr auto kSpin = std::chrono::microseconds(200);
// The caller waiting for a chunk that another thread runs yields after this many pauses, so that
// a descheduled worker can get the caller's core.
constexpr int kPausesBeforeYield = 2048;

inline uint32_t generation_of(uint64_t s) { return static_cast<uint32_t>(s >> kGenerationShift); }
inline int64_t next_of(uint64_t s) { return static_cast<int64_t>((s >> kChunkBits) & kChunkMask); }
inline int64_t chunks_of(uint64_t s) { return static_cast<int64_t>(s & kChunkMask); }

thread_local bool tl_in_pool = false;  // a pool worker, or a caller inside its own loop

class Pool {
 public:
  std::mutex caller;  // one loop at a time; another caller runs its loop inline

  int workers() const { return static_cast<int>(threads_.size()); }

  void resize(int num_workers) {
    if (num_workers == workers()) return;
    stop_workers();
    stop_ = false;
    for (int i = 0; i < num_workers; ++i) threads_.emplace_back([this] { worker_loop(); });
  }

  void run(int64_t num_chunks, void (*fn)(void*, int64_t), void* ctx) {
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    failed_.store(false, std::memory_order_relaxed);
    error_ = nullptr;
    const uint32_t generation = generation_of(state_.load(std::memory_order_relaxed)) + 1;
    const uint64_t start = (static_cast<uint64_t>(generation) << kGenerationShift) | static_cast<uint64_t>(num_chunks);
    state_.store(start, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    claim_and_run(start);
    for (int pauses = 0; done_.load(std::memory_order_acquire) < num_chunks;) {
      if (++pauses < kPausesBeforeYield) {
        KVLOOM_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::vector<std::thread> threads_;
  // The claimed word and the done count on lines of their own: every chunk writes both.
  alignas(64) std::atomic<uint64_t> state_{0};
  std::atomic<void (*)(void*, int64_t)> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<bool> failed_{false};
  std::exception_ptr error_;  // written by the one thread that set failed_, read after done_
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;

  // Claims and runs chunks of the loop `s` belongs to until none is left or the loop is gone.
  void claim_and_run(uint64_t s) {
    // Read after the acquire load that gave s: at least s's loop's function; a later loop's only
    // if s's has ended, and then no claim below can succeed.
    auto* fn = fn_.load(std::memory_order_relaxed);
    void* ctx = ctx_.load(std::memory_order_relaxed);
    const uint32_t generation = generation_of(s);
    while (generation_of(s) == generation && next_of(s) < chunks_of(s)) {
      if (!state_.compare_exchange_weak(s, s + kNextOne, std::memory_order_acq_rel, std::memory_order_acquire)) {
        continue;  // s now holds the current word
      }
      try {
        fn(ctx, next_of(s));
      } catch (...) {
        if (!failed_.exchange(true)) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
      s = state_.load(std::memory_order_acquire);
    }
  }

  void worker_loop() {
    tl_in_pool = true;
    uint32_t seen = generation_of(state_.load(std::memory_order_acquire));
    while (true) {
      uint64_t s = wait_for_loop(seen);
      if (stop_.load(std::memory_order_acquire)) return;
      seen = generation_of(s);
      claim_and_run(s);
    }
  }

  // The state word once its generation differs from `seen` (or the pool stops): spinning first,
  // then asleep until the caller's notify.
  uint64_t wait_for_loop(uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int pauses = 1;; ++pauses) {
      const uint64_t s = state_.load(std::memory_order_acquire);
      if (generation_of(s) != seen || stop_.load(std::memory_order_relaxed)) return s;
      KVLOOM_PAUSE();
      if (pauses % 256 == 0 && std::chrono::steady_clock::now() > until) break;
    }
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    wake_.wait(lock, [&] {
      return generation_of(state_.load(std::memory_order_seq_cst)) != seen || stop_.load(std::memory_order_seq_cst);
    });
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    return state_.load(std::memory_order_acquire);
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stop_.store(true, std::memory_order_seq_cst);
      wake_.notify_all();
    }
    for (auto& t : threads_) t.join();
    threads_.clear();
  }
};

// Never destroyed: workers may still be asleep in it at exit. A forked child gets a new one (the
// parent's workers do not exist there), leaking the copy it inherited.
Pool* g_pool = nullptr;
std::once_flag g_atfork;

Pool& pool() {
  std::call_once(g_atfork, [] { pthread_atfork(nullptr, nullptr, [] { g_pool = nullptr; }); });
  if (g_pool == nullptr) g_pool = new Pool();
  return *g_pool;
}

std::atomic<bool> g_enabled{false};

void use_thread_pool(bool enable) { g_enabled.store(enable, std::memory_order_relaxed); }

}  // namespace

bool pool_enabled() { return g_enabled.load(std::memory_order_relaxed); }

int pool_threads() { return tl_in_pool ? 1 : std::max(1, at::get_num_threads()); }

void run_chunks(int64_t num_chunks, void (*fn)(void*, int64_t), void* ctx) {
  const int threads = pool_threads();
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.caller, std::try_to_lock);
  if (threads <= 1 || num_chunks <= 1 || !lock.owns_lock()) {
    for (int64_t c = 0; c < num_chunks; ++c) fn(ctx, c);
    return;
  }
  p.resize(threads - 1);
  struct InPool {  // a loop inside one of our chunks runs inline; reset however this call ends
    InPool() { tl_in_pool = true; }
    ~InPool() { tl_in_pool = false; }
  } in_pool;
  // A loop of more chunks than the state word counts runs in rounds (none does today: parallel_for
  // cuts at most threads * kChunksPerThread, attention one per request and head group).
  for (int64_t first = 0; first < num_chunks; first += kMaxChunks) {
    struct Offset {
      void (*fn)(void*, int64_t);
      void* ctx;
      int64_t first;
    } offset{fn, ctx, first};
    p.run(std::min(kMaxChunks, num_chunks - first),
          [](void* o, int64_t c) {
            auto* off = static_cast<Offset*>(o);
            off->fn(off->ctx, off->first + c);
          },
          &offset);
  }
}

}  // namespace kvloom

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("use_thread_pool(bool enable) -> ()", &kvloom::use_thread_pool);
}
