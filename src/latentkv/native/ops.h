// What the matrix-product ops (decode.cpp, bf16.cpp) share: the vector-path and residual checks,
// how many output units one thread takes, and the expert shapes built on a format's product
// (experts.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>

#include "native.h"

namespace latentkv_native {

inline void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 4, "latentkv kernels: isa (vector path) must be 0..4, got ", isa);
  TORCH_CHECK(cpu_has(isa), "latentkv kernels: this CPU lacks the instructions of path ", isa);
}

// The residual's rows (row stride in *ld), or nullptr without one; float32 [M, N], unit column stride.
inline const float* residual_of(const std::optional<at::Tensor>& r, int64_t M, int64_t N, int64_t* ld) {
  if (!r.has_value()) return nullptr;
  const at::Tensor& t = *r;
  TORCH_CHECK(t.dim() == 2 && t.size(0) == M && t.size(1) == N && t.scalar_type() == at::kFloat &&
                  t.stride(1) == 1,
              "residual must be float32 [M, N] with unit column stride");
  *ld = t.stride(0);
  return t.data_ptr<float>();
}

// Units per thread chunk (at least 256 KB of weights): small matrices run on the calling thread
// (a parallel region costs more).
inline int64_t grain(int64_t bytes_per_unit) {
  return std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, bytes_per_unit));
}

// ---- experts over any format's product (experts.cpp) ----------------------------------------

// y [M, ldy] = x [M, K] (row stride ldx) times a matrix the closure holds (+ res, row stride ldr)
using Product = std::function<void(const float* x, int64_t K, int64_t ldx, float* y, const float* res, int64_t ldr)>;
// expert e's SwiGLU of n rows of x (row stride ldx) into y [n, D]
using ExpertRun = std::function<void(int64_t e, const float* x, int64_t n, int64_t ldx, float* y)>;

// h [M, 2I] (gate | up) -> act [M, I] = silu(gate) * up
void silu_mul(float* h, int64_t M, int64_t I, float* act);
// x [M, K] -> down(silu(gate(x)) * up(x)) [M, D] (+ residual)
at::Tensor swiglu(const at::Tensor& x, int64_t I, int64_t D, const Product& gate_up, const Product& down,
                  const std::optional<at::Tensor>& residual);
// x [N, K], idx / w [N, k] -> [N, D]: the router-weighted sum of each token's experts
at::Tensor moe(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, int64_t E, int64_t D,
               bool by_id, const ExpertRun& run_expert);

}  // namespace latentkv_native
