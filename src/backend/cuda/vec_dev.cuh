/*
 * Device twins of src/kernels/cpu/ref/vec_ref.c's scalar functions that the GPU passes share:
 * the same fp32 operations in the same order (the backend is built with -fmad=false; the fused
 * multiply-adds meant are written as fmaf), so each gives the CPU's bits.
 */
#ifndef MOEQ_BACKEND_CUDA_VEC_DEV_CUH
#define MOEQ_BACKEND_CUDA_VEC_DEV_CUH

#include <stdint.h>

#ifdef MQM_EMU
#define MQ_VEC_DEV inline
#else
#define MQ_VEC_DEV __device__ __forceinline__
#endif

namespace mqd {

MQ_VEC_DEV float pow2i(float k) { return __uint_as_float((uint32_t)((int32_t)k + 127) << 23); }

/* mq_vec_expf: Cody-Waite reduction by ln 2, a degree-6 polynomial, the scale in two halves so
 * that results near the limits stay finite. */
MQ_VEC_DEV float vec_expf(float x) {
    if (x != x) return x + x;
    x = -104.0f > x ? -104.0f : x;
    x = 88.75f < x ? 88.75f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    float y = fmaf(p, r * r, r) + 1.0f;
    float n1 = floorf(n * 0.5f), n2 = n - n1;
    return (y * pow2i(n1)) * pow2i(n2);
}

}  // namespace mqd

#endif
