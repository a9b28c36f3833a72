// The gated MLP's activation in one pass: out = silu(gate) * up (gelu_tanh_mul: Gemma's gelu with the tanh
// approximation in place of silu), from the fused gate/up projection's output
// [rows, 2I] (gate in columns [0, I), up in [I, 2I)) to [rows, I], fp32 or bf16 (silu_mul); or from the two
// products apart, [rows, I] each (silu_mul_parts: where gate and up are two oneDNN products, which a prefill
// worker's AMX runs faster than one of twice the width).
//
// PyTorch runs it as a silu and a multiply over two column slices: on bf16 both are scalar conversion loops
// (a 16 x 2816 silu took 134 us and the multiply about as long on a 2-core Xeon: 8% of a 0.35B model's decode
// step). The roundings match transformers' bf16 path: silu computed in float and rounded to the dtype, then the
// product computed in float and rounded again.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16.h"
#include "exp.h"
#include "parallel.h"

#include <cmath>
#include <cstdint>

namespace {

using pdserve::exp_nonpositive;
using pdserve::round_to;
using pdserve::to_float;

// silu(x) = x / (1 + exp(-x)); for x < 0 as x e^x / (1 + e^x), so exp only ever sees -|x| (no overflow).
// Below -87 (where exp_nonpositive stops) -0, as PyTorch's x / (1 + exp(-x)) gives once exp overflows.
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  return x < -87.f ? -0.f : (x >= 0.f ? x : x * e) / (1.f + e);
}

// tanh(y): Cephes' tanhf, in plain arithmetic that vectorizes: an odd polynomial below |y| = 0.625, else
// 1 - 2e / (1 + e) with e = exp(-2|y|) (no cancellation near +-1).
inline float tanh_approx(float y) {
  const float a = std::fabs(y);
  const float e = exp_nonpositive(-2.f * a);
  const float big = 1.f - 2.f * e / (1.f + e);
  const float s = y * y;
  const float small =
      ((((-5.70498872745e-3f * s + 2.06390887954e-2f) * s - 5.37397155531e-2f) * s + 1.33314422036e-1f) * s -
       3.33332819422e-1f) * s * a + a;
  const float t = a > 0.625f ? big : small;
  return y < 0.f ? -t : t;
}

// gelu with the tanh approximation (PyTorch's approximate="tanh": Gemma's gelu_pytorch_tanh), as PyTorch
// computes it: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
inline float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanh_approx(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

struct Silu {
  static float apply(float x) { return silu(x); }
};
struct GeluTanh {
  static float apply(float x) { return gelu_tanh(x); }
};

// gate rows g_stride apart, up rows u_stride apart, out [rows, n]
template <typename Act = Silu, typename T>
void silu_mul_rows(const T* gate, const T* up, T* out, int64_t rows, int64_t n, int64_t g_stride, int64_t u_stride) {
  // about 64K elements a chunk, and a batch of rows at least in halves: 16 decode rows of 2 x 2,816 took 64 us on
  // one thread, 40 us on two (1 row: one thread either way)
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>((rows + 1) / 2, (int64_t{1} << 16) / std::max<int64_t>(1, n)));
  pdserve::parallel_claim(rows, chunk, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate + r * g_stride;
      const T* u = up + r * u_stride;
      T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        o[i] = round_to<T>(to_float(round_to<T>(Act::apply(to_float(g[i])))) * to_float(u[i]));
    }
  });
}

// gu [..., 2I] (rows contiguous in the last dimension) -> [..., I]
template <typename Act>
at::Tensor act_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.device().is_cpu() && gu.dim() >= 1 && gu.size(-1) % 2 == 0,
              "pdserve::silu_mul/gelu_tanh_mul take a CPU tensor [..., 2I], got ", gu.sizes(), " on ", gu.device());
  const int64_t n = gu.size(-1) / 2;
  at::Tensor rows = gu.reshape({-1, 2 * n});  // a view where the strides allow it
  if (rows.stride(1) != 1) rows = rows.contiguous();
  at::Tensor out = at::empty({rows.size(0), n}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    const float* g = rows.data_ptr<float>();
    silu_mul_rows<Act>(g, g + n, out.data_ptr<float>(), rows.size(0), n, rows.stride(0), rows.stride(0));
  } else if (gu.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* g = rows.data_ptr<c10::BFloat16>();
    silu_mul_rows<Act>(g, g + n, out.data_ptr<c10::BFloat16>(), rows.size(0), n, rows.stride(0), rows.stride(0));
  } else {
    TORCH_CHECK(false, "pdserve::silu_mul/gelu_tanh_mul support float32 and bfloat16, got ", gu.scalar_type());
  }
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

at::Tensor silu_mul(const at::Tensor& gu) { return act_mul<Silu>(gu); }
at::Tensor gelu_tanh_mul(const at::Tensor& gu) { return act_mul<GeluTanh>(gu); }

// gate, up [..., I] of one shape and dtype -> [..., I]
at::Tensor silu_mul_parts(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu() && gate.dim() >= 1 && gate.sizes() == up.sizes() &&
                  gate.scalar_type() == up.scalar_type(),
              "pdserve::silu_mul_parts takes two CPU tensors of one shape and dtype, got ", gate.sizes(), " ",
              gate.scalar_type(), " and ", up.sizes(), " ", up.scalar_type());
  const int64_t n = gate.size(-1);
  at::Tensor g = gate.reshape({-1, n}), u = up.reshape({-1, n});
  if (g.stride(1) != 1) g = g.contiguous();
  if (u.stride(1) != 1) u = u.contiguous();
  at::Tensor out = at::empty({g.size(0), n}, gate.options());
  if (gate.scalar_type() == at::kFloat) {
    silu_mul_rows(g.data_ptr<float>(), u.data_ptr<float>(), out.data_ptr<float>(), g.size(0), n, g.stride(0),
                  u.stride(0));
  } else if (gate.scalar_type() == at::kBFloat16) {
    silu_mul_rows(g.data_ptr<c10::BFloat16>(), u.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), g.size(0),
                  n, g.stride(0), u.stride(0));
  } else {
    TORCH_CHECK(false, "pdserve::silu_mul_parts supports float32 and bfloat16, got ", gate.scalar_type());
  }
  return out.view(gate.sizes());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("silu_mul_parts(Tensor gate, Tensor up) -> Tensor");
  m.impl("silu_mul_parts", c10::DispatchKey::CPU, TORCH_FN(silu_mul_parts));
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.impl("gelu_tanh_mul", c10::DispatchKey::CPU, TORCH_FN(gelu_tanh_mul));
}
