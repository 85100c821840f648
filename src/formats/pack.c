/*
 * 4-bit code packing shared by every checkpoint layout: two codes per byte with the first in the
 * low nibble (compressed-tensors nvfp4-pack-quantized, ModelOpt, torchao pack_uint4), and eight
 * codes per 32-bit word LSB first (compressed-tensors pack-quantized, GPTQ qweight/qzeros).
 * formats.md sections 2.1-2.4.
 */
#include "formats/formats.h"

void mq_pack_u4_bytes(const uint8_t *codes, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n / 2; i++)
        out[i] = (uint8_t)((codes[2 * i] & 0xF) | (codes[2 * i + 1] & 0xF) << 4);
}

void mq_unpack_u4_bytes(const uint8_t *packed, int64_t n, uint8_t *codes) {
    for (int64_t i = 0; i < n / 2; i++) {
        codes[2 * i] = packed[i] & 0xF;
        codes[2 * i + 1] = packed[i] >> 4;
    }
}

void mq_pack_u4_words(const uint8_t *codes, int64_t n, uint32_t *out) {
    for (int64_t i = 0; i < n / 8; i++) {
        uint32_t w = 0;
        for (int j = 0; j < 8; j++) w |= (uint32_t)(codes[8 * i + j] & 0xF) << (4 * j);
        out[i] = w;
    }
}

void mq_unpack_u4_words(const uint32_t *packed, int64_t n, uint8_t *codes) {
    for (int64_t i = 0; i < n / 8; i++)
        for (int j = 0; j < 8; j++) codes[8 * i + j] = (uint8_t)((packed[i] >> (4 * j)) & 0xF);
}
