// The two products of attention_bf16.cpp, S = Q.K^T and O = P.V, bf16 pairs multiplied into fp32, on one of two
// units: AMX tiles where the CPU (and OS) gives AMX, vdpbf16ps (AVX512_BF16) where it does not (the AVX-512 EPYC).
// Either way each output element is one chain in a fixed order: a score over d in order, an output over its keys
// from key 0. No other row enters it, so a row's bits do not depend on the rows computed beside it. The two units
// round differently, and a process uses one of them for every call.
//
// Layouts (attention_bf16.cpp packs them): q and p rows of bf16, `ld` apart; kt the keys as [keys / 16][D / 2][16]
// dwords (a 16-key group's k pairs); vt the values as [keys / 32][D / 16][16][16] dwords (a 32-key block's pairs of
// 16 columns).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "amx.h"

namespace {

// ---- AMX: tiles 0-3 the accumulators of 2 row tiles x 2 column tiles, 4-5 the row tiles, 6-7 the column tiles ----

SIE_AMX inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// One k step of a 32 x 32 block (16 x 32 when not `two`): the row tiles at a (and 16 rows on), `lda` bf16 a row,
// times the column tiles at b0 and b1 (64 bytes a row), into accumulators 0-3.
SIE_AMX inline void multiply_step(const uint16_t* a, int64_t lda, const void* b0, const void* b1, bool two) {
  _tile_loadd(4, a, 2 * lda);
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (two) {
    _tile_loadd(5, a + 16 * lda, 2 * lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// The accumulators to c (ldc floats a row): rows 0-15 (and 16-31 when `two`) x 32 columns
SIE_AMX inline void store_accumulators(float* c, int64_t ldc, bool two) {
  _tile_stored(0, c, 4 * ldc);
  _tile_stored(1, c + 16, 4 * ldc);
  if (two) {
    _tile_stored(2, c + 16 * ldc, 4 * ldc);
    _tile_stored(3, c + 16 * ldc + 16, 4 * ldc);
  }
}

// s [rows, key_end] = q [rows, D] . kt's keys 0..key_end-1: 32 keys at a time, d in steps of 32. rows: a multiple
// of 16 (zero rows past the real ones).
SIE_AMX void scores_amx(const uint16_t* q, int64_t rows, int64_t D, const uint32_t* kt, int64_t key_end, float* s) {
  for (int64_t r = 0; r < rows; r += 32) {
    const bool two = rows - r >= 32;
    for (int64_t key = 0; key < key_end; key += 32) {
      zero_accumulators();
      for (int64_t d = 0; d < D; d += 32)
        multiply_step(q + r * D + d, D, kt + key * (D / 2) + d / 2 * 16, kt + (key + 16) * (D / 2) + d / 2 * 16, two);
      store_accumulators(s + r * key_end + key, key_end, two);
    }
  }
}

// o [rows, D] = p [rows, key_end] . vt: 32 columns at a time, keys in blocks of 32 from key 0
SIE_AMX void values_amx(const uint16_t* p, int64_t rows, int64_t key_end, const uint32_t* vt, int64_t D, float* o) {
  for (int64_t r = 0; r < rows; r += 32) {
    const bool two = rows - r >= 32;
    for (int64_t c = 0; c < D; c += 32) {
      zero_accumulators();
      for (int64_t key = 0; key < key_end; key += 32) {
        const uint32_t* v = vt + (key / 32 * (D / 16) + c / 16) * 256;
        multiply_step(p + r * key_end + key, key_end, v, v + 256, two);
      }
      store_accumulators(o + r * D + c, D, two);
    }
  }
}

// ---- vdpbf16ps: register blocks of up to 8 rows x 32 columns (16 zmm accumulators), a row's bf16 pair broadcast ----

SIE_AMX inline __m512bh broadcast_pair(const uint16_t* at) {
  int32_t pair;
  std::memcpy(&pair, at, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// acc[i] (rows i of a, lda bf16 apart) += a's pairs 0..pairs-1 . b's 16-dword column vectors, b0 and b1 a pair's
// two vectors, `step` dwords on to the next pair: each accumulator adds the pairs in order
template <int MT>
SIE_AMX inline void dot_block(__m512 (&acc)[MT][2], const uint16_t* a, int64_t lda, const uint32_t* b0,
                              const uint32_t* b1, int64_t step, int64_t pairs) {
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(b0 + i * step), v1 = (__m512bh)_mm512_loadu_si512(b1 + i * step);
    for (int r = 0; r < MT; ++r) {
      const __m512bh x = broadcast_pair(a + r * lda + 2 * i);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, v0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, v1);
    }
  }
}

template <int MT>
SIE_AMX inline void zero(__m512 (&acc)[MT][2]) {
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
}

template <int MT>
SIE_AMX inline void store(const __m512 (&acc)[MT][2], float* c, int64_t ldc) {
  for (int r = 0; r < MT; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc[r][0]);
    _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
  }
}

// block.run<MT>(r) for rows r..r+MT-1 in blocks of MT (8), then one block of the rest (7..1): only the real rows
// are computed
template <int MT, class Block>
SIE_AMX void in_row_blocks(const Block& block, int64_t rows, int64_t r = 0) {
  for (; r + MT <= rows; r += MT) block.template run<MT>(r);
  if constexpr (MT > 1) {
    if (r < rows) in_row_blocks<MT - 1>(block, rows, r);
  }
}

// S = Q.K^T, a row block against 32 keys at a time, d in pairs from 0
struct ScoresDot {
  const uint16_t* q;
  int64_t D;
  const uint32_t* kt;
  int64_t key_end;
  float* s;

  template <int MT>
  SIE_AMX void run(int64_t r) const {
    for (int64_t key = 0; key < key_end; key += 32) {
      __m512 acc[MT][2];
      zero(acc);
      dot_block(acc, q + r * D, D, kt + key * (D / 2), kt + (key + 16) * (D / 2), 16, D / 2);
      store(acc, s + r * key_end + key, key_end);
    }
  }
};

// O = P.V, a row block against 32 columns at a time, keys in blocks of 32 from key 0
struct ValuesDot {
  const uint16_t* p;
  int64_t key_end;
  const uint32_t* vt;
  int64_t D;
  float* o;

  template <int MT>
  SIE_AMX void run(int64_t r) const {
    for (int64_t c = 0; c < D; c += 32) {
      __m512 acc[MT][2];
      zero(acc);
      for (int64_t key = 0; key < key_end; key += 32) {
        const uint32_t* v = vt + (key / 32 * (D / 16) + c / 16) * 256;
        dot_block(acc, p + r * key_end + key, key_end, v, v + 256, 16, 16);
      }
      store(acc, o + r * D + c, D);
    }
  }
};

// scores_amx and values_amx on vdpbf16ps, over the real rows alone
SIE_AMX void scores_dot(const uint16_t* q, int64_t rows, int64_t D, const uint32_t* kt, int64_t key_end, float* s) {
  in_row_blocks<8>(ScoresDot{q, D, kt, key_end, s}, rows);
}

SIE_AMX void values_dot(const uint16_t* p, int64_t rows, int64_t key_end, const uint32_t* vt, int64_t D, float* o) {
  in_row_blocks<8>(ValuesDot{p, key_end, vt, D, o}, rows);
}

}  // namespace
