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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using pdserve::exp_nonpositive;
using pdserve::round_to;
using pdserve::to_float;

// silu(x) = x / (1 + exp(-x)), PyTorch's own formula: its bf16 silu computes it in float and rounds once. exp(-x)
// as 2^t, t = -x log2(e) carried in two parts (the product's rounding error recovered by an FMA, plus x times
// log2(e)'s own remainder), 2^t = 2^floor(t) 2^r with r = t - floor(t) in [0, 1) and 2^r by a degree-5
// polynomial fitted for the least largest relative error (1.6e-7 evaluated in float); the division exact. Every
// one of the 65,536 bf16 gates then gives PyTorch's bf16 silu bit for bit (the Cephes exp over -|x| before missed
// four: -87.5, -88 and -88.5, whose exp(-x) PyTorch keeps finite, and -inf, whose silu PyTorch gives as NaN). -x clamped to [-150, 150], where
// exp(-x) is already 0 or inf; NaN goes through as NaN. The AVX-512 form (silu16) and this one compute alike.
constexpr float kLog2e = 1.4426950216293335f, kLog2eLow = 1.925963033500011e-08f;  // log2(e) = kLog2e + kLog2eLow
constexpr float kExp2Poly[6] = {0.9999999403953552f,  0.6931530833244324f,   0.24015361070632935f,
                                0.05582631379365921f, 0.008989345282316208f, 0.0018775742501020432f};

// exp(-x), as silu and sigmoid take it
inline float exp_neg(float x) {
  float nx = -x;  // clamped, NaN to 0 (x / d is NaN then anyway): no branch, so the loop vectorizes
  nx = nx < -150.f ? -150.f : nx;
  nx = nx > 150.f ? 150.f : nx;
  nx = nx == nx ? nx : 0.f;
  const float th = nx * kLog2e;
  const float tlo = std::fma(nx, kLog2eLow, std::fma(nx, kLog2e, -th));
  const float n = std::floor(th);
  const float r = (th - n) + tlo;
  float p = kExp2Poly[5];
  for (int i = 4; i >= 0; --i) p = std::fma(p, r, kExp2Poly[i]);
  // p 2^n in two exact steps of at most 2^109 each (|n| <= 217) and one rounding, as ldexp and scalef round
  const int32_t ni = static_cast<int32_t>(n), half = ni >> 1;
  const uint32_t a = static_cast<uint32_t>(half + 127) << 23, b = static_cast<uint32_t>(ni - half + 127) << 23;
  float fa, fb;
  std::memcpy(&fa, &a, sizeof fa);
  std::memcpy(&fb, &b, sizeof fb);
  return p * fa * fb;
}

inline float silu(float x) { return x / (1.f + exp_neg(x)); }

// sigmoid(x) = 1 / (1 + exp(-x)), PyTorch's formula, by silu's exp: every one of the 65,536 bf16 inputs gives
// PyTorch's bf16 sigmoid bit for bit (test_cpu_kernels.py); NaN stays NaN.
inline float sigmoid(float x) { return x == x ? 1.f / (1.f + exp_neg(x)) : x; }

#if defined(__AVX512F__)
// exp(-x) over 16 lanes, as exp_neg() computes it: vreduceps gives th - floor(th) exactly, scalef takes floor(th)
// itself.
inline __m512 exp_neg16(__m512 x) {
  const __m512 nx = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(-150.f)),
                                  _mm512_set1_ps(150.f));  // max(NaN, -150): -150, and x/1 stays NaN
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  const __m512 th = _mm512_mul_ps(nx, log2e);
  const __m512 tlo = _mm512_fmadd_ps(nx, _mm512_set1_ps(kLog2eLow), _mm512_fmsub_ps(nx, log2e, th));
  const __m512 r = _mm512_add_ps(_mm512_reduce_ps(th, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), tlo);
  __m512 p = _mm512_set1_ps(kExp2Poly[5]);
  for (int i = 4; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, th);
}

inline __m512 silu16(__m512 x) { return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp_neg16(x))); }

inline __m512 sigmoid16(__m512 x) {  // NaN lanes keep x
  const __m512 s = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp_neg16(x)));
  return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), s);
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp(-x) over 8 lanes (CPUs with AVX2 alone), as exp_neg() computes it, step for step: the same result bit for bit
// (the scalar loop does not vectorize: GCC turns its clamps into branches)
inline __m256 exp_neg8(__m256 x) {
  const __m256 nx = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(-150.f)),
                                  _mm256_set1_ps(150.f));  // max(NaN, -150): -150, and x/1 stays NaN
  const __m256 log2e = _mm256_set1_ps(kLog2e);
  const __m256 th = _mm256_mul_ps(nx, log2e);
  const __m256 tlo = _mm256_fmadd_ps(nx, _mm256_set1_ps(kLog2eLow), _mm256_fmsub_ps(nx, log2e, th));
  const __m256 n = _mm256_floor_ps(th);
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(th, n), tlo);
  __m256 p = _mm256_set1_ps(kExp2Poly[5]);
  for (int i = 4; i >= 0; --i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
  const __m256i a = _mm256_slli_epi32(_mm256_add_epi32(half, bias), 23);
  const __m256i b = _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23);
  return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(a)), _mm256_castsi256_ps(b));
}

inline __m256 silu8(__m256 x) { return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp_neg8(x))); }

inline __m256 sigmoid8(__m256 x) {  // NaN lanes keep x
  const __m256 s = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), exp_neg8(x)));
  return _mm256_blendv_ps(s, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
using pdserve::exp_nonpositive8;

// gelu_tanh over 8 lanes: tanh_approx's two branches both computed, the one for each lane's |y| kept
inline __m256 gelu_tanh8(__m256 x) {
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), x), x, x));
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 a = _mm256_andnot_ps(sign, y), one = _mm256_set1_ps(1.f);
  const __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_set1_ps(-2.f), a));
  const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_add_ps(e, e), _mm256_add_ps(one, e)));
  const __m256 s = _mm256_mul_ps(y, y);
  __m256 small = _mm256_fmadd_ps(_mm256_set1_ps(-5.70498872745e-3f), s, _mm256_set1_ps(2.06390887954e-2f));
  small = _mm256_fmsub_ps(small, s, _mm256_set1_ps(5.37397155531e-2f));
  small = _mm256_fmadd_ps(small, s, _mm256_set1_ps(1.33314422036e-1f));
  small = _mm256_fmsub_ps(small, s, _mm256_set1_ps(3.33332819422e-1f));
  small = _mm256_fmadd_ps(_mm256_mul_ps(small, s), a, a);
  const __m256 t = _mm256_blendv_ps(small, big, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_GT_OQ));
  const __m256 tanh = _mm256_or_ps(t, _mm256_and_ps(y, sign));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, tanh));
}
#endif

struct Silu {
  static float apply(float x) { return silu(x); }
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  static __m256 apply8(__m256 x) { return silu8(x); }
#endif
};
struct GeluTanh {
  static float apply(float x) { return gelu_tanh(x); }
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  static __m256 apply8(__m256 x) { return gelu_tanh8(x); }
#endif
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
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<Act, Silu>)
        for (; i + 16 <= n; i += 16)
          pdserve::store16(o + i, _mm512_mul_ps(pdserve::round16<T>(silu16(pdserve::load16(g + i))),
                                                pdserve::load16(u + i)));
#elif defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= n; i += 8)
        pdserve::store8(o + i, _mm256_mul_ps(pdserve::round8<T>(Act::apply8(pdserve::load8(g + i))),
                                             pdserve::load8(u + i)));
#endif
#pragma omp simd
      for (int64_t j = i; j < n; ++j)
        o[j] = round_to<T>(to_float(round_to<T>(Act::apply(to_float(g[j])))) * to_float(u[j]));
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

// GPT-OSS's gate (GptOssExperts._apply_gate) over rows of [gate | up] (moe.py takes the model's interleaved
// columns apart): gate clamped above at limit, up to [-limit, limit], then (up + 1) * (gate * sigmoid(gate *
// alpha)), each operation rounded to T as PyTorch rounds it. Clamps propagate NaN as torch.clamp does. It ran as
// a scalar loop over std::exp in moe.cpp: 262 of 432 ms of a 2,048-token bf16 prefill of the families' GPT-OSS
// (32 experts of 352, top 4) on a 2-core Xeon.
template <typename T>
inline float gpt_oss_one(T g, T u, float alpha, float limit) {
  const float gate = std::min(to_float(g), limit);  // min(NaN, limit) is NaN
  const float x = to_float(u);
  const float up = x != x ? x : std::min(std::max(x, -limit), limit);
  const float sig = to_float(round_to<T>(sigmoid(to_float(round_to<T>(gate * alpha)))));
  return to_float(round_to<T>(up + 1.f)) * to_float(round_to<T>(gate * sig));
}

template <typename T>
void gpt_oss_rows(const T* gate_up, T* out, int64_t rows, int64_t n, float alpha, float limit) {
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>((rows + 1) / 2, (int64_t{1} << 15) / std::max<int64_t>(1, n)));
#if defined(__AVX512F__)
  using pdserve::round16;
  const __m512 lim = _mm512_set1_ps(limit), neg_lim = _mm512_set1_ps(-limit), a = _mm512_set1_ps(alpha);
  const __m512 one = _mm512_set1_ps(1.f);
#elif defined(__AVX2__) && defined(__FMA__)
  using pdserve::round8;
  const __m256 lim = _mm256_set1_ps(limit), neg_lim = _mm256_set1_ps(-limit), a = _mm256_set1_ps(alpha);
  const __m256 one = _mm256_set1_ps(1.f);
#endif
  pdserve::parallel_claim(rows, chunk, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        const __m512 gate = _mm512_min_ps(lim, pdserve::load16(g + i));  // vminps gives its second operand on NaN
        const __m512 up = _mm512_max_ps(neg_lim, _mm512_min_ps(lim, pdserve::load16(u + i)));
        const __m512 sig = round16<T>(sigmoid16(round16<T>(_mm512_mul_ps(gate, a))));
        pdserve::store16(o + i, _mm512_mul_ps(round16<T>(_mm512_add_ps(up, one)), round16<T>(_mm512_mul_ps(gate, sig))));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= n; i += 8) {
        const __m256 gate = _mm256_min_ps(lim, pdserve::load8(g + i));  // vminps gives its second operand on NaN
        const __m256 up = _mm256_max_ps(neg_lim, _mm256_min_ps(lim, pdserve::load8(u + i)));
        const __m256 sig = round8<T>(sigmoid8(round8<T>(_mm256_mul_ps(gate, a))));
        pdserve::store8(o + i, _mm256_mul_ps(round8<T>(_mm256_add_ps(up, one)), round8<T>(_mm256_mul_ps(gate, sig))));
      }
#endif
      for (; i < n; ++i) o[i] = round_to<T>(gpt_oss_one(g[i], u[i], alpha, limit));
    }
  });
}

// gate_up [..., 2I] (the gate columns, then the up columns) -> [..., I]
at::Tensor gpt_oss_gate(const at::Tensor& gate_up, double alpha, double limit) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "pdserve::gpt_oss_gate takes a CPU tensor [..., 2I], got ", gate_up.sizes(), " on ", gate_up.device());
  const int64_t n = gate_up.size(-1) / 2;
  const at::Tensor rows = gate_up.reshape({-1, 2 * n}).contiguous();
  at::Tensor out = at::empty({rows.size(0), n}, gate_up.options());
  const auto a = static_cast<float>(alpha), l = static_cast<float>(limit);
  if (gate_up.scalar_type() == at::kFloat)
    gpt_oss_rows(rows.data_ptr<float>(), out.data_ptr<float>(), rows.size(0), n, a, l);
  else if (gate_up.scalar_type() == at::kBFloat16)
    gpt_oss_rows(rows.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows.size(0), n, a, l);
  else
    TORCH_CHECK(false, "pdserve::gpt_oss_gate supports float32 and bfloat16, got ", gate_up.scalar_type());
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("gpt_oss_gate(Tensor gate_up, float alpha, float limit) -> Tensor");
  m.impl("gpt_oss_gate", c10::DispatchKey::CPU, TORCH_FN(gpt_oss_gate));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("silu_mul_parts(Tensor gate, Tensor up) -> Tensor");
  m.impl("silu_mul_parts", c10::DispatchKey::CPU, TORCH_FN(silu_mul_parts));
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.impl("gelu_tanh_mul", c10::DispatchKey::CPU, TORCH_FN(gelu_tanh_mul));
}
