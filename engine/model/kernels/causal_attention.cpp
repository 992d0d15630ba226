// Causal attention of one sequence's prefill chunk on the CPU, fp32, GQA: out[n, Hq, D] for queries at positions
// start..start+n-1 against keys and values 0..start+n-1 (the chunk's own, written to the cache before the call,
// and any cached prefix).
//
// Why our own: torch's CPU flash attention reached about 190 GFLOP/s on a 1.5k-token prefill (half the GEMM
// peak), and with a cached prefix the chunk's mask is a tensor it cannot skip blocks with. This kernel is the
// tiled linear's pattern twice. S = Q.K^T with each KV head's keys transposed once per call, so the query heads
// that share them stream the same key tiles; then P.V with V's rows as the k-major tiles. Between them an exact
// softmax over each row's whole key range (the row fits in L2 up to tens of thousands of keys), with a vectorised
// exp.
//
// A query's output depends only on its own q and keys 0..its position, computed in a fixed order from key 0:
// scores in d order, the max exact, the denominator in 16 fixed lanes, the output in key order (keys past the
// position add exact zeros). So a prefix-cache hit gives the same bits as a miss, a prompt gives the same bits
// whatever its chunking, and the AVX-512 and AVX2 variants agree bit for bit.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Args {
  const float* q;        // [n, Hq, D] rows q_row_stride apart, heads contiguous
  const float* kt;       // [Hkv, D, keys_padded]: the keys transposed, zero past the last
  const float* v;        // [Hkv, keys, D] with the strides below
  float* out;            // [n, Hq, D]
  int64_t n, start, group, head_dim, block_positions, keys_padded;
  int64_t q_row_stride, kv_head_stride, kv_row_stride, out_row_stride;
  float scale;
};

#define SIE_BODY "causal_attention_body.h"
#include "isa_variants.h"
#undef SIE_BODY

constexpr int64_t kBlockRows = 48;  // query rows (position x head of the group) per work item

// q [n, Hq, D] (head and feature strides contiguous; D a multiple of 64, the output blocks' width), k and v
// [Hkv, >= start+n, D] (feature stride 1) -> [n, Hq, D].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                            double scale, bool avx2) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "causal_attention: q [n, Hq, D], k/v [Hkv, L, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "causal_attention: fp32 only");
  const int64_t n = q.size(0), hq = q.size(1), D = q.size(2), hkv = k.size(0), keys = start + n;
  TORCH_CHECK(D % 64 == 0 && k.size(2) == D && v.size(2) == D, "causal_attention: head_dim a multiple of 64");
  TORCH_CHECK(hq % hkv == 0 && v.size(0) == hkv, "causal_attention: query heads a multiple of KV heads");
  TORCH_CHECK(start >= 0 && k.size(1) >= keys && v.size(1) >= keys, "causal_attention: keys 0..start+n needed");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.stride(1) == v.stride(1) && k.stride(0) == v.stride(0),
              "causal_attention: rows of contiguous heads; k and v with the same strides");
  at::Tensor out = at::empty({n, hq, D}, q.options());
  if (n == 0) return out;
  const int64_t keys_padded = round_up(keys, 64);
  // each KV head's keys transposed once, [Hkv, D, keys_padded], zero past the last key
  at::Tensor kt = at::zeros({hkv, D, keys_padded}, q.options());
  const float* kp = k.data_ptr<float>();
  float* ktp = kt.data_ptr<float>();
  at::parallel_for(0, hkv * D, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* src = kp + (i / D) * k.stride(0) + i % D;
      float* dst = ktp + i * keys_padded;
      for (int64_t key = 0; key < keys; ++key) dst[key] = src[key * k.stride(1)];
    }
  });
  const int64_t group = hq / hkv;
  Args a{q.data_ptr<float>(), ktp, v.data_ptr<float>(), out.data_ptr<float>(), n, start, group, D,
         std::max<int64_t>(1, kBlockRows / group), keys_padded, q.stride(0), k.stride(0), k.stride(1), hq * D,
         static_cast<float>(scale)};
  const int64_t blocks = (n + a.block_positions - 1) / a.block_positions;
  const bool wide = has_avx512() && !avx2;
  // Work items alternate the cheapest and the dearest query blocks (causal: cost grows with position), so the
  // contiguous ranges parallel_for hands each thread carry about the same work.
  at::parallel_for(0, hkv * blocks, 1, [&](int64_t lo, int64_t hi) {
    const int64_t rows = round_up(a.block_positions * group, 24);  // a multiple of every variant's RB
    std::vector<float> qs(rows * D), s(rows * keys_padded), os(rows * D);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t g = w % hkv, j = w / hkv;
      const int64_t qb = j % 2 == 0 ? j / 2 : blocks - 1 - j / 2;
      if (wide)
        avx512::attend_block<6, 4, 4>(a, g, qb, qs.data(), s.data(), os.data());
      else
        avx2::attend_block<2, 2, 2>(a, g, qb, qs.data(), s.data(), os.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, int start, float scale, bool avx2=False) -> Tensor");
  m.impl("causal_attention", c10::DispatchKey::CPU, TORCH_FN(causal_attention));
}
