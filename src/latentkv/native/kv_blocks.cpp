// latentkv's encoder of KV rows into ggml-shaped blocks (kv/codecs/blocks.py): the same bytes as
// the torch encoder, row by row, without its dozens of small tensor ops per call (a decode step
// encodes one row per layer: ~0.2-0.5 ms each through torch, microseconds here).
//
//   latentkv::encode_blocks(x f32 [N, n], kind, block) -> uint8 [N, n / block * block_bytes]
//       kind 0  q8_0: d = amax / 127, q = round(x / d) half away from zero       (34 bytes / 32)
//            1  q4_0: d = max / -8, q = min(15, trunc(x / d + 8.5))              (18 bytes / 32)
//            2  q8s:  q8_0's bytes, d searched (below)
//            3  q4s:  q4_0's bytes, d searched, either sign
//   searched: the best of the trial scales fp16(g amax / top) (g = 0.85, 0.86 .. 1.05; q4s also
//   -g) under the error sum w (level d - x)^2, w = x^2 (q4s: + the block's mean x^2), then of that
//   scale and the weighted least-squares refit fp16(sum w x q / sum w q^2); the first on a tie.
//
// Every step is the torch encoder's, in float32 with the same roundings (the build has
// -ffp-contract=off, so no product is fused into a sum), and every sum over a block is taken in
// the order torch's CPU sum takes it for these widths (eight running sums over the block, value
// i into sum i mod 8, then those eight added in order), so the bytes are equal: the tests compare
// them on random rows and the golden rows. A row holding a NaN or an infinity, and a block whose
// fp16 scale overflows, are stored as zero bytes (the inert rows every codec writes).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "native.h"

namespace {

using latentkv_native::half_to_f32;

enum Kind : int64_t { Q8_0 = 0, Q4_0 = 1, Q8S = 2, Q4S = 3 };

constexpr int64_t MAX_BLOCK = 32;
constexpr int GRID = 21;  // trial scales 0.85 .. 1.05

// float -> IEEE half bits, round to nearest even (overflow -> inf, NaN kept), as torch's .to(float16)
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t ax = x & 0x7FFFFFFF;
  if (ax >= 0x7F800000) return static_cast<uint16_t>(sign | 0x7C00 | (ax > 0x7F800000 ? 0x200 : 0));
  if (ax >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds past 65504: inf
  if (ax < 0x38800000) {  // below the smallest normal half: a subnormal (or zero)
    if (ax < 0x33000000) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
    const uint32_t exp = ax >> 23, mant = (ax & 0x7FFFFF) | 0x800000;
    const uint32_t shift = 126 - exp;  // 14 .. 24
    uint32_t half = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((ax >> 13) - (112u << 10));
  const uint32_t rest = ax & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;
  return static_cast<uint16_t>(sign | half);
}

inline float round_f16(float f) { return half_to_f32(f32_to_f16(f)); }

// sum of v[0 .. n) in torch's order for a contiguous float row of 8, 16 or 32 values
__attribute__((always_inline)) inline float torch_sum(const float* v, int64_t n) {
  float acc[8];
  for (int l = 0; l < 8; ++l) acc[l] = v[l];
  for (int64_t k = 8; k < n; k += 8)
    for (int l = 0; l < 8; ++l) acc[l] = acc[l] + v[k + l];
  float s = acc[0];
  for (int l = 1; l < 8; ++l) s = s + acc[l];
  return s;
}

struct Searched {
  float low, high, top;
  bool both_signs;
  float grid[2 * GRID];  // trial multipliers, in the torch encoder's order
  int trials;
};

Searched searched_for(int64_t kind) {
  Searched s{};
  const bool q4 = kind == Q4S;
  s.low = q4 ? -8.0f : -127.0f;
  s.high = q4 ? 7.0f : 127.0f;
  s.top = q4 ? 8.0f : 127.0f;
  s.both_signs = q4;
  s.trials = 0;
  for (int i = 0; i < GRID; ++i) {
    const double g = 0.85 + 0.01 * i;  // Python's float arithmetic: SCALE_GRID
    s.grid[s.trials++] = static_cast<float>(g);
    if (q4) s.grid[s.trials++] = static_cast<float>(-g);
  }
  return s;
}

// The nearest levels of x[0 .. b) under scale d, and their error sum w (level d - x)^2.
__attribute__((always_inline)) inline float nearest(const Searched& s, const float* x, const float* w, int64_t b, float d, float* level) {
  const float div = d == 0.0f ? 1.0f : d;
  float e[MAX_BLOCK];
  for (int64_t j = 0; j < b; ++j) {
    const float v = x[j] / div;
    const float below = std::floor(v);
    float l = below + ((v > below + 0.5f) ? 1.0f : 0.0f);
    l = std::min(std::max(l, s.low), s.high);
    level[j] = l;
    const float r = l * d - x[j];
    e[j] = w[j] * (r * r);
  }
  return torch_sum(e, b);
}

// The first trial of least error (a NaN error never wins, unless it is the first trial's).
inline int best_of(const float* err, int n) {
  int best = 0;
  float best_err = std::isnan(err[0]) ? INFINITY : err[0];
  for (int i = 1; i < n; ++i) {
    const float e = std::isnan(err[i]) ? INFINITY : err[i];
    if (e < best_err) {
      best = i;
      best_err = e;
    }
  }
  return std::isnan(err[0]) ? 0 : best;
}

// One block of a searched codec: its levels and fp16 scale. Built for AVX2 and AVX-512 beside the
// baseline (the CPU picks at load): the trial loops vectorize there (floor and division are exact
// IEEE operations on every path, and nothing is fused, so every path writes the same bytes).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void search_block(const Searched& s, const float* x, int64_t b, float* level, uint16_t* d16) {
  float amax = 0.0f;
  for (int64_t j = 0; j < b; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float unit = amax / s.top;
  float w[MAX_BLOCK];
  for (int64_t j = 0; j < b; ++j) w[j] = x[j] * x[j];
  if (s.both_signs) {
    const float mean = torch_sum(w, b) / static_cast<float>(b);
    for (int64_t j = 0; j < b; ++j) w[j] = w[j] + mean;
  }
  float err[2 * GRID], scale[2 * GRID], trial[MAX_BLOCK];
  for (int i = 0; i < s.trials; ++i) {
    scale[i] = round_f16(unit * s.grid[i]);
    err[i] = nearest(s, x, w, b, scale[i], trial);
  }
  const int best = best_of(err, s.trials);
  const float d = scale[best];
  float q[MAX_BLOCK], t[MAX_BLOCK];
  nearest(s, x, w, b, d, q);  // its error is err[best]
  for (int64_t j = 0; j < b; ++j) t[j] = (w[j] * x[j]) * q[j];
  const float num = torch_sum(t, b);
  for (int64_t j = 0; j < b; ++j) t[j] = w[j] * (q[j] * q[j]);
  const float refit = round_f16(num / std::max(torch_sum(t, b), 1e-30f));
  const float pair_err[2] = {err[best], nearest(s, x, w, b, refit, trial)};
  const bool refitted = best_of(pair_err, 2) == 1;
  std::memcpy(level, refitted ? trial : q, sizeof(float) * b);
  *d16 = f32_to_f16(refitted ? refit : d);
}

int64_t block_bytes(int64_t kind, int64_t b) { return 2 + ((kind == Q8_0 || kind == Q8S) ? b : b / 2); }

// One row of n values into its blocks' bytes.
void encode_row(int64_t kind, const Searched& s, const float* row, int64_t n, int64_t b, uint8_t* out) {
  const int64_t bytes = block_bytes(kind, b);
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) finite = finite && std::isfinite(row[j]);
  if (!finite) {
    std::memset(out, 0, (n / b) * bytes);
    return;
  }
  const bool eight = kind == Q8_0 || kind == Q8S;
  for (int64_t k = 0; k < n / b; ++k, out += bytes) {
    const float* x = row + k * b;
    float level[MAX_BLOCK];
    uint16_t d16;
    if (kind == Q8S || kind == Q4S) {
      search_block(s, x, b, level, &d16);
    } else if (kind == Q8_0) {
      float amax = 0.0f;
      for (int64_t j = 0; j < b; ++j) amax = std::max(amax, std::fabs(x[j]));
      const float d = amax / 127.0f;
      const float inv = d != 0.0f ? 1.0f / d : 0.0f;
      for (int64_t j = 0; j < b; ++j) {
        const float v = x[j] * inv;
        const float sign = static_cast<float>((v > 0.0f) - (v < 0.0f));
        level[j] = sign * std::floor(std::fabs(v) + 0.5f);
      }
      d16 = f32_to_f16(d);
    } else {  // q4_0: the signed value of the largest magnitude (the first on a tie) lands on -8
      int64_t at = 0;
      for (int64_t j = 1; j < b; ++j)
        if (std::fabs(x[j]) > std::fabs(x[at])) at = j;
      const float d = x[at] / -8.0f;
      const float inv = d != 0.0f ? 1.0f / d : 0.0f;
      for (int64_t j = 0; j < b; ++j) {
        const float v = x[j] * inv + 8.5f;
        level[j] = static_cast<float>(std::min<int32_t>(static_cast<int32_t>(v), 15)) - 8.0f;
      }
      d16 = f32_to_f16(d);
    }
    if ((d16 & 0x7C00) == 0x7C00) {  // an fp16 scale that overflowed: an inert block
      std::memset(out, 0, bytes);
      continue;
    }
    std::memcpy(out, &d16, 2);
    if (eight) {
      for (int64_t j = 0; j < b; ++j) out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(level[j]));
    } else {
      for (int64_t j = 0; j < b / 2; ++j) {
        const int lo = static_cast<int>(level[j]) + 8, hi = static_cast<int>(level[j + b / 2]) + 8;
        out[2 + j] = static_cast<uint8_t>((lo & 15) | ((hi & 15) << 4));
      }
    }
  }
}

at::Tensor encode_blocks(const at::Tensor& x, int64_t kind, int64_t block) {
  TORCH_CHECK(kind >= Q8_0 && kind <= Q4S, "encode_blocks: unknown kind ", kind);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "encode_blocks: x must be float32 [N, n] with unit column stride");
  TORCH_CHECK(block == 8 || block == 16 || block == 32, "encode_blocks: blocks of 8, 16 or 32 values, got ", block);
  const int64_t N = x.size(0), n = x.size(1);
  TORCH_CHECK(n % block == 0, "encode_blocks: ", n, " values per row are not whole blocks of ", block);
  const int64_t row_bytes = n / block * block_bytes(kind, block);
  at::Tensor out = at::empty({N, row_bytes}, x.options().dtype(at::kByte));
  const Searched s = searched_for(kind);
  const float* src = x.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t ld = x.stride(0);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, n));
  at::parallel_for(0, N, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) encode_row(kind, s, src + r * ld, n, block, dst + r * row_bytes);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(latentkv, m) { m.def("encode_blocks(Tensor x, int kind, int block) -> Tensor"); }

TORCH_LIBRARY_IMPL(latentkv, CPU, m) { m.impl("encode_blocks", &encode_blocks); }
