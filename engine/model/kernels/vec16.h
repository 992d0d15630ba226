// Vec16, 16 fp32 lanes: one zmm register on AVX-512, two ymm halves on AVX2, with the few operations our kernels
// need. Every lane computes the same sequence of IEEE operations in both, so a kernel written over Vec16 gives
// identical bits on both ISAs (reductions fold the 16 lanes in one fixed order).
//
// Included once per ISA by isa_variants.h, with SIE_ISA naming the namespace (avx512 or avx2), SIE_VEC_BITS the
// vector width and SIE_TARGET the function attribute that enables the ISA (GCC does not apply a `#pragma GCC
// target` region to functions defined inside a class). No include guard on purpose.

namespace SIE_ISA {

#if SIE_VEC_BITS == 512
struct Vec16 {
  __m512 v;
  SIE_TARGET static Vec16 zero() { return {_mm512_setzero_ps()}; }
  SIE_TARGET static Vec16 set1(float x) { return {_mm512_set1_ps(x)}; }
  SIE_TARGET static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  // 16 bf16 (their raw bits) widened to fp32, exactly: each one's bits become an fp32's high half
  SIE_TARGET static Vec16 load(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  // 16 int8 as fp32 (exact)
  SIE_TARGET static Vec16 load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  // lane i reads p[offsets[i]]
  SIE_TARGET static Vec16 gather(const float* p, const int32_t* offsets) {
    return {_mm512_i32gather_ps(_mm512_loadu_si512(offsets), p, 4)};
  }
  SIE_TARGET void store(float* p) const { _mm512_storeu_ps(p, v); }
  SIE_TARGET bool any_above(float t) const {
    return _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
  }
  SIE_TARGET friend Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  SIE_TARGET friend Vec16 fnmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
  SIE_TARGET friend Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  SIE_TARGET friend Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  SIE_TARGET friend Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  SIE_TARGET friend Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  SIE_TARGET friend Vec16 min(Vec16 a, Vec16 b) { return {_mm512_min_ps(a.v, b.v)}; }
  SIE_TARGET friend Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  SIE_TARGET friend Vec16 round_nearest(Vec16 a) {
    return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  // 2^n for integral n in [-126, 127], built in the exponent field (exact)
  SIE_TARGET friend Vec16 pow2(Vec16 n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
  }
  // lanes whose index (first + lane) is below `limit` keep their value, the others become `fill`
  SIE_TARGET Vec16 below(int64_t first, int64_t limit, float fill) const {
    const int64_t keep = limit - first;
    const __mmask16 m = keep >= 16 ? __mmask16(0xFFFF) : keep <= 0 ? __mmask16(0) : __mmask16((1u << keep) - 1);
    return {_mm512_mask_blend_ps(m, _mm512_set1_ps(fill), v)};
  }
};
#else
struct Vec16 {
  __m256 lo, hi;
  SIE_TARGET static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  SIE_TARGET static Vec16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  SIE_TARGET static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  SIE_TARGET static Vec16 load(const uint16_t* p) {
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  }
  SIE_TARGET static Vec16 load(const int8_t* p) {
    const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
  }
  SIE_TARGET static Vec16 gather(const float* p, const int32_t* offsets) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets + 8));
    return {_mm256_i32gather_ps(p, lo, 4), _mm256_i32gather_ps(p, hi, 4)};
  }
  SIE_TARGET void store(float* p) const { _mm256_storeu_ps(p, lo), _mm256_storeu_ps(p + 8, hi); }
  SIE_TARGET bool any_above(float t) const {
    const __m256 tv = _mm256_set1_ps(t);
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(lo, tv, _CMP_GT_OQ), _mm256_cmp_ps(hi, tv, _CMP_GT_OQ))) != 0;
  }
  SIE_TARGET friend Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  SIE_TARGET friend Vec16 fnmadd(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
  }
  SIE_TARGET friend Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  SIE_TARGET friend Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  SIE_TARGET friend Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  SIE_TARGET friend Vec16 max(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  SIE_TARGET friend Vec16 min(Vec16 a, Vec16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
  SIE_TARGET friend Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  SIE_TARGET friend Vec16 round_nearest(Vec16 a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
  }
  SIE_TARGET friend Vec16 pow2(Vec16 n) {
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256i lo = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.lo), bias), 23);
    const __m256i hi = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.hi), bias), 23);
    return {_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)};
  }
  SIE_TARGET Vec16 below(int64_t first, int64_t limit, float fill) const {
    const __m256i idx_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i idx_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t clamped = std::min<int64_t>(std::max<int64_t>(limit - first, 0), 16);
    const __m256i keep = _mm256_set1_epi32(static_cast<int>(clamped));
    const __m256 f = _mm256_set1_ps(fill);
    const __m256 m_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(keep, idx_lo));
    const __m256 m_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(keep, idx_hi));
    return {_mm256_blendv_ps(f, lo, m_lo), _mm256_blendv_ps(f, hi, m_hi)};
  }
};
#endif

#if SIE_VEC_BITS == 512
// dst[j][i] = src[i][j] for a 16 x 16 block (rows ld apart): unpacks, then 128-bit lane shuffles, in registers.
// `src` fp32, bf16's raw bits or int8 (widened to fp32 as the rows are loaded).
template <class T>
SIE_TARGET inline void transpose16x16(const T* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = Vec16::load(src + i * ld_src).v;
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ld_dst, r[i]);
}
#else
template <class T>
SIE_TARGET inline void transpose16x16(const T* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  if constexpr (std::is_same_v<T, float>) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) dst[j * ld_dst + i] = src[i * ld_src + j];
  } else {
    alignas(32) float row[16];
    for (int i = 0; i < 16; ++i) {
      Vec16::load(src + i * ld_src).store(row);
      for (int j = 0; j < 16; ++j) dst[j * ld_dst + i] = row[j];
    }
  }
}
#endif

// exp(x): Cephes' expf, 2^n * p(r) with r = x - n ln2, about 1 ulp. x is clamped to [-87, 88], where 2^n stays in
// the normal range: exp(-87) is 1.6e-38 (nothing beside a softmax's 1 or silu's x), exp(88) 1.7e38.
SIE_TARGET inline Vec16 exp(Vec16 x) {
  x = min(max(x, Vec16::set1(-87.0f)), Vec16::set1(88.0f));
  const Vec16 n = round_nearest(x * Vec16::set1(1.44269504088896341f));
  Vec16 r = fnmadd(n, Vec16::set1(0.693359375f), x);
  r = fnmadd(n, Vec16::set1(-2.12194440e-4f), r);
  Vec16 p = Vec16::set1(1.9875691500e-4f);
  p = fmadd(p, r, Vec16::set1(1.3981999507e-3f));
  p = fmadd(p, r, Vec16::set1(8.3334519073e-3f));
  p = fmadd(p, r, Vec16::set1(4.1665795894e-2f));
  p = fmadd(p, r, Vec16::set1(1.6666665459e-1f));
  p = fmadd(p, r, Vec16::set1(5.0000001201e-1f));
  const Vec16 y = fmadd(p * r, r, r + Vec16::set1(1.0f));
  return y * pow2(n);
}

// Lane sums and maxima are folded in one fixed order, the same on both ISAs.
SIE_TARGET inline float fold_add(Vec16 a) {
  alignas(64) float l[16];
  a.store(l);
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += l[i];
  return s;
}
SIE_TARGET inline float fold_max(Vec16 a) {
  alignas(64) float l[16];
  a.store(l);
  float m = l[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, l[i]);
  return m;
}

}  // namespace SIE_ISA
