// The element-wise work between a layer's linears, fused, fp32 on the CPU: RMSNorm (with the residual add before
// it), RoPE in place, and SiLU(gate) * up.
//
// Why: torch runs each of these as several ops (RMSNorm alone is pow, mean, add, rsqrt and two multiplies), each a
// dispatch and a pass over memory. In a 1.5k-token prefill they took 12 % of the time; in a decode step of a
// few rows they are dispatch overhead, about 20 ops a layer. Here each is one pass and one call. Rows are
// independent and each is computed the same way whatever the row count, so a row's bits do not depend on its batch.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>

namespace {

#define SIE_BODY "layer_ops_body.h"
#include "isa_variants.h"
#undef SIE_BODY

constexpr int64_t kGrainElements = 32768;  // rows per thread task: a decode step's few rows stay on one thread

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / row_elements); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, name,
              ": fp32 rows [M, K] with contiguous features");
  TORCH_CHECK(x.size(1) % 16 == 0, name, ": a row length that is a multiple of 16");
}

// h [M, K] (updated in place to h + delta when delta is given), weight [K] -> RMSNorm(h) * weight [M, K]
at::Tensor rms_norm(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                    double eps, bool avx2) {
  check_rows(h, "rms_norm");
  const int64_t m = h.size(0), k = h.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == k,
              "rms_norm: an fp32 weight of the row length");
  if (delta) {
    check_rows(*delta, "rms_norm");
    TORCH_CHECK(delta->sizes() == h.sizes(), "rms_norm: delta shaped as h");
  }
  at::Tensor out = at::empty({m, k}, h.options());
  float* hp = h.data_ptr<float>();
  const float* dp = delta ? delta->data_ptr<float>() : nullptr;
  const int64_t hs = h.stride(0), ds = delta ? delta->stride(0) : 0;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = has_avx512() && !avx2;
  at::parallel_for(0, m, grain(k), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* d = dp ? dp + r * ds : nullptr;
      if (wide)
        avx512::rms_norm_row(hp + r * hs, d, wp, k, static_cast<float>(eps), op + r * k);
      else
        avx2::rms_norm_row(hp + r * hs, d, wp, k, static_cast<float>(eps), op + r * k);
    }
  });
  return out;
}

// x [N, H, D] in place (rows any stride apart, heads contiguous); cos, sin_signed [N, D] (each row's position)
void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed, bool avx2) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope_: fp32 x [N, H, D] with contiguous heads");
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 32 == 0, "rope_: a head dim that is a multiple of 32");
  for (const at::Tensor* t : {&cos, &sin_signed})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == n &&
                    t->size(1) == d,
                "rope_: fp32 tables [N, D]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin_signed.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const bool wide = has_avx512() && !avx2;
  at::parallel_for(0, n, grain(heads * d), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        if (wide)
          avx512::rope_head(xp + r * xs + h * d, cp + r * d, sp + r * d, d);
        else
          avx2::rope_head(xp + r * xs + h * d, cp + r * d, sp + r * d, d);
      }
  });
}

// gate_up [M, 2I] (gate, then up) -> silu(gate) * up [M, I]
at::Tensor silu_mul(const at::Tensor& gate_up, bool avx2) {
  check_rows(gate_up, "silu_mul");
  const int64_t m = gate_up.size(0), k = gate_up.size(1) / 2;
  TORCH_CHECK(k % 16 == 0, "silu_mul: a half width that is a multiple of 16");
  at::Tensor out = at::empty({m, k}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  float* op = out.data_ptr<float>();
  const bool wide = has_avx512() && !avx2;
  at::parallel_for(0, m, grain(k), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (wide)
        avx512::silu_mul_row(gp + r * gs, gp + r * gs + k, k, op + r * k);
      else
        avx2::silu_mul_row(gp + r * gs, gp + r * gs + k, k, op + r * k);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps, bool avx2=False) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin_signed, bool avx2=False) -> ()");
  m.impl("rope_", c10::DispatchKey::CPU, TORCH_FN(rope_));
  m.def("silu_mul(Tensor gate_up, bool avx2=False) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
