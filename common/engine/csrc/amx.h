// What the engine's AMX kernels (bf16_amx.cpp, prefill_attention.cpp) share: the OS's permission for tile state
// and the tile configuration block. PDSERVE_AMX is defined where the build targets AMX-BF16 on Linux.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define PDSERVE_AMX 1

namespace pdserve {

// Linux hands out AMX state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), once.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// _tile_loadconfig's block (palette 1): each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace pdserve

#endif
