// int5 weights' decode (formats.py: GGUF's Q5_0 / Q5_1 / Q5_K, 5 bits a weight: int4's nibbles
// and a plane of high bits), for both tiles' GEMVs: tiles.cpp (float32 activations) and
// tiles_a8.cpp (int8 ones).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// A tile row's block (its 16 nibble bytes, then 4 bytes of high bits: bit j weight j's) as
// float32, weights 0..15 in lo and 16..31 in hi: through a 32-entry table of scale * level +
// min (a product, then a sum, as the reference), two vectors, one permutex2var a 16 weights
// (index bit 4, the weight's high bit, picks the second vector).
inline void decode_int5(const uint8_t* row, float scale_value, float min_value, __m512& lo, __m512& hi) {
  const __m512 scale = _mm512_set1_ps(scale_value), min = _mm512_set1_ps(min_value);
  const __m512 levels = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 table_lo = _mm512_add_ps(_mm512_mul_ps(levels, scale), min);
  const __m512 table_hi = _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(levels, _mm512_set1_ps(16)), scale), min);
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  uint32_t high;
  std::memcpy(&high, row + 16, 4);
  const __m512i sixteen = _mm512_set1_epi32(16);
  const __m512i nib_lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), nib_hi = _mm512_srli_epi32(bytes, 4);
  const __m512i idx_lo = _mm512_mask_or_epi32(nib_lo, static_cast<__mmask16>(high), nib_lo, sixteen);
  const __m512i idx_hi = _mm512_mask_or_epi32(nib_hi, static_cast<__mmask16>(high >> 16), nib_hi, sixteen);
  lo = _mm512_permutex2var_ps(table_lo, idx_lo, table_hi);
  hi = _mm512_permutex2var_ps(table_lo, idx_hi, table_hi);
}

// The int8-activation tiles' high bits added into a block's 8 vectors of nibbles w (tiles_a8.cpp
// load_block: w[j] holds inputs 4j .. 4j + 3 of the 16 rows, row n at bytes 4n ..): the block's
// 5th 64-byte vector is 8 masks of 64 bits, mask j's bit 4n + k the high bit of row n's input
// 4j + k, so each vector takes its 16s in one masked byte add (a nibble + 16: the OR of bit 4).
inline void add_high_bits(const uint8_t* masks, __m512i (&w)[8]) {
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int j = 0; j < 8; ++j) {
    uint64_t bits;
    std::memcpy(&bits, masks + 8 * j, 8);
    w[j] = _mm512_mask_add_epi8(w[j], _cvtu64_mask64(bits), w[j], sixteen);
  }
}
