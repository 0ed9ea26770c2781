// The elementwise steps of a decoder layer, one arithmetic for decode_layer.cpp's fused step
// and the layer-by-layer path (ops.py: rope_, silu_mul, gelu_mul, head_rms_norm_), so a row
// gets the same numbers in either: RoPE, SiLU and GELU (tanh) gating, the RMSNorm of each head
// (Qwen3's and Gemma 3's q / k norms).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "vec_exp.h"

// RoPE in place on the first `heads` heads of each row of qkv [T, width]: rotate_half's sign
// is in sin (llama.py `rotary`), its roll by D / 2 the swap of the halves: v = h * cos +
// swap(h) * sin, 16 lanes at a time (D is 32, 64, 128 or 256: the paged kernel's sizes), each a
// product, then a sum, as the scalar form under -ffp-contract=off.
void rope_rows(float* qkv, int64_t T, int64_t width, int64_t heads, int64_t D, const float* cos, const float* sin) {
  TORCH_CHECK(D % 32 == 0, "rope: head_dim a multiple of 32");
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = qkv + t * width + h * D;
      for (int64_t d = 0; d < half; d += 16) {
        const __m512 lo = _mm512_loadu_ps(v + d), hi = _mm512_loadu_ps(v + half + d);
        _mm512_storeu_ps(v + d, _mm512_add_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(c + d)),
                                              _mm512_mul_ps(hi, _mm512_loadu_ps(s + d))));
        _mm512_storeu_ps(v + half + d, _mm512_add_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(c + half + d)),
                                                     _mm512_mul_ps(lo, _mm512_loadu_ps(s + half + d))));
      }
    }
  }
}

// RMSNorm in place of heads first .. first + heads - 1 of each row of x [T, width] (D each, a
// multiple of 16), times w [D]: kernels.cpp rms_norm's arithmetic on each head.
void head_norm_rows(float* x, int64_t T, int64_t width, int64_t first, int64_t heads, int64_t D, const float* w,
                    double eps) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = first; h < first + heads; ++h) {
      float* v = x + t * width + h * D;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(v + d), _mm512_loadu_ps(v + d), acc);
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t d = 0; d < D; ++d) v[d] = (v[d] * inv) * w[d];
    }
  }
}

namespace {

// silu(g) = g / (1 + exp(-g)), as torch computes it; gelu(g) with tanh = 0.5 g (1 + tanh(u)),
// u = sqrt(2 / pi) (g + 0.044715 g^3), tanh(u) = 1 - 2 / (exp(2u) + 1) (exp16: ~1e-7 from torch's).
inline __m512 silu16(__m512 g) {
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

inline __m512 gelu16(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f), cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
  const __m512 e = exp16(_mm512_add_ps(u, u));
  const __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, tanh));
}

}  // namespace

// act[t, i] = gate(gate_up[t, i]) * gate_up[t, I + i], gate SiLU or GELU (tanh), 16 lanes at a
// time (I: a multiple of 16).
torch::Tensor gated(torch::Tensor gate_up, bool gelu) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == torch::kFloat32,
              "gate_up: contiguous float32 [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(I % 16 == 0, "gated: an intermediate size a multiple of 16");
  torch::Tensor act = torch::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *gate = g + t * 2 * I, *up = gate + I;
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 x = _mm512_loadu_ps(gate + i);
        _mm512_storeu_ps(a + t * I + i, _mm512_mul_ps(gelu ? gelu16(x) : silu16(x), _mm512_loadu_ps(up + i)));
      }
    }
  });
  return act;
}

torch::Tensor silu_mul(torch::Tensor gate_up) { return gated(gate_up, false); }

torch::Tensor gelu_mul(torch::Tensor gate_up) { return gated(gate_up, true); }

// RoPE in place on the first `heads` heads of each row of x [T, width] (contiguous float32),
// cos, sin [T, D]: decode_layer's arithmetic, for the layer-by-layer path's rows.
void rope_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: contiguous float32 [T, W]");
  const int64_t T = x.size(0), D = cos.numel() / std::max<int64_t>(T, 1);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && sin.numel() == cos.numel() && cos.numel() == T * D &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  heads * D <= x.size(1), "cos, sin: float32 [T, D]");
  rope_rows(x.data_ptr<float>(), T, x.size(1), heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
}

// RMSNorm in place of heads first .. first + heads - 1 of each row of x [T, width] (contiguous
// float32), each D = weight's size long, times weight: decode_layer's q / k norms.
void head_rms_norm_(torch::Tensor x, int64_t first, int64_t heads, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: contiguous float32 [T, W]");
  const int64_t D = weight.numel();
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat32 && D % 16 == 0 && first >= 0 &&
                  (first + heads) * D <= x.size(1), "weight: float32 [D], D a multiple of 16; heads inside a row");
  head_norm_rows(x.data_ptr<float>(), x.size(0), x.size(1), first, heads, D, weight.data_ptr<float>(), eps);
}
