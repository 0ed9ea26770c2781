// One decoder layer of a step (decode, verify or prefill rows) in one call, for a layer
// whose linears are tiles (tiles.cpp): the same steps as llama.py's DecoderLayer, each by our
// kernels, with no Python between them. At one stream a layer's ~20 torch calls from Python
// cost more than its non-matmul arithmetic; here they are one.
//
//   h = rms_norm(x); qkv = h @ Wqkv (+ bias); RoPE on q and k; k, v written at their slots;
//   x += attention(q, the cache) @ Wo (+ bias); h = rms_norm(x); x += (silu(g) * u) @ Wdown
//
// Arithmetic is the unfused path's up to the order of float additions and SiLU's exp (RoPE
// and SiLU are written out here: x * cos + rotate_half(x) * sin, g / (1 + exp(-g)) * u, the
// exp Cephes', vec_exp.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "vec_exp.h"

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor tiled_matmul(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias);
torch::Tensor tiled_matmul_a8(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias);
void tiled_matmul_add(torch::Tensor y, torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias);
void tiled_matmul_a8_add(torch::Tensor y, torch::Tensor x, torch::Tensor data, torch::Tensor params,
                         torch::Tensor bias);
torch::Tensor paged_attention_rows(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                   torch::Tensor block_tables, torch::Tensor seq, torch::Tensor lens,
                                   int64_t block_size, double scale, int64_t window, double softcap);

namespace {

// The operands' order in `weights` (llama.py `DecoderLayer.decode_operands`).
enum Operand { kInputNorm, kQkv, kQkvParams, kQkvBias, kO, kOParams, kOBias, kPostNorm, kGateUp, kGateUpParams,
               kDown, kDownParams, kOperands };

// RoPE in place on the first `heads` heads of each row of qkv [T, width]: rotate_half's sign
// is in sin (llama.py `rotary`), its roll by D / 2 the swap of the halves: v = h * cos +
// swap(h) * sin, 16 lanes at a time (D is 32, 64, 128 or 256: the paged kernel's sizes), each a
// product, then a sum, as the scalar form under -ffp-contract=off.
void rope(float* qkv, int64_t T, int64_t width, int64_t heads, int64_t D, const float* cos, const float* sin) {
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

// act[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i], silu(g) = g / (1 + exp(-g)) as torch
// computes it, 16 lanes at a time (I: down's K, a multiple of 32; exp16 ~1e-7 from torch's).
}  // namespace

// RoPE in place on the first `heads` heads of each row of x [T, width] (contiguous float32),
// cos, sin [T, D]: decode_layer's arithmetic, for the layer-by-layer path's rows.
void rope_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: contiguous float32 [T, W]");
  const int64_t T = x.size(0), D = cos.numel() / std::max<int64_t>(T, 1);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && sin.numel() == cos.numel() && cos.numel() == T * D &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  heads * D <= x.size(1), "cos, sin: float32 [T, D]");
  rope(x.data_ptr<float>(), T, x.size(1), heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.scalar_type() == torch::kFloat32,
              "gate_up: contiguous float32 [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(I % 16 == 0, "silu_mul: an intermediate size a multiple of 16");
  torch::Tensor act = torch::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.0f);
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *gate = g + t * 2 * I, *up = gate + I;
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 x = _mm512_loadu_ps(gate + i);
        const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        _mm512_storeu_ps(a + t * I + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
      }
    }
  });
  return act;
}

namespace {

// n values of `row` into `cache` (flat) from element `at`: copied into a float32 cache,
// rounded to the nearest float16 (ties to even, as torch's .to(float16)) into a float16 one.
void store_kv(torch::Tensor& cache, int64_t at, const float* row, int64_t n) {
  if (cache.scalar_type() == torch::kFloat32) {
    std::copy(row, row + n, cache.data_ptr<float>() + at);
    return;
  }
  auto* out = static_cast<uint16_t*>(cache.data_ptr()) + at;
  for (int64_t i = 0; i < n; i += 16) {  // n: KV * head_dim, a multiple of 16
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(row + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
  }
}

}  // namespace

// x [T, hidden] float32 contiguous, updated in place and returned. cos, sin [T, D]; keys,
// values [num_slots, KV, D] (the layer's cache, flat); slots [T]; tables [B, max_blocks],
// seq [T], lens [T]: paged_attention_rows' operands (any rows: a decode's, a verify step's, a
// prefill chunk's). int8_activations: the linears take tiles_a8.cpp's
// GEMV (the tiles' `Tiles.activations`: QUANT_ACTIVATIONS), else tiles.cpp's. Each linear's
// params tell its layout to those GEMVs (int8 group 16: 4 dimensions, formats.Tiles), so a
// layer may mix group 16 (GGUF's Q6_K, Q3_K, Q2_K) and group 32 linears.
torch::Tensor decode_layer(torch::Tensor x, std::vector<torch::Tensor> weights, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor keys, torch::Tensor values, torch::Tensor slots, torch::Tensor tables,
                           torch::Tensor seq, torch::Tensor lens, int64_t block_size, int64_t window, int64_t num_heads,
                           int64_t num_kv_heads, double scale, double eps, bool int8_activations) {
  TORCH_CHECK(weights.size() == kOperands, "decode_layer: the layer's 12 operands");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: float32 [T, hidden]");
  const int64_t T = x.size(0), D = keys.size(2), H = num_heads, KV = num_kv_heads;
  TORCH_CHECK(keys.size(1) == KV && keys.is_contiguous() && values.is_contiguous(), "keys, values: [S, KV, D]");
  TORCH_CHECK((keys.scalar_type() == torch::kFloat32 || keys.scalar_type() == torch::kFloat16) &&
                  values.scalar_type() == keys.scalar_type(), "keys, values: float32 or float16");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D, "cos, sin");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == T && slots.is_contiguous(), "slots: int64 [T]");
  const int64_t width = (H + 2 * KV) * D, num_slots = keys.size(0);
  const auto linear = [&](const torch::Tensor& in, int w, const torch::Tensor& bias) {
    return int8_activations ? tiled_matmul_a8(in, weights[w], weights[w + 1], bias)
                          : tiled_matmul(in, weights[w], weights[w + 1], bias);
  };
  const auto residual = [&](const torch::Tensor& in, int w, const torch::Tensor& bias) {  // x += linear(in)
    int8_activations ? tiled_matmul_a8_add(x, in, weights[w], weights[w + 1], bias)
                     : tiled_matmul_add(x, in, weights[w], weights[w + 1], bias);
  };
  torch::Tensor qkv = linear(rms_norm(x, weights[kInputNorm], eps), kQkv, weights[kQkvBias]);
  TORCH_CHECK(qkv.size(1) == width, "qkv: [T, (H + 2 KV) * D]");
  float* qp = qkv.data_ptr<float>();
  rope(qp, T, width, H + KV, D, cos.data_ptr<float>(), sin.data_ptr<float>());
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "a slot outside the cache");
    const float* row = qp + t * width;
    store_kv(keys, sp[t] * KV * D, row + H * D, KV * D);
    store_kv(values, sp[t] * KV * D, row + (H + KV) * D, KV * D);
  }
  torch::Tensor q = qkv.narrow(1, 0, H * D).contiguous().view({T, H, D});
  torch::Tensor attn = paged_attention_rows(q, keys, values, tables, seq, lens, block_size, scale, window, 0.0);
  residual(attn.view({T, H * D}), kO, weights[kOBias]);
  torch::Tensor gate_up = linear(rms_norm(x, weights[kPostNorm], eps), kGateUp, torch::Tensor());
  residual(silu_mul(gate_up), kDown, torch::Tensor());
  return x;
}
