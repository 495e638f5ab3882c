// The GGUF types block_kernel_more_isa.cc unpacks for the block kernel (block_kernel_isa.cc), beside
// the ones that file unpacks itself: Q3_K, IQ4_XS, IQ4_NL, Q5_1 and Q2_K. Plain C inline functions with
// internal linkage, so the glue (baseline CPU) and every per-ISA object each hold their own copy.
//
// The contract of an unpacker (shared with block_kernel_isa.cc's own): one row of W [K weights] becomes
// int8 levels [K], a float scale per 16 inputs [K / 16] and, for the types with a minimum, a float
// minimum per 16 inputs [K / 16], such that weight k = scale[k / 16] * level[k] - min[k / 16] with
// exactly the float32 factors gguf-py's dequantiser multiplies (model/ggml.py mirrors it).
#pragma once
#include <stdint.h>

#include "quant_kernel.h"

// (Q5_1, Q2_K, Q3_K, IQ4_NL and IQ4_XS: their ids are in quant_kernel.h, whose skippy_int8_block_type lists them)

// Weights and bytes per block of one of these types; 0 (and nothing written) for any other type.
static inline int skippy_more_block(int64_t type, int64_t* block, int64_t* bytes) {
  switch (type) {
    case SKIPPY_GGML_Q5_1: *block = 32, *bytes = 24; return 1;
    case SKIPPY_GGML_IQ4_NL: *block = 32, *bytes = 18; return 1;
    case SKIPPY_GGML_Q2_K: *block = 256, *bytes = 84; return 1;
    case SKIPPY_GGML_Q3_K: *block = 256, *bytes = 110; return 1;
    case SKIPPY_GGML_IQ4_XS: *block = 256, *bytes = 136; return 1;
    default: return 0;
  }
}

// Whether a type of this file subtracts a minimum per 16 inputs (its unpacker writes `min`).
static inline int skippy_more_has_min(int64_t type) {
  return type == SKIPPY_GGML_Q2_K || type == SKIPPY_GGML_Q5_1;
}

// Unpacks weights [k0, k0 + count) of one row of W (a `type` of this file; k0 and count multiples of its
// block) as above, into level[0 .. count), scale and min[0 .. count / 16). In a per-ISA object
// (included after quant_kernel_simd.h) the name carries the ISA, skippy_unpack_more_<isa>, so each ISA's
// block loops call the unpacker built for the same ISA.
#if defined(SKIPPY_ISA) && defined(SKIPPY_CAT)
#define skippy_unpack_more SKIPPY_CAT(skippy_unpack_more_, SKIPPY_ISA)
extern "C" void skippy_unpack_more(int32_t type, const uint8_t* row, int64_t k0, int64_t count, int8_t* level,
                                   float* scale, float* min);
#endif
