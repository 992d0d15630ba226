// y[M, N] = x[M, K] @ W^T with bf16 weights, on CPUs with AVX512_BF16 (engine.model.tiled_linear.runs), W
// laid out once at load as column tiles of k pairs [N/16, K/2, 16, 2] (engine/model/tiled_linear.py). x is bf16, or
// fp32 rounded to bf16 as it is read; y is bf16 (rounded once, nearest even, as torch rounds) or the fp32
// accumulators.
//
// Why our own: oneDNN's bf16 GEMMs switch kernels with the row count (AMX from some M on), so a row's bits depended
// on its batch. Here every output element is one fixed chain of bf16 pair products into fp32 in k order, whatever
// M is or which row it is: a row's result is bit-identical alone, in any batch, in prefill or decode. Two variants,
// picked by the CPU and the weight's shape alone, never by the row count:
// - AMX (K a multiple of 32): tile multiplies of 16 rows x 16 columns x 32 k; x is zero-padded to whole tiles.
//   SmolLM2's linears, 30 layers, 2-core Xeon: 5.7 ms at 1 row, 8.3 at 8, 7.7 at 16, 52 at 512 (2.1 TFLOP/s),
//   against our fp32 kernel's 9.1 / 13.0 / 19.2 / 363 and prepacked oneDNN bf16's 7.1 / 10.2 / 11.4 / 74 (50 at 512
//   rows on 2026-12-04, when ours went from 60 to 52: `amx_units`).
// - vdpbf16ps (a CPU with AVX512_BF16 but no AMX, or a K that is not a multiple of 32): the fp32 kernel's register
//   blocks (tiled_linear.cpp), one instruction adding a k pair's products for 16 columns. On the AVX-512 EPYC
//   (Zen 4, no AMX) it runs SmolLM2's linears at ~370 GFLOP/s at 512 rows, within 5 % of oneDNN's bf16 (the same
//   instruction) and ahead of it at decode's row counts (engine/model/tiled_linear.py `runs`).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "amx.h"
#include "shared_work.h"

namespace {

constexpr int kTile = 16;      // output columns per tile
constexpr int kPanel = 3;      // tiles per register block (48 columns; 8 rows x 3 = 24 of the 32 zmm accumulators)
constexpr int kPadTiles = 6;   // N padded as the fp32 layout pads it
constexpr int kPairBytes = kTile * 2 * 2;  // one tile's k pair: 16 columns x 2 bf16
constexpr int kPrefetch = 24;  // k pairs ahead

#define SIE_BF16 __attribute__((target("avx512f,avx512bf16")))

// y: bf16 (rounded to nearest even, as torch rounds) or fp32 (the accumulators as they are)
template <int MT, typename Out>
SIE_BF16 inline void block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K2, Out* y, int64_t ldy) {
  __m512 acc[MT][kPanel];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPanel; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512i wv[kPanel];
    for (int j = 0; j < kPanel; ++j) {
      const char* t = reinterpret_cast<const char*>(w) + (j * K2 + k2) * kPairBytes;
      _mm_prefetch(t + kPrefetch * kPairBytes, _MM_HINT_T0);
      wv[j] = _mm512_loadu_si512(t);
    }
    for (int i = 0; i < MT; ++i) {
      int32_t pair;  // x[k], x[k+1] as one 32-bit lane, broadcast
      std::memcpy(&pair, x + i * ldx + 2 * k2, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kPanel; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPanel; ++j) {
      if constexpr (std::is_same_v<Out, float>)
        _mm512_storeu_ps(y + i * ldy + j * kTile, acc[i][j]);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ldy + j * kTile),
                            (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
    }
}

// Register blocks of 8 rows, then one block of the rest (7..1).
template <int MT, typename Out>
SIE_BF16 void panel_rows(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K2, Out* y, int64_t ldy,
                         int64_t m) {
  int64_t i = 0;
  for (; i + MT <= m; i += MT) block<MT>(x + i * ldx, ldx, w, K2, y + i * ldy, ldy);
  if constexpr (MT > 1) {
    if (i < m) panel_rows<MT - 1>(x + i * ldx, ldx, w, K2, y + i * ldy, ldy, m - i);
  }
}

template <typename Out>
void run_panels(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K2, int64_t N, Out* y) {
  shared_for(N / (kTile * kPanel), [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      panel_rows<8>(x, 2 * K2, w + p * kPanel * K2 * 2 * kTile, K2, y + p * kPanel * kTile, N, M);
  });
}

// ---- AMX: the same product on the tile unit, where the CPU has AMX-BF16 and the OS lets this process use it ----
//
// A tile multiply adds 16 rows x 16 columns x 16 k pairs at once, about 8x the pairs a vdpbf16ps adds per cycle.
// The weight layout is already what a B tile wants (16 k pairs of 16 columns, 64 bytes a row). Every output
// element is the same chain of tile multiplies in k order whatever the row count (x is zero-padded to whole
// 16-row tiles), so AMX keeps the batch invariance; its bits differ from the vdpbf16ps kernel's, and the kernel
// picks one of the two by the CPU and the weight's shape alone, never by the row count.

// Tiles 0-3: the fp32 accumulators (row block r, column tile c at 2r + c); 4-5: x's row blocks; 6-7: the two
// weight tiles (amx.h's configuration).

// c [RB*16, 32] fp32 (rows ldc floats apart) = x rows [RB*16, K] . two weight tiles' columns, over all K/32 k
// blocks in order. x is in A-tile blocks (`block_rows`): the 16 rows x 32 k of each tile in one 1 KB run.
template <int RB>
SIE_AMX void amx_block(const uint16_t* x, int64_t K2, const uint16_t* w0, const uint16_t* w1, float* c,
                       int64_t ldc) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < K2; kb += 16) {
    _tile_loadd(4, x + 32 * kb, 64);  // row block 0, k block kb / 16
    if constexpr (RB == 2) _tile_loadd(5, x + 16 * 2 * K2 + 32 * kb, 64);
    _tile_loadd(6, w0 + kb * 2 * kTile, 64);
    _tile_loadd(7, w1 + kb * 2 * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RB == 2) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 4 * ldc);
  _tile_stored(1, c + 16, 4 * ldc);
  if constexpr (RB == 2) {
    _tile_stored(2, c + 16 * ldc, 4 * ldc);
    _tile_stored(3, c + 16 * ldc + 16, 4 * ldc);
  }
}

template <typename Out>
SIE_AMX void store_row(const float* c, Out* y) {
  for (int j = 0; j < 2; ++j) {
    const __m512 v = _mm512_loadu_ps(c + j * kTile);
    if constexpr (std::is_same_v<Out, float>)
      _mm512_storeu_ps(y + j * kTile, v);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j * kTile), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Column pairs first..last-1 of y [M, N] from x [Mp, K] bf16 (Mp = M rounded up to 16, zero rows past M), in groups
// of kGroup pairs: each 32-row block of x (in tile blocks, `block_rows`) runs against a group's pairs in turn, so
// it is reused from L1 while the group's weights (kGroup x K x 128 bytes) stay in L2. Column pairs outermost
// re-read all of x from L2 or beyond for every pair. SmolLM2's 120 linears, one layer's weights hot: 60 -> 52 ms
// at 512 rows, 227 -> 156 at 1,546; with all 30 layers' weights (streamed from memory) 512 rows take ~60. Software
// prefetch of the next group's weights cost 5 ms more (L2 pollution). The order of the blocks never changes what
// one output element sums.
constexpr int64_t kGroup = 8;

template <typename Out>
SIE_AMX void amx_units(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K2, int64_t N, Out* y,
                       int64_t first, int64_t last) {
  const int64_t padded_rows = (M + 15) / 16 * 16;
  load_tile_config();  // per thread: the tile configuration is thread state
  alignas(64) float c[32 * 32];
  for (int64_t group = first; group < last; group += kGroup) {
    for (int64_t r = 0; r < padded_rows; r += 32) {
      const int64_t blocks = padded_rows - r >= 32 ? 2 : 1;
      for (int64_t u = group; u < std::min(last, group + kGroup); ++u) {
        const uint16_t* w0 = w + 2 * u * K2 * 2 * kTile;
        const uint16_t* w1 = w0 + K2 * 2 * kTile;
        if constexpr (std::is_same_v<Out, float>) {
          if (r + 32 <= M) {  // fp32 out, a whole block: the tiles go straight to y
            amx_block<2>(x + r * 2 * K2, K2, w0, w1, y + r * N + u * 2 * kTile, N);
            continue;
          }
        }
        if (blocks == 2)
          amx_block<2>(x + r * 2 * K2, K2, w0, w1, c, 32);
        else
          amx_block<1>(x + r * 2 * K2, K2, w0, w1, c, 32);
        for (int64_t i = 0; i < std::min<int64_t>(16 * blocks, M - r); ++i)
          store_row(c + i * 32, y + (r + i) * N + u * 2 * kTile);
      }
    }
  }
  _tile_release();
}

// x [M, K] -> dst in A-tile blocks [Mp/16, K/32, 16, 32] bf16 (zero rows past M were zeroed by the caller), fp32
// rounded to nearest even as torch rounds, across both cores. Why blocks: a 32-row block of x, which the kernel
// multiplies by a group of weight pairs in turn, is then two contiguous runs that stay in L1 (row-major, its
// tiles read 64 bytes from each of 32 rows apart; SmolLM2's linears at 512 rows took 8 % longer). Why our own
// rounding: torch's copy_ did it at ~6 GB/s, 5 % of a bf16 prefill. K is a multiple of 32.
SIE_BF16 void block_row(const float* src, int64_t K, uint16_t* dst) {
  for (int64_t k = 0; k < K; k += 32)
    _mm512_storeu_si512(dst + 16 * k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16),
                                                                   _mm512_loadu_ps(src + k)));
}

SIE_BF16 void block_row(const uint16_t* src, int64_t K, uint16_t* dst) {
  for (int64_t k = 0; k < K; k += 32) _mm512_storeu_si512(dst + 16 * k, _mm512_loadu_si512(src + k));
}

template <typename In>
void block_rows(const In* src, int64_t src_stride, int64_t M, int64_t K, uint16_t* dst) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) block_row(src + r * src_stride, K, dst + (r / 16) * 16 * K + (r % 16) * 32);
  });
}

template <typename Out>
void amx_panels(const uint16_t* x, const uint16_t* w, int64_t M, int64_t K2, int64_t N, Out* y) {
  at::parallel_for(0, N / (2 * kTile), 1,
                   [&](int64_t first, int64_t last) { amx_units(x, w, M, K2, N, y, first, last); });
}

// x [M, K] (K even; fp32 is rounded to bf16 first), tiles [N/16, K/2, 32] bf16 (N/16 a multiple of kPadTiles) ->
// y [M, N], fp32 when `float_out`, else bf16.
// `amx`: use the tile unit where it runs and K is a multiple of 32 (false: the vdpbf16ps kernel, for tests).
at::Tensor tiled_linear_bf16(const at::Tensor& x_in, const at::Tensor& tiles, bool float_out, bool amx) {
  TORCH_CHECK(has_avx512_bf16(), "tiled_linear_bf16: this CPU has no AVX512_BF16");
  TORCH_CHECK(x_in.dim() == 2 && tiles.dim() == 3, "tiled_linear_bf16: x [M, K] and tiles [N/16, K/2, 32]");
  TORCH_CHECK((x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat) &&
                  tiles.scalar_type() == at::kBFloat16,
              "tiled_linear_bf16: bf16 tiles, bf16 or fp32 x");
  TORCH_CHECK(tiles.is_contiguous() && tiles.size(2) == 2 * kTile && tiles.size(0) % kPadTiles == 0,
              "tiled_linear_bf16: tiles not laid out by engine.model.tiled_linear.TiledWeight");
  TORCH_CHECK(x_in.size(1) == 2 * tiles.size(1), "tiled_linear_bf16: x has ", x_in.size(1), " features, W ",
              2 * tiles.size(1));
  const int64_t M = x_in.size(0), K2 = tiles.size(1), N = tiles.size(0) * kTile;
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
  const bool on_amx = amx && K2 % 16 == 0 && has_amx();
  at::Tensor x;
  if (on_amx) {  // whole 16-row tiles in A-tile blocks, zero rows past M
    at::Tensor rows = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    x = at::empty({(M + 15) / 16 * 16, 2 * K2}, x_in.options().dtype(at::kBFloat16));
    auto* dst = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
    x.narrow(0, M / 16 * 16, x.size(0) - M / 16 * 16).zero_();  // the last block's rows past M read as zeros
    if (rows.scalar_type() == at::kFloat)
      block_rows(rows.data_ptr<float>(), rows.stride(0), M, 2 * K2, dst);
    else
      block_rows(reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>()), rows.stride(0), M, 2 * K2, dst);
  } else {
    x = x_in.to(at::kBFloat16).contiguous();
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  auto run = [&](auto* yp) {
    if (on_amx)
      amx_panels(xp, wp, M, K2, N, yp);
    else
      run_panels(xp, wp, M, K2, N, yp);
  };
  if (float_out)
    run(y.data_ptr<float>());
  else
    run(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("tiled_linear_bf16(Tensor x, Tensor tiles, bool float_out=False, bool amx=True) -> Tensor");
  m.def("has_avx512_bf16() -> bool", has_avx512_bf16);
  m.def("has_amx() -> bool", has_amx);
  m.impl("tiled_linear_bf16", c10::DispatchKey::CPU, TORCH_FN(tiled_linear_bf16));
}
