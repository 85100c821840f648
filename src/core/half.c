/* IEEE binary16 conversions (bf16 ones are inline in core.h). */
#include <math.h>
#include <string.h>

#include "core.h"

float mq_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {   /* subnormal: value = man * 2^-24 */
            float v = (float)man * 0x1p-24f;
            memcpy(&bits, &v, 4);
            bits |= sign;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t mq_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u;        /* NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;       /* rounds to >= 65536: inf */
    if (ax < 0x38800000u) {                             /* below the smallest normal 2^-14 */
        /* subnormal: round(|f| * 2^24) with ties to even, computed exactly in fp32 */
        float a;
        memcpy(&a, &ax, 4);
        float scaled = a * 0x1p24f;                     /* exact: power-of-two scaling */
        float r = nearbyintf(scaled);                   /* default rounding mode is RNE */
        return sign | (uint16_t)r;
    }
    uint32_t man = ax & 0x7fffffu;
    uint32_t exp = (ax >> 23) - 112;
    uint32_t h = (exp << 10) | (man >> 13);
    uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}
