// Causal attention with bf16 products, for the bf16 profile's mixed mode on CPUs with AVX512_BF16, where the
// activations stay fp32 (engine.model.decoder): the same two calls as causal_attention.cpp (a prefill chunk, a
// decode step), the same arguments (a layer's paged KV pools [num_blocks, Hkv, B, D], fp32 or bf16, and block
// tables), fp32 in and out. A bf16 pool's keys and values go into the products as they are; an fp32 pool's are
// rounded to bf16 as they are read, the same nearest-even rounding a bf16 pool's write applies, so a bf16 pool
// costs this mode no accuracy (subnormal values aside, which the two conversions may treat apart). The products run on AMX tiles where the CPU has AMX, on vdpbf16ps otherwise
// (attention_bf16_products.h).
//
// Why: in a bf16 prefill the linears run at bf16's rate and the fp32 attention kernel became half the time (330 of
// 620 ms on a 1.5k-token prompt, 2-core Xeon; 530 of 1,600 ms on the AVX-512 EPYC). Here Q.K^T and P.V multiply
// bf16 pairs: Q is scaled then rounded to bf16, K and V are rounded as they are read from an fp32 pool, and P,
// an fp32 softmax's exps, is rounded before it multiplies V; every product adds into fp32.
//
// The guarantees of causal_attention.cpp hold: a query's output depends only on its own q and keys 0..its position,
// each in one fixed chain: a score over d in order; the softmax's max exact and its denominator (the exps' fp32
// sum) in 4 x 16 fixed lanes from key 0; each output over 32-key blocks from key 0, blocks past the row's position
// adding exact zeros. Other rows never enter a row's chain, so a prefix-cache hit gives the same bits as a miss, a
// prompt the same bits whatever its chunking or batch, and a decode step the bits a prefill gives (a decode row
// goes through the same blocks). Keys and values are read through the block table only as they are packed, each
// 16-key group from its one pool block (B is a multiple of 16), so the packed tiles, and every bit after them, are
// those of one contiguous row.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>

#include "amx.h"
#include "attention_bf16_products.h"
#include "paged_rows.h"
#include "scratch.h"
#include "shared_work.h"

namespace {

#define SIE_ISA avx512
#define SIE_VEC_BITS 512
#define SIE_TARGET __attribute__((target("avx512f")))
#include "vec16.h"
#undef SIE_ISA
#undef SIE_VEC_BITS
#undef SIE_TARGET
using avx512::Vec16;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr int64_t kKeyBlock = 32;   // keys per P.V tile step (16 pairs), and the multiple every key range rounds to
constexpr int64_t kBlockRows = 64;  // a prefill work item's query rows (position x head of the group), 4 row tiles

// Per-thread scratch (scratch.h)
enum class Scratch { kKeys, kValues, kQueries, kScores, kProbs, kOutputs, kDenominators, kScales, kCount };

#include "attention_bf16_steps.h"

// The rows of one work item: q [rows, D] bf16 (rows a multiple of 16, zero rows past the real ones), against keys
// 0..key_end-1 of the packed kt / vt (key_end a multiple of 32). Row r is query head r % group of the item's KV
// head at position r / group from its first: it sees keys 0..first_valid + r / group - 1, and its output, divided by
// its denominator, goes to out + (r / group) * out_row + (r % group) * D. Scratch: s [rows, key_end] fp32, p [rows,
// key_end] bf16, o [rows, D].
// `amx`: the products on AMX tiles (all `rows`), else on vdpbf16ps (the real rows alone). `ks`, `vs`: an int8
// pool's keys' and values' scales [key_end] (else null): each score times its key's, each exp times its value's
// before it is rounded for P.V (the denominator sums the unscaled exps).
SIE_AMX void attend_rows(const uint16_t* q, int64_t rows, int64_t rows_real, int64_t D, const uint32_t* kt,
                         const uint32_t* vt, int64_t key_end, int64_t group, int64_t first_valid, float* out,
                         int64_t out_row, bool amx, const float* ks = nullptr, const float* vs = nullptr) {
  float* s = scratch<float>(Scratch::kScores, rows * key_end);
  uint16_t* p = scratch<uint16_t>(Scratch::kProbs, rows * key_end);
  float* o = scratch<float>(Scratch::kOutputs, rows * D);
  if (amx)
    scores_amx(q, rows, D, kt, key_end, s);
  else
    scores_dot(q, rows_real, D, kt, key_end, s);
  if (ks)
    for (int64_t r = 0; r < rows_real; ++r)
      for (int64_t key = 0; key < key_end; key += 16)
        _mm512_storeu_ps(s + r * key_end + key,
                         _mm512_mul_ps(_mm512_loadu_ps(s + r * key_end + key), _mm512_loadu_ps(ks + key)));
  float* denom = scratch<float>(Scratch::kDenominators, rows_real);
  for (int64_t r = 0; r < rows; ++r) {
    if (r < rows_real)
      denom[r] = vs ? softmax_to_bf16<true>(s + r * key_end, first_valid + r / group, key_end, p + r * key_end, vs)
                    : softmax_to_bf16<false>(s + r * key_end, first_valid + r / group, key_end, p + r * key_end, vs);
    else
      std::fill(p + r * key_end, p + (r + 1) * key_end, uint16_t(0));
  }
  if (amx)
    values_amx(p, rows, key_end, vt, D, o);
  else
    values_dot(p, rows_real, key_end, vt, D, o);
  for (int64_t r = 0; r < rows_real; ++r)
    for (int64_t d = 0; d < D; ++d) out[r / group * out_row + r % group * D + d] = o[r * D + d] / denom[r];
}

void check_common(const at::Tensor& q, int64_t D) {
  TORCH_CHECK(has_avx512_bf16(), "attention_bf16: this CPU has no AVX512_BF16");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attention_bf16: fp32 queries, keys and values");
  TORCH_CHECK(D % 32 == 0 && D <= 256, "attention_bf16: head_dim a multiple of 32, at most 256");
}

// Every KV head's keys 0..keys-1 and values packed (pack_keys, pack_values), in 32-key blocks across both cores
template <class T>
void pack_heads(const at::Tensor& k, const at::Tensor& v, const at::Tensor& entries, int64_t keys, int64_t keys_pad,
                uint32_t* kt, uint32_t* vt) {
  const int64_t hkv = k.size(1), D = k.size(3), block = k.size(2), blocks = keys_pad / kKeyBlock;
  const PagedRowsOf<T> k_rows{pool_data<T>(k), entries.data_ptr<int64_t>(), block, k.stride(0), k.stride(2)};
  const PagedRowsOf<T> v_rows{pool_data<T>(v), entries.data_ptr<int64_t>(), block, v.stride(0), v.stride(2)};
  at::parallel_for(0, hkv * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t g = i / blocks, first = i % blocks * kKeyBlock, end = first + kKeyBlock;
      const int64_t offset = g * keys_pad * D / 2 + first * D / 2;
      pack_keys(k_rows.head(g * k.stride(1)), first, keys, end, D, kt + offset);
      pack_values(v_rows.head(g * v.stride(1)), first, keys, end, D, vt + offset);
    }
  });
}

// causal_attention.cpp's causal_attention with bf16 products: q [n, Hq, D] for positions start..start+n-1, k and
// v the layer's pools [num_blocks, Hkv, B, D] (the chunk's own keys written), `table` the sequence's block table
// (int64, covering keys 0..start+n-1) -> [n, Hq, D].
using Scales = c10::optional<at::Tensor>;  // an int8 pool's, [num_blocks, Hkv, B] (paged_rows.h)

at::Tensor causal_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& table, int64_t start, double scale, const Scales& k_scale,
                                const Scales& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4,
              "causal_attention_bf16: q [n, Hq, D], k/v pools [num_blocks, Hkv, B, D]");
  const int64_t n = q.size(0), hq = q.size(1), D = q.size(2), hkv = k.size(1), block = k.size(2), keys = start + n;
  check_common(q, D);
  check_pools("causal_attention_bf16", k, v, D);
  check_scales("causal_attention_bf16", k, k_scale, v_scale);
  TORCH_CHECK(hq % hkv == 0, "causal_attention_bf16: query heads a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "causal_attention_bf16: rows of contiguous heads");
  const int64_t used = (keys + block - 1) / block;
  TORCH_CHECK(start >= 0 && table.scalar_type() == at::kLong && table.dim() == 1 && table.size(0) >= used,
              "causal_attention_bf16: an int64 block table covering keys 0..start+n-1");
  const at::Tensor entries = table.contiguous();
  check_entries("causal_attention_bf16", entries.data_ptr<int64_t>(), used, k.size(0));
  at::Tensor out = at::empty({n, hq, D}, q.options());
  if (n == 0) return out;
  const int64_t keys_pad = round_up(keys, kKeyBlock), group = hq / hkv;
  const bool amx = has_amx();
  // every KV head's keys and values packed once, in 32-key blocks across both cores
  uint32_t* kt = scratch<uint32_t>(Scratch::kKeys, hkv * keys_pad * D / 2);
  uint32_t* vt = scratch<uint32_t>(Scratch::kValues, hkv * keys_pad * D / 2);
  float* scales = nullptr;  // an int8 pool's: every head's keys' then values' scales, gathered once
  if (k.scalar_type() == at::kBFloat16) {
    pack_heads<uint16_t>(k, v, entries, keys, keys_pad, kt, vt);
  } else if (k.scalar_type() == at::kChar) {
    pack_heads<int8_t>(k, v, entries, keys, keys_pad, kt, vt);
    scales = scratch<float>(Scratch::kScales, 2 * hkv * keys_pad);
    for (int64_t g = 0; g < hkv; ++g)
      for (int64_t i = 0; i < 2; ++i) {
        const at::Tensor& pool = i == 0 ? *k_scale : *v_scale;
        const PagedScales rows{pool.data_ptr<float>() + g * pool.stride(1), entries.data_ptr<int64_t>(), block,
                               pool.stride(0)};
        rows.gather(keys, keys_pad, scales + (i * hkv + g) * keys_pad);
      }
  } else {
    pack_heads<float>(k, v, entries, keys, keys_pad, kt, vt);
  }
  const int64_t block_positions = std::max<int64_t>(1, kBlockRows / group);
  const int64_t q_blocks = (n + block_positions - 1) / block_positions;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // work items alternate the cheapest and the dearest query blocks, as in causal_attention.cpp
  shared_for(hkv * q_blocks, [&](int64_t lo, int64_t hi) {
    if (amx) load_tile_config();
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t g = w % hkv, j = w / hkv;
      const int64_t qb = j % 2 == 0 ? j / 2 : q_blocks - 1 - j / 2;
      const int64_t first = qb * block_positions, positions = std::min(block_positions, n - first);
      const int64_t rows_real = positions * group, rows = round_up(rows_real, 16);
      uint16_t* qs = scratch<uint16_t>(Scratch::kQueries, rows * D);
      for (int64_t r = 0; r < rows_real; ++r)
        pack_query(qp + (first + r / group) * q.stride(0) + (g * group + r % group) * D, static_cast<float>(scale),
                   D, qs + r * D);
      std::fill(qs + rows_real * D, qs + rows * D, uint16_t(0));
      const int64_t key_end = round_up(start + first + positions, kKeyBlock);
      attend_rows(qs, rows, rows_real, D, kt + g * keys_pad * D / 2, vt + g * keys_pad * D / 2, key_end, group,
                  start + first + 1, op + (first * hq + g * group) * D, hq * D, amx,
                  scales ? scales + g * keys_pad : nullptr, scales ? scales + (hkv + g) * keys_pad : nullptr);
    }
    if (amx) release_tiles();
  });
  return out;
}

// decode_attention_bf16's work over pools of T, once the arguments are checked. A bf16 pool's new key and value are
// rounded as they are written, as a prefill's write through torch rounds them (paged_rows.h).
template <class T>
void run_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& tab, const int64_t* pp, double scale,
                const Scales& k_scale, const Scales& v_scale, at::Tensor& out) {
  const int64_t b = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_cache.size(1), block = k_cache.size(2);
  const int64_t group = hq / hkv, rows = round_up(group, 16);
  const bool amx = has_amx();
  T* kc = pool_data<T>(k_cache);
  T* vc = pool_data<T>(v_cache);
  const int64_t* tp = tab.data_ptr<int64_t>();
  shared_for(b * hkv, [&](int64_t lo, int64_t hi) {
    if (amx) load_tile_config();
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t row = w / hkv, g = w % hkv, p = pp[row], keys = p + 1, key_end = round_up(keys, kKeyBlock);
      const int64_t* table = tp + row * tab.stride(0);  // k_cache and v_cache share their strides
      const PagedRowsOf<T> kh{kc + g * k_cache.stride(1), table, block, k_cache.stride(0), k_cache.stride(2)};
      const PagedRowsOf<T> vh{vc + g * k_cache.stride(1), table, block, k_cache.stride(0), k_cache.stride(2)};
      float* scales = nullptr;  // an int8 pool's: this row's keys' then values' scales [2, key_end]
      if constexpr (std::is_same_v<T, int8_t>) {
        const PagedScales ksc{k_scale->data_ptr<float>() + g * k_scale->stride(1), table, block, k_scale->stride(0)};
        const PagedScales vsc{v_scale->data_ptr<float>() + g * v_scale->stride(1), table, block, v_scale->stride(0)};
        kv_quantize_row(k.data_ptr<float>() + row * k.stride(0) + g * D, D, kh.row(p), ksc.at(p));
        kv_quantize_row(v.data_ptr<float>() + row * v.stride(0) + g * D, D, vh.row(p), vsc.at(p));
        scales = scratch<float>(Scratch::kScales, 2 * key_end);
        ksc.gather(keys, key_end, scales);
        vsc.gather(keys, key_end, scales + key_end);
      } else {
        kv_write_row(k.data_ptr<float>() + row * k.stride(0) + g * D, D, kh.row(p));
        kv_write_row(v.data_ptr<float>() + row * v.stride(0) + g * D, D, vh.row(p));
      }
      uint32_t* kt = scratch<uint32_t>(Scratch::kKeys, key_end * D / 2);
      uint32_t* vt = scratch<uint32_t>(Scratch::kValues, key_end * D / 2);
      pack_keys(kh, 0, keys, key_end, D, kt);
      pack_values(vh, 0, keys, key_end, D, vt);
      uint16_t* qs = scratch<uint16_t>(Scratch::kQueries, rows * D);
      for (int64_t r = 0; r < group; ++r)
        pack_query(q.data_ptr<float>() + row * q.stride(0) + (g * group + r) * D, static_cast<float>(scale), D,
                   qs + r * D);
      std::fill(qs + group * D, qs + rows * D, uint16_t(0));
      attend_rows(qs, rows, group, D, kt, vt, key_end, group, keys, out.data_ptr<float>() + (row * hq + g * group) * D,
                  hq * D, amx, scales, scales ? scales + key_end : nullptr);
    }
    if (amx) release_tiles();
  });
}

// causal_attention.cpp's decode_attention with bf16 products: q [rows, Hq, D], the new k and v [rows, Hkv, D], the
// layer's pools [num_blocks, Hkv, B, D] (written at positions[b] through row b's block table tables[b], then read
// over 0..positions[b]) -> [rows, Hq, D], the bits causal_attention_bf16 gives that query. As there, the position
// a row writes must be one no other row of the step reads.
at::Tensor decode_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                                const at::Tensor& positions, double scale, const Scales& k_scale,
                                const Scales& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "decode_attention_bf16: q [rows, Hq, D], k/v [rows, Hkv, D], caches: pools [num_blocks, Hkv, B, D]");
  const int64_t b = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_cache.size(1), block = k_cache.size(2);
  check_common(q, D);
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(-1) == 1, "decode_attention_bf16: fp32, features contiguous");
  check_pools("decode_attention_bf16", k_cache, v_cache, D);
  check_scales("decode_attention_bf16", k_cache, k_scale, v_scale);
  TORCH_CHECK(hq % hkv == 0 && k.size(1) == hkv && v.size(1) == hkv && k.size(0) == b && v.size(0) == b,
              "decode_attention_bf16: query heads a multiple of KV heads, one new key and value per row");
  TORCH_CHECK(q.stride(1) == D && k.stride(1) == D && v.stride(1) == D, "decode_attention_bf16: heads contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) >= b,
              "decode_attention_bf16: int64 block tables [>= rows, max_blocks], one per row");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == b,
              "decode_attention_bf16: int64 positions [rows]");
  const at::Tensor tab = tables.stride(1) == 1 ? tables : tables.contiguous();  // rows may lie any stride apart
  const at::Tensor pos = positions.contiguous();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(pp[i] >= 0 && pp[i] < tab.size(1) * block, "decode_attention_bf16: a position outside its block table");
    check_entries("decode_attention_bf16", tp + i * tab.stride(0), pp[i] / block + 1, k_cache.size(0));
  }
  at::Tensor out = at::empty({b, hq, D}, q.options());
  if (b == 0) return out;
  if (k_cache.scalar_type() == at::kBFloat16)
    run_decode<uint16_t>(q, k, v, k_cache, v_cache, tab, pp, scale, k_scale, v_scale, out);
  else if (k_cache.scalar_type() == at::kChar)
    run_decode<int8_t>(q, k, v, k_cache, v_cache, tab, pp, scale, k_scale, v_scale, out);
  else
    run_decode<float>(q, k, v, k_cache, v_cache, tab, pp, scale, k_scale, v_scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("causal_attention_bf16(Tensor q, Tensor k, Tensor v, Tensor table, int start, float scale, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.impl("causal_attention_bf16", c10::DispatchKey::CPU, TORCH_FN(causal_attention_bf16));
  m.def("decode_attention_bf16(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor tables, Tensor positions, float scale, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) "
        "-> Tensor");
  m.impl("decode_attention_bf16", c10::DispatchKey::CPU, TORCH_FN(decode_attention_bf16));
}
