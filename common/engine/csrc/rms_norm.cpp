// Llama-style RMSNorm of each row in one pass: y = w * to_dtype(x * rsqrt(mean(x^2) + eps)), computed in
// float as transformers' LlamaRMSNorm does (the normalised row rounded to the input dtype before the weight).
// PyTorch runs that as six to eight small ops (~35-50 us a call at one row on 2 cores); a decode step of a
// 24-layer model calls it 49 times.

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

template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = y + r * n;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_float(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const T normed = round_to<T>(to_float(xr[i]) * inv);  // the rounding transformers does
        yr[i] = round_to<T>(to_float(w[i]) * to_float(normed));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "pdserve::rms_norm runs on the CPU");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype, got ", x.scalar_type(),
              " and ", weight.scalar_type());
  const int64_t n = weight.numel();
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == n,
              "weight must be a contiguous [N] tensor and x [..., N]");
  at::Tensor rows = x.reshape({-1, n});  // a view where the strides allow it
  if (rows.stride(1) != 1) rows = rows.contiguous();
  at::Tensor out = at::empty({rows.size(0), n}, x.options());
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_rows(rows.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows.size(0), n,
             rows.stride(0), feps);
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_rows(rows.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
             rows.size(0), n, rows.stride(0), feps);
  } else {
    TORCH_CHECK(false, "pdserve::rms_norm supports float32 and bfloat16, got ", x.scalar_type());
  }
  return out.view(x.sizes());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
}
