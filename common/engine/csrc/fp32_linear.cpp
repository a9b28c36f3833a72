// fp32 linear layers for x86 CPUs with AVX2 and FMA, over weights packed in blocks of 16 output features.
//
// Packed layout: [N_pad / 16, K, 16] — each block's 16 features side by side for every input, so one input
// feature is two 32-byte vectors and a row of x needs no horizontal sums: out[16] += W[k] * broadcast(x[k]).
// Decode shapes (a few rows) are where oneDNN's packed fp32 inner product is weakest on AVX2-only CPUs: on a
// 2-core Zen 3 VM the 60M model's linear layers ran 1.4-1.65x faster here at 1 to 16 rows and even at 64.
// - One row: eight FMA chains over the block, streaming its weights once.
// - More rows: in groups of 64 (a group's x stays in L2 while the blocks' weights stream past), each block's
//   inputs in slices of 256 (16 KiB of weights, in L1) under tiles of 6 rows x 16 features (12 accumulators);
//   partial sums wait in a 4 KiB buffer between slices. At prefill sizes (128-2048 rows) this ran at
//   0.8-1.0x oneDNN there: widening slices of columns for torch's GEMM did no better (the copy costs 10-15%
//   at 256 rows with these models' small K).
// The engine uses it only on CPUs without AVX-512, where oneDNN has its own wider kernels. Blocks are handed
// out in chunks the threads claim as they come (parallel.h): a thread the OS preempts holds no share back.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_FP32_LINEAR 1
#endif

namespace {

bool fp32_linear_supported() {
#ifdef PDSERVE_FP32_LINEAR
  return true;
#else
  return false;
#endif
}

// w [N, K] float -> [N_pad / 16, K, 16], N_pad = N rounded up to 16 (zero rows).
at::Tensor pack_fp32_blocks(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack_fp32_blocks takes a [N, K] float32 CPU tensor, got ", w.scalar_type(), " of shape ", w.sizes(),
              " on ", w.device());
  const int64_t n = w.size(0), k = w.size(1), n_pad = (n + 15) / 16 * 16;
  at::Tensor padded = at::zeros({n_pad, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({n_pad / 16, 16, k}).permute({0, 2, 1}).contiguous();
}

#ifdef PDSERVE_FP32_LINEAR

constexpr int64_t kRowGroup = 64;   // rows whose partial sums one block keeps in its buffer
constexpr int64_t kDepth = 256;     // inputs per slice: a block's slice of weights is 16 KiB

// R rows x 16 features over inputs [0, depth) of w (the block's slice) and x (rows x_stride apart); sums
// added to (or, when first, written over) acc, R rows 16 apart.
template <int R>
inline void tile(const float* w, int64_t depth, const float* x, int64_t x_stride, float* acc, bool first) {
  __m256 a[2][R];
  for (int r = 0; r < R; ++r) {
    a[0][r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + 16 * r);
    a[1][r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + 16 * r + 8);
  }
  for (int64_t i = 0; i < depth; ++i) {
    const __m256 w0 = _mm256_loadu_ps(w + 16 * i), w1 = _mm256_loadu_ps(w + 16 * i + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + i);
      a[0][r] = _mm256_fmadd_ps(w0, xv, a[0][r]);
      a[1][r] = _mm256_fmadd_ps(w1, xv, a[1][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + 16 * r, a[0][r]);
    _mm256_storeu_ps(acc + 16 * r + 8, a[1][r]);
  }
}

// rows (1 to 5) left after the tiles of 6.
inline void tail_tile(int64_t rows, const float* w, int64_t depth, const float* x, int64_t x_stride, float* acc,
                      bool first) {
  switch (rows) {
    case 5: tile<5>(w, depth, x, x_stride, acc, first); break;
    case 4: tile<4>(w, depth, x, x_stride, acc, first); break;
    case 3: tile<3>(w, depth, x, x_stride, acc, first); break;
    case 2: tile<2>(w, depth, x, x_stride, acc, first); break;
    case 1: tile<1>(w, depth, x, x_stride, acc, first); break;
    default: break;
  }
}

// One row against one block: eight chains (four inputs a turn), summed once.
inline void row(const float* w, int64_t k, const float* x, float* acc) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 4 <= k; i += 4) {
    for (int u = 0; u < 4; ++u) {
      const __m256 xv = _mm256_broadcast_ss(x + i + u);
      a[2 * u] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 16 * (i + u)), xv, a[2 * u]);
      a[2 * u + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 16 * (i + u) + 8), xv, a[2 * u + 1]);
    }
  }
  for (; i < k; ++i) {
    const __m256 xv = _mm256_broadcast_ss(x + i);
    a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 16 * i), xv, a[0]);
    a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 16 * i + 8), xv, a[1]);
  }
  _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6])));
  _mm256_storeu_ps(acc + 8, _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7])));
}

// rows x 16 sums (16 apart) -> output columns [col, min(col + 16, n)), bias added.
inline void store(const float* acc, int64_t rows, const float* bias, float* out, int64_t n, int64_t col) {
  const int64_t width = std::min<int64_t>(16, n - col);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) out[r * n + col + j] = acc[16 * r + j] + (bias ? bias[col + j] : 0.f);
}

#endif

// x [..., K] float, packed from pack_fp32_blocks, bias [N] float or None -> [..., N] float.
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n) {
#ifdef PDSERVE_FP32_LINEAR
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && x.device().is_cpu(),
              "fp32_linear takes float32 CPU tensors, got x ", x.scalar_type(), " on ", x.device(), " and packed ",
              packed.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous(),
              "packed must come from pack_fp32_blocks, got shape ", packed.sizes());
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.size(1) == k && n <= packed.size(0) * 16 && n > packed.size(0) * 16 - 16,
              "fp32_linear: x has ", k, " input features and n is ", n, ", packed is ", packed.sizes());
  pdserve::LinearCall call = pdserve::linear_call(x, bias, n);
  const int64_t m = call.rows.size(0);
  if (m == 0) return call.out.view(call.shape);
  const float* w = packed.data_ptr<float>();
  const float* xp = call.rows.data_ptr<float>();
  const float* bp = call.bias_ptr();
  float* op = call.out.data_ptr<float>();
  const int64_t blocks = packed.size(0);
  if (m == 1) {
    pdserve::parallel_claim(blocks, pdserve::claim_chunk(blocks, k * 16), [&](int64_t b0, int64_t b1) {
      alignas(32) float acc[16];
      for (int64_t b = b0; b < b1; ++b) {
        row(w + b * k * 16, k, xp, acc);
        store(acc, 1, bp, op, n, 16 * b);
      }
    });
  } else {
    // row groups outer: a group's rows of x (64 x K floats) stay in L2 while the blocks' weights stream past
    for (int64_t r0 = 0; r0 < m; r0 += kRowGroup) {
      const int64_t rows_here = std::min(kRowGroup, m - r0);
      pdserve::parallel_claim(blocks, pdserve::claim_chunk(blocks, rows_here * k * 16), [&](int64_t b0, int64_t b1) {
        alignas(32) float acc[kRowGroup * 16];
        for (int64_t b = b0; b < b1; ++b) {
          const float* wb = w + b * k * 16;
          for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
            const int64_t depth = std::min(kDepth, k - k0);
            const float* xk = xp + r0 * k + k0;
            int64_t r = 0;
            for (; r + 6 <= rows_here; r += 6) tile<6>(wb + 16 * k0, depth, xk + r * k, k, acc + 16 * r, k0 == 0);
            tail_tile(rows_here - r, wb + 16 * k0, depth, xk + r * k, k, acc + 16 * r, k0 == 0);
          }
          store(acc, rows_here, bp, op + r0 * n, n, 16 * b);
        }
      });
    }
  }
  return call.out.view(call.shape);
#else
  TORCH_CHECK(false, "fp32_linear needs a build with AVX2 and FMA (see fp32_linear_supported)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("fp32_linear_supported() -> bool");
  m.impl("fp32_linear_supported", c10::DispatchKey::CatchAll, TORCH_FN(fp32_linear_supported));
  m.def("pack_fp32_blocks(Tensor w) -> Tensor");
  m.impl("pack_fp32_blocks", c10::DispatchKey::CPU, TORCH_FN(pack_fp32_blocks));
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("fp32_linear", c10::DispatchKey::CPU, TORCH_FN(fp32_linear));
}
