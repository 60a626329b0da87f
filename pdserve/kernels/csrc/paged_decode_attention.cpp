// Decode attention over the paged KV cache on CPU, reading each K/V vector in place, once.
//
// The torch path (pdserve/model/attention.py) gathers every row's blocks into a padded dense tensor and then
// runs two matmuls over it: the KV bytes cross memory about three times, and padding costs as much as
// real tokens. Here each (row, kv head) task walks its block table and reads the K and V vectors where
// they lie in the cache. Decode attention is memory-bound, so touching every byte once is the point.
//
// Layout (see pdserve/model/attention.py): kv_layer is [2, kv_heads, num_blocks, block_size, head_dim], so
// one block of one kv head is block_size * head_dim contiguous floats. A kv head serves G = heads /
// kv_heads query heads (grouped-query attention); a task computes all G together, so each K/V vector is
// loaded from memory once for the whole group and reused from L1 for the other G - 1 heads.
//
// Algorithm per task: two passes. Pass 1 computes the G x ctx scores into a small scratch buffer
// (ctx * G floats: a few KB, it stays in L1/L2); the softmax then runs on that buffer exactly as the
// torch path does (subtract the max, exponentiate, sum); pass 2 accumulates probability-weighted V
// vectors into the output. Compared with an online (flash-style) softmax this reads the same bytes,
// needs no rescaling of the accumulator, and keeps the arithmetic in the torch path's order, which
// keeps the parity with it tight.
//
// Numerics: fp32 throughout, no -ffast-math (which would let the compiler reorder every sum). The
// vectorisation is explicit instead, with GCC/clang vector types of 8 floats: dot products keep 8-lane
// partial sums and add them up at the end, the V update is an elementwise multiply-add, and exp is a
// branch-free polynomial (Cephes expf, ~1 ulp) rather than a scalar libm call. Results differ from the
// torch path only by summation order and exp rounding (~1e-7 absolute on unit-scale values). A bf16
// cache is read as stored and widened in registers (q and the output go through fp32 copies, a few
// KB): bf16 halves the bytes, the arithmetic stays fp32. The hot function is multiversioned (vec.h).
// Only the ATen headers this file uses: <torch/types.h> (all of ATen's functions) made the build 1.5x as long.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

using namespace pdserve_vec;

// K and V are fp32 or bf16 in the cache; everything else (q, scores, the output) is fp32 here.
using pdserve_vec::load;  // overloaded below: a using-directive alone would be hidden by the overload
PDSERVE_INLINE vec8 load(const c10::BFloat16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }
PDSERVE_INLINE float to_f(float x) { return x; }
PDSERVE_INLINE float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

PDSERVE_INLINE vec8 splat(float x) { return vec8{x, x, x, x, x, x, x, x}; }

PDSERVE_INLINE vec8 vmax(vec8 a, vec8 b) { return a > b ? a : b; }

PDSERVE_INLINE float hmax(vec8 v) {
  float m = v[0];
  for (int j = 1; j < kW; ++j) m = m > v[j] ? m : v[j];
  return m;
}

PDSERVE_INLINE vec4 fold(vec8 v) {  // lanes j and j + 4 added: 8 partial sums -> 4
  vec4 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  return lo + hi;
}

PDSERVE_INLINE float hsum(vec8 v) {
  const vec4 s = fold(v);
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// {sum(a), sum(b), sum(c), sum(d)}: four horizontal sums for the price of about two.
PDSERVE_INLINE vec4 hsum4(vec8 a8, vec8 b8, vec8 c8, vec8 d8) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
  const vec4 a = fold(a8), b = fold(b8), c = fold(c8), d = fold(d8);
  // ab = {a0+a2, b0+b2, a1+a3, b1+b3}, cd likewise; then pairs of those complete each sum.
  const vec4 ab = __builtin_shufflevector(a, b, 0, 4, 1, 5) + __builtin_shufflevector(a, b, 2, 6, 3, 7);
  const vec4 cd = __builtin_shufflevector(c, d, 0, 4, 1, 5) + __builtin_shufflevector(c, d, 2, 6, 3, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
#else
  return vec4{hsum(a8), hsum(b8), hsum(c8), hsum(d8)};
#endif
}

// q . k over n floats: two vector accumulators (so consecutive FMAs do not wait on each other), one
// horizontal sum at the end, scalar tail for n not a multiple of 8.
template <typename T>
PDSERVE_INLINE float dot(const float* a, const T* b, int64_t n) {
  vec8 acc0 = splat(0.f), acc1 = splat(0.f);
  int64_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    acc0 += load(a + i) * load(b + i);
    acc1 += load(a + i + kW) * load(b + i + kW);
  }
  for (; i + kW <= n; i += kW) acc0 += load(a + i) * load(b + i);
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * to_f(b[i]);
  return hsum(acc0 + acc1) + tail;
}

// q . k_j for four consecutive rows k_j = k + j * n: each load of q serves four products, and the
// four horizontal sums are done together.
template <typename T>
PDSERVE_INLINE vec4 dot4(const float* q, const T* k, int64_t n) {
  vec8 a0 = splat(0.f), a1 = splat(0.f), a2 = splat(0.f), a3 = splat(0.f);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const vec8 qv = load(q + i);
    a0 += qv * load(k + i);
    a1 += qv * load(k + n + i);
    a2 += qv * load(k + 2 * n + i);
    a3 += qv * load(k + 3 * n + i);
  }
  vec4 r = hsum4(a0, a1, a2, a3);
  for (; i < n; ++i)
    for (int j = 0; j < 4; ++j) r[j] += q[i] * to_f(k[j * n + i]);
  return r;
}

// The same arithmetic on one float or on a vector of 8, for exp_nonpositive below.
PDSERVE_INLINE float clamp_below(float x, float lo) { return x > lo ? x : lo; }
PDSERVE_INLINE vec8 clamp_below(vec8 x, float lo) { return vmax(x, splat(lo)); }
PDSERVE_INLINE int32_t to_int(float x) { return static_cast<int32_t>(x); }  // truncates toward zero
PDSERVE_INLINE ivec8 to_int(vec8 x) { return __builtin_convertvector(x, ivec8); }
PDSERVE_INLINE float to_float(int32_t x) { return static_cast<float>(x); }
PDSERVE_INLINE vec8 to_float(ivec8 x) { return __builtin_convertvector(x, vec8); }
PDSERVE_INLINE float from_bits(int32_t x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
PDSERVE_INLINE vec8 from_bits(ivec8 x) {
  vec8 f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the Cephes
// expf polynomial (~1 ulp), 2^n built in the exponent bits. Branch-free, so the vector version is the
// scalar one applied lane by lane. Inputs below -87 (where exp leaves the normal range) are clamped
// there: they contribute ~1e-38 instead of 0, far below the resolution of a sum that is >= 1.
template <typename F>
PDSERVE_INLINE F exp_nonpositive(F x) {
  x = clamp_below(x, -87.0f);
  const auto n = to_int(x * 1.44269504088896341f - 0.5f);  // x <= 0: truncation rounds x / ln2 to nearest
  const F fn = to_float(n);
  const F r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;  // ln2 in two parts: fn * 0.693359375 is exact
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * from_bits((n + 127) << 23);
}

// s[t] = exp(s[t] - max(s)) in place; returns the sum of the results.
PDSERVE_INLINE float softmax_numerator(float* s, int64_t n) {
  vec8 m8 = splat(s[0]);
  int64_t t = 0;
  for (; t + kW <= n; t += kW) m8 = vmax(m8, load(s + t));
  float m = hmax(m8);
  for (; t < n; ++t) m = m > s[t] ? m : s[t];
  vec8 sum8 = splat(0.f);
  for (t = 0; t + kW <= n; t += kW) {
    const vec8 e = exp_nonpositive(load(s + t) - m);
    store(s + t, e);
    sum8 += e;
  }
  float sum = hsum(sum8);
  for (; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// o[0:n] += sum_i p[i] * v[i * stride + 0:n] over i < count: the output stays in registers (four
// vectors, 32 floats at a time) across all `count` rows of v instead of being reloaded per row.
template <typename T>
PDSERVE_INLINE void accumulate_rows(float* o, const float* p, const T* v, int64_t count, int64_t stride,
                                    int64_t n) {
  int64_t d = 0;
  for (; d + 4 * kW <= n; d += 4 * kW) {
    vec8 a0 = load(o + d), a1 = load(o + d + kW), a2 = load(o + d + 2 * kW), a3 = load(o + d + 3 * kW);
    for (int64_t i = 0; i < count; ++i) {
      const float pi = p[i];  // scalar * vector broadcasts it (a vector literal here compiles badly)
      const T* vi = v + i * stride + d;
      a0 += pi * load(vi);
      a1 += pi * load(vi + kW);
      a2 += pi * load(vi + 2 * kW);
      a3 += pi * load(vi + 3 * kW);
    }
    store(o + d, a0), store(o + d + kW, a1), store(o + d + 2 * kW, a2), store(o + d + 3 * kW, a3);
  }
  for (; d + kW <= n; d += kW) {
    vec8 a = load(o + d);
    for (int64_t i = 0; i < count; ++i) a += p[i] * load(v + i * stride + d);
    store(o + d, a);
  }
  for (; d < n; ++d)
    for (int64_t i = 0; i < count; ++i) o[d] += p[i] * to_f(v[i * stride + d]);
}

// Asks for the cache lines of the next block while this one is computed: blocks lie at unrelated
// addresses, so the hardware prefetcher, which follows sequential streams, cannot guess them
// (measured here: ~10-15% off a layer whose K/V come from DRAM).
template <typename T>
PDSERVE_INLINE void prefetch(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(T)) __builtin_prefetch(p + i);
}

struct Geometry {
  int64_t group;        // query heads per kv head
  int64_t head_dim;
  int64_t block_size;
  int64_t head_stride;  // floats between kv heads in K (or V): num_blocks * block_size * head_dim
};

// One (row, kv head): q and out point at the G consecutive query heads [G, D]; k and v at this kv
// head's blocks [num_blocks, block_size, D]; scores is scratch of G * ctx floats.
template <typename T>
PDSERVE_MULTIVERSION
void attend(const float* q, const T* k, const T* v, const int64_t* table, int64_t ctx, float scale,
            const Geometry& geo, float* scores, float* out) {
  const int64_t G = geo.group, D = geo.head_dim, BS = geo.block_size;

  // Pass 1: scores[g, t] = scale * (q_g . k_t). Each k_t comes from memory once; the other G - 1 heads
  // read it from L1.
  for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += BS, ++b) {
    const T* kb = k + table[b] * BS * D;
    const int64_t n = std::min(BS, ctx - t0);
    if (t0 + BS < ctx) prefetch(k + table[b + 1] * BS * D, std::min(BS, ctx - t0 - BS) * D);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)  // four tokens at a time; their K (1 KB at D = 64) stays in L1 across heads
      for (int64_t g = 0; g < G; ++g) {
        const vec4 s = dot4(q + g * D, kb + i * D, D) * scale;
        std::memcpy(scores + g * ctx + t0 + i, &s, sizeof s);
      }
    for (; i < n; ++i)
      for (int64_t g = 0; g < G; ++g) scores[g * ctx + t0 + i] = dot(q + g * D, kb + i * D, D) * scale;
  }

  prefetch(v + table[0] * BS * D, std::min(BS, ctx) * D);  // pass 2's first block, during the softmax

  // Softmax per head, as torch computes it: subtract the max, exponentiate, sum. The 1 / sum scales
  // the output at the end (D multiplies per head instead of ctx).
  float inv_sum[64];  // G <= 64 is checked by the caller
  for (int64_t g = 0; g < G; ++g) inv_sum[g] = 1.0f / softmax_numerator(scores + g * ctx, ctx);

  // Pass 2: out_g = sum_t p[g, t] * v_t, a block at a time: the block's V (block_size * D floats, a
  // few KB) comes from memory once and stays in L1 while every head of the group accumulates it.
  std::fill(out, out + G * D, 0.0f);
  for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += BS, ++b) {
    const T* vb = v + table[b] * BS * D;
    const int64_t n = std::min(BS, ctx - t0);
    if (t0 + BS < ctx) prefetch(v + table[b + 1] * BS * D, std::min(BS, ctx - t0 - BS) * D);
    for (int64_t g = 0; g < G; ++g) accumulate_rows(out + g * D, scores + g * ctx + t0, vb, n, D, D);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv_sum[g];
}

// Writes attention of q [B, H, D] over the paged cache into out [B, H, D]; returns out.
at::Tensor paged_decode_attention_out(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, double scale, at::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && kv_layer.device().is_cpu() && block_tables.device().is_cpu() &&
                  context_lens.device().is_cpu() && out.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  const auto dtype = kv_layer.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && q.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_decode_attention: q, kv_layer and out must all be float32 or all bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(q.dim() == 3 && kv_layer.dim() == 5 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_decode_attention: expected q [B, H, D], kv_layer [2, KVH, NB, BS, D], block_tables [B, M], "
              "context_lens [B]");
  TORCH_CHECK(q.is_contiguous() && kv_layer.is_contiguous() && block_tables.is_contiguous() &&
                  context_lens.is_contiguous() && out.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = kv_layer.size(1), NB = kv_layer.size(2), BS = kv_layer.size(3);
  const int64_t M = block_tables.size(1);
  TORCH_CHECK(kv_layer.size(0) == 2 && kv_layer.size(4) == D, "paged_decode_attention: kv_layer shape mismatch");
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && H / KVH <= 64, "paged_decode_attention: heads must be a multiple of "
              "kv_heads, at most 64 per kv head");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "paged_decode_attention: batch mismatch");
  TORCH_CHECK(out.sizes() == q.sizes(), "paged_decode_attention: out must have q's shape");
  if (B == 0) return out;

  // Validate before any thread starts: a bad block id would read outside the cache.
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= M * BS, "paged_decode_attention: context length ", lens[b], " of row ", b,
                " outside [1, ", M * BS, "]");
    for (int64_t j = 0, used = (lens[b] + BS - 1) / BS; j < used; ++j)
      TORCH_CHECK(tables[b * M + j] >= 0 && tables[b * M + j] < NB, "paged_decode_attention: block id ",
                  tables[b * M + j], " outside [0, ", NB, ")");
    total += lens[b];
  }

  const Geometry geo{H / KVH, D, BS, NB * BS * D};
  // q and the output in fp32 (a few KB); K and V read in place, in the cache's dtype.
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor of = dtype == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  const float* qp = qf.data_ptr<float>();
  float* op = of.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // Tasks are (row, kv head), task i = row i / KVH. Rows arrive sorted by length (the runner sorts
  // decodes), so an even split of the task range would give one thread all the long rows: split it
  // into one contiguous range per thread of equal cost instead (cost ~ context length + a fixed part).
  const int64_t tasks = B * KVH;
  constexpr int64_t kTaskOverhead = 16;  // tokens' worth of per-task fixed work
  // Below ~1K token-heads (~20-40 us of work) waking the thread pool costs about what it saves.
  const int64_t chunks = std::min<int64_t>(tasks, total * KVH < 1024 ? 1 : at::get_num_threads());
  std::vector<int64_t> bounds(chunks + 1, tasks);
  bounds[0] = 0;
  {
    const int64_t work = total * KVH + tasks * kTaskOverhead;
    int64_t acc = 0, c = 1;
    for (int64_t i = 0; i < tasks && c < chunks; ++i) {
      acc += lens[i / KVH] + kTaskOverhead;
      if (acc * chunks >= work * c) bounds[c++] = i + 1;
    }
  }

  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t longest = 0;
      for (int64_t i = bounds[c]; i < bounds[c + 1]; ++i) longest = std::max(longest, lens[i / KVH]);
      std::vector<float> scores(geo.group * longest);
      for (int64_t i = bounds[c]; i < bounds[c + 1]; ++i) {
        const int64_t b = i / KVH, h = i % KVH;
        const int64_t off = (b * H + h * geo.group) * D;
        if (dtype == at::kFloat) {
          const float* kp = kv_layer.data_ptr<float>();
          attend(qp + off, kp + h * geo.head_stride, kp + (KVH + h) * geo.head_stride, tables + b * M, lens[b],
                 fscale, geo, scores.data(), op + off);
        } else {
          const c10::BFloat16* kp = kv_layer.data_ptr<c10::BFloat16>();
          attend(qp + off, kp + h * geo.head_stride, kp + (KVH + h) * geo.head_stride, tables + b * M, lens[b],
                 fscale, geo, scores.data(), op + off);
        }
      }
    }
  });
  if (dtype != at::kFloat) out.copy_(of);
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_decode_attention_out(Tensor q, Tensor kv_layer, Tensor block_tables, Tensor context_lens, float scale, "
        "Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention_out", &paged_decode_attention_out);
}
