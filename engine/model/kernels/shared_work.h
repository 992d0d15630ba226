// Work items handed out from a shared counter instead of in fixed halves. Why: on a busy box (the served stack puts
// the gateway, Triton and the client on the same cores) the OS preempts one of the forward's threads now and
// then; with at::parallel_for's static split the other thread finishes its half and waits at the barrier, so the
// whole region pays for the preemption. Here a running thread takes the items the preempted one has not started.
// Which thread computes an item never changes its bits (each item is computed alone).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace {

// f(lo, hi) over [0, n), by every thread of the pool that is free, in chunks of about an eighth of a thread's
// share: contiguous enough for the hardware prefetchers' streams, small enough to even out a preemption.
template <typename F>
void shared_for(int64_t n, const F& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, n / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, (n + chunk - 1) / chunk), 1, [&](int64_t, int64_t) {
    for (int64_t lo; (lo = next.fetch_add(chunk, std::memory_order_relaxed)) < n;) f(lo, std::min(n, lo + chunk));
  });
}

}  // namespace
