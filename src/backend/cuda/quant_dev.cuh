/*
 * Device twins of the scalar quantization functions of src/formats/ (codecs.c, quant.c): the
 * same IEEE fp32/fp64 operations in the same order, so codes, scales and search results are
 * bit-identical to the CPU's for the same inputs (tests/gpu/test_gpu.c checks every E4M3/E2M1
 * input class and random groups of every scheme). The backend is built with -fmad=false: a
 * product followed by a sum stays two roundings, as in the C code (C11, no contraction); the
 * fused multiply-adds that are meant are written as fmaf.
 */
#ifndef MOEQ_BACKEND_CUDA_QUANT_DEV_CUH
#define MOEQ_BACKEND_CUDA_QUANT_DEV_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

extern "C" {
#include "formats/formats.h"
#include "quant/gptq.h"
}

#ifdef MQM_EMU   /* compiled as host code by the SIMT emulator (kvattn_emu.cu) */
#define DEV inline
#else
#define DEV __device__ __forceinline__
#endif

namespace mqd {

constexpr float E2M1_MAX = 6.0f;
constexpr float E4M3_MAX = 448.0f;

/* mq_gparams' layout, so device arrays of it copy straight into an mq_qtensor. */
static_assert(sizeof(mq_gparams) == 12, "mq_gparams layout");

/* The codecs are codecs_inline.h's (formats.h includes it), the CPU's very lines. */
DEV uint8_t e2m1_encode(float x) { return mq_e2m1_encode_inl(x); }
DEV float e2m1_decode(uint8_t code) { return mq_e2m1_decode_inl(code); }
DEV uint8_t e4m3_encode(float x) { return mq_e4m3_encode(x); }
/* e4m3 value of a non-negative code */
DEV float e4m3_value(uint8_t code) { return mq_e4m3_value(code); }
DEV uint8_t e8m0_encode_ceil(float x) { return mq_e8m0_encode_ceil_inl(x); }
DEV float e8m0_decode(uint8_t bits) { return mq_e8m0_decode_inl(bits); }

DEV float round_to_dtype(float x, moeq_dtype dt) {
    if (dt == MOEQ_DT_BF16) return __bfloat162float(__float2bfloat16_rn(x));
    if (dt == MOEQ_DT_F16) {
        if (fabsf(x) > 65504.0f) return x > 0 ? 65504.0f : -65504.0f;
        return __half2float(__float2half_rn(x));
    }
    return x;
}

DEV float group_step(const mq_qspec &s, float gs, const mq_gparams &g) {
    if (s.scheme == MQ_QS_NVFP4) return s.nvfp4_conv == MQ_NVFP4_MUL ? g.scale * gs : g.scale / gs;
    return g.scale;
}

DEV uint8_t quant_step(const mq_qspec &s, float step, float zero, float x) {
    return mq_code_of_step(s.scheme == MQ_QS_INT4, s.asym, step, zero, x);
}

DEV float dequant_step(const mq_qspec &s, float step, float zero, uint8_t code) {
    return mq_value_of_code(s.scheme == MQ_QS_INT4, s.asym, step, zero, code);
}

DEV void params_scaled(const mq_qspec &s, float gs, float amax, float xmin, float xmax, float m,
                       mq_gparams &out) {
    out.zero = 0.0f;
    out.scale_code = 0;
    switch (s.scheme) {
    case MQ_QS_NVFP4: {
        float t = amax / E2M1_MAX;
        t = s.nvfp4_conv == MQ_NVFP4_MUL ? t / gs : gs * t;
        if (m != 1.0f) t = t * m;
        if (t < s.nvfp4_scale_min) t = s.nvfp4_scale_min;
        if (t > E4M3_MAX) t = E4M3_MAX;
        uint8_t code = e4m3_encode(t);
        if (code == 0 && amax > 0) code = 0x01;
        out.scale_code = code;
        out.scale = e4m3_value(code);
        return;
    }
    case MQ_QS_MXFP4: {
        float t = amax / E2M1_MAX;
        if (m != 1.0f) t = t * m;
        if (!(amax > 0)) {
            out.scale = 0.0f;
            return;
        }
        out.scale_code = e8m0_encode_ceil(t);
        out.scale = e8m0_decode(out.scale_code);
        return;
    }
    case MQ_QS_INT4: {
        float scale;
        if (s.asym) {
            float lo = xmin < 0.0f ? xmin : 0.0f, hi = xmax > 0.0f ? xmax : 0.0f;
            if (m != 1.0f) {
                lo = lo * m;
                hi = hi * m;
            }
            scale = (hi - lo) / 15.0f;
            if (scale > 0.0f) {
                scale = round_to_dtype(scale, s.scale_dtype);
                if (scale == 0.0f) scale = round_to_dtype(0x1p-24f, s.scale_dtype);
                float z = rintf(-lo / scale);
                float zmin = (float)s.int4_zero_min;
                out.zero = z < zmin ? zmin : z > 15.0f ? 15.0f : z;
            } else {
                scale = 0.0f;
            }
        } else {
            const bool flip = s.int4_signed_scale && xmax > -xmin;   /* quant.c's signed scales */
            scale = amax / (s.int4_signed_scale ? 8.0f : s.int4_sym_div);
            if (m != 1.0f) scale = scale * m;
            if (scale > 0.0f) {
                scale = round_to_dtype(scale, s.scale_dtype);
                if (scale == 0.0f) scale = 0x1p-24f;
                if (flip) scale = -scale;
            } else {
                scale = 0.0f;
            }
        }
        out.scale = scale;
        return;
    }
    default: out.scale = 0.0f; return;
    }
}

DEV uint8_t nvfp4_code(const mq_qspec &s, float t0, float m) {
    float t = t0 * m;
    if (t < s.nvfp4_scale_min) t = s.nvfp4_scale_min;
    if (t > E4M3_MAX) t = E4M3_MAX;
    uint8_t code = e4m3_encode(t);
    return code == 0 ? 0x01 : code;
}

DEV float grid_m(const mq_qspec &s, int32_t i) {
    return s.mse_steps == 1 ? s.mse_lo
                            : s.mse_lo + (s.mse_hi - s.mse_lo) * (float)i / (float)(s.mse_steps - 1);
}

/* quant.c's cand_iter: the search's candidates in grid order, consecutive repeats removed. */
struct cand_iter {
    float gs, amax, xmin, xmax, t0;
    int32_t i;
    unsigned code, last;
    bool dense;
    mq_gparams prev;
};

DEV void cand_init(cand_iter &it, const mq_qspec &s, float gs, float amax, float xmin, float xmax) {
    it.gs = gs;
    it.amax = amax;
    it.xmin = xmin;
    it.xmax = xmax;
    it.i = 0;
    it.dense = false;
    it.t0 = 0;
    it.code = it.last = 0;
    if (s.scheme != MQ_QS_NVFP4) return;
    float t0 = amax / E2M1_MAX;
    it.t0 = t0 = s.nvfp4_conv == MQ_NVFP4_MUL ? t0 / gs : gs * t0;
    const int32_t steps = s.mse_steps;
    it.dense = steps > 1 && isfinite(t0) && s.mse_lo > 0 && s.mse_hi >= s.mse_lo &&
               (s.mse_hi - s.mse_lo) / (float)(steps - 1) < 0.0625f * s.mse_lo;
    if (it.dense) {
        it.code = nvfp4_code(s, t0, grid_m(s, 0));
        it.last = nvfp4_code(s, t0, grid_m(s, steps - 1));
    }
}

DEV bool cand_next(cand_iter &it, const mq_qspec &s, mq_gparams &c) {
    if (it.dense) {
        if (it.code > it.last) return false;
        c.scale = e4m3_value((uint8_t)it.code);
        c.zero = 0.0f;
        c.scale_code = (uint8_t)it.code;
        it.code++;
        return true;
    }
    while (it.i < s.mse_steps) {
        float m = grid_m(s, it.i);
        if (s.scheme == MQ_QS_NVFP4) {
            uint8_t code = nvfp4_code(s, it.t0, m);
            c.scale = e4m3_value(code);
            c.zero = 0.0f;
            c.scale_code = code;
        } else {
            params_scaled(s, it.gs, it.amax, it.xmin, it.xmax, m, c);
        }
        bool repeat = it.i > 0 && c.scale == it.prev.scale && c.zero == it.prev.zero;
        it.i++;
        if (repeat) continue;
        it.prev = c;
        return true;
    }
    return false;
}

/* A group of n values at x[t * ld] (t = 0 .. n-1): its plain params into out; false when there
 * is nothing to search (quant.c's group_start). */
DEV bool group_start(const mq_qspec &s, float gs, const float *x, int64_t n, int64_t ld,
                     mq_gparams &out, cand_iter &it) {
    float xmin = 0.0f, xmax = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        float v = x[t * ld];
        xmin = v < xmin ? v : xmin;
        xmax = v > xmax ? v : xmax;
    }
    float amax = -xmin > xmax ? -xmin : xmax;
    params_scaled(s, gs, amax, xmin, xmax, 1.0f, out);
    if (!s.mse || !(amax > 0)) return false;
    cand_init(it, s, gs, amax, xmin, xmax);
    return true;
}

/* mq_group_params: the plain params, or with spec.mse the candidate of least plain squared
 * error (first of equals), summed in double in t order. */
DEV void group_params_plain(const mq_qspec &s, float gs, const float *x, int64_t n, int64_t ld,
                            mq_gparams &out) {
    cand_iter it;
    if (!group_start(s, gs, x, n, ld, out, it)) return;
    mq_gparams best_p = out, cand;
    double best = INFINITY;
    while (cand_next(it, s, cand)) {
        const float step = group_step(s, gs, cand);
        double e = 0;
        for (int64_t t = 0; t < n; t++) {
            const float v = x[t * ld];
            const double d = (double)v - (double)dequant_step(s, step, cand.zero,
                                                              quant_step(s, step, cand.zero, v));
            e += d * d;
        }
        if (e < best) {
            best = e;
            best_p = cand;
        }
    }
    out = best_p;
}

}  // namespace mqd

#endif
