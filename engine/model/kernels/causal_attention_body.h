// The body of causal_attention.cpp over Vec16 (vec16.h), included once per ISA. No include guard on purpose.

namespace SIE_ISA {

// out[RB, 16*W] = a[RB, k] . b[k, 16*W]: the register block of both halves of attention, one FMA per output
// element and step of k, in k order. Scores: a = the scaled queries, b = the transposed keys (k = d). Outputs: a =
// the probabilities, b = the values (k = keys). `resume`: out holds the sums of the k steps before these, and each
// chain continues from them (an fp32 store and load is exact: the bits of one pass). `b` fp32, or a bf16 or int8
// pool's values, widened to fp32 as they are loaded (exact: the same chain as over their fp32 copy).
template <int RB, int W, class TB>
SIE_TARGET inline void gemm_block(const float* a, int64_t lda, const TB* b, int64_t ldb, int64_t k, float* out,
                                  int64_t ldo, bool resume = false) {
  Vec16 acc[RB][W];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < W; ++j) acc[i][j] = resume ? Vec16::load(out + i * ldo + 16 * j) : Vec16::zero();
  for (int64_t step = 0; step < k; ++step) {
    Vec16 bv[W];
    for (int j = 0; j < W; ++j) bv[j] = Vec16::load(b + step * ldb + 16 * j);
    for (int i = 0; i < RB; ++i) {
      const Vec16 ab = Vec16::set1(a[i * lda + step]);
      for (int j = 0; j < W; ++j) acc[i][j] = fmadd(ab, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < W; ++j) acc[i][j].store(out + i * ldo + 16 * j);
}

// S[RB rows, 16*KV keys] = Q[RB, D] . KT[D, keys]
template <int RB, int KV>
SIE_TARGET inline void scores_block(const float* q, int64_t D, const float* kt, int64_t ldkt, float* s, int64_t lds) {
  gemm_block<RB, KV, float>(q, D, kt, ldkt, D, s, lds);
}

// O[RB rows, 16*CV columns] = P[RB, keys] . V[keys, columns]
template <int RB, int CV, class TV>
SIE_TARGET inline void values_block(const float* p, int64_t ldp, const TV* v, int64_t ldv, int64_t keys, float* o,
                                    int64_t ldo, bool resume = false) {
  gemm_block<RB, CV, TV>(p, ldp, v, ldv, keys, o, ldo, resume);
}

// A row of scores becomes exp(s - max) over keys 0..valid-1 and exact zeros from there to key_end (rounded up to
// 16); returns the row's sum, folded from 16 lanes that each add their keys in order from key 0.
// Whole vectors of valid keys need no mask; only the one that straddles `valid` and those past it do.
SIE_TARGET inline float softmax_row(float* row, int64_t valid, int64_t key_end) {
  const int64_t whole = valid / 16 * 16;
  Vec16 m = Vec16::set1(-INFINITY);
  for (int64_t key = 0; key < whole; key += 16) m = max(m, Vec16::load(row + key));
  if (whole < valid) m = max(m, Vec16::load(row + whole).below(whole, valid, -INFINITY));
  const Vec16 top = Vec16::set1(fold_max(m));
  Vec16 sum = Vec16::zero();
  for (int64_t key = 0; key < whole; key += 16) {
    const Vec16 e = exp(Vec16::load(row + key) - top);
    e.store(row + key);
    sum = sum + e;
  }
  for (int64_t key = whole; key < key_end; key += 16) {
    const Vec16 e = exp(Vec16::load(row + key) - top).below(key, valid, 0.0f);
    e.store(row + key);
    sum = sum + e;
  }
  return fold_add(sum);
}

// row[0..n) *= scales[0..n), n rounded up to 16 (both hold that much): an int8 pool's scores times their keys'
// scales, or its exps times their values' scales (the scale of a key or value row factored out of its products)
SIE_TARGET inline void scale_row(float* row, const float* scales, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) (Vec16::load(row + i) * Vec16::load(scales + i)).store(row + i);
}

SIE_TARGET inline void divide_row(const float* src, float denom, int64_t d, float* dst) {
  for (int64_t i = 0; i < d; ++i) dst[i] = src[i] / denom;
}

// One query block of one KV head: rows are (position, query head of the group) pairs, `rows` of them (a multiple of
// RB, padded with zero queries), the last real one at `rows_real`. Scratch: q [rows, D], s [rows, ldk], o [rows, D].
// `T`: the pool's element (fp32, bf16's bits or int8; int8 scores and probabilities take their rows' scales).
template <int RB, int KV, int CV, class T>
SIE_TARGET void attend_block(const Args<T>& a, int64_t g, int64_t qb, float* qs, float* s, float* os) {
  const int64_t G = a.group, D = a.head_dim;
  const int64_t first = qb * a.block_positions;  // chunk index of the block's first query
  const int64_t positions = std::min(a.block_positions, a.n - first);
  const int64_t rows_real = positions * G, rows = round_up(rows_real, RB);
  const int64_t key_end = a.start + first + positions;  // keys any row of the block reads
  const int64_t key_pad = round_up(key_end, 16 * KV);
  const int64_t ldk = a.keys_padded;
  // the block's queries, scaled, gathered row by row (zeros pad to a multiple of RB)
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = qs + r * D;
    if (r >= rows_real) {
      std::fill(dst, dst + D, 0.0f);
      continue;
    }
    const float* src = a.q + (first + r / G) * a.q_row_stride + (g * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
  }
  // keys in blocks of 64, each block's D x 64 transposed keys contiguous (16 KB at D = 64): key blocks outside, row
  // blocks inside, so a block streams in once and stays in L1 while every row block reads it
  const float* kt = a.kt + g * D * ldk;
  for (int64_t key = 0; key < key_pad; key += 16 * KV)
    for (int64_t r = 0; r < rows; r += RB)
      scores_block<RB, KV>(qs + r * D, D, kt + key / 64 * 64 * D + key % 64, 64, s + r * ldk + key, ldk);
  if constexpr (std::is_same_v<T, int8_t>)
    for (int64_t r = 0; r < rows_real; ++r) scale_row(s + r * ldk, a.k_scales + g * ldk, key_end);
  // softmax over each row's own keys 0..position (the rest of the row becomes exact zeros)
  std::vector<float> denom(rows, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    if (r >= rows_real)
      std::fill(s + r * ldk, s + r * ldk + key_end, 0.0f);
    else
      denom[r] = softmax_row(s + r * ldk, a.start + first + r / G + 1, key_end);
  }
  if constexpr (std::is_same_v<T, int8_t>)
    for (int64_t r = 0; r < rows_real; ++r) scale_row(s + r * ldk, a.v_scales + g * ldk, key_end);
  // V in spans of up to kValueKeys rows (32 KB at D = 64, in L1) that every row block reads in turn, each output
  // resuming its chain where the span before left it: the same bits as one pass over all keys, V read once from L2.
  // A span also ends where the next row does not follow in memory (a pool block's end, unless the table placed the
  // next block right behind it).
  const PagedRowsOf<T> v = a.v.head(g * a.kv_head_stride);
  for (int64_t key = 0, span; key < key_end; key += span) {
    span = v.contiguous(key, std::min(kValueKeys, key_end - key));
    const T* rows_v = v.row(key);
    for (int64_t c = 0; c < D; c += 16 * CV)
      for (int64_t r = 0; r < rows; r += RB)
        values_block<RB, CV>(s + r * ldk + key, ldk, rows_v + c, v.pos_stride, span, os + r * D + c, D, key > 0);
  }
  for (int64_t r = 0; r < rows_real; ++r)
    divide_row(os + r * D, denom[r], D, a.out + (first + r / G) * a.out_row_stride + (g * G + r % G) * D);
}

// Rows 0..rows-1 of `scores_block` / `values_block` in register blocks of 3 (a GQA group of 3, or 6 or 9, takes
// no remainder), then the rest one by one. Each output element is the same FMA chain whatever block computes it.
template <int KV>
SIE_TARGET inline void scores_rows(const float* q, int64_t rows, int64_t D, const float* kt, int64_t ldkt, float* s,
                                   int64_t lds) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3) scores_block<3, KV>(q + r * D, D, kt, ldkt, s + r * lds, lds);
  for (; r < rows; ++r) scores_block<1, KV>(q + r * D, D, kt, ldkt, s + r * lds, lds);
}

template <int CV, class TV>
SIE_TARGET inline void values_rows(const float* p, int64_t rows, int64_t ldp, const TV* v, int64_t ldv,
                                   int64_t keys, float* o, int64_t ldo, bool resume) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3) values_block<3, CV>(p + r * ldp, ldp, v, ldv, keys, o + r * ldo, ldo, resume);
  for (; r < rows; ++r) values_block<1, CV>(p + r * ldp, ldp, v, ldv, keys, o + r * ldo, ldo, resume);
}

// Decode: row b's query heads of KV head g, at position p = positions[b], against keys 0..p of row b's blocks,
// after writing the row's new key and value there. Each 64-key tile of K is transposed into a small buffer (only its
// 16-key groups that hold keys: a short context's last tile is mostly past the end), so a score
// is the same FMA chain as in attend_block, and so is everything after it: a token's attention output has the
// same bits in a decode step as in a prefill. Scratch: q [G, D], s [G, >= p + 64], o [G, D], tile [D, 64] + [16, D].
// A bf16 pool's new key and value are rounded as they are written, as a prefill's write through torch rounds them.
// An int8 pool's row is quantized as it is written (kv_quantize_row), and its scales are gathered into `scales`
// [2, >= p + 64] (keys', values').
template <int KV, int CV, class T>
SIE_TARGET void decode_one(const DecodeArgs<T>& a, int64_t b, int64_t g, float* qs, float* s, float* os,
                           float* tile, float* scales = nullptr) {
  constexpr int64_t kTileKeys = 64;
  const int64_t G = a.group, D = a.head_dim, p = a.positions[b];
  const PagedRowsOf<T> kc = a.rows(a.k_cache, b, g), vc = a.rows(a.v_cache, b, g);
  const int64_t keys = p + 1, lds = round_up(keys, kTileKeys);
  if constexpr (std::is_same_v<T, int8_t>) {
    const PagedScales ksc = a.scales(a.k_scales, b, g), vsc = a.scales(a.v_scales, b, g);
    kv_quantize_row(a.k_new + b * a.k_row_stride + g * D, D, kc.row(p), ksc.at(p));
    kv_quantize_row(a.v_new + b * a.v_row_stride + g * D, D, vc.row(p), vsc.at(p));
    ksc.gather(keys, lds, scales);
    vsc.gather(keys, lds, scales + lds);
  } else {
    kv_write_row(a.k_new + b * a.k_row_stride + g * D, D, kc.row(p));
    kv_write_row(a.v_new + b * a.v_row_stride + g * D, D, vc.row(p));
  }
  for (int64_t r = 0; r < G; ++r) {
    const float* src = a.q + b * a.q_row_stride + (g * G + r) * D;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * a.scale;
  }
  float* last_rows = tile + D * kTileKeys;  // [16, D]: the 16-key group that straddles the last key
  for (int64_t key = 0; key < keys; key += kTileKeys) {
    const int64_t valid = std::min(kTileKeys, keys - key);
    for (int64_t i = 0; i < valid; i += 16) {
      if (i + 16 > valid) {  // its rows past the last key repeat the last key (their scores are never read)
        for (int64_t j = 0; j < 16; ++j) kv_read_row(kc.row(key + std::min(i + j, valid - 1)), D, last_rows + j * D);
        for (int64_t d = 0; d < D; d += 16) transpose16x16(last_rows + d, D, tile + d * kTileKeys + i, kTileKeys);
      } else {
        const T* src = kc.row(key + i);  // the 16-key group lies in one pool block
        for (int64_t d = 0; d < D; d += 16)
          transpose16x16(src + d, kc.pos_stride, tile + d * kTileKeys + i, kTileKeys);
      }
    }
    // 16-key groups wholly past the last key keep the tile's older keys: scored, and never read
    for (int64_t i = 0; i < kTileKeys; i += 16 * KV) scores_rows<KV>(qs, G, D, tile + i, kTileKeys, s + key + i, lds);
  }
  if constexpr (std::is_same_v<T, int8_t>)
    for (int64_t r = 0; r < G; ++r) scale_row(s + r * lds, scales, keys);
  std::vector<float> denom(G);
  for (int64_t r = 0; r < G; ++r) denom[r] = softmax_row(s + r * lds, keys, keys);
  if constexpr (std::is_same_v<T, int8_t>)
    for (int64_t r = 0; r < G; ++r) scale_row(s + r * lds, scales + lds, keys);
  // V in spans of rows that follow each other in memory (a block, or blocks the table placed back to back), each
  // output resuming its chain where the span before left it: the bits of one pass over keys 0..p
  for (int64_t key = 0, span; key < keys; key += span) {
    span = vc.contiguous(key, keys - key);
    for (int64_t c = 0; c < D; c += 16 * CV)
      values_rows<CV>(s + key, G, lds, vc.row(key) + c, vc.pos_stride, span, os + c, D, key > 0);
  }
  for (int64_t r = 0; r < G; ++r) divide_row(os + r * D, denom[r], D, a.out + b * a.out_row_stride + (g * G + r) * D);
}

}  // namespace SIE_ISA
