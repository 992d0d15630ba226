// The body of layer_ops.cpp over Vec16 (vec16.h), included once per ISA. No include guard on purpose.
// Each function handles whole rows; `k` (the row length) is a multiple of 16.

namespace SIE_ISA {

// out = x * (1 / sqrt(mean(x^2) + eps)) * w; when `delta` is given, h += delta first (h is x, updated in place).
SIE_TARGET inline void rms_norm_row(float* x, const float* delta, const float* w, int64_t k, float eps, float* out) {
  Vec16 squares = Vec16::zero();
  for (int64_t i = 0; i < k; i += 16) {
    Vec16 v = Vec16::load(x + i);
    if (delta) {
      v = v + Vec16::load(delta + i);
      v.store(x + i);
    }
    squares = fmadd(v, v, squares);
  }
  const Vec16 scale = Vec16::set1(1.0f / std::sqrt(fold_add(squares) / static_cast<float>(k) + eps));
  for (int64_t i = 0; i < k; i += 16) (Vec16::load(x + i) * scale * Vec16::load(w + i)).store(out + i);
}

// RoPE in HF's form on one head in place: x * cos + rotate_half(x) * sin, with rotate_half's sign in `sin_signed`
// (two multiplies and an add, as torch computes it, so the bits match).
SIE_TARGET inline void rope_head(float* x, const float* cos, const float* sin_signed, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const Vec16 lo = Vec16::load(x + i), hi = Vec16::load(x + half + i);
    (lo * Vec16::load(cos + i) + hi * Vec16::load(sin_signed + i)).store(x + i);
    (hi * Vec16::load(cos + half + i) + lo * Vec16::load(sin_signed + half + i)).store(x + half + i);
  }
}

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)).
SIE_TARGET inline void silu_mul_row(const float* gate, const float* up, int64_t k, float* out) {
  const Vec16 one = Vec16::set1(1.0f);
  for (int64_t i = 0; i < k; i += 16) {
    const Vec16 g = Vec16::load(gate + i);
    (g / (one + exp(Vec16::zero() - g)) * Vec16::load(up + i)).store(out + i);
  }
}

}  // namespace SIE_ISA
