// The body of causal_attention.cpp over Vec16 (vec16.h), included once per ISA. No include guard on purpose.

namespace SIE_ISA {

// S[RB rows, 16*KV keys] = Q[RB, D] . KT[D, keys]: one FMA per (row, key, d), in d order.
template <int RB, int KV>
SIE_TARGET inline void scores_block(const float* q, int64_t D, const float* kt, int64_t ldkt, float* s, int64_t lds) {
  Vec16 acc[RB][KV];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < KV; ++j) acc[i][j] = Vec16::zero();
  for (int64_t d = 0; d < D; ++d) {
    Vec16 kv[KV];
    for (int j = 0; j < KV; ++j) kv[j] = Vec16::load(kt + d * ldkt + 16 * j);
    for (int i = 0; i < RB; ++i) {
      const Vec16 qb = Vec16::set1(q[i * D + d]);
      for (int j = 0; j < KV; ++j) acc[i][j] = fmadd(qb, kv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < KV; ++j) acc[i][j].store(s + i * lds + 16 * j);
}

// O[RB rows, 16*CV columns] = P[RB, keys] . V[keys, columns]: one FMA per (row, column, key), in key order.
template <int RB, int CV>
SIE_TARGET inline void values_block(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t keys, float* o,
                         int64_t ldo) {
  Vec16 acc[RB][CV];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < CV; ++j) acc[i][j] = Vec16::zero();
  for (int64_t k = 0; k < keys; ++k) {
    Vec16 vv[CV];
    for (int j = 0; j < CV; ++j) vv[j] = Vec16::load(v + k * ldv + 16 * j);
    for (int i = 0; i < RB; ++i) {
      const Vec16 pb = Vec16::set1(p[i * ldp + k]);
      for (int j = 0; j < CV; ++j) acc[i][j] = fmadd(pb, vv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < CV; ++j) acc[i][j].store(o + i * ldo + 16 * j);
}

// One query block of one KV head: rows are (position, query head of the group) pairs, `rows` of them (a multiple of
// RB, padded with zero queries), the last real one at `rows_real`. Scratch: q [rows, D], s [rows, ldk], o [rows, D].
template <int RB, int KV, int CV>
SIE_TARGET void attend_block(const Args& a, int64_t g, int64_t qb, float* qs, float* s, float* os) {
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
  const float* kt = a.kt + g * D * ldk;
  for (int64_t r = 0; r < rows; r += RB)
    for (int64_t key = 0; key < key_pad; key += 16 * KV)
      scores_block<RB, KV>(qs + r * D, D, kt + key, ldk, s + r * ldk + key, ldk);
  // softmax over each row's own keys 0..position (the rest of the row becomes exact zeros)
  std::vector<float> denom(rows, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ldk;
    if (r >= rows_real) {
      std::fill(row, row + key_end, 0.0f);
      continue;
    }
    const int64_t valid = a.start + first + r / G + 1;
    Vec16 m = Vec16::set1(-INFINITY);
    for (int64_t key = 0; key < valid; key += 16) m = max(m, Vec16::load(row + key).below(key, valid, -INFINITY));
    const Vec16 top = Vec16::set1(fold_max(m));
    Vec16 sum = Vec16::zero();
    for (int64_t key = 0; key < key_end; key += 16) {
      const Vec16 e = exp(Vec16::load(row + key) - top).below(key, valid, 0.0f);
      e.store(row + key);
      sum = sum + e;
    }
    denom[r] = fold_add(sum);
  }
  const float* v = a.v + g * a.kv_head_stride;
  for (int64_t c = 0; c < D; c += 16 * CV)
    for (int64_t r = 0; r < rows; r += RB)
      values_block<RB, CV>(s + r * ldk, ldk, v + c, a.kv_row_stride, key_end, os + r * D + c, D);
  for (int64_t r = 0; r < rows_real; ++r) {
    float* dst = a.out + (first + r / G) * a.out_row_stride + (g * G + r % G) * D;
    const float* src = os + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] / denom[r];
  }
}

}  // namespace SIE_ISA
