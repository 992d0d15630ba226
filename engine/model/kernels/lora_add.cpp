// A LoRA delta added to a fused linear's output in one call, fp32 on the CPU: out[rows] += (x[rows] @ A^T) @ B^T.
//
// Why: in torch this is two matmuls and an add (and a gather and a scatter for mixed batches), and in a decode step
// each of those tiny MKL calls took 13-20 us, ~120 of them a step: LoRA rows ran ~13 % slower than base rows.
// Here it is one call per fused weight. Every row is computed alone in a fixed order (blocks of rows only share
// loads of B), so an adapter row's bits do not depend on its batch either.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

namespace {

constexpr int64_t kLoraRows = 8;   // rows sharing one pass over B
constexpr int64_t kMaxRank = 512;  // summed rank of a fused weight's slices (a stack buffer per row block)
constexpr int64_t kMinPartColumns = 256;  // a column part below this is not worth a thread's wake-up

#define SIE_BODY "lora_add_body.h"
#include "isa_variants.h"
#undef SIE_BODY

void check_matrix(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, "lora_add_: fp32 ", what,
              " [rows, features] with contiguous features");
  TORCH_CHECK(t.size(1) % 16 == 0, "lora_add_: ", what, " width a multiple of 16");
}

// out [M, N] += (x [M, K] @ a [R, K]^T) @ b_t [R, N] on the rows listed in `rows` (int64), or on all M.
void lora_add_(const at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& rows,
               const at::Tensor& a, const at::Tensor& b_t, bool avx2) {
  check_matrix(out, "out");
  check_matrix(x, "x");
  const int64_t k = x.size(1), n = out.size(1), r = a.size(0);
  TORCH_CHECK(x.size(0) == out.size(0), "lora_add_: x and out with the same rows");
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.dim() == 2 && a.size(1) == k,
              "lora_add_: a contiguous fp32 A [R, K]");
  TORCH_CHECK(b_t.scalar_type() == at::kFloat && b_t.is_contiguous() && b_t.dim() == 2 && b_t.size(0) == r &&
                  b_t.size(1) == n,
              "lora_add_: a contiguous fp32 B^T [R, N]");
  TORCH_CHECK(r >= 1 && r <= kMaxRank, "lora_add_: a rank of 1 to ", kMaxRank);
  const int64_t* rp = nullptr;
  int64_t count = out.size(0);
  if (rows) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->dim() == 1,
                "lora_add_: rows as contiguous int64 [count]");
    rp = rows->data_ptr<int64_t>();
    count = rows->numel();
    for (int64_t i = 0; i < count; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < out.size(0), "lora_add_: row out of range");
  }
  float* op = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b_t.data_ptr<float>();
  const int64_t os = out.stride(0), xs = x.stride(0);
  const bool wide = has_avx512() && !avx2;
  // tasks: row blocks, each cut into column parts when there are fewer blocks than threads (a decode step's
  // few rows still use every core; each part redoes its block's small x @ A^T)
  const int64_t blocks = (count + kLoraRows - 1) / kLoraRows;
  const int64_t parts = std::max<int64_t>(1, std::min(at::get_num_threads() / blocks, n / kMinPartColumns));
  const int64_t part_columns = (n / 16 + parts - 1) / parts * 16;
  at::parallel_for(0, blocks * parts, 1, [&](int64_t lo, int64_t hi) {
    float h[kLoraRows * kMaxRank];
    float* outs[kLoraRows];
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t first = task / parts * kLoraRows, size = std::min(kLoraRows, count - first);
      const int64_t col_lo = task % parts * part_columns, col_hi = std::min(n, col_lo + part_columns);
      for (int64_t q = 0; q < size; ++q) {
        const int64_t row = rp ? rp[first + q] : first + q;
        outs[q] = op + row * os;
        if (wide)
          avx512::lora_shrink(xp + row * xs, ap, r, k, h + q * r);
        else
          avx2::lora_shrink(xp + row * xs, ap, r, k, h + q * r);
      }
      if (wide)
        avx512::lora_expand(outs, h, size, r, bp, n, col_lo, col_hi);
      else
        avx2::lora_expand(outs, h, size, r, bp, n, col_lo, col_hi);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sie_kernels, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor? rows, Tensor a, Tensor b_t, bool avx2=False) -> ()");
  m.impl("lora_add_", c10::DispatchKey::CPU, TORCH_FN(lora_add_));
}
