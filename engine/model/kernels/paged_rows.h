// A sequence's rows in a layer's paged KV pool, and the checks both attention sources make on pools and block
// tables (causal_attention.cpp, attention_bf16.cpp). Included inside each source's anonymous namespace.
//
// A pool holds fp32, bf16 or int8 (the profile's kv_cache_dtype), the same layout each way. bf16 rows are stored as
// their raw 16 bits (uint16_t): the kernels widen them to fp32 in registers as they read them (exact), and a value
// written by a kernel is rounded the way torch's `.to(torch.bfloat16)` rounds it (nearest even), so a position
// holds the same bits whether a prefill chunk (through torch) or a decode step (here) wrote it. int8 rows come with a
// scale per position and KV head (PagedScales), quantized the way KVCache.write quantizes.
#pragma once

#include <c10/util/BFloat16.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// One sequence's keys (or values) of one KV head in a layer's pool: position p is row p % block of pool block
// table[p / block]; rows pos_stride elements apart within a block, blocks block_stride apart in the pool.
template <class T>
struct PagedRowsOf {
  T* base;               // the pool at the head's row 0 of block 0
  const int64_t* table;  // the sequence's block table
  int64_t block, block_stride, pos_stride;

  T* row(int64_t p) const { return base + table[p / block] * block_stride + p % block * pos_stride; }
  PagedRowsOf head(int64_t offset) const { return {base + offset, table, block, block_stride, pos_stride}; }
  // How many rows from p on (at most `most`) lie pos_stride apart: to the end of p's block, and on through the
  // blocks that the table happens to place right behind it in memory.
  int64_t contiguous(int64_t p, int64_t most) const {
    int64_t n = std::min(most, block - p % block);
    while (n < most && row(p + n) == row(p + n - 1) + pos_stride) n = std::min(most, n + block);
    return n;
  }
};
using PagedRows = PagedRowsOf<float>;

// The scales of an int8 pool: one fp32 per position and KV head, [num_blocks, Hkv, B], laid out as the pool's rows
// (position p's at row p % block of block table[p / block], consecutive positions of a block adjacent).
struct PagedScales {
  float* base;           // the scale pool at the head's position 0 of block 0
  const int64_t* table;
  int64_t block, block_stride;

  float* at(int64_t p) const { return base + table[p / block] * block_stride + p % block; }
  // positions 0..keys-1 into dst, zeros on to padded
  void gather(int64_t keys, int64_t padded, float* dst) const {
    for (int64_t p = 0; p < keys; ++p) dst[p] = *at(p);
    std::fill(dst + keys, dst + padded, 0.0f);
  }
};

// A KV element as fp32 (bf16: its 16 bits are fp32's high half, so widening is exact; int8: its integer)
inline float kv_float(float x) { return x; }
inline float kv_float(int8_t x) { return static_cast<float>(x); }
inline float kv_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// An fp32 value as a pool element: itself, or bf16 rounded as torch rounds it
inline void kv_store(float x, float* dst) { *dst = x; }
inline void kv_store(float x, uint16_t* dst) { *dst = c10::BFloat16(x).x; }

// A row of D fp32 values into a pool row, and back
inline void kv_write_row(const float* src, int64_t D, float* dst) { std::copy_n(src, D, dst); }
inline void kv_write_row(const float* src, int64_t D, uint16_t* dst) {
  for (int64_t d = 0; d < D; ++d) kv_store(src[d], dst + d);
}
// A row of D fp32 values as int8 and its scale: absmax / 127, each value divided by it and rounded to nearest even,
// the same operations in the same order as KVCache.write's torch quantization, so either write gives the same bits.
// An all-zero row gets scale 0 and zeros.
inline void kv_quantize_row(const float* src, int64_t D, int8_t* dst, float* scale) {
  float top = 0.0f;
  for (int64_t d = 0; d < D; ++d) top = std::max(top, std::fabs(src[d]));
  const float s = top / 127.0f;
  *scale = s;
  for (int64_t d = 0; d < D; ++d)
    dst[d] = s > 0.0f ? static_cast<int8_t>(std::clamp(std::nearbyint(src[d] / s), -127.0f, 127.0f)) : 0;
}
inline void kv_read_row(const float* src, int64_t D, float* dst) { std::copy_n(src, D, dst); }
inline void kv_read_row(const int8_t* src, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = kv_float(src[d]);
}
inline void kv_read_row(const uint16_t* src, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = kv_float(src[d]);
}

// k and v: one layer's pools [num_blocks, Hkv, B, D], both of one dtype, features contiguous, with the same
// sizes and strides (one address computation serves both); B a multiple of 16, so no 16-key group crosses a block.
inline void check_pools(const char* op, const at::Tensor& k, const at::Tensor& v, int64_t D) {
  TORCH_CHECK((k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kChar) &&
                  v.scalar_type() == k.scalar_type() && k.size(3) == D,
              op, ": fp32, bf16 or int8 pools (both alike) of q's head_dim");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides() && k.stride(3) == 1, op,
              ": k and v pools of the same sizes and strides, features contiguous");
  TORCH_CHECK(k.size(2) > 0 && k.size(2) % 16 == 0, op, ": positions a block a multiple of 16, not ", k.size(2));
}

// int8 pools come with their scales: fp32 [num_blocks, Hkv, B], positions adjacent; other pools with none
inline void check_scales(const char* op, const at::Tensor& k, const c10::optional<at::Tensor>& k_scale,
                         const c10::optional<at::Tensor>& v_scale) {
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()) && (int8 || !(k_scale || v_scale)), op,
              ": scales with an int8 pool, and only with one");
  if (!int8) return;
  for (const at::Tensor* t : {&*k_scale, &*v_scale})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == k.size(0) &&
                    t->size(1) == k.size(1) && t->size(2) == k.size(2) && t->stride(2) == 1 &&
                    t->strides() == k_scale->strides(),
                op, ": fp32 scales [num_blocks, Hkv, B] for the int8 pools, positions adjacent");
}

// A pool's elements as T (fp32, bf16's raw bits or int8)
template <class T>
inline T* pool_data(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>)
    return t.data_ptr<float>();
  else if constexpr (std::is_same_v<T, int8_t>)
    return t.data_ptr<int8_t>();
  else
    return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Entries 0..used-1 of a block table each name a block of the pool.
inline void check_entries(const char* op, const int64_t* table, int64_t used, int64_t num_blocks) {
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, op, ": block table entry ", j, " is ", table[j],
                ", outside the pool's ", num_blocks, " blocks");
}
