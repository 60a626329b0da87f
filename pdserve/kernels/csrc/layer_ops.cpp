// The small per-layer operations of a decoder step, fused, on CPU: residual add + RMSNorm, SiLU-and-mul,
// and RoPE + KV-cache write.
//
// Why: at decode each of these touches a few KB, so their cost is not arithmetic but the number of
// torch operations around them (dispatch, allocation, a thread-pool fork per op): about 35 operations
// per layer, ~13 ms of a 57 ms step on a 2-core machine for a 30-layer model. Each op here replaces
// 2 to 15 of them with one call that makes one pass over its rows. pdserve/model/layer_ops.py keeps the torch
// versions (the reference, and the path for every other device or dtype).
//
// Numerics: everything is computed in fp32 and rounded once to the tensor's dtype (fp32 or bf16).
// RMSNorm sums squares in fp32 in 8 partial sums (torch sums in blocks too); RoPE uses the fp32
// cos/sin tables directly (the torch path rounds them to the activation dtype first).
// Only the ATen headers this file uses: <torch/types.h> (all of ATen's functions) made the build 1.5x as long.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) { p[i] = c10::BFloat16(v); }

// Rows per task: one row is a few hundred floats, so small batches stay on the calling thread.
constexpr int64_t kGrain = 16;

// residual += x (when x is given); out = residual * rsqrt(mean(residual^2) + eps) * weight.
template <typename T>
void add_rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t dim, double eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* res = residual + r * dim;
      float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < dim; ++i) {
        float v = load(res, i);
        if (x) {
          v += load(x + r * dim, i);
          store(res, i, v);
          v = load(res, i);  // normalise the rounded sum, as a separate add then norm would
        }
        partial[i & 7] += v * v;
      }
      const float ss = ((partial[0] + partial[4]) + (partial[1] + partial[5])) +
                       ((partial[2] + partial[6]) + (partial[3] + partial[7]));
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      for (int64_t i = 0; i < dim; ++i) store(out + r * dim, i, load(res, i) * inv * load(weight, i));
    }
  });
}

at::Tensor add_rms_norm(const std::optional<at::Tensor>& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "add_rms_norm: residual must be [rows, dim] contiguous");
  TORCH_CHECK(weight.scalar_type() == residual.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == residual.size(1), "add_rms_norm: weight must be [dim] of the residual's dtype");
  if (x) TORCH_CHECK(x->sizes() == residual.sizes() && x->scalar_type() == residual.scalar_type() && x->is_contiguous(),
                     "add_rms_norm: x must match the residual");
  at::Tensor out = at::empty_like(residual);
  const int64_t rows = residual.size(0), dim = residual.size(1);
  if (residual.scalar_type() == at::kFloat) {
    add_rms_norm_rows(x ? x->data_ptr<float>() : nullptr, residual.data_ptr<float>(), weight.data_ptr<float>(),
                      out.data_ptr<float>(), rows, dim, eps);
  } else {
    TORCH_CHECK(residual.scalar_type() == at::kBFloat16, "add_rms_norm: fp32 or bf16 only");
    add_rms_norm_rows(x ? x->data_ptr<c10::BFloat16>() : nullptr, residual.data_ptr<c10::BFloat16>(),
                      weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, dim, eps);
  }
  return out;
}

// gate_up [rows, 2 * d] -> silu(gate) * up [rows, d].
template <typename T>
void silu_and_mul_rows(const T* in, T* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = in + r * 2 * d;
      for (int64_t i = 0; i < d; ++i) {
        const float a = load(g, i);
        // silu rounded to the dtype first, as F.silu(gate) * up does.
        T s;
        store(&s, 0, a / (1.0f + std::exp(-a)));
        store(out + r * d, i, load(&s, 0) * load(g + d, i));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: [rows, 2 * d] contiguous expected");
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, d);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_and_mul: fp32 or bf16 only");
    silu_and_mul_rows(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, d);
  }
  return out;
}

// In place on qkv [tokens, (heads + 2 * kv_heads) * head_dim]: rotate-half RoPE on the q and k heads of
// each token at its position; then the token's k and v heads are copied into the cache slot
// slot_mapping[t] of kv_layer [2, kv_heads, num_blocks, block_size, head_dim].
template <typename T>
void rope_and_cache_rows(T* qkv, const int64_t* positions, const float* cos, const float* sin, T* kv,
                         const int64_t* slots, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t cache_slots, int64_t max_pos) {
  const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
  at::parallel_for(0, tokens, kGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pos = positions[t];
      TORCH_CHECK(pos >= 0 && pos < max_pos, "rope_and_cache: position ", pos, " out of the RoPE table");
      const float* c = cos + pos * half;
      const float* s = sin + pos * half;
      T* row = qkv + t * width;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {  // q heads, then k heads
        T* x = row + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(x, i), x2 = load(x, i + half);
          store(x, i, x1 * c[i] - x2 * s[i]);
          store(x, i + half, x2 * c[i] + x1 * s[i]);
        }
      }
      const int64_t slot = slots[t];
      TORCH_CHECK(slot >= 0 && slot < cache_slots, "rope_and_cache: slot ", slot, " outside the cache");
      for (int64_t part = 0; part < 2; ++part) {  // k, then v
        const T* src = row + (heads + part * kv_heads) * head_dim;
        for (int64_t h = 0; h < kv_heads; ++h) {
          T* dst = kv + ((part * kv_heads + h) * cache_slots + slot) * head_dim;
          std::copy(src + h * head_dim, src + (h + 1) * head_dim, dst);
        }
      }
    }
  });
}

void rope_and_cache(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& kv_layer, const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.size(1) == kv_heads && kv_layer.is_contiguous(),
              "rope_and_cache: kv_layer must be [2, kv_heads, blocks, block_size, head_dim] contiguous");
  const int64_t head_dim = kv_layer.size(4), tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * head_dim &&
                  qkv.scalar_type() == kv_layer.scalar_type(), "rope_and_cache: qkv must be [tokens, (heads + 2 kv_heads) "
              "* head_dim] contiguous, of the cache's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == tokens && slot_mapping.numel() == tokens && positions.is_contiguous() &&
                  slot_mapping.is_contiguous(), "rope_and_cache: positions and slot_mapping must be [tokens] int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == head_dim / 2 && sin.sizes() == cos.sizes(),
              "rope_and_cache: cos and sin must be [max_pos, head_dim / 2] fp32");
  const int64_t cache_slots = kv_layer.size(2) * kv_layer.size(3);
  if (qkv.scalar_type() == at::kFloat) {
    rope_and_cache_rows(qkv.data_ptr<float>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                        sin.data_ptr<float>(), kv_layer.data_ptr<float>(), slot_mapping.data_ptr<int64_t>(), tokens,
                        heads, kv_heads, head_dim, cache_slots, cos.size(0));
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rope_and_cache: fp32 or bf16 only");
    rope_and_cache_rows(qkv.data_ptr<c10::BFloat16>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                        sin.data_ptr<float>(), kv_layer.data_ptr<c10::BFloat16>(), slot_mapping.data_ptr<int64_t>(),
                        tokens, heads, kv_heads, head_dim, cache_slots, cos.size(0));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("add_rms_norm(Tensor? x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) kv_layer, "
        "Tensor slot_mapping, int heads, int kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_and_cache", &rope_and_cache);
}
