// Weight-only quantized matmul for the CPU (AVX-512): y[M, N] = x[M, K] @ W^T (+ bias),
// W held as groups of `group` weights along K, each w = scale * q + min (min absent: w = scale * q).
//
// Formats (backend/runner/quant/formats.py):
//   int8: q int8 [N, K];
//   int4: q uint8 [N, K / 2], in blocks of 32 weights: byte j of a block holds weight j in its
//         low nibble and weight j + 16 in its high nibble (GGUF's Q4_0 / Q4_1 block layout).
//   scales, mins: float32 [N, K / group]; group is a multiple of 32, or 16 for int8 (GGUF's
//   K-quants: a block of 32 weights takes two groups' scales, and mins, one a half).
//
// The weights are decoded to float32 in registers and multiplied in float32, so a result
// equals float32 x @ dequantize(W)^T up to the order of float additions. `dequant` writes
// the dequantized matrix (float32, exact; or bf16) for the many-row (prefill) path's GEMM.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kBlock = 32;
constexpr int kMaxRows = 8;  // rows of x sharing one decode of the weights

// Weights k..k+31 of one output row, decoded to two float vectors (k..k+15, k+16..k+31).
inline void decode_int8(const int8_t* q, __m512& lo, __m512& hi) {
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
}

inline void decode_int4(const uint8_t* q, __m512& lo, __m512& hi) {
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}

template <bool kInt4>
inline void decode(const uint8_t* row, int64_t k, __m512& lo, __m512& hi) {
  if constexpr (kInt4) {
    decode_int4(row + k / 2, lo, hi);
  } else {
    decode_int8(reinterpret_cast<const int8_t*>(row) + k, lo, hi);
  }
}

struct Problem {
  const float* x;       // [M, K]
  const float* xsums;   // [M, K / group]: x summed over each group (for the mins)
  const uint8_t* q;     // a row of W is `row_bytes` bytes
  const float* scales;  // [N, K / group]
  const float* mins;    // [N, K / group] or null
  const float* bias;    // [N] or null
  float* y;             // [M, N]
  int64_t M, N, K, group, row_bytes;
};

// y[row, n] = the dot + (int8 with mins) mins[n, :] . xsums[row, :] + bias[n].
inline void store(const Problem& p, int64_t n, int64_t row, float dot) {
  if (p.mins != nullptr) {
    const int64_t groups = p.K / p.group;
    const float* m = p.mins + n * groups;
    const float* xs = p.xsums + row * groups;
    for (int64_t g = 0; g < groups; ++g) dot += m[g] * xs[g];
  }
  p.y[row * p.N + n] = dot + (p.bias != nullptr ? p.bias[n] : 0.f);
}

// Outputs n .. n + NT - 1 of rows r0 .. r0 + R - 1, int8: each group's products summed
// unscaled, then scaled once; the mins' share is the dot of the row's mins with x's group sums.
// R * NT independent accumulators keep the FMA units busy (one row alone would wait on
// each FMA's latency).
template <int R, int NT>
void dot_rows_int8(const Problem& p, int64_t n, int64_t r0) {
  const int64_t groups = p.K / p.group;
  __m512 acc[NT][R];
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[NT][R];
    for (int t = 0; t < NT; ++t) {
      for (int r = 0; r < R; ++r) part[t][r] = _mm512_setzero_ps();
    }
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += kBlock) {
      for (int t = 0; t < NT; ++t) {
        __m512 lo, hi;
        decode<false>(p.q + (n + t) * p.row_bytes, k, lo, hi);
        for (int r = 0; r < R; ++r) {
          const float* xr = p.x + (r0 + r) * p.K + k;
          part[t][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), part[t][r]);
          part[t][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), part[t][r]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 scale = _mm512_set1_ps(p.scales[(n + t) * groups + g]);
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_fmadd_ps(part[t][r], scale, acc[t][r]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < R; ++r) store(p, n + t, r0 + r, _mm512_reduce_add_ps(acc[t][r]));
  }
}

// int4: each group's 16 possible weights (scale * level + min, computed as the reference
// does) are a 16-float table, and a nibble picks its weight with one permute: the products
// are of the dequantized weights themselves, no scale or min pass after.
template <int R, int NT>
void dot_rows_int4(const Problem& p, int64_t n, int64_t r0) {
  const int64_t groups = p.K / p.group;
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 acc_lo[NT][R], acc_hi[NT][R];
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < R; ++r) acc_lo[t][r] = acc_hi[t][r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512 table[NT];
    for (int t = 0; t < NT; ++t) {
      const int64_t at = (n + t) * groups + g;
      table[t] = _mm512_mul_ps(levels, _mm512_set1_ps(p.scales[at]));
      table[t] = _mm512_add_ps(table[t], _mm512_set1_ps(p.mins[at]));
    }
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += kBlock) {
      for (int t = 0; t < NT; ++t) {
        const __m512i bytes = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + (n + t) * p.row_bytes + k / 2)));
        const __m512 lo = _mm512_permutexvar_ps(bytes, table[t]);  // the low 4 bits index
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table[t]);
        for (int r = 0; r < R; ++r) {
          const float* xr = p.x + (r0 + r) * p.K + k;
          acc_lo[t][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc_lo[t][r]);
          acc_hi[t][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc_hi[t][r]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < R; ++r) {
      p.y[(r0 + r) * p.N + n + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[t][r], acc_hi[t][r])) +
                                    (p.bias != nullptr ? p.bias[n + t] : 0.f);
    }
  }
}

// int8 group 16: each weight decoded as the reference computes it (q * scale + min, the scale
// and min of its half of the block), as tiles.cpp does, and multiplied by x.
template <int R, int NT>
void dot_rows_int8_halves(const Problem& p, int64_t n, int64_t r0) {
  const int64_t groups = p.K / 16;
  __m512 acc[NT][R];
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < p.K; k += kBlock) {
    for (int t = 0; t < NT; ++t) {
      __m512 w[2];
      decode<false>(p.q + (n + t) * p.row_bytes, k, w[0], w[1]);
      for (int h = 0; h < 2; ++h) {
        const int64_t g = (n + t) * groups + k / 16 + h;
        w[h] = _mm512_mul_ps(w[h], _mm512_set1_ps(p.scales[g]));
        if (p.mins != nullptr) w[h] = _mm512_add_ps(w[h], _mm512_set1_ps(p.mins[g]));
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = p.x + (r0 + r) * p.K + k;
        acc[t][r] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xr), acc[t][r]);
        acc[t][r] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xr + 16), acc[t][r]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    for (int r = 0; r < R; ++r) {
      p.y[(r0 + r) * p.N + n + t] = _mm512_reduce_add_ps(acc[t][r]) + (p.bias != nullptr ? p.bias[n + t] : 0.f);
    }
  }
}

enum class Path { kInt8, kInt4, kInt8Halves };  // the row kernels: int8 / int4 by whole groups, int8 group 16

template <Path kPath, int R, int NT>
inline void dot_rows(const Problem& p, int64_t n, int64_t r0) {
  if constexpr (kPath == Path::kInt4) {
    dot_rows_int4<R, NT>(p, n, r0);
  } else if constexpr (kPath == Path::kInt8Halves) {
    dot_rows_int8_halves<R, NT>(p, n, r0);
  } else {
    dot_rows_int8<R, NT>(p, n, r0);
  }
}

// Outputs [begin, end) of rows r0 .. r0 + rows - 1, four outputs at a time where they fit.
template <Path kPath, int R>
void dot_span(const Problem& p, int64_t begin, int64_t end, int64_t r0) {
  constexpr int NT = R >= 4 ? 1 : (R == 1 ? 4 : 2);
  int64_t n = begin;
  for (; n + NT <= end; n += NT) dot_rows<kPath, R, NT>(p, n, r0);
  for (; n < end; ++n) dot_rows<kPath, R, 1>(p, n, r0);
}

template <Path kPath>
void dot_tile(const Problem& p, int64_t begin, int64_t end, int64_t r0, int64_t rows) {
  switch (rows) {
    case 1: return dot_span<kPath, 1>(p, begin, end, r0);
    case 2: return dot_span<kPath, 2>(p, begin, end, r0);
    case 3: return dot_span<kPath, 3>(p, begin, end, r0);
    case 4: return dot_span<kPath, 4>(p, begin, end, r0);
    case 5: return dot_span<kPath, 5>(p, begin, end, r0);
    case 6: return dot_span<kPath, 6>(p, begin, end, r0);
    case 7: return dot_span<kPath, 7>(p, begin, end, r0);
    default: return dot_span<kPath, 8>(p, begin, end, r0);
  }
}

// group: a multiple of 32 dividing K, or (int8) 16 with K a multiple of 32
void check_group(int64_t K, int64_t group, int64_t bits) {
  TORCH_CHECK((group % kBlock == 0 || (group == 16 && bits == 8)) && K % group == 0 && K % kBlock == 0,
              "group must be a multiple of 32 dividing K, or 16 (int8)");
}

void check_operands(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, int64_t group,
                    int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  check_group(x.size(1), group, bits);
  TORCH_CHECK(q.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kFloat32, "layout");
  TORCH_CHECK(scales.size(1) == x.size(1) / group, "scales: [N, K / group]");
}

}  // namespace

// y = x @ W^T (+ bias). bits: 8 or 4; mins and bias may be empty tensors.
torch::Tensor quant_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor scales, torch::Tensor mins,
                           torch::Tensor bias, int64_t group, int64_t bits) {
  check_operands(x, q, scales, group, bits);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == (bits == 4 ? K / 2 : K), "q does not match K");
  TORCH_CHECK(bits == 8 || mins.numel(), "int4 has a min per group (symmetric: -8 * scale)");
  const bool halves = group == 16;
  // int8's mins multiply x's group sums; int4's go into its tables, group 16's into its weights
  torch::Tensor xsums = bits == 8 && !halves && mins.numel() ? x.view({M, K / group, group}).sum(-1).contiguous() : x;
  torch::Tensor y = torch::empty({M, N}, x.options());
  Problem p{x.data_ptr<float>(), xsums.data_ptr<float>(), static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<float>(),
            mins.numel() ? mins.data_ptr<float>() : nullptr, bias.numel() ? bias.data_ptr<float>() : nullptr,
            y.data_ptr<float>(), M, N, K, group, q.size(1)};
  // Each thread takes a run of outputs, every row: its weights are read from memory once.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, M - r0);
      if (bits == 4) {
        dot_tile<Path::kInt4>(p, begin, end, r0, rows);
      } else if (halves) {
        dot_tile<Path::kInt8Halves>(p, begin, end, r0, rows);
      } else {
        dot_tile<Path::kInt8>(p, begin, end, r0, rows);
      }
    }
  });
  return y;
}

// The dequantized weights [N, K], float32 (exact: the reference's values) or bf16 (rounded),
// the operand of the many-row matmul.
// `out`: where to write them (a reused buffer of at least N * K elements of the dtype), or empty.
torch::Tensor dequant(torch::Tensor q, torch::Tensor scales, torch::Tensor mins, int64_t group, int64_t bits,
                      bool bf16, torch::Tensor out) {
  const int64_t N = q.size(0), K = bits == 4 ? q.size(1) * 2 : q.size(1), groups = K / group;
  check_group(K, group, bits);
  TORCH_CHECK(q.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kFloat32, "layout");
  const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
  torch::Tensor w;
  if (out.numel()) {
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.numel() >= N * K, "out: too small");
    w = out.view(-1).narrow(0, 0, N * K).view({N, K});
  } else {
    w = torch::empty({N, K}, q.options().dtype(dtype));
  }
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.numel() ? mins.data_ptr<float>() : nullptr;
  char* wp = static_cast<char*>(w.data_ptr());
  const int64_t row_bytes = q.size(1), out_bytes = bf16 ? 2 : 4;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < K; k += kBlock) {
        __m512 lo, hi;
        if (bits == 4) {
          decode<true>(qp + n * row_bytes, k, lo, hi);
        } else {
          decode<false>(qp + n * row_bytes, k, lo, hi);
        }
        // the groups of weights k.. and k + 16..: one group, or group 16's two
        const int64_t g = n * groups + k / group, g_hi = n * groups + (k + 16) / group;
        // as the reference computes it: q * scale, then + min (two roundings, no fused multiply-add)
        lo = _mm512_mul_ps(lo, _mm512_set1_ps(sp[g]));
        hi = _mm512_mul_ps(hi, _mm512_set1_ps(sp[g_hi]));
        if (mp != nullptr) {
          lo = _mm512_add_ps(lo, _mm512_set1_ps(mp[g]));
          hi = _mm512_add_ps(hi, _mm512_set1_ps(mp[g_hi]));
        }
        char* dst = wp + (n * K + k) * out_bytes;
        if (bf16) {
          _mm512_storeu_si512(reinterpret_cast<void*>(dst), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
          _mm512_storeu_ps(reinterpret_cast<float*>(dst), lo);
          _mm512_storeu_ps(reinterpret_cast<float*>(dst) + 16, hi);
        }
      }
    }
  });
  return w;
}

// RMSNorm of each row, as transformers computes it in float32: (x * rsqrt(mean(x^2) + eps)) * w.
// One call instead of PyTorch's composite of six ops (~25 us for one 576-wide row on 2 cores).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [T, H]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight: [H]");
  const int64_t T = x.size(0), H = x.size(1);
  torch::Tensor y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * H;
      __m512 acc = _mm512_setzero_ps();
      int64_t h = 0;
      for (; h + 16 <= H; h += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(xr + h), _mm512_loadu_ps(xr + h), acc);
      float squares = _mm512_reduce_add_ps(acc);
      for (; h < H; ++h) squares += xr[h] * xr[h];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(H) + static_cast<float>(eps));
      for (h = 0; h < H; ++h) yp[t * H + h] = (xr[h] * inv) * wp[h];
    }
  };
  if (T < 16) {
    rows(0, T);  // a decode step's few rows: a parallel region would cost more than the work
  } else {
    at::parallel_for(0, T, 8, rows);
  }
  return y;
}

// paged_attention.cpp
torch::Tensor paged_attention_rows(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                   torch::Tensor block_tables, torch::Tensor seq, torch::Tensor lens,
                                   int64_t block_size, double scale, int64_t window, double softcap);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, int64_t window);
// tiles.cpp, tiles_a8.cpp
torch::Tensor tiled_matmul(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias);
torch::Tensor tiled_matmul_a8(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias);
// dense.cpp
torch::Tensor dense_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor bias);
// first_max.cpp
torch::Tensor first_max(torch::Tensor x);
// layer_ops.cpp
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor gelu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor sin);
void head_rms_norm_(torch::Tensor x, int64_t first, int64_t heads, torch::Tensor weight, double eps);
// decode_layer.cpp
torch::Tensor decode_layer(torch::Tensor x, std::vector<torch::Tensor> weights, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor keys, torch::Tensor values, torch::Tensor slots, torch::Tensor tables,
                           torch::Tensor seq, torch::Tensor lens, int64_t block_size, int64_t window, int64_t num_heads,
                           int64_t num_kv_heads, double scale, double eps, bool int8_activations, double softcap,
                           bool gelu);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs: the stub's other threads (the sender's
  // responses, Triton's requests) go on during a step
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("tiled_matmul", &tiled_matmul, nogil, "y = x @ dequant(W)^T (+ bias), W int4 or int8 as formats.Tiles");
  m.def("tiled_matmul_a8", &tiled_matmul_a8, nogil, "y = quantize_activations(x) @ dequant(W)^T (+ bias), W as formats.Tiles");
  m.def("decode_layer", &decode_layer, nogil, "one decoder layer of a step, its linears tiles, x updated in place");
  m.def("quant_matmul", &quant_matmul, nogil, "y = x @ dequant(W)^T (+ bias), W int8 or int4 group-wise");
  m.def("dequant", &dequant, nogil, "dequant(W) [N, K], float32 or bf16");
  m.def("dense_matmul", &dense_matmul, nogil, "y = x @ w (+ bias), float32, each row's sums in one order");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of each row of float32 x [T, H]");
  m.def("first_max", &first_max, nogil, "each row's argmax, the first of ties, NaN the largest");
  m.def("paged_attention_rows", &paged_attention_rows, nogil,
        "each query row over its sequence's cached keys through its block table, batch-invariant");
  m.def("rope_", &rope_, nogil, "RoPE in place on the first heads of each row, decode_layer's arithmetic");
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up of gate_up [T, 2I], decode_layer's arithmetic");
  m.def("gelu_mul", &gelu_mul, nogil, "gelu_tanh(gate) * up of gate_up [T, 2I], decode_layer's arithmetic");
  m.def("head_rms_norm_", &head_rms_norm_, nogil, "RMSNorm in place of some heads of each row, decode_layer's");
  m.def("paged_decode_attention", &paged_decode_attention, nogil,
        "one query token per sequence, attending over its cached keys through its block table");
}
