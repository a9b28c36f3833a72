// Work split of the engine's kernels: chunks claimed by the threads as they come, not a fixed share each.
//
// at::parallel_for gives each thread one fixed share, so an operator lasts as long as its slowest thread. On a
// machine the engine shares with other processes (router, clients, another worker), the OS preempts one of the
// two threads for a neighbour's burst of work now and then, and the other thread then waits at the end of the
// operator for as long as the neighbour ran. With chunks claimed from a shared counter, the thread that keeps
// running takes the chunks the preempted one would have done. Every index is still computed exactly once, by
// the same code, so results do not change.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pdserve {

// f(begin, end) over [0, n) in chunks of `chunk` indices (the last may be shorter).
template <typename F>
void parallel_claim(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {  // one task a thread; each claims until none is left
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      f(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// Chunk size for n items of `work` (multiply-adds) each: about 2^20 multiply-adds (tens of microseconds) a
// chunk, and at least 8 chunks when there are 8 items.
inline int64_t claim_chunk(int64_t n, int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>((int64_t{1} << 20) / std::max<int64_t>(1, work), n / 8));
}

}  // namespace pdserve
