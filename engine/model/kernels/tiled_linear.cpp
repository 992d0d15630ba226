// y[M, N] = x[M, K] @ W^T for fp32 on the CPU, with W laid out once at load as column tiles [N/16, K, 16].
//
// Why our own: a decode step multiplies a few rows by every weight. MKL and oneDNN reach 10-25 GB/s of weight
// reads there (their small-M paths), and oneDNN's one-row kernel differs from its batched one, so a row's logits
// depended on its batch. This kernel keeps a block of outputs in registers (up to 8 rows x 48 columns), walks K once
// per block with one FMA per weight element per row, and prefetches the tile stream: faster than MKL and oneDNN at
// 1-32 rows, and on par at prefill sizes (measured in engine/model/tiled_linear.py's docstring).
//
// Every output element is the plain sequential FMA sum over k, whatever M is, which row of the batch it is, or
// which ISA variant runs (AVX-512: one 16-lane vector per tile; AVX2: two 8-lane halves, the same per-lane
// order): a row's result is bit-identical alone, in any batch, in a prefill chunk or a decode step.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include "shared_work.h"

namespace {

constexpr int kTile = 16;      // output columns per packed tile
constexpr int kPanel512 = 3;   // tiles per register block on AVX-512 (48 columns: 13-17 % faster than 32 at 1-16 rows)
constexpr int kPanel256 = 2;   // on AVX2 (32 columns: 16 ymm registers)
constexpr int kPadTiles = 6;   // the layout pads N to a multiple of both panels (engine/model/tiled_linear.py)
constexpr int kPrefetch = 24;  // k steps ahead: ~1.5 KB of each tile stream
// and into L2 from further ahead (6 KB of each stream): the L1 prefetches alone left a decode step's weight reads
// short of the memory's rate; with these SmolLM2's fp32 linears at 8 / 16 rows ran ~10-15 % faster on the AVX-512
// EPYC (alternated A/B; 1 row and 512 rows level)
constexpr int kPrefetchL2 = 96;

template <int MT>
__attribute__((target("avx512f"))) inline void block512(const float* x, int64_t ldx, const float* w, int64_t K,
                                                         float* y, int64_t ldy) {
  __m512 acc[MT][kPanel512];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPanel512; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[kPanel512];
    for (int j = 0; j < kPanel512; ++j) {
      const float* t = w + (j * K + k) * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetch * kTile), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchL2 * kTile), _MM_HINT_T1);
      wv[j] = _mm512_loadu_ps(t);
    }
    for (int i = 0; i < MT; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
      for (int j = 0; j < kPanel512; ++j) acc[i][j] = _mm512_fmadd_ps(xb, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPanel512; ++j) _mm512_storeu_ps(y + i * ldy + j * kTile, acc[i][j]);
}

template <int MT>
__attribute__((target("avx2,fma"))) inline void block256(const float* x, int64_t ldx, const float* w, int64_t K,
                                                          float* y, int64_t ldy) {
  constexpr int V = kPanel256 * 2;  // 8-lane halves
  __m256 acc[MT][V];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < V; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[V];
    for (int j = 0; j < kPanel256; ++j) {
      const float* t = w + (j * K + k) * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetch * kTile), _MM_HINT_T0);
      wv[2 * j] = _mm256_loadu_ps(t);
      wv[2 * j + 1] = _mm256_loadu_ps(t + 8);
    }
    for (int i = 0; i < MT; ++i) {
      const __m256 xb = _mm256_set1_ps(x[i * ldx + k]);
      for (int j = 0; j < V; ++j) acc[i][j] = _mm256_fmadd_ps(xb, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < V; ++j) _mm256_storeu_ps(y + i * ldy + j * 8, acc[i][j]);
}

using Block = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);

// Register blocks of up to 8 rows on AVX-512 (24 accumulators of 32 registers), 2 on AVX2 (8 of 16), then the
// rest.
template <template <int> class Pick, int MT>
void panel_rows(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t m) {
  int64_t i = 0;
  for (; i + MT <= m; i += MT) Pick<MT>::fn(x + i * ldx, ldx, w, K, y + i * ldy, ldy);
  if constexpr (MT > 1) {
    if (i < m) panel_rows<Pick, MT - 1>(x + i * ldx, ldx, w, K, y + i * ldy, ldy, m - i);
  }
}

template <int MT>
struct Avx512 {
  static constexpr Block fn = block512<MT>;
};
template <int MT>
struct Avx2 {
  static constexpr Block fn = block256<MT>;
};

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// x [M, K] fp32, tiles [N/16, K, 16] fp32 (N/16 a multiple of kPadTiles) -> y [M, N]. `avx2`: force the AVX2
// variant (tests).
at::Tensor tiled_linear(const at::Tensor& x_in, const at::Tensor& tiles, bool avx2) {
  TORCH_CHECK(x_in.dim() == 2 && tiles.dim() == 3, "tiled_linear: x [M, K] and tiles [N/16, K, 16]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && tiles.scalar_type() == at::kFloat, "tiled_linear: fp32 only");
  TORCH_CHECK(tiles.is_contiguous() && tiles.size(2) == kTile && tiles.size(0) % kPadTiles == 0,
              "tiled_linear: tiles not laid out by engine.model.tiled_linear.pack");
  TORCH_CHECK(x_in.size(1) == tiles.size(1), "tiled_linear: x has ", x_in.size(1), " features, W ", tiles.size(1));
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = tiles.size(0) * kTile;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = tiles.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool wide = has_avx512() && !avx2;
  const int panel = wide ? kPanel512 : kPanel256;
  shared_for(N / (kTile * panel), [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const float* w = wp + p * panel * K * kTile;
      float* out = yp + p * panel * kTile;
      if (wide)
        panel_rows<Avx512, 8>(xp, K, w, K, out, N, M);
      else
        panel_rows<Avx2, 2>(xp, K, w, K, out, N, M);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(sie_kernels, m) {
  m.def("tiled_linear(Tensor x, Tensor tiles, bool avx2=False) -> Tensor");
  m.impl("tiled_linear", c10::DispatchKey::CPU, TORCH_FN(tiled_linear));
}
