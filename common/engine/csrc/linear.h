// The shared front of the engine's linear kernels (bf16_linear.cpp, fp32_linear.cpp): x [..., K] as contiguous
// rows, the bias checked and in float, the output [rows, n] and the shape to return it in.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace pdserve {

struct LinearCall {
  at::Tensor rows, bias, out;  // bias undefined when there is none
  std::vector<int64_t> shape;  // x's shape with n output features

  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

inline LinearCall linear_call(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n) {
  LinearCall call;
  call.rows = x.reshape({-1, x.size(-1)}).contiguous();
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must have ", n, " elements, got ", bias->numel());
    call.bias = bias->to(at::kFloat).contiguous();
  }
  call.shape.assign(x.sizes().begin(), x.sizes().end());
  call.shape.back() = n;
  call.out = at::empty({call.rows.size(0), n}, x.options());
  return call;
}

}  // namespace pdserve
