// bf16 <-> float for the engine's CPU kernels, in plain integer arithmetic that the compiler vectorizes:
// c10::BFloat16's float constructor is a scalar call (2.5 ns an element, measured here).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pdserve {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> T, rounding to nearest even as c10::BFloat16(float) does (NaN stays a quiet NaN).
template <typename T>
inline T round_to(float x);

template <>
inline float round_to<float>(float x) {
  return x;
}

template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
  return out;
}

#if defined(__AVX512F__)

// 16 elements as floats
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {  // widened
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v rounded to T's precision, still in float lanes: round_to<T> 16 lanes at a time, in integer arithmetic
// (vcvtneps2bf16 would treat subnormal inputs and outputs as zero, round_to does not)
template <typename T>
inline __m512 round16(__m512 v);

template <>
inline __m512 round16<float>(__m512 v) {
  return v;
}

#if defined(__AVX512BF16__)
// vcvtneps2bf16 rounds as round_to does except for NaNs (it keeps their payload) and subnormals (it flushes them):
// lanes of either class (vfpclassps: QNaN 0x01, denormal 0x20, SNaN 0x80) take the integer path below
inline bool plain16(__m512 v) { return _mm512_fpclass_ps_mask(v, 0xA1) == 0; }
#endif

template <>
inline __m512 round16<c10::BFloat16>(__m512 v) {
#if defined(__AVX512BF16__)
  if (plain16(v))
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v))), 16));
#endif
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd);
  const __m512i rounded = _mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000)));
}

// 16 floats stored as T, rounded as round_to<T>
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(c10::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  if (plain16(v)) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    return;
  }
#endif
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round16<c10::BFloat16>(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}

#endif  // __AVX512F__

#if defined(__AVX2__)

// 8 elements as floats, for CPUs with AVX2 alone (Zen 2 and 3): load16, round16 and store16 above, 8 lanes wide

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {  // widened
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename T>
inline __m256 round8(__m256 v);

template <>
inline __m256 round8<float>(__m256 v) {
  return v;
}

template <>
inline __m256 round8<c10::BFloat16>(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
  const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(c10::BFloat16* p, __m256 v) {
  // the high halves, packed within each 128-bit lane (no saturation: they are below 2^16), then lanes 0 and 2
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round8<c10::BFloat16>(v)), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

#endif  // __AVX2__

}  // namespace pdserve
