// latentkv's decode attention over packed latent KV rows on the CPU: one new token's absorbed
// MLA query, all heads at once, against T cached rows read in place in their stored format.
//
//   latentkv::mla_decode(query f32 [H, n_c + n_r], c uint8 [T, bytes_c], r uint8 [T, bytes_r],
//                        index int64 [K]?, fmt_c, block_c, fmt_r, block_r, isa) -> f32 [H, n_c]
//       s[h, t] = query[h] . [c_t | r_t]      p = softmax_t(s[h])      out[h] = sum_t p[h, t] c_t
//   over the rows at `index` (DSA's top-k) when given, else over rows 0 .. T-1; the softmax scale
//   is folded into the query already.
//
// Row formats (each row part's bytes as its codec stores them, kv/codecs):
//   0  bf16    n values of 2 bytes
//   1  q8_0    blocks of `block` values: fp16 scale d, then `block` int8 q; value q d (q8_0, q8s)
//   2  q4_0    blocks: fp16 d, then block / 2 bytes, byte j holding value j in its low nibble and
//              value j + block / 2 in its high one; value (q - 8) d (q4_0, q4s)
// Each value is widened to float32 exactly as the codec's decoder widens it (a product of a small
// integer and an fp16 scale is exact in float32), so the kernel and the torch reference read the
// same numbers; products and sums are float32, in another order than the reference's matmuls.
//
// The work is two small matrix products with the widening done once per row, on AVX-512 (isa >= 2)
// or AVX2 + FMA (isa 1) vectors (the Python backend leaves plain-C++ CPUs to the torch reference):
//   1. scores, split over threads by rows: 6 rows at a time are widened into a float32 scratch,
//      then multiplied by the query transposed [n_c + n_r, H'] (heads padded to 16), 6 rows x
//      64 heads (AVX2: 16) of float32 sums in registers;
//   2. the softmax per head, vectorized over heads (one thread: H x K exponentials);
//   3. the context, split over threads by 64-column spans of c: 64 rows of the span are widened
//      at a time, then 6 heads x 64 columns (AVX2: 16) of sums in registers take every row's weight.
// Each output value is summed in one fixed order whatever the thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "native.h"

namespace {

using latentkv_native::bf16_to_f32;
using latentkv_native::cpu_has;
using latentkv_native::half_to_f32;

enum Format : int64_t { BF16 = 0, Q8_0 = 1, Q4_0 = 2 };

constexpr int64_t ROWS = 6;    // rows per score tile, heads per context tile
constexpr int64_t SPAN = 64;   // context columns per task
constexpr int64_t CHUNK = 64;  // rows widened at a time for the context

struct Part {
  const uint8_t* base;
  int64_t stride;  // bytes between rows
  int64_t n;       // values per row
  int64_t fmt, block;
};

int64_t row_bytes(int64_t fmt, int64_t n, int64_t block) {
  if (fmt == BF16) return 2 * n;
  const int64_t blocks = n / block;
  return blocks * (2 + (fmt == Q8_0 ? block : block / 2));
}

inline float scale_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_f32(h);
}

// A block of b values other than 32 (8 or 16: a narrow rope key's) widened one by one.
inline void widen_block(int64_t fmt, const uint8_t* q, int64_t b, float d, float* out) {
  if (fmt == Q8_0) {
    for (int64_t j = 0; j < b; ++j) out[j] = static_cast<float>(static_cast<int8_t>(q[j])) * d;
    return;
  }
  for (int64_t j = 0; j < b / 2; ++j) {
    out[j] = static_cast<float>((q[j] & 15) - 8) * d;
    out[j + b / 2] = static_cast<float>((q[j] >> 4) - 8) * d;
  }
}

#if LKV_X86

// One vector path's pieces, as static members (the target attribute on each): LANES floats per
// vector, tiles of up to MAX_NV vectors (what the registers hold: ROWS x MAX_NV sums plus the
// operands), `widen` (values [v0, v0 + count) of a stored row to float32; v0 and count multiples of
// the block, and of 16 for bf16), `score_tile`, `context_tile` and `softmax_column` (below, AVX-512's).
struct Avx512 {
  static constexpr int64_t LANES = 16;
  static constexpr int MAX_NV = 4;

  LKV_AVX512 static void widen(const Part& p, const uint8_t* row, int64_t v0, int64_t count, float* out) {
    if (p.fmt == BF16) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(row) + v0;
      int64_t i = 0;
      for (; i + 16 <= count; i += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
      }
      for (; i < count; ++i) out[i] = bf16_to_f32(src[i]);
      return;
    }
    const int64_t b = p.block, bytes = 2 + (p.fmt == Q8_0 ? b : b / 2);
    for (int64_t k = v0 / b, end = (v0 + count) / b; k < end; ++k, out += b) {
      const uint8_t* blk = row + k * bytes;
      const float d = scale_at(blk);
      const uint8_t* q = blk + 2;
      if (b != 32) {
        widen_block(p.fmt, q, b, d, out);
      } else if (p.fmt == Q8_0) {
        const __m512 vd = _mm512_set1_ps(d);
        for (int h = 0; h < 2; ++h) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h));
          _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), vd));
        }
      } else {
        const __m512 vd = _mm512_set1_ps(d);
        const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        const __m512i eight = _mm512_set1_epi32(8), low = _mm512_set1_epi32(15);
        const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(raw, low), eight);
        const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(raw, 4), eight);
        _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), vd));
        _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), vd));
      }
    }
  }

  // exp(x) for the softmax's x <= 0: Cephes' expf (degree-5 polynomial on [-ln2/2, ln2/2], ~1
  // ulp) scaled by 2^n; very negative x give 0, a NaN stays NaN.
  LKV_AVX512 static __m512 exp(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
  }

  // s[i][0 .. 16 NV) = sum_k x[i][k] qt[k][0 .. 16 NV) for ROWS rows of x (row stride ldx).
  template <int NV>
  LKV_AVX512 static void score_tile(const float* x, int64_t ldx, const float* qt, int64_t ldq, int64_t W,
                                    float* s, int64_t lds) {
    __m512 acc[ROWS][NV];
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < W; ++k) {
      __m512 q[NV];
      for (int j = 0; j < NV; ++j) q[j] = _mm512_loadu_ps(qt + k * ldq + 16 * j);
      for (int i = 0; i < ROWS; ++i) {
        const __m512 v = _mm512_set1_ps(x[i * ldx + k]);
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(v, q[j], acc[i][j]);
      }
    }
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(s + i * lds + 16 * j, acc[i][j]);
  }

  // acc[h][0 .. 16 NV) += sum_t p[t][h] v[t][0 .. 16 NV) for ROWS heads h (v and acc: row stride SPAN).
  template <int NV>
  LKV_AVX512 static void context_tile(const float* p, int64_t ldp, const float* v, int64_t rows, float* acc) {
    __m512 a[ROWS][NV];
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NV; ++j) a[i][j] = _mm512_loadu_ps(acc + i * SPAN + 16 * j);
    for (int64_t t = 0; t < rows; ++t) {
      __m512 x[NV];
      for (int j = 0; j < NV; ++j) x[j] = _mm512_loadu_ps(v + t * SPAN + 16 * j);
      for (int i = 0; i < ROWS; ++i) {
        const __m512 w = _mm512_set1_ps(p[t * ldp + i]);
        for (int j = 0; j < NV; ++j) a[i][j] = _mm512_fmadd_ps(w, x[j], a[i][j]);
      }
    }
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + i * SPAN + 16 * j, a[i][j]);
  }

  // Rows t < K of the 16 columns at col (row stride ld) -> exp(x - their max), and the sums.
  LKV_AVX512 static void softmax_column(float* col, int64_t ld, int64_t K, float* sum) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < K; ++t) m = _mm512_max_ps(m, _mm512_loadu_ps(col + t * ld));
    __m512 z = _mm512_setzero_ps();
    for (int64_t t = 0; t < K; ++t) {
      const __m512 e = exp(_mm512_sub_ps(_mm512_loadu_ps(col + t * ld), m));
      _mm512_storeu_ps(col + t * ld, e);
      z = _mm512_add_ps(z, e);
    }
    _mm512_storeu_ps(sum, z);
  }
};

// The same on AVX2 + FMA: 8 lanes, tiles of up to 2 vectors (16 registers).
struct Avx2 {
  static constexpr int64_t LANES = 8;
  static constexpr int MAX_NV = 2;

  LKV_AVX2 static void widen(const Part& p, const uint8_t* row, int64_t v0, int64_t count, float* out) {
    if (p.fmt == BF16) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(row) + v0;
      int64_t i = 0;
      for (; i + 8 <= count; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
      for (; i < count; ++i) out[i] = bf16_to_f32(src[i]);
      return;
    }
    const int64_t b = p.block, bytes = 2 + (p.fmt == Q8_0 ? b : b / 2);
    for (int64_t k = v0 / b, end = (v0 + count) / b; k < end; ++k, out += b) {
      const uint8_t* blk = row + k * bytes;
      const float d = scale_at(blk);
      const uint8_t* q = blk + 2;
      if (b != 32) {
        widen_block(p.fmt, q, b, d, out);
      } else if (p.fmt == Q8_0) {
        const __m256 vd = _mm256_set1_ps(d);
        for (int h = 0; h < 4; ++h) {
          const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h));
          _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), vd));
        }
      } else {
        const __m256 vd = _mm256_set1_ps(d);
        const __m256i eight = _mm256_set1_epi32(8), low = _mm256_set1_epi32(15);
        for (int h = 0; h < 2; ++h) {  // bytes 8 h .. 8 h + 7: values 8 h .. (low), 16 + 8 h .. (high)
          const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h)));
          const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(raw, low), eight);
          const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(raw, 4), eight);
          _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), vd));
          _mm256_storeu_ps(out + 16 + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), vd));
        }
      }
    }
  }

  // Cephes' expf as on AVX-512; 2^n built in the exponent bits (x is clamped at -87, where n >= -126).
  LKV_AVX2 static __m256 exp(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }

  template <int NV>
  LKV_AVX2 static void score_tile(const float* x, int64_t ldx, const float* qt, int64_t ldq, int64_t W, float* s,
                                  int64_t lds) {
    __m256 acc[ROWS][NV];
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < W; ++k) {
      __m256 q[NV];
      for (int j = 0; j < NV; ++j) q[j] = _mm256_loadu_ps(qt + k * ldq + 8 * j);
      for (int i = 0; i < ROWS; ++i) {
        const __m256 v = _mm256_set1_ps(x[i * ldx + k]);
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_fmadd_ps(v, q[j], acc[i][j]);
      }
    }
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NV; ++j) _mm256_storeu_ps(s + i * lds + 8 * j, acc[i][j]);
  }

  template <int NV>
  LKV_AVX2 static void context_tile(const float* p, int64_t ldp, const float* v, int64_t rows, float* acc) {
    __m256 a[ROWS][NV];
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NV; ++j) a[i][j] = _mm256_loadu_ps(acc + i * SPAN + 8 * j);
    for (int64_t t = 0; t < rows; ++t) {
      __m256 x[NV];
      for (int j = 0; j < NV; ++j) x[j] = _mm256_loadu_ps(v + t * SPAN + 8 * j);
      for (int i = 0; i < ROWS; ++i) {
        const __m256 w = _mm256_set1_ps(p[t * ldp + i]);
        for (int j = 0; j < NV; ++j) a[i][j] = _mm256_fmadd_ps(w, x[j], a[i][j]);
      }
    }
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + i * SPAN + 8 * j, a[i][j]);
  }

  LKV_AVX2 static void softmax_column(float* col, int64_t ld, int64_t K, float* sum) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < K; ++t) m = _mm256_max_ps(m, _mm256_loadu_ps(col + t * ld));
    __m256 z = _mm256_setzero_ps();
    for (int64_t t = 0; t < K; ++t) {
      const __m256 e = exp(_mm256_sub_ps(_mm256_loadu_ps(col + t * ld), m));
      _mm256_storeu_ps(col + t * ld, e);
      z = _mm256_add_ps(z, e);
    }
    _mm256_storeu_ps(sum, z);
  }
};

// f(integral_constant<nv>) for nv in 1 .. MAX (a tile's vector count as a template argument)
template <int MAX, typename F>
void by_vectors(int64_t nv, F&& f) {
  if (nv <= 1) return f(std::integral_constant<int, 1>{});
  if constexpr (MAX >= 2) {
    if (nv == 2) return f(std::integral_constant<int, 2>{});
  }
  if constexpr (MAX >= 4) {
    if (nv == 3) return f(std::integral_constant<int, 3>{});
    return f(std::integral_constant<int, 4>{});
  }
}

// The three steps of the file's comment on one vector path P.
template <class P>
void decode_rows(const float* query, int64_t H, const Part& c, const Part& r, const int64_t* index, int64_t K,
                 float* out) {
  constexpr int64_t L = P::LANES;
  const int64_t W = c.n + r.n;
  const int64_t Hp = (H + 15) / 16 * 16;                             // score columns: heads padded to 16
  const int64_t Hs = ((H + ROWS - 1) / ROWS * ROWS + 15) / 16 * 16;  // ... and to context tiles
  const int64_t Kp = (K + ROWS - 1) / ROWS * ROWS;
  auto row_of = [&](const Part& part, int64_t t) { return part.base + (index ? index[t] : t) * part.stride; };

  std::vector<float> qt(W * Hs, 0.0f);  // the query transposed [W][Hs], zero past H
  for (int64_t h = 0; h < H; ++h)
    for (int64_t k = 0; k < W; ++k) qt[k * Hs + h] = query[h * W + k];
  std::unique_ptr<float[]> s(new float[Kp * Hs]);  // scores, then weights [Kp][Hs] (every read entry written)

  // 1. scores, ROWS rows at a time (rows past K are zero: their scores are never read)
  const int64_t tiles = Kp / ROWS;
  const int64_t grain = std::max<int64_t>(1, 256 * 1024 / std::max<int64_t>(1, ROWS * W * Hp));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> x(ROWS * W);
    for (int64_t tile = t0; tile < t1; ++tile) {
      for (int64_t i = 0; i < ROWS; ++i) {
        const int64_t t = tile * ROWS + i;
        if (t < K) {
          P::widen(c, row_of(c, t), 0, c.n, x.data() + i * W);
          P::widen(r, row_of(r, t), 0, r.n, x.data() + i * W + c.n);
        } else {
          std::fill(x.begin() + i * W, x.begin() + (i + 1) * W, 0.0f);
        }
      }
      for (int64_t v0 = 0; v0 < Hp / L; v0 += P::MAX_NV) {
        by_vectors<P::MAX_NV>(std::min<int64_t>(P::MAX_NV, Hp / L - v0), [&](auto nv) {
          P::template score_tile<decltype(nv)::value>(x.data(), W, qt.data() + L * v0, Hs, W,
                                                      s.get() + tile * ROWS * Hs + L * v0, Hs);
        });
      }
    }
  });

  // 2. softmax over the K rows, per head (L heads per vector, a vector per task); the sums
  //    divide the context
  std::vector<float> sum(Hs, 0.0f);
  at::parallel_for(0, Hs / L, K >= 512 ? 1 : Hs / L, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) P::softmax_column(s.get() + L * v, Hs, K, sum.data() + L * v);
  });

  // 3. context, one span of SPAN columns of c per task
  const int64_t spans = (c.n + SPAN - 1) / SPAN;
  const int64_t Hr = (H + ROWS - 1) / ROWS * ROWS;
  at::parallel_for(0, spans, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> acc(Hr * SPAN), v(CHUNK * SPAN);
    for (int64_t span = j0; span < j1; ++span) {
      const int64_t col = span * SPAN, width = std::min<int64_t>(SPAN, c.n - col);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t0 = 0; t0 < K; t0 += CHUNK) {
        const int64_t rows = std::min<int64_t>(CHUNK, K - t0);
        for (int64_t i = 0; i < rows; ++i) P::widen(c, row_of(c, t0 + i), col, width, v.data() + i * SPAN);
        for (int64_t h = 0; h < Hr; h += ROWS) {
          for (int64_t v0 = 0; v0 < width / L; v0 += P::MAX_NV) {
            by_vectors<P::MAX_NV>(std::min<int64_t>(P::MAX_NV, width / L - v0), [&](auto nv) {
              P::template context_tile<decltype(nv)::value>(s.get() + t0 * Hs + h, Hs, v.data() + L * v0, rows,
                                                            acc.data() + h * SPAN + L * v0);
            });
          }
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const float inv = 1.0f / sum[h];
        for (int64_t j = 0; j < width; ++j) out[h * c.n + col + j] = acc[h * SPAN + j] * inv;
      }
    }
  });
}

#endif  // LKV_X86

Part part_of(const at::Tensor& codes, int64_t n, int64_t fmt, int64_t block, const char* name) {
  TORCH_CHECK(fmt >= BF16 && fmt <= Q4_0, "mla_decode: ", name, ": unknown row format ", fmt);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.stride(1) == 1,
              "mla_decode: ", name, " must be uint8 [T, bytes] with unit column stride");
  if (fmt != BF16)  // the codecs' blocks; a context span (64 values) is whole blocks of each
    TORCH_CHECK((block == 8 || block == 16 || block == 32) && n % block == 0, "mla_decode: ", name,
                ": blocks of 8, 16 or 32 values that divide the row's ", n, ", got ", block);
  TORCH_CHECK(codes.size(1) == row_bytes(fmt, n, block), "mla_decode: ", name, " rows of ", codes.size(1),
              " bytes, format ", fmt, " stores ", n, " values in ", row_bytes(fmt, n, block));
  return Part{codes.data_ptr<uint8_t>(), codes.stride(0), n, fmt, block};
}

at::Tensor mla_decode(const at::Tensor& query, const at::Tensor& c, const at::Tensor& r,
                      const std::optional<at::Tensor>& index, int64_t fmt_c, int64_t block_c, int64_t n_r,
                      int64_t fmt_r, int64_t block_r, int64_t isa) {
  TORCH_CHECK(isa >= 1 && isa <= 4 && cpu_has(isa),
              "mla_decode: needs the AVX2 or AVX-512 path (isa 1..4) on a CPU that has it, got isa ", isa);
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 2 && query.is_contiguous(),
              "mla_decode: query must be contiguous float32 [H, n_c + n_r]");
  const int64_t H = query.size(0), n_c = query.size(1) - n_r;
  TORCH_CHECK(n_r >= 0 && n_c > 0 && n_c % 16 == 0, "mla_decode: the latent width ", n_c,
              " must be a positive multiple of 16");
  TORCH_CHECK(c.size(0) == r.size(0), "mla_decode: ", c.size(0), " c rows but ", r.size(0), " r rows");
  const Part pc = part_of(c, n_c, fmt_c, block_c, "c"), pr = part_of(r, n_r, fmt_r, block_r, "r");
  const int64_t T = c.size(0);
  const int64_t* idx = nullptr;
  int64_t K = T;
  if (index.has_value()) {
    const at::Tensor& ix = *index;
    TORCH_CHECK(ix.scalar_type() == at::kLong && ix.dim() == 1 && ix.is_contiguous(),
                "mla_decode: index must be contiguous int64 [K]");
    idx = ix.data_ptr<int64_t>();
    K = ix.size(0);
    for (int64_t i = 0; i < K; ++i)
      TORCH_CHECK(idx[i] >= 0 && idx[i] < T, "mla_decode: index ", idx[i], " outside the ", T, " rows");
  }
  TORCH_CHECK(K > 0, "mla_decode: no rows to attend to");
  at::Tensor out = at::empty({H, n_c}, query.options());
#if LKV_X86
  if (isa >= 2)
    decode_rows<Avx512>(query.data_ptr<float>(), H, pc, pr, idx, K, out.data_ptr<float>());
  else
    decode_rows<Avx2>(query.data_ptr<float>(), H, pc, pr, idx, K, out.data_ptr<float>());
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latentkv, m) {
  m.def(
      "mla_decode(Tensor query, Tensor c, Tensor r, Tensor? index, int fmt_c, int block_c, int n_r, int fmt_r, "
      "int block_r, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(latentkv, CPU, m) { m.impl("mla_decode", &mla_decode); }
