// y[M, N] = x[M, K] @ W^T with 4-bit weights in groups of 32 along K, each group of a column with its own fp16
// scale and minimum (w = q * scale + min, q in 0..15: GGUF Q4_1's arithmetic), fp32 x and y, on AVX-512.
// W is laid out once at load (engine/model/tiled_linear.py `TiledWeight.int4`): column tiles of k pairs
// [N/16, K/2, 16] bytes, each byte a column's q[k] (low nibble) and q[k + 1] (high nibble); scales and minimums
// [N/16, K/32, 16] fp16.
//
// Why: at one request a decode step reads every weight once, and 4 bits (plus a byte of scale and minimum per 32)
// read about a sixth of fp32's bytes. The activations stay fp32 (weight-only).
//
// Per row and column, each group's sum is a plain sequential FMA chain over its 32 k of x * q (q widened to fp32),
// then the running total takes scale * that sum + min * (the row's sum of x over the group), in group order. Every
// step is per row: a row's result is bit-identical alone, in any batch, in a prefill chunk or a decode step.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "shared_work.h"

namespace {

constexpr int kTile = 16;       // output columns per tile
constexpr int kPanel = 3;       // tiles per register block
constexpr int kPadTiles = 6;    // N padded as the fp32 layout pads it
constexpr int kGroup = 32;      // k per scale
constexpr int kPairs = kGroup / 2;
constexpr int kPrefetch = 64;   // k pairs ahead (16 lines of each tile stream)

#define SIE_INT4 __attribute__((target("avx512f,f16c")))

template <int MT>
SIE_INT4 inline void block(const float* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* w,
                           const at::Half* scales, const at::Half* mins, int64_t K2, float* y, int64_t ldy) {
  const __m512i low = _mm512_set1_epi32(0xF);
  __m512 total[MT][kPanel];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPanel; ++j) total[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MT][kPanel];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < kPanel; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = g * kPairs; p < (g + 1) * kPairs; ++p) {
      __m512 lo[kPanel], hi[kPanel];
      for (int j = 0; j < kPanel; ++j) {
        const uint8_t* t = w + (j * K2 + p) * kTile;
        if (p % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetch * kTile), _MM_HINT_T0);
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
        lo[j] = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
        hi[j] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      }
      for (int i = 0; i < MT; ++i) {
        const __m512 x0 = _mm512_set1_ps(x[i * ldx + 2 * p]);
        const __m512 x1 = _mm512_set1_ps(x[i * ldx + 2 * p + 1]);
        for (int j = 0; j < kPanel; ++j) acc[i][j] = _mm512_fmadd_ps(x1, hi[j], _mm512_fmadd_ps(x0, lo[j], acc[i][j]));
      }
    }
    for (int j = 0; j < kPanel; ++j) {
      const int64_t at = (j * groups + g) * kTile;
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + at)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + at)));
      for (int i = 0; i < MT; ++i)
        total[i][j] = _mm512_fmadd_ps(s, acc[i][j], _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[i * groups + g]),
                                                                    total[i][j]));
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPanel; ++j) _mm512_storeu_ps(y + i * ldy + j * kTile, total[i][j]);
}

// register blocks of up to 4 rows (4 x 3 group sums, 4 x 3 totals and the widened weights fill the 32 registers)
template <int MT>
void panel_rows(const float* x, int64_t ldx, const float* xsum, int64_t groups, const uint8_t* w,
                const at::Half* scales, const at::Half* mins, int64_t K2, float* y, int64_t ldy, int64_t m) {
  int64_t i = 0;
  for (; i + MT <= m; i += MT)
    block<MT>(x + i * ldx, ldx, xsum + i * groups, groups, w, scales, mins, K2, y + i * ldy, ldy);
  if constexpr (MT > 1) {
    if (i < m) panel_rows<MT - 1>(x + i * ldx, ldx, xsum + i * groups, groups, w, scales, mins, K2, y + i * ldy,
                                  ldy, m - i);
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// x [M, K] fp32 (K a multiple of 32), tiles [N/16, K/2, 16] uint8, scales and mins [N/16, K/32, 16] fp16 -> y [M, N]
at::Tensor tiled_linear_int4(const at::Tensor& x_in, const at::Tensor& tiles, const at::Tensor& scales,
                             const at::Tensor& mins) {
  TORCH_CHECK(has_avx512(), "tiled_linear_int4: needs AVX-512");
  TORCH_CHECK(x_in.dim() == 2 && tiles.dim() == 3 && scales.dim() == 3 && mins.dim() == 3,
              "tiled_linear_int4: x [M, K], tiles [N/16, K/2, 16], scales and mins [N/16, K/32, 16]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && tiles.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf,
              "tiled_linear_int4: fp32 x, uint8 tiles, fp16 scales and mins");
  const int64_t K = x_in.size(1), groups = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && tiles.size(1) * 2 == K && tiles.size(2) == kTile &&
                  tiles.size(0) % kPadTiles == 0 && tiles.is_contiguous() && scales.is_contiguous() &&
                  mins.is_contiguous() && scales.sizes() == mins.sizes() && scales.size(0) == tiles.size(0) &&
                  scales.size(1) == groups && scales.size(2) == kTile,
              "tiled_linear_int4: not laid out by engine.model.tiled_linear.TiledWeight.int4 for ", K, " features");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = tiles.size(0) * kTile, K2 = K / 2;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // each row's sum of x over each group, in k order (the minimums' term)
  at::Tensor xsum = at::empty({M, groups}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = xsum.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) s += xp[r * K + k];
      sp[r * groups + g] = s;
    }
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  const at::Half* scp = scales.data_ptr<at::Half>();
  const at::Half* mnp = mins.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  shared_for(N / (kTile * kPanel), [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t tile = p * kPanel;
      panel_rows<4>(xp, K, sp, groups, wp + tile * K2 * kTile, scp + tile * groups * kTile,
                    mnp + tile * groups * kTile, K2, yp + tile * kTile, N, M);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("tiled_linear_int4(Tensor x, Tensor tiles, Tensor scales, Tensor mins) -> Tensor");
  m.impl("tiled_linear_int4", c10::DispatchKey::CPU, TORCH_FN(tiled_linear_int4));
}
