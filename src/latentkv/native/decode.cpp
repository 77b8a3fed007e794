// latentkv's decode kernels: a few rows of float32 activations times an int8 or int4 matrix,
// reading the packed matrix once, straight from memory (a decode step is bound by the bytes it
// reads, not by arithmetic).
//
//   latentkv::int8_mm(x f32 [M, K], q int8 [N, ldq], scale bf16 [N], residual?, isa) -> [M, N]
//       y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]                 (+ residual[m, n])
//   latentkv::int4_mm(x f32 [M, K], packed uint8 [Np, Kp / 2], scale_zeros bf16 [Kp / G, Np, 2],
//                     G, N, residual?, isa) -> [M, N]
//       y[m, n] = sum_g s[g, n] * sum_{k in g} x[m, k] * q[n, k]
//               + (z[g, n] - 8 s[g, n]) * sum_{k in g} x[m, k]     (+ residual[m, n])
//       i.e. x @ W~^T with W~ = (q - 8) * s + z, the int4 format's matrix (weights/int4.py).
//
// int4 layout (BLOCK = 64 output rows): block b holds, for each column k, 32 bytes; byte j holds
// q[64 b + j, k] in its low nibble and q[64 b + 32 + j, k] in its high nibble. (The layout torch's
// AVX-512 `_convert_weight_to_int4pack_for_cpu` makes for whole blocks of 64 rows.) Np % 64 == 0.
//
// Each weight is read once and widened in registers, and multiplied by every row of x. `isa` picks
// the vector path (Python picks it once per process from torch's CPU capability,
// native/__init__.py):
//   3  AVX-512 VNNI (+ VBMI): x quantized to int16 per group of columns, exact integer dot
//      products (vpdpwssd), one float32 scale per group (see the section below);
//   4  the same instructions with x quantized to int8 per group, u8 x s8 products (vpdpbusd) on
//      the weights' own bytes (see its section);
//   2  AVX-512 (F, BW, VL, DQ), 1 AVX2 + FMA, 0 plain C++ (the compiler's baseline ISA): float32 x,
//      weights widened to float32, float32 sums.
// Output rows are split over torch's intra-op threads (at::parallel_for). Built with
// -ffp-contract=off: a residual is added after the product, as a separate add would.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "native.h"
#include "ops.h"

namespace {

using latentkv_native::bf16_to_f32;
using latentkv_native::check_isa;
using latentkv_native::cpu_has;
using latentkv_native::grain;
using latentkv_native::residual_of;
#if LKV_X86
using latentkv_native::hsum256;
#endif
using latentkv_native::moe;
using latentkv_native::silu_mul;
using latentkv_native::swiglu;

constexpr int64_t BLOCK = 64;  // int4 rows per block
constexpr int64_t HALF = BLOCK / 2;

struct Int8Args {
  const float* x;
  int64_t M, K, ldx;
  const int8_t* q;
  int64_t ldq;
  const uint16_t* scale;
  float* y;
  int64_t ldy;
  const float* res;  // nullptr: no residual
  int64_t ldr;
  int64_t N_rows;  // rows of q
};

struct Int4Args {
  const float* x;
  int64_t M, K, ldx;
  const uint8_t* packed;  // [Np / 64][Kp][32]
  int64_t Kp;
  const uint16_t* sz;  // [groups][Np][2]
  int64_t Np, G, N;
  const float* xsum;  // [M][groups]: sum of x over each group (as the path rounds x)
  int64_t groups;
  float* y;
  int64_t ldy;
  const float* res;
  int64_t ldr;
};

// x quantized to int16 per group of columns (the VNNI path; see there)
constexpr int64_t XGROUP8 = 256;  // int8: columns per x scale (bounds the int32 sums)

// x quantized per group of columns (the VNNI paths): int16 codes (isa 3) or int8 ones (isa 4)
struct XQ {
  std::vector<int16_t> q;  // [M][Kpad], zero past K (isa 3)
  std::vector<int8_t> q8;  // the same (isa 4)
  std::vector<float> scale, sum;  // [M][groups]: the step, and the sum of the quantized x
  std::vector<int32_t> codes;     // [M][groups]: the sum of the codes (isa 4: int8's bias)
  int64_t Kpad, groups;
};

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (finite values)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline void store_row(const Int8Args& a, int64_t m, int64_t n, float v) {
  a.y[m * a.ldy + n] = v + (a.res ? a.res[m * a.ldr + n] : 0.0f);
}

// ---- plain C++ -----------------------------------------------------------------------------

void int8_generic(const Int8Args& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qn = a.q + n * a.ldq;
    const float s = bf16_to_f32(a.scale[n]);
    for (int64_t m = 0; m < a.M; ++m) {
      const float* xm = a.x + m * a.ldx;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < a.K; ++k) acc += xm[k] * static_cast<float>(qn[k]);
      store_row(a, m, n, acc * s);
    }
  }
}

// One block of 64 rows for one row m of x: the block's sums per group, then the group's scale.
void int4_generic(const Int4Args& a, int64_t b0, int64_t b1) {
  float acc[BLOCK], y[BLOCK];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = a.packed + b * a.Kp * HALF;
    for (int64_t m = 0; m < a.M; ++m) {
      const float* xm = a.x + m * a.ldx;
      std::fill(y, y + BLOCK, 0.0f);
      for (int64_t g = 0; g < a.groups; ++g) {
        std::fill(acc, acc + BLOCK, 0.0f);
        const int64_t k1 = std::min(a.K, (g + 1) * a.G);
        for (int64_t k = g * a.G; k < k1; ++k) {
          const uint8_t* col = blk + k * HALF;
          const float xk = xm[k];
#pragma omp simd
          for (int64_t j = 0; j < HALF; ++j) {
            acc[j] += xk * static_cast<float>(col[j] & 15);
            acc[HALF + j] += xk * static_cast<float>(col[j] >> 4);
          }
        }
        const uint16_t* sz = a.sz + (g * a.Np + b * BLOCK) * 2;
        const float xs = a.xsum[m * a.groups + g];
        for (int64_t j = 0; j < BLOCK; ++j) {
          const float s = bf16_to_f32(sz[2 * j]), z = bf16_to_f32(sz[2 * j + 1]);
          y[j] += s * acc[j] + (z - 8.0f * s) * xs;
        }
      }
      const int64_t rows = std::min(BLOCK, a.N - b * BLOCK);
      for (int64_t j = 0; j < rows; ++j) {
        const int64_t n = b * BLOCK + j;
        a.y[m * a.ldy + n] = y[j] + (a.res ? a.res[m * a.ldr + n] : 0.0f);
      }
    }
  }
}

#if LKV_X86

// ---- AVX-512 -------------------------------------------------------------------------------

// y[m, n .. n + 16) = v (+ residual), the rows past N left out.
LKV_AVX512 inline void store16(const Int4Args& a, int64_t m, int64_t n, __m512 v) {
  const int64_t rows = std::min<int64_t>(16, a.N - n);
  if (rows <= 0) return;
  const __mmask16 mask = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
  if (a.res) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.res + m * a.ldr + n));
  _mm512_mask_storeu_ps(a.y + m * a.ldy + n, mask, v);
}

// R rows of q (4, or 1 for the tail) times MB rows of x.
template <int R, int MB>
LKV_AVX512 void int8_avx512_tile(const Int8Args& a, int64_t n, int64_t m0) {
  const int8_t* __restrict q[R];
  const float* __restrict x[MB];
  for (int r = 0; r < R; ++r) q[r] = a.q + (n + r) * a.ldq;
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.ldx;
  const int64_t K = a.K, K16 = K / 16 * 16;
  __m512 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __mmask16 mask) LKV_AVX512 {
    __m512 w[R];
    for (int r = 0; r < R; ++r)
      w[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q[r] + k)));
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x[i] + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(w[r], xv, acc[i][r]);
    }
  };
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 w[R];
    for (int r = 0; r < R; ++r)
      w[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[r] + k))));
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x[i] + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_fmadd_ps(w[r], xv, acc[i][r]);
    }
  }
  if (K16 < K) step(K16, __mmask16((1u << (K - K16)) - 1));
  for (int r = 0; r < R; ++r) {
    const float s = bf16_to_f32(a.scale[n + r]);
    for (int i = 0; i < MB; ++i) store_row(a, m0 + i, n + r, _mm512_reduce_add_ps(acc[i][r]) * s);
  }
}

template <int R>
LKV_AVX512 void int8_avx512_rows(const Int8Args& a, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) int8_avx512_tile<R, 4>(a, n, m);
  switch (a.M - m) {
    case 3: int8_avx512_tile<R, 3>(a, n, m); break;
    case 2: int8_avx512_tile<R, 2>(a, n, m); break;
    case 1: int8_avx512_tile<R, 1>(a, n, m); break;
    default: break;
  }
}

LKV_AVX512 void int8_avx512(const Int8Args& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) int8_avx512_rows<4>(a, n);
  for (; n < n1; ++n) int8_avx512_rows<1>(a, n);
}

// int4 on AVX-512 without BF16: float32 x, each nibble widened through a 16-entry table of
// (q - 8) as float32 (vpermps reads only an index's low 4 bits, so the low nibble needs no mask).
// MB rows of x through block b, V = 4 vectors of 16 rows (the whole 32-byte column) or V = 2 (its
// 16-byte half h: rows 16 h .. 16 h + 15 from the low nibbles, 32 + 16 h .. from the high ones).
template <int MB, int V>
LKV_AVX512 void int4_avx512_tile(const Int4Args& a, int64_t b, int64_t m0, int h) {
  const uint8_t* __restrict blk = a.packed + b * a.Kp * HALF + h * 16;
  const float* __restrict x[MB];
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.ldx;
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  constexpr int P = V / 2;  // 16-byte pieces per column
  __m512 y[MB][V];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < V; ++v) y[i][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 acc[MB][V];
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_ps();
    const int64_t k1 = std::min(a.K, (g + 1) * a.G);
    for (int64_t k = g * a.G; k < k1; ++k) {
      __m512 w[V];
      for (int p = 0; p < P; ++p) {
        const __m512i d =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + k * HALF + 16 * p)));
        w[p] = _mm512_permutexvar_ps(d, table);
        w[P + p] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
      }
      for (int i = 0; i < MB; ++i) {
        const __m512 xk = _mm512_set1_ps(x[i][k]);
        for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(w[v], xk, acc[i][v]);
      }
    }
    const uint16_t* sz = a.sz + (g * a.Np + b * BLOCK) * 2;
    for (int v = 0; v < V; ++v) {
      const int row = (v < P ? 0 : HALF) + h * 16 + 16 * (v % P);
      const __m512i pair = _mm512_loadu_si512(sz + 2 * row);  // 16 x (scale | zero << 16)
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pair, hi16));
      for (int i = 0; i < MB; ++i) {
        const __m512 xs = _mm512_set1_ps(a.xsum[(m0 + i) * a.groups + g]);
        y[i][v] = _mm512_fmadd_ps(z, xs, _mm512_fmadd_ps(s, acc[i][v], y[i][v]));
      }
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t n = b * BLOCK + (v < P ? 0 : HALF) + h * 16 + 16 * (v % P);
    for (int i = 0; i < MB; ++i) store16(a, m0 + i, n, y[i][v]);
  }
}

LKV_AVX512 void int4_avx512(const Int4Args& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    if (a.M <= 2) {
      a.M == 1 ? int4_avx512_tile<1, 4>(a, b, 0, 0) : int4_avx512_tile<2, 4>(a, b, 0, 0);
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      int64_t m = 0;
      for (; m + 4 <= a.M; m += 4) int4_avx512_tile<4, 2>(a, b, m, h);
      switch (a.M - m) {
        case 3: int4_avx512_tile<3, 2>(a, b, m, h); break;
        case 2: int4_avx512_tile<2, 2>(a, b, m, h); break;
        case 1: int4_avx512_tile<1, 2>(a, b, m, h); break;
        default: break;
      }
    }
  }
}

// ---- AVX-512 VNNI (and VBMI) ---------------------------------------------------------------
// x is quantized per group of columns to int16 (scale = max |x| / 32767, rounded to nearest) and
// the products are exact integer dot products (vpdpwssd: two int16 pairs into an int32 sum), one
// float32 scale per group: an activation's error is at most half a step of its group's largest,
// well under the bfloat16 rounding torch's ops apply to every activation. A weight is widened to
// int16 once (int8: vpmovsxbw; int4: a byte permutation and a nibble mask) and each instruction
// multiplies 32 of them: about a third of the float32 path's work per weight.

// LEVELS = 32767 (int16 codes, isa 3) or 127 (int8 codes, isa 4).
template <int LEVELS>
LKV_VNNI XQ quantize_x(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t group, int64_t Kpad) {
  XQ out{};
  out.Kpad = Kpad;
  out.groups = Kpad / group;
  if constexpr (LEVELS == 32767) out.q.assign(M * Kpad, 0);
  else out.q8.assign(M * Kpad, 0);
  out.scale.assign(M * out.groups, 0.0f);
  out.sum.assign(M * out.groups, 0.0f);
  out.codes.assign(M * out.groups, 0);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512i top_code = _mm512_set1_epi32(LEVELS), bottom_code = _mm512_set1_epi32(-LEVELS);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * ldx;
    for (int64_t g = 0; g < out.groups; ++g) {
      const int64_t k0 = g * group, k1 = std::min(K, k0 + group);
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = k0; k < k1; k += 16) {
        const __mmask16 mask = k1 - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k1 - k)) - 1);
        amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_maskz_loadu_ps(mask, xm + k)));
      }
      const float top = _mm512_reduce_max_ps(amax);
      if (!(top > 0.0f)) continue;  // all zero (or past K): q stays 0, scale 0
      const float step = top / static_cast<float>(LEVELS);
      const __m512 inv = _mm512_set1_ps(static_cast<float>(LEVELS) / top);
      __m512i total = _mm512_setzero_si512();
      for (int64_t k = k0; k < k1; k += 16) {
        const __mmask16 mask = k1 - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k1 - k)) - 1);
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, xm + k), inv));
        v = _mm512_max_epi32(_mm512_min_epi32(v, top_code), bottom_code);
        total = _mm512_add_epi32(total, v);
        if constexpr (LEVELS == 32767)
          _mm256_mask_storeu_epi16(out.q.data() + m * Kpad + k, mask, _mm512_cvtepi32_epi16(v));
        else
          _mm_mask_storeu_epi8(out.q8.data() + m * Kpad + k, mask, _mm512_cvtepi32_epi8(v));
      }
      const int32_t codes = _mm512_reduce_add_epi32(total);
      out.scale[m * out.groups + g] = step;
      out.sum[m * out.groups + g] = static_cast<float>(codes) * step;
      out.codes[m * out.groups + g] = codes;
    }
  }
  return out;
}

// Software prefetch distances of the VNNI decode paths (one core brings in a single stream no
// faster than its line-fill buffers allow; fetched ahead, a stream reads at the core's full rate):
constexpr int64_t SZ_AHEAD = 2;         // int4: a block's scales and zeros, groups ahead
constexpr int64_t PACKED_AHEAD = 1024;  // int4: a block's packed bytes, bytes ahead
constexpr int64_t ROW_AHEAD = 512;      // int8: each weight row's bytes, bytes ahead

// A block's scales and zeros for group g: 256 bytes, one row of [groups][Np][2] (a stride of
// Np * 4 bytes between groups, which the hardware prefetcher does not follow).
LKV_VNNI inline void prefetch_sz(const Int4Args& a, int64_t b, int64_t g) {
  const char* p = reinterpret_cast<const char*>(a.sz + (g * a.Np + b * BLOCK) * 2);
  for (int line = 0; line < 4; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T0);
}

// Both int4 VNNI paths, after group g of block b: y[i][v] += s * step * sums[i][v] + (z - 8 s) *
// sum(x), for rows 16 v .. 16 v + 15 of the block and row m0 + i of x.
template <int MB>
LKV_VNNI inline void int4_vnni_group(const Int4Args& a, const XQ& xq, int64_t b, int64_t g, int64_t m0,
                                     const __m512i (&sums)[MB][4], __m512 (&y)[MB][4]) {
  const __m512i hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* sz = a.sz + (g * a.Np + b * BLOCK) * 2;
  for (int v = 0; v < 4; ++v) {
    const __m512i pair = _mm512_loadu_si512(sz + 32 * v);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pair, hi16));
    const __m512 zs = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * xq.groups + g;
      const __m512 step = _mm512_mul_ps(s, _mm512_set1_ps(xq.scale[at]));
      y[i][v] = _mm512_fmadd_ps(zs, _mm512_set1_ps(xq.sum[at]),
                                _mm512_fmadd_ps(step, _mm512_cvtepi32_ps(sums[i][v]), y[i][v]));
    }
  }
}

// int4: MB rows of x through block b, two columns at a time. One 64-byte load holds columns k and
// k + 1; a zero-masked byte permutation puts byte j of each (16 rows per permutation) in the two
// words of dword j, the low nibbles are masked out and the high ones shifted down, and vpdpwssd
// adds q[k] x[k] + q[k+1] x[k+1] to each row's int32 sum. Rows of accumulator v: 16 v .. 16 v + 15.
template <int MB>
LKV_VNNI void int4_vnni_tile(const Int4Args& a, const XQ& xq, int64_t b, int64_t m0) {
  const uint8_t* __restrict blk = a.packed + b * a.Kp * HALF;
  const uint32_t* __restrict x[MB];  // int16 pairs
  for (int i = 0; i < MB; ++i) x[i] = reinterpret_cast<const uint32_t*>(xq.q.data() + (m0 + i) * xq.Kpad);
  alignas(64) uint8_t pick_bytes[2][64];
  for (int r = 0; r < 2; ++r)
    for (int p = 0; p < 64; ++p) pick_bytes[r][p] = static_cast<uint8_t>((p / 2 % 2 ? 32 : 0) + 16 * r + p / 4);
  const __m512i pick[2] = {_mm512_load_si512(pick_bytes[0]), _mm512_load_si512(pick_bytes[1])};
  const __mmask64 low_bytes = 0x5555555555555555ull;  // the low byte of every word
  const __m512i nibble = _mm512_set1_epi16(15);
  __m512 y[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < 4; ++v) y[i][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512i acc[MB][4];
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_si512();
    const int64_t k1 = std::min(a.K, (g + 1) * a.G);
    for (int64_t k = g * a.G; k < k1; k += 2) {
      const __m512i cols = _mm512_loadu_si512(blk + k * HALF);
      for (int r = 0; r < 2; ++r) {
        const __m512i pr = _mm512_maskz_permutexvar_epi8(low_bytes, pick[r], cols);
        const __m512i lo = _mm512_and_si512(pr, nibble);
        const __m512i hi = _mm512_srli_epi16(pr, 4);
        for (int i = 0; i < MB; ++i) {
          const __m512i xk = _mm512_set1_epi32(static_cast<int>(x[i][k / 2]));
          acc[i][r] = _mm512_dpwssd_epi32(acc[i][r], lo, xk);
          acc[i][2 + r] = _mm512_dpwssd_epi32(acc[i][2 + r], hi, xk);
        }
      }
    }
    int4_vnni_group<MB>(a, xq, b, g, m0, acc, y);
  }
  for (int v = 0; v < 4; ++v)
    for (int i = 0; i < MB; ++i) store16(a, m0 + i, b * BLOCK + 16 * v, y[i][v]);
}

LKV_VNNI void int4_vnni(const Int4Args& a, const XQ& xq, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t m = 0;
    for (; m + 2 <= a.M; m += 2) int4_vnni_tile<2>(a, xq, b, m);
    if (m < a.M) int4_vnni_tile<1>(a, xq, b, m);
  }
}

// ---- AVX-512 VNNI with int8 activations (isa 4) ---------------------------------------------
// The same as isa 3 with x quantized to int8 per group (step max |x| / 127) and u8 x s8 products
// (vpdpbusd: four byte pairs into an int32 sum, 64 weights per instruction), which needs no
// widening of the weights at all:
//   int8: the signed weights are biased to unsigned (w ^ 0x80 = w + 128) and the bias taken back
//         exactly through the group's code sum: each group's int32 sum starts at -128 sum(x codes);
//   int4: the nibbles are unsigned already; a byte permutation gathers 4 columns' bytes per row,
//         one product of the whole bytes (low + 16 high) and one of the masked low nibbles give
//         both halves' sums (high = (whole - low) / 16, exact).
// x's rounding is at most half a step of 1/127 of its group's largest: llama.cpp's q8 activations
// (q8_0: groups of 32, q8_K: 256) (docs/weights.md measures what it costs).

// int8 on both VNNI paths: R rows of q times MB rows of x. X8 (isa 4): int8 x, 64 columns per
// step, the weights biased; else (isa 3) int16 x, 32 columns per step, the weights sign-extended.
template <int R, int MB, bool X8>
LKV_VNNI void int8_vnni_tile(const Int8Args& a, const XQ& xq, int64_t n, int64_t m0) {
  using Code = std::conditional_t<X8, int8_t, int16_t>;
  constexpr int64_t STEP = X8 ? 64 : 32;
  const int8_t* __restrict q[R];
  const Code* __restrict x[MB];
  for (int r = 0; r < R; ++r) q[r] = a.q + (n + r) * a.ldq;
  for (int i = 0; i < MB; ++i) {
    if constexpr (X8) x[i] = xq.q8.data() + (m0 + i) * xq.Kpad;
    else x[i] = xq.q.data() + (m0 + i) * xq.Kpad;
  }
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 y[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) y[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < xq.groups; ++g) {
    const int64_t k0 = g * XGROUP8, k1 = std::min(a.K, k0 + XGROUP8);
    __m512i acc[MB][R];
    for (int i = 0; i < MB; ++i) {
      // X8: the sum starts at -128 sum(x codes), taking back the weights' bias exactly
      const __m512i start = X8 ? _mm512_maskz_set1_epi32(1, -128 * xq.codes[(m0 + i) * xq.groups + g])
                               : _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) acc[i][r] = start;
    }
    for (int64_t k = k0; k < k1; k += STEP) {
      // past K: weight 0 (biased: 128) times x 0
      const __mmask64 mask = k1 - k >= STEP ? (~__mmask64(0) >> (64 - STEP)) : (__mmask64(1) << (k1 - k)) - 1;
      __m512i w[R];
      if (k % 64 == 0)  // one cache line per row: every step (int8 x), every other one (int16 x)
        for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(q[r] + k) + ROW_AHEAD, _MM_HINT_T0);
      for (int r = 0; r < R; ++r) {
        if constexpr (X8) w[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, q[r] + k), bias);
        else w[r] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(__mmask32(mask), q[r] + k));
      }
      for (int i = 0; i < MB; ++i) {
        const __m512i xv = _mm512_loadu_si512(x[i] + k);
        for (int r = 0; r < R; ++r) {
          if constexpr (X8) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], w[r], xv);
          else acc[i][r] = _mm512_dpwssd_epi32(acc[i][r], w[r], xv);
        }
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 step = _mm512_set1_ps(xq.scale[(m0 + i) * xq.groups + g]);
      for (int r = 0; r < R; ++r) y[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][r]), step, y[i][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float s = bf16_to_f32(a.scale[n + r]);
    for (int i = 0; i < MB; ++i) store_row(a, m0 + i, n + r, _mm512_reduce_add_ps(y[i][r]) * s);
  }
}

template <int R, bool X8>
LKV_VNNI void int8_vnni_rows(const Int8Args& a, const XQ& xq, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= a.M; m += 4) int8_vnni_tile<R, 4, X8>(a, xq, n, m);
  switch (a.M - m) {
    case 3: int8_vnni_tile<R, 3, X8>(a, xq, n, m); break;
    case 2: int8_vnni_tile<R, 2, X8>(a, xq, n, m); break;
    case 1: int8_vnni_tile<R, 1, X8>(a, xq, n, m); break;
    default: break;
  }
}

template <bool X8>
LKV_VNNI void int8_vnni(const Int8Args& a, const XQ& xq, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) int8_vnni_rows<4, X8>(a, xq, n);
  for (; n < n1; ++n) int8_vnni_rows<1, X8>(a, xq, n);
}

// int4: MB rows of x through NB blocks b .. b + NB - 1 side by side, four columns at a time.
// Two 64-byte loads hold a block's columns k .. k + 3; permutation h puts byte 16 h + d of each
// column in the 4 bytes of dword d (rows 16 h + d in the low nibbles, 32 + 16 h + d in the high
// ones). Rows of sum v: 16 v .. 16 v + 15. Each block's arithmetic is the same whatever NB is;
// NB = 2 reads two contiguous streams at once, which one core reads faster than one stream (its
// hardware prefetcher follows each within a 4 KiB page), and the packed bytes are also fetched
// PACKED_AHEAD bytes ahead in software.
template <int MB, int NB>
LKV_VNNI void int4_vnni8_tile(const Int4Args& a, const XQ& xq, int64_t b, int64_t m0) {
  const uint8_t* __restrict blk[NB];
  for (int n = 0; n < NB; ++n) blk[n] = a.packed + (b + n) * a.Kp * HALF;
  const int32_t* __restrict x[MB];  // int8 quads
  for (int i = 0; i < MB; ++i) x[i] = reinterpret_cast<const int32_t*>(xq.q8.data() + (m0 + i) * xq.Kpad);
  alignas(64) uint8_t pick_bytes[2][64];
  for (int h = 0; h < 2; ++h)
    for (int p = 0; p < 64; ++p) pick_bytes[h][p] = static_cast<uint8_t>(p % 4 * HALF + 16 * h + p / 4);
  const __m512i pick[2] = {_mm512_load_si512(pick_bytes[0]), _mm512_load_si512(pick_bytes[1])};
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 y[NB][MB][4];
  for (int n = 0; n < NB; ++n)
    for (int i = 0; i < MB; ++i)
      for (int v = 0; v < 4; ++v) y[n][i][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    if (g + SZ_AHEAD < a.groups)
      for (int n = 0; n < NB; ++n) prefetch_sz(a, b + n, g + SZ_AHEAD);
    __m512i low[NB][MB][2], whole[NB][MB][2];
    for (int n = 0; n < NB; ++n)
      for (int i = 0; i < MB; ++i)
        for (int h = 0; h < 2; ++h) low[n][i][h] = whole[n][i][h] = _mm512_setzero_si512();
    const int64_t k1 = std::min(a.K, (g + 1) * a.G);  // G % 4 == 0: k + 3 stays in the group
    for (int64_t k = g * a.G; k < k1; k += 4) {
      for (int n = 0; n < NB; ++n) {
        const uint8_t* at = blk[n] + k * HALF;
        const __m512i c01 = _mm512_loadu_si512(at);
        const __m512i c23 = _mm512_loadu_si512(at + 2 * HALF);
        _mm_prefetch(reinterpret_cast<const char*>(at) + PACKED_AHEAD, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(at) + PACKED_AHEAD + 64, _MM_HINT_T0);
        for (int h = 0; h < 2; ++h) {
          const __m512i bytes = _mm512_permutex2var_epi8(c01, pick[h], c23);
          const __m512i lo = _mm512_and_si512(bytes, nibble);
          for (int i = 0; i < MB; ++i) {
            const __m512i xk = _mm512_set1_epi32(x[i][k / 4]);
            whole[n][i][h] = _mm512_dpbusd_epi32(whole[n][i][h], bytes, xk);
            low[n][i][h] = _mm512_dpbusd_epi32(low[n][i][h], lo, xk);
          }
        }
      }
    }
    for (int n = 0; n < NB; ++n) {
      __m512i sums[MB][4];  // rows 16 v ..: low nibbles (v = 0, 1), high = (whole - low) / 16 (v = 2, 3)
      for (int i = 0; i < MB; ++i)
        for (int h = 0; h < 2; ++h) {
          sums[i][h] = low[n][i][h];
          sums[i][2 + h] = _mm512_srai_epi32(_mm512_sub_epi32(whole[n][i][h], low[n][i][h]), 4);
        }
      int4_vnni_group<MB>(a, xq, b + n, g, m0, sums, y[n]);
    }
  }
  for (int n = 0; n < NB; ++n)
    for (int v = 0; v < 4; ++v)
      for (int i = 0; i < MB; ++i) store16(a, m0 + i, (b + n) * BLOCK + 16 * v, y[n][i][v]);
}

LKV_VNNI void int4_vnni8(const Int4Args& a, const XQ& xq, int64_t b0, int64_t b1) {
  int64_t b = b0;
  if (a.M == 1)  // one row (a sequence's decode): two blocks at a time
    for (; b + 2 <= b1; b += 2) int4_vnni8_tile<1, 2>(a, xq, b, 0);
  for (; b < b1; ++b) {
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) int4_vnni8_tile<4, 1>(a, xq, b, m);
    switch (a.M - m) {
      case 3: int4_vnni8_tile<3, 1>(a, xq, b, m); break;
      case 2: int4_vnni8_tile<2, 1>(a, xq, b, m); break;
      case 1: int4_vnni8_tile<1, 1>(a, xq, b, m); break;
      default: break;
    }
  }
}

// ---- AVX2 ----------------------------------------------------------------------------------

template <int R, int MB>
LKV_AVX2 void int8_avx2_tile(const Int8Args& a, int64_t n, int64_t m0) {
  const int8_t* __restrict q[R];
  const float* __restrict x[MB];
  for (int r = 0; r < R; ++r) q[r] = a.q + (n + r) * a.ldq;
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.ldx;
  __m256 acc[MB][R];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t K = a.K, K8 = K / 8 * 8;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 w[R];
    for (int r = 0; r < R; ++r)
      w[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[r] + k))));
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x[i] + k);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(w[r], xv, acc[i][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float s = bf16_to_f32(a.scale[n + r]);
    for (int i = 0; i < MB; ++i) {
      float sum = hsum256(acc[i][r]);
      for (int64_t k = K8; k < K; ++k) sum += x[i][k] * static_cast<float>(q[r][k]);
      store_row(a, m0 + i, n + r, sum * s);
    }
  }
}

template <int R>
LKV_AVX2 void int8_avx2_rows(const Int8Args& a, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= a.M; m += 2) int8_avx2_tile<R, 2>(a, n, m);
  if (m < a.M) int8_avx2_tile<R, 1>(a, n, m);
}

LKV_AVX2 void int8_avx2(const Int8Args& a, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) int8_avx2_rows<4>(a, n);
  for (; n < n1; ++n) int8_avx2_rows<1>(a, n);
}

// MB rows of x through the 16 rows of block b that bytes [8 q, 8 q + 8) of each column hold:
// rows 8 q .. 8 q + 7 (low nibbles) and 32 + 8 q .. (high nibbles), q = 0..3.
template <int MB>
LKV_AVX2 void int4_avx2_tile(const Int4Args& a, int64_t b, int64_t m0, int quarter) {
  const uint8_t* blk = a.packed + b * a.Kp * HALF + quarter * 8;
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m256i hi16 = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 y[MB][2];
  for (int i = 0; i < MB; ++i) y[i][0] = y[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    __m256 acc[MB][2];
    for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const int64_t k1 = std::min(a.K, (g + 1) * a.G);
    for (int64_t k = g * a.G; k < k1; ++k) {
      const __m256i d =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + k * HALF)));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, low4));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
      for (int i = 0; i < MB; ++i) {
        const __m256 xk = _mm256_broadcast_ss(a.x + (m0 + i) * a.ldx + k);
        acc[i][0] = _mm256_fmadd_ps(lo, xk, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(hi, xk, acc[i][1]);
      }
    }
    const uint16_t* sz = a.sz + (g * a.Np + b * BLOCK) * 2;
    for (int v = 0; v < 2; ++v) {
      const int row = v * HALF + quarter * 8;
      const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 2 * row));
      const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(pair, hi16));
      const __m256 zs = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z);
      for (int i = 0; i < MB; ++i) {
        const __m256 xs = _mm256_set1_ps(a.xsum[(m0 + i) * a.groups + g]);
        y[i][v] = _mm256_fmadd_ps(zs, xs, _mm256_fmadd_ps(s, acc[i][v], y[i][v]));
      }
    }
  }
  for (int v = 0; v < 2; ++v) {
    const int64_t n = b * BLOCK + v * HALF + quarter * 8;
    const int64_t rows = std::min<int64_t>(8, a.N - n);
    for (int i = 0; i < MB; ++i) {
      float out[8];
      _mm256_storeu_ps(out, y[i][v]);
      for (int64_t j = 0; j < rows; ++j)
        a.y[(m0 + i) * a.ldy + n + j] = out[j] + (a.res ? a.res[(m0 + i) * a.ldr + n + j] : 0.0f);
    }
  }
}

LKV_AVX2 void int4_avx2(const Int4Args& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int quarter = 0; quarter < 4; ++quarter) {
      int64_t m = 0;
      for (; m + 2 <= a.M; m += 2) int4_avx2_tile<2>(a, b, m, quarter);
      if (m < a.M) int4_avx2_tile<1>(a, b, m, quarter);
    }
  }
}

#endif  // LKV_X86

// The activations as the chosen path reads them: int16 / int8 groups for VNNI (isa 3 / 4), else nothing
// (the float rows are read in place).
XQ prepare_int8(const Int8Args& a, int64_t isa) {
  XQ xq;
#if LKV_X86
  const int64_t Kpad = (a.K + XGROUP8 - 1) / XGROUP8 * XGROUP8;
  if (isa == 3) xq = quantize_x<32767>(a.x, a.M, a.K, a.ldx, XGROUP8, Kpad);
  if (isa == 4) xq = quantize_x<127>(a.x, a.M, a.K, a.ldx, XGROUP8, Kpad);
#endif
  return xq;
}

// Rows [n0, n1) of y through the path `isa` names.
void int8_span(const Int8Args& a, const XQ& xq, int64_t isa, int64_t n0, int64_t n1) {
#if LKV_X86
  if (isa == 4) return int8_vnni<true>(a, xq, n0, n1);
  if (isa == 3) return int8_vnni<false>(a, xq, n0, n1);
  if (isa == 2) return int8_avx512(a, n0, n1);
  if (isa == 1) return int8_avx2(a, n0, n1);
#endif
  int8_generic(a, n0, n1);
}

// int4's activations: int16 / int8 groups for VNNI, else each row's per-group sums (a.xsum, kept in
// `xsum`) that the zero points multiply.
XQ prepare_int4(Int4Args& a, std::vector<float>& xsum, int64_t isa) {
  xsum.assign(a.M * a.groups, 0.0f);
  a.xsum = xsum.data();
  XQ xq;
#if LKV_X86
  if (isa == 3) return quantize_x<32767>(a.x, a.M, a.K, a.ldx, a.G, a.Kp);
  if (isa == 4) {
    TORCH_CHECK(a.G % 4 == 0, "latentkv kernels: path 4 needs a group size divisible by 4, got ", a.G);
    return quantize_x<127>(a.x, a.M, a.K, a.ldx, a.G, a.Kp);
  }
#endif
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t g = 0; g < a.groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * a.G; k < std::min(a.K, (g + 1) * a.G); ++k) s += a.x[m * a.ldx + k];
      xsum[m * a.groups + g] = s;
    }
  return xq;
}

// Row blocks [b0, b1) of y through the path `isa` names.
void int4_span(const Int4Args& a, const XQ& xq, int64_t isa, int64_t b0, int64_t b1) {
#if LKV_X86
  if (isa == 4) return int4_vnni8(a, xq, b0, b1);
  if (isa == 3) return int4_vnni(a, xq, b0, b1);
  if (isa == 2) return int4_avx512(a, b0, b1);
  if (isa == 1) return int4_avx2(a, b0, b1);
#endif
  int4_generic(a, b0, b1);
}

// y = x @ q^T * scale (+ residual) over raw buffers (a.y written), rows split over the threads.
void run_int8(const Int8Args& a, int64_t isa) {
  if (a.M == 0 || a.N_rows == 0) return;
  const XQ xq = prepare_int8(a, isa);
  const int64_t N = a.N_rows;
  // units of 4 rows
  at::parallel_for(0, (N + 3) / 4, grain(4 * a.K * std::max<int64_t>(1, a.M / 4)), [&](int64_t u0, int64_t u1) {
    int8_span(a, xq, isa, u0 * 4, std::min(N, u1 * 4));
  });
}

// y = x @ W~^T (+ residual) over raw buffers (a.y written; a.xsum is filled here), row blocks
// split over the threads.
void run_int4(Int4Args& a, std::vector<float>& xsum, int64_t isa) {
  if (a.M == 0) return;
  const XQ xq = prepare_int4(a, xsum, isa);
  at::parallel_for(0, a.Np / BLOCK, grain(BLOCK * a.Kp / 2 * std::max<int64_t>(1, a.M / 4)), [&](int64_t b0, int64_t b1) {
    int4_span(a, xq, isa, b0, b1);
  });
}

// One int8 / int4 matrix as the ops receive it, checked once.
struct Int8Matrix {
  const int8_t* q;
  int64_t N, ldq;
  const uint16_t* scale;
};

Int8Matrix int8_matrix(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.stride(1) == 1, "q must be int8 [N, ldq]");
  const int64_t N = q.size(0);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == at::kBFloat16 &&
                  scale.is_contiguous(),
              "scale must be bfloat16 [N]");
  return {q.data_ptr<int8_t>(), N, q.stride(0), reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>())};
}

struct Int4Matrix {
  const uint8_t* packed;
  int64_t Np, Kp, G, groups, N;
  const uint16_t* sz;
};

Int4Matrix int4_matrix(const at::Tensor& packed, const at::Tensor& scale_zeros, int64_t group_size,
                       int64_t out_features) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be uint8 [Np, Kp / 2]");
  const int64_t Np = packed.size(0), Kp = 2 * packed.size(1);
  TORCH_CHECK(Np % BLOCK == 0, "packed rows must be a multiple of ", BLOCK, ", got ", Np);
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && Kp % group_size == 0, "group size ", group_size,
              " does not divide ", Kp);
  const int64_t groups = Kp / group_size;
  TORCH_CHECK(scale_zeros.dim() == 3 && scale_zeros.size(0) == groups && scale_zeros.size(1) == Np &&
                  scale_zeros.size(2) == 2 && scale_zeros.scalar_type() == at::kBFloat16 &&
                  scale_zeros.is_contiguous(),
              "scale_zeros must be bfloat16 [", groups, ", ", Np, ", 2]");
  TORCH_CHECK(out_features > Np - BLOCK && out_features <= Np, "out_features ", out_features,
              " does not fit ", Np, " packed rows");
  return {packed.data_ptr<uint8_t>(), Np, Kp, group_size, groups, out_features,
          reinterpret_cast<const uint16_t*>(scale_zeros.data_ptr<at::BFloat16>())};
}

// Every entry of a stack of matrices (MLA's heads, a layer's experts), each checked as
// int8_matrix / int4_matrix check one: entry 0 through them, the others at entry 0's layout moved
// by the stack's stride. No tensor per entry: a select costs ~1 us, 64 heads a layer and 256
// experts a GLM-5 MoE layer.
std::vector<Int8Matrix> int8_stack(const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 3 && scale.dim() == 2 && q.size(0) == scale.size(0) && q.size(0) > 0,
              "stacked int8 matrices must be q [E, N, ldq] with scale [E, N]");
  const Int8Matrix first = int8_matrix(q[0], scale[0]);
  std::vector<Int8Matrix> out(q.size(0), first);
  for (int64_t e = 1; e < q.size(0); ++e) {
    out[e].q += e * q.stride(0);
    out[e].scale += e * scale.stride(0);
  }
  return out;
}

std::vector<Int4Matrix> int4_stack(const at::Tensor& packed, const at::Tensor& scale_zeros, int64_t group_size,
                                   int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && scale_zeros.dim() == 4 && packed.size(0) == scale_zeros.size(0) &&
                  packed.size(0) > 0,
              "stacked int4 matrices must be packed [E, Np, Kp / 2] with scale_zeros [E, groups, Np, 2]");
  const Int4Matrix first = int4_matrix(packed[0], scale_zeros[0], group_size, out_features);
  std::vector<Int4Matrix> out(packed.size(0), first);
  for (int64_t e = 1; e < packed.size(0); ++e) {
    out[e].packed += e * packed.stride(0);
    out[e].sz += e * scale_zeros.stride(0);
  }
  return out;
}

void check_x(const at::Tensor& x, int64_t max_k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= max_k && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be float32 [M, K <= ", max_k, "] with unit column stride");
}

// y [M, N] (row stride ldy) = x [M, K] through one matrix, residual optional.
void product8(const Int8Matrix& w, const float* x, int64_t M, int64_t K, int64_t ldx, float* y, int64_t ldy,
              const float* res, int64_t ldr, int64_t isa) {
  Int8Args a{x, M, K, ldx, w.q, w.ldq, w.scale, y, ldy, res, ldr, w.N};
  run_int8(a, isa);
}

void product4(const Int4Matrix& w, const float* x, int64_t M, int64_t K, int64_t ldx, float* y, int64_t ldy,
              const float* res, int64_t ldr, int64_t isa) {
  std::vector<float> xsum;
  Int4Args a{x, M, K, ldx, w.packed, w.Kp, w.sz, w.Np, w.G, w.N, nullptr, w.groups, y, ldy, res, ldr};
  run_int4(a, xsum, isa);
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                   const std::optional<at::Tensor>& residual, int64_t isa) {
  check_isa(isa);
  const Int8Matrix w = int8_matrix(q, scale);
  check_x(x, w.ldq);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, w.N}, x.options());
  int64_t ldr = 0;
  const float* res = residual_of(residual, M, w.N, &ldr);
  product8(w, x.data_ptr<float>(), M, K, x.stride(0), y.data_ptr<float>(), w.N, res, ldr, isa);
  return y;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zeros,
                   int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& residual,
                   int64_t isa) {
  check_isa(isa);
  const Int4Matrix w = int4_matrix(packed, scale_zeros, group_size, out_features);
  check_x(x, w.Kp);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, w.N}, x.options());
  int64_t ldr = 0;
  const float* res = residual_of(residual, M, w.N, &ldr);
  product4(w, x.data_ptr<float>(), M, K, x.stride(0), y.data_ptr<float>(), w.N, res, ldr, isa);
  return y;
}

// ---- a SwiGLU expert in one call (the shape: experts.cpp) -------------------------------------

at::Tensor expert_int8(const at::Tensor& x, const at::Tensor& gu_q, const at::Tensor& gu_scale,
                       const at::Tensor& dn_q, const at::Tensor& dn_scale,
                       const std::optional<at::Tensor>& residual, int64_t isa) {
  check_isa(isa);
  const Int8Matrix gu = int8_matrix(gu_q, gu_scale), dn = int8_matrix(dn_q, dn_scale);
  TORCH_CHECK(gu.N % 2 == 0 && gu.N / 2 <= dn.ldq, "gate_up has ", gu.N, " rows, down ", dn.ldq, " columns");
  check_x(x, gu.ldq);
  const int64_t M = x.size(0), I = gu.N / 2;
  auto product = [M, isa](const Int8Matrix& w, int64_t ldy) {
    return [w, ldy, M, isa](const float* xp, int64_t K, int64_t ldx, float* y, const float* res, int64_t ldr) {
      product8(w, xp, M, K, ldx, y, ldy, res, ldr, isa);
    };
  };
  return swiglu(x, I, dn.N, product(gu, 2 * I), product(dn, dn.N), residual);
}

at::Tensor expert_int4(const at::Tensor& x, const at::Tensor& gu_packed, const at::Tensor& gu_sz,
                       int64_t gu_rows, const at::Tensor& dn_packed, const at::Tensor& dn_sz, int64_t dn_rows,
                       int64_t group_size, const std::optional<at::Tensor>& residual, int64_t isa) {
  check_isa(isa);
  const Int4Matrix gu = int4_matrix(gu_packed, gu_sz, group_size, gu_rows);
  const Int4Matrix dn = int4_matrix(dn_packed, dn_sz, group_size, dn_rows);
  TORCH_CHECK(gu.N % 2 == 0 && gu.N / 2 <= dn.Kp, "gate_up has ", gu.N, " rows, down ", dn.Kp, " columns");
  check_x(x, gu.Kp);
  const int64_t M = x.size(0), I = gu.N / 2;
  auto product = [M, isa](const Int4Matrix& w, int64_t ldy) {
    return [w, ldy, M, isa](const float* xp, int64_t K, int64_t ldx, float* y, const float* res, int64_t ldr) {
      product4(w, xp, M, K, ldx, y, ldy, res, ldr, isa);
    };
  };
  return swiglu(x, I, dn.N, product(gu, 2 * I), product(dn, dn.N), residual);
}

// ---- a layer's routed experts in one call (the sum: experts.cpp) ------------------------------
// Every expert's matrices are one slice of the stacked tensors.

at::Tensor moe_int8(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, const at::Tensor& gu_q,
                    const at::Tensor& gu_scale, const at::Tensor& dn_q, const at::Tensor& dn_scale, bool by_id,
                    int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(gu_q.dim() == 3 && dn_q.dim() == 3 && gu_q.size(0) == dn_q.size(0) && gu_scale.dim() == 2 &&
                  dn_scale.dim() == 2,
              "stacked experts must be gate_up q [E, 2I, ldq], scale [E, 2I], down q [E, D, ldq], scale [E, D]");
  const int64_t E = gu_q.size(0);
  const std::vector<Int8Matrix> gus = int8_stack(gu_q, gu_scale), dns = int8_stack(dn_q, dn_scale);
  TORCH_CHECK(gus[0].N % 2 == 0 && gus[0].N / 2 <= dns[0].ldq, "gate_up and down do not fit");
  check_x(x, gus[0].ldq);
  const int64_t I = gus[0].N / 2, D = dns[0].N, K = x.size(1);
  return moe(x, idx, w, E, D, by_id, [&](int64_t e, const float* xp, int64_t n, int64_t ldx, float* y) {
    std::vector<float> h(n * 2 * I), act(n * I);
    product8(gus[e], xp, n, K, ldx, h.data(), 2 * I, nullptr, 0, isa);
    silu_mul(h.data(), n, I, act.data());
    product8(dns[e], act.data(), n, I, I, y, D, nullptr, 0, isa);
  });
}

at::Tensor moe_int4(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, const at::Tensor& gu_packed,
                    const at::Tensor& gu_sz, int64_t gu_rows, const at::Tensor& dn_packed, const at::Tensor& dn_sz,
                    int64_t dn_rows, int64_t group_size, bool by_id, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(gu_packed.dim() == 3 && dn_packed.dim() == 3 && gu_packed.size(0) == dn_packed.size(0) &&
                  gu_sz.dim() == 4 && dn_sz.dim() == 4,
              "stacked experts must be packed [E, Np, Kp / 2] with scale_zeros [E, groups, Np, 2]");
  const int64_t E = gu_packed.size(0);
  const std::vector<Int4Matrix> gus = int4_stack(gu_packed, gu_sz, group_size, gu_rows),
                                dns = int4_stack(dn_packed, dn_sz, group_size, dn_rows);
  TORCH_CHECK(gu_rows % 2 == 0 && gu_rows / 2 <= dns[0].Kp, "gate_up and down do not fit");
  check_x(x, gus[0].Kp);
  const int64_t I = gu_rows / 2, D = dn_rows, K = x.size(1);
  return moe(x, idx, w, E, D, by_id, [&](int64_t e, const float* xp, int64_t n, int64_t ldx, float* y) {
    std::vector<float> h(n * 2 * I), act(n * I);
    product4(gus[e], xp, n, K, ldx, h.data(), 2 * I, nullptr, 0, isa);
    silu_mul(h.data(), n, I, act.data());
    product4(dns[e], act.data(), n, I, I, y, D, nullptr, 0, isa);
  });
}

// ---- one product per attention head, all heads in one call ---------------------------------
// x [H, S, K] -> [H, S, N]: head h's rows through head h's matrix (MLA's W_UK^T and W_UV), the
// heads split over the threads (each head's product on one thread: they are small).

// The same products on the calling thread (one head's or one expert's, the threads split above).
void int8_rows(const Int8Args& a, int64_t isa) { int8_span(a, prepare_int8(a, isa), isa, 0, a.N_rows); }

void int4_rows(Int4Args& a, int64_t isa) {
  std::vector<float> xsum;
  int4_span(a, prepare_int4(a, xsum, isa), isa, 0, a.Np / BLOCK);
}

at::Tensor heads_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(q.dim() == 3 && scale.dim() == 2 && x.dim() == 3 && x.size(0) == q.size(0),
              "heads: x [H, S, K], q [H, N, ldq], scale [H, N]");
  const int64_t H = q.size(0), S = x.size(1), K = x.size(2);
  const std::vector<Int8Matrix> w = int8_stack(q, scale);
  const at::Tensor xc = x.contiguous();
  TORCH_CHECK(xc.scalar_type() == at::kFloat && K <= w[0].ldq, "x must be float32 [H, S, K <= ldq]");
  const int64_t N = w[0].N;
  at::Tensor y = at::empty({H, S, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      Int8Args a{xp + h * S * K, S, K, K, w[h].q, w[h].ldq, w[h].scale, yp + h * S * N, N, nullptr, 0, N};
      int8_rows(a, isa);
    }
  });
  return y;
}

at::Tensor heads_int4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zeros,
                      int64_t group_size, int64_t out_features, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(packed.dim() == 3 && scale_zeros.dim() == 4 && x.dim() == 3 && x.size(0) == packed.size(0),
              "heads: x [H, S, K], packed [H, Np, Kp / 2], scale_zeros [H, groups, Np, 2]");
  const int64_t H = packed.size(0), S = x.size(1), K = x.size(2);
  const std::vector<Int4Matrix> w = int4_stack(packed, scale_zeros, group_size, out_features);
  const at::Tensor xc = x.contiguous();
  TORCH_CHECK(xc.scalar_type() == at::kFloat && K <= w[0].Kp, "x must be float32 [H, S, K <= Kp]");
  const int64_t N = out_features;
  at::Tensor y = at::empty({H, S, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      Int4Args a{xp + h * S * K, S, K, K, w[h].packed, w[h].Kp, w[h].sz, w[h].Np, w[h].G, N, nullptr, w[h].groups,
                 yp + h * S * N, N, nullptr, 0};
      int4_rows(a, isa);
    }
  });
  return y;
}

bool has_isa(int64_t isa) { return isa >= 0 && isa <= 4 && cpu_has(isa); }

}  // namespace

TORCH_LIBRARY(latentkv, m) {
  m.def("int8_mm(Tensor x, Tensor q, Tensor scale, Tensor? residual, int isa) -> Tensor");
  m.def(
      "expert_int8(Tensor x, Tensor gate_up_q, Tensor gate_up_scale, Tensor down_q, Tensor down_scale, "
      "Tensor? residual, int isa) -> Tensor");
  m.def(
      "expert_int4(Tensor x, Tensor gate_up_packed, Tensor gate_up_scale_zeros, int gate_up_rows, "
      "Tensor down_packed, Tensor down_scale_zeros, int down_rows, int group_size, Tensor? residual, "
      "int isa) -> Tensor");
  m.def(
      "int4_mm(Tensor x, Tensor packed, Tensor scale_zeros, int group_size, int out_features, "
      "Tensor? residual, int isa) -> Tensor");
  m.def(
      "moe_int8(Tensor x, Tensor idx, Tensor weights, Tensor gate_up_q, Tensor gate_up_scale, Tensor down_q, "
      "Tensor down_scale, bool by_id, int isa) -> Tensor");
  m.def(
      "moe_int4(Tensor x, Tensor idx, Tensor weights, Tensor gate_up_packed, Tensor gate_up_scale_zeros, "
      "int gate_up_rows, Tensor down_packed, Tensor down_scale_zeros, int down_rows, int group_size, bool by_id, "
      "int isa) -> Tensor");
  m.def("heads_int8(Tensor x, Tensor q, Tensor scale, int isa) -> Tensor");
  m.def("heads_int4(Tensor x, Tensor packed, Tensor scale_zeros, int group_size, int out_features, int isa) -> Tensor");
  m.def("has_isa(int isa) -> bool", &has_isa);
}

TORCH_LIBRARY_IMPL(latentkv, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int4_mm", &int4_mm);
  m.impl("expert_int8", &expert_int8);
  m.impl("expert_int4", &expert_int4);
  m.impl("moe_int8", &moe_int8);
  m.impl("moe_int4", &moe_int4);
  m.impl("heads_int8", &heads_int8);
  m.impl("heads_int4", &heads_int4);
}
