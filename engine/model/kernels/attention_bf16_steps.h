// The steps of attention_bf16.cpp around its products: K, V and Q packed as bf16 tiles from a paged pool (fp32
// rounded as read, bf16 as stored, int8 widened exactly), and the softmax whose exps are rounded to bf16 for P.V.
// Included once, inside attention_bf16.cpp's anonymous namespace, after its Vec16 and kKeyBlock: no include guard
// on purpose.

// 16 fp32 -> 16 bf16 (nearest even)
SIE_AMX inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// 16 pool elements as bf16: fp32 rounded (nearest even), or a bf16 pool's own bits
SIE_AMX inline __m256i row_bf16(const float* src) { return to_bf16(_mm512_loadu_ps(src)); }
SIE_AMX inline __m256i row_bf16(const uint16_t* src) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
}
SIE_AMX inline __m256i row_bf16(const int8_t* src) {  // exact: bf16 holds every integer of int8
  return to_bf16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))));
}

// Keys first..end-1 of one head (first a multiple of 16; those from `keys` on zero) as Q.K^T's B tiles:
// [(end - first) / 16][D / 2][16] dwords, dword (i, j) of a 16-key group the bf16 pair (k[j][2i], k[j][2i + 1]).
template <class T>
SIE_AMX void pack_keys(const PagedRowsOf<T>& k, int64_t first, int64_t keys, int64_t end, int64_t D, uint32_t* dst) {
  alignas(64) uint32_t rows[16 * 128];  // 16 keys x D / 2 pairs (D <= 256)
  for (int64_t group = first; group < end; group += 16) {
    const T* src = group < keys ? k.row(group) : nullptr;  // the group's rows, in one pool block
    for (int64_t j = 0; j < 16; ++j) {
      uint32_t* row = rows + j * (D / 2);
      if (group + j >= keys) {
        std::fill(row, row + D / 2, 0u);
        continue;
      }
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d / 2), row_bf16(src + j * k.pos_stride + d));
    }
    uint32_t* out = dst + (group - first) * (D / 2);
    for (int64_t i = 0; i < D / 2; i += 16)  // dwords move as floats: the transpose only shuffles bits
      avx512::transpose16x16(reinterpret_cast<const float*>(rows + i), D / 2, reinterpret_cast<float*>(out + i * 16), 16);
  }
}

// Values first..end-1 of one head (first a multiple of 32; those from `keys` on zero) as P.V's B tiles:
// [(end - first) / 32][D / 16][16][16] dwords, dword (p, c) of a 32-key block and 16-column group the bf16 pair
// (v[2p][c], v[2p + 1][c]); zero keys up to end (P is zero there, and zero times the pool's stale values could be a
// NaN). A pair lies in one 16-key group; a block's two groups are looked up apart (with B = 16, two pool blocks).
template <class T>
SIE_AMX void pack_values(const PagedRowsOf<T>& v, int64_t first, int64_t keys, int64_t end, int64_t D,
                         uint32_t* dst) {
  for (int64_t block = first; block < end; block += kKeyBlock) {
    const T* groups[2] = {block < keys ? v.row(block) : nullptr, block + 16 < keys ? v.row(block + 16) : nullptr};
    const auto row = [&](int64_t key) { return groups[(key - block) / 16] + (key - block) % 16 * v.pos_stride; };
    for (int64_t c = 0; c < D; c += 16) {
      uint32_t* tile = dst + ((block - first) / kKeyBlock * (D / 16) + c / 16) * 256;
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t even = block + 2 * p, odd = even + 1;
        const __m256i e = even < keys ? row_bf16(row(even) + c) : _mm256_setzero_si256();
        const __m256i o = odd < keys ? row_bf16(row(odd) + c) : _mm256_setzero_si256();
        const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(e), _mm512_slli_epi32(_mm512_cvtepu16_epi32(o), 16));
        _mm512_storeu_si512(tile + p * 16, pair);
      }
    }
  }
}

// One query row, scaled and rounded: dst[D] bf16
SIE_AMX inline void pack_query(const float* q, float scale, int64_t D, uint16_t* dst) {
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), to_bf16(_mm512_mul_ps(_mm512_loadu_ps(q + d), _mm512_set1_ps(scale))));
}

// exp(x) for x <= 0 to about 4e-5 (the exps are rounded to bf16, 2^-9, next): 2^n * p(r), r = x - n ln2 in
// [-0.35, 0.35], p Taylor's to r^4, 2^n by vscalefps (exact, and 0 far below the normal range). Half the
// instructions of vec16.h's fp32 exp, and the exp was half of a prefill chunk's attention.
SIE_AMX inline __m512 exp_to_bf16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// exp(s[at..at+16) - top), the lanes outside `keep` zero, stored to p as bf16 (times the values' scales `vs` for
// an int8 pool); returns the fp32 exps
template <bool kScaled>
SIE_AMX inline __m512 exps(const float* s, __m512 top, int64_t at, __mmask16 keep, uint16_t* p, const float* vs) {
  const __m512 e = _mm512_maskz_mov_ps(keep, exp_to_bf16(_mm512_sub_ps(_mm512_loadu_ps(s + at), top)));
  if constexpr (kScaled)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + at), to_bf16(_mm512_mul_ps(e, _mm512_loadu_ps(vs + at))));
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + at), to_bf16(e));
  return e;
}

// A row's scores s[0..valid) become bf16 exps p[0..end) (exact zeros from valid on); returns the exps' fp32 sum.
// Vector j of the row (keys 16j..16j+15) adds into accumulator j % 4, so four chains run at once, in an order
// fixed by the key positions alone; the zeros past valid would add nothing, so they are not added. Whole vectors
// of valid keys need no mask; only the one that straddles `valid` does.
template <bool kScaled>
SIE_AMX float softmax_to_bf16(const float* s, int64_t valid, int64_t end, uint16_t* p, const float* vs) {
  const int64_t whole = valid / 16 * 16;
  __m512 m[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                 _mm512_set1_ps(-INFINITY)};
  int64_t key = 0;
  for (; key + 64 <= whole; key += 64)
    for (int j = 0; j < 4; ++j) m[j] = _mm512_max_ps(m[j], _mm512_loadu_ps(s + key + 16 * j));
  for (; key < whole; key += 16) m[0] = _mm512_max_ps(m[0], _mm512_loadu_ps(s + key));
  if (whole < valid)
    m[1] = _mm512_max_ps(m[1], _mm512_mask_loadu_ps(m[1], static_cast<__mmask16>((1u << (valid - whole)) - 1),
                                                    s + whole));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]),
                                                                       _mm512_max_ps(m[2], m[3]))));
  __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (key = 0; key + 64 <= whole; key += 64)
    for (int j = 0; j < 4; ++j) sum[j] = _mm512_add_ps(sum[j], exps<kScaled>(s, top, key + 16 * j, 0xFFFF, p, vs));
  for (int j = 0; key < valid; key += 16, ++j) {  // at most 3 whole vectors and the partial one: j < 4
    const __m512 e = exps<kScaled>(s, top, key,
                                   key + 16 <= valid ? 0xFFFF : static_cast<__mmask16>((1u << (valid - key)) - 1), p, vs);
    sum[j] = _mm512_add_ps(sum[j], e);
  }
  for (; key < end; key += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + key), _mm256_setzero_si256());
  return avx512::fold_add(Vec16{_mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]))});
}
