// The two shapes every expert kernel takes, whatever its weights' format (decode.cpp: int8, int4;
// bf16.cpp: bfloat16), over that format's product:
//
//   swiglu: down(silu(gate(x)) * up(x)) for the rows of x, gate_up [2I, D] (gate rows first) and
//       down [D, I]: the two products with the activation between them in a scratch buffer, no
//       tensor per step. silu(g) = g / (1 + exp(-g)), exp as the C library computes it.
//   moe: out[n] = sum over the token's k experts, in a fixed order, of w[n, j] * expert_e(x[n]):
//       each expert computed once over the rows routed to it (ascending token order), its output
//       multiplied by the router weight and added, exactly as the MoE layer adds a store's outputs
//       (`y * w`, then `out + that`): by expert id (`by_id`, the grouped pass) or in the router's
//       column order (a lone token).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

namespace latentkv_native {

void silu_mul(float* h, int64_t M, int64_t I, float* act) {
  // h [M, 2I] (gate | up) -> act [M, I]
  at::parallel_for(0, M * I, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / I, j = i % I;
      const float g = h[m * 2 * I + j], u = h[m * 2 * I + I + j];
      act[i] = g / (1.0f + std::exp(-g)) * u;
    }
  });
}

at::Tensor swiglu(const at::Tensor& x, int64_t I, int64_t D, const Product& gate_up, const Product& down,
                  const std::optional<at::Tensor>& residual) {
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, D}, x.options());
  int64_t ldr = 0;
  const float* res = residual_of(residual, M, D, &ldr);
  if (M == 0) return y;
  std::vector<float> h(M * 2 * I), act(M * I);
  gate_up(x.data_ptr<float>(), x.size(1), x.stride(0), h.data(), nullptr, 0);
  silu_mul(h.data(), M, I, act.data());
  down(act.data(), I, I, y.data_ptr<float>(), res, ldr);
  return y;
}

at::Tensor moe(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, int64_t E, int64_t D,
               bool by_id, const ExpertRun& run_expert) {
  TORCH_CHECK(idx.dim() == 2 && idx.scalar_type() == at::kLong && idx.size(0) == x.size(0),
              "idx must be int64 [N, k]");
  TORCH_CHECK(w.sizes() == idx.sizes() && w.scalar_type() == at::kFloat, "weights must be float32 [N, k]");
  const at::Tensor ic = idx.contiguous(), wc = w.contiguous();
  const int64_t N = idx.size(0), k = idx.size(1), ldx = x.stride(0);
  const int64_t* ip = ic.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  std::vector<std::vector<int64_t>> rows(E);  // tokens routed to each expert, ascending
  std::vector<int64_t> slot(N * k);           // (token, column) -> row of its expert's output
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ip[n * k + j];
      TORCH_CHECK(e >= 0 && e < E, "expert id ", e, " out of range [0, ", E, ")");
      TORCH_CHECK(rows[e].empty() || rows[e].back() != n, "token ", n, " routed twice to expert ", e);
      slot[n * k + j] = static_cast<int64_t>(rows[e].size());
      rows[e].push_back(n);
    }
  std::vector<std::vector<float>> out_e(E);
  std::vector<float> gathered;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(rows[e].size());
    if (n == 0) continue;
    out_e[e].resize(n * D);
    if (N == 1) {
      run_expert(e, xp, 1, ldx, out_e[e].data());
      continue;
    }
    gathered.resize(n * x.size(1));
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(gathered.data() + r * x.size(1), xp + rows[e][r] * ldx, x.size(1) * sizeof(float));
    run_expert(e, gathered.data(), n, x.size(1), out_e[e].data());
  }
  at::Tensor out = at::zeros({N, D}, x.options());
  float* op = out.data_ptr<float>();
  std::vector<int64_t> order(k);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < k; ++j) order[j] = j;
    if (by_id) std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ip[n * k + a] < ip[n * k + b]; });
    float* on = op + n * D;
    for (int64_t j : order) {
      const int64_t e = ip[n * k + j];
      const float* y = out_e[e].data() + slot[n * k + j] * D;
      const float wt = wp[n * k + j];
      for (int64_t d = 0; d < D; ++d) {
        const float t = y[d] * wt;
        on[d] = on[d] + t;
      }
    }
  }
  return out;
}

}  // namespace latentkv_native
