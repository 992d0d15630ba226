// The CPU's bf16 units: whether it has AVX512_BF16 (vdpbf16ps) and whether this process may use the AMX tile unit,
// and the one tile configuration our kernels share (eight tiles of 16 rows x 64 bytes: a tile multiply adds 16 rows
// x 16 columns x 16 bf16 pairs into fp32). Included by tiled_linear_bf16.cpp and attention_bf16.cpp.
#pragma once

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

#define SIE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return yes;
}

inline bool has_amx() {
  static const bool yes = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return yes;
}

// Per thread (the configuration is thread state), before its first tile op; `release_tiles()` after its last.
SIE_AMX inline void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // GCC does not count ldtilecfg as a read of cfg and, inlined, dropped the stores above: a compiler barrier
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

SIE_AMX inline void release_tiles() { _tile_release(); }

}  // namespace
