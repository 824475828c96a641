// The kernels' one way onto XLA's intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jmoe {

// Runs fn(0) .. fn(n - 1) on the caller and the pool's other threads; returns when all are done.
// Workers that start late find no work left and return, so the caller never waits on a worker
// that has not started (the shared state outlives the call).
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, const std::function<void(int64_t)>& fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t n;
    std::function<void(int64_t)> fn;
  };
  auto state = std::make_shared<State>();
  state->n = n;
  state->fn = fn;
  auto work = [](State& s) {
    for (int64_t i; (i = s.next.fetch_add(1)) < s.n;) {
      s.fn(i);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state, work] { work(*state); });
  work(*state);
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jmoe
