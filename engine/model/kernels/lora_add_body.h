// The body of lora_add.cpp over Vec16 (vec16.h), included once per ISA. No include guard on purpose.
// Row lengths (k, n) are multiples of 16. Every loop below keeps several independent sums in flight: one sum
// chained through k (or r) waits an FMA's latency per step, which made the first version 4-8x slower.

namespace SIE_ISA {

// h[j] = x . a[j] for J consecutive rows j of a [., k]: J sums share each load of x, then fixed-order folds.
template <int J>
SIE_TARGET inline void lora_shrink_rows(const float* x, const float* a, int64_t k, float* h) {
  Vec16 acc[J];
  for (int j = 0; j < J; ++j) acc[j] = Vec16::zero();
  for (int64_t i = 0; i < k; i += 16) {
    const Vec16 xv = Vec16::load(x + i);
    for (int j = 0; j < J; ++j) acc[j] = fmadd(xv, Vec16::load(a + j * k + i), acc[j]);
  }
  for (int j = 0; j < J; ++j) h[j] = fold_add(acc[j]);
}

// h[j] = x . a[j] for each of the r rows of a [r, k].
SIE_TARGET inline void lora_shrink(const float* x, const float* a, int64_t r, int64_t k, float* h) {
  int64_t j = 0;
  for (; j + 8 <= r; j += 8) lora_shrink_rows<8>(x, a + j * k, k, h + j);
  for (; j < r; ++j) lora_shrink_rows<1>(x, a + j * k, k, h + j);
}

// out[q][c0, c0 + 16C) += h[q] @ b_t[:, c0, c0 + 16C) for Q rows (h: [Q, r], b_t: [r, n]): Q x C sums in registers
// over all r, each B load shared by the Q rows; a row's sums run in the same order whatever Q and C are.
template <int Q, int C>
SIE_TARGET inline void lora_expand_cols(float* const* out, const float* h, int64_t r, const float* b_t, int64_t n,
                                        int64_t c0) {
  Vec16 acc[Q][C];
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < C; ++c) acc[q][c] = Vec16::zero();
  for (int64_t j = 0; j < r; ++j) {
    Vec16 b[C];
    for (int c = 0; c < C; ++c) b[c] = Vec16::load(b_t + j * n + c0 + 16 * c);
    for (int q = 0; q < Q; ++q) {
      const Vec16 hq = Vec16::set1(h[q * r + j]);
      for (int c = 0; c < C; ++c) acc[q][c] = fmadd(hq, b[c], acc[q][c]);
    }
  }
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < C; ++c) {
      float* o = out[q] + c0 + 16 * c;
      (Vec16::load(o) + acc[q][c]).store(o);
    }
}

template <int Q>
SIE_TARGET inline void lora_expand_block(float* const* out, const float* h, int64_t r, const float* b_t, int64_t n,
                                         int64_t lo, int64_t hi) {
  constexpr int C = Q >= 4 ? 1 : 4 / Q;  // at least 4 independent sums per step of r
  int64_t c0 = lo;
  for (; c0 + 16 * C <= hi; c0 += 16 * C) lora_expand_cols<Q, C>(out, h, r, b_t, n, c0);
  for (; c0 < hi; c0 += 16) lora_expand_cols<Q, 1>(out, h, r, b_t, n, c0);
}

// out[q][lo, hi) += (h[q] @ b_t)[lo, hi) for a block of `rows` (1-8) rows; lo and hi are multiples of 16.
SIE_TARGET inline void lora_expand(float* const* out, const float* h, int64_t rows, int64_t r, const float* b_t,
                                   int64_t n, int64_t lo, int64_t hi) {
  switch (rows) {
    case 8: return lora_expand_block<8>(out, h, r, b_t, n, lo, hi);
    case 7: return lora_expand_block<7>(out, h, r, b_t, n, lo, hi);
    case 6: return lora_expand_block<6>(out, h, r, b_t, n, lo, hi);
    case 5: return lora_expand_block<5>(out, h, r, b_t, n, lo, hi);
    case 4: return lora_expand_block<4>(out, h, r, b_t, n, lo, hi);
    case 3: return lora_expand_block<3>(out, h, r, b_t, n, lo, hi);
    case 2: return lora_expand_block<2>(out, h, r, b_t, n, lo, hi);
    default: return lora_expand_block<1>(out, h, r, b_t, n, lo, hi);
  }
}

}  // namespace SIE_ISA
