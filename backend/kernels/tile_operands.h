// The operands of the tiles' GEMVs (tiles.cpp, tiles_a8.cpp), checked once for both.
#pragma once

#include <torch/extension.h>

struct TileOperands {
  int64_t M, N, K, blocks;
  bool int4, mins;     // int4 or int5 (else int8) weights; params hold mins after the scales (int4 /
                       // int5 without: symmetric, a block's min -8 / -16 x its scale)
  bool int5;           // int5: int4's nibbles and a plane of high bits (formats.Tiles)
  bool halves;         // int8 group 16: params per half block (formats.Tiles)
  const float* bias;   // [N] or null
  int64_t chunk;       // tiles a thread takes per round of passes: ~256 KB of weights, its L2
};

// x: contiguous float32 [M, K]; data: uint8 [N / 4, K / 32, 4, 16] (int4), [.., 20] (int5) or int8 [.., 32];
// params: float32 [N / 4, K / 32, 8] (4 scales, 4 mins) or [.., 4] (int8 without mins), with a
// dimension of 2 before the last for int8 group 16 ([.., K / 32, 2, 8 or 4]: each half's);
// bias: [N], or undefined / empty for none.
TileOperands check_tile_operands(const torch::Tensor& x, const torch::Tensor& data, const torch::Tensor& params,
                                 const torch::Tensor& bias);

// y: contiguous float32 [M, N], the output a product is added into (tiled_matmul_add, _a8_add).
void check_accumulator(const torch::Tensor& y, const TileOperands& o);
