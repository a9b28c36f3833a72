// Llama-style RMSNorm of each row in one pass: y = w * to_dtype(x * rsqrt(mean(x^2) + eps)), computed in float as
// transformers' LlamaRMSNorm does (the normalised row rounded to the input dtype before the weight);
// rms_norm_scaled: Gemma's, below.
// PyTorch runs that as six to eight small ops (~35-50 us a call at one row on 2 cores); a decode step of a
// 24-layer model calls it 49 times.
//
// add_rms_norm_ also adds the residual first, in place (x += r, rounded to the dtype as x + r is), and
// normalises the sum while its row is still in L1: a decoder layer's "x = x + attention; h = norm(x)" and
// "x = x + mlp; h = next norm(x)" without the separate pass of the addition over the whole hidden state (a
// 2,048-token prefill of a 0.35B model: 48 additions of 4 MB a prompt).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16.h"

#include <cmath>
#include <cstdint>

namespace {

using pdserve::round_to;
using pdserve::to_float;

// One row. Not inlined, so that both operators run this very code: the vectorized sum of squares adds in one
// order, and the fused operator's output is bit for bit rms_norm's of the same sum.
template <typename T>
inline float inv_rms(const T* xr, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(xr[i]);
    sum += v * v;
  }
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

template <typename T>
__attribute__((noinline)) void rms_row(const T* xr, const T* w, T* yr, int64_t n, float eps) {
  const float inv = inv_rms(xr, n, eps);
  int64_t i = 0;
#if defined(__AVX512F__)
  // 16 at a time with bf16.h's roundings (vcvtneps2bf16 where it rounds as round_to does): the autovectorized
  // loop below rounded in integer arithmetic, twice an element
  const __m512 inv16 = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) {
    const __m512 normed = pdserve::round16<T>(_mm512_mul_ps(pdserve::load16(xr + i), inv16));
    pdserve::store16(yr + i, _mm512_mul_ps(pdserve::load16(w + i), normed));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) {
    const T normed = round_to<T>(to_float(xr[j]) * inv);  // the rounding transformers does
    yr[j] = round_to<T>(to_float(w[j]) * to_float(normed));
  }
}

// Gemma's RMSNorm: y = to_dtype(x * rsqrt(mean(x^2) + eps) * scale), all in float and rounded once (scale = 1 +
// weight, in float), as transformers' GemmaRMSNorm computes it.
template <typename T>
void scaled_rows(const T* x, const float* scale, T* y, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = y + r * n;
      const float inv = inv_rms(xr, n, eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) yr[i] = round_to<T>(to_float(xr[i]) * inv * scale[i]);
    }
  });
}

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_row(x + r * x_stride, w, y + r * n, n, eps);
  });
}

// x [rows, n] (contiguous) += res [rows, n] (rows res_stride apart), then y = rms_norm(x)
template <typename T>
void add_rms_rows(T* x, const T* res, const T* w, T* y, int64_t rows, int64_t n, int64_t res_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      const T* rr = res + r * res_stride;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16)
        pdserve::store16(xr + i, _mm512_add_ps(pdserve::load16(xr + i), pdserve::load16(rr + i)));
#endif
#pragma omp simd
      for (int64_t j = i; j < n; ++j) xr[j] = round_to<T>(to_float(xr[j]) + to_float(rr[j]));
      rms_row(xr, w, y + r * n, n, eps);
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "pdserve::", op, " runs on the CPU");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype, got ", x.scalar_type(),
              " and ", weight.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "pdserve::", op,
              " supports float32 and bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.numel(),
              "weight must be a contiguous [N] tensor and x [..., N]");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "rms_norm");
  const int64_t n = weight.numel();
  at::Tensor rows = x.reshape({-1, n});  // a view where the strides allow it
  if (rows.stride(1) != 1) rows = rows.contiguous();
  at::Tensor out = at::empty({rows.size(0), n}, x.options());
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_rows(rows.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows.size(0), n,
             rows.stride(0), feps);
  } else {
    rms_rows(rows.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
             rows.size(0), n, rows.stride(0), feps);
  }
  return out.view(x.sizes());
}

// x [..., N] float32 or bfloat16, scale [N] float32 -> Gemma's RMSNorm of x with that 1 + weight
at::Tensor rms_norm_scaled(const at::Tensor& x, const at::Tensor& scale, double eps) {
  TORCH_CHECK(x.device().is_cpu() && scale.device().is_cpu() && scale.scalar_type() == at::kFloat &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "pdserve::rms_norm_scaled takes a float32 or bfloat16 x and a float32 scale on the CPU, got x ",
              x.scalar_type(), " on ", x.device(), " and scale ", scale.scalar_type(), " on ", scale.device());
  TORCH_CHECK(scale.dim() == 1 && scale.is_contiguous() && x.dim() >= 1 && x.size(-1) == scale.numel(),
              "scale must be a contiguous [N] tensor and x [..., N], got scale ", scale.sizes(), " and x ", x.sizes());
  const int64_t n = scale.numel();
  at::Tensor rows = x.reshape({-1, n});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  at::Tensor out = at::empty({rows.size(0), n}, x.options());
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat)
    scaled_rows(rows.data_ptr<float>(), scale.data_ptr<float>(), out.data_ptr<float>(), rows.size(0), n,
                rows.stride(0), feps);
  else
    scaled_rows(rows.data_ptr<c10::BFloat16>(), scale.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), rows.size(0),
                n, rows.stride(0), feps);
  return out.view(x.sizes());
}

// x (contiguous) += residual (x's shape and dtype), in place; returns rms_norm(x) with the new x
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, "add_rms_norm_");
  TORCH_CHECK(x.is_contiguous(), "pdserve::add_rms_norm_ adds into a contiguous x");
  TORCH_CHECK(residual.device().is_cpu() && residual.scalar_type() == x.scalar_type() &&
                  residual.sizes() == x.sizes(),
              "the residual must be a CPU tensor of x's dtype and shape ", x.sizes(), ", got ", residual.sizes(),
              " ", residual.scalar_type());
  const int64_t n = weight.numel();
  at::Tensor res = residual.reshape({-1, n});
  if (res.stride(1) != 1) res = res.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = res.size(0);
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    add_rms_rows(x.data_ptr<float>(), res.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows,
                 n, res.stride(0), feps);
  } else {
    add_rms_rows(x.data_ptr<c10::BFloat16>(), res.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                 out.data_ptr<c10::BFloat16>(), rows, n, res.stride(0), feps);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("add_rms_norm_(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm_));
  m.def("rms_norm_scaled(Tensor x, Tensor scale, float eps) -> Tensor");
  m.impl("rms_norm_scaled", c10::DispatchKey::CPU, TORCH_FN(rms_norm_scaled));
}
