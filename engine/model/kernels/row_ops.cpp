// Per-row work over a step's logits [B, V], fp32 on the CPU: logsumexp, argmax, the k largest, and penalties.
//
// Why: torch's CPU kernels for these are slow on a few wide rows: on the 2-core Xeon, [8, 49152] logits took
// 313 us for argmax, 157 us for logsumexp, 319-367 us for topk(5)/topk(50), against about 17 us to read them
// once (amax). Every step runs logsumexp and argmax, and a sampled row with top_k or top logprobs runs topk too.
// Penalties in torch took a compare, an OR and two nonzero passes over every penalised row (~1 ms at 8 rows).
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

// One value of type T per row of x: wide(row, n) with AVX-512, else narrow(row, n).
template <typename T, typename Wide, typename Narrow>
at::Tensor per_row(const at::Tensor& x, const char* name, bool avx2, Wide wide, Narrow narrow) {
  check_logits(x, name);
  const int64_t b = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({b}, x.options().dtype(c10::CppTypeToScalarType<T>::value));
  const float* xp = x.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const bool use_wide = has_avx512() && !avx2;
  at::parallel_for(0, b, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) op[r] = use_wide ? wide(xp + r * stride, n) : narrow(xp + r * stride, n);
  });
  return out;
}

at::Tensor row_logsumexp(const at::Tensor& x, bool avx2) {
  return per_row<float>(x, "row_logsumexp", avx2, avx512::row_logsumexp, avx2::row_logsumexp);
}

at::Tensor row_argmax(const at::Tensor& x, bool avx2) {
  return per_row<int64_t>(x, "row_argmax", avx2, avx512::row_argmax, avx2::row_argmax);
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

// Penalties in place on logits rows `rows` [P]: counts[count_rows[p]] holds row p's output-token counts, prompt
// [P, V] (optional: only when a row has a repetition penalty) its prompt tokens, settings [P, 3] its repetition,
// presence and frequency penalties.
void penalize_(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& counts,
               const at::Tensor& count_rows, const std::optional<at::Tensor>& prompt, const at::Tensor& settings,
               bool avx2) {
  check_logits(logits, "penalize_");
  const int64_t b = logits.size(0), n = logits.size(1), p = rows.numel();
  TORCH_CHECK(counts.scalar_type() == at::kFloat && counts.dim() == 2 && counts.size(1) == n && counts.is_contiguous(),
              "penalize_: fp32 counts [N, V] like the logits");
  for (const at::Tensor* t : {&rows, &count_rows})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() && t->numel() == p,
                "penalize_: rows and count_rows as int64 [P]");
  TORCH_CHECK(settings.scalar_type() == at::kFloat && settings.is_contiguous() && settings.dim() == 2 &&
                  settings.size(0) == p && settings.size(1) == 3,
              "penalize_: fp32 settings [P, 3]");
  if (prompt)
    TORCH_CHECK(prompt->scalar_type() == at::kBool && prompt->is_contiguous() && prompt->dim() == 2 &&
                    prompt->size(0) == p && prompt->size(1) == n,
                "penalize_: a bool prompt mask [P, V]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* cp = count_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < p; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < b && cp[i] >= 0 && cp[i] < counts.size(0), "penalize_: row out of range");
  float* xp = logits.data_ptr<float>();
  const float* counts_p = counts.data_ptr<float>();
  const bool* pp = prompt ? prompt->data_ptr<bool>() : nullptr;
  const float* sp = settings.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const bool wide = has_avx512() && !avx2;
  at::parallel_for(0, p, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* x = xp + rp[i] * stride;
      const float* c = counts_p + cp[i] * n;
      const bool* seen = pp ? pp + i * n : nullptr;
      if (wide)
        avx512::penalize_row(x, c, seen, n, sp[3 * i], sp[3 * i + 1], sp[3 * i + 2]);
      else
        avx2::penalize_row(x, c, seen, n, sp[3 * i], sp[3 * i + 1], sp[3 * i + 2]);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("row_logsumexp(Tensor x, bool avx2=False) -> Tensor");
  m.impl("row_logsumexp", c10::DispatchKey::CPU, TORCH_FN(row_logsumexp));
  m.def("row_argmax(Tensor x, bool avx2=False) -> Tensor");
  m.impl("row_argmax", c10::DispatchKey::CPU, TORCH_FN(row_argmax));
  m.def("row_topk(Tensor x, int k, bool avx2=False) -> (Tensor, Tensor)");
  m.impl("row_topk", c10::DispatchKey::CPU, TORCH_FN(row_topk));
  m.def("penalize_(Tensor(a!) logits, Tensor rows, Tensor counts, Tensor count_rows, Tensor? prompt, "
        "Tensor settings, bool avx2=False) -> ()");
  m.impl("penalize_", c10::DispatchKey::CPU, TORCH_FN(penalize_));
}
