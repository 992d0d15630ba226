// y[M, N] = x[M, K] @ (W_q * scale)^T with int8 weights (one fp32 scale per output column), fp32 x and y, on
// AVX-512. W_q is laid out once at load as the fp32 kernel's column tiles [N/16, K, 16], one byte a weight
// (engine/model/tiled_linear.py `TiledWeight.int8`).
//
// Why: at a few rows a decode step reads every weight once, so its time is the weights' bytes over the memory's
// rate. int8 reads a quarter of fp32's bytes and half of bf16's. The activations stay fp32 (weight-only, W8A16 in
// the field's words): nothing about a row depends on the other rows, and no activation is rounded.
//
// Every output element is the plain sequential FMA sum over k of x * widened weight, then one multiply by its
// column's scale, whatever M is or which row it is: a row's result is bit-identical alone, in any batch, in a
// prefill chunk or a decode step (as in tiled_linear.cpp, whose register blocks this kernel shares).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "shared_work.h"

namespace {

constexpr int kTile = 16;      // output columns per tile
constexpr int kPanel = 3;      // tiles per register block (48 columns; 8 rows x 3 = 24 of the 32 zmm accumulators)
constexpr int kPadTiles = 6;   // N padded as the fp32 layout pads it
constexpr int kLineSteps = 4;  // k steps per 64-byte line of one tile's stream (16 columns x 1 byte x 4)
constexpr int kPrefetch = 96;  // k steps ahead (24 lines of each stream) into L1
constexpr int kPrefetchL2 = 384;

#define SIE_INT8 __attribute__((target("avx512f")))

SIE_INT8 inline __m512 widen(const int8_t* t) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t))));
}

template <int MT>
SIE_INT8 inline void block(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* scale, float* y,
                           int64_t ldy) {
  __m512 acc[MT][kPanel];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPanel; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[kPanel];
    for (int j = 0; j < kPanel; ++j) {
      const int8_t* t = w + (j * K + k) * kTile;
      if (k % kLineSteps == 0) {  // one prefetch a cache line, not one a k step
        _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetch * kTile), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchL2 * kTile), _MM_HINT_T1);
      }
      wv[j] = widen(t);
    }
    for (int i = 0; i < MT; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      for (int j = 0; j < kPanel; ++j) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]);
    }
  }
  for (int j = 0; j < kPanel; ++j) {
    const __m512 s = _mm512_loadu_ps(scale + j * kTile);
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(y + i * ldy + j * kTile, _mm512_mul_ps(acc[i][j], s));
  }
}

using Block = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, float*, int64_t);

// register blocks of up to 8 rows, then the rest
template <int MT>
void panel_rows(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* scale, float* y, int64_t ldy,
                int64_t m) {
  int64_t i = 0;
  for (; i + MT <= m; i += MT) block<MT>(x + i * ldx, ldx, w, K, scale, y + i * ldy, ldy);
  if constexpr (MT > 1) {
    if (i < m) panel_rows<MT - 1>(x + i * ldx, ldx, w, K, scale, y + i * ldy, ldy, m - i);
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// x [M, K] fp32, tiles [N/16, K, 16] int8 (N/16 a multiple of kPadTiles), scales [N] fp32 -> y [M, N] fp32
at::Tensor tiled_linear_int8(const at::Tensor& x_in, const at::Tensor& tiles, const at::Tensor& scales) {
  TORCH_CHECK(has_avx512(), "tiled_linear_int8: needs AVX-512");
  TORCH_CHECK(x_in.dim() == 2 && tiles.dim() == 3, "tiled_linear_int8: x [M, K] and tiles [N/16, K, 16]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && tiles.scalar_type() == at::kChar &&
                  scales.scalar_type() == at::kFloat, "tiled_linear_int8: fp32 x, int8 tiles, fp32 scales");
  TORCH_CHECK(tiles.is_contiguous() && tiles.size(2) == kTile && tiles.size(0) % kPadTiles == 0 &&
                  scales.is_contiguous() && scales.numel() == tiles.size(0) * kTile,
              "tiled_linear_int8: tiles not laid out by engine.model.tiled_linear.TiledWeight.int8");
  TORCH_CHECK(x_in.size(1) == tiles.size(1), "tiled_linear_int8: x has ", x_in.size(1), " features, W ",
              tiles.size(1));
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = tiles.size(0) * kTile;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = tiles.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  shared_for(N / (kTile * kPanel), [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      panel_rows<8>(xp, K, wp + p * kPanel * K * kTile, K, sp + p * kPanel * kTile, yp + p * kPanel * kTile, N, M);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("tiled_linear_int8(Tensor x, Tensor tiles, Tensor scales) -> Tensor");
  m.impl("tiled_linear_int8", c10::DispatchKey::CPU, TORCH_FN(tiled_linear_int8));
}
