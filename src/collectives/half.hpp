// float16 (IEEE binary16) and bfloat16 <-> float conversions, rounding to nearest even.
//
// The float16 conversions are the branch-free ones of the FP16 library (Marat Dukhan, MIT), which
// PyTorch's c10::Half uses too; they rely only on IEEE float arithmetic in the default rounding
// mode (do not build this file with -ffast-math).
#pragma once

#include <cstdint>
#include <cstring>

namespace commux::half {

inline float bits_to_float(std::uint32_t w) {
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

inline std::uint32_t float_to_bits(float f) {
  std::uint32_t w;
  std::memcpy(&w, &f, sizeof w);
  return w;
}

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
  const std::uint32_t sign = w & UINT32_C(0x80000000);
  const std::uint32_t two_w = w + w;
  constexpr std::uint32_t exp_offset = UINT32_C(0xE0) << 23;
  constexpr float exp_scale = 0x1.0p-112f;
  const float normalized = bits_to_float((two_w >> 4) + exp_offset) * exp_scale;
  constexpr std::uint32_t magic_mask = UINT32_C(126) << 23;
  constexpr float magic_bias = 0.5f;
  const float denormalized = bits_to_float((two_w >> 17) | magic_mask) - magic_bias;
  constexpr std::uint32_t denormalized_cutoff = UINT32_C(1) << 27;
  const std::uint32_t result = sign | (two_w < denormalized_cutoff ? float_to_bits(denormalized)
                                                                   : float_to_bits(normalized));
  return bits_to_float(result);
}

inline std::uint16_t float_to_half(float f) {
  constexpr float scale_to_inf = 0x1.0p+112f;
  constexpr float scale_to_zero = 0x1.0p-110f;
  const std::uint32_t w = float_to_bits(f);
  const float abs_f = bits_to_float(w & UINT32_C(0x7FFFFFFF));
  float base = (abs_f * scale_to_inf) * scale_to_zero;
  const std::uint32_t shl1_w = w + w;
  const std::uint32_t sign = w & UINT32_C(0x80000000);
  std::uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = bits_to_float((bias >> 1) + UINT32_C(0x07800000)) + base;
  const std::uint32_t bits = float_to_bits(base);
  const std::uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const std::uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const std::uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<std::uint16_t>((sign >> 16) |
                                    (shl1_w > UINT32_C(0xFF000000) ? UINT32_C(0x7E00) : nonsign));
}

inline float bfloat16_to_float(std::uint16_t h) {
  return bits_to_float(static_cast<std::uint32_t>(h) << 16);
}

inline std::uint16_t float_to_bfloat16(float f) {
  const std::uint32_t w = float_to_bits(f);
  if ((w & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000)) {
    return static_cast<std::uint16_t>((w >> 16) | UINT32_C(0x0040));  // NaN stays a (quiet) NaN
  }
  const std::uint32_t rounding_bias = UINT32_C(0x7FFF) + ((w >> 16) & 1u);
  return static_cast<std::uint16_t>((w + rounding_bias) >> 16);
}

}  // namespace commux::half
