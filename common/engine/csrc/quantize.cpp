// The elementwise ends of a W8A8 product (the int8_dynamic layout of cpu_linear.PackedLinear): each input row
// rounded to int8 on its own scale before the int8 GEMM, the GEMM's int32 sums scaled back after it, each as one
// pass where torchao's form takes five to seven tensor ops (at one row, the ops cost more than the GEMM itself).
// Every step rounds where torchao's does, in the same order (tests compare bit for bit):
//   x_scale = max(T(amax|x| / 127.5), T(eps)) in x's dtype T, as a float; q = clamp(rint(float(x) * (1 / x_scale)))
//   y = T(sums * x_scale) (kept as a float), then y * w_scale (+ bias), rounded once to T.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Rows a thread takes at once: enough elements that a call of a few rows runs on the calling thread alone.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width)); }

template <typename T>
float amax_abs(const T* x, int64_t k) {
  float m = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    __m512 v = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) v = _mm512_max_ps(v, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    m = _mm512_reduce_max_ps(v);
  } else {
    __m512 v = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      v = _mm512_max_ps(v, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))));
    }
    m = _mm512_reduce_max_ps(v);
  }
#endif
  for (; i < k; ++i) m = std::max(m, std::fabs(pdserve::to_float(x[i])));
  return m;
}

template <typename T>
void quantize_row(const T* x, int64_t k, float inv, uint8_t flip, int8_t* q) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  const __m128i f = _mm_set1_epi8(static_cast<char>(flip));
  for (; i + 16 <= k; i += 16) {
    __m512 v;
    if constexpr (std::is_same_v<T, float>) {
      v = _mm512_loadu_ps(x + i);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    v = _mm512_roundscale_ps(_mm512_mul_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __m128i b = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_xor_si128(b, f));
  }
#endif
  for (; i < k; ++i) {
    const float r = std::min(std::max(std::nearbyint(pdserve::to_float(x[i]) * inv), -128.f), 127.f);
    q[i] = static_cast<int8_t>(static_cast<int8_t>(r) ^ static_cast<int8_t>(flip));
  }
}

// x [M, K] float or bf16 -> (q [M, K] int8, or uint8 holding q + 128 where `offset`; x_scale [M, 1] float).
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, bool offset) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows takes [M, K] float32 or bf16 CPU rows, got ", x.scalar_type(), " of shape ", x.sizes(),
              " on ", x.device());
  const at::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1);
  at::Tensor q = at::empty({m, k}, rows.options().dtype(offset ? at::kByte : at::kChar));
  at::Tensor scale = at::empty({m, 1}, rows.options().dtype(at::kFloat));
  const uint8_t flip = offset ? 0x80 : 0;
  const float eps = std::numeric_limits<float>::epsilon();  // torchao's floor for the scale
  auto run = [&](const auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    int8_t* qp = static_cast<int8_t*>(q.data_ptr());
    float* sp = scale.data_ptr<float>();
    // amax / 127.5 and the floor in x's dtype (a bf16 scale is rounded to bf16), then the float reciprocal
    const float floor = pdserve::to_float(pdserve::round_to<T>(eps));
    at::parallel_for(0, m, row_grain(k), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* xr = xp + r * k;
        float s = pdserve::to_float(pdserve::round_to<T>(amax_abs(xr, k) / 127.5f));
        if (s < floor) s = floor;
        sp[r] = s;
        quantize_row(xr, k, 1.f / s, flip, qp + r * k);
      }
    });
  };
  if (rows.scalar_type() == at::kFloat)
    run(rows.data_ptr<float>());
  else
    run(rows.data_ptr<c10::BFloat16>());
  return {q, scale};
}

// sums [M, N] float (a GEMM's int32 sums), x_scale [M, 1] float, w_scale [N] float, bias [N] (float: used as it
// is; bf16: converted, exactly) or None -> [M, N] of `bf16 ? bf16 : float`. Compiled without contraction (the build's -ffp-contract=fast would fuse
// the weight scale's product and the bias's sum into one rounding, where torchao rounds each).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
at::Tensor dequantize_sums(const at::Tensor& sums, const at::Tensor& x_scale, const at::Tensor& w_scale,
                           const std::optional<at::Tensor>& bias, bool bf16) {
  TORCH_CHECK(sums.dim() == 2 && sums.scalar_type() == at::kFloat && sums.device().is_cpu(),
              "dequantize_sums takes [M, N] float32 CPU sums, got ", sums.scalar_type(), " of shape ", sums.sizes());
  const int64_t m = sums.size(0), n = sums.size(1);
  TORCH_CHECK(x_scale.numel() == m && x_scale.scalar_type() == at::kFloat && w_scale.numel() == n &&
                  w_scale.scalar_type() == at::kFloat,
              "dequantize_sums: x_scale must be ", m, " floats and w_scale ", n, " floats, got ", x_scale.sizes(), " ",
              x_scale.scalar_type(), " and ", w_scale.sizes(), " ", w_scale.scalar_type());
  const at::Tensor s = sums.contiguous(), xs = x_scale.contiguous(), ws = w_scale.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must have ", n, " elements, got ", bias->numel());
    b = bias->to(at::kFloat).contiguous();  // exact: bias is float or bf16
  }
  at::Tensor out = at::empty({m, n}, s.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float* sp = s.data_ptr<float>();
  const float* xp = xs.data_ptr<float>();
  const float* wp = ws.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto run = [&](auto* op) {
    using T = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, m, row_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = sp + r * n;
        const float scale = xp[r];
        T* o = op + r * n;
        for (int64_t j = 0; j < n; ++j) {
          float y = pdserve::to_float(pdserve::round_to<T>(row[j] * scale)) * wp[j];
          if (bp) y += bp[j];
          o[j] = pdserve::round_to<T>(y);
        }
      }
    });
  };
  if (bf16)
    run(out.data_ptr<c10::BFloat16>());
  else
    run(out.data_ptr<float>());
  return out;
}
#pragma GCC pop_options

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("quantize_rows(Tensor x, bool offset) -> (Tensor, Tensor)");
  m.impl("quantize_rows", c10::DispatchKey::CPU, TORCH_FN(quantize_rows));
  m.def("dequantize_sums(Tensor sums, Tensor x_scale, Tensor w_scale, Tensor? bias, bool bf16) -> Tensor");
  m.impl("dequantize_sums", c10::DispatchKey::CPU, TORCH_FN(dequantize_sums));
}
