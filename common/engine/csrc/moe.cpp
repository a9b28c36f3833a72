// A mixture-of-experts block's experts in one call: each token's top-k experts, every expert's gated MLP
// over the engine's packed weights (fp32_linear.cpp, bf16_linear.cpp, bf16_amx.cpp), weighted and summed.
//
// transformers computes the experts of Qwen2/3-MoE, Mixtral, OLMoE and their kin with torch's grouped matmul
// (integrations/moe.py, grouped_mm_experts_forward): sort the (token, expert) pairs by expert, one grouped_mm for
// gate|up, the activation, one for down, weight, unsort, sum the k products of each token. On the CPU torch's
// grouped_mm is a loop over every expert, hit or not, each a matmul over the transposed weight plus a host read
// of its offsets: on a 60M-active model of 32 experts (top 4), 10 ms of a 16.5 ms single-stream decode step.
//
// Here the pairs are counted per expert once (T x k integers), and only the experts hit run: gather their
// tokens' rows, gate|up through the engine's linear kernel, silu_mul (activation.cpp), down, each product
// weighted into its (token, slot) row, then the k slots of each token summed. Products, weighting and sum are
// computed with transformers' roundings (the activation rounded, then the product; the weight multiplied in the
// promoted dtype; the slots summed in one reduction and rounded once), so the result differs from transformers'
// only by the linear kernels' order of summation.
//
// int8 experts (``--quantization int8-weight-only``, moe.Int8Experts): each expert's int8 values in the same
// layouts (the linear kernels widen them in registers as they load them) and one scale per output feature, in x's
// dtype; each product is scaled as torchao scales a weight-only int8 layer's (the product rounded to x's dtype,
// times the scale, rounded again).
//
// GPT-OSS's experts (gate="gpt_oss"): each expert's weights transposed back and its interleaved gate and up
// columns taken apart into gate rows then up rows (moe.py), float biases added by the linear kernels, and its
// clamped gate (gpt_oss_gate, activation.cpp) in place of silu_mul.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

// mean rows an expert up to which its products run whole on one thread (see moe_experts)
constexpr int64_t WHOLE_EXPERTS_ROWS = 16;
// rows an int8 expert from which bf16 products widen its values for AMX tiles (see moe_experts)
constexpr int64_t INT8_TILE_ROWS = 32;

using Linear4 = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t);
using Linear5 = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t);

// rows [m, K] times one expert's packed weight -> [m, n], by the kernel of `layout` (fp32_blocks, bf16_pairs or
// bf16_amx)
struct ExpertLinear {
  explicit ExpertLinear(const std::string& layout) : fp32(layout == "fp32_blocks") {
    auto& dispatcher = c10::Dispatcher::singleton();
    if (fp32)
      f5 = dispatcher.findSchemaOrThrow("pdserve::fp32_linear", "").typed<Linear5>();
    else
      f4 = dispatcher.findSchemaOrThrow(layout == "bf16_pairs" ? "pdserve::bf16_linear" : "pdserve::bf16_linear_amx", "")
               .typed<Linear4>();
  }
  at::Tensor operator()(const at::Tensor& rows, const at::Tensor& packed, int64_t n,
                        const std::optional<at::Tensor>& bias = std::nullopt) const {
    return fp32 ? f5->call(rows, packed, bias, n, 0) : f4->call(rows, packed, bias, n);
  }
  bool fp32;
  std::optional<c10::TypedOperatorHandle<Linear5>> f5;
  std::optional<c10::TypedOperatorHandle<Linear4>> f4;
};

// slots[pos[r]] = out[r] * weights[pos[r]] for out's rows r, each product computed in float and rounded once to
// the slots' dtype (what at::mul gives for these dtypes); rows split over the threads (a 2,048-token prefill
// weighs 8,192 rows of the hidden size a layer at top 4)
template <typename Out, typename W, typename S>
void weigh_rows(const Out* out, const W* weights, const int64_t* pos, S* slots, int64_t m, int64_t hidden) {
  using pdserve::round_to;
  using pdserve::to_float;
  pdserve::parallel_claim(m, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, hidden)),
                          [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float w = to_float(weights[pos[r]]);
      S* dst = slots + pos[r] * hidden;
      const Out* src = out + r * hidden;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= hidden; i += 16)
        pdserve::store16(dst + i, _mm512_mul_ps(pdserve::load16(src + i), _mm512_set1_ps(w)));
#elif defined(__AVX2__)
      for (; i + 8 <= hidden; i += 8)
        pdserve::store8(dst + i, _mm256_mul_ps(pdserve::load8(src + i), _mm256_set1_ps(w)));
#endif
      for (; i < hidden; ++i) dst[i] = round_to<S>(to_float(src[i]) * w);
    }
  });
}

// out[t] = the k slots of token t added in float, slot after slot, and rounded once to Out: what torch's sum over
// the slot dimension (float accumulation for bf16, slot order) and the conversion to x's dtype give, bit for bit;
// tokens split over the threads (at::sum ran 2.1 ms a layer on one thread for 2,048 tokens of 512 at top 4)
template <typename S, typename Out>
void sum_slots(const S* slots, Out* out, int64_t tokens, int64_t k, int64_t hidden) {
  using pdserve::round_to;
  using pdserve::to_float;
  pdserve::parallel_claim(tokens, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, k * hidden)),
                          [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const S* src = slots + t * k * hidden;
      Out* dst = out + t * hidden;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= hidden; i += 16) {
        __m512 acc = pdserve::load16(src + i);
        for (int64_t j = 1; j < k; ++j) acc = _mm512_add_ps(acc, pdserve::load16(src + j * hidden + i));
        pdserve::store16(dst + i, acc);
      }
#elif defined(__AVX2__)
      for (; i + 8 <= hidden; i += 8) {
        __m256 acc = pdserve::load8(src + i);
        for (int64_t j = 1; j < k; ++j) acc = _mm256_add_ps(acc, pdserve::load8(src + j * hidden + i));
        pdserve::store8(dst + i, acc);
      }
#endif
      for (; i < hidden; ++i) {
        float acc = to_float(src[i]);
        for (int64_t j = 1; j < k; ++j) acc += to_float(src[j * hidden + i]);
        dst[i] = round_to<Out>(acc);
      }
    }
  });
}

// y[r, j] *= scale[j] in y's dtype (float products, rounded once: what at::mul gives), then y[r, j] += bias[j]
// where there is a bias (rounded again: torchao adds a weight-only int8 layer's bias after its scaling)
template <typename T>
void scale_columns(T* y, const T* scale, const T* bias, int64_t m, int64_t n) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const T scaled = static_cast<T>(static_cast<float>(y[r * n + j]) * static_cast<float>(scale[j]));
      y[r * n + j] = bias ? static_cast<T>(static_cast<float>(scaled) + static_cast<float>(bias[j])) : scaled;
    }
}

void scale_columns(at::Tensor& y, const at::Tensor& scale, const std::optional<at::Tensor>& bias) {
  if (y.scalar_type() == at::kFloat)
    scale_columns(y.data_ptr<float>(), scale.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, y.size(0),
                  y.size(1));
  else
    scale_columns(y.data_ptr<c10::BFloat16>(), scale.data_ptr<c10::BFloat16>(),
                  bias ? bias->data_ptr<c10::BFloat16>() : nullptr, y.size(0), y.size(1));
}

template <typename Out, typename W>
void weigh_as(const at::Tensor& out, const W* weights, const int64_t* pos, at::Tensor& slots) {
  const int64_t m = out.size(0), hidden = out.size(1);
  if (slots.scalar_type() == at::kFloat)
    weigh_rows(out.data_ptr<Out>(), weights, pos, slots.data_ptr<float>(), m, hidden);
  else
    weigh_rows(out.data_ptr<Out>(), weights, pos, slots.data_ptr<c10::BFloat16>(), m, hidden);
}

void weigh(const at::Tensor& out, const at::Tensor& weights, const int64_t* pos, at::Tensor& slots) {
  const bool out_f = out.scalar_type() == at::kFloat;
  if (weights.scalar_type() == at::kFloat) {
    const float* w = weights.data_ptr<float>();
    out_f ? weigh_as<float>(out, w, pos, slots) : weigh_as<c10::BFloat16>(out, w, pos, slots);
  } else {
    const c10::BFloat16* w = weights.data_ptr<c10::BFloat16>();
    out_f ? weigh_as<float>(out, w, pos, slots) : weigh_as<c10::BFloat16>(out, w, pos, slots);
  }
}

// x [T, H]; ids, weights [T, k] (each token's experts and their routing weights); gate_up [E, ...] and down
// [E, ...] each expert's packed [2I, H] and [H, I] weights (concatenated gate then up rows, as transformers stores
// them) -> [T, H] in x's dtype. int8 stacks come with their scales, gate_up_scale [E, 2I] and down_scale [E, H]
// in x's dtype.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& gate_up,
                       const at::Tensor& down, int64_t inter, c10::string_view layout,
                       const std::optional<at::Tensor>& gate_up_scale, const std::optional<at::Tensor>& down_scale,
                       const std::optional<at::Tensor>& gate_up_bias, const std::optional<at::Tensor>& down_bias,
                       c10::string_view gate, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "pdserve::moe_experts takes x [T, H] and ids, weights [T, k], got ", x.sizes(), ", ", ids.sizes(), ", ",
              weights.sizes());
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  (weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kBFloat16),
              "pdserve::moe_experts takes float32 or bfloat16 tokens and weights, got ", x.scalar_type(), " and ",
              weights.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && gate_up.size(0) == down.size(0) && gate_up.is_contiguous() && down.is_contiguous(),
              "pdserve::moe_experts takes CPU tensors and contiguous stacks of packed weights, one per expert");
  const bool int8 = gate_up.scalar_type() == at::kChar;
  TORCH_CHECK(down.scalar_type() == gate_up.scalar_type() && gate_up_scale.has_value() == int8 &&
                  down_scale.has_value() == int8,
              "pdserve::moe_experts: int8 weight stacks (both, or neither) come with their scales, and only they");
  if (int8) {
    TORCH_CHECK(gate_up_scale->scalar_type() == x.scalar_type() && down_scale->scalar_type() == x.scalar_type() &&
                    gate_up_scale->is_contiguous() && down_scale->is_contiguous() &&
                    gate_up_scale->sizes() == at::IntArrayRef({gate_up.size(0), 2 * inter}) &&
                    down_scale->sizes() == at::IntArrayRef({down.size(0), x.size(1)}),
                "pdserve::moe_experts: scales [E, 2 x inter] and [E, hidden] in x's dtype, got ",
                gate_up_scale->sizes(), " and ", down_scale->sizes());
  }
  const std::string gate_name(gate);
  TORCH_CHECK(gate_name == "silu" || gate_name == "gpt_oss", "pdserve::moe_experts: gate must be silu or gpt_oss, got ",
              gate_name);
  const bool gpt_oss = gate_name == "gpt_oss";
  TORCH_CHECK(gate_up_bias.has_value() == down_bias.has_value(),
              "pdserve::moe_experts: biases for both projections, or for neither");
  if (gate_up_bias) {  // float, added by the linear kernels; int8 experts': x's dtype, added after the scaling
    const auto bias_type = int8 ? x.scalar_type() : at::kFloat;
    TORCH_CHECK(gate_up_bias->scalar_type() == bias_type && down_bias->scalar_type() == bias_type &&
                    gate_up_bias->is_contiguous() && down_bias->is_contiguous() &&
                    gate_up_bias->sizes() == at::IntArrayRef({gate_up.size(0), 2 * inter}) &&
                    down_bias->sizes() == at::IntArrayRef({down.size(0), x.size(1)}),
                "pdserve::moe_experts: biases [E, 2 x inter] and [E, hidden] in ", bias_type, ", got ",
                gate_up_bias->sizes(), " and ", down_bias->sizes(), " in ", gate_up_bias->scalar_type());
  }
  // each expert's biases where the linear kernels add them (full precision) or the scaling does (int8)
  const auto bias_of = [](const std::optional<at::Tensor>& bias, int64_t e) {
    return bias ? std::optional<at::Tensor>((*bias)[e]) : std::nullopt;
  };
  const std::string name(layout);
  TORCH_CHECK(name == "fp32_blocks" || name == "bf16_pairs" || name == "bf16_amx",
              "pdserve::moe_experts: layout must be fp32_blocks, bf16_pairs or bf16_amx, got ", name);
  static const ExpertLinear fp32_linear("fp32_blocks"), bf16_linear("bf16_pairs"), bf16_amx("bf16_amx");
  const ExpertLinear& linear = name == "fp32_blocks" ? fp32_linear : name == "bf16_pairs" ? bf16_linear : bf16_amx;
  // int8 experts in bf16 on CPUs with AMX: the pairs kernel widens each int8 value in a register and multiplies by
  // vdpbf16ps, where bf16 experts run on tiles. An expert of INT8_TILE_ROWS rows or more has its int8 values
  // widened to bf16 (exactly) in their pair layout, which is the tiles' own, and its products run on tiles. A
  // 512-token prefill of a Qwen3-MoE (32 experts of 352, top 4) on a 2-core Xeon ran at 0.28x its bf16 experts'
  // before this; below the threshold the widening costs more than the tiles save.
  static const bool amx = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("pdserve::bf16_amx_supported", "")
                              .typed<bool()>()
                              .call();
  const bool int8_tiles = int8 && amx && name == "bf16_pairs" && x.scalar_type() == at::kBFloat16 &&
                          x.size(1) % 32 == 0 && inter % 32 == 0;
  const auto product = [&](const at::Tensor& rows, const at::Tensor& w, int64_t n,
                           const std::optional<at::Tensor>& bias) {
    if (int8_tiles && rows.size(0) >= INT8_TILE_ROWS) return bf16_amx(rows, w.to(at::kBFloat16), n);
    return linear(rows, w, n, bias);
  };
  const int64_t tokens = x.size(0), hidden = x.size(1), k = ids.size(1), experts = gate_up.size(0);
  const at::Tensor id = ids.to(at::kLong).contiguous();
  const int64_t* e_of = id.data_ptr<int64_t>();
  const int64_t pairs = tokens * k;
  // the (token, slot) pairs grouped by expert, in pair order within an expert: pair p = token * k + slot
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(e_of[p] >= 0 && e_of[p] < experts, "pdserve::moe_experts: expert id ", e_of[p], " out of [0, ",
                experts, ")");
    ++start[e_of[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> order(pairs);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[next[e_of[p]]++] = p;
  }
  const at::Tensor rows_all = x.contiguous();
  const at::Tensor flat_weights = weights.reshape({pairs}).contiguous();
  // each pair's weighted product, in the promoted dtype (transformers multiplies the expert's output, x's dtype,
  // by the routing weight)
  at::Tensor slots = at::empty({pairs, hidden}, x.options().dtype(at::result_type(x, weights)));
  static const auto silu_mul = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("pdserve::silu_mul", "")
                                   .typed<at::Tensor(const at::Tensor&)>();
  static const auto gpt_oss_gate = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("pdserve::gpt_oss_gate", "")
                                       .typed<at::Tensor(const at::Tensor&, double, double)>();
  const int64_t row_bytes = hidden * x.element_size();
  std::vector<int64_t> hit;  // the experts some pair chose
  for (int64_t e = 0; e < experts; ++e)
    if (start[e + 1] > start[e]) hit.push_back(e);
  // expert e's rows through gate|up, silu_mul and down, weighed into its pairs' slots (no other expert's)
  const auto run = [&](int64_t e) {
    const int64_t m = start[e + 1] - start[e];
    at::Tensor rows = at::empty({m, hidden}, x.options());
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(static_cast<char*>(rows.data_ptr()) + r * row_bytes,
                  static_cast<const char*>(rows_all.data_ptr()) + order[start[e] + r] / k * row_bytes, row_bytes);
    at::Tensor gu = product(rows, gate_up[e], 2 * inter, int8 ? std::nullopt : bias_of(gate_up_bias, e));
    if (int8) scale_columns(gu, (*gate_up_scale)[e], bias_of(gate_up_bias, e));
    const at::Tensor act = gpt_oss ? gpt_oss_gate.call(gu, alpha, limit) : silu_mul.call(gu);
    at::Tensor out = product(act, down[e], hidden, int8 ? std::nullopt : bias_of(down_bias, e));
    if (int8) scale_columns(out, (*down_scale)[e], bias_of(down_bias, e));
    weigh(out, flat_weights, order.data() + start[e], slots);
  };
  const int64_t n_hit = static_cast<int64_t>(hit.size());
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && n_hit >= 2 * threads && pairs <= WHOLE_EXPERTS_ROWS * n_hit) {
    // Decode-sized batches (at most WHOLE_EXPERTS_ROWS rows an expert on average, two experts a thread at least):
    // whole experts a thread, claimed as they come; each expert's products run on the thread that claimed it (the
    // kernels run inline inside a parallel region, parallel.h), where every product split over the threads is a
    // parallel region of its own, 64 a step for a one-stream Qwen3-MoE. Each output is computed by the same code
    // either way: the results do not change. Decode on a 2-core Xeon with AMX, one process alternating: Qwen3-MoE
    // (32 experts of 352, top 4) bf16 1.08x at one stream, 1.15x at 16; fp32 1.04x and 1.12x; Mixtral (8 of 704,
    // top 2) 1.07x and 1.04x at 16 streams, 0.93x at one stream with one expert a thread (so: two at least).
    pdserve::parallel_claim(n_hit, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) run(hit[i]);
    });
  } else {
    for (const int64_t e : hit) run(e);
  }
  at::Tensor y = at::empty({tokens, hidden}, x.options());
  const bool slots_f = slots.scalar_type() == at::kFloat, y_f = y.scalar_type() == at::kFloat;
  if (slots_f && y_f)
    sum_slots(slots.data_ptr<float>(), y.data_ptr<float>(), tokens, k, hidden);
  else if (slots_f)
    sum_slots(slots.data_ptr<float>(), y.data_ptr<c10::BFloat16>(), tokens, k, hidden);
  else
    sum_slots(slots.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), tokens, k, hidden);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, Tensor down, int inter, str layout, "
        "Tensor? gate_up_scale=None, Tensor? down_scale=None, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
        "str gate=\"silu\", float alpha=0., float limit=0.) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, TORCH_FN(moe_experts));
}
