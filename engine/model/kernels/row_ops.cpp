// Per-row reductions over a step's logits [B, V], fp32 on the CPU: logsumexp, argmax and the k largest.
//
// Why: torch's CPU kernels for these are slow on a few wide rows: on the 2-core Xeon, [8, 49152] logits took
// 313 us for argmax, 157 us for logsumexp, 319-367 us for topk(5)/topk(50), against about 17 us to read them
// once (amax). Every step runs logsumexp and argmax, and a sampled row with top_k or top logprobs runs topk too.
// Each row is reduced alone in a fixed order, so its results do not depend on its batch.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

#define SIE_BODY "row_ops_body.h"
#include "isa_variants.h"
#undef SIE_BODY

void check_logits(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, name,
              ": fp32 logits [B, V] with contiguous rows");
}

at::Tensor row_logsumexp(const at::Tensor& x, bool avx2) {
  check_logits(x, "row_logsumexp");
  const int64_t b = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({b}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = has_avx512() && !avx2;
  at::parallel_for(0, b, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      op[r] = wide ? avx512::row_logsumexp(xp + r * stride, n) : avx2::row_logsumexp(xp + r * stride, n);
  });
  return out;
}

at::Tensor row_argmax(const at::Tensor& x, bool avx2) {
  check_logits(x, "row_argmax");
  const int64_t b = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({b}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const bool wide = has_avx512() && !avx2;
  at::parallel_for(0, b, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      op[r] = wide ? avx512::row_argmax(xp + r * stride, n) : avx2::row_argmax(xp + r * stride, n);
  });
  return out;
}

// (values [B, k], indices [B, k]) of each row's k largest, by value descending then index ascending
std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& x, int64_t k, bool avx2) {
  check_logits(x, "row_topk");
  const int64_t b = x.size(0), n = x.size(1), stride = x.stride(0);
  TORCH_CHECK(k >= 1 && k <= n, "row_topk: k from 1 to the row length");
  at::Tensor values = at::empty({b, k}, x.options());
  at::Tensor indices = at::empty({b, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  const bool wide = has_avx512() && !avx2;
  at::parallel_for(0, b, 1, [&](int64_t lo, int64_t hi) {
    std::vector<std::pair<float, int64_t>> buf;
    std::vector<float> block_maxima;
    buf.reserve(static_cast<size_t>(2 * k + 64));
    for (int64_t r = lo; r < hi; ++r) {
      if (wide)
        avx512::row_topk(xp + r * stride, n, k, vp + r * k, ip + r * k, buf, block_maxima);
      else
        avx2::row_topk(xp + r * stride, n, k, vp + r * k, ip + r * k, buf, block_maxima);
    }
  });
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("row_logsumexp(Tensor x, bool avx2=False) -> Tensor");
  m.impl("row_logsumexp", c10::DispatchKey::CPU, TORCH_FN(row_logsumexp));
  m.def("row_argmax(Tensor x, bool avx2=False) -> Tensor");
  m.impl("row_argmax", c10::DispatchKey::CPU, TORCH_FN(row_argmax));
  m.def("row_topk(Tensor x, int k, bool avx2=False) -> (Tensor, Tensor)");
  m.impl("row_topk", c10::DispatchKey::CPU, TORCH_FN(row_topk));
}
