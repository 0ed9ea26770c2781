// The GEMV over tiles (formats.py `Tiles`) with int8 activations (`Tiles.activations`: QUANT_ACTIVATIONS;
// AVX-512 VNNI), the decode arithmetic of llama.cpp's Q4_1 / Q8_0 x Q8_1:
// y[M, N] = xq[M, K] @ W^T (+ bias), each row of x first rounded to int8 in blocks of 32
// (d = max |x| / 127, q = round(x / d): formats.quantize_activations).
//
// A block's products are integers, summed exactly by vpdpbusd (unsigned x signed bytes), then
// scaled once: dw * dx * sum(qw * qx) + mw * dx * sum(qx). So the result equals float32
// dequantize(W) @ dequantize(xq)^T up to the order of float additions. A tile's block of 4
// output rows is one vpdpbusd pair for int4 (the levels 0..15 are the unsigned side) where
// tiles.cpp decodes 32 weights a row to floats: ~12 instructions for 128 weights against ~40.
// int8 weights: the activations are the unsigned side, stored as qx + 128, and 128 * sum(qw)
// (one more vpdpbusd a block, shared by every row of x) is taken off.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "tile_operands.h"

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace {

constexpr int kTile = 4, kBlock = 32, kPassRows = 4;

// x rounded to int8 per block of 32: q in order (int8 weights: + 128), each block's d and d * sum(q).
struct Activations {
  std::vector<uint8_t> q;  // [M, K]
  std::vector<float> d, sums;  // [M, blocks]
};

VNNI Activations quantize(const float* x, int64_t M, int64_t K, bool unsigned_side) {
  const int64_t blocks = K / kBlock;
  Activations a{std::vector<uint8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * blocks)};
  const __m128i bias = _mm_set1_epi8(unsigned_side ? static_cast<char>(0x80) : 0);
  for (int64_t i = 0; i < M * blocks; ++i) {
    const __m512 lo = _mm512_loadu_ps(x + i * kBlock), hi = _mm512_loadu_ps(x + i * kBlock + 16);
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(lo)), _mm512_reduce_max_ps(_mm512_abs_ps(hi)));
    const float d = amax / 127.f;
    const __m512 dv = _mm512_set1_ps(d > 0.f ? d : 1.f);  // an all-zero block: q = 0
    // x / d rounded to nearest even, as torch.round(x / d) in the reference
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_div_ps(lo, dv)), qhi = _mm512_cvtps_epi32(_mm512_div_ps(hi, dv));
    auto* out = reinterpret_cast<__m128i*>(a.q.data() + i * kBlock);
    _mm_storeu_si128(out, _mm_xor_si128(_mm512_cvtsepi32_epi8(qlo), bias));
    _mm_storeu_si128(out + 1, _mm_xor_si128(_mm512_cvtsepi32_epi8(qhi), bias));
    a.d[i] = d;
    a.sums[i] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
  return a;
}

struct Problem {
  const uint8_t* data;  // tiles: [N / 4, blocks, 4, 16] (int4) or [.., 32] (int8)
  const float* params;  // [N / 4, blocks, 8]: 4 scales, 4 mins; or [.., 4]: scales alone
  const float* bias;    // [N] or null
  const Activations* x;
  float* y;             // [M, N]
  int64_t N, K, blocks, params_per_block, chunk;
  bool accumulate;      // y += the product (tiled_matmul_a8_add), else y = it
};

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// Block b of a tile against rows x0.. of x: acc[v][r] += float(products) * dw * dx, where the
// int32 lanes of vector v hold row t of the tile at lanes t * L .. t * L + L - 1 of v's pair
// (int4: one vector, L = 4; int8: two, L = 8).
template <bool kInt4, int R>
VNNI inline void block_dot(const uint8_t* w, const __m128 scales, const uint8_t* const* xq, const float* const* xd,
                           int64_t b, __m512 (&acc)[2][R]) {
  const __m512 wide = _mm512_castps128_ps512(scales);
  if constexpr (kInt4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), packed = _mm512_loadu_si512(w);
    const __m512i lo = _mm512_and_si512(packed, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    const __m512 ws = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), wide);
    for (int r = 0; r < R; ++r) {
      const uint8_t* x = xq[r] + b * kBlock;
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_broadcast_i32x4(load128(x)));
      dot = _mm512_dpbusd_epi32(dot, hi, _mm512_broadcast_i32x4(load128(x + 16)));
      acc[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, _mm512_set1_ps(xd[r][b])), acc[0][r]);
    }
  } else {
    const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i w01 = _mm512_loadu_si512(w), w23 = _mm512_loadu_si512(w + 64);
    const __m512i off01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, w01);  // 128 * sum(qw)
    const __m512i off23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u128, w23);
    const __m512 ws01 = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), wide);
    const __m512 ws23 = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2), wide);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * kBlock)));
      const __m512 dx = _mm512_set1_ps(xd[r][b]);
      const __m512i d01 = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x, w01), off01);
      const __m512i d23 = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x, w23), off23);
      acc[0][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01), _mm512_mul_ps(ws01, dx), acc[0][r]);
      acc[1][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d23), _mm512_mul_ps(ws23, dx), acc[1][r]);
    }
  }
}

// Outputs tile * 4 .. + 3 of rows r0 .. r0 + R - 1.
template <bool kInt4, bool kMins, int R>
VNNI void tile_dot(const Problem& p, int64_t tile, int64_t r0) {
  constexpr int64_t kBlockBytes = kTile * (kInt4 ? 16 : 32);
  const uint8_t* w = p.data + tile * p.blocks * kBlockBytes;
  const float* params = p.params + tile * p.blocks * p.params_per_block;
  const uint8_t* xq[R];
  const float *xd[R], *xs[R];
  __m512 acc[2][R];
  __m128 min_acc[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = p.x->q.data() + (r0 + r) * p.K;
    xd[r] = p.x->d.data() + (r0 + r) * p.blocks;
    xs[r] = p.x->sums.data() + (r0 + r) * p.blocks;
    acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    min_acc[r] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < p.blocks; ++b) {
    const float* sm = params + b * p.params_per_block;
    block_dot<kInt4, R>(w + b * kBlockBytes, _mm_loadu_ps(sm), xq, xd, b, acc);
    if constexpr (kMins) {  // the tile's 4 mins times the block's d * sum(qx)
      const __m128 mins = _mm_loadu_ps(sm + kTile);
      for (int r = 0; r < R; ++r) min_acc[r] = _mm_fmadd_ps(mins, _mm_set1_ps(xs[r][b]), min_acc[r]);
    }
  }
  constexpr int kLanes = kInt4 ? 4 : 8;  // int32 lanes of products a tile row
  for (int r = 0; r < R; ++r) {
    alignas(64) float lanes[32], mins[4];
    _mm512_store_ps(lanes, acc[0][r]);
    _mm512_store_ps(lanes + 16, acc[1][r]);
    _mm_store_ps(mins, min_acc[r]);
    for (int t = 0; t < kTile; ++t) {
      float sum = 0.f;
      for (int l = 0; l < kLanes; ++l) sum += lanes[t * kLanes + l];
      const int64_t n = tile * kTile + t;
      const float value = sum + mins[t] + (p.bias != nullptr ? p.bias[n] : 0.f);
      float& out = p.y[(r0 + r) * p.N + n];
      out = p.accumulate ? out + value : value;
    }
  }
}

template <bool kInt4, bool kMins>
VNNI void run(const Problem& p, int64_t M) {
  at::parallel_for(0, p.N / kTile, 4, [&](int64_t begin, int64_t end) {
    for (int64_t from = begin; from < end; from += p.chunk) {
      const int64_t to = std::min(end, from + p.chunk);
      for (int64_t r0 = 0; r0 < M; r0 += kPassRows) {
        for (int64_t tile = from; tile < to; ++tile) {
          switch (std::min<int64_t>(kPassRows, M - r0)) {
            case 1: tile_dot<kInt4, kMins, 1>(p, tile, r0); break;
            case 2: tile_dot<kInt4, kMins, 2>(p, tile, r0); break;
            case 3: tile_dot<kInt4, kMins, 3>(p, tile, r0); break;
            default: tile_dot<kInt4, kMins, 4>(p, tile, r0); break;
          }
        }
      }
    }
  });
}

}  // namespace

namespace {

void tiled_a8_into(const TileOperands& o, const torch::Tensor& x, const torch::Tensor& data,
                   const torch::Tensor& params, float* yp, bool accumulate) {
  const Activations a = quantize(x.data_ptr<float>(), o.M, o.K, !o.int4);
  const Problem p{static_cast<const uint8_t*>(data.data_ptr()), params.data_ptr<float>(), o.bias, &a, yp,
                  o.N, o.K, o.blocks, params.size(2), o.chunk, accumulate};
  if (o.int4) {
    run<true, true>(p, o.M);
  } else if (o.mins) {
    run<false, true>(p, o.M);
  } else {
    run<false, false>(p, o.M);
  }
}

}  // namespace

// y = quantize_activations(x) @ dequant(W)^T (+ bias), W int4 or int8 as formats.Tiles
// (tiles.cpp's operands).
torch::Tensor tiled_matmul_a8(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias) {
  const TileOperands o = check_tile_operands(x, data, params, bias);
  torch::Tensor y = torch::empty({o.M, o.N}, x.options());
  tiled_a8_into(o, x, data, params, y.data_ptr<float>(), false);
  return y;
}

// y += the same product (+ bias), as y + (product + bias): tiled_matmul_add's, int8 activations.
void tiled_matmul_a8_add(torch::Tensor y, torch::Tensor x, torch::Tensor data, torch::Tensor params,
                         torch::Tensor bias) {
  const TileOperands o = check_tile_operands(x, data, params, bias);
  check_accumulator(y, o);
  tiled_a8_into(o, x, data, params, y.data_ptr<float>(), true);
}
