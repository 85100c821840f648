/*
 * 4-bit code packing shared by every checkpoint layout: two codes per byte with the first in the
 * low nibble (compressed-tensors nvfp4-pack-quantized, ModelOpt, torchao pack_uint4), and eight
 * codes per 32-bit word LSB first (compressed-tensors pack-quantized, GPTQ qweight/qzeros).
 * formats.md sections 2.1-2.4.
 */
#include "formats/formats.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

void mq_pack_u4_bytes_ref(const uint8_t *codes, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n / 2; i++)
        out[i] = mq_u4_pair(codes[2 * i], codes[2 * i + 1]);
}

/* 32 codes a step with SSE2 (every x86-64 CPU): a byte pair (c0, c1) as one 16-bit lane
 * c0 | c1 << 8, that lane | itself >> 4 holds c0 | c1 << 4 in its low byte, and packus keeps
 * the low bytes. The scalar loop took a millisecond for a 2048 x 1024 weight, most of a chunk's
 * write at 16 threads. */
void mq_pack_u4_bytes(const uint8_t *codes, int64_t n, uint8_t *out) {
    int64_t i = 0;
#if defined(__SSE2__)
    if (!mq_force_ref()) {
        const __m128i nib = _mm_set1_epi8(0x0F), low = _mm_set1_epi16(0x00FF);
        for (; i + 32 <= n; i += 32) {
            __m128i a = _mm_and_si128(_mm_loadu_si128((const __m128i *)(codes + i)), nib);
            __m128i b = _mm_and_si128(_mm_loadu_si128((const __m128i *)(codes + i + 16)), nib);
            a = _mm_and_si128(_mm_or_si128(a, _mm_srli_epi16(a, 4)), low);
            b = _mm_and_si128(_mm_or_si128(b, _mm_srli_epi16(b, 4)), low);
            _mm_storeu_si128((__m128i *)(out + i / 2), _mm_packus_epi16(a, b));
        }
    }
#endif
    mq_pack_u4_bytes_ref(codes + i, n - i, out + i / 2);
}

void mq_unpack_u4_bytes(const uint8_t *packed, int64_t n, uint8_t *codes) {
    for (int64_t i = 0; i < n / 2; i++) {
        codes[2 * i] = mq_u4_first(packed[i]);
        codes[2 * i + 1] = mq_u4_second(packed[i]);
    }
}

void mq_pack_u4_words(const uint8_t *codes, int64_t n, uint32_t *out) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* a word of eight codes LSB first is, in memory, the four bytes of the byte packing */
    if (!mq_force_ref()) {
        mq_pack_u4_bytes(codes, n / 8 * 8, (uint8_t *)out);
        return;
    }
#endif
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
