// exp for the engine's CPU kernels, in plain arithmetic that the compiler vectorizes (std::exp is a scalar
// libm call: a third of the decode-attention kernel's time when it used it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pdserve {

// exp(x) for x <= 0 (a softmax after subtracting the maximum, a sigmoid of -|x|), within 2 ulp.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);                                  // below: the result is under float's smallest normal
  // x = n ln2 + r, |r| <= ln2 / 2; n rounded to nearest by the 1.5 * 2^23 trick (nearbyint does not vectorize)
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693145751953125f;                    // ln2 in two parts, exact products
  r -= n * 1.428606765330187045e-06f;
  float p = 1.9875691500e-4f;                              // Cephes' expf polynomial
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// tanh(x) as (1 - e) / (1 + e), e = exp(-2|x|), with the sign of x: GCC vectorizes it for AVX-512 (a soft cap over
// every score; on AVX2 it makes the clamp a branch, and tanh_of8 below serves). Within a few ulp of tanh for
// |x| >= 0.5; an absolute error under 2e-7 below it.
inline float tanh_of(float x) {
  const float e = exp_nonpositive(-2.f * std::fabs(x));
  return std::copysign((1.f - e) / (1.f + e), x);
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive over 8 lanes, with FMAs where -ffp-contract=fast puts them in the scalar code
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 shift = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), shift), shift);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// tanh_of over 8 lanes (CPUs with AVX2: GCC does not vectorize the scalar form there, its clamp turned into a branch)
inline __m256 tanh_of8(__m256 x) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_set1_ps(-2.f), _mm256_andnot_ps(sign, x)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}
#endif

}  // namespace pdserve
