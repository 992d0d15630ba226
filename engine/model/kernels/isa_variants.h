// Compiles SIE_BODY, a header written over Vec16 (vec16.h), twice: as namespace avx512 and as namespace avx2, each
// with the target attribute its intrinsics need, so one binary runs on either CPU. Callers pick a namespace at run
// time (has_avx512()). No include guard on purpose: each kernel source includes it once, with its own SIE_BODY.

#define SIE_ISA avx512
#define SIE_VEC_BITS 512
#define SIE_TARGET __attribute__((target("avx512f")))
#include "vec16.h"
#include SIE_BODY
#undef SIE_ISA
#undef SIE_VEC_BITS
#undef SIE_TARGET

#define SIE_ISA avx2
#define SIE_VEC_BITS 256
#define SIE_TARGET __attribute__((target("avx2,fma")))
#include "vec16.h"
#include SIE_BODY
#undef SIE_ISA
#undef SIE_VEC_BITS
#undef SIE_TARGET

inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}
