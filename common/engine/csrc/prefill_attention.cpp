// Causal attention of whole prompts over their own keys (a prefill step's fresh prompts), bf16, for CPUs with
// AVX512-BF16: flash attention with vdpbf16ps products.
//
// torch's CPU flash attention runs at ~127 GFLOP/s on a 2-core Zen 4 VM whose bf16 matmul reaches ~435 (2,048
// tokens, 16 heads of 64 over 8 KV heads: 67 ms a layer, a third of a 0.35B model's prefill). Here:
//
// - Each (prompt, KV head) is packed once, for every query head of its group: K as [key block][dim pair][64
//   keys] of bf16 pairs (a score vector is 16 keys, summed over the head's dim pairs by vdpbf16ps with the
//   query's pair broadcast), V as [key block][key pair][dim] of bf16 pairs (an output vector is 16 dims, summed
//   over pairs of keys with the two probabilities broadcast). Keys past the prompt are zeros.
// - Work items are (prompt, query head, block of 64 query rows), the costliest (last rows: most keys) first,
//   claimed by the threads as they come (parallel.h). An item walks its key blocks once: per group of 4 rows,
//   the 4 x 64 scores in 16 registers, the online softmax in float (exp2 with the scale folded in, running sums
//   kept as vectors), the probabilities rounded to bf16 (as torch's does for its matmul) and summed into the
//   rows' float outputs straight away, while they are in L1. Masks only where a key block crosses the diagonal
//   (or a sliding window's edge).
//
// q, k, v: [tokens, heads, head_dim] views with unit stride in head_dim (the step's fused q|k|v product, read in
// place); out: [tokens, query heads, head_dim]; bounds: [n + 1] int32, prompt i's tokens [bounds[i],
// bounds[i+1]).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BK = 64;   // keys a block
constexpr int64_t BQ = 64;   // query rows a work item
constexpr int RS = 4;        // rows a register block
constexpr int64_t MAX_DIM = 256;

bool prefill_attention_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)

constexpr float NEG = -1e30f;  // a finite "minus infinity": a row with no key yet never computes inf - inf

// 2^x for x <= 0 (degree-5 Taylor of 2^r on |r| <= 1/2: relative error ~2e-6, far below bf16's rounding of the
// probabilities; scalef takes n down to 0 without overflow tricks).
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

inline uint32_t pair_at(const c10::BFloat16* row, int64_t p) {
  uint32_t u;
  std::memcpy(&u, row + 2 * p, sizeof u);
  return u;
}

struct Layout {
  const c10::BFloat16* q;
  c10::BFloat16* out;
  int64_t q_s0, q_s1, o_s0, o_s1;
  int64_t q_heads, kv_heads, dim;
  float scale_log2;  // scale * log2(e)
  int64_t window;    // 0: none
};

// The keys [0, len) of one (sequence, KV head), whose K and V rows key_row(j) and value_row(j) give, into kp
// ([blocks][dim / 2][BK] pairs) and vp ([blocks][BK / 2][dim] pairs), zero past len.
template <typename KeyRow, typename ValueRow>
void pack_kv(int64_t len, int64_t dim, const KeyRow& key_row, const ValueRow& value_row, uint32_t* kp, uint32_t* vp) {
  const int64_t blocks = (len + BK - 1) / BK, half = dim / 2;
  std::memset(kp, 0, sizeof(uint32_t) * blocks * half * BK);
  std::memset(vp, 0, sizeof(uint32_t) * blocks * (BK / 2) * dim);
  for (int64_t j = 0; j < len; ++j) {
    const c10::BFloat16* krow = key_row(j);
    uint32_t* dst = kp + (j / BK) * half * BK + j % BK;
    for (int64_t p = 0; p < half; ++p) dst[p * BK] = pair_at(krow, p);
  }
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* vrow = reinterpret_cast<const uint16_t*>(value_row(j));
    uint16_t* dst = reinterpret_cast<uint16_t*>(vp + (j / BK) * (BK / 2) * dim + (j % BK) / 2 * dim) + (j & 1);
    for (int64_t d = 0; d < dim; ++d) dst[2 * d] = vrow[d];
  }
}

// Scores of R rows (q rows given) against the 64 keys of one packed block: s[r][c] covers keys 16c..16c+15.
template <int R>
inline void score_block(__m512 (&s)[RS][4], const c10::BFloat16* const* qrows, const uint32_t* kb, int64_t half) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half; ++p) {  // each key vector loaded once for the R rows (loaded per row, 20% slower)
    const uint32_t* kpp = kb + p * BK;
    __m512i qp[RS];
    for (int r = 0; r < R; ++r) qp[r] = _mm512_set1_epi32(static_cast<int>(pair_at(qrows[r], p)));
    for (int c = 0; c < 4; ++c) {
      const __m512i kc = _mm512_loadu_si512(kpp + 16 * c);
      for (int r = 0; r < R; ++r) s[r][c] = _mm512_dpbf16_ps(s[r][c], as_bh(qp[r]), as_bh(kc));
    }
  }
}

// o[r][16 (c0 + c)..] = o * alpha[r] + sum over the block's key pairs of P[r][pair] . V[pair], NC vectors of dims.
template <int R, int NC>
inline void weigh_block(float* o, int64_t dim, const float* alpha, const uint32_t* prob, const uint32_t* vb,
                        int64_t c0) {
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + 16 * (c0 + c)), a);
  }
  for (int64_t jp = 0; jp < BK / 2; ++jp) {
    __m512i pp[R];
    for (int r = 0; r < R; ++r) pp[r] = _mm512_set1_epi32(static_cast<int>(prob[r * (BK / 2) + jp]));
    for (int c = 0; c < NC; ++c) {
      const __m512i vc = _mm512_loadu_si512(vb + jp * dim + 16 * (c0 + c));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(pp[r]), as_bh(vc));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * dim + 16 * (c0 + c), acc[r][c]);
}

template <int R>
inline void weigh_rows(float* o, int64_t dim, const float* alpha, const uint32_t* prob, const uint32_t* vb) {
  const int64_t nv = dim / 16;
  int64_t c0 = 0;
  for (; c0 + 4 <= nv; c0 += 4) weigh_block<R, 4>(o, dim, alpha, prob, vb, c0);
  switch (nv - c0) {
    case 3: weigh_block<R, 3>(o, dim, alpha, prob, vb, c0); break;
    case 2: weigh_block<R, 2>(o, dim, alpha, prob, vb, c0); break;
    case 1: weigh_block<R, 1>(o, dim, alpha, prob, vb, c0); break;
    default: break;
  }
}

// Rows [r0, r0 + R) of one item (query rows t0 + r0.., at positions pos0 + r0..) over key block kb: scores,
// online softmax (m, l), probabilities, outputs.
template <int R>
void rows_over_block(const Layout& L, int64_t t0, int64_t pos0, int64_t h, int64_t r0, int64_t kb, bool masked,
                     const uint32_t* kp, const uint32_t* vp, float* o, float* m, __m512* l) {
  const int64_t half = L.dim / 2;
  const c10::BFloat16* qrows[RS];
  for (int r = 0; r < R; ++r) qrows[r] = L.q + (t0 + r0 + r) * L.q_s0 + h * L.q_s1;
  __m512 s[RS][4];
  score_block<R>(s, qrows, kp + kb * half * BK, half);
  const __m512 scale = _mm512_set1_ps(L.scale_log2);
  alignas(64) uint32_t prob[RS * BK / 2];
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
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_mask_mul_ps(_mm512_set1_ps(NEG), valid[r][c], s[r][c], scale);
    const __m512 top = _mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3]));
    m_new[r] = std::max(m[r], _mm512_reduce_max_ps(top));
    diff[r] = m[r] - m_new[r];
    m[r] = m_new[r];
  }
  _mm512_store_ps(alpha, exp2_nonpositive(_mm512_load_ps(diff)));  // the R rows' rescalings in one exp
  for (int r = 0; r < R; ++r) {
    const __m512 mv = _mm512_set1_ps(m_new[r]);
    __m512 p[4];
    for (int c = 0; c < 4; ++c) p[c] = _mm512_maskz_mov_ps(valid[r][c], exp2_nonpositive(_mm512_sub_ps(s[r][c], mv)));
    l[r] = _mm512_fmadd_ps(l[r], _mm512_set1_ps(alpha[r]),
                           _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])));
    _mm512_storeu_si512(prob + r * (BK / 2), (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_storeu_si512(prob + r * (BK / 2) + 16, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
  }
  weigh_rows<R>(o, L.dim, alpha, prob, vp + kb * (BK / 2) * L.dim);
}

template <int R>
void finish_rows(const Layout& L, int64_t t0, int64_t h, int64_t r0, const float* o, const __m512* l) {
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
    c10::BFloat16* dst = L.out + (t0 + r0 + r) * L.o_s0 + h * L.o_s1;
    for (int64_t d = 0; d < L.dim; d += 16) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * L.dim + d), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)y);
    }
  }
}

template <int R>
void group_rows(const Layout& L, int64_t t0, int64_t pos0, int64_t h, int64_t r0, const uint32_t* kp,
                const uint32_t* vp, float* o) {
  float m[RS];
  __m512 l[RS];
  for (int r = 0; r < R; ++r) m[r] = NEG, l[r] = _mm512_setzero_ps();
  std::fill(o, o + R * L.dim, 0.f);
  const int64_t first = pos0 + r0, last = first + R - 1;  // positions; the group's last row sees the most keys
  const int64_t first_key = L.window > 0 ? std::max<int64_t>(0, first - L.window + 1) : 0;
  for (int64_t kb = first_key / BK; kb <= last / BK; ++kb) {
    const int64_t k0 = kb * BK, k1 = k0 + BK - 1;
    const bool masked = k1 > first || (L.window > 0 && k0 <= last - L.window);
    rows_over_block<R>(L, t0, pos0, h, r0, kb, masked, kp, vp, o, m, l);
  }
  finish_rows<R>(L, t0, h, r0, o, l);
}

// One item: query head h of a sequence whose queries are rows t0.. at positions pos0.., rows [i0, i1) of them.
void attend_item(const Layout& L, int64_t t0, int64_t pos0, int64_t h, int64_t i0, int64_t i1, const uint32_t* kp,
                 const uint32_t* vp) {
  alignas(64) float o[RS * MAX_DIM];
  int64_t r0 = i0;
  for (; r0 + RS <= i1; r0 += RS) group_rows<RS>(L, t0, pos0, h, r0, kp, vp, o);
  switch (i1 - r0) {
    case 3: group_rows<3>(L, t0, pos0, h, r0, kp, vp, o); break;
    case 2: group_rows<2>(L, t0, pos0, h, r0, kp, vp, o); break;
    case 1: group_rows<1>(L, t0, pos0, h, r0, kp, vp, o); break;
    default: break;
  }
}

// A sequence of a call: queries at rows [t0, t0 + n) of q and out, at positions [pos0, pos0 + n); keys [0, pos0 + n).
struct Seq {
  int64_t t0, pos0, n;
};

// Every sequence's attention: each (sequence, KV head) packed by pack(i, g, kp, vp), then items (sequence, query
// head, block of BQ rows), the most keys first, claimed by the threads as they come.
template <typename Pack>
void attend(const Layout& L, const std::vector<Seq>& seqs, const Pack& pack) {
  const int64_t n = static_cast<int64_t>(seqs.size()), group = L.q_heads / L.kv_heads, dim = L.dim;
  std::vector<int64_t> pack_at(n + 1, 0), blocks(n);  // packed K|V of sequence i: offsets in uint32s
  for (int64_t i = 0; i < n; ++i) {
    blocks[i] = (seqs[i].pos0 + seqs[i].n + BK - 1) / BK;
    pack_at[i + 1] = pack_at[i] + L.kv_heads * blocks[i] * BK * dim / 2;  // dim / 2 pairs a key
  }
  std::vector<uint32_t> packed(static_cast<size_t>(2 * pack_at[n]));
  auto k_of = [&](int64_t i, int64_t g) { return packed.data() + 2 * pack_at[i] + g * blocks[i] * BK * dim; };
  auto v_of = [&](int64_t i, int64_t g) { return k_of(i, g) + blocks[i] * BK * dim / 2; };
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
      attend_item(L, sq.t0, sq.pos0, it.head, it.row, std::min<int64_t>(it.row + BQ, sq.n), k_of(it.seq, g),
                  v_of(it.seq, g));
    }
  });
}

#endif  // __AVX512BF16__

void prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& bounds, double scale, int64_t window) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "q, k, v, out: [tokens, heads, dim]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &out})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(2) == 1, "q, k, v, out: bfloat16, unit dim stride");
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

  Layout L{q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), q.stride(0), q.stride(1), out.stride(0),
           out.stride(1), q.size(1), k.size(1), dim, static_cast<float>(scale * 1.4426950408889634),
           window > 0 ? window : 0};
  std::vector<Seq> seqs;
  for (int64_t i = 0; i < n; ++i) seqs.push_back({b[i], 0, b[i + 1] - b[i]});
  const c10::BFloat16 *kd = k.data_ptr<c10::BFloat16>(), *vd = v.data_ptr<c10::BFloat16>();
  const int64_t k_s0 = k.stride(0), k_s1 = k.stride(1), v_s0 = v.stride(0), v_s1 = v.stride(1);
  attend(L, seqs, [&](int64_t i, int64_t g, uint32_t* kp, uint32_t* vp) {
    const int64_t t0 = seqs[i].t0;
    pack_kv(seqs[i].n, dim, [&](int64_t j) { return kd + (t0 + j) * k_s0 + g * k_s1; },
            [&](int64_t j) { return vd + (t0 + j) * v_s0 + g * v_s1; }, kp, vp);
  });
#else
  TORCH_CHECK(false, "prefill_attention needs a build for a CPU with AVX512-BF16 (see prefill_attention_supported)");
#endif
}

// Prefill chunks continuing their sequences (after a cached prefix, a long prompt's later chunks): queries of
// sequence b at rows spans[b][0].. of q/out and positions spans[b][1].., spans[b][2] of them; keys 0 ..
// spans[b][1] + spans[b][2] - 1 read from the paged cache (the step's own already written there) by
// block_table[b]. Cache layout (common/engine/kv_cache.py): [layers, 2 (K|V), kv_heads, num_blocks, block_size,
// head_dim].
void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& cache, int64_t layer,
                             const at::Tensor& block_table, const at::Tensor& spans, double scale, int64_t window) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && out.sizes() == q.sizes(), "q, out: [tokens, heads, dim]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &out, &cache})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(-1) == 1, "q, out, cache: bfloat16, unit dim stride");
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
  Layout L{q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), q.stride(0), q.stride(1), out.stride(0),
           out.stride(1), q.size(1), kv_heads, dim, static_cast<float>(scale * 1.4426950408889634),
           window > 0 ? window : 0};
  const c10::BFloat16* base = cache.data_ptr<c10::BFloat16>() + layer * cache.stride(0);
  const int64_t kv_s = cache.stride(1), head_s = cache.stride(2), block_s = cache.stride(3), slot_s = cache.stride(4);
  attend(L, seqs, [&](int64_t b, int64_t g, uint32_t* kp, uint32_t* vp) {
    const int64_t* blocks = table + b * width;
    auto row = [&](int64_t kv, int64_t j) {
      return base + kv * kv_s + g * head_s + blocks[j / block_size] * block_s + (j % block_size) * slot_s;
    };
    pack_kv(seqs[b].pos0 + seqs[b].n, dim, [&](int64_t j) { return row(0, j); }, [&](int64_t j) { return row(1, j); },
            kp, vp);
  });
#else
  TORCH_CHECK(false, "paged_prefill_attention needs a build for a CPU with AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("prefill_attention_supported() -> bool");
  m.impl("prefill_attention_supported", c10::DispatchKey::CatchAll, TORCH_FN(prefill_attention_supported));
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor bounds, float scale, int window) -> "
      "()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor cache, int layer, Tensor block_table, Tensor spans, "
      "float scale, int window) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_attention));
}
