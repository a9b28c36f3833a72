// Causal attention of a prefill step's sequences on the CPU: flash attention in bf16 (vdpbf16ps products, CPUs with
// AVX512-BF16; AMX tiles on CPUs with AMX-BF16, head dims multiples of 32 up to 256: see "bf16 on CPUs with AMX"
// below) or fp32 (FMAs, CPUs with AVX-512), or both in float on CPUs with AVX2 and FMA alone (see "AVX2" below), for whole prompts
// over their own keys (prefill_attention) and for chunks continuing their sequences over keys read from the paged
// cache (paged_prefill_attention).
//
// torch's CPU flash attention runs at ~120 GFLOP/s in bf16 on a 2-core Zen 4 VM whose bf16 matmul reaches ~435
// (2,048 tokens, 16 heads of 64 over 8 KV heads: 71 ms a layer, a third of a 0.35B model's prefill), and a
// continuing chunk's keys were gathered, padded and masked. Here:
//
// - Each (sequence, KV head) is packed once, for every query head of its group, in 32-bit units (a bf16 pair or
//   a float): K as [key block][unit of the head dim][64 keys] (a score vector is 16 keys, summed over the head's
//   units with the query's unit broadcast), V as [key block][unit of keys][dim] (an output vector is 16 dims,
//   summed over the keys with their probabilities broadcast). Keys past the sequence are zeros.
// - Work items are (sequence, query head, block of 64 query rows), the costliest (most keys) first, claimed by
//   the threads as they come (parallel.h). An item walks its key blocks once: per group of 4 rows, the 4 x 64
//   scores in 16 registers, the online softmax in float (exp2 with the scale folded in, running sums kept as
//   vectors), the probabilities (in bf16: rounded to bf16, as torch's flash attention does for its matmul)
//   summed into the rows' float outputs straight away, while they are in L1. Masks only where a key block
//   crosses the diagonal (or a sliding window's edge).
//
// q: [tokens, query heads, head_dim] with unit stride in head_dim (the step's fused q|k|v product, read in place);
// out: the same shape.
//
// Logit extras, as the decode kernel (paged_attention.cpp) computes them: a soft cap (Gemma 2: each scaled score s
// becomes cap * tanh(s / cap), tanh from the kernels' exp2) and sink logits (GPT-OSS: one per query head, a column
// of the softmax that weighs no value: a row's running maximum starts at its sink and its sum at 1). The AMX path
// computes both too (see amx_item).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#define PDSERVE_PREFILL_KERNEL 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_PREFILL_KERNEL 1
#define PDSERVE_PREFILL_AVX2 1  // both dtypes in float: see "AVX2" below
#endif

#if defined(PDSERVE_PREFILL_KERNEL)
#include <immintrin.h>
#endif

#include "amx.h"
#include "bf16.h"

#if defined(PDSERVE_AMX) && defined(__AVX512BF16__)
#define PDSERVE_AMX_ATTENTION 1
#endif

namespace {

constexpr int64_t BK = 64;   // keys a block
constexpr int64_t BQ = 64;   // query rows a work item
constexpr int RS = 4;        // rows a register block
constexpr int64_t MAX_DIM = 256;

bool prefill_attention_supported(c10::ScalarType dtype) {
#if defined(__AVX512BF16__) || defined(PDSERVE_PREFILL_AVX2)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(PDSERVE_PREFILL_KERNEL)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

// The logit extras of a call: a soft cap (0: none) and sink logits ([query heads] float, or none).
struct Extras {
  double softcap = 0.;
  const float* sinks = nullptr;
};

// A sequence of a call: queries at rows [t0, t0 + n) of q and out, at positions [pos0, pos0 + n); keys [0, pos0 + n).
struct Seq {
  int64_t t0, pos0, n;
};

#if defined(PDSERVE_PREFILL_KERNEL)

constexpr float NEG = -1e30f;  // a finite "minus infinity": a row with no key yet never computes inf - inf

#if defined(__AVX512F__)
// 2^x for x <= 0: Taylor of 2^r on |r| <= 1/2, degree 5 for bf16 (relative error ~2e-6, far below the rounding of
// the probabilities), 6 for fp32 (~1.2e-7); scalef takes n down to 0 without overflow tricks.
template <bool FINE>
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  if constexpr (FINE) p = _mm512_fmadd_ps(_mm512_set1_ps(1.5403530393e-4f), r, p);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// Elements per 32-bit unit of the packed layouts: a bf16 pair, or a float (bf16 widened to float on AVX2).
#if defined(PDSERVE_PREFILL_AVX2)
constexpr bool WIDEN_BF16 = true;
#else
constexpr bool WIDEN_BF16 = false;
#endif
template <typename T>
constexpr int64_t PER = std::is_same_v<T, float> || WIDEN_BF16 ? 1 : 2;

// Unit u of a row: elements PER * u.. as they are, or a bf16 element widened to the bits of its float.
template <typename T>
inline uint32_t unit_at(const T* row, int64_t u) {
  if constexpr (!std::is_same_v<T, float> && WIDEN_BF16) {
    uint16_t b;
    std::memcpy(&b, row + u, sizeof b);
    return static_cast<uint32_t>(b) << 16;
  }
  uint32_t x;
  std::memcpy(&x, row + PER<T> * u, sizeof x);
  return x;
}

#if defined(__AVX512F__)
// acc += a . b over one 32-bit unit per lane: vdpbf16ps (two bf16 products a lane) or an FMA
template <typename T>
inline __m512 unit_fma(__m512 acc, __m512i a, __m512i b) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  } else {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    static_assert(std::is_same_v<T, float>, "bf16 needs AVX512-BF16");
    return acc;
#endif
  }
}
#endif  // __AVX512F__

template <typename T>
struct Layout {
  const T* q;
  T* out;
  int64_t q_s0, q_s1, o_s0, o_s1;
  int64_t q_heads, kv_heads, dim;
  float scale_log2;  // scale * log2(e)
  int64_t window;    // 0: none
  float cap_log2;        // soft cap * log2(e); 0: none
  float scale_over_cap;  // scale / soft cap
  const float* sinks;    // [q_heads] sink logits (natural units), or nullptr
  // a row's softmax before its first key: its sink in log2 units (the maximum), or none yet
  float start_log2(int64_t h) const { return sinks != nullptr ? sinks[h] * 1.4426950408889634f : NEG; }
};

// The keys [0, len) of one (sequence, KV head), whose K and V rows key_row(j) and value_row(j) give, into kp
// ([blocks][dim / PER][BK] units) and vp ([blocks][BK / PER][dim] units), zero past len.
template <typename T, typename KeyRow, typename ValueRow>
void pack_kv(int64_t len, int64_t dim, const KeyRow& key_row, const ValueRow& value_row, uint32_t* kp, uint32_t* vp) {
  constexpr int64_t per = PER<T>;
  const int64_t blocks = (len + BK - 1) / BK, units = dim / per;
  std::memset(kp, 0, sizeof(uint32_t) * blocks * units * BK);
  std::memset(vp, 0, sizeof(uint32_t) * blocks * (BK / per) * dim);
  for (int64_t j = 0; j < len; ++j) {
    const T* krow = key_row(j);
    uint32_t* dst = kp + (j / BK) * units * BK + j % BK;
    for (int64_t u = 0; u < units; ++u) dst[u * BK] = unit_at(krow, u);
  }
  for (int64_t j = 0; j < len; ++j) {
    const T* vrow = value_row(j);
    if constexpr (per == 1) {
      uint32_t* dst = vp + j * dim;  // [block][key][dim]: keys one after the other
      for (int64_t d = 0; d < dim; ++d) dst[d] = unit_at(vrow, d);
    } else {
      T* dst = reinterpret_cast<T*>(vp + (j / BK) * (BK / per) * dim + (j % BK) / per * dim) + (j % per);
      for (int64_t d = 0; d < dim; ++d) dst[per * d] = vrow[d];
    }
  }
}

#if defined(__AVX512F__)

// tanh(y) as (1 - e) / (1 + e), e = 2^(-2|y| log2(e)), with y's sign: the decode kernel's tanh_of (exp.h), 16 lanes.
inline __m512 tanh16(__m512 y) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 a = _mm512_andnot_ps(sign, y);
  const __m512 e = exp2_nonpositive<true>(_mm512_mul_ps(a, _mm512_set1_ps(-2.8853900817779268f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  return _mm512_or_ps(t, _mm512_and_ps(y, sign));
}

// Scores of R rows (q rows given) against the 64 keys of one packed block: s[r][c] covers keys 16c..16c+15.
template <typename T, int R>
inline void score_block(__m512 (&s)[RS][4], const T* const* qrows, const uint32_t* kb, int64_t units) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; ++u) {  // each key vector loaded once for the R rows (loaded per row, 20% slower)
    const uint32_t* kpu = kb + u * BK;
    __m512i qu[RS];
    for (int r = 0; r < R; ++r) qu[r] = _mm512_set1_epi32(static_cast<int>(unit_at(qrows[r], u)));
    for (int c = 0; c < 4; ++c) {
      const __m512i kc = _mm512_loadu_si512(kpu + 16 * c);
      for (int r = 0; r < R; ++r) s[r][c] = unit_fma<T>(s[r][c], qu[r], kc);
    }
  }
}

// o[r][16 (c0 + c)..] = o * alpha[r] + sum over the block's keys of P[r][key] V[key], NC vectors of dims; prob:
// [R][BK / PER] units of the rows' probabilities.
template <typename T, int R, int NC>
inline void weigh_block(float* o, int64_t dim, const float* alpha, const uint32_t* prob, const uint32_t* vb,
                        int64_t c0) {
  constexpr int64_t units = BK / PER<T>;
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + 16 * (c0 + c)), a);
  }
  for (int64_t ju = 0; ju < units; ++ju) {
    __m512i pu[R];
    for (int r = 0; r < R; ++r) pu[r] = _mm512_set1_epi32(static_cast<int>(prob[r * units + ju]));
    for (int c = 0; c < NC; ++c) {
      const __m512i vc = _mm512_loadu_si512(vb + ju * dim + 16 * (c0 + c));
      for (int r = 0; r < R; ++r) acc[r][c] = unit_fma<T>(acc[r][c], pu[r], vc);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * dim + 16 * (c0 + c), acc[r][c]);
}

template <typename T, int R>
inline void weigh_rows(float* o, int64_t dim, const float* alpha, const uint32_t* prob, const uint32_t* vb) {
  const int64_t nv = dim / 16;
  int64_t c0 = 0;
  for (; c0 + 4 <= nv; c0 += 4) weigh_block<T, R, 4>(o, dim, alpha, prob, vb, c0);
  switch (nv - c0) {
    case 3: weigh_block<T, R, 3>(o, dim, alpha, prob, vb, c0); break;
    case 2: weigh_block<T, R, 2>(o, dim, alpha, prob, vb, c0); break;
    case 1: weigh_block<T, R, 1>(o, dim, alpha, prob, vb, c0); break;
    default: break;
  }
}

// Rows [r0, r0 + R) of one item (query rows t0 + r0.., at positions pos0 + r0..) over key block kb: scores,
// online softmax (m, l), probabilities, outputs.
template <typename T, int R>
void rows_over_block(const Layout<T>& L, int64_t t0, int64_t pos0, int64_t h, int64_t r0, int64_t kb, bool masked,
                     const uint32_t* kp, const uint32_t* vp, float* o, float* m, __m512* l) {
  constexpr bool fp32 = std::is_same_v<T, float>;
  const int64_t units = L.dim / PER<T>;
  const T* qrows[RS];
  for (int r = 0; r < R; ++r) qrows[r] = L.q + (t0 + r0 + r) * L.q_s0 + h * L.q_s1;
  __m512 s[RS][4];
  score_block<T, R>(s, qrows, kp + kb * units * BK, units);
  const bool capped = L.cap_log2 > 0.f;
  const __m512 scale = _mm512_set1_ps(capped ? L.scale_over_cap : L.scale_log2), cap = _mm512_set1_ps(L.cap_log2);
  alignas(64) uint32_t prob[RS * BK];
  alignas(64) float diff[16] = {}, alpha[16];
  float m_new[RS];
  __mmask16 valid[RS][4];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 4; ++c) valid[r][c] = 0xFFFF;
    if (masked) {  // key j visible to the row at position i iff j <= i (and j > i - window)
      const int64_t i = pos0 + r0 + r;
      const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      for (int c = 0; c < 4; ++c) {
        const __m512i j = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(kb * BK + 16 * c)));
        valid[r][c] = _mm512_cmple_epi32_mask(j, _mm512_set1_epi32(static_cast<int>(i)));
        if (L.window > 0)
          valid[r][c] &= _mm512_cmpgt_epi32_mask(j, _mm512_set1_epi32(static_cast<int>(i - L.window)));
      }
    }
    for (int c = 0; c < 4; ++c)  // to log2 units: s * scale * log2(e), or cap * tanh(s * scale / cap) * log2(e)
      s[r][c] = capped ? _mm512_mask_mov_ps(_mm512_set1_ps(NEG), valid[r][c],
                                            _mm512_mul_ps(cap, tanh16(_mm512_mul_ps(s[r][c], scale))))
                       : _mm512_mask_mul_ps(_mm512_set1_ps(NEG), valid[r][c], s[r][c], scale);
    const __m512 top = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
    m_new[r] = std::max(m[r], _mm512_reduce_max_ps(top));
    diff[r] = m[r] - m_new[r];
    m[r] = m_new[r];
  }
  _mm512_store_ps(alpha, exp2_nonpositive<fp32>(_mm512_load_ps(diff)));  // the R rows' rescalings in one exp
  for (int r = 0; r < R; ++r) {
    const __m512 mv = _mm512_set1_ps(m_new[r]);
    __m512 p[4];
    for (int c = 0; c < 4; ++c)
      p[c] = _mm512_maskz_mov_ps(valid[r][c], exp2_nonpositive<fp32>(_mm512_sub_ps(s[r][c], mv)));
    l[r] = _mm512_fmadd_ps(l[r], _mm512_set1_ps(alpha[r]),
                           _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
    if constexpr (fp32) {
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(reinterpret_cast<float*>(prob + r * BK) + 16 * c, p[c]);
    } else {
#if defined(__AVX512BF16__)
      _mm512_storeu_si512(prob + r * (BK / 2), (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
      _mm512_storeu_si512(prob + r * (BK / 2) + 16, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
#endif
    }
  }
  weigh_rows<T, R>(o, L.dim, alpha, prob, vp + kb * (BK / PER<T>) * L.dim);
}

template <typename T, int R>
void finish_rows(const Layout<T>& L, int64_t t0, int64_t h, int64_t r0, const float* o, const __m512* l) {
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
    T* dst = L.out + (t0 + r0 + r) * L.o_s0 + h * L.o_s1;
    for (int64_t d = 0; d < L.dim; d += 16) {
      const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(o + r * L.dim + d), inv);
      if constexpr (std::is_same_v<T, float>) {
        _mm512_storeu_ps(dst + d, y);
      } else {
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(y));
#endif
      }
    }
  }
}

template <typename T, int R>
void group_rows(const Layout<T>& L, int64_t t0, int64_t pos0, int64_t h, int64_t r0, const uint32_t* kp,
                const uint32_t* vp, float* o) {
  float m[RS];
  __m512 l[RS];
  const float start = L.start_log2(h);  // a sink: the sum starts at its 2^0 = 1
  const __m512 l0 = L.sinks != nullptr ? _mm512_maskz_mov_ps(1, _mm512_set1_ps(1.f)) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) m[r] = start, l[r] = l0;
  std::fill(o, o + R * L.dim, 0.f);
  const int64_t first = pos0 + r0, last = first + R - 1;  // positions; the group's last row sees the most keys
  const int64_t first_key = L.window > 0 ? std::max<int64_t>(0, first - L.window + 1) : 0;
  for (int64_t kb = first_key / BK; kb <= last / BK; ++kb) {
    const int64_t k0 = kb * BK, k1 = k0 + BK - 1;
    const bool masked = k1 > first || (L.window > 0 && k0 <= last - L.window);
    rows_over_block<T, R>(L, t0, pos0, h, r0, kb, masked, kp, vp, o, m, l);
  }
  finish_rows<T, R>(L, t0, h, r0, o, l);
}

// One item: query head h of a sequence whose queries are rows t0.. at positions pos0.., rows [i0, i1) of them.
template <typename T>
void attend_item(const Layout<T>& L, int64_t t0, int64_t pos0, int64_t h, int64_t i0, int64_t i1,
                 const uint32_t* kp, const uint32_t* vp) {
  alignas(64) float o[RS * MAX_DIM];
  int64_t r0 = i0;
  for (; r0 + RS <= i1; r0 += RS) group_rows<T, RS>(L, t0, pos0, h, r0, kp, vp, o);
  switch (i1 - r0) {
    case 3: group_rows<T, 3>(L, t0, pos0, h, r0, kp, vp, o); break;
    case 2: group_rows<T, 2>(L, t0, pos0, h, r0, kp, vp, o); break;
    case 1: group_rows<T, 1>(L, t0, pos0, h, r0, kp, vp, o); break;
    default: break;
  }
}

#ifdef PDSERVE_AMX_ATTENTION
// bf16 on CPUs with AMX: the two products on tiles, scores transposed. torch's flash attention runs its products on
// AMX there too, and the vdpbf16ps kernel above lost to it (0.65x end to end on a 2-core Xeon). Per group of 16
// query rows (one query head), over chunks of KC keys:
// - S^T (16 keys x 16 queries, float) = K (16 keys x 32 dims, row-major as packed) . Q^T (the 16 rows' dims as
//   bf16 pairs: AMX's B layout), head dims 32 at a time;
// - the online softmax runs down S^T's columns: a key's scores for the 16 queries are one vector, so a row's
//   maximum and sum are vertical operations (no lane reductions); a row's running maximum moves only when a new
//   score passes it by more than 2^8 (the probabilities stay below 256, exact enough in float), so the outputs
//   are rescaled rarely, not every chunk;
// - P^T (pairs of keys x 16 queries, bf16: rounded as torch's flash attention rounds its probabilities) is AMX's
//   B layout as it comes out of one two-vector conversion and a permute, and O^T (16 dims x 16 queries, float)
//   += V^T (16 dims x 32 keys) . P^T stays in four tiles for the whole row group (head dims 32 and 64); head dims
//   96 to 256 keep O^T's dims past 64 in L1 and add to them through the two score tiles, which are free by then.
//   Heads of 160 and 256 (Gemma's), 2,048 tokens, 8 heads over 4 KV heads: 10.9 and 18.5 ms a layer against the
//   vdpbf16ps kernel's 66 and 111 that took them before and SDPA's 14.8 and 24.7.
// - head dims up to 64 pipeline a row group's chunks (amx_item): chunk i's softmax runs between chunk i + 1's
//   scores and chunk i - 1's values, and V^T's tiles take turns in three operand tiles.
// Packed per (sequence, KV head): K as [keys][dim] bf16, V^T chunk by chunk, keys padded with zeros to whole KCs.
// 2,048 tokens, 16 heads of 64 over 8 KV heads, 2-core Xeon (Emerald Rapids): 12.1-12.4 ms a layer against
// torch's 23.2-23.6 (alternating, medians); with V^T as one [dim][keys] matrix (its tile rows 4 KiB apart) 27 ms.
// Heads of 128: 23.3 against 29.6 (the vdpbf16ps kernel 115.9).
// Where the time goes (2-core Xeon, 2,048 tokens, heads of 64; each part left out in turn, one process): without
// the vector work the kernel took 5.2 of 8.9 ms (its tile products alone ran ~2,000 GFLOP/s, near oneDNN's GEMM
// peak here), without the tile products 4.1; the two hardly overlap. The pipeline, the polynomial of exp2_amx and
// the operand tiles took it from 10.9 to 9.7 ms (1.12x). Then (the same kind, separate processes alternated):
// the packed K and V 64-byte aligned, exp2_amx in five operations, Q^T, V^T and the outputs transposed in
// registers rather than gathered, unmasked chunks without masks: 9.1-9.3 -> 7.2-7.5 ms. Tried, not kept: the
// scores, the softmax and the values of 256 keys at a time as three phases (Q^T resident in two tiles, four
// score tiles, so each operand tile is loaded once; no row maximum to chase): the tile part alone ran no faster
// (its K and V^T tiles come from L2, each used by one 16-row group: L2's bandwidth bounds them) and the phases
// lost the pipeline's overlap, 0.84x.

// Keys a chunk: two 16-key tiles, one P^T tile. Against chunks of 64 (two tile pairs), the same Xeon, alternating
// in one process, prompts of 37 to 2,048 tokens, heads of 64 and 128: 1.00-1.11x where its matmul ran fast (about
// 1.04x typical), 1.10-1.19x in its slow phase; each V^T tile is 1 KiB contiguous, and the masked chunk on the
// diagonal half as wide. Chunks of 128: 0.75x.
constexpr int64_t KC = 32;
static_assert(KC % 32 == 0 && BK % KC == 0, "a chunk is whole P^T tiles, and packing blocks hold whole chunks");
constexpr int64_t AMX_DIM = 256;  // head dims up to this (a multiple of 32): O^T's first 64 in tiles 0-3
constexpr float RESCALE = 8.f;    // log2 of the growth allowed before the outputs are rescaled

bool amx_usable(int64_t dim) { return dim > 0 && dim % 32 == 0 && dim <= AMX_DIM && pdserve::amx_permitted(); }

// Tiles 0-3: O^T, 4-5: S^T, 6: an A operand (K or V^T), 7: a B operand (Q^T or P^T); all 16 rows of 64 bytes.
void amx_configure() {
  pdserve::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// r[i] lane j <- r[j] lane i (32-bit lanes), in 64 shuffles: a tenth of the time of the 16 gathers it replaces
// (each gather of 16 lanes took ~8 ns on the 2-core Xeon)
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);      // per 128-bit lane: r_i0 r_j0 r_i1 r_j1
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  // r_i2 r_j2 r_i3 r_j3
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);      // column 0 of rows i..i+3, per lane
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);  // column 1
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4b + c] lane L (128-bit) holds column 4L + c of rows 4b..4b+3
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);      // lanes 0,2 of rows 0-3 | 0,2 of rows 4-7
    const __m512i b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);      // lanes 1,3
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(a, e, 0x88);       // column c
    t[8 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);   // column 8 + c
    t[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);   // column 4 + c
    t[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);  // column 12 + c
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
// K rows into kp ([keys_pad][dim] bf16), V transposed chunk by chunk into vp ([keys_pad / KC][dim][KC] bf16: a
// chunk's V^T tile rows are 64 bytes, one after the other; rows a whole V^T apart, 4 KiB at 2,048 keys, fell in one
// L1 set), zeros past len.
template <typename KeyRow, typename ValueRow>
void pack_kv_amx(int64_t len, int64_t dim, const KeyRow& key_row, const ValueRow& value_row, uint32_t* kp,
                 uint32_t* vp) {
  const int64_t pad = (len + KC - 1) / KC * KC;
  auto* k = reinterpret_cast<c10::BFloat16*>(kp);
  auto* vt = reinterpret_cast<uint16_t*>(vp);
  for (int64_t j = 0; j < len; ++j) std::memcpy(k + j * dim, key_row(j), sizeof(c10::BFloat16) * dim);
  std::memset(k + len * dim, 0, sizeof(c10::BFloat16) * (pad - len) * dim);
  for (int64_t j0 = 0; j0 < pad; j0 += 16) {  // 16 keys at a time: each dim's 16 values are one 32-byte run
    const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, len - j0));
    alignas(64) uint16_t tile[16][AMX_DIM];
    for (int64_t r = 0; r < 16; ++r) {
      if (r < n)
        std::memcpy(tile[r], value_row(j0 + r), sizeof(uint16_t) * dim);
      else
        std::memset(tile[r], 0, sizeof(uint16_t) * dim);
    }
    uint16_t* chunk = vt + j0 / KC * dim * KC + j0 % KC;
    // units (dims d, d + 1) of the 16 rows transposed 16 at a time, then each dim's 16 values (32 bytes) out
    for (int64_t u0 = 0; u0 < dim / 2; u0 += 16) {
      __m512i t[16];
      for (int r = 0; r < 16; ++r) t[r] = _mm512_load_si512(&tile[r][2 * u0]);
      transpose16(t);
      for (int j = 0; j < 16; ++j) {
        const int64_t d = 2 * (u0 + j);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunk + d * KC), _mm512_cvtepi32_epi16(t[j]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(chunk + (d + 1) * KC),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(t[j], 16)));
      }
    }
  }
}

// O^T's tiles (0 .. d16 - 1) to o ([dim][16] floats)
inline void store_ot(float (*o)[16], int64_t d16) {
  _tile_stored(0, o[0], 64);
  _tile_stored(1, o[16], 64);
  if (d16 > 2) {
    _tile_stored(2, o[32], 64);
    _tile_stored(3, o[48], 64);
  }
}

// 2^x for the AMX softmax, zero in the lanes `keep` drops (x <= RESCALE where a lane is kept; dropped lanes may hold
// anything finite): r = x - floor(x) in [0, 1) in one vreduceps, 2^r by a degree-3 polynomial fitted for the least
// largest relative error (7.5e-5 evaluated in float: a 26th of the bf16 rounding the probabilities take), then
// scalef by x, which takes floor(x) itself. No clamp: 2^floor(x) underflows to 0, and overflows only in lanes the
// mask drops. Five operations where rounding by adding and taking away 1.5 x 2^23, a degree-4 polynomial and a
// masking move took nine.
inline __m512 exp2_amx(__m512 x, __mmask16 keep = 0xFFFF) {
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.07802419364452362f), r, _mm512_set1_ps(0.2260672152042389f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6958337426185608f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.9999251961708069f));
  return _mm512_maskz_scalef_ps(keep, p, x);
}

// 2^x for x <= 64 as exp2_amx computes it with a polynomial of degree 4 (largest relative error 2.7e-6 in float)
inline __m512 exp2_fine(__m512 x) {
  const __m512 r = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.013534121215343475f), r, _mm512_set1_ps(0.052011482417583466f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24144279956817627f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6930038332939148f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0000026226043701f));
  return _mm512_scalef_ps(p, x);
}

// A soft-capped logit less the row maxima, cap tanh(y) - m, as (cap - m) - 2 cap / (1 + 2^x) for x = 2 y log2(e)
// (scores times scale / cap times 2 log2(e)), capped at 64 (tanh 1 in float); 1 / (1 + 2^x) by vrcp14ps and one
// Newton step. Thirteen operations from the score where tanh16 and the subtraction took twenty; the error in
// tanh is at most half exp2_fine's, ~1e-4 of a unit at Gemma 2's cap of 50 (72 in log2 units).
// 2,048 tokens, 8 heads of 64 over 4 KV heads, 2-core Xeon VM with AMX, medians: capped 5.3-5.7 ms a layer
// against 3.5-3.7 uncapped (with tanh16, 7.0-7.3); sinks cost nothing measurable. The vdpbf16ps kernel that took
// these layers before: capped 28-30 ms, sinks 25-27.
inline __m512 capped_less(__m512 x, __m512 cap_less_m, __m512 two_cap) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp2_fine(_mm512_min_ps(x, _mm512_set1_ps(64.f))));
  const __m512 r0 = _mm512_rcp14_ps(d);
  const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.f)));  // r0 (2 - d r0)
  return _mm512_fnmadd_ps(two_cap, r, cap_less_m);
}

// Query rows [i0, i1) (at most BQ) of head h of a sequence (rows t0.., positions pos0..); kp, vp packed by
// pack_kv_amx.
void amx_item(const Layout<c10::BFloat16>& L, int64_t t0, int64_t pos0, int64_t h, int64_t i0, int64_t i1,
              const uint32_t* kp, const uint32_t* vp) {
  const int64_t dim = L.dim, d32 = dim / 32, d16 = dim / 16, high = std::max<int64_t>(0, dim - 64);
  const auto* k = reinterpret_cast<const c10::BFloat16*>(kp);
  const auto* vt = reinterpret_cast<const c10::BFloat16*>(vp);
  alignas(64) uint32_t qt[AMX_DIM / 32][16][16];  // Q^T: [32 dims][16 dim pairs][16 queries]
  alignas(64) float sbuf[2][KC][16];               // S^T of a chunk, two chunks in flight
  alignas(64) uint32_t pt[2][KC / 32][16][16];     // P^T: [32 keys][16 key pairs][16 queries], two chunks
  alignas(64) float obuf[AMX_DIM][16];             // O^T when it leaves the tiles
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(interleave);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // a soft cap: a score s is cap * tanh(s * scale / cap) in log2 units, taken once per probability; the row
  // maxima come from the raw scores (tanh rises with them) and are capped once per chunk
  const bool capped = L.cap_log2 > 0.f;
  const __m512 scale = _mm512_set1_ps(capped ? L.scale_over_cap * 2.8853900817779268f : L.scale_log2);
  const __m512 cap = _mm512_set1_ps(L.cap_log2), two_cap = _mm512_add_ps(cap, cap);
  const __m512i window = _mm512_set1_epi32(static_cast<int>(L.window));
  // sinks: every lane is a row of head h, whose maximum starts at the sink and its sum at the sink's 2^0
  const __m512 m_start = _mm512_set1_ps(L.start_log2(h));
  const __m512 l_start = _mm512_set1_ps(L.sinks != nullptr ? 1.f : 0.f);
  amx_configure();
  for (int64_t r0 = i0; r0 < i1; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, i1 - r0);
    {  // Q^T: 16 units (32 dims) of the 16 rows at a time, transposed in registers (rows past `rows` zero)
      const c10::BFloat16* q0 = L.q + (t0 + r0) * L.q_s0 + h * L.q_s1;
      for (int64_t u0 = 0; u0 < dim / 2; u0 += 16) {
        __m512i t[16];
        for (int64_t r = 0; r < 16; ++r)
          t[r] = r < rows ? _mm512_loadu_si512(q0 + r * L.q_s0 + 2 * u0) : _mm512_setzero_si512();
        transpose16(t);
        for (int j = 0; j < 16; ++j) _mm512_store_si512(qt[u0 / 16][j], t[j]);
      }
    }
    const int64_t first = pos0 + r0, last = first + rows - 1;
    // lanes past the rows stand in for the last row (their outputs are dropped)
    const __m512i qpos = _mm512_min_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(first))),
                                          _mm512_set1_epi32(static_cast<int>(last)));
    const int64_t first_key = L.window > 0 ? std::max<int64_t>(0, first - L.window + 1) : 0;
    __m512 m = m_start, l = l_start;
    bool empty = true;  // O^T is still zero
    std::memset(obuf[64], 0, sizeof(float) * 16 * high);  // O^T's dims past 64
    _tile_zero(0);  // O^T's first dims: tiles 0 .. min(d16, 4) - 1
    _tile_zero(1);
    if (d16 > 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    // 16-key tiles of the chunk at k0 with a key visible to a row
    const auto tiles_at = [&](int64_t k0) { return std::min<int64_t>(KC / 16, (last - k0) / 16 + 1); };
    // stage 1: S^T of the chunk at k0 (Q^T . K^T) in tiles 4 and 5, stored to sbuf[buf]
    const auto scores = [&](int64_t k0, int buf) {
      const int64_t tiles = tiles_at(k0);
      _tile_zero(4);
      if (tiles > 1) _tile_zero(5);
      for (int64_t c = 0; c < d32; ++c) {
        _tile_loadd(7, qt[c], 64);
        _tile_loadd(6, k + k0 * dim + 32 * c, dim * 2);
        _tile_dpbf16ps(4, 6, 7);
        if (tiles > 1) {
          _tile_loadd(6, k + (k0 + 16) * dim + 32 * c, dim * 2);
          _tile_dpbf16ps(5, 6, 7);
        }
      }
      _tile_stored(4, sbuf[buf][0], 64);
      if (tiles > 1) _tile_stored(5, sbuf[buf][16], 64);
    };
    // stage 3: O^T += V^T . P^T of the chunk at k0 (its P^T in pt[buf])
    const auto values = [&](int64_t k0, int buf) {
      static_assert(KC == 32, "a chunk's P^T is one tile");
      const c10::BFloat16* v = vt + k0 * dim;  // the chunk's V^T: [dim][KC]
      _tile_loadd(7, pt[buf][0], 64);
      if (high == 0) {
        // tiles 4 and 5 are free (the scores were stored): V^T's tiles go through 6, 4 and 5, so a load does not
        // wait for the product before it to have read its operand (alone, these products took 0.9x the time)
        _tile_loadd(6, v, KC * 2);
        _tile_loadd(4, v + 16 * KC, KC * 2);
        if (d16 > 2) _tile_loadd(5, v + 32 * KC, KC * 2);
        _tile_dpbf16ps(0, 6, 7);
        _tile_dpbf16ps(1, 4, 7);
        if (d16 > 2) {
          _tile_dpbf16ps(2, 5, 7);
          _tile_loadd(6, v + 48 * KC, KC * 2);
          _tile_dpbf16ps(3, 6, 7);
        }
        empty = false;
        return;
      }
      _tile_loadd(6, v, KC * 2);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(6, v + 16 * KC, KC * 2);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(6, v + 32 * KC, KC * 2);  // past 64 dims: d16 > 4
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(6, v + 48 * KC, KC * 2);
      _tile_dpbf16ps(3, 6, 7);
      for (int64_t d = 64; d < dim; d += 32) {  // dims past 64, two tiles at a time through tiles 4 and 5
        _tile_loadd(4, obuf[d], 64);
        _tile_loadd(5, obuf[d + 16], 64);
        _tile_loadd(6, v + d * KC, KC * 2);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(6, v + (d + 16) * KC, KC * 2);
        _tile_dpbf16ps(5, 6, 7);
        _tile_stored(4, obuf[d], 64);
        _tile_stored(5, obuf[d + 16], 64);
      }
      empty = false;
    };
    // The three stages are software-pipelined where the head dims leave tiles 4 and 5 to the scores (up to 64):
    // chunk i's softmax comes after chunk i + 1's scores and before chunk i - 1's values, so the tile units work
    // while the vector units do, and each chunk's scores and probabilities cross memory (tile store to vector
    // loads, vector stores to a tile load) an iteration before they are read. A rescaling adds the pending chunk's
    // values first (they were weighed against the old maximum). Past 64 dims the stages run one after the other.
    const bool ahead = high == 0;
    int64_t pending = -1;  // the chunk whose values are still to be added (its P^T in pt[buf ^ 1])
    int buf = 0;
    const int64_t k_first = first_key / KC * KC;
    if (ahead) scores(k_first, 0);
    for (int64_t k0 = k_first; k0 <= last; k0 += KC, buf ^= 1) {
      if (!ahead)
        scores(k0, buf);
      else if (k0 + KC <= last)
        scores(k0 + KC, buf ^ 1);
      const bool masked = k0 + KC - 1 > first || (L.window > 0 && k0 <= last - L.window);
      const int64_t keys = 16 * tiles_at(k0);
      const float(*sb)[16] = sbuf[buf];
      __mmask16 valid[KC];
      // four running maxima: one would be a chain of 32 dependent steps
      __m512 top0 = _mm512_set1_ps(NEG), top1 = top0, top2 = top0, top3 = top0;
      if (masked) {
        for (int64_t j = 0; j < keys; j += 4) {
          for (int64_t u = j; u < j + 4; ++u) {  // key u visible to the row at position i iff u <= i (and u > i - window)
            const __m512i kpos = _mm512_set1_epi32(static_cast<int>(k0 + u));
            valid[u] = _mm512_cmple_epi32_mask(kpos, qpos);
            if (L.window > 0)
              valid[u] &= _mm512_cmpgt_epi32_mask(kpos, _mm512_sub_epi32(qpos, window));
          }
          top0 = _mm512_mask_max_ps(top0, valid[j], top0, _mm512_load_ps(sb[j]));
          top1 = _mm512_mask_max_ps(top1, valid[j + 1], top1, _mm512_load_ps(sb[j + 1]));
          top2 = _mm512_mask_max_ps(top2, valid[j + 2], top2, _mm512_load_ps(sb[j + 2]));
          top3 = _mm512_mask_max_ps(top3, valid[j + 3], top3, _mm512_load_ps(sb[j + 3]));
        }
      } else {  // every key visible to every row (no masks: they cost a load into a mask register a vector)
        for (int64_t j = 0; j < keys; j += 4) {
          top0 = _mm512_max_ps(top0, _mm512_load_ps(sb[j]));
          top1 = _mm512_max_ps(top1, _mm512_load_ps(sb[j + 1]));
          top2 = _mm512_max_ps(top2, _mm512_load_ps(sb[j + 2]));
          top3 = _mm512_max_ps(top3, _mm512_load_ps(sb[j + 3]));
        }
      }
      const __m512 top = _mm512_max_ps(_mm512_max_ps(top0, top1), _mm512_max_ps(top2, top3));
      // rows whose maximum grew past m + RESCALE take the new one; the others keep theirs
      const __m512 none = _mm512_set1_ps(NEG);
      const __mmask16 any = _mm512_cmp_ps_mask(top, none, _CMP_GT_OQ);
      const __m512 seen = capped ? _mm512_mask_mov_ps(none, any, capped_less(_mm512_mul_ps(top, scale), cap, two_cap))
                                 : _mm512_mask_mul_ps(none, any, top, scale);
      const __mmask16 grow = _mm512_cmp_ps_mask(seen, _mm512_add_ps(m, _mm512_set1_ps(RESCALE)), _CMP_GT_OQ);
      if (grow) {
        if (pending >= 0) {
          values(pending, buf ^ 1);
          pending = -1;
        }
        const __m512 m_new = _mm512_mask_mov_ps(m, grow, seen);
        const __m512 alpha = exp2_amx(_mm512_sub_ps(m, m_new));
        l = _mm512_mul_ps(l, alpha);
        if (!empty) {  // O^T's columns (queries) times their rows' alpha
          store_ot(obuf, d16);
          for (int64_t d = 0; d < dim; ++d) _mm512_store_ps(obuf[d], _mm512_mul_ps(_mm512_load_ps(obuf[d]), alpha));
          _tile_loadd(0, obuf[0], 64);
          _tile_loadd(1, obuf[16], 64);
          if (d16 > 2) {
            _tile_loadd(2, obuf[32], 64);
            _tile_loadd(3, obuf[48], 64);
          }
        }
        m = m_new;
      }
      uint32_t* prow = pt[buf][0][0];  // keys j and j + 1 make P^T's row j / 2 (16 units a row)
      // log2_of(s): a key's scores for the 16 rows in log2 units, less the rows' maxima
      const auto probabilities = [&](const auto& mask_of, const auto& log2_of) {
#pragma GCC unroll 4
        for (int64_t j = 0; j < keys; j += 2) {
          const __m512 p0 = exp2_amx(log2_of(_mm512_load_ps(sb[j])), mask_of(j));
          const __m512 p1 = exp2_amx(log2_of(_mm512_load_ps(sb[j + 1])), mask_of(j + 1));
          l = _mm512_add_ps(l, _mm512_add_ps(p0, p1));
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // [p0's 16 | p1's 16] as bf16
          _mm512_store_si512(prow + 8 * j, _mm512_permutexvar_epi16(pairs, both));
        }
      };
      const auto in_mask = [&](int64_t j) { return valid[j]; };
      const auto all = [](int64_t) { return static_cast<__mmask16>(0xFFFF); };
      const auto plain = [&](__m512 s) { return _mm512_fmsub_ps(s, scale, m); };
      const __m512 cap_less_m = _mm512_sub_ps(cap, m);
      const auto capped_of = [&](__m512 s) { return capped_less(_mm512_mul_ps(s, scale), cap_less_m, two_cap); };
      if (capped) {
        if (masked)
          probabilities(in_mask, capped_of);
        else
          probabilities(all, capped_of);
      } else if (masked) {
        probabilities(in_mask, plain);
      } else {
        probabilities(all, plain);
      }
      for (int64_t j = keys; j < KC && j % 32 != 0; j += 2)  // the last P^T tile's rows past the keys
        _mm512_store_si512(pt[buf][j / 32][(j % 32) / 2], _mm512_setzero_si512());
      if (!ahead) {
        values(k0, buf);
      } else {
        if (pending >= 0) values(pending, buf ^ 1);
        pending = k0;
      }
    }
    if (pending >= 0) values(pending, buf ^ 1);
    store_ot(obuf, d16);
    // O^T's columns over their sums, then 16 dims of the 16 rows at a time transposed in registers
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      __m512i t[16];
      for (int j = 0; j < 16; ++j) t[j] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(obuf[d0 + j]), inv));
      transpose16(t);
      for (int64_t i = 0; i < rows; ++i) {
        c10::BFloat16* dst = L.out + (t0 + r0 + i) * L.o_s0 + h * L.o_s1 + d0;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(t[i])));
      }
    }
  }
  _tile_release();
}
#endif  // PDSERVE_AMX_ATTENTION

#elif defined(PDSERVE_PREFILL_AVX2)
// AVX2 (CPUs without AVX-512: Zen 2 and 3, older Xeons), 8 floats a vector and 16 registers. Both dtypes compute
// in float: bf16 K and V rows are widened as they are packed, an item's queries as it starts, and the
// probabilities stay float (torch's bf16 flash attention rounds them to bf16). Packed as above with float units:
// K as [key block][dim][64 keys], V as [key][dim]. An item walks its key blocks, and per block its groups of 6
// query rows: the scores 16 keys at a time, the online softmax over the block, then the outputs 16 dims at a time.
// Keys of a block past a group's last row are neither scored nor weighed.

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// 2^x for x <= 0 (degree 6, relative error ~1.2e-7); x clamped to -126, whose 2^x (~1e-38) is nothing next to the
// row maximum's 1 (masked keys are zeroed apart).
inline __m256 exp2_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, n);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.5403530393e-4f), r, _mm256_set1_ps(1.3333558146e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6181291076e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5504108665e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4022650696e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9314718056e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// tanh(y) as (1 - e) / (1 + e), e = 2^(-2|y| log2(e)), with y's sign: the decode kernel's tanh_of (exp.h), 8 lanes.
inline __m256 tanh8(__m256 y) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256 a = _mm256_andnot_ps(sign, y);
  const __m256 e = exp2_nonpositive(_mm256_mul_ps(a, _mm256_set1_ps(-2.8853900817779268f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(t, _mm256_and_ps(y, sign));
}

// Register blocks of 6 rows x 16 keys (scores) or x 16 dims (outputs): 12 accumulators, 2 vectors of keys or values
// and a broadcast take 15 of the 16 registers; 8 loads a 12 FMAs. (3 x 32: 17 registers, and GCC read the keys
// from memory at every FMA.)
constexpr int RS2 = 6;  // rows a register block

// s[r][0, keys) = q[r] . K[key] over one packed block (q: R rows of dim floats), 16 keys at a time; keys a
// multiple of 16.
template <int R>
inline void score_rows(float (*s)[BK], const float* q, const uint32_t* kb, int64_t dim, int64_t keys) {
  for (int64_t c = 0; c < keys; c += 16) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t u = 0; u < dim; ++u) {
      const float* k = reinterpret_cast<const float*>(kb + u * BK + c);
      const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 qb = _mm256_broadcast_ss(q + r * dim + u);
        a[r][0] = _mm256_fmadd_ps(qb, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qb, k1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s[r] + c, a[r][0]);
      _mm256_storeu_ps(s[r] + c + 8, a[r][1]);
    }
  }
}

// o[r] = o[r] * alpha[r] + sum over keys [0, keys) of p[r][key] V[key], 16 dims at a time (dims are whole 16s)
template <int R>
inline void weigh_rows(float* o, int64_t dim, const float* alpha, const float (*p)[BK], const float* vb,
                       int64_t keys) {
  for (int64_t d = 0; d < dim; d += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(alpha[r]);
      acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + r * dim + d), a);
      acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + r * dim + d + 8), a);
    }
    for (int64_t j = 0; j < keys; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vb + j * dim + d), v1 = _mm256_loadu_ps(vb + j * dim + d + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pb = _mm256_broadcast_ss(&p[r][j]);
        acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + r * dim + d, acc[r][0]);
      _mm256_storeu_ps(o + r * dim + d + 8, acc[r][1]);
    }
  }
}

// R rows of an item at positions pos.. (q their widened queries, o their outputs: R x dim floats) over key block
// kb: scores, online softmax (m, l), probabilities, outputs.
template <typename T, int R>
void rows_over_block(const Layout<T>& L, int64_t pos, int64_t kb, bool masked, const float* q, const uint32_t* kp,
                     const uint32_t* vp, float* o, float* m, __m256* l) {
  const int64_t last = pos + R - 1;
  const int64_t keys = std::min<int64_t>(BK, last - kb * BK + 1);  // visible to some row of the group
  const int64_t vecs = (keys + 7) / 8;
  alignas(32) float s[RS2][BK];
  score_rows<R>(s, q, kp + kb * L.dim * BK, L.dim, (keys + 15) / 16 * 16);
  const __m256 scale = _mm256_set1_ps(L.cap_log2 > 0.f ? L.scale_over_cap : L.scale_log2), neg = _mm256_set1_ps(NEG);
  const __m256 cap = _mm256_set1_ps(L.cap_log2);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float diff[8] = {}, alpha[8];
  __m256 valid[RS2][BK / 8];
  for (int r = 0; r < R; ++r) {
    const int64_t i = pos + r;
    __m256 top = neg;
    for (int64_t c = 0; c < vecs; ++c) {
      __m256 x = _mm256_mul_ps(_mm256_load_ps(s[r] + 8 * c), scale);
      if (L.cap_log2 > 0.f) x = _mm256_mul_ps(cap, tanh8(x));  // cap * tanh(s * scale / cap) * log2(e)
      if (masked) {  // key j visible to the row at position i iff j <= i (and j > i - window)
        const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(kb * BK + 8 * c)));
        __m256i ok = _mm256_xor_si256(_mm256_cmpgt_epi32(j, _mm256_set1_epi32(static_cast<int>(i))),
                                      _mm256_set1_epi32(-1));
        if (L.window > 0)
          ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(j, _mm256_set1_epi32(static_cast<int>(i - L.window))));
        valid[r][c] = _mm256_castsi256_ps(ok);
        x = _mm256_blendv_ps(neg, x, valid[r][c]);
      }
      _mm256_store_ps(s[r] + 8 * c, x);
      top = _mm256_max_ps(top, x);
    }
    const float m_new = std::max(m[r], hmax(top));
    diff[r] = m[r] - m_new;
    m[r] = m_new;
  }
  _mm256_store_ps(alpha, exp2_nonpositive(_mm256_load_ps(diff)));  // the R rows' rescalings in one exp
  alignas(32) float p[RS2][BK];
  for (int r = 0; r < R; ++r) {
    const __m256 mv = _mm256_set1_ps(m[r]);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t c = 0; c < vecs; ++c) {
      __m256 e = exp2_nonpositive(_mm256_sub_ps(_mm256_load_ps(s[r] + 8 * c), mv));
      if (masked) e = _mm256_and_ps(e, valid[r][c]);
      sum = _mm256_add_ps(sum, e);
      _mm256_store_ps(p[r] + 8 * c, e);
    }
    l[r] = _mm256_fmadd_ps(l[r], _mm256_set1_ps(alpha[r]), sum);
  }
  weigh_rows<R>(o, L.dim, alpha, p, reinterpret_cast<const float*>(vp) + kb * BK * L.dim, 8 * vecs);
}

// One item: query head h of a sequence whose queries are rows t0.. at positions pos0.., rows [i0, i1) of them.
// Key blocks outer, the item's row groups inner: a block's K and V (16 KiB each at a head dim of 64) are read from
// memory once for the item's rows, not once per group (2,048 keys of K and V, 1 MiB, outgrow a Zen 3 core's L2).
template <typename T>
void attend_item(const Layout<T>& L, int64_t t0, int64_t pos0, int64_t h, int64_t i0, int64_t i1,
                 const uint32_t* kp, const uint32_t* vp) {
  const int64_t n = i1 - i0, dim = L.dim;
  // the rows' float queries, then their outputs; 64-byte aligned, as the packed K and V (see attend)
  const std::unique_ptr<float, decltype(&std::free)> buf(
      static_cast<float*>(std::aligned_alloc(64, sizeof(float) * 2 * BQ * dim)), &std::free);
  TORCH_CHECK(buf, "prefill_attention: out of memory");
  float* q = buf.get();
  float* o = q + BQ * dim;
  alignas(32) float m[BQ];
  __m256 l[BQ];
  const float start = L.start_log2(h);  // a sink: the sum starts at its 2^0 = 1
  const __m256 l0 = L.sinks != nullptr ? _mm256_setr_ps(1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f) : _mm256_setzero_ps();
  for (int64_t r = 0; r < n; ++r) {
    const T* row = L.q + (t0 + i0 + r) * L.q_s0 + h * L.q_s1;
    for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = pdserve::to_float(row[d]);
    m[r] = start, l[r] = l0;
  }
  std::fill(o, o + n * dim, 0.f);
  const int64_t first = pos0 + i0, last = pos0 + i1 - 1;  // positions
  const int64_t first_key = L.window > 0 ? std::max<int64_t>(0, first - L.window + 1) : 0;
  for (int64_t kb = first_key / BK; kb <= last / BK; ++kb) {
    const int64_t k0 = kb * BK, k1 = k0 + BK - 1;
    for (int64_t r0 = 0; r0 < n; r0 += RS2) {
      const int R = static_cast<int>(std::min<int64_t>(RS2, n - r0));
      const int64_t g_first = pos0 + i0 + r0, g_last = g_first + R - 1;
      if (k0 > g_last || (L.window > 0 && k1 <= g_first - L.window)) continue;  // no key of the block visible
      const bool masked = k1 > g_first || (L.window > 0 && k0 <= g_last - L.window);
      float *qg = q + r0 * dim, *og = o + r0 * dim;
      switch (R) {
        case 6: rows_over_block<T, 6>(L, g_first, kb, masked, qg, kp, vp, og, m + r0, l + r0); break;
        case 5: rows_over_block<T, 5>(L, g_first, kb, masked, qg, kp, vp, og, m + r0, l + r0); break;
        case 4: rows_over_block<T, 4>(L, g_first, kb, masked, qg, kp, vp, og, m + r0, l + r0); break;
        case 3: rows_over_block<T, 3>(L, g_first, kb, masked, qg, kp, vp, og, m + r0, l + r0); break;
        case 2: rows_over_block<T, 2>(L, g_first, kb, masked, qg, kp, vp, og, m + r0, l + r0); break;
        default: rows_over_block<T, 1>(L, g_first, kb, masked, qg, kp, vp, og, m + r0, l + r0); break;
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    const float inv = 1.f / hsum(l[r]);
    T* dst = L.out + (t0 + i0 + r) * L.o_s0 + h * L.o_s1;
    for (int64_t d = 0; d < dim; ++d) dst[d] = pdserve::round_to<T>(o[r * dim + d] * inv);
  }
}
static_assert(RS2 == 6, "attend_item's groups of 1 to 6 rows");

#endif  // __AVX512F__, PDSERVE_PREFILL_AVX2

// Every sequence's attention: each (sequence, KV head) packed by pack(i, g, kp, vp), then items (sequence, query
// head, block of BQ rows), the most keys first, claimed by the threads as they come, each attended by
// item(t0, pos0, head, first row, end row, kp, vp).
template <typename T, typename Pack, typename Attend>
void attend(const Layout<T>& L, const std::vector<Seq>& seqs, const Pack& pack, const Attend& item) {
  const int64_t n = static_cast<int64_t>(seqs.size()), group = L.q_heads / L.kv_heads, dim = L.dim;
  const int64_t key_units = dim / PER<T>;  // 32-bit units a key takes, in K and in V each
  std::vector<int64_t> pack_at(n + 1, 0), blocks(n);  // packed K|V of sequence i: offsets in units
  for (int64_t i = 0; i < n; ++i) {
    blocks[i] = (seqs[i].pos0 + seqs[i].n + BK - 1) / BK;
    pack_at[i + 1] = pack_at[i] + L.kv_heads * blocks[i] * BK * key_units;
  }
  // left uninitialised: pack_kv writes every unit (a vector's zero-fill cost a pass over megabytes a layer). From
  // torch's allocator, 64-byte aligned: new[]'s 16-byte alignment left the rows of every K and V^T tile across
  // two cache lines in some processes and not others (the AMX kernel ran 7.1 or 8.5 ms a layer by the process)
  const at::Tensor packed = at::empty({2 * pack_at[n]}, at::TensorOptions().dtype(at::kInt));
  uint32_t* base = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  auto k_of = [&](int64_t i, int64_t g) { return base + 2 * pack_at[i] + 2 * g * blocks[i] * BK * key_units; };
  auto v_of = [&](int64_t i, int64_t g) { return k_of(i, g) + blocks[i] * BK * key_units; };
  pdserve::parallel_claim(n * L.kv_heads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t i = w / L.kv_heads, g = w % L.kv_heads;
      if (seqs[i].n > 0) pack(i, g, k_of(i, g), v_of(i, g));
    }
  });
  struct Item {
    int64_t keys, seq, head, row;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < seqs[i].n; r += BQ) {
      const int64_t last = seqs[i].pos0 + std::min<int64_t>(r + BQ, seqs[i].n);
      const int64_t first = L.window > 0 ? std::max<int64_t>(0, seqs[i].pos0 + r - L.window + 1) : 0;
      for (int64_t h = 0; h < L.q_heads; ++h) items.push_back({last - first, i, h, r});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.keys > y.keys; });
  pdserve::parallel_claim(static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t w = lo; w < hi; ++w) {
      const Item& it = items[w];
      const Seq& sq = seqs[it.seq];
      const int64_t g = it.head / group;
      item(sq.t0, sq.pos0, it.head, it.row, std::min<int64_t>(it.row + BQ, sq.n), k_of(it.seq, g), v_of(it.seq, g));
    }
  });
}

// attend() with the packing and items of the dtype and CPU: row(i, g, kv, j) is row j of sequence i's K (kv 0) or
// V (kv 1) in KV head g.
template <typename T, typename Row>
void attend_rows(const Layout<T>& L, const std::vector<Seq>& seqs, const Row& row) {
  auto keys = [&](int64_t i, int64_t g, int64_t kv) {
    return [&row, i, g, kv](int64_t j) { return row(i, g, kv, j); };
  };
#ifdef PDSERVE_AMX_ATTENTION
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (amx_usable(L.dim)) {
      attend<T>(
          L, seqs,
          [&](int64_t i, int64_t g, uint32_t* kp, uint32_t* vp) {
            pack_kv_amx(seqs[i].pos0 + seqs[i].n, L.dim, keys(i, g, 0), keys(i, g, 1), kp, vp);
          },
          [&](int64_t t0, int64_t pos0, int64_t h, int64_t i0, int64_t i1, const uint32_t* kp, const uint32_t* vp) {
            amx_item(L, t0, pos0, h, i0, i1, kp, vp);
          });
      return;
    }
  }
#endif
  attend<T>(
      L, seqs,
      [&](int64_t i, int64_t g, uint32_t* kp, uint32_t* vp) {
        pack_kv<T>(seqs[i].pos0 + seqs[i].n, L.dim, keys(i, g, 0), keys(i, g, 1), kp, vp);
      },
      [&](int64_t t0, int64_t pos0, int64_t h, int64_t i0, int64_t i1, const uint32_t* kp, const uint32_t* vp) {
        attend_item<T>(L, t0, pos0, h, i0, i1, kp, vp);
      });
}

template <typename T>
Layout<T> layout_of(at::Tensor& out, const at::Tensor& q, int64_t kv_heads, double scale, int64_t window,
                    const Extras& extras) {
  const bool capped = extras.softcap > 0.;
  return Layout<T>{q.data_ptr<T>(), out.data_ptr<T>(), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                   q.size(1), kv_heads, q.size(2), static_cast<float>(scale * 1.4426950408889634),
                   window > 0 ? window : 0, capped ? static_cast<float>(extras.softcap * 1.4426950408889634) : 0.f,
                   capped ? static_cast<float>(scale / extras.softcap) : 0.f, extras.sinks};
}

template <typename T>
void whole_prompts(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::vector<Seq>& seqs, double scale, int64_t window, const Extras& extras) {
  const Layout<T> L = layout_of<T>(out, q, k.size(1), scale, window, extras);
  const T *kd = k.data_ptr<T>(), *vd = v.data_ptr<T>();
  const int64_t k_s0 = k.stride(0), k_s1 = k.stride(1), v_s0 = v.stride(0), v_s1 = v.stride(1);
  attend_rows<T>(L, seqs, [&](int64_t i, int64_t g, int64_t kv, int64_t j) {
    return kv == 0 ? kd + (seqs[i].t0 + j) * k_s0 + g * k_s1 : vd + (seqs[i].t0 + j) * v_s0 + g * v_s1;
  });
}

template <typename T>
void from_cache(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, int64_t layer, const int64_t* table,
                int64_t width, const std::vector<Seq>& seqs, double scale, int64_t window, const Extras& extras) {
  const Layout<T> L = layout_of<T>(out, q, cache.size(2), scale, window, extras);
  const T* base = cache.data_ptr<T>() + layer * cache.stride(0);
  const int64_t kv_s = cache.stride(1), head_s = cache.stride(2), block_s = cache.stride(3), slot_s = cache.stride(4);
  const int64_t block_size = cache.size(4);
  attend_rows<T>(L, seqs, [&](int64_t b, int64_t g, int64_t kv, int64_t j) {
    const int64_t* blocks = table + b * width;
    return base + kv * kv_s + g * head_s + blocks[j / block_size] * block_s + (j % block_size) * slot_s;
  });
}

#endif  // PDSERVE_PREFILL_KERNEL

// Whether bf16 prefill attention runs on AMX tiles for this head dim (CPUs with AMX-BF16, head dims 32 to 256 by 32);
// elsewhere bf16 takes the vdpbf16ps kernel.
bool prefill_attention_amx(int64_t head_dim) {
#ifdef PDSERVE_AMX_ATTENTION
  return amx_usable(head_dim);
#else
  (void)head_dim;
  return false;
#endif
}

// softcap >= 0 (0: none); sinks, when given, a contiguous float [query heads] tensor (GPT-OSS's, converted once)
Extras extras_of(const char* op, double softcap, const std::optional<at::Tensor>& sinks, int64_t q_heads) {
  TORCH_CHECK(softcap >= 0, op, ": softcap must be positive (or 0: none), got ", softcap);
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                         sinks->size(0) == q_heads),
              op, ": sinks must be a contiguous float [Hq] tensor (Hq = ", q_heads, "), got ",
              sinks ? sinks->scalar_type() : at::kFloat, " ", sinks ? sinks->sizes() : at::IntArrayRef{},
              sinks && !sinks->is_contiguous() ? " (not contiguous)" : "");
  return Extras{softcap, sinks ? sinks->data_ptr<float>() : nullptr};
}

void check_dtype(c10::ScalarType dtype, const char* op) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, op, ": bfloat16 or float32 tensors, got ", dtype);
  TORCH_CHECK(prefill_attention_supported(dtype), op, " in ", dtype,
              " needs a build for a CPU with AVX2 and FMA, or AVX-512 (with AVX512-BF16 for bfloat16): see "
              "prefill_attention_supported");
}

// Whole prompts: prompt i's queries and keys are rows [bounds[i], bounds[i + 1]) of q and of k, v ([tokens, kv
// heads, head_dim] views, unit stride in head_dim), its positions from 0.
void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& bounds, double scale, int64_t window, double softcap,
                       const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "q, k, v, out: [tokens, heads, dim]");
  const auto dtype = q.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &out})
    TORCH_CHECK(t->scalar_type() == dtype && t->stride(2) == 1, "q, k, v, out: one dtype, unit dim stride");
  check_dtype(dtype, "prefill_attention");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == tokens && k.size(2) == dim, "k, v: [tokens, kv heads, dim]");
  TORCH_CHECK(out.sizes() == q.sizes(), "out: the shape of q");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(dim % 16 == 0 && dim <= MAX_DIM, "head dim must be a multiple of 16, at most ", MAX_DIM);
  TORCH_CHECK(bounds.scalar_type() == at::kInt && bounds.dim() == 1 && bounds.is_contiguous() && bounds.numel() >= 1,
              "bounds: [n + 1] int32");
  const int32_t* b = bounds.data_ptr<int32_t>();
  const int64_t n = bounds.numel() - 1;
  TORCH_CHECK(b[0] >= 0 && b[n] <= tokens, "bounds outside the tokens");
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(b[i] <= b[i + 1], "bounds must not decrease");
  const Extras extras = extras_of("prefill_attention", softcap, sinks, q.size(1));
  std::vector<Seq> seqs;
  for (int64_t i = 0; i < n; ++i) seqs.push_back({b[i], 0, b[i + 1] - b[i]});
#if defined(PDSERVE_PREFILL_KERNEL)
  if (dtype == at::kFloat) whole_prompts<float>(out, q, k, v, seqs, scale, window, extras);
#endif
#if defined(__AVX512BF16__) || defined(PDSERVE_PREFILL_AVX2)
  if (dtype == at::kBFloat16) whole_prompts<c10::BFloat16>(out, q, k, v, seqs, scale, window, extras);
#endif
}

// Prefill chunks continuing their sequences (after a cached prefix, a long prompt's later chunks): queries of
// sequence b at rows spans[b][0].. of q/out and positions spans[b][1].., spans[b][2] of them; keys 0 ..
// spans[b][1] + spans[b][2] - 1 read from the paged cache (the step's own already written there) by
// block_table[b]. Cache layout (common/engine/kv_cache.py): [layers, 2 (K|V), kv_heads, num_blocks, block_size,
// head_dim].
void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                             const at::Tensor& block_table, const at::Tensor& spans, double scale, int64_t window,
                             double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && out.sizes() == q.sizes(), "q, out: [tokens, heads, dim]");
  const auto dtype = q.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &out, &cache})
    TORCH_CHECK(t->scalar_type() == dtype && t->stride(-1) == 1, "q, out, cache: one dtype, unit dim stride");
  check_dtype(dtype, "paged_prefill_attention");
  TORCH_CHECK(cache.dim() == 6 && cache.size(1) == 2 && cache.size(5) == q.size(2), "cache: [L, 2, H, NB, bs, D]");
  TORCH_CHECK(layer >= 0 && layer < cache.size(0), "layer out of range: ", layer);
  const int64_t tokens = q.size(0), dim = q.size(2), kv_heads = cache.size(2), num_blocks = cache.size(3);
  const int64_t block_size = cache.size(4);
  TORCH_CHECK(q.size(1) % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(dim % 16 == 0 && dim <= MAX_DIM, "head dim must be a multiple of 16, at most ", MAX_DIM);
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.is_contiguous() && spans.dim() == 2 && spans.size(1) == 3,
              "spans: contiguous [B, 3] int64 (row, position, count)");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2 &&
                  block_table.size(0) == spans.size(0),
              "block_table: contiguous [B, nb] int64");
  const Extras extras = extras_of("paged_prefill_attention", softcap, sinks, q.size(1));
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t width = block_table.size(1);
  std::vector<Seq> seqs;
  for (int64_t b = 0; b < spans.size(0); ++b) {
    const Seq sq{sp[3 * b], sp[3 * b + 1], sp[3 * b + 2]};
    TORCH_CHECK(sq.t0 >= 0 && sq.pos0 >= 0 && sq.n >= 0 && sq.t0 + sq.n <= tokens, "spans[", b, "] outside q");
    TORCH_CHECK(sq.pos0 + sq.n <= width * block_size, "spans[", b, "]: keys past the block table");
    for (int64_t i = 0; i < (sq.pos0 + sq.n + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[b * width + i] >= 0 && table[b * width + i] < num_blocks, "block id ", table[b * width + i],
                  " out of range");
    seqs.push_back(sq);
  }
#if defined(PDSERVE_PREFILL_KERNEL)
  if (dtype == at::kFloat) from_cache<float>(out, q, cache, layer, table, width, seqs, scale, window, extras);
#endif
#if defined(__AVX512BF16__) || defined(PDSERVE_PREFILL_AVX2)
  if (dtype == at::kBFloat16)
    from_cache<c10::BFloat16>(out, q, cache, layer, table, width, seqs, scale, window, extras);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("prefill_attention_supported(ScalarType dtype) -> bool");
  m.impl("prefill_attention_supported", c10::DispatchKey::CatchAll, TORCH_FN(prefill_attention_supported));
  m.def("prefill_attention_amx(int head_dim) -> bool");
  m.impl("prefill_attention_amx", c10::DispatchKey::CatchAll, TORCH_FN(prefill_attention_amx));
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor bounds, float scale, int window, "
      "float softcap=0., Tensor? sinks=None) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor cache, int layer, Tensor block_table, Tensor spans, "
      "float scale, int window, float softcap=0., Tensor? sinks=None) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_attention));
}
