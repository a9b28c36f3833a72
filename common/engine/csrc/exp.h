// exp for the engine's CPU kernels, in plain arithmetic that the compiler vectorizes (std::exp is a scalar
// libm call: a third of the decode-attention kernel's time when it used it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// tanh(x) as (1 - e) / (1 + e), e = exp(-2|x|), with the sign of x: vectorizes as exp_nonpositive does (a soft
// cap over every score). Within a few ulp of tanh for |x| >= 0.5; an absolute error under 2e-7 below it.
inline float tanh_of(float x) {
  const float e = exp_nonpositive(-2.f * std::fabs(x));
  return std::copysign((1.f - e) / (1.f + e), x);
}

}  // namespace pdserve
