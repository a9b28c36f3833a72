// bf16 linear layers for CPUs with AVX512-BF16, over weights packed in pairs.
//
// Packed layout: [N_pad / 16, K / 2, 16, 2] — for each block of 16 output features, each pair of input features
// is one 64-byte vector (16 outputs x 2 inputs), the operand of vdpbf16ps. A row of x then needs no
// horizontal sums: out[16 features] += W_pair_vector . broadcast(x pair). One row streams the weights once
// (decode of a lone stream: oneDNN's packed inner product read 20-26 GB/s here, this 30-34); several rows reuse
// each weight vector from registers (two blocks of features x 8 rows: 16 accumulators, 10 loads per 16
// instructions), which matched oneDNN from 16 to 512 rows on the machine it was written on.
// Accumulation in float; the output rounded once to bf16 (bias added in float first).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PDSERVE_BF16_LINEAR 1
#endif

namespace {

bool bf16_linear_supported() {
#ifdef PDSERVE_BF16_LINEAR
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16 (K even) -> [N_pad / 16, K / 2, 16, 2], N_pad = N rounded up to 32 (zero rows).
at::Tensor pack_bf16_pairs(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "pack_bf16_pairs takes a [N, K] bf16 CPU tensor");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 2 == 0, "pack_bf16_pairs needs an even number of input features, got ", k);
  const int64_t n_pad = (n + 31) / 32 * 32;
  at::Tensor padded = at::zeros({n_pad, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({n_pad / 16, 16, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#ifdef PDSERVE_BF16_LINEAR

// R rows of x against NB consecutive blocks of 16 features; stores columns [col, col + 16 * NB) of R output rows,
// masked past n.
template <int R, int NB>
inline void tile(const __m512i* w, int64_t kp_count, const uint32_t* x, int64_t x_stride, const float* bias,
                 c10::BFloat16* out, int64_t out_stride, int64_t col, int64_t n) {
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + b * kp_count + kp);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + kp]));
      for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], wv[b], xv);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t c = col + 16 * b;
    if (c >= n) break;
    const __mmask16 mask = n - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[b][r], bv));
      _mm256_mask_storeu_epi16(out + r * out_stride + c, mask, (__m256i)v);
    }
  }
}

// One row, one block: four accumulation chains (a lone row is latency-bound, not compute-bound).
inline void row_block(const __m512i* w, int64_t kp_count, const uint32_t* x, const float* bias, c10::BFloat16* out,
                      int64_t col, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t kp = 0;
  for (; kp + 4 <= kp_count; kp += 4) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + kp), (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp])));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + kp + 1),
                          (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp + 1])));
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + kp + 2),
                          (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp + 2])));
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + kp + 3),
                          (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp + 3])));
  }
  for (; kp < kp_count; ++kp)
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + kp), (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp])));
  if (col >= n) return;
  const __mmask16 mask = n - col >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - col)) - 1);
  __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
  if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias + col));
  _mm256_mask_storeu_epi16(out + col, mask, (__m256i)_mm512_cvtneps_pbh(sum));
}

#endif

// x [..., K] bf16, packed from pack_bf16_pairs, bias [N] (float or bf16) or None -> [..., N] bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n) {
#ifdef PDSERVE_BF16_LINEAR
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_linear takes bf16 CPU tensors, got x ", x.scalar_type(), " on ", x.device(), " and packed ",
              packed.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must come from pack_bf16_pairs");
  const int64_t k = x.size(-1), kp_count = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(k == 2 * kp_count && n <= blocks * 16 && blocks % 2 == 0, "bf16_linear: shapes do not match");
  const at::Tensor rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  at::Tensor fbias;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must have ", n, " elements");
    fbias = bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out.view(shape);
  const __m512i* w = reinterpret_cast<const __m512i*>(packed.data_ptr());
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(rows.data_ptr());
  const float* bp = fbias.defined() ? fbias.data_ptr<float>() : nullptr;
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t block_vectors = kp_count;  // 64-byte vectors per block of 16 features
  if (m == 1) {
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) row_block(w + b * block_vectors, kp_count, xr, bp, op, 16 * b, n);
    });
    return out.view(shape);
  }
  at::parallel_for(0, blocks / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const __m512i* wp = w + 2 * p * block_vectors;
      const int64_t col = 32 * p;
      if (col >= n) continue;
      int64_t r = 0;
      for (; r + 8 <= m; r += 8) tile<8, 2>(wp, kp_count, xr + r * kp_count, kp_count, bp, op + r * n, n, col, n);
      for (; r + 4 <= m; r += 4) tile<4, 2>(wp, kp_count, xr + r * kp_count, kp_count, bp, op + r * n, n, col, n);
      for (; r < m; ++r) tile<1, 2>(wp, kp_count, xr + r * kp_count, kp_count, bp, op + r * n, n, col, n);
    }
  });
  return out.view(shape);
#else
  TORCH_CHECK(false, "bf16_linear needs a build with AVX512-BF16 (see bf16_linear_supported)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("bf16_linear_supported() -> bool");
  m.impl("bf16_linear_supported", c10::DispatchKey::CatchAll, TORCH_FN(bf16_linear_supported));
  m.def("pack_bf16_pairs(Tensor w) -> Tensor");
  m.impl("pack_bf16_pairs", c10::DispatchKey::CPU, TORCH_FN(pack_bf16_pairs));
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
}
