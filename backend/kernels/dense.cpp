// The float32 matmul of unquantized weights (QUANT=none): y[M, N] = x[M, K] @ w[K, N] (+ bias),
// w stored [in, out] as llama.py keeps its matmul weights. Each output is one chain of
// multiply-adds over k in order, then the bias: a row's numbers are the same whatever the
// other rows, how many there are, and how the threads split the work (MKL's GEMM chooses its
// kernel by the row count, so a row's sums were cut differently beside 1 or 7 other rows).
// A thread takes 64 columns at a time, 4 rows of x a pass: 16 accumulators, the columns'
// weights (K x 256 bytes) read from its L2 by every pass after the first. Against MKL on 2
// cores (Zen 4, K 576, N 1728): 1 row 0.03 / 0.07 ms, 8 rows 0.2 / 0.19, 32 rows 0.8 / 0.44,
// 512 rows 13 / 5.5: decode faster, a prefill chunk's linears ~2.4x slower (QUANT=none only).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int kVectors = 4;  // 16-column vectors a block
constexpr int64_t kColumns = 16 * kVectors;

// Rows r0 .. r0 + R - 1 of y's columns n0 .. n0 + 63 (bias: [N] or null).
template <int R>
void dense_block(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t r0,
                 int64_t n0) {
  __mmask16 keep[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const int64_t left = std::clamp<int64_t>(N - n0 - 16 * v, 0, 16);
    keep[v] = static_cast<__mmask16>((1u << left) - 1);
  }
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[kVectors];
    for (int v = 0; v < kVectors; ++v) wk[v] = _mm512_maskz_loadu_ps(keep[v], w + k * N + n0 + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[(r0 + r) * K + k]);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_fmadd_ps(xr, wk[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVectors; ++v) {
      const int64_t n = n0 + 16 * v;
      __m512 out = acc[r][v];
      if (bias != nullptr) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(keep[v], bias + n));
      _mm512_mask_storeu_ps(y + (r0 + r) * N + n, keep[v], out);
    }
  }
}

}  // namespace

// y = x @ w (+ bias). x: contiguous float32 [M, K]; w: contiguous float32 [K, N]; bias [N],
// or undefined / empty for none. -> [M, N] float32.
torch::Tensor dense_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(0), "x [M, K] @ w [K, N]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(1);
  const bool biased = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!biased || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == torch::kFloat32), "bias [N]");
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>(), *bp = biased ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kColumns - 1) / kColumns;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        switch (std::min<int64_t>(4, M - r0)) {
          case 1: dense_block<1>(xp, wp, bp, yp, K, N, r0, b * kColumns); break;
          case 2: dense_block<2>(xp, wp, bp, yp, K, N, r0, b * kColumns); break;
          case 3: dense_block<3>(xp, wp, bp, yp, K, N, r0, b * kColumns); break;
          default: dense_block<4>(xp, wp, bp, yp, K, N, r0, b * kColumns); break;
        }
      }
    }
  });
  return y;
}
