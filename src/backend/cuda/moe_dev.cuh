/*
 * Device pieces of the MoE op on the GPU (moe.cu): the packed weight layout's decoders, the
 * tensor-core and asynchronous-copy instructions, and the scalar decoders of the exact path.
 *
 * Packed layout of one weight matrix W [N, K] (N outputs, K inputs; N a multiple of 16). Rows are
 * cut into strips of 16 and K is padded with zero weights to K64 (a multiple of 64); a strip is
 * K64 / 64 chunks of 512 bytes, and a chunk is 32 lanes x 4 words: word kk of lane l holds the 8
 * codes that lane l needs as the A operand of one mma.m16n8k16 on k-tile kk (16 inputs) of the
 * chunk. With g = l / 4 and t = l % 4 those are, in the order of the fragment's registers,
 *   a0 a1 = (row g,   k 2t, 2t+1)    a2 a3 = (row g+8, k 2t, 2t+1)
 *   a4 a5 = (row g,   k 2t+8, 2t+9)  a6 a7 = (row g+8, k 2t+8, 2t+9)
 * so a warp reads a chunk of a strip as one coalesced 512-byte load (a 16-byte load per lane) and
 * every lane decodes its own A fragments in registers (no shared-memory transposition).
 *   INT4  (code u, 0..15): a_{2j} in bits 4j..4j+3 and a_{2j+1} in bits 16+4j..: register j is
 *         ((w >> 4j) & 0x000F000F) | 0x43004300 = the bf16 pair (128 + u, 128 + u'), exact.
 *   NVFP4 (code = sign << 3 | magnitude index): the 3 magnitude bits of a_i in bits 4i..4i+2;
 *         the sign of a_i (i < 4) in bit 8i+7 and of a_{4+i} in bit 8i+3, so that byte-permute
 *         table lookups give the bf16 bytes of a0..a3 and a4..a7 and one masked or adds the signs.
 * Scales, per (strip, group, g): the rows g and g+8 as two adjacent entries. INT4: bf16 scales
 * (the canonical fp32 rounded to bf16), groups of G inputs, one pad group at the end; NVFP4: the
 * E4M3 bytes, one per k-tile; asymmetric INT4 also bf16 -(128 + z). Gate/up matrices interleave
 * their halves per strip: strip s = gate rows 8s..8s+7, then up rows 8s..8s+7, so that the SwiGLU
 * of a row happens in the registers of the lane that holds both halves.
 */
#ifndef MOEQ_BACKEND_CUDA_MOE_DEV_CUH
#define MOEQ_BACKEND_CUDA_MOE_DEV_CUH

#include <stdint.h>

#include "backend/cuda/kern_qual.cuh"

namespace mqm {

/* bf16 of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: high bytes and low bytes, 8 entries. */
constexpr uint32_t E2M1_HI0 = 0x3F3F3F00u, E2M1_HI1 = 0x40404040u;
constexpr uint32_t E2M1_LO0 = 0xC0800000u, E2M1_LO1 = 0xC0804000u;
constexpr uint32_t BF16X2_ONE = 0x3F803F80u;      /* (1, 1) */
constexpr uint32_t BF16X2_NEG136 = 0xC308C308u;   /* (-136, -136): -(128 + 8) */
constexpr uint32_t BF16X2_NEG0 = 0x80008000u;     /* (-0, -0) */

#ifdef MQM_EMU
MQD uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) { return ::mqm_emu::bf16x2_fma(a, b, c); }
#else
MQD uint32_t bf16x2_fma(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#endif

/* The bf16 pair (v, v) of the 16-bit value in the low (hi = 0) or high half of x. */
MQD uint32_t bcast_lo(uint32_t x) { return __byte_perm(x, x, 0x1010); }
MQD uint32_t bcast_hi(uint32_t x) { return __byte_perm(x, x, 0x3232); }

/* INT4: the A fragment of one k-tile from its word w; sg / sg8: (s, s) of rows g and g+8, og /
 * og8: (-(128 + z), ..) of rows g and g+8 (symmetric: -136). Weight = bf16(s * (u - z)). */
MQD void decode_int4(uint32_t w, uint32_t sg, uint32_t sg8, uint32_t og, uint32_t og8,
                                            uint32_t (&a)[4]) {
MQ_UNROLL
    for (int j = 0; j < 4; j++) {
        uint32_t r = ((w >> (4 * j)) & 0x000F000Fu) | 0x43004300u;
        r = bf16x2_fma(r, BF16X2_ONE, (j & 1) ? og8 : og);   /* u - z, exact */
        a[j] = bf16x2_fma(r, (j & 1) ? sg8 : sg, BF16X2_NEG0);
    }
}

/* NVFP4: the A fragment of one k-tile; sg / sg8: (s, s) of the E4M3 scales of rows g and g+8 as
 * bf16 (exact). e2m1 * e4m3 has at most 6 significant bits: the weights are exact in bf16. */
MQD void decode_nvfp4(uint32_t w, uint32_t sg, uint32_t sg8, uint32_t (&a)[4]) {
    const uint32_t m = w & 0x77777777u, mh = m >> 16;
    uint32_t hl = __byte_perm(E2M1_HI0, E2M1_HI1, m), ll = __byte_perm(E2M1_LO0, E2M1_LO1, m);
    uint32_t hh = __byte_perm(E2M1_HI0, E2M1_HI1, mh), lh = __byte_perm(E2M1_LO0, E2M1_LO1, mh);
    hl |= w & 0x80808080u;
    hh |= (w << 4) & 0x80808080u;
    a[0] = bf16x2_fma(__byte_perm(ll, hl, 0x5140), sg, BF16X2_NEG0);
    a[1] = bf16x2_fma(__byte_perm(ll, hl, 0x7362), sg8, BF16X2_NEG0);
    a[2] = bf16x2_fma(__byte_perm(lh, hh, 0x5140), sg, BF16X2_NEG0);
    a[3] = bf16x2_fma(__byte_perm(lh, hh, 0x7362), sg8, BF16X2_NEG0);
}

/* The position of element (row r of the strip, 0..15; input kin of the k-tile, 0..15) in the
 * layout: the lane and the fragment index a_i. */
MQHD void frag_pos(int r, int kin, int *lane, int *ai) {
    const int g = r & 7, hi = r >> 3, t = (kin & 7) >> 1, e = kin & 1, half = kin >> 3;
    *lane = g * 4 + t;
    *ai = half * 4 + hi * 2 + e;
}

/* The 4-bit code of fragment element ai in word w. */
MQHD uint32_t int4_code(uint32_t w, int ai) {
    return (w >> (4 * (ai >> 1) + 16 * (ai & 1))) & 15u;
}
MQHD uint32_t nvfp4_code(uint32_t w, int ai) {
    const uint32_t mag = (w >> (4 * ai)) & 7u;
    const int sbit = ai < 4 ? 8 * ai + 7 : 8 * (ai - 4) + 3;
    return mag | (((w >> sbit) & 1u) << 3);
}
/* The bits a code sets in its word (the packer's inverse of the two above). */
MQHD uint32_t int4_bits(uint32_t code, int ai) {
    return (code & 15u) << (4 * (ai >> 1) + 16 * (ai & 1));
}
MQHD uint32_t nvfp4_bits(uint32_t code, int ai) {
    const int sbit = ai < 4 ? 8 * ai + 7 : 8 * (ai - 4) + 3;
    return ((code & 7u) << (4 * ai)) | (((code >> 3) & 1u) << sbit);
}

/* E4M3 byte -> value (the CPU kernels' e4m3_value: exact). */
MQHD float e4m3_value(uint32_t b) {
    const int e = (int)((b >> 3) & 15u), m = (int)(b & 7u);
    float v = e == 0 ? (float)m * 0x1p-9f : ldexpf(1.0f + (float)m * 0.125f, e - 7);
    return (b & 0x80u) ? -v : v;
}
/* The doubled E2M1 value of a code as the CPU's integers use it (2 * e2m1: 0..12, signed). */
MQHD int e2m1_x2(uint32_t c) {
    const int mag[8] = {0, 1, 2, 3, 4, 6, 8, 12};
    return (c & 8u) ? -mag[c & 7u] : mag[c & 7u];
}

/* ---- instructions -------------------------------------------------------------------------- */
#ifdef MQM_EMU
MQD void cp_async16(void *smem, const void *gmem) { ::mqm_emu::copy16(smem, gmem); }
MQD void cp_async_commit() {}
template <int N> MQD void cp_async_wait() {}
MQD void ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
    ::mqm_emu::ldmatrix(4, p, &r0, &r1, &r2, &r3);
}
MQD void ldmatrix_x2(uint32_t &r0, uint32_t &r1, const void *p) { ::mqm_emu::ldmatrix(2, p, &r0, &r1, nullptr, nullptr); }
MQD void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { ::mqm_emu::mma_bf16(c, a, b0, b1); }
#else
MQD uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

MQD void cp_async16(void *smem, const void *gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
MQD void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> MQD void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

MQD void ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}
MQD void ldmatrix_x2(uint32_t &r0, uint32_t &r1, const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(smem_addr(p)));
}

/* c += a b: m16n8k16, bf16 operands, fp32 accumulators. */
MQD void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif

}  // namespace mqm

#endif
