// What the matrix-product ops (decode.cpp, bf16.cpp) share: the vector-path and residual checks,
// and how many output units one thread takes.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
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

}  // namespace latentkv_native
