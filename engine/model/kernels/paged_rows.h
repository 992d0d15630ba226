// A sequence's rows in a layer's paged KV pool, and the checks both attention sources make on pools and block
// tables (causal_attention.cpp, attention_bf16.cpp). Included inside each source's anonymous namespace.
#pragma once

#include <torch/types.h>

#include <algorithm>

// One sequence's keys (or values) of one KV head in a layer's pool: position p is row p % block of pool block
// table[p / block]; rows pos_stride floats apart within a block, blocks block_stride apart in the pool.
struct PagedRows {
  float* base;           // the pool at the head's row 0 of block 0
  const int64_t* table;  // the sequence's block table
  int64_t block, block_stride, pos_stride;

  float* row(int64_t p) const { return base + table[p / block] * block_stride + p % block * pos_stride; }
  PagedRows head(int64_t offset) const { return {base + offset, table, block, block_stride, pos_stride}; }
  // How many rows from p on (at most `most`) lie pos_stride apart: to the end of p's block, and on through the
  // blocks that the table happens to place right behind it in memory.
  int64_t contiguous(int64_t p, int64_t most) const {
    int64_t n = std::min(most, block - p % block);
    while (n < most && row(p + n) == row(p + n - 1) + pos_stride) n = std::min(most, n + block);
    return n;
  }
};

// k and v: one layer's pools [num_blocks, Hkv, B, D] of fp32, features contiguous, with the same sizes and strides
// (one address computation serves both); B a multiple of 16, so no 16-key group crosses a block.
inline void check_pools(const char* op, const at::Tensor& k, const at::Tensor& v, int64_t D) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.size(3) == D, op,
              ": fp32 pools of q's head_dim");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides() && k.stride(3) == 1, op,
              ": k and v pools of the same sizes and strides, features contiguous");
  TORCH_CHECK(k.size(2) > 0 && k.size(2) % 16 == 0, op, ": positions a block a multiple of 16, not ", k.size(2));
}

// Entries 0..used-1 of a block table each name a block of the pool.
inline void check_entries(const char* op, const int64_t* table, int64_t used, int64_t num_blocks) {
  for (int64_t j = 0; j < used; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, op, ": block table entry ", j, " is ", table[j],
                ", outside the pool's ", num_blocks, " blocks");
}
