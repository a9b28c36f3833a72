// Decode attention read straight from the paged KV cache, for the CPU.
//
// One query token per sequence; its keys are the first seq_lens[b] slots of the sequence's blocks
// (block_table[b]). Each (sequence, KV head) is one work item: the query heads that share the KV head
// score every key once (float accumulation, bf16 or fp32 storage), take a softmax in float and sum the
// values in float. No gather into a padded batch, no mask: what the batched SDPA path pays for in copies
// and in work over padding (see common/engine/attention.py).
//
// Cache layout (common/engine/kv_cache.py): [layers, 2 (K|V), kv_heads, num_blocks, block_size, head_dim].

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
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using pdserve::exp_nonpositive;
using pdserve::tanh_of;
using pdserve::round_to;
using pdserve::to_float;

// Asks for the rows of a block two ahead of the one being read: blocks are scattered, and a miss at each
// block's start (the hardware prefetcher stops at a jump) cost more than the arithmetic.
template <typename cache_t>
inline void prefetch_block(const cache_t* plane, const int64_t* blocks, int64_t next_pos, int64_t end,
                           int64_t block_size, int64_t dim) {
  if (next_pos >= end) return;
  const char* p = reinterpret_cast<const char*>(plane + blocks[next_pos / block_size] * block_size * dim);
  const int64_t bytes = block_size * dim * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}


template <typename cache_t>
inline __attribute__((always_inline)) void load_row(float* dst, const cache_t* src, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// q . k over one head. The AVX-512 build sums in two vector chains and reduces once with a shuffle tree: the
// compiler's own reduction of the simd loop ends in sixteen dependent scalar adds, the kernel's bottleneck.
template <int64_t DIM>
inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t dim) {
#if defined(__AVX512F__)
  if constexpr (DIM > 0 && DIM % 32 == 0) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int64_t d = 0; d < DIM; d += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < dim; ++d) s += a[d] * b[d];
  return s;
}

// acc += sum over r < count of w[r] * rows[r]: the accumulator stays in registers across the rows (in memory,
// each row's update waits on the last one's store).
template <int64_t DIM>
inline void weighted_rows(float* __restrict__ acc, const float* __restrict__ w, const float* __restrict__ rows,
                          int64_t count, int64_t dim) {
#if defined(__AVX512F__)
  if constexpr (DIM > 0 && DIM % 16 == 0 && DIM <= 256) {
    constexpr int64_t V = DIM / 16;
    __m512 a[V];
    for (int64_t c = 0; c < V; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t r = 0; r < count; ++r) {
      const __m512 wr = _mm512_set1_ps(w[r]);
      for (int64_t c = 0; c < V; ++c) a[c] = _mm512_fmadd_ps(wr, _mm512_loadu_ps(rows + r * DIM + 16 * c), a[c]);
    }
    for (int64_t c = 0; c < V; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
    return;
  }
#endif
  for (int64_t r = 0; r < count; ++r) {
    const float wr = w[r];
    const float* v = rows + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += wr * v[d];
  }
}

#if defined(__AVX512F__)
// Query and cache of one type, head size a multiple of 32 (up to 128), on AVX-512 CPUs (bf16: with AVX512-BF16):
// the item's scores and weighted values by runs of up to 16 keys. The generic path above spends most of its
// instructions converting each key row to float, reducing each dot product across lanes (a shuffle tree per key
// and query head) and storing it; here a key row leaves a vector of partial sums (bf16: vdpbf16ps on the query's
// and the key's bf16 pairs, two instructions per 32 dimensions; float: FMAs), one transposing tree of 45 shuffles
// and adds turns a run's 16 vectors into its 16 scores, and the values are read (bf16: widened) once per pair of
// query heads.

// lane j = the sum of v[j]'s 16 lanes (j < 16)
inline __m512 sum_lanes16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per chunk: the chunk's sums of v[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

using pdserve::load16;

// q . k[r]'s 16 partial sums
template <int64_t DIM>
inline __m512 partial_dot(const float* q, const float* k) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
  for (int64_t d = 16; d < DIM; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  return acc;
}

#if defined(__AVX512BF16__)
template <int64_t DIM>
inline __m512 partial_dot(const c10::BFloat16* q, const c10::BFloat16* k) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < DIM; d += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
  return acc;
}
#endif

// scores s[r] = scale * q . k[r] for `count` <= 16 consecutive key rows
template <int64_t DIM, typename T>
inline void score_run(float* s, const T* q, const T* k, int64_t count, float scale) {
  __m512 part[16];
  for (int64_t r = 0; r < count; ++r) part[r] = partial_dot<DIM>(q, k + r * DIM);
  for (int64_t r = count; r < 16; ++r) part[r] = _mm512_setzero_ps();
  const __m512 sums = _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << count) - 1), sums);
}

// acc[j] += sum over r < count of w[j][r] * v[r], for the H (1 or 2) query heads j whose weights start at w[j]
template <int64_t DIM, int H, typename T>
inline void weigh_run(float* acc, const float* const* w, const T* v, int64_t count) {
  constexpr int64_t V = DIM / 16;
  __m512 a[H][V];
  for (int j = 0; j < H; ++j)
    for (int64_t c = 0; c < V; ++c) a[j][c] = _mm512_loadu_ps(acc + j * DIM + 16 * c);
  for (int64_t r = 0; r < count; ++r) {
    __m512 row[V];
    for (int64_t c = 0; c < V; ++c) row[c] = load16(v + r * DIM + 16 * c);
    for (int j = 0; j < H; ++j) {
      const __m512 wr = _mm512_set1_ps(w[j][r]);
      for (int64_t c = 0; c < V; ++c) a[j][c] = _mm512_fmadd_ps(wr, row[c], a[j][c]);
    }
  }
  for (int j = 0; j < H; ++j)
    for (int64_t c = 0; c < V; ++c) _mm512_storeu_ps(acc + j * DIM + 16 * c, a[j][c]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same runs on CPUs with AVX2 alone (Zen 2 and 3), head sizes a multiple of 32: the query in float (scaled
// once, as the generic path has it), each key row widened in registers into a vector of 8 partial sums, a tree of
// 6 horizontal adds and a lane swap turning 8 such vectors into 8 scores; values weighed 32 dims at a time, each
// row widened once for both query heads of a pair. The generic path ran at 5-10 GB/s of K and V here (16
// sequences of 2,048 keys), its dot products each reduced across lanes on their own.

using pdserve::load8;

// lane j = the sum of v[j]'s 8 lanes
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // u0: the sums of v[0..3]'s low halves, then of their high halves; u1 likewise for v[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k's 8 partial sums (q: DIM floats)
template <int64_t DIM, typename T>
inline __m256 partial_dot8(const float* q, const T* k) {
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
  __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), load8(k + 8));
  for (int64_t d = 16; d < DIM; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
  }
  return _mm256_add_ps(a0, a1);
}

// s[r] = q . k[r] for `count` <= 16 consecutive key rows (q scaled already)
template <int64_t DIM, typename T>
inline void score_run8(float* s, const float* q, const T* k, int64_t count) {
  for (int64_t r0 = 0; r0 < count; r0 += 8) {
    const int64_t rows = std::min<int64_t>(8, count - r0);
    __m256 part[8];
    for (int64_t r = 0; r < rows; ++r) part[r] = partial_dot8<DIM>(q, k + (r0 + r) * DIM);
    for (int64_t r = rows; r < 8; ++r) part[r] = _mm256_setzero_ps();
    const __m256 sums = sum_lanes8(part);
    if (rows == 8) {
      _mm256_storeu_ps(s + r0, sums);
    } else {
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      _mm256_maskstore_ps(s + r0, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rows)), lane), sums);
    }
  }
}

// acc[j] += sum over r < count of w[j][r] * v[r], for the H (1 or 2) query heads j whose weights start at w[j]
template <int64_t DIM, int H, typename T>
inline void weigh_run8(float* acc, const float* const* w, const T* v, int64_t count) {
  for (int64_t c = 0; c < DIM; c += 32) {  // 4 H accumulators, a row's 4 vectors and a broadcast in registers
    __m256 a[H][4];
    for (int j = 0; j < H; ++j)
      for (int u = 0; u < 4; ++u) a[j][u] = _mm256_loadu_ps(acc + j * DIM + c + 8 * u);
    for (int64_t r = 0; r < count; ++r) {
      __m256 row[4];
      for (int u = 0; u < 4; ++u) row[u] = load8(v + r * DIM + c + 8 * u);
      for (int j = 0; j < H; ++j) {
        const __m256 wr = _mm256_set1_ps(w[j][r]);
        for (int u = 0; u < 4; ++u) a[j][u] = _mm256_fmadd_ps(wr, row[u], a[j][u]);
      }
    }
    for (int j = 0; j < H; ++j)
      for (int u = 0; u < 4; ++u) _mm256_storeu_ps(acc + j * DIM + c + 8 * u, a[j][u]);
  }
}
#endif

// The largest of x[0, n), a vector at a time: the compiler's own reduction of std::max stayed scalar, one dependent
// vmaxss an element (14% of the kernel's time on keys in L2; the kernel 1.10x faster on 16 sequences of ~190 keys).
inline float row_max(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 a = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), b = a;
  int64_t t = 0;
  for (; t + 32 <= n; t += 32) {
    a = _mm512_max_ps(a, _mm512_loadu_ps(x + t));
    b = _mm512_max_ps(b, _mm512_loadu_ps(x + t + 16));
  }
  for (; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
    a = _mm512_mask_max_ps(a, k, a, _mm512_maskz_loadu_ps(k, x + t));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
#elif defined(__AVX2__)
  __m256 a = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) a = _mm256_max_ps(a, _mm256_loadu_ps(x + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, x[t]);
  return m;
#endif
}

// DIM > 0: the head size as a constant (the inner loops unroll into a few vector instructions); 0: any size.
template <typename q_t, typename cache_t, int64_t DIM>
void decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& cache, int64_t layer,
                      const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t window,
                      float softcap, const float* sinks) {
  const int64_t batch = query.size(0), q_heads = query.size(1), dim = DIM > 0 ? DIM : query.size(2);
  const int64_t kv_heads = cache.size(2), num_blocks = cache.size(3), block_size = cache.size(4);
  const int64_t group = q_heads / kv_heads;
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t table_width = block_table.size(1);
  const q_t* q_base = query.data_ptr<q_t>();
  q_t* o_base = out.data_ptr<q_t>();
  const cache_t* layer_base = cache.data_ptr<cache_t>() + layer * cache.stride(0);
  const int64_t plane = num_blocks * block_size * dim;  // one (K|V, head) plane
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
#if defined(__AVX512BF16__)
  constexpr bool bf16_fast = std::is_same_v<cache_t, c10::BFloat16>;
#else
  constexpr bool bf16_fast = false;
#endif
#if defined(__AVX512F__)
  constexpr bool fast = std::is_same_v<q_t, cache_t> && (std::is_same_v<cache_t, float> || bf16_fast) && DIM > 0 &&
                        DIM % 32 == 0 && DIM <= 128;  // score_run and weigh_run
#else
  constexpr bool fast = false;
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  constexpr bool fast8 = DIM > 0 && DIM % 32 == 0;  // score_run8 and weigh_run8, any dtypes
#endif

  // (sequence, KV head) items claimed in chunks as the threads come (parallel.h): items differ in length, and a
  // preempted thread holds no share back. Head-major: the next item reads the same head's plane for the next
  // sequence, whose blocks often follow this one's (a batch's prompts are given blocks in order), so the hardware
  // prefetcher streams on across items (sequence-major, each item jumped to another plane: the kernel alone, 16
  // sequences of 500 tokens with their blocks in order, took 12% longer)
  pdserve::parallel_claim(batch * kv_heads, std::max<int64_t>(1, batch * kv_heads / 16), [&](int64_t begin,
                                                                                         int64_t end) {
    std::vector<float> q(group * dim), acc(group * dim), rows(block_size * dim), scores, total(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item % batch, h = item / batch;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* blocks = table + b * table_width;
      const cache_t* k_plane = layer_base + h * plane;
      const cache_t* v_plane = layer_base + (kv_heads + h) * plane;
      for (int64_t j = 0; j < (fast ? 0 : group); ++j) {  // the fast path reads the query as it is
        const q_t* src = q_base + b * q_s0 + (h * group + j) * q_s1;
        float* dst = q.data() + j * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(src[d]) * fscale;
      }
      scores.resize(group * n);
      // scores, one block's keys at a time: its rows in float once, then every query head over them
      const int64_t second = first - first % block_size + block_size;  // the start of the item's second block
      for (const cache_t* plane : {k_plane, v_plane}) {
        prefetch_block(plane, blocks, first, len, block_size, dim);
        prefetch_block(plane, blocks, second, len, block_size, dim);
      }
      for (int64_t pos = first; pos < len;) {
        const int64_t off = pos % block_size, count = std::min<int64_t>({block_size - off, len - pos, 16});
        prefetch_block(k_plane, blocks, pos - off + 2 * block_size, len, block_size, dim);
        const cache_t* keys = k_plane + (blocks[pos / block_size] * block_size + off) * dim;
#if defined(__AVX512F__)
        if constexpr (fast) {
          for (int64_t j = 0; j < group; ++j)
            score_run<DIM>(scores.data() + j * n + (pos - first), q_base + b * q_s0 + (h * group + j) * q_s1, keys,
                           count, fscale);
          pos += count;
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (fast8) {
          for (int64_t j = 0; j < group; ++j)
            score_run8<DIM>(scores.data() + j * n + (pos - first), q.data() + j * dim, keys, count);
          pos += count;
          continue;
        }
#endif
        load_row(rows.data(), keys, count * dim);
        for (int64_t j = 0; j < group; ++j) {
          const float* __restrict__ qj = q.data() + j * dim;
          float* __restrict__ sj = scores.data() + j * n + (pos - first);
          for (int64_t r = 0; r < count; ++r) sj[r] = dot<DIM>(qj, rows.data() + r * dim, dim);
        }
        pos += count;
      }
      for (int64_t j = 0; j < group; ++j) {
        float* __restrict__ sj = scores.data() + j * n;
        if (softcap > 0.f) {  // Gemma 2: cap * tanh(score / cap)
          // the cap a local: read through the lambda's reference, GCC saw control flow and left the loop scalar
          // (2.3 ns a score: a capped layer of 16 x 2,048 keys took 1.7x an uncapped one on a Zen 4)
          const float cap = softcap;
          int64_t t = 0;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
          const __m256 cap8 = _mm256_set1_ps(cap);
          for (; t + 8 <= n; t += 8)
            _mm256_storeu_ps(sj + t,
                             _mm256_mul_ps(cap8, pdserve::tanh_of8(_mm256_div_ps(_mm256_loadu_ps(sj + t), cap8))));
#endif
#pragma omp simd
          for (int64_t u = t; u < n; ++u) sj[u] = cap * tanh_of(sj[u] / cap);
        }
        float m = row_max(sj, n);
        float sum = 0.f;
        if (sinks != nullptr) {  // GPT-OSS: a sink logit per query head, in the softmax and weighing no value
          const float sink = sinks[h * group + j];
          m = std::max(m, sink);
          sum = exp_nonpositive(sink - m);
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          sj[t] = exp_nonpositive(sj[t] - m);
          sum += sj[t];
        }
        total[j] = sum;
      }
      // weighted values, block by block in the same way
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = first; pos < len;) {
        const int64_t off = pos % block_size, count = std::min<int64_t>({block_size - off, len - pos, 16});
        prefetch_block(v_plane, blocks, pos - off + 2 * block_size, len, block_size, dim);
        const cache_t* values = v_plane + (blocks[pos / block_size] * block_size + off) * dim;
#if defined(__AVX512F__)
        if constexpr (fast) {
          for (int64_t j = 0; j < group; j += 2) {
            const float* wj = scores.data() + j * n + (pos - first);
            const float* w[2] = {wj, j + 1 < group ? wj + n : wj};
            if (j + 1 < group)
              weigh_run<DIM, 2>(acc.data() + j * dim, w, values, count);
            else
              weigh_run<DIM, 1>(acc.data() + j * dim, w, values, count);
          }
          pos += count;
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (fast8) {
          for (int64_t j = 0; j < group; j += 2) {
            const float* wj = scores.data() + j * n + (pos - first);
            const float* w[2] = {wj, j + 1 < group ? wj + n : wj};
            if (j + 1 < group)
              weigh_run8<DIM, 2>(acc.data() + j * dim, w, values, count);
            else
              weigh_run8<DIM, 1>(acc.data() + j * dim, w, values, count);
          }
          pos += count;
          continue;
        }
#endif
        load_row(rows.data(), values, count * dim);
        for (int64_t j = 0; j < group; ++j)
          weighted_rows<DIM>(acc.data() + j * dim, scores.data() + j * n + (pos - first), rows.data(), count, dim);
        pos += count;
      }
      for (int64_t j = 0; j < group; ++j) {
        q_t* dst = o_base + b * o_s0 + (h * group + j) * o_s1;
        const float inv = 1.f / total[j];
        for (int64_t d = 0; d < dim; ++d) dst[d] = round_to<q_t>(acc[j * dim + d] * inv);
      }
    }
  });
}

template <typename q_t, typename cache_t>
void dispatch_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& cache, int64_t layer,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t window,
                  float softcap, const float* sinks) {
  switch (query.size(2)) {
    case 64:
      return decode_attention<q_t, cache_t, 64>(out, query, cache, layer, block_table, seq_lens, scale, window,
                                                softcap, sinks);
    case 128:
      return decode_attention<q_t, cache_t, 128>(out, query, cache, layer, block_table, seq_lens, scale, window,
                                                 softcap, sinks);
    default:
      return decode_attention<q_t, cache_t, 0>(out, query, cache, layer, block_table, seq_lens, scale, window,
                                               softcap, sinks);
  }
}

// out [B, Hq, D] (written), query [B, Hq, D] (any strides with a unit last one), cache the whole KV cache,
// block_table [B, nb] int64, seq_lens [B] int64 (keys per sequence, the query's own included), window 0 = none;
// softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2); sinks [Hq] float: each query
// head's sink logit, a column of the softmax without a value (GPT-OSS).
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& cache, int64_t layer,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t window,
                            double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu() && cache.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [B, Hq, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need a unit stride on the last axis");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "out and query must share a dtype, got ", out.scalar_type(),
              " and ", query.scalar_type());
  TORCH_CHECK(cache.dim() == 6 && cache.size(1) == 2 && cache.is_contiguous(), "cache must be [L, 2, H, NB, bs, D]");
  TORCH_CHECK(cache.size(5) == query.size(2) && query.size(1) % cache.size(2) == 0, "head shapes do not match");
  TORCH_CHECK(layer >= 0 && layer < cache.size(0), "layer out of range: ", layer, " (the cache has ", cache.size(0),
              ")");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2 &&
                  block_table.size(0) == query.size(0),
              "block_table must be a contiguous [B, nb] int64 tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == query.size(0),
              "seq_lens must be a contiguous [B] int64 tensor");
  const int64_t capacity = block_table.size(1) * cache.size(4);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < query.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= capacity, "seq_lens[", b, "] = ", lens[b], " outside the block table");
    for (int64_t i = 0; i < (lens[b] + cache.size(4) - 1) / cache.size(4); ++i) {
      const int64_t blk = table[b * block_table.size(1) + i];
      TORCH_CHECK(blk >= 0 && blk < cache.size(3), "block id ", blk, " out of range");
    }
  }
  TORCH_CHECK(softcap >= 0, "paged_decode_attention: softcap must be positive (or 0: none), got ", softcap);
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                         sinks->size(0) == query.size(1)),
              "paged_decode_attention: sinks must be a contiguous float [Hq] tensor (Hq = ", query.size(1), "), got ",
              sinks->scalar_type(), " ", sinks->sizes(), sinks->is_contiguous() ? "" : " (not contiguous)");
  const float cap = static_cast<float>(softcap);
  const float* sink = sinks ? sinks->data_ptr<float>() : nullptr;
  const auto qt = query.scalar_type(), ct = cache.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat) {
    dispatch_dim<float, float>(out, query, cache, layer, block_table, seq_lens, scale, window, cap, sink);
  } else if (qt == at::kBFloat16 && ct == at::kBFloat16) {
    dispatch_dim<c10::BFloat16, c10::BFloat16>(out, query, cache, layer, block_table, seq_lens, scale, window, cap,
                                               sink);
  } else if (qt == at::kFloat && ct == at::kBFloat16) {
    dispatch_dim<float, c10::BFloat16>(out, query, cache, layer, block_table, seq_lens, scale, window, cap, sink);
  } else if (qt == at::kBFloat16 && ct == at::kFloat) {
    dispatch_dim<c10::BFloat16, float>(out, query, cache, layer, block_table, seq_lens, scale, window, cap, sink);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16, got ", qt, " and ", ct);
  }
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor cache, int layer, Tensor block_table, "
      "Tensor seq_lens, float scale, int window, float softcap=0., Tensor? sinks=None) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
