// The GEMV over tiles (formats.py `Tiles`): y[M, N] = x[M, K] @ W^T (+ bias), W int4 or int8.
//
// In GGUF's row layout a thread reading 4 output rows at once touches 4 short runs of bytes
// (a row of 576 int4 weights is 288 bytes), then 4 more; the hardware prefetchers follow
// such runs poorly, and a decode step, which reads every weight once, stalled on memory:
// ~22 GB/s on the 2 cores where a plain sum streams ~45. A tile stores each block of 32
// inputs of 4 consecutive output rows side by side (int4: 64 bytes, one cache line) and the
// tile's scales and mins next to each other, so each thread reads two arrays front to back.
//
// Weights are decoded to float32 as the reference computes them and multiplied in float32:
// exact to x @ dequantize(W)^T up to the order of float additions.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "int5.h"
#include "tile_operands.h"

namespace {

constexpr int kTile = 4;       // output rows per tile (formats.TILE)
constexpr int kPassRows = 4;   // rows of x per pass over a thread's tiles (4 x 4 accumulators)
constexpr int64_t kChunkBytes = 256 << 10;  // a thread's tiles per round of passes: in its L2
constexpr int64_t kGroupRows = 32;  // rows of x sharing a tile's decoded weights (32 x 1536 floats: 192 KB of L2)
constexpr int64_t kGroupFrom = 128;  // rows of x from which the tiles are decoded once a group (a prefill chunk)

struct Tiles {
  const uint8_t* data;   // [N / 4, blocks, 4, 16] (int4) or [.., 32] (int8)
  const float* params;   // [N / 4, blocks, 8]: 4 scales, then 4 mins; [.., 4]: scales alone (int8 without
                         // mins; int4 / int5 symmetric: min -8 / -16 x scale);
                         // int8 group 16: [N / 4, blocks, 2, 8 or 4], each half's
  const float* bias;     // [N] or null
  int64_t N, K, blocks;
  bool accumulate;       // y += the product (tiled_matmul_add), else y = it
};

// A block's weights 0..15 and 16..31 of tile row t, as float32: int4 through a 16-entry table
// of scale * level + min (one permute a nibble), int8 as q * scale + min (kMins) or q * scale;
// each computes a weight as the reference does (a product, then a sum: no fused multiply-add).
// kHalves (int8 group 16): `sm` holds the block's two halves' params one after the other, and
// each half of the block takes its own scale (and min).
template <bool kInt4, bool kMins, bool kHalves = false>
inline void decode(const uint8_t* block, const float* sm, int t, __m512& lo, __m512& hi) {
  static_assert(!(kHalves && kInt4), "group 16 is int8's");
  // symmetric int4 (params without mins: GGUF's Q4_0) has min -8 * scale: the stored one's number
  const float min_value = kMins ? sm[kTile + t] : kInt4 ? sm[t] * -8.0f : 0.0f;
  const __m512 scale = _mm512_set1_ps(sm[t]), min = _mm512_set1_ps(min_value);
  if constexpr (kInt4) {
    const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(levels, scale), min);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + t * 16)));
    lo = _mm512_permutexvar_ps(bytes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    const float* sm_hi = sm + (kMins ? 2 * kTile : kTile);  // group 16: the second half's params
    const __m512 scale_hi = kHalves ? _mm512_set1_ps(sm_hi[t]) : scale;
    const __m512 min_hi = kHalves && kMins ? _mm512_set1_ps(sm_hi[kTile + t]) : min;
    const auto* q = reinterpret_cast<const __m128i*>(block + t * 32);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    lo = _mm512_mul_ps(lo, scale);
    hi = _mm512_mul_ps(hi, scale_hi);
    if constexpr (kMins) {
      lo = _mm512_add_ps(lo, min);
      hi = _mm512_add_ps(hi, min_hi);
    }
  }
}

// The sums of 4 accumulators' lanes, each added as _mm512_reduce_add_ps adds them (lane i
// with i + 8, then i + 4, then i + 2, then i + 1), several accumulators per instruction:
// 128-bit chunk c of the result holds accumulator c's partial sums.
inline __m512 halve_four(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));  // i + 8
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // i + 4
}

// acc[t][r] of a tile's R rows (R <= 4) -> sums[t * 4 + r], each accumulator's lanes added in
// _mm512_reduce_add_ps's order: bit for bit what reducing them one by one gives.
template <int R>
inline void reduce_tile(const __m512 (&acc)[kTile][R], float* sums) {
  if constexpr (R == 1) {
    const __m512 h = halve_four(acc[0][0], acc[1][0], acc[2][0], acc[3][0]);
    const __m512 q = _mm512_add_ps(h, _mm512_shuffle_ps(h, h, _MM_SHUFFLE(1, 0, 3, 2)));  // i + 2
    const __m512 o = _mm512_add_ps(q, _mm512_shuffle_ps(q, q, _MM_SHUFFLE(2, 3, 0, 1)));  // i + 1
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, o);
    for (int t = 0; t < kTile; ++t) sums[t * 4] = lanes[t * 4];
  } else {
    __m512 h[4];
    for (int r = 0; r < 4; ++r) {
      h[r] = r < R ? halve_four(acc[0][r], acc[1][r], acc[2][r], acc[3][r]) : _mm512_setzero_ps();
    }
    // chunk t of h[r]: accumulator (t, r)'s 4 partial sums [p0 p1 p2 p3]; p0 + p2, p1 + p3
    const __m512 q01 = _mm512_add_ps(_mm512_shuffle_ps(h[0], h[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(h[0], h[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 q23 = _mm512_add_ps(_mm512_shuffle_ps(h[2], h[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(h[2], h[3], _MM_SHUFFLE(3, 2, 3, 2)));
    // then their two halves: chunk t holds rows 0..3 of tile row t
    const __m512 o = _mm512_add_ps(_mm512_shuffle_ps(q01, q23, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(q01, q23, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(sums, o);
  }
}

// Outputs tile * 4 .. tile * 4 + 3 of R rows of x (x and y point at the first of them).
// `weights(b, t, lo, hi)` gives block b of tile row t as float32: decoded from the tile
// (one pass of rows: tile_dot) or read back from the tile decoded once (decoded_dot).
template <int R, class Weights>
inline void dot(const Tiles& w, int64_t tile, const float* x, float* y, Weights&& weights) {
  __m512 acc[kTile][R];
  for (int t = 0; t < kTile; ++t) {
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < w.blocks; ++b) {
    for (int t = 0; t < kTile; ++t) {
      __m512 lo, hi;
      weights(b, t, lo, hi);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * w.K + b * 32;
        acc[t][r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[t][r]);
        acc[t][r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[t][r]);
      }
    }
  }
  float sums[kTile * 4];  // [t * 4 + r]
  reduce_tile<R>(acc, sums);
  for (int t = 0; t < kTile; ++t) {
    const int64_t n = tile * kTile + t;
    const float add = w.bias != nullptr ? w.bias[n] : 0.f;
    for (int r = 0; r < R; ++r) {
      const float value = sums[t * 4 + r] + add;
      y[r * w.N + n] = w.accumulate ? y[r * w.N + n] + value : value;
    }
  }
}

// int5's tiles: int4's params, 20 bytes a row's block (formats.tile_weight); without mins
// (symmetric: GGUF's Q5_0) a block's min is -16 * its scale.
template <bool kMins>
struct TileDecoder5 {
  static constexpr int64_t kBlockBytes = kTile * 20, kParams = (kMins ? 2 : 1) * kTile;
  const uint8_t* data;
  const float* params;

  TileDecoder5(const Tiles& w, int64_t tile)
      : data(w.data + tile * w.blocks * kBlockBytes), params(w.params + tile * w.blocks * kParams) {}

  void operator()(int64_t b, int t, __m512& lo, __m512& hi) const {
    const float* sm = params + b * kParams;  // the 4 scales, then the 4 mins if any
    decode_int5(data + b * kBlockBytes + t * 20, sm[t], kMins ? sm[kTile + t] : sm[t] * -16.0f, lo, hi);
  }
};

// A tile's blocks, decoded one (block, tile row) at a time: dot's weights for tile_dot, and
// decode_tile's source. kMins: a block's params are its 4 scales then its 4 mins, else its 4
// scales alone (int8 without mins: GGUF's Q8_0, QUANT's symmetric int8); kHalves: those of
// each half of the block (int8 group 16: GGUF's K-quants).
template <bool kInt4, bool kMins, bool kHalves = false>
struct TileDecoder {
  static constexpr int64_t kBlockBytes = kTile * (kInt4 ? 16 : 32);
  static constexpr int64_t kParams = (kMins ? 2 * kTile : kTile) * (kHalves ? 2 : 1);
  const uint8_t* data;
  const float* params;

  TileDecoder(const Tiles& w, int64_t tile)
      : data(w.data + tile * w.blocks * kBlockBytes), params(w.params + tile * w.blocks * kParams) {}

  void operator()(int64_t b, int t, __m512& lo, __m512& hi) const {
    decode<kInt4, kMins, kHalves>(data + b * kBlockBytes, params + b * kParams, t, lo, hi);
  }
};

template <class Decoder, int R>
inline void tile_dot(const Tiles& w, int64_t tile, const float* x, float* y) {
  dot<R>(w, tile, x, y, Decoder(w, tile));
}

// A tile's weights decoded once, [blocks][4][32] floats, for every pass of a group of rows.
template <class Decoder>
inline void decode_tile(const Tiles& w, int64_t tile, float* out) {
  const Decoder weights(w, tile);
  for (int64_t b = 0; b < w.blocks; ++b) {
    for (int t = 0; t < kTile; ++t) {
      __m512 lo, hi;
      weights(b, t, lo, hi);
      _mm512_storeu_ps(out + (b * kTile + t) * 32, lo);
      _mm512_storeu_ps(out + (b * kTile + t) * 32 + 16, hi);
    }
  }
}

template <int R>
inline void decoded_dot(const Tiles& w, int64_t tile, const float* decoded, const float* x, float* y) {
  dot<R>(w, tile, x, y, [&](int64_t b, int t, __m512& lo, __m512& hi) {
    lo = _mm512_loadu_ps(decoded + (b * kTile + t) * 32);
    hi = _mm512_loadu_ps(decoded + (b * kTile + t) * 32 + 16);
  });
}

// Rows r0 .. r0 + rows - 1 of x (at most kPassRows) through tiles begin .. end - 1.
template <class Decoder>
void pass(const Tiles& w, int64_t begin, int64_t end, const float* x, float* y, int64_t rows) {
  for (int64_t tile = begin; tile < end; ++tile) {
    switch (rows) {
      case 1: tile_dot<Decoder, 1>(w, tile, x, y); break;
      case 2: tile_dot<Decoder, 2>(w, tile, x, y); break;
      case 3: tile_dot<Decoder, 3>(w, tile, x, y); break;
      default: tile_dot<Decoder, 4>(w, tile, x, y); break;
    }
  }
}

// A prefill's many rows: each tile decoded once for a group of up to kGroupRows rows (their x
// stays in L2), its passes reading the floats back from L1; the arithmetic is the same, bit
// for bit. 512 rows measured 1.07x the passes that decode as they go; up to 64 rows no faster
// (8 rows 0.7x: a pass over decoded floats costs about what decoding as it goes does there).
template <class Decoder>
void grouped_passes(const Tiles& w, int64_t begin, int64_t end, const float* x, float* y, int64_t rows,
                    float* decoded) {
  for (int64_t tile = begin; tile < end; ++tile) {
    decode_tile<Decoder>(w, tile, decoded);
    for (int64_t r0 = 0; r0 < rows; r0 += kPassRows) {
      const float* xr = x + r0 * w.K;
      float* yr = y + r0 * w.N;
      switch (std::min<int64_t>(kPassRows, rows - r0)) {
        case 1: decoded_dot<1>(w, tile, decoded, xr, yr); break;
        case 2: decoded_dot<2>(w, tile, decoded, xr, yr); break;
        case 3: decoded_dot<3>(w, tile, decoded, xr, yr); break;
        default: decoded_dot<4>(w, tile, decoded, xr, yr); break;
      }
    }
  }
}

// y = x @ W^T for M rows: each thread takes a run of tiles and goes through it in chunks of
// `chunk` tiles (~256 KB), each chunk for every row of x: its weights are read from memory
// once, later passes over a chunk find it in the core's L2 (the prefill's many rows included).
template <class Decoder>
void run(const Tiles& w, const float* xp, float* yp, int64_t M, int64_t chunk) {
  const int64_t K = w.K, N = w.N;
  at::parallel_for(0, N / kTile, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> decoded(M >= kGroupFrom ? static_cast<size_t>(w.blocks * kTile * 32) : 0);
    for (int64_t from = begin; from < end; from += chunk) {
      const int64_t to = std::min(end, from + chunk);
      if (M < kGroupFrom) {
        for (int64_t r0 = 0; r0 < M; r0 += kPassRows) {
          pass<Decoder>(w, from, to, xp + r0 * K, yp + r0 * N, std::min<int64_t>(kPassRows, M - r0));
        }
        continue;
      }
      for (int64_t g0 = 0; g0 < M; g0 += kGroupRows) {
        grouped_passes<Decoder>(w, from, to, xp + g0 * K, yp + g0 * N, std::min<int64_t>(kGroupRows, M - g0),
                                decoded.data());
      }
    }
  });
}

}  // namespace

TileOperands check_tile_operands(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& params,
                                 const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const bool int4 = data.scalar_type() == torch::kUInt8, int5 = int4 && data.dim() == 4 && data.size(3) == 20;
  TORCH_CHECK(data.dim() == 4 && data.size(2) == kTile && data.size(3) == (int5 ? 20 : int4 ? 16 : 32) &&
                  data.is_contiguous() && (int4 || data.scalar_type() == torch::kInt8),
              "data: uint8 [N / 4, K / 32, 4, 16] (int4) or [.., 20] (int5), or int8 [.., 32]");
  const int64_t tiles = data.size(0), blocks = data.size(1), N = tiles * kTile;
  TORCH_CHECK(blocks * 32 == x.size(1), "data does not match K");
  const bool halves = params.dim() == 4;  // int8 group 16: [.., 2, P]
  const int64_t P = params.size(-1);
  const bool mins = P == 2 * kTile;
  TORCH_CHECK(params.scalar_type() == torch::kFloat32 && params.is_contiguous() && params.size(0) == tiles &&
                  params.size(1) == blocks && (params.dim() == 3 || (halves && !int4 && params.size(2) == 2)) &&
                  (mins || P == kTile),
              "params: float32 [N / 4, K / 32, 8], or [.., 4] without mins; int8 group 16: [.., 2, 8 or 4]");
  const bool has_bias = bias.defined() && bias.numel() > 0;  // undefined or empty: none
  TORCH_CHECK(!has_bias || (bias.numel() == N && bias.is_contiguous()), "bias: [N]");
  const int64_t block_bytes = kTile * data.size(3) + params.numel() / std::max<int64_t>(1, tiles * blocks) * 4;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (blocks * block_bytes));
  return {x.size(0), N, x.size(1), blocks, int4, mins, int5, halves, has_bias ? bias.data_ptr<float>() : nullptr, chunk};
}

namespace {

void tiled_into(const TileOperands& o, const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& params,
                float* yp, bool accumulate) {
  const Tiles w{static_cast<const uint8_t*>(data.data_ptr()), params.data_ptr<float>(), o.bias, o.N, o.K, o.blocks,
                accumulate};
  const float* xp = x.data_ptr<float>();
  if (o.int5) {
    o.mins ? run<TileDecoder5<true>>(w, xp, yp, o.M, o.chunk) : run<TileDecoder5<false>>(w, xp, yp, o.M, o.chunk);
  } else if (o.int4) {
    o.mins ? run<TileDecoder<true, true>>(w, xp, yp, o.M, o.chunk)
           : run<TileDecoder<true, false>>(w, xp, yp, o.M, o.chunk);
  } else if (o.halves) {
    o.mins ? run<TileDecoder<false, true, true>>(w, xp, yp, o.M, o.chunk)
           : run<TileDecoder<false, false, true>>(w, xp, yp, o.M, o.chunk);
  } else if (o.mins) {
    run<TileDecoder<false, true>>(w, xp, yp, o.M, o.chunk);
  } else {
    run<TileDecoder<false, false>>(w, xp, yp, o.M, o.chunk);
  }
}

}  // namespace

void check_accumulator(const torch::Tensor& y, const TileOperands& o) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat32 && y.is_contiguous() && y.size(0) == o.M &&
                  y.size(1) == o.N, "y: contiguous float32 [M, N]");
}

torch::Tensor tiled_matmul(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias) {
  const TileOperands o = check_tile_operands(x, data, params, bias);
  torch::Tensor y = torch::empty({o.M, o.N}, x.options());
  tiled_into(o, x, data, params, y.data_ptr<float>(), false);
  return y;
}

// y += x @ dequant(W)^T (+ bias), as y + (the product + bias): the decode layer's residual
// adds, each value added by the thread that computed it, where it wrote it.
void tiled_matmul_add(torch::Tensor y, torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias) {
  const TileOperands o = check_tile_operands(x, data, params, bias);
  check_accumulator(y, o);
  tiled_into(o, x, data, params, y.data_ptr<float>(), true);
}
