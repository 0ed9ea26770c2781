// Weights times int8 activations (QUANT_ACTIVATIONS=int8; AVX-512 VNNI), the decode path of
// llama.cpp's Q4_1 / Q8_0 x Q8_1: y[M, N] = xq[M, K] @ W^T (+ bias), where each row of x is
// first rounded to int8 in blocks of 32 (scale d = max |x| / 127, q = round(x / d)) and W has
// one scale (and, but for symmetric int8, one min) per 32 weights (formats.py): int4 levels
// 0..15 in GGUF's Q4_1 nibble layout, or signed int8 levels.
//
// A block's products are integers, summed exactly by vpdpbusd (unsigned x signed bytes), then
// scaled once: dw * dx * sum(qw * qx) + mw * dx * sum(qx). So the result equals float32
// dequantize(W) @ dequantize(xq)^T up to the order of float additions
// (formats.quantize_activations is the reference), and costs a few instructions per 64
// bytes of weights where the float32 path (kernels.cpp) decodes each weight to a float.
// int4: the weights are the unsigned side. int8: the activations are, stored as qx + 128,
// and 128 * sum(qw) (one more vpdpbusd per 64 weights, shared by every row) is taken off.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace {

constexpr int kBlock = 32;

// Blocks per 512-bit step of weights: int4, 4 (128 weights in 64 bytes); int8, 2 (64 in 64).
template <bool kInt8>
constexpr int kPer = kInt8 ? 2 : 4;

// x rounded to int8, laid out for the weights. int4, per chunk of 4 blocks: their first 16
// values each (matching the low nibbles), then their last 16 (the high ones). int8: in
// order, each value + 128 (the unsigned side of vpdpbusd).
struct Activations {
  torch::Tensor q;       // [M, chunks * kPer * 32] bytes, zero past K
  torch::Tensor scales;  // float32 [M, chunks * 16]: each block's d, once per int32 lane of its products
  torch::Tensor sums;    // float32 [M, blocks]: d * sum(q) of each block (the weights' mins multiply it)
  int64_t blocks, chunks, row_bytes;
};

template <bool kInt8>
VNNI void quantize_row(const float* x, int64_t blocks, uint8_t* q, float* lanes, float* sums) {
  constexpr int per = kPer<kInt8>, lanes_per_block = 16 / per;
  const __m128i bias = _mm_set1_epi8(kInt8 ? static_cast<char>(0x80) : 0);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(lo)), _mm512_reduce_max_ps(_mm512_abs_ps(hi)));
    const float d = amax / 127.f;
    const __m512 dv = _mm512_set1_ps(d > 0.f ? d : 1.f);  // an all-zero block: q = 0
    // x / d rounded to nearest even, as torch.round(x / d) in the reference
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_div_ps(lo, dv)), qhi = _mm512_cvtps_epi32(_mm512_div_ps(hi, dv));
    const __m128i lo8 = _mm_xor_si128(_mm512_cvtsepi32_epi8(qlo), bias);
    const __m128i hi8 = _mm_xor_si128(_mm512_cvtsepi32_epi8(qhi), bias);
    uint8_t* first = kInt8 ? q + b * kBlock : q + (b / per) * 128 + (b % per) * 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(first), lo8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(first + (kInt8 ? 16 : 64)), hi8);
    for (int i = 0; i < lanes_per_block; ++i) lanes[b * lanes_per_block + i] = d;
    sums[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}

template <bool kInt8>
VNNI Activations quantize(const torch::Tensor& x) {
  const int64_t M = x.size(0), blocks = x.size(1) / kBlock, chunks = (blocks + kPer<kInt8> - 1) / kPer<kInt8>;
  const int64_t row_bytes = chunks * kPer<kInt8> * kBlock;
  Activations a{torch::zeros({M, row_bytes}, x.options().dtype(torch::kUInt8)), torch::zeros({M, chunks * 16}, x.options()),
                torch::empty({M, blocks}, x.options()), blocks, chunks, row_bytes};
  for (int64_t r = 0; r < M; ++r) {
    quantize_row<kInt8>(x.data_ptr<float>() + r * x.size(1), blocks, a.q.data_ptr<uint8_t>() + r * row_bytes,
                        a.scales.data_ptr<float>() + r * chunks * 16, a.sums.data_ptr<float>() + r * blocks);
  }
  return a;
}

struct Problem {
  const uint8_t* xq;    // Activations.q
  const float* xd;      // Activations.scales
  const float* xs;      // Activations.sums
  const uint8_t* q;     // int4 [N, K / 2] | int8 [N, K]
  const float* scales;  // [N, blocks]
  const float* mins;    // [N, blocks] or null (symmetric int8)
  const float* bias;    // [N] or null
  float* y;             // [M, N]
  int64_t N, blocks, chunks, row_bytes, act_bytes;
};

// The weights' mins times the activations' block sums, for output n and row r.
VNNI inline float min_term(const Problem& p, int64_t n, int64_t r) {
  if (p.mins == nullptr) return 0.f;
  const float* m = p.mins + n * p.blocks;
  const float* s = p.xs + r * p.blocks;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; b += 16) {
    const __mmask16 k = p.blocks - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (p.blocks - b)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + b), _mm512_maskz_loadu_ps(k, s + b), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// Outputs n .. n + NT - 1 of rows r0 .. r0 + R - 1.
template <bool kInt8, int R, int NT>
VNNI void dot_rows(const Problem& p, int64_t n, int64_t r0) {
  constexpr int per = kPer<kInt8>;
  const __m512i nibble = _mm512_set1_epi8(0x0F), u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  // a block's scale to the int32 lanes of its products: 4 lanes a block (int4), 8 (int8)
  const __m512i spread = kInt8 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                               : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[NT][R];
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < p.chunks; ++c) {
    const int64_t left = std::min<int64_t>(per, p.blocks - c * per);
    const __mmask64 bytes = left == per ? ~0ULL : (1ULL << (64 / per * left)) - 1;
    const __mmask8 blocks = static_cast<__mmask8>((1u << left) - 1);
    for (int t = 0; t < NT; ++t) {
      const __m512i packed = _mm512_maskz_loadu_epi8(bytes, p.q + (n + t) * p.row_bytes + c * 64);
      const __m128 ws4 = _mm_maskz_loadu_ps(blocks, p.scales + (n + t) * p.blocks + c * per);
      const __m512 ws = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(ws4));
      __m512i lo = packed, hi = packed, offset = _mm512_setzero_si512();
      if constexpr (kInt8) {
        offset = _mm512_dpbusd_epi32(offset, u128, packed);  // 128 * sum(qw), taken off each row's products
      } else {
        lo = _mm512_and_si512(packed, nibble);
        hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = p.xq + (r0 + r) * p.act_bytes + c * per * kBlock;
        __m512i dot;
        if constexpr (kInt8) {
          dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xr), packed), offset);
        } else {
          dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr));
          dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(xr + 64));
        }
        const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(p.xd + (r0 + r) * p.chunks * 16 + c * 16));
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[t][r]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < R; ++r) {
      const float b = p.bias != nullptr ? p.bias[n + t] : 0.f;
      p.y[(r0 + r) * p.N + n + t] = _mm512_reduce_add_ps(acc[t][r]) + min_term(p, n + t, r0 + r) + b;
    }
  }
}

template <bool kInt8, int R>
VNNI void dot_span(const Problem& p, int64_t begin, int64_t end, int64_t r0) {
  constexpr int NT = R == 1 ? 4 : (R == 2 ? 2 : 1);
  int64_t n = begin;
  for (; n + NT <= end; n += NT) dot_rows<kInt8, R, NT>(p, n, r0);
  for (; n < end; ++n) dot_rows<kInt8, R, 1>(p, n, r0);
}

template <bool kInt8>
VNNI torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                          const torch::Tensor& mins, const torch::Tensor& bias) {
  const int64_t M = x.size(0), N = q.size(0);
  const Activations a = quantize<kInt8>(x);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const Problem p{a.q.data_ptr<uint8_t>(), a.scales.data_ptr<float>(), a.sums.data_ptr<float>(),
                  static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<float>(),
                  mins.numel() ? mins.data_ptr<float>() : nullptr, bias.numel() ? bias.data_ptr<float>() : nullptr,
                  y.data_ptr<float>(), N, a.blocks, a.chunks, q.size(1), a.row_bytes};
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int64_t r0 = 0;
    for (; r0 + 4 <= M; r0 += 4) dot_span<kInt8, 4>(p, begin, end, r0);
    switch (M - r0) {
      case 3: dot_span<kInt8, 3>(p, begin, end, r0); break;
      case 2: dot_span<kInt8, 2>(p, begin, end, r0); break;
      case 1: dot_span<kInt8, 1>(p, begin, end, r0); break;
      default: break;
    }
  });
  return y;
}

}  // namespace

// y = quantize_activations(x) @ dequant(W)^T (+ bias), W in groups of 32: int4 (uint8 [N, K / 2],
// with mins) or int8 (int8 [N, K], mins or none).
torch::Tensor quant_matmul_q8(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor mins,
                              torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K a multiple of 32");
  TORCH_CHECK(q.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(), "contiguous weights");
  TORCH_CHECK(scales.size(1) == x.size(1) / kBlock && (mins.numel() == 0 || mins.sizes() == scales.sizes()),
              "scales, mins: [N, K / 32]");
  if (q.scalar_type() == torch::kChar) {
    TORCH_CHECK(q.size(1) == x.size(1), "int8 q: [N, K]");
    return matmul<true>(x, q, scales, mins, bias);
  }
  TORCH_CHECK(q.scalar_type() == torch::kByte && q.size(1) * 2 == x.size(1) && mins.numel(), "int4 q: uint8 [N, K / 2], mins");
  return matmul<false>(x, q, scales, mins, bias);
}
