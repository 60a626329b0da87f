// What the CPU kernels share: function multiversioning and 8-float vectors.
//
// Hot functions are compiled twice with GCC's target_clones, for x86-64-v3 (AVX2 + FMA) and the
// baseline, and the dynamic loader picks one for the CPU it runs on: one build is safe on any x86-64
// machine and still uses 256-bit vectors where they exist. (-march=native would tie the build to the
// CPU that compiled it, and the build is cached in a directory other machines may share.) Other
// compilers and architectures get the baseline build.
//
// GCC/clang vector extensions make the vectorisation explicit rather than hoping the auto-vectoriser
// finds it, with no intrinsics tied to one instruction set: 8 floats are one AVX register (two SSE ones
// in the baseline clone).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11  // x86-64-v3: GCC 11+
#define PDSERVE_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PDSERVE_MULTIVERSION
#endif
#define PDSERVE_INLINE inline __attribute__((always_inline))

namespace pdserve_vec {

typedef float vec8 __attribute__((vector_size(32)));
typedef int32_t ivec8 __attribute__((vector_size(32)));
typedef uint32_t uvec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));
constexpr int64_t kW = 8;

PDSERVE_INLINE vec8 load(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

PDSERVE_INLINE void store(float* p, vec8 v) { std::memcpy(p, &v, sizeof v); }

// Eight bf16 values (their bits) as fp32: a bf16 is the top half of an fp32.
typedef uint16_t u16x8 __attribute__((vector_size(16)));
PDSERVE_INLINE vec8 load_bf16(const uint16_t* p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const uvec8 u = __builtin_convertvector(h, uvec8) << 16;
  vec8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

}  // namespace pdserve_vec
