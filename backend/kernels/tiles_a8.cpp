// The GEMV over tiles (formats.py `Tiles`) with int8 activations (`Tiles.activations`: QUANT_ACTIVATIONS;
// AVX-512 VNNI), the decode arithmetic of llama.cpp's Q4_1 / Q8_0 x Q8_1:
// y[M, N] = xq[M, K] @ W^T (+ bias), each row of x first rounded to int8 in blocks of 32
// (d = max |x| / 127, q = round(x / d): formats.quantize_activations).
//
// A tile holds 16 output rows, one a 32-bit lane of a vector: its word j of a block is that
// row's 4 weights 4j .. 4j + 3 (int4: two words a byte, formats.tile_weight). So a block's
// 32 products of a row are 8 vpdpbusd, each against 4 bytes of x broadcast, and land summed in
// the row's own lane: an exact integer, scaled once a block (dw * dx * sum(qw * qx) + mw * dx *
// sum(qx)) and added to the lane's float, block after block. Every row of x costs those 8
// instructions and 3 more a block for 16 outputs, where 4-row tiles paid 2 vpdpbusd and 6 more
// per 4 outputs; a pass takes up to 8 rows of x, their blocks side by side. A verify step's
// k + 1 rows read the weights once: gate_up (3072 x 576) at 5 rows 33 us against 4-row tiles'
// 72, at one row 13 against 22 (2 cores, docs/speed.md). The order of the additions is the
// same for every row count (one row per lane, blocks in order), so a row's numbers do not
// depend on its batch.
//
// The weights are vpdpbusd's unsigned side, x its signed one: int4 levels 0..15 (int5's 0..31) as they are,
// int8 weights stored as qw + 128, and 128 * sum(qx) of x's block (exact in float) taken off
// the products before the scale.
//
// int5 (GGUF's Q5_0 / Q5_1 / Q5_K): int4's 4 vectors a block and a 5th of high bits (8 masks of
// 64), added into the nibbles as a block is loaded (int5.h add_high_bits); the rest is int4's,
// mins included.
//
// int8 group 16 (GGUF's K-quants: a scale, and a min, per half block): words 0..3 and 4..7 of
// a block are summed apart, two chains of 4 vpdpbusd, each half scaled by its own scale; the
// + 128 correction and the mins' share then take x's sum over each half (Activations::halves).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "int5.h"
#include "tile_operands.h"

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace {

constexpr int kRows = 16, kBlock = 32, kPassRows = 8;
constexpr int64_t kChunkBytes = 256 << 10;  // a thread's tiles per round of passes: in its L2

// x rounded to int8 per block of 32: q, each block's d, d * sum(q) and 128 * sum(q),
// interleaved by passes: block b of the kPassRows rows of pass g side by side, so a tile's pass
// reads one run of bytes a block (and keeps 3 pointers, not 3 a row, in registers).
struct Activations {
  std::vector<uint8_t> q;      // [passes, blocks, kPassRows, 32]
  std::vector<float> d, sums, offsets;  // [passes, blocks, kPassRows]
  // group 16's weights only: each half block's d * sum(q) and 128 * sum(q), [.., kPassRows, 4]
  std::vector<float> halves;
};

// A block's two halves' sums of q (group 16's weights): d * sum and 128 * sum of each.
VNNI inline void half_sums(__m512i qlo, __m512i qhi, float d, float* out) {
  const int32_t lo = _mm512_reduce_add_epi32(qlo), hi = _mm512_reduce_add_epi32(qhi);
  out[0] = d * static_cast<float>(lo);
  out[1] = d * static_cast<float>(hi);
  out[2] = static_cast<float>(128 * lo);
  out[3] = static_cast<float>(128 * hi);
}

// A vector of at least n elements, kept across calls (grown, never zeroed: a call writes every
// element it reads, rows past M are never read).
template <class T>
T* grown(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
  return buffer.data();
}

// Row m of x [M, K] into its slots of `a`.
VNNI void quantize_row(const float* x, int64_t m, int64_t K, bool halves, Activations& a) {
  const int64_t blocks = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + m * K + b * kBlock;
    const int64_t i = ((m / kPassRows) * blocks + b) * kPassRows + m % kPassRows;
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(lo)), _mm512_reduce_max_ps(_mm512_abs_ps(hi)));
    const float d = amax / 127.f;
    const __m512 dv = _mm512_set1_ps(d > 0.f ? d : 1.f);  // an all-zero block: q = 0
    // x / d rounded to nearest even, as torch.round(x / d) in the reference
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_div_ps(lo, dv)), qhi = _mm512_cvtps_epi32(_mm512_div_ps(hi, dv));
    auto* out = reinterpret_cast<__m128i*>(a.q.data() + i * kBlock);
    _mm_storeu_si128(out, _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(out + 1, _mm512_cvtsepi32_epi8(qhi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    a.d[i] = d;
    a.sums[i] = d * static_cast<float>(sum);
    a.offsets[i] = static_cast<float>(128 * sum);
    if (halves) half_sums(qlo, qhi, d, a.halves.data() + i * 4);
  }
}

// x rounded into the calling thread's buffers (kept: a step's ~120 GEMVs zeroed and freed
// fresh ones), on the calling thread: a parallel loop of its own, a few microseconds of work,
// would add a barrier at which any other process on the cores stalls both threads.
VNNI const Activations& quantize(const float* x, int64_t M, int64_t K, bool halves) {
  static thread_local Activations a;
  const int64_t slots = (M + kPassRows - 1) / kPassRows * kPassRows * (K / kBlock);
  grown(a.q, slots * kBlock), grown(a.d, slots), grown(a.sums, slots), grown(a.offsets, slots);
  if (halves) grown(a.halves, slots * 4);
  for (int64_t m = 0; m < M; ++m) quantize_row(x, m, K, halves, a);
  return a;
}

struct Problem {
  const uint8_t* data;  // [N / 16, blocks, 4, 64] (int4), [.., 5, 64] (int5) or [.., 8, 64] (int8 + 128): formats.tile_weight
  const float* params;  // [N / 16, blocks, P]: 16 scales, then 16 mins if any; group 16: [.., 2, P]
  const float* bias;    // [N] or null
  const Activations* x;
  float* y;             // [M, N]
  int64_t N, K, blocks, params_per_block, chunk;
  bool accumulate;      // y += the product (tiled_matmul_a8_add), else y = it
};

// Block b's 8 words of weights, word j (4 inputs 4j .. 4j + 3 of each of the 16 rows) in w[j];
// kBits 4, 5 (int4's words and a 5th vector of high bits) or 8.
template <int kBits>
VNNI inline void load_block(const uint8_t* block, __m512i (&w)[8]) {
  if constexpr (kBits != 8) {  // vector v: inputs 4v.. in the low nibbles, 16 + 4v.. in the high ones
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
      const __m512i packed = _mm512_loadu_si512(block + v * 64);
      w[v] = _mm512_and_si512(packed, nibble);
      w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
    if constexpr (kBits == 5) add_high_bits(block + 4 * 64, w);
  } else {
    for (int v = 0; v < 8; ++v) w[v] = _mm512_loadu_si512(block + v * 64);
  }
}

// sum over the block's 32 inputs of qw * qx for the 16 rows, exact (int8: of (qw + 128) * qx);
// two chains of 4 for the latency, their integer sum the same in any order.
VNNI inline __m512i block_products(const __m512i (&w)[8], const uint8_t* xq) {
  const auto* words = reinterpret_cast<const int32_t*>(xq);  // a broadcast load each
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  for (int j = 0; j < 8; j += 2) {
    const __m512i xe = _mm512_set1_epi32(words[j]), xo = _mm512_set1_epi32(words[j + 1]);
    even = _mm512_dpbusd_epi32(even, w[j], xe);
    odd = _mm512_dpbusd_epi32(odd, w[j + 1], xo);
  }
  return _mm512_add_epi32(even, odd);
}

// A block's scales (and mins) of its two halves, each [16] (int8 group 16: formats.Tiles).
struct HalfParams {
  __m512 scale[2], min[2];
};

template <bool kMins>
VNNI inline HalfParams half_params(const float* sm) {
  constexpr int kHalf = kMins ? 2 * kRows : kRows;
  HalfParams hp;
  for (int h = 0; h < 2; ++h) {
    hp.scale[h] = _mm512_loadu_ps(sm + h * kHalf);
    hp.min[h] = kMins ? _mm512_loadu_ps(sm + h * kHalf + kRows) : _mm512_setzero_ps();
  }
  return hp;
}

// acc + block's share of the 16 rows, int8 group 16: the products of words 0..3 (inputs
// 0..15) and 4..7 summed apart (exact integers), each less 128 * its half of x's sum and
// scaled by its half's scale; the mins' share by x's sums over each half. `xh`: the slot's
// Activations::halves.
template <bool kMins>
VNNI inline __m512 add_halves(const __m512i (&w)[8], const uint8_t* xq, float xd, const float* xh,
                              const HalfParams& hp, __m512 acc) {
  const auto* words = reinterpret_cast<const int32_t*>(xq);
  __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int j = 0; j < 4; ++j) {  // the two halves' chains side by side, for the latency
    sum[0] = _mm512_dpbusd_epi32(sum[0], w[j], _mm512_set1_epi32(words[j]));
    sum[1] = _mm512_dpbusd_epi32(sum[1], w[j + 4], _mm512_set1_epi32(words[j + 4]));
  }
  const __m512 dx = _mm512_set1_ps(xd);
  for (int h = 0; h < 2; ++h) {
    const __m512 dot = _mm512_sub_ps(_mm512_cvtepi32_ps(sum[h]), _mm512_set1_ps(xh[2 + h]));  // below 2^24: exact
    acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(hp.scale[h], dx), acc);
  }
  if constexpr (kMins) {
    for (int h = 0; h < 2; ++h) acc = _mm512_fmadd_ps(hp.min[h], _mm512_set1_ps(xh[h]), acc);
  }
  return acc;
}

// Outputs tile * 16 .. + 15 of rows r0 .. r0 + R - 1; kBits 4, 5 or 8; kHalves: int8 group 16.
template <int kBits, bool kMins, bool kHalves, int R>
VNNI void tile_dot(const Problem& p, int64_t tile, int64_t r0) {
  constexpr int64_t kBlockBytes = kRows * (kBits == 8 ? 32 : kBits == 5 ? 20 : 16);
  const uint8_t* data = p.data + tile * p.blocks * kBlockBytes;
  const float* params = p.params + tile * p.blocks * p.params_per_block;
  const int64_t pass = r0 / kPassRows * p.blocks * kPassRows;  // the pass's first slot
  const uint8_t* xq = p.x->q.data() + pass * kBlock;
  const float *xd = p.x->d.data() + pass, *xs = p.x->sums.data() + pass, *xo = p.x->offsets.data() + pass;
  const float* xh = kHalves ? p.x->halves.data() + pass * 4 : nullptr;
  // int4 / int5 without mins (symmetric: GGUF's Q4_0, Q5_0): a block's min is -8 / -16 x its
  // scale, the very number a stored min holds (a product by a power of 2)
  constexpr bool kSymmetric = !kMins && kBits != 8;
  const __m512 kLowest = _mm512_set1_ps(kBits == 5 ? -16.0f : -8.0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512i w[8];
    load_block<kBits>(data + b * kBlockBytes, w);
    const float* sm = params + b * p.params_per_block;
    if constexpr (kHalves) {
      const HalfParams hp = half_params<kMins>(sm);
      for (int r = 0; r < R; ++r) {
        const int64_t slot = b * kPassRows + r;
        acc[r] = add_halves<kMins>(w, xq + slot * kBlock, xd[slot], xh + slot * 4, hp, acc[r]);
      }
    } else {
      const __m512 scales = _mm512_loadu_ps(sm);
      const __m512 mins = kMins ? _mm512_loadu_ps(sm + kRows) : kSymmetric ? _mm512_mul_ps(scales, kLowest) : scales;
      for (int r = 0; r < R; ++r) {
        const int64_t slot = b * kPassRows + r;
        __m512 dot = _mm512_cvtepi32_ps(block_products(w, xq + slot * kBlock));
        if constexpr (kBits == 8) dot = _mm512_sub_ps(dot, _mm512_set1_ps(xo[slot]));  // integers below 2^24: exact
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scales, _mm512_set1_ps(xd[slot])), acc[r]);
        if constexpr (kMins || kSymmetric) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xs[slot]), acc[r]);
      }
    }
  }
  const int64_t n = tile * kRows;
  const __m512 bias = p.bias != nullptr ? _mm512_loadu_ps(p.bias + n) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    float* out = p.y + (r0 + r) * p.N + n;
    const __m512 value = _mm512_add_ps(acc[r], bias);
    _mm512_storeu_ps(out, p.accumulate ? _mm512_add_ps(_mm512_loadu_ps(out), value) : value);
  }
}

template <int kBits, bool kMins, bool kHalves = false>
VNNI void run(const Problem& p, int64_t M) {
  at::parallel_for(0, p.N / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t from = begin; from < end; from += p.chunk) {
      const int64_t to = std::min(end, from + p.chunk);
      for (int64_t r0 = 0; r0 < M; r0 += kPassRows) {
        for (int64_t tile = from; tile < to; ++tile) {
          switch (std::min<int64_t>(kPassRows, M - r0)) {
            case 1: tile_dot<kBits, kMins, kHalves, 1>(p, tile, r0); break;
            case 2: tile_dot<kBits, kMins, kHalves, 2>(p, tile, r0); break;
            case 3: tile_dot<kBits, kMins, kHalves, 3>(p, tile, r0); break;
            case 4: tile_dot<kBits, kMins, kHalves, 4>(p, tile, r0); break;
            case 5: tile_dot<kBits, kMins, kHalves, 5>(p, tile, r0); break;
            case 6: tile_dot<kBits, kMins, kHalves, 6>(p, tile, r0); break;
            case 7: tile_dot<kBits, kMins, kHalves, 7>(p, tile, r0); break;
            default: tile_dot<kBits, kMins, kHalves, 8>(p, tile, r0); break;
          }
        }
      }
    }
  });
}

// x: contiguous float32 [M, K]; data: uint8 [N / 16, K / 32, 4, 64] (int4) or [.., 8, 64] (int8);
// params: float32 [N / 16, K / 32, 32] (scales, mins) or [.., 16] (scales: int8 without mins, int4 /
// int5 symmetric),
// int8 group 16 [N / 16, K / 32, 2, 32 or 16] (each half's); bias: [N], or undefined / empty for none.
TileOperands check_a8_operands(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& params,
                               const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const bool int5 = data.dim() == 4 && data.size(2) == 5, int4 = int5 || (data.dim() == 4 && data.size(2) == 4);
  TORCH_CHECK(data.dim() == 4 && (int4 || data.size(2) == 8) && data.size(3) == 64 && data.is_contiguous() &&
                  data.scalar_type() == torch::kUInt8, "data: uint8 [N / 16, K / 32, 4 (int4), 5 (int5) or 8 (int8), 64]");
  const int64_t tiles = data.size(0), blocks = data.size(1), N = tiles * kRows;
  TORCH_CHECK(blocks * kBlock == x.size(1), "data does not match K");
  const bool halves = params.dim() == 4;  // int8 group 16
  const int64_t P = params.size(-1);
  const bool mins = P == 2 * kRows;
  TORCH_CHECK(params.scalar_type() == torch::kFloat32 && params.is_contiguous() && params.size(0) == tiles &&
                  params.size(1) == blocks && (params.dim() == 3 || (halves && !int4 && params.size(2) == 2)) &&
                  (mins || P == kRows),
              "params: float32 [N / 16, K / 32, 32], or [.., 16] without mins; group 16: [.., 2, 32 or 16]");
  const bool has_bias = bias.defined() && bias.numel() > 0;  // undefined or empty: none
  TORCH_CHECK(!has_bias || (bias.numel() == N && bias.is_contiguous()), "bias: [N]");
  const int64_t block_bytes = kRows * (int5 ? 20 : int4 ? 16 : 32) + params.numel() / std::max<int64_t>(1, tiles * blocks) * 4;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (blocks * block_bytes));
  return {x.size(0), N, x.size(1), blocks, int4, mins, int5, halves, has_bias ? bias.data_ptr<float>() : nullptr, chunk};
}

void tiled_a8_into(const TileOperands& o, const torch::Tensor& x, const torch::Tensor& data,
                   const torch::Tensor& params, float* yp, bool accumulate) {
  const Activations& a = quantize(x.data_ptr<float>(), o.M, o.K, o.halves);
  const int64_t params_per_block = params.size(-1) * (o.halves ? 2 : 1);
  const Problem p{static_cast<const uint8_t*>(data.data_ptr()), params.data_ptr<float>(), o.bias, &a, yp,
                  o.N, o.K, o.blocks, params_per_block, o.chunk, accumulate};
  if (o.int5) {
    o.mins ? run<5, true>(p, o.M) : run<5, false>(p, o.M);
  } else if (o.int4) {
    o.mins ? run<4, true>(p, o.M) : run<4, false>(p, o.M);
  } else if (o.halves) {
    o.mins ? run<8, true, true>(p, o.M) : run<8, false, true>(p, o.M);
  } else if (o.mins) {
    run<8, true>(p, o.M);
  } else {
    run<8, false>(p, o.M);
  }
}

}  // namespace

// y = quantize_activations(x) @ dequant(W)^T (+ bias), W int4 or int8 as formats.tile_weight.
torch::Tensor tiled_matmul_a8(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias) {
  const TileOperands o = check_a8_operands(x, data, params, bias);
  torch::Tensor y = torch::empty({o.M, o.N}, x.options());
  tiled_a8_into(o, x, data, params, y.data_ptr<float>(), false);
  return y;
}

// y += the same product (+ bias), as y + (product + bias): tiled_matmul_add's, int8 activations.
void tiled_matmul_a8_add(torch::Tensor y, torch::Tensor x, torch::Tensor data, torch::Tensor params,
                         torch::Tensor bias) {
  const TileOperands o = check_a8_operands(x, data, params, bias);
  check_accumulator(y, o);
  tiled_a8_into(o, x, data, params, y.data_ptr<float>(), true);
}
