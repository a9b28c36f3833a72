// bf16 linear layers on CPUs with AMX, over the pair packing of bf16_linear.cpp ([N_pad / 16, K / 2, 16, 2]).
//
// The pair packing is AMX's own layout for the right-hand operand: 16 consecutive pairs of one block of 16
// features are one B tile (16 rows of 64 bytes, 1 KiB contiguous). Decode shapes (a few rows) are where
// oneDNN's AMX matmul streams the weights slowly (10-13 GB/s in a 0.35B model's decode step on a 2-core Xeon
// whose copy runs at 22-24 GB/s); here the threads claim groups of three blocks and stream each front to back,
// every 16 rows of x one A tile (32 inputs a step). Against oneDNN's packed AMX matmul on that Xeon (the 0.35B
// model's shapes, weights hot): 1.12-1.37x at 1 to 16 rows, 0.86-1.68x at 64, 0.85-1.78x at 128. From
// kWidenRows rows (prefill) a slice of blocks is widened to plain bf16 [K, S] (one permute per pair vector) for
// torch's matmul (oneDNN's AMX GEMM): the tiles here reload A and B for every 16 x 16 product, which loses to
// oneDNN's blocking at prefill sizes (0.57-0.94x at 2,048 rows).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "amx.h"
#include "linear.h"
#include "parallel.h"

#ifdef PDSERVE_AMX
#define PDSERVE_BF16_AMX 1
#endif

namespace {

#ifdef PDSERVE_BF16_AMX

constexpr int64_t kWidenRows = 512;
// From kWidenRows rows, the GEMM takes the rows down to a multiple of kWidenGrain and the tiles the rest. oneDNN
// builds (JIT-compiles) its AMX GEMM for each row count it has not seen, 2-6 ms on a 2-core Xeon for a [m, 512] x
// [512, 704] product that then runs in 0.4-0.7 ms, and keeps 1,024 such builds: a prefill of a length it had not
// seen paid a build for every weight shape (60M Llama, prompts of 1,100-2,000 tokens: 1.19x the time of lengths
// seen before; now 1.03-1.04x, lengths seen before as fast as they were), and every MoE expert's row count was a
// new one (Qwen3-MoE 2,048-token prefill 4,468 -> 8,795 tok/s). Multiples of 64 are at most 64 builds a weight up
// to 4,096 rows; grains of 128 and 256 left more rows to the tiles, which run slower than a large GEMM.
constexpr int64_t kWidenGrain = 64;
constexpr int kGroup = 3;  // blocks a pass: three C tiles, one A tile, three B tiles (7 of the 8)
// Each block's stream is prefetched this far ahead (two B tiles), on a group's first pass of rows. The hardware
// prefetcher alone left the decode step's weights at 15-19 GB/s on the Intel AMX kind where a plain read runs
// at 19-22; the tile loads then wait on DRAM one after another.
constexpr int64_t kPrefetchAhead = 2048;

using pdserve::amx_permitted;
using pdserve::TileConfig;

// Tiles 0-2: C (rows x 16 floats), 3: A (rows x 32 bf16), 4-6: B (16 pair rows x 16 features x 2).
void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;
  cfg.rows[3] = rows, cfg.colsb[3] = 64;
  for (int t = 4; t < 7; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// rows (<= 16) of x (bf16, x_stride elements apart) against `count` (1-3) blocks starting at wb (each
// kp_count pair rows of 64 bytes); the rows x 16 float sums of block j to acc + 256 * j (rows 16 apart).
// `prefetch`: the blocks are not in cache yet (the group's first 16 rows).
void tile_pass(const c10::BFloat16* x, int64_t x_stride, const uint8_t* wb, int64_t kp_count, int count,
               float* acc, bool prefetch) {
  const int64_t block_bytes = kp_count * 64;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t kp = 0; kp < kp_count; kp += 16) {
    _tile_loadd(3, x + 2 * kp, x_stride * 2);
    const uint8_t* w = wb + kp * 64;
    if (prefetch)
      for (int j = 0; j < count; ++j)
        for (int64_t off = 0; off < 1024; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w + j * block_bytes + kPrefetchAhead + off), _MM_HINT_T0);
    _tile_loadd(4, w, 64);
    _tile_dpbf16ps(0, 3, 4);
    if (count > 1) {
      _tile_loadd(5, w + block_bytes, 64);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (count > 2) {
      _tile_loadd(6, w + 2 * block_bytes, 64);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, acc, 64);
  if (count > 1) _tile_stored(1, acc + 256, 64);
  if (count > 2) _tile_stored(2, acc + 512, 64);
}

// Columns of blocks [b0, b1) as plain bf16 [K, (b1 - b0) * 16], row-major: each 64-byte pair vector (16
// features x even, odd input) split by one permute into its even and odd inputs' rows.
void unpack_plain(const uint16_t* w, int64_t kp_count, int64_t b0, int64_t b1, uint16_t* dst) {
  const int64_t width = (b1 - b0) * 16;
  alignas(64) static const uint16_t order[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                 1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i idx = _mm512_load_si512(order);
  at::parallel_for(0, kp_count, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t kp = p0; kp < p1; ++kp) {
        const __m512i v = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(w + (b * kp_count + kp) * 32));
        uint16_t* even = dst + 2 * kp * width + (b - b0) * 16;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(even), _mm512_castsi512_si256(v));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + width), _mm512_extracti64x4_epi64(v, 1));
      }
  });
}

#endif

bool bf16_amx_supported() {
#ifdef PDSERVE_BF16_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x [..., K] bf16 (K a multiple of 32), packed from pack_bf16_pairs, bias [N] or None -> [..., N] bf16.
at::Tensor bf16_linear_amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                           int64_t n) {
#ifdef PDSERVE_BF16_AMX
  TORCH_CHECK(amx_permitted(), "bf16_linear_amx: the OS did not grant AMX state to this process");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_linear_amx takes bf16 CPU tensors");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous(),
              "packed must come from pack_bf16_pairs, got shape ", packed.sizes());
  const int64_t k = x.size(-1), kp_count = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(k == 2 * kp_count && k % 32 == 0 && n <= blocks * 16, "bf16_linear_amx: x has ", k,
              " input features (a multiple of 32 needed) and n is ", n, ", packed is ", packed.sizes());
  pdserve::LinearCall call = pdserve::linear_call(x, bias, n);
  const int64_t m = call.rows.size(0);
  if (m == 0) return call.out.view(call.shape);
  const auto* xp = call.rows.data_ptr<c10::BFloat16>();
  auto* op = call.out.data_ptr<c10::BFloat16>();
  const float* bp = call.bias_ptr();
  const int64_t used = (n + 15) / 16;  // blocks past n are padding
  int64_t r_first = 0;  // the rows from here on run on the tiles
  if (m >= kWidenRows) {
    r_first = m / kWidenGrain * kWidenGrain;
    const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
    pdserve::widened_gemm(call, used, [&](int64_t b0, int64_t b1, void* dst) {
      unpack_plain(w, kp_count, b0, b1, static_cast<uint16_t*>(dst));
    }, r_first);
    if (r_first == m) return call.out.view(call.shape);
  }
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const int64_t groups = (used + kGroup - 1) / kGroup;
  const int64_t m_tiles = m - r_first;
  xp += r_first * k;
  op += r_first * n;
  // at least two groups a claim where there are 16 claims or more: a thread's stream then runs on across six
  // blocks (at 16 rows, with the prefetch, claims of one group streamed 0.94-0.95x as fast as claims of two)
  const int64_t chunk =
      std::max(pdserve::claim_chunk(groups, m_tiles * k * 16 * kGroup), std::min<int64_t>(2, groups / 8));
  pdserve::parallel_claim(groups, chunk, [&](int64_t g0, int64_t g1) {
    alignas(64) float acc[kGroup * 256];
    int configured = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g * kGroup;
      const int count = static_cast<int>(std::min<int64_t>(kGroup, used - b));
      for (int64_t r0 = 0; r0 < m_tiles; r0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, m_tiles - r0));
        if (rows != configured) configure(rows), configured = rows;
        tile_pass(xp + r0 * k, k, w + b * kp_count * 64, kp_count, count, acc, r0 == 0);
        for (int j = 0; j < count; ++j) pdserve::store_block(acc + 256 * j, rows, bp, op + r0 * n, n, 16 * (b + j));
      }
    }
    if (configured) _tile_release();
  });
  return call.out.view(call.shape);
#else
  TORCH_CHECK(false, "bf16_linear_amx needs a build for a CPU with AMX-BF16 (see bf16_amx_supported)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("bf16_amx_supported() -> bool");
  m.impl("bf16_amx_supported", c10::DispatchKey::CatchAll, TORCH_FN(bf16_amx_supported));
  m.def("bf16_linear_amx(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.impl("bf16_linear_amx", c10::DispatchKey::CPU, TORCH_FN(bf16_linear_amx));
}
