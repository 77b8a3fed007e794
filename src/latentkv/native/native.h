// What latentkv's native kernels (decode.cpp, bf16.cpp, attention.cpp, kv_blocks.cpp) share: the x86 target
// attributes of their vector paths, which of those paths this CPU runs, bfloat16's and fp16's
// widening, an AVX2 vector's lane sum.
//
// Vector paths (`isa`, chosen once per process in Python from torch's CPU capability):
//   4, 3  AVX-512 VNNI (+ VBMI); 2  AVX-512 (F, BW, VL, DQ); 1  AVX2 + FMA; 0  plain C++.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LKV_X86 1
#define LKV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define LKV_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni,fma")))
#define LKV_AVX2 __attribute__((target("avx2,fma")))
#else
#define LKV_X86 0
#endif

namespace latentkv_native {

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IEEE half -> float (exact; subnormals included).
inline float half_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if LKV_X86
// The sum of a float32 AVX2 vector's 8 lanes.
LKV_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Whether this CPU runs vector path `isa`.
inline bool cpu_has(int64_t isa) {
#if LKV_X86
  if (isa == 4) return cpu_has(3);  // the same instructions, int8 activations
  if (isa == 3)
    return cpu_has(2) && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni");
  if (isa == 2)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma");
  if (isa == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == 0;
}

}  // namespace latentkv_native
