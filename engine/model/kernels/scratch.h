// Per-thread buffers that outlive a kernel call, one per slot of an enum (ending in kCount), each grown to the
// largest size asked and reused, 64-byte aligned. Why: fresh ones cost a prefill chunk a page fault per 4 KB every
// call (glibc maps allocations over 128 KB anew, and the kernel zeroes the pages): 6 % of a 512-token chunk's
// attention. Used by causal_attention.cpp and attention_bf16.cpp.
#pragma once

#include <cstdint>
#include <vector>

namespace {

template <typename T, typename Slot>
T* scratch(Slot slot, int64_t count) {
  thread_local std::vector<char> buffers[static_cast<int>(Slot::kCount)];
  std::vector<char>& buffer = buffers[static_cast<int>(slot)];
  const size_t bytes = count * sizeof(T) + 64;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
}

}  // namespace
