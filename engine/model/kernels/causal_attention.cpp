// Causal attention on the CPU, fp32, GQA, over a layer's paged KV cache: one pool of fixed-size blocks
// [num_blocks, Hkv, B, D] (B positions a block, a multiple of 16) for every sequence, a sequence's positions
// j*B..j*B+B-1 in the pool block that entry j of its block table names. Our two shapes of call:
// - causal_attention: one sequence's prefill chunk, out[n, Hq, D] for queries at positions start..start+n-1
//   against keys and values 0..start+n-1 (the chunk's own, written to the pool before the call, and any cached
//   prefix), read through the sequence's block table;
// - decode_attention: one decode step, a query per row at the row's own position, which first writes the row's
//   new key and value into its block through the row's table.
//
// Why our own: torch's CPU flash attention reached about 190 GFLOP/s on a 1.5k-token prefill (half the GEMM
// peak), and with a cached prefix the chunk's mask is a tensor it cannot skip blocks with; in decode, SDPA plus the
// cache write by advanced indexing cost 0.7 ms a layer at 16 rows of 330 keys. The prefill kernel is the tiled
// linear's pattern twice. S = Q.K^T with each KV head's keys transposed once per call, so the query heads that
// share them stream the same key tiles; then P.V with V's rows as the k-major tiles. Between them an exact softmax
// over each row's whole key range (the row fits in L2 up to tens of thousands of keys), with a vectorised exp.
// Decode transposes 64-key tiles on the fly and runs the same blocks.
//
// The pools hold fp32 or bf16 (the profile's kv_cache_dtype: half the bytes a token, and half the K/V reads that
// pace a long decode). A bf16 key or value is widened to fp32 as it is loaded (in registers, exact) and everything
// after that is the fp32 kernel's math, so bf16 K/V give the bits fp32 K/V holding the same rounded values give.
// int8 pools (about a quarter of fp32's bytes) come with a scale per position and KV head: their integers are
// widened the same way, and each key's scale multiplies its scores, each value's scale its probabilities (before
// P.V; the softmax's denominator is the unscaled exps'), one product per key and row, the same in prefill and decode.
//
// A query's output depends only on its own q and keys 0..its position, computed in a fixed order from key 0:
// scores in d order, the max exact, the denominator in 16 fixed lanes, the output in key order (keys past the
// position add exact zeros). So a prefix-cache hit gives the same bits as a miss, a prompt gives the same bits
// whatever its chunking or batch, a decode step gives the bits a prefill would, and the AVX-512 and AVX2 variants
// agree bit for bit. Where the blocks lie changes no bit either: a 16-key group the kernels transpose never crosses
// a block (B is a multiple of 16), and P.V walks V in spans that end where the next row does not follow in memory,
// each output's chain resuming exactly where the span before left it.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "paged_rows.h"
#include "scratch.h"
#include "shared_work.h"

namespace {

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr int64_t kValueKeys = 128;  // rows of V per span of the prefill's P.V (attend_block), at most

// T: the pools' element, fp32 or bf16's bits (paged_rows.h)
template <class T>
struct Args {
  const float* q;        // [n, Hq, D] rows q_row_stride apart, heads contiguous
  const float* kt;       // [Hkv, keys_padded / 64, D, 64]: the keys transposed in blocks of 64, zero past the last
  PagedRowsOf<T> v;      // the sequence's values of KV head 0; head g kv_head_stride elements on
  const float* k_scales;  // int8 pools: the keys' and values' scales gathered, [Hkv, keys_padded] (else null)
  const float* v_scales;
  float* out;            // [n, Hq, D]
  int64_t n, start, group, head_dim, block_positions, keys_padded;
  int64_t q_row_stride, kv_head_stride, out_row_stride;
  float scale;
};

template <class T>
struct DecodeArgs {
  const float* q;        // [rows, Hq, D]: one query row per sequence
  const float* k_new;    // [rows, Hkv, D]: each row's new key and value, written at its position first
  const float* v_new;
  T* k_cache;            // the layer's pools [num_blocks, Hkv, B, D], the strides below for both
  T* v_cache;
  float* k_scales;       // int8 pools: their scales [num_blocks, Hkv, B], the strides below for both (else null)
  float* v_scales;
  int64_t scale_block_stride, scale_head_stride;
  const int64_t* tables;     // row b's block table at tables + b * table_stride
  const int64_t* positions;  // [rows]
  float* out;            // [rows, Hq, D]
  int64_t group, head_dim;
  int64_t q_row_stride, k_row_stride, v_row_stride, table_stride, block, block_stride, head_stride, pos_stride,
      out_row_stride;
  float scale;

  // row b's keys or values of KV head g in `pool` (k_cache or v_cache)
  PagedRowsOf<T> rows(T* pool, int64_t b, int64_t g) const {
    return {pool + g * head_stride, tables + b * table_stride, block, block_stride, pos_stride};
  }
  PagedScales scales(float* pool, int64_t b, int64_t g) const {
    return {pool + g * scale_head_stride, tables + b * table_stride, block, scale_block_stride};
  }
};

#define SIE_BODY "causal_attention_body.h"
#include "isa_variants.h"
#undef SIE_BODY

constexpr int64_t kBlockRows = 48;  // query rows (position x head of the group) per work item

// Per-thread scratch (scratch.h): the caller's thread holds the transposed keys, every worker (the caller among
// them) its own query, score and output blocks.
enum class Scratch { kKeys, kQueries, kScores, kOutputs, kScales, kCount };

// Each KV head's keys 0..keys-1 transposed once, in blocks of 64 keys: kt [Hkv, keys_padded / 64, D, 64], zero past
// the last key; 16 x 16 blocks in registers, each 16-key group read from its one pool block (bf16 widened as it
// is read).
template <class T>
void transpose_keys(const PagedRowsOf<T>& k, int64_t head_stride, int64_t hkv, int64_t keys, int64_t keys_padded,
                    int64_t D, bool wide, float* kt) {
  const int64_t key_blocks = keys_padded / 64, ld = k.pos_stride;
  at::parallel_for(0, hkv * key_blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const PagedRowsOf<T> head = k.head(i / key_blocks * head_stride);
      const int64_t first = i % key_blocks * 64, valid = std::min<int64_t>(64, keys - first);
      float* dst = kt + i * D * 64;  // [D, 64]
      for (int64_t d = 0; d < D; d += 16) {
        int64_t key = 0;
        for (; key + 16 <= valid; key += 16) {
          const T* src = head.row(first + key) + d;
          if (wide)
            avx512::transpose16x16(src, ld, dst + d * 64 + key, 64);
          else
            avx2::transpose16x16(src, ld, dst + d * 64 + key, 64);
        }
        for (int64_t dd = d; dd < d + 16; ++dd) {
          for (int64_t kk = key; kk < valid; ++kk) dst[dd * 64 + kk] = kv_float(head.row(first + kk)[dd]);
          std::fill(dst + dd * 64 + valid, dst + dd * 64 + 64, 0.0f);
        }
      }
    }
  });
}

using Scales = c10::optional<at::Tensor>;  // an int8 pool's, [num_blocks, Hkv, B] (paged_rows.h)

template <class T>
void run_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& entries,
                int64_t start, double scale, bool wide, const Scales& k_scale, const Scales& v_scale,
                at::Tensor& out);
template <class T>
void run_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& tab, const int64_t* pp, int64_t longest, double scale,
                bool wide, const Scales& k_scale, const Scales& v_scale, at::Tensor& out);

// q [n, Hq, D] (head and feature strides contiguous; D a multiple of 64, the output blocks' width), k and v the
// layer's pools [num_blocks, Hkv, B, D] (fp32, bf16, or int8 with their scales), `table` the sequence's block table
// (int64, covering keys 0..start+n-1) -> [n, Hq, D].
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                            int64_t start, double scale, bool avx2, const Scales& k_scale, const Scales& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4,
              "causal_attention: q [n, Hq, D], k/v pools [num_blocks, Hkv, B, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "causal_attention: fp32 only");
  check_pools("causal_attention", k, v, q.size(2));
  check_scales("causal_attention", k, k_scale, v_scale);
  const int64_t n = q.size(0), hq = q.size(1), D = q.size(2), hkv = k.size(1), block = k.size(2), keys = start + n;
  TORCH_CHECK(D % 64 == 0, "causal_attention: head_dim a multiple of 64");
  TORCH_CHECK(hq % hkv == 0, "causal_attention: query heads a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "causal_attention: rows of contiguous heads");
  const int64_t used = (keys + block - 1) / block;
  TORCH_CHECK(start >= 0 && table.scalar_type() == at::kLong && table.dim() == 1 && table.size(0) >= used,
              "causal_attention: an int64 block table covering keys 0..start+n-1");
  const at::Tensor entries = table.contiguous();
  check_entries("causal_attention", entries.data_ptr<int64_t>(), used, k.size(0));
  at::Tensor out = at::empty({n, hq, D}, q.options());
  if (n == 0) return out;
  const bool wide = has_avx512() && !avx2;
  if (k.scalar_type() == at::kBFloat16)
    run_causal<uint16_t>(q, k, v, entries, start, scale, wide, k_scale, v_scale, out);
  else if (k.scalar_type() == at::kChar)
    run_causal<int8_t>(q, k, v, entries, start, scale, wide, k_scale, v_scale, out);
  else
    run_causal<float>(q, k, v, entries, start, scale, wide, k_scale, v_scale, out);
  return out;
}

// causal_attention's work over pools of T, once the arguments are checked
template <class T>
void run_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& entries,
                int64_t start, double scale, bool wide, const Scales& k_scale, const Scales& v_scale,
                at::Tensor& out) {
  const int64_t n = q.size(0), hq = q.size(1), D = q.size(2), hkv = k.size(1), block = k.size(2), keys = start + n;
  const int64_t keys_padded = round_up(keys, 64);
  const PagedRowsOf<T> k_rows{pool_data<T>(k), entries.data_ptr<int64_t>(), block, k.stride(0), k.stride(2)};
  float* ktp = scratch<float>(Scratch::kKeys, hkv * D * keys_padded);
  transpose_keys(k_rows, k.stride(1), hkv, keys, keys_padded, D, wide, ktp);
  const int64_t group = hq / hkv;
  float* scales = nullptr;  // an int8 pool's: every head's keys' then values' scales, gathered once
  if constexpr (std::is_same_v<T, int8_t>) {
    scales = scratch<float>(Scratch::kScales, 2 * hkv * keys_padded);
    for (int64_t g = 0; g < hkv; ++g)
      for (int64_t i = 0; i < 2; ++i) {
        const at::Tensor& pool = i == 0 ? *k_scale : *v_scale;
        const PagedScales rows{pool.data_ptr<float>() + g * pool.stride(1), entries.data_ptr<int64_t>(), block,
                               pool.stride(0)};
        rows.gather(keys, keys_padded, scales + (i * hkv + g) * keys_padded);
      }
  }
  Args<T> a{q.data_ptr<float>(), ktp, {pool_data<T>(v), entries.data_ptr<int64_t>(), block, v.stride(0), v.stride(2)},
            scales, scales ? scales + hkv * keys_padded : nullptr,
            out.data_ptr<float>(), n, start, group, D, std::max<int64_t>(1, kBlockRows / group), keys_padded,
            q.stride(0), v.stride(1), hq * D, static_cast<float>(scale)};
  const int64_t blocks = (n + a.block_positions - 1) / a.block_positions;
  // Work items alternate the cheapest and the dearest query blocks (causal: cost grows with position), so each
  // chunk of them a thread takes carries about the same work.
  shared_for(hkv * blocks, [&](int64_t lo, int64_t hi) {
    const int64_t rows = round_up(a.block_positions * group, 24);  // a multiple of every variant's RB
    float* qs = scratch<float>(Scratch::kQueries, rows * D);
    float* s = scratch<float>(Scratch::kScores, rows * keys_padded);
    float* os = scratch<float>(Scratch::kOutputs, rows * D);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t g = w % hkv, j = w / hkv;
      const int64_t qb = j % 2 == 0 ? j / 2 : blocks - 1 - j / 2;
      if (wide)
        avx512::attend_block<6, 4, 4>(a, g, qb, qs, s, os);
      else
        avx2::attend_block<2, 2, 2>(a, g, qb, qs, s, os);
    }
  });
}

// One decode step's attention for rows 0..rows-1 (row b's query at positions[b]): q [rows, Hq, D], the new k and v
// [rows, Hkv, D] (rows any stride apart, heads contiguous), the layer's pools [num_blocks, Hkv, B, D] (written at
// each row's position through its block table, tables[b], then read over 0..position) -> [rows, Hq, D], the same
// bits causal_attention gives that query. Rows' tables may share the blocks of a common prefix, but the position a
// row writes must be one no other row of the step reads: the rows run in parallel.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& positions,
                            double scale, bool avx2, const Scales& k_scale, const Scales& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "decode_attention: q [rows, Hq, D], k/v [rows, Hkv, D], caches: pools [num_blocks, Hkv, B, D]");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(-1) == 1, "decode_attention: fp32, features contiguous");
  check_pools("decode_attention", k_cache, v_cache, q.size(2));
  check_scales("decode_attention", k_cache, k_scale, v_scale);
  const int64_t b = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_cache.size(1), block = k_cache.size(2);
  TORCH_CHECK(D % 64 == 0, "decode_attention: head_dim a multiple of 64");
  TORCH_CHECK(hq % hkv == 0 && k.size(1) == hkv && v.size(1) == hkv && k.size(0) == b && v.size(0) == b,
              "decode_attention: query heads a multiple of KV heads, one new key and value per row");
  TORCH_CHECK(q.stride(1) == D && k.stride(1) == D && v.stride(1) == D, "decode_attention: heads contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) >= b,
              "decode_attention: int64 block tables [>= rows, max_blocks], one per row");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == b,
              "decode_attention: int64 positions [rows]");
  const at::Tensor tab = tables.stride(1) == 1 ? tables : tables.contiguous();  // rows may lie any stride apart
  const at::Tensor pos = positions.contiguous();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < tab.size(1) * block, "decode_attention: a position outside its block table");
    check_entries("decode_attention", tp + i * tab.stride(0), pp[i] / block + 1, k_cache.size(0));
    longest = std::max(longest, pp[i] + 1);
  }
  at::Tensor out = at::empty({b, hq, D}, q.options());
  if (b == 0) return out;
  const bool wide = has_avx512() && !avx2;
  if (k_cache.scalar_type() == at::kBFloat16)
    run_decode<uint16_t>(q, k, v, k_cache, v_cache, tab, pp, longest, scale, wide, k_scale, v_scale, out);
  else if (k_cache.scalar_type() == at::kChar)
    run_decode<int8_t>(q, k, v, k_cache, v_cache, tab, pp, longest, scale, wide, k_scale, v_scale, out);
  else
    run_decode<float>(q, k, v, k_cache, v_cache, tab, pp, longest, scale, wide, k_scale, v_scale, out);
  return out;
}

// decode_attention's work over pools of T, once the arguments are checked
template <class T>
void run_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& tab, const int64_t* pp, int64_t longest, double scale,
                bool wide, const Scales& k_scale, const Scales& v_scale, at::Tensor& out) {
  const int64_t b = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_cache.size(1), block = k_cache.size(2);
  const int64_t group = hq / hkv;
  float* k_scales = k_scale ? k_scale->data_ptr<float>() : nullptr;
  DecodeArgs<T> a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), pool_data<T>(k_cache),
                  pool_data<T>(v_cache), k_scales, v_scale ? v_scale->data_ptr<float>() : nullptr,
                  k_scale ? k_scale->stride(0) : 0, k_scale ? k_scale->stride(1) : 0, tab.data_ptr<int64_t>(), pp,
                  out.data_ptr<float>(), group, D, q.stride(0), k.stride(0), v.stride(0), tab.stride(0), block,
                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), hq * D, static_cast<float>(scale)};
  shared_for(b * hkv, [&](int64_t lo, int64_t hi) {
    float* qs = scratch<float>(Scratch::kQueries, group * D);
    float* s = scratch<float>(Scratch::kScores, group * round_up(longest, 64));
    float* os = scratch<float>(Scratch::kOutputs, group * D);
    float* tile = scratch<float>(Scratch::kKeys, D * (64 + 16));  // a decode call holds no prefill's keys
    float* scales = k_scales ? scratch<float>(Scratch::kScales, 2 * round_up(longest, 64)) : nullptr;
    for (int64_t w = lo; w < hi; ++w) {
      if (wide)
        avx512::decode_one<4, 4>(a, w / hkv, w % hkv, qs, s, os, tile, scales);
      else
        avx2::decode_one<2, 2>(a, w / hkv, w % hkv, qs, s, os, tile, scales);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, Tensor table, int start, float scale, bool avx2=False, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.impl("causal_attention", c10::DispatchKey::CPU, TORCH_FN(causal_attention));
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor tables, "
        "Tensor positions, float scale, bool avx2=False, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) "
        "-> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
