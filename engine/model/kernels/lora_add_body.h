// The body of lora_add.cpp over Vec16 (vec16.h), included once per ISA. No include guard on purpose.
// Row lengths (k, n) are multiples of 16; a row block holds at most kLoraRows rows.

namespace SIE_ISA {

// h[j] = x . a[j] for each of the r rows of a [r, k]: one vector sum over k, then a fixed-order fold.
SIE_TARGET inline void lora_shrink_row(const float* x, const float* a, int64_t r, int64_t k, float* h) {
  for (int64_t j = 0; j < r; ++j) {
    Vec16 acc = Vec16::zero();
    for (int64_t i = 0; i < k; i += 16) acc = fmadd(Vec16::load(x + i), Vec16::load(a + j * k + i), acc);
    h[j] = fold_add(acc);
  }
}

// out[q] += h[q] @ b_t for the block's rows q (h: [rows, r], b_t: [r, n]). Each 16 output columns of every row
// stay in registers over all r, so b_t is read once per block; a row's sums run in the same order in any block.
SIE_TARGET inline void lora_expand_rows(float* const* out, const float* h, int64_t rows, int64_t r,
                                        const float* b_t, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    Vec16 acc[kLoraRows];
    for (int64_t q = 0; q < rows; ++q) acc[q] = Vec16::zero();
    for (int64_t j = 0; j < r; ++j) {
      const Vec16 b = Vec16::load(b_t + j * n + c);
      for (int64_t q = 0; q < rows; ++q) acc[q] = fmadd(Vec16::set1(h[q * r + j]), b, acc[q]);
    }
    for (int64_t q = 0; q < rows; ++q) (Vec16::load(out[q] + c) + acc[q]).store(out[q] + c);
  }
}

}  // namespace SIE_ISA
