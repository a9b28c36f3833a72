// bf16 linear layers for x86 CPUs, over weights packed in pairs: AVX512-BF16 where the CPU has it, else AVX2+FMA.
//
// Packed layout: [N_pad / 16, K / 2, 16, 2] — for each block of 16 output features, each pair of input features
// is one 64-byte vector (16 outputs x 2 inputs), the operand of vdpbf16ps. A row of x then needs no
// horizontal sums: out[16 features] += W_pair_vector . broadcast(x pair). One row streams the weights once
// (decode of a lone stream: oneDNN's packed inner product read 20-26 GB/s here, this 30-34); several rows reuse
// each weight vector from registers (two blocks of features x 8 rows: 16 accumulators, 10 loads per 16
// instructions), which matched oneDNN from 16 to 512 rows on the machine it was written on.
//
// AVX2 (no bf16 arithmetic): the same layout, read as two 32-byte halves of 8 features; a bf16 is the top half
// of a float, so a shift left by 16 gives the even inputs' weights and a mask the odd ones', each then one FMA
// against the broadcast float of x. Six rows at a time (12 accumulators, the 16-register file's fill), rows
// taken in chunks whose float copy stays in L2. There oneDNN has no bf16 kernel and torch falls back to a
// scalar loop (0.3-0.7 GFLOP/s on a 2-core Zen VM), so this is what makes a bf16 model usable on such CPUs.
// Accumulation in float; the output rounded once to bf16 (bias added in float first). CPUs with AMX run the same
// packing through AMX tiles instead (bf16_amx.cpp): there vdpbf16ps ran at half oneDNN's AMX speed from 16 rows.
//
// int8 weights (a bf16 model's int8 layers: torchao's values in the same pair layout, cpu_linear._int8_pairs) run
// the same loops, each pair vector widened in registers as it is loaded (int8 -> float -> bf16, exact: every int8
// is a bf16): half the bytes of a bf16 weight for the memory-bound rows of decoding. The caller applies the
// scales. V is the type of one pair vector in memory: __m512i (bf16, 64 bytes) or __m256i (int8, 32 bytes); the
// AVX2 path reads half-vectors, __m256i or __m128i.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "linear.h"
#include "parallel.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PDSERVE_BF16_LINEAR 1
#define PDSERVE_BF16_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_BF16_LINEAR 1
#define PDSERVE_BF16_AVX2 1
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
              "pack_bf16_pairs takes a [N, K] bf16 CPU tensor, got ", w.scalar_type(), " of shape ", w.sizes(),
              " on ", w.device());
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 2 == 0, "pack_bf16_pairs needs an even number of input features, got ", k);
  const int64_t n_pad = (n + 31) / 32 * 32;
  at::Tensor padded = at::zeros({n_pad, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({n_pad / 16, 16, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#ifdef PDSERVE_BF16_AVX512

// One pair vector (16 features x 2 inputs) as bf16.
inline __m512bh load_pairs(const __m512i* v) { return (__m512bh)_mm512_loadu_si512(v); }
inline __m512bh load_pairs(const __m256i* v) {
  const __m128i* p = reinterpret_cast<const __m128i*>(v);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
  // every int8 is exact in bf16: the floats' top halves, in order (lo's 16 values first)
  const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                             25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return (__m512bh)_mm512_permutex2var_epi16(_mm512_castps_si512(lo), odd_words, _mm512_castps_si512(hi));
}

// R rows of x against NB consecutive blocks of 16 features; stores columns [col, col + 16 * NB) of R output rows,
// masked past n.
template <int R, int NB, typename V>
inline void tile(const V* w, int64_t kp_count, const uint32_t* x, int64_t x_stride, const float* bias,
                 c10::BFloat16* out, int64_t out_stride, int64_t col, int64_t n) {
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = load_pairs(w + b * kp_count + kp);
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
template <typename V>
inline void row_block(const V* w, int64_t kp_count, const uint32_t* x, const float* bias, c10::BFloat16* out,
                      int64_t col, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t kp = 0;
  for (; kp + 4 <= kp_count; kp += 4) {
    a0 = _mm512_dpbf16_ps(a0, load_pairs(w + kp), (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp])));
    a1 = _mm512_dpbf16_ps(a1, load_pairs(w + kp + 1), (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp + 1])));
    a2 = _mm512_dpbf16_ps(a2, load_pairs(w + kp + 2), (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp + 2])));
    a3 = _mm512_dpbf16_ps(a3, load_pairs(w + kp + 3), (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp + 3])));
  }
  for (; kp < kp_count; ++kp)
    a0 = _mm512_dpbf16_ps(a0, load_pairs(w + kp), (__m512bh)_mm512_set1_epi32(static_cast<int>(x[kp])));
  if (col >= n) return;
  const __mmask16 mask = n - col >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - col)) - 1);
  __m512 sum = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
  if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias + col));
  _mm256_mask_storeu_epi16(out + col, mask, (__m256i)_mm512_cvtneps_pbh(sum));
}

#endif

#ifdef PDSERVE_BF16_AVX2

// Rows from which linear_avx2 widens the weight and runs torch's fp32 GEMM: at 128 rows about even with the
// register tiles on a Zen 3 VM, from 256 up 1.1-1.4x faster (within 0.9x of fp32 oneDNN; the tiles: 0.6-0.7x).
constexpr int64_t kUnpackRows = 128;

// The even-input weights of one 8-feature half of a pair vector as floats (bf16 bits shifted into place), and the
// odd-input ones (bf16 bits already on top: mask off the even).
inline __m256 even_weights(const __m256i* v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(v), 16));
}
inline __m256 odd_weights(const __m256i* v, __m256i high) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(v), high));
}
// The same from an int8 half-vector (8 features x 2 inputs, 16 bytes): sign-extended to 16-bit pairs, each pair
// one 32-bit lane whose low half is the even input's value and high half the odd one's.
inline __m256 even_weights(const __m128i* v) {
  const __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128(v));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(pairs, 16), 16));
}
inline __m256 odd_weights(const __m128i* v, __m256i) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128(v)), 16));
}

// R rows of float x against one block of 16 features (w: the block's first half-vector, two per pair);
// writes the R x 16 float sums to acc_out.
template <int R, typename V>
inline void tile_avx2(const V* w, int64_t kp_count, const float* x, int64_t x_stride, float* acc_out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    const V* v = w + 2 * kp;
    __m256 w0 = even_weights(v), w1 = even_weights(v + 1);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + 2 * kp);
      acc[0][r] = _mm256_fmadd_ps(w0, xv, acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(w1, xv, acc[1][r]);
    }
    w0 = odd_weights(v, high);
    w1 = odd_weights(v + 1, high);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + 2 * kp + 1);
      acc[0][r] = _mm256_fmadd_ps(w0, xv, acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(w1, xv, acc[1][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc_out + 16 * r, acc[0][r]);
    _mm256_storeu_ps(acc_out + 16 * r + 8, acc[1][r]);
  }
}

// One row against one block: even and odd inputs in separate chains, two pairs a turn (eight chains: a lone row
// is bound by FMA latency and memory, not FMA throughput).
template <typename V>
inline void row_avx2(const V* w, int64_t kp_count, const float* x, float* acc_out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  int64_t kp = 0;
  for (; kp + 2 <= kp_count; kp += 2) {
    for (int u = 0; u < 2; ++u) {
      const V* v = w + 2 * (kp + u);
      const __m256 xe = _mm256_broadcast_ss(x + 2 * (kp + u)), xo = _mm256_broadcast_ss(x + 2 * (kp + u) + 1);
      a[4 * u + 0] = _mm256_fmadd_ps(even_weights(v), xe, a[4 * u + 0]);
      a[4 * u + 1] = _mm256_fmadd_ps(even_weights(v + 1), xe, a[4 * u + 1]);
      a[4 * u + 2] = _mm256_fmadd_ps(odd_weights(v, high), xo, a[4 * u + 2]);
      a[4 * u + 3] = _mm256_fmadd_ps(odd_weights(v + 1, high), xo, a[4 * u + 3]);
    }
  }
  for (; kp < kp_count; ++kp) {
    const V* v = w + 2 * kp;
    const __m256 xe = _mm256_broadcast_ss(x + 2 * kp), xo = _mm256_broadcast_ss(x + 2 * kp + 1);
    a[0] = _mm256_fmadd_ps(even_weights(v), xe, a[0]);
    a[1] = _mm256_fmadd_ps(even_weights(v + 1), xe, a[1]);
    a[2] = _mm256_fmadd_ps(odd_weights(v, high), xo, a[2]);
    a[3] = _mm256_fmadd_ps(odd_weights(v + 1, high), xo, a[3]);
  }
  const __m256 lo = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6]));
  const __m256 hi = _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7]));
  _mm256_storeu_ps(acc_out, lo);
  _mm256_storeu_ps(acc_out + 8, hi);
}

template <int R, typename V>
inline void rows_avx2(const V* w, int64_t kp_count, const float* x, int64_t k, const float* bias,
                      c10::BFloat16* out, int64_t n, int64_t col) {
  alignas(32) float acc[16 * R];
  tile_avx2<R>(w, kp_count, x, k, acc);
  pdserve::store_block(acc, R, bias, out, n, col);
}

// Columns [c0, c1) of the packed weight as floats laid out [K, c1 - c0] (c0 a multiple of 16; the last block may
// run past c1 into zero padding, which is not written).
template <typename V>
void unpack_float(const V* w, int64_t kp_count, int64_t c0, int64_t c1, float* dst) {
  const int64_t width = c1 - c0;
  const int64_t first = c0 / 16, last = (c1 + 15) / 16;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  at::parallel_for(first, last, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = 16 * b - c0, cols = std::min<int64_t>(16, width - j0);
      const V* wb = w + 2 * b * kp_count;
      for (int64_t kp = 0; kp < kp_count; ++kp) {
        float* even = dst + 2 * kp * width + j0;
        float* odd = even + width;
        alignas(32) float e[16], o[16];
        _mm256_store_ps(e, even_weights(wb + 2 * kp));
        _mm256_store_ps(e + 8, even_weights(wb + 2 * kp + 1));
        _mm256_store_ps(o, odd_weights(wb + 2 * kp, high));
        _mm256_store_ps(o + 8, odd_weights(wb + 2 * kp + 1, high));
        if (cols == 16) {
          std::memcpy(even, e, sizeof e);
          std::memcpy(odd, o, sizeof o);
        } else {
          std::memcpy(even, e, cols * sizeof(float));
          std::memcpy(odd, o, cols * sizeof(float));
        }
      }
    }
  });
}

template <typename V>
void linear_avx2(const at::Tensor& rows, const V* w, int64_t kp_count, const float* bias, at::Tensor& out) {
  const at::Tensor xf = rows.to(at::kFloat);  // bf16 -> float once, not per broadcast
  const float* x = xf.data_ptr<float>();
  const int64_t m = rows.size(0), k = rows.size(1), n = out.size(1);
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  if (m >= kUnpackRows) {
    // Many rows (prefill): widen a slice of columns to float and let torch's fp32 GEMM run it; widening costs
    // 1 / (2 m) of the slice's FLOPs in bytes written, and the GEMM runs near the machine's fp32 peak.
    const int64_t slice = std::max<int64_t>(16, (4 << 20) / (4 * k) / 16 * 16);  // ~4 MiB of floats
    at::Tensor wf = at::empty({k, std::min(slice, n)}, xf.options());
    for (int64_t c0 = 0; c0 < n; c0 += slice) {
      const int64_t c1 = std::min(n, c0 + slice);
      at::Tensor wslice = wf.narrow(1, 0, c1 - c0);
      if (c1 - c0 != wf.size(1)) wslice = at::empty({k, c1 - c0}, xf.options());
      unpack_float(w, kp_count, c0, c1, wslice.data_ptr<float>());
      at::Tensor prod = at::mm(xf, wslice);
      if (bias) prod.add_(at::from_blob(const_cast<float*>(bias) + c0, {c1 - c0}, xf.options()));
      out.narrow(1, c0, c1 - c0).copy_(prod);
    }
    return;
  }
  const int64_t used_blocks = (n + 15) / 16;  // the padding blocks past n hold zeros
  if (m == 1) {
    pdserve::parallel_claim(used_blocks, pdserve::claim_chunk(used_blocks, k * 16), [&](int64_t b0, int64_t b1) {
      alignas(32) float acc[16];
      for (int64_t b = b0; b < b1; ++b) {
        row_avx2(w + 2 * b * kp_count, kp_count, x, acc);
        pdserve::store_block(acc, 1, bias, op, n, 16 * b);
      }
    });
    return;
  }
  // Rows in chunks whose float copy (chunk x k x 4 bytes) stays near 192 KiB, in L2 while every block passes.
  const int64_t chunk = std::max<int64_t>(6, (192 * 1024 / (4 * k)) / 6 * 6);
  for (int64_t r0 = 0; r0 < m; r0 += chunk) {
    const int64_t r1 = std::min(m, r0 + chunk);
    const int64_t claim = pdserve::claim_chunk(used_blocks, (r1 - r0) * k * 16);
    pdserve::parallel_claim(used_blocks, claim, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const V* wb = w + 2 * b * kp_count;
        int64_t r = r0;
        for (; r + 6 <= r1; r += 6) rows_avx2<6>(wb, kp_count, x + r * k, k, bias, op + r * n, n, 16 * b);
        switch (r1 - r) {
          case 5: rows_avx2<5>(wb, kp_count, x + r * k, k, bias, op + r * n, n, 16 * b); break;
          case 4: rows_avx2<4>(wb, kp_count, x + r * k, k, bias, op + r * n, n, 16 * b); break;
          case 3: rows_avx2<3>(wb, kp_count, x + r * k, k, bias, op + r * n, n, 16 * b); break;
          case 2: rows_avx2<2>(wb, kp_count, x + r * k, k, bias, op + r * n, n, 16 * b); break;
          case 1: rows_avx2<1>(wb, kp_count, x + r * k, k, bias, op + r * n, n, 16 * b); break;
          default: break;
        }
      }
    });
  }
}

#endif

#ifdef PDSERVE_BF16_AVX512

template <typename V>
void linear_avx512(const at::Tensor& rows, const V* w, int64_t kp_count, int64_t blocks, const float* bias,
                   c10::BFloat16* op, int64_t n) {
  const int64_t m = rows.size(0);
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(rows.data_ptr());
  if (m == 1) {
    pdserve::parallel_claim(blocks, pdserve::claim_chunk(blocks, kp_count * 32), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) row_block(w + b * kp_count, kp_count, xr, bias, op, 16 * b, n);
    });
    return;
  }
  pdserve::parallel_claim(blocks / 2, pdserve::claim_chunk(blocks / 2, m * kp_count * 64), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const V* wp = w + 2 * p * kp_count;
      const int64_t col = 32 * p;
      if (col >= n) continue;
      int64_t r = 0;
      for (; r + 8 <= m; r += 8) tile<8, 2>(wp, kp_count, xr + r * kp_count, kp_count, bias, op + r * n, n, col, n);
      for (; r + 4 <= m; r += 4) tile<4, 2>(wp, kp_count, xr + r * kp_count, kp_count, bias, op + r * n, n, col, n);
      for (; r < m; ++r) tile<1, 2>(wp, kp_count, xr + r * kp_count, kp_count, bias, op + r * n, n, col, n);
    }
  });
}

#endif

// x [..., K] bf16, packed from pack_bf16_pairs (or int8 values in its layout), bias [N] (float or bf16) or None
// -> [..., N] bf16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n) {
#ifdef PDSERVE_BF16_LINEAR
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && (packed.scalar_type() == at::kBFloat16 || int8) &&
                  x.device().is_cpu() && packed.device().is_cpu(),
              "bf16_linear takes a bf16 x and a bf16 or int8 packed weight on the CPU, got x ", x.scalar_type(),
              " on ", x.device(), " and packed ", packed.scalar_type(), " on ", packed.device());
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must come from pack_bf16_pairs (or be int8 in its layout), got shape ", packed.sizes());
  const int64_t k = x.size(-1), kp_count = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(k == 2 * kp_count && n <= blocks * 16 && blocks % 2 == 0, "bf16_linear: x has ", k,
              " input features and n is ", n, ", packed is ", packed.sizes());
  pdserve::LinearCall call = pdserve::linear_call(x, bias, n);
  if (call.rows.size(0) == 0) return call.out.view(call.shape);
#ifdef PDSERVE_BF16_AVX512
  c10::BFloat16* op = call.out.data_ptr<c10::BFloat16>();
  if (int8)
    linear_avx512(call.rows, static_cast<const __m256i*>(packed.data_ptr()), kp_count, blocks, call.bias_ptr(), op, n);
  else
    linear_avx512(call.rows, static_cast<const __m512i*>(packed.data_ptr()), kp_count, blocks, call.bias_ptr(), op, n);
#else
  if (int8)
    linear_avx2(call.rows, static_cast<const __m128i*>(packed.data_ptr()), kp_count, call.bias_ptr(), call.out);
  else
    linear_avx2(call.rows, static_cast<const __m256i*>(packed.data_ptr()), kp_count, call.bias_ptr(), call.out);
#endif
  return call.out.view(call.shape);
#else
  TORCH_CHECK(false, "bf16_linear needs a build with AVX512-BF16 or AVX2 and FMA (see bf16_linear_supported)");
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
