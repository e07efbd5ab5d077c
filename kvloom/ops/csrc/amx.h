// AMX tiles: whether the build and this process may use them, and the AMX-INT8 tile configuration of the code-block
// product (gemm_q4.cpp; amx_bf16.h has the AMX-BF16 one, shared by the dequantizing products). KVLOOM_AMX_INT8 is defined where the build has AMX-TILE / AMX-INT8 and the AVX-512 the
// epilogue uses (-march=native on an Intel Xeon 4th gen on). (The W8A8 product on Q8_0 blocks was tried on tiles
// the same way, its B tiles read in place: no faster at 16-64 rows, slower at 256, so it keeps VNNI.)
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512DQ__) && \
    defined(__linux__)
#define KVLOOM_AMX_INT8
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>

namespace kvloom::amx {

// Whether this process may use the tiles (Linux grants them on request, once) and KVLOOM_CPU_AMX is not 0.
inline bool ready() {
  static const bool granted = [] {
    const char* env = std::getenv("KVLOOM_CPU_AMX");
    if (env != nullptr && env[0] == '0' && env[1] == '\0') return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile 0: C, 16 rows x 16 int32 sums; 1: A, 16 rows x 32 s8 codes (a block of 32 k); 2: B, 8 quads of k x 16
// columns x 4 u8 codes. Per thread, before its first tile instruction.
inline void configure() {
  TileConfig config;
  config.rows[0] = 16;
  config.colsb[0] = 64;
  config.rows[1] = 16;
  config.colsb[1] = 32;
  config.rows[2] = 8;
  config.colsb[2] = 64;
  _tile_loadconfig(&config);
}

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVLOOM_AMX_BF16  // the dequantizing bf16 product: amx_bf16.h
#endif

}  // namespace kvloom::amx
#endif
