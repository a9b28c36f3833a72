// Rotary position embedding (RoPE, the half-split form of Llama and Qwen2) applied in place to the query and key
// heads of a fused q/k/v projection's output, in one pass.
//
// transformers applies it as q * cos + rotate_half(q) * sin for q and k: two slices, a negation, a concatenation,
// two multiplies and an add each, fourteen operators a layer (with their allocations) where one loop suffices. On
// a 0.35B model's 2,048-token prefill those operators took about 11% of the time; in a single-stream decode step
// they are a hundred small calls. The roundings are transformers' own: each product rounded to the dtype, then
// their sum (for the first half q1*cos - q2*sin, as q1*cos + (-q2)*sin, whose negation is exact). Nothing here may
// fuse a multiply into an add, so contraction is off for this file.

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using pdserve::round_to;
using pdserve::to_float;

// one head of one token: x[0, D) rotated by c[0, D), s[0, D); 16 pairs a vector where the CPU has AVX-512 (GCC
// vectorizes the loop below with 512-bit vectors for Zen 4, with 256-bit ones for Sapphire Rapids, whose tuning
// prefers them; rotary_ alone on Zen 4, bf16, 24 heads of 64: 1.02x at 1 and 16 rows, 1.05x at 2,048)
// C: the angles' type. T's (transformers' rotation in the model's dtype): each product rounded to T, then their
// sum. float with bf16 heads (OLMo 2's and 3's rotary embedding keeps float angles and its rotation computes in
// float, cast back once): only the sum rounded.
template <typename T, typename C>
inline void rotate_head(T* x, const float* c, const float* s, int64_t half, int64_t second) {
  constexpr bool round_products = std::is_same_v<T, C>;
  int64_t i = 0;
#if defined(__AVX512F__)
  using pdserve::load16;
  using pdserve::round16;
  using pdserve::store16;
  const auto product16 = [](__m512 a, __m512 b) {
    const __m512 p = _mm512_mul_ps(a, b);
    if constexpr (round_products) return round16<T>(p);
    return p;
  };
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
    const __m512 a1 = product16(x1, load16(c + i));
    const __m512 b1 = product16(x2, load16(s + i));
    const __m512 a2 = product16(x2, load16(c + i + second));
    const __m512 b2 = product16(x1, load16(s + i + second));
    store16(x + i, _mm512_sub_ps(a1, b1));
    store16(x + i + half, _mm512_add_ps(a2, b2));
  }
#endif
  const auto product = [](float a, float b) {
    if constexpr (round_products) return to_float(round_to<T>(a * b));
    return a * b;
  };
  for (; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float a1 = product(x1, to_float(c[i]));
    const float b1 = product(x2, to_float(s[i]));
    const float a2 = product(x2, to_float(c[i + second]));
    const float b2 = product(x1, to_float(s[i + second]));
    x[i] = round_to<T>(a1 - b1);
    x[i + half] = round_to<T>(a2 + b2);
  }
}

template <typename T, typename C>
void rotary_rows(T* qkv, const C* cos, const C* sin, int64_t rows, int64_t row_stride, int64_t cs_stride,
                 int64_t heads, int64_t head_dim, int64_t rot, int64_t second) {
  // about 32K elements a chunk, and a batch of rows at least in halves (16 decode rows of 24 heads of 64: 1.6x)
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>((rows + 1) / 2, (int64_t{1} << 15) / std::max<int64_t>(1, heads * head_dim)));
  // each row's angles widened to float once, for all its heads (they were widened again for every head)
  const int64_t width = second + rot / 2;
  pdserve::parallel_claim(rows, chunk, [&](int64_t r0, int64_t r1) {
    std::vector<float> angles(2 * width);
    for (int64_t r = r0; r < r1; ++r) {
      T* x = qkv + r * row_stride;
      const C* c = cos + r * cs_stride;
      const C* s = sin + r * cs_stride;
      for (int64_t i = 0; i < width; ++i) angles[i] = to_float(c[i]), angles[width + i] = to_float(s[i]);
      for (int64_t h = 0; h < heads; ++h)
        rotate_head<T, C>(x + h * head_dim, angles.data(), angles.data() + width, rot / 2, second);
    }
  });
}

// qkv [..., T, (Hq + 2 Hkv) D]: the first Hq + Hkv heads of each row (queries, then keys) rotated in place; values
// untouched. cos, sin [..., T, D] (one row a token, as transformers' rotary embedding gives them; [..., T, D / 2]:
// each angle once, GPT-OSS's, both halves rotated by it), qkv's dtype (or float for bf16 qkv: OLMo 2's and 3's).
// rotary_dim > 0: only each head's first rotary_dim features rotated (GLM-4-MoE's partial rotary, half the head),
// half-split within them, by cos and sin [..., T, rotary_dim]; the rest of the head untouched.
void rotary_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
             int64_t head_dim, int64_t rotary_dim) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "pdserve::rotary_ takes CPU tensors");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && num_q_heads > 0 && num_kv_heads > 0,
              "pdserve::rotary_: bad head layout ", num_q_heads, " x ", num_kv_heads, " x ", head_dim);
  TORCH_CHECK(qkv.dim() >= 1 && qkv.size(-1) == (num_q_heads + 2 * num_kv_heads) * head_dim && qkv.stride(-1) == 1,
              "pdserve::rotary_: qkv [..., (Hq + 2 Hkv) D] with contiguous rows, got ", qkv.sizes());
  const bool float_angles = qkv.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kFloat;
  TORCH_CHECK((qkv.scalar_type() == cos.scalar_type() || float_angles) && cos.scalar_type() == sin.scalar_type(),
              "pdserve::rotary_: cos and sin must be qkv's dtype (or float for bf16 qkv), got qkv ", qkv.scalar_type(),
              ", cos ", cos.scalar_type(), ", sin ", sin.scalar_type());
  TORCH_CHECK(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
              "pdserve::rotary_: rotary_dim must be even and at most the head dim ", head_dim,
              " (0: the whole head), got ", rotary_dim);
  at::Tensor rows = qkv.view({-1, qkv.size(-1)});  // fails (rather than copies) where the rows are not one stride
  const int64_t n = rows.size(0);
  at::Tensor c = cos.reshape({-1, cos.size(-1)}), s = sin.reshape({-1, sin.size(-1)});
  if (rotary_dim > 0) {
    TORCH_CHECK(c.size(0) == n && c.size(1) == rotary_dim && s.sizes() == c.sizes(),
                "pdserve::rotary_: cos and sin [..., T, rotary_dim] for T = ", n, " and rotary_dim = ", rotary_dim,
                ", got ", cos.sizes());
  } else {
    TORCH_CHECK(c.size(0) == n && (c.size(1) == head_dim || c.size(1) == head_dim / 2) && s.sizes() == c.sizes(),
                "pdserve::rotary_: cos and sin [..., T, D] (or [..., T, D / 2]) for T = ", n, " and D = ", head_dim,
                ", got ", cos.sizes());
  }
  // the features rotated, and the angles of their second half: the second half of cos and sin, or (D / 2 of them
  // over a whole head: GPT-OSS's) the same
  const int64_t rot = rotary_dim > 0 ? rotary_dim : head_dim;
  const int64_t second = rotary_dim > 0 ? rotary_dim / 2 : (c.size(1) == head_dim ? head_dim / 2 : 0);
  if (c.stride(1) != 1 || s.stride(1) != 1 || c.stride(0) != s.stride(0)) {
    c = c.contiguous();
    s = s.contiguous();
  }
  const int64_t heads = num_q_heads + num_kv_heads;
  if (qkv.scalar_type() == at::kFloat) {
    rotary_rows(rows.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), n, rows.stride(0), c.stride(0),
                heads, head_dim, rot, second);
  } else if (float_angles) {
    rotary_rows(rows.data_ptr<c10::BFloat16>(), c.data_ptr<float>(), s.data_ptr<float>(), n, rows.stride(0),
                c.stride(0), heads, head_dim, rot, second);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    rotary_rows(rows.data_ptr<c10::BFloat16>(), c.data_ptr<c10::BFloat16>(), s.data_ptr<c10::BFloat16>(), n,
                rows.stride(0), c.stride(0), heads, head_dim, rot, second);
  } else {
    TORCH_CHECK(false, "pdserve::rotary_ supports float32 and bfloat16, got ", qkv.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def(
      "rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads, int head_dim, "
      "int rotary_dim=0) -> ()");
  m.impl("rotary_", c10::DispatchKey::CPU, TORCH_FN(rotary_));
}
