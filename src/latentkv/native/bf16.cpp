// A few rows of float32 activations times a bfloat16 matrix, reading the matrix once:
//
//   latentkv::bf16_mm(x f32 [M, K], w bf16 [N, K], residual?, isa) -> [M, N]
//       y[m, n] = sum_k x[m, k] * w[n, k]                            (+ residual[m, n])
//   latentkv::expert_bf16(x, gate_up bf16 [2I, D], down bf16 [D, I], residual?, isa) -> [M, D]
//       a SwiGLU expert in one call (experts.cpp's swiglu over this product)
//   latentkv::moe_bf16(x, idx [M, k], weights [M, k], gate_up [E, 2I, D], down [E, D, I], by_id, isa)
//       a layer's routed experts in one call (experts.cpp's moe), each expert a slice of the stacks
//
// Each weight is widened to float32 in registers (exact: a bfloat16 is the top half of a float32)
// and multiplied by every row of x; products and sums in float32, x as it is (not rounded to
// bfloat16, as torch.mv's bfloat16 kernel needs it). What a one-row bf16 product costs in a
// decode step is the bytes of the matrix, so the loop streams four output rows' weights at a
// time. `isa` (native/__init__.py): 2 and up AVX-512, 1 AVX2 + FMA, 0 plain C++. Output rows are
// split over torch's intra-op threads. Built with -ffp-contract=off: a residual is added after
// the product, as a separate add would.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "native.h"
#include "ops.h"

namespace {

using latentkv_native::bf16_to_f32;
using latentkv_native::check_isa;
using latentkv_native::grain;
using latentkv_native::residual_of;
using latentkv_native::silu_mul;
#if LKV_X86
using latentkv_native::hsum256;
#endif

constexpr int64_t MAX_ROWS = 4;  // rows of x per call (decode: one per sequence of a small batch)
constexpr int64_t UNIT = 4;      // output rows a tile reads together

struct Args {
  const float* x;
  int64_t M, K, ldx;
  const uint16_t* w;  // [N, K] bf16 bits
  int64_t N;
  float* y;  // [M, N]
  const float* res;
  int64_t ldr;
};

inline void store(const Args& a, int64_t m, int64_t n, float v) {
  if (a.res != nullptr) v += a.res[m * a.ldr + n];
  a.y[m * a.N + n] = v;
}

void generic(const Args& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = a.w + n * a.K;
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * a.ldx;
      float s = 0.0f;
      for (int64_t k = 0; k < a.K; ++k) s += x[k] * bf16_to_f32(row[k]);
      store(a, m, n, s);
    }
  }
}

#if LKV_X86

LKV_AVX512 inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

LKV_AVX512 inline __m512 widen16_masked(const uint16_t* p, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// R output rows from n, every row of x (M <= MAX_ROWS): R x M accumulators of 16 lanes.
template <int R, int M>
LKV_AVX512 void avx512_tile(const Args& a, int64_t n) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t K = a.K, full = K / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) {
    __m512 x[M];
    for (int m = 0; m < M; ++m) x[m] = _mm512_loadu_ps(a.x + m * a.ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512 w = widen16(a.w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(x[m], w, acc[r][m]);
    }
  }
  if (full < K) {
    const __mmask16 mask = (__mmask16)((1u << (K - full)) - 1);
    __m512 x[M];
    for (int m = 0; m < M; ++m) x[m] = _mm512_maskz_loadu_ps(mask, a.x + m * a.ldx + full);
    for (int r = 0; r < R; ++r) {
      const __m512 w = widen16_masked(a.w + (n + r) * K + full, mask);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(x[m], w, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) store(a, m, n + r, _mm512_reduce_add_ps(acc[r][m]));
}

template <int M>
LKV_AVX512 void avx512_rows(const Args& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + UNIT <= n1; n += UNIT) avx512_tile<UNIT, M>(a, n);
  for (; n < n1; ++n) avx512_tile<1, M>(a, n);
}

LKV_AVX512 void avx512(const Args& a, int64_t n0, int64_t n1) {
  switch (a.M) {
    case 1: return avx512_rows<1>(a, n0, n1);
    case 2: return avx512_rows<2>(a, n0, n1);
    case 3: return avx512_rows<3>(a, n0, n1);
    default: return avx512_rows<4>(a, n0, n1);
  }
}

LKV_AVX2 inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

template <int R, int M>
LKV_AVX2 void avx2_tile(const Args& a, int64_t n) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t K = a.K, full = K / 8 * 8;
  for (int64_t k = 0; k < full; k += 8) {
    __m256 x[M];
    for (int m = 0; m < M; ++m) x[m] = _mm256_loadu_ps(a.x + m * a.ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m256 w = widen8(a.w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(x[m], w, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float s = hsum256(acc[r][m]);
      const float* x = a.x + m * a.ldx;
      const uint16_t* row = a.w + (n + r) * K;
      for (int64_t k = full; k < K; ++k) s += x[k] * bf16_to_f32(row[k]);
      store(a, m, n + r, s);
    }
}

template <int M>
LKV_AVX2 void avx2_rows(const Args& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + UNIT <= n1; n += UNIT) avx2_tile<UNIT, M>(a, n);
  for (; n < n1; ++n) avx2_tile<1, M>(a, n);
}

LKV_AVX2 void avx2(const Args& a, int64_t n0, int64_t n1) {
  switch (a.M) {
    case 1: return avx2_rows<1>(a, n0, n1);
    case 2: return avx2_rows<2>(a, n0, n1);
    case 3: return avx2_rows<3>(a, n0, n1);
    default: return avx2_rows<4>(a, n0, n1);
  }
}

#endif  // LKV_X86

void span(const Args& a, int64_t isa, int64_t n0, int64_t n1) {
#if LKV_X86
  if (isa >= 2) return avx512(a, n0, n1);
  if (isa == 1) return avx2(a, n0, n1);
#endif
  generic(a, n0, n1);
}

// y [M, N] = x [M, K] (row stride ldx) w^T (+ res, row stride ldr), w [N, K] bf16 bits
void product(const uint16_t* w, int64_t N, int64_t K, const float* x, int64_t M, int64_t ldx, float* y,
             const float* res, int64_t ldr, int64_t isa) {
  const Args a{x, M, K, ldx, w, N, y, res, ldr};
  if (M == 0 || N == 0) return;
  at::parallel_for(0, (N + UNIT - 1) / UNIT, grain(UNIT * K * 2),
                   [&](int64_t u0, int64_t u1) { span(a, isa, u0 * UNIT, std::min(N, u1 * UNIT)); });
}

const uint16_t* bits(const at::Tensor& w) { return reinterpret_cast<const uint16_t*>(w.data_ptr()); }

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) == K,
              "x must be float32 [M, K] with unit column stride, K the matrix's columns");
  TORCH_CHECK(x.size(0) <= MAX_ROWS, "the bf16 kernels take up to ", MAX_ROWS, " rows, got ", x.size(0));
}

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& residual, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "w must be a contiguous bfloat16 [N, K] matrix");
  check_x(x, w.size(1));
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  int64_t ldr = 0;
  const float* res = residual_of(residual, M, N, &ldr);
  product(bits(w), N, K, x.data_ptr<float>(), M, x.stride(0), y.data_ptr<float>(), res, ldr, isa);
  return y;
}

// gate_up [.., 2I, D] and down [.., D, I]: contiguous bfloat16 of matching widths (dims: 2 or 3)
void check_pair(const at::Tensor& gu, const at::Tensor& dn, int64_t dims) {
  TORCH_CHECK(gu.dim() == dims && dn.dim() == dims && gu.scalar_type() == at::kBFloat16 &&
                  dn.scalar_type() == at::kBFloat16 && gu.is_contiguous() && dn.is_contiguous(),
              "gate_up and down must be contiguous bfloat16 ", dims == 2 ? "[2I, D] and [D, I]" : "[E, 2I, D] and [E, D, I]");
  TORCH_CHECK(dims == 2 || gu.size(0) == dn.size(0), "gate_up and down stack different numbers of experts");
  const int64_t two_i = gu.size(dims - 2), D = gu.size(dims - 1);
  TORCH_CHECK(two_i % 2 == 0 && dn.size(dims - 1) == two_i / 2 && dn.size(dims - 2) == D,
              "gate_up [2I, D] and down [D, I] do not fit: ", gu.sizes(), " and ", dn.sizes());
}

at::Tensor expert_bf16(const at::Tensor& x, const at::Tensor& gu, const at::Tensor& dn,
                       const std::optional<at::Tensor>& residual, int64_t isa) {
  check_isa(isa);
  check_pair(gu, dn, 2);
  check_x(x, gu.size(1));
  const int64_t M = x.size(0), I = gu.size(0) / 2, D = gu.size(1);
  auto of = [M, isa](const at::Tensor& w) {
    return [p = bits(w), N = w.size(0), M, isa](const float* xp, int64_t K, int64_t ldx, float* y,
                                                const float* res, int64_t ldr) {
      product(p, N, K, xp, M, ldx, y, res, ldr, isa);
    };
  };
  return latentkv_native::swiglu(x, I, D, of(gu), of(dn), residual);
}

at::Tensor moe_bf16(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, const at::Tensor& gu,
                    const at::Tensor& dn, bool by_id, int64_t isa) {
  check_isa(isa);
  check_pair(gu, dn, 3);
  check_x(x, gu.size(2));
  const int64_t E = gu.size(0), I = gu.size(1) / 2, D = gu.size(2);
  const uint16_t *gp = bits(gu), *dp = bits(dn);
  return latentkv_native::moe(x, idx, w, E, D, by_id, [&](int64_t e, const float* xp, int64_t n, int64_t ldx, float* y) {
    std::vector<float> h(n * 2 * I), act(n * I);
    product(gp + e * 2 * I * D, 2 * I, D, xp, n, ldx, h.data(), nullptr, 0, isa);
    silu_mul(h.data(), n, I, act.data());
    product(dp + e * D * I, D, I, act.data(), n, I, y, nullptr, 0, isa);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latentkv, m) {
  m.def("bf16_mm(Tensor x, Tensor w, Tensor? residual, int isa) -> Tensor");
  m.def("expert_bf16(Tensor x, Tensor gate_up, Tensor down, Tensor? residual, int isa) -> Tensor");
  m.def("moe_bf16(Tensor x, Tensor idx, Tensor weights, Tensor gate_up, Tensor down, bool by_id, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(latentkv, CPU, m) {
  m.impl("bf16_mm", &bf16_mm);
  m.impl("expert_bf16", &expert_bf16);
  m.impl("moe_bf16", &moe_bf16);
}
