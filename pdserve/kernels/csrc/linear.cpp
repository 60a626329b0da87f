// y = x @ W^T (+ bias) on CPU, for the small row counts of a decode step, with W stored as fp32, bf16
// or int8 with one fp32 scale per output channel (weight-only quantisation).
//
// Why not torch's own: at decode a linear layer is a matrix-vector product, bound by reading W once.
// On the AMD EPYC (AVX2) machines this project runs on, torch 2.13's fp32 path (MKL sgemm) reads W at
// about 8 GB/s of the ~18 GB/s the cores can stream, and its int8 weight-only kernel
// (_weight_int8pack_mm) is vectorised for AVX-512 only: 1-5 GB/s here. This kernel streams W once per
// call whatever M is, converting each weight vector to fp32 in registers, and keeps fp32 accumulators.
//
// Blocking: a task owns 4 consecutive output channels (rows of W) and walks K once, keeping
// 4 channels x up to 4 input rows = 16 accumulators of 8 lanes, which is the AVX2 register file; each
// loaded weight vector serves up to 4 rows of x, each loaded x vector 4 channels. More than 4 rows of x
// are done 4 at a time over the same 4 weight rows, which are then in L1 (4 x K x 4 bytes at most).
//
// Numerics: fp32 multiply-adds in 8-lane partial sums, added at the end (torch's kernels also sum in
// blocks; results differ from F.linear by summation order only, ~1e-6 relative). int8 rows are
// summed unscaled and multiplied by their scale once: exact in the integer part, one rounding more.
//
// Portability: the hot functions are built twice with target_clones (x86-64-v3 and baseline, see vec.h), as in
// paged_decode_attention.cpp, so one cached build runs on any x86-64 machine.
// Only the ATen headers this file uses: <torch/types.h> (all of ATen's functions) made the build 1.5x as long.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using namespace pdserve_vec;
constexpr int64_t kN = 4;  // output channels per task
constexpr int64_t kM = 4;  // rows of x per pass
#ifndef PDSERVE_PREFETCH
#define PDSERVE_PREFETCH 2
#endif
constexpr int64_t kPrefetch = PDSERVE_PREFETCH;  // groups of kN weight rows ahead

// How each weight format becomes fp32 vectors. A block of kB weights is one 32-byte load; sub(p, j)
// is its j-th vector of 8. Narrow formats are widened with shifts within 32-bit lanes, which AVX2 does
// in one instruction each (a byte or half-word shuffle into lanes would not vectorise as well), so
// vector j holds the weights k = lane * (kB / 8) + j of the block. The matching x values are put in
// that order once per call (permute_x), which costs M * K floats, not N * K.
template <typename W>
struct Format;

template <>
struct Format<float> {
  static constexpr int64_t kB = 8;
  static PDSERVE_INLINE vec8 sub(const float* p, int) { return load(p); }
};

template <>
struct Format<c10::BFloat16> {  // bf16 is the top half of an fp32
  static constexpr int64_t kB = 16;
  static PDSERVE_INLINE vec8 sub(const c10::BFloat16* p, int j) {
    uvec8 u;
    std::memcpy(&u, p, sizeof u);
    u = j == 0 ? u << 16 : u & 0xFFFF0000u;
    vec8 v;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
};

template <>
struct Format<int8_t> {
  static constexpr int64_t kB = 32;
  static PDSERVE_INLINE vec8 sub(const int8_t* p, int j) {
    ivec8 u;
    std::memcpy(&u, p, sizeof u);
    u = (u << (24 - 8 * j)) >> 24;  // byte j of each lane, sign-extended
    return __builtin_convertvector(u, vec8);
  }
};

PDSERVE_INLINE float to_float(float v) { return v; }
PDSERVE_INLINE float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
PDSERVE_INLINE float to_float(int8_t v) { return static_cast<float>(v); }

// x [M, K] into xp [M, K] with each whole block of kB values in the lane order of Format<W>::sub; the
// tail past the last whole block keeps its order.
template <typename W>
void permute_x(const float* x, float* xp, int64_t M, int64_t K) {
  constexpr int64_t kB = Format<W>::kB, kS = kB / kW;
  const int64_t kv = K - K % kB;
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = xp + m * K;
    for (int64_t k = 0; k < kv; k += kB)
      for (int64_t j = 0; j < kS; ++j)
        for (int64_t lane = 0; lane < kW; ++lane) dst[k + j * kW + lane] = src[k + lane * kS + j];
    for (int64_t k = kv; k < K; ++k) dst[k] = src[k];
  }
}

PDSERVE_INLINE float hsum(vec8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// acc[m][n] = x[m, :] . w[n, :] for NR weight rows and MR rows of x (x permuted for W's format).
// pf, when given, is the start of weight rows to prefetch (kN of them, ldw apart) while this tile runs.
template <int NR, int MR, typename W>
PDSERVE_INLINE void tile(const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t K, float acc[kM][kN],
                         const W* pf) {
  constexpr int64_t kB = Format<W>::kB;
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
  vec8 a[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) a[m][n] = vec8{};
  const int64_t kv = K - K % kB;
  for (int64_t k = 0; k < kv; k += kB) {
    if (pf && k % kLine == 0)
      for (int n = 0; n < kN; ++n) __builtin_prefetch(pf + n * ldw + k, 0, 3);
    for (int j = 0; j < kB / kW; ++j) {
      vec8 wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = Format<W>::sub(w + n * ldw + k, j);
      for (int m = 0; m < MR; ++m) {
        const vec8 xv = load(x + m * ldx + k + j * kW);
        for (int n = 0; n < NR; ++n) a[m][n] += wv[n] * xv;
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = hsum(a[m][n]);
      for (int64_t k = kv; k < K; ++k) s += to_float(w[n * ldw + k]) * x[m * ldx + k];
      acc[m][n] = s;
    }
}

template <int NR, typename W>
PDSERVE_INLINE void rows_pass(const W* w, int64_t ldw, const float* x, int64_t ldx, int64_t K, int64_t mr,
                              float acc[kM][kN], const W* pf) {
  switch (mr) {
    case 4: tile<NR, 4>(w, ldw, x, ldx, K, acc, pf); break;
    case 3: tile<NR, 3>(w, ldw, x, ldx, K, acc, pf); break;
    case 2: tile<NR, 2>(w, ldw, x, ldx, K, acc, pf); break;
    default: tile<NR, 1>(w, ldw, x, ldx, K, acc, pf); break;
  }
}

// Output channels [n0, n1) for all M rows: y[m, n] = acc * scale[n] + bias[n].
template <typename W>
PDSERVE_MULTIVERSION void linear_channels(const W* w, const float* scale, const float* bias, const float* x,
                                          float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  float acc[kM][kN];
  for (int64_t n = n0; n < n1; n += kN) {
    const int64_t nr = n1 - n < kN ? n1 - n : kN;
    for (int64_t m = 0; m < M; m += kM) {
      const int64_t mr = M - m < kM ? M - m : kM;
      const W* wn = w + n * K;
      const float* xm = x + m * K;
      // The first pass over these rows fetches the rows kPrefetch groups ahead: the hardware prefetcher
      // alone leaves each core at ~4 GB/s of its share on the EPYC machines (measured: int8 rows of
      // 576 bytes streamed at 7 GB/s on 2 cores without, 11-13 GB/s with).
      const W* pf = m == 0 && n + kPrefetch * kN < N ? wn + kPrefetch * kN * K : nullptr;
      switch (nr) {
        case 4: rows_pass<4>(wn, K, xm, K, K, mr, acc, pf); break;
        case 3: rows_pass<3>(wn, K, xm, K, K, mr, acc, pf); break;
        case 2: rows_pass<2>(wn, K, xm, K, K, mr, acc, pf); break;
        default: rows_pass<1>(wn, K, xm, K, K, mr, acc, pf); break;
      }
      for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nr; ++j) {
          float v = acc[i][j];
          if (scale) v *= scale[n + j];
          if (bias) v += bias[n + j];
          y[(m + i) * N + n + j] = v;
        }
    }
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear: x must be fp32 or bf16");
  const auto wt = weight.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar, "linear: weight must be fp32, bf16 or int8");
  TORCH_CHECK(weight.is_contiguous(), "linear: weight must be contiguous");
  TORCH_CHECK((wt == at::kChar) == scale.has_value(), "linear: int8 weights need a per-channel scale, others none");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();  // no copy for contiguous fp32
  if (wt != at::kFloat) {  // narrow weights take x in their lane order
    at::Tensor xp = at::empty_like(xf);
    if (wt == at::kBFloat16)
      permute_x<c10::BFloat16>(xf.data_ptr<float>(), xp.data_ptr<float>(), M, K);
    else
      permute_x<int8_t>(xf.data_ptr<float>(), xp.data_ptr<float>(), M, K);
    xf = xp;
  }
  at::Tensor sf, bf;
  if (scale) {
    sf = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(sf.numel() == N, "linear: scale needs one value per output channel");
  }
  if (bias) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "linear: bias needs one value per output channel");
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  const float* sp = scale ? sf.data_ptr<float>() : nullptr;
  const float* bp = bias ? bf.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Tasks of whole 4-channel groups; at least 16 groups each so small layers stay on one thread.
  const int64_t groups = (N + kN - 1) / kN;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * kN, n1 = g1 * kN < N ? g1 * kN : N;
    if (wt == at::kFloat)
      linear_channels(weight.data_ptr<float>(), sp, bp, xp, yp, M, N, K, n0, n1);
    else if (wt == at::kBFloat16)
      linear_channels(weight.data_ptr<c10::BFloat16>(), sp, bp, xp, yp, M, N, K, n0, n1);
    else
      linear_channels(weight.data_ptr<int8_t>(), sp, bp, xp, yp, M, N, K, n0, n1);
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("linear", &linear); }
