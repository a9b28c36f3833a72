// What the engine's linear kernels (bf16_linear.cpp, bf16_amx.cpp, fp32_linear.cpp) share: the front (x [..., K]
// as contiguous rows, the bias checked and in float, the output [rows, n] and the shape to return it in), the
// store of a tile's sums, and the widened-slice GEMM of prefill-sized calls.
#pragma once

#include <ATen/ATen.h>

#include "bf16.h"

#include <algorithm>
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

// rows x 16 float sums (16 apart) -> output columns [col, min(col + 16, n)) of rows n apart, the bias added
// before the one rounding to T.
template <typename T>
inline void store_block(const float* acc, int64_t rows, const float* bias, T* out, int64_t n, int64_t col) {
  const int64_t width = std::min<int64_t>(16, n - col);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) out[r * n + col + j] = round_to<T>(acc[16 * r + j] + (bias ? bias[col + j] : 0.f));
}

// Many rows (prefill): a packed weight's 16-feature blocks [0, blocks) widened a ~4 MiB slice at a time into
// w^T's columns (unpack(b0, b1, dst) writes blocks [b0, b1) as a row-major [K, (b1 - b0) * 16] matrix of x's
// dtype), each slice through torch's GEMM straight into the output's columns (rows n apart: written in place),
// the bias added before the GEMM's one rounding. Widening writes K x 16 elements a block against m x K x 16
// multiply-adds. Only the first `m` rows where given (the caller computes the others).
template <typename Unpack>
inline void widened_gemm(LinearCall& call, int64_t blocks, const Unpack& unpack, int64_t m = -1) {
  const at::Tensor rows = m < 0 ? call.rows : call.rows.narrow(0, 0, m);
  const at::Tensor out = m < 0 ? call.out : call.out.narrow(0, 0, m);
  const int64_t k = call.rows.size(1), n = call.out.size(1), per_block = k * 16;
  const int64_t slice = std::max<int64_t>(1, (int64_t{4} << 20) / (per_block * call.rows.element_size()));
  // kept between calls (a calling thread's ~4 MiB): a fresh one costs a page fault per 4 KiB every call
  thread_local at::Tensor wide;
  const int64_t need = per_block * std::min(slice, blocks);
  if (!wide.defined() || wide.scalar_type() != call.rows.scalar_type() || wide.numel() < need)
    wide = at::empty({need}, call.rows.options());
  for (int64_t b0 = 0; b0 < blocks; b0 += slice) {
    const int64_t b1 = std::min(blocks, b0 + slice), c0 = b0 * 16, c1 = std::min(n, b1 * 16);
    at::Tensor wslice = wide.narrow(0, 0, per_block * (b1 - b0)).view({k, (b1 - b0) * 16});
    unpack(b0, b1, wslice.data_ptr());
    at::Tensor dest = out.narrow(1, c0, c1 - c0);
    const at::Tensor columns = wslice.narrow(1, 0, c1 - c0);
    if (call.bias.defined())
      at::addmm_out(dest, call.bias.narrow(0, c0, c1 - c0).to(call.rows.scalar_type()), rows, columns);
    else
      at::mm_out(dest, rows, columns);
  }
}

}  // namespace pdserve
