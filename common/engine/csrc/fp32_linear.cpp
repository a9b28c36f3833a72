// fp32 linear layers for x86 CPUs with AVX2 and FMA (and wider tiles with AVX-512), over weights packed in
// blocks of 16 output features.
//
// Packed layout: [N_pad / 16, K, 16] — each block's 16 features side by side for every input, so one input
// feature is one 64-byte line (two AVX2 registers, one AVX-512 register) and a row of x needs no horizontal
// sums: out[16] += W[k] * broadcast(x[k]). Decode shapes (a few rows) are where oneDNN's packed fp32 inner
// product is weakest: on a 2-core Zen 3 VM (AVX2) the 60M model's linear layers ran 1.4-1.65x faster here at 1
// to 16 rows and even at 64; on a 2-core Xeon with AVX-512 1.1-1.6x at 1 to 16 rows.
// - One row: eight FMA chains over the block, streaming its weights once.
// - More rows: in groups of 64 (a group's x stays in L2 while the blocks' weights stream past), each block's
//   inputs in slices of kDepth (its weights stay in L1) under register tiles (AVX2: 6 rows x 1 block, AVX-512:
//   6 rows x 4 blocks); partial sums wait in a buffer between slices. On AVX2 at prefill sizes (128-2048 rows)
//   this ran at 0.8-1.0x oneDNN, and widening slices of columns for torch's GEMM did no better (the copy costs
//   10-15% at 256 rows with these models' small K); on AVX-512 the tiles ran at 0.75-0.85x there, so from 512
//   rows a slice of blocks is widened into w^T's columns for torch's GEMM (0.8-1.0x oneDNN, noisy VM).
// Blocks are handed out in chunks the threads claim as they come (parallel.h): a thread the OS preempts holds
// no share back.
// int8 weights (an int8 model's values in the same blocks, cpu_linear._int8_blocks) run the same loops, each
// weight widened to float in a register as it is loaded: the products and their order are those of the widened
// weight packed as floats, bit for bit, from a quarter of its bytes. The caller applies the scales.

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

constexpr int64_t kRowGroup = 64;  // rows whose partial sums one block keeps in its buffer
// Tiles inlined into their loops: compiled on their own, GCC kept their accumulators on the stack (1.5x slower).
#define PDSERVE_TILE inline __attribute__((always_inline))

#if defined(__AVX512F__)
constexpr int64_t kDepth = 128;  // inputs per slice: a tile's 4 blocks of weights take 32 KiB
// Rows from which the weights are widened, a slice of columns at a time, for torch's fp32 GEMM (which runs
// near the FLOP peak there): the tiles below reach 0.75-0.85x oneDNN at prefill sizes.
constexpr int64_t kWidenRows = 512;
// AVX-512: a block's 16 features are one register. Tiles cover R rows x B blocks (6 x 4: 24 accumulators; four
// weight loads and six broadcasts feed 24 multiply-adds), so the loads keep up with both FMA units.
constexpr int kTileRows = 6;
constexpr int kTileBlocks = 4;

// A block's 16 weights for one input, as floats.
PDSERVE_TILE __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
PDSERVE_TILE __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// R rows x B blocks over inputs [0, depth) of w (block b's slice at w + b * w_stride) and x (rows x_stride
// apart); each slice sums from zero, then adds to (or, when first, writes over) acc, block b's at
// acc + b * acc_stride, rows 16 apart: sums of K terms round as 256-term chains added up, not one long chain.
template <int R, int B, typename W>
PDSERVE_TILE void tile(const W* w, int64_t w_stride, int64_t depth, const float* x, int64_t x_stride, float* acc,
                 int64_t acc_stride, bool first) {
  __m512 a[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) a[b][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < depth; ++i) {
    __m512 wv[B];
    for (int b = 0; b < B; ++b) wv[b] = load16(w + b * w_stride + 16 * i);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * x_stride + i]);
      for (int b = 0; b < B; ++b) a[b][r] = _mm512_fmadd_ps(wv[b], xv, a[b][r]);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) {
      float* out = acc + b * acc_stride + 16 * r;
      _mm512_storeu_ps(out, first ? a[b][r] : _mm512_add_ps(_mm512_loadu_ps(out), a[b][r]));
    }
}

// One row against one block: eight chains, summed once.
template <typename W>
inline void row(const W* w, int64_t k, const float* x, float* acc) {
  __m512 a[8];
  for (auto& v : a) v = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int u = 0; u < 8; ++u) a[u] = _mm512_fmadd_ps(load16(w + 16 * (i + u)), _mm512_set1_ps(x[i + u]), a[u]);
  for (; i < k; ++i) a[0] = _mm512_fmadd_ps(load16(w + 16 * i), _mm512_set1_ps(x[i]), a[0]);
  const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                                 _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])));
  _mm512_storeu_ps(acc, s);
}
#else
constexpr int64_t kDepth = 256;  // inputs per slice: a block's slice of weights is 16 KiB
// On AVX2 CPUs the tiles ran at 0.8-1.0x oneDNN at prefill sizes and widening did no better (measured at 256 rows).
constexpr int64_t kWidenRows = INT64_MAX;
// AVX2: a block's 16 features are two registers; tiles of R rows x 1 block (12 accumulators at R = 6).
constexpr int kTileRows = 6;
constexpr int kTileBlocks = 1;

// 8 of a block's weights for one input, as floats.
PDSERVE_TILE __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
PDSERVE_TILE __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

template <int R, int B, typename W>
PDSERVE_TILE void tile(const W* w, int64_t, int64_t depth, const float* x, int64_t x_stride, float* acc, int64_t,
                 bool first) {
  static_assert(B == 1, "the AVX2 tiles cover one block");
  __m256 lo[R], hi[R];  // features 0-7 and 8-15 (two plain arrays: GCC keeps them in registers)
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < depth; ++i) {
    const __m256 w0 = load8(w + 16 * i), w1 = load8(w + 16 * i + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + i);
      lo[r] = _mm256_fmadd_ps(w0, xv, lo[r]);
      hi[r] = _mm256_fmadd_ps(w1, xv, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = acc + 16 * r;
    if (!first) {
      lo[r] = _mm256_add_ps(_mm256_loadu_ps(out), lo[r]);
      hi[r] = _mm256_add_ps(_mm256_loadu_ps(out + 8), hi[r]);
    }
    _mm256_storeu_ps(out, lo[r]);
    _mm256_storeu_ps(out + 8, hi[r]);
  }
}

// One row against one block: eight chains (four inputs a turn), summed once.
template <typename W>
inline void row(const W* w, int64_t k, const float* x, float* acc) {
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 4 <= k; i += 4) {
    for (int u = 0; u < 4; ++u) {
      const __m256 xv = _mm256_broadcast_ss(x + i + u);
      a[2 * u] = _mm256_fmadd_ps(load8(w + 16 * (i + u)), xv, a[2 * u]);
      a[2 * u + 1] = _mm256_fmadd_ps(load8(w + 16 * (i + u) + 8), xv, a[2 * u + 1]);
    }
  }
  for (; i < k; ++i) {
    const __m256 xv = _mm256_broadcast_ss(x + i);
    a[0] = _mm256_fmadd_ps(load8(w + 16 * i), xv, a[0]);
    a[1] = _mm256_fmadd_ps(load8(w + 16 * i + 8), xv, a[1]);
  }
  _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6])));
  _mm256_storeu_ps(acc + 8, _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7])));
}
#endif

// rows 1 to kTileRows - 1, left after the full tiles.
template <int B, int R = kTileRows - 1, typename W>
inline void tail_tile(int64_t rows, const W* w, int64_t w_stride, int64_t depth, const float* x, int64_t x_stride,
                      float* acc, int64_t acc_stride, bool first) {
  if constexpr (R >= 1) {
    if (rows == R) return tile<R, B>(w, w_stride, depth, x, x_stride, acc, acc_stride, first);
    tail_tile<B, R - 1>(rows, w, w_stride, depth, x, x_stride, acc, acc_stride, first);
  }
}

// rows x B blocks (block b of `blocks` starting at w, ws elements apart): all tiles over inputs [0, k) in slices
// of kDepth, sums in acc (block b's at acc + b * kRowGroup * 16).
template <int B, typename W>
inline void row_group(const W* w, int64_t ws, int64_t k, const float* x, int64_t rows, float* acc) {
  constexpr int64_t acc_stride = kRowGroup * 16;
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, k - k0);
    const float* xk = x + k0;
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows)
      tile<kTileRows, B>(w + 16 * k0, ws, depth, xk + r * k, k, acc + 16 * r, acc_stride, k0 == 0);
    tail_tile<B>(rows - r, w + 16 * k0, ws, depth, xk + r * k, k, acc + 16 * r, acc_stride, k0 == 0);
  }
}

// row_group over `blocks` (1 to kTileBlocks) blocks
template <int B = kTileBlocks, typename W>
inline void blocks_group(int64_t blocks, const W* w, int64_t ws, int64_t k, const float* x, int64_t rows,
                         float* acc) {
  if constexpr (B >= 1) {
    if (blocks == B) return row_group<B>(w, ws, k, x, rows, acc);
    blocks_group<B - 1>(blocks, w, ws, k, x, rows, acc);
  }
}

// Blocks [b0, b1) of w (ws elements apart), inputs [i0, i1), as floats into rows i0..i1 of a row-major
// [K, (b1 - b0) * 16] matrix.
template <typename W>
inline void unpack_blocks(const W* w, int64_t ws, int64_t b0, int64_t b1, int64_t i0, int64_t i1, float* out) {
  const int64_t stride = (b1 - b0) * 16;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t i = i0; i < i1; ++i) {
      const W* src = w + b * ws + i * 16;
      float* dst = out + i * stride + (b - b0) * 16;
      for (int j = 0; j < 16; ++j) dst[j] = static_cast<float>(src[j]);
    }
}

// The product over weights of type W (first input at w, blocks ws elements apart): one row, row groups under
// register tiles, or from kWidenRows rows widened slices through torch's GEMM.
template <typename W>
void blocked_product(pdserve::LinearCall& call, const W* w, int64_t ws, int64_t blocks, int64_t n) {
  const int64_t m = call.rows.size(0), k = call.rows.size(1);
  const float* xp = call.rows.data_ptr<float>();
  const float* bp = call.bias_ptr();
  float* op = call.out.data_ptr<float>();
  if (m == 1) {
    pdserve::parallel_claim(blocks, pdserve::claim_chunk(blocks, k * 16), [&](int64_t b0, int64_t b1) {
      alignas(64) float acc[16];
      for (int64_t b = b0; b < b1; ++b) {
        row(w + b * ws, k, xp, acc);
        pdserve::store_block(acc, 1, bp, op, n, 16 * b);
      }
    });
  } else if (m >= kWidenRows) {
    pdserve::widened_gemm(call, blocks, [&](int64_t b0, int64_t b1, void* dst) {
      float* wide = static_cast<float*>(dst);
      at::parallel_for(0, k, 16, [&](int64_t i0, int64_t i1) {  // 16 inputs a turn: a KiB read from each block
        for (int64_t i = i0; i < i1; i += 16) unpack_blocks(w, ws, b0, b1, i, std::min(i1, i + 16), wide);
      });
    });
  } else {
    // row groups outer: a group's rows of x (64 x K floats) stay in L2 while the blocks' weights stream past;
    // the threads claim tiles of kTileBlocks blocks
    const int64_t units = (blocks + kTileBlocks - 1) / kTileBlocks;
    for (int64_t r0 = 0; r0 < m; r0 += kRowGroup) {
      const int64_t rows_here = std::min(kRowGroup, m - r0);
      const int64_t unit_work = rows_here * k * 16 * kTileBlocks;
      pdserve::parallel_claim(units, pdserve::claim_chunk(units, unit_work), [&](int64_t u0, int64_t u1) {
        alignas(64) float acc[kTileBlocks * kRowGroup * 16];
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t b = u * kTileBlocks, here = std::min<int64_t>(kTileBlocks, blocks - b);
          blocks_group(here, w + b * ws, ws, k, xp + r0 * k, rows_here, acc);
          for (int64_t j = 0; j < here; ++j)
            pdserve::store_block(acc + j * kRowGroup * 16, rows_here, bp, op + r0 * n, n, 16 * (b + j));
        }
      });
    }
  }
}

#endif

// x [..., K] float, packed [N_pad / 16, K_all, 16] (float from pack_fp32_blocks, or int8 values in the same
// blocks), bias [N] float or None -> [..., N] float: x times the packed weight's inputs [k0, k0 + K).
at::Tensor fp32_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n, int64_t k0) {
#ifdef PDSERVE_FP32_LINEAR
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(x.scalar_type() == at::kFloat && (packed.scalar_type() == at::kFloat || int8) && x.device().is_cpu() &&
                  packed.device().is_cpu(),
              "fp32_linear takes a float32 x and a float32 or int8 packed weight on the CPU, got x ", x.scalar_type(),
              " on ", x.device(), " and packed ", packed.scalar_type(), " on ", packed.device());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous(),
              "packed must come from pack_fp32_blocks (or be int8 in its blocks), got shape ", packed.sizes());
  const int64_t k = x.size(-1), ws = packed.size(1) * 16;
  TORCH_CHECK(k0 >= 0 && k0 + k <= packed.size(1) && n <= packed.size(0) * 16 && n > packed.size(0) * 16 - 16,
              "fp32_linear: x has ", k, " input features from ", k0, " and n is ", n, ", packed is ",
              packed.sizes());
  pdserve::LinearCall call = pdserve::linear_call(x, bias, n);
  if (call.rows.size(0) == 0) return call.out.view(call.shape);
  if (int8)
    blocked_product(call, packed.data_ptr<int8_t>() + 16 * k0, ws, packed.size(0), n);
  else
    blocked_product(call, packed.data_ptr<float>() + 16 * k0, ws, packed.size(0), n);
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
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias, int n, int k0=0) -> Tensor");
  m.impl("fp32_linear", c10::DispatchKey::CPU, TORCH_FN(fp32_linear));
}
