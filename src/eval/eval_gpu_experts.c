/*
 * A quantized checkpoint's routed experts as the GPU MoE op takes them (eval_gpu.h): each
 * expert's gate, up and down read from the mapped files as codes and scales
 * (ckpt/layout.h's mq_layout_read, the loader's own reader) and laid out in the canonical
 * moeq_moe_experts_desc of the layer, so that the device decodes them in its GEMMs and no fp32
 * copy of the experts is made on the host.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/layout.h"
#include "core/core.h"
#include "eval/eval_gpu.h"
#include "io/safetensors.h"

static const mq_tensor_view *lookup(void *user, const char *name) { return mq_st_find((const mq_st *)user, name); }

void mq_gpu_experts_free(mq_gpu_experts *x) {
    if (!x) return;
    MQ_RELEASE_EACH(x->gu_codes, x->dn_codes, x->gu_scales, x->dn_scales, x->gu_zero, x->dn_zero);
    MQ_FREE_EACH(x->gu_global, x->dn_global);
    memset(x, 0, sizeof *x);
}

typedef struct {
    const mq_st *st;
    const mq_layer *ly;
    mq_gpu_experts *x;
    int64_t D, F;
    moeq_status *status;
    mq_qspec *spec;      /* [E]: each expert's gate spec, compared after the loop */
    float *global;       /* [E, 3] */
    int64_t *group;      /* [E] */
    char (*msg)[256];    /* [E]: a failed expert's message (the last error is per thread) */
} read_ctx;

/* One expert's three matrices into their places of the layer's arrays. */
static void read_expert(void *vctx, int64_t e, int thread) {
    (void)thread;
    read_ctx *c = vctx;
    const mq_linear *lin[3] = {&c->ly->exp_gate[e], &c->ly->exp_up[e], &c->ly->exp_down[e]};
    const int64_t D = c->D, F = c->F;
    mq_gpu_experts *x = c->x;
    moeq_status s = MOEQ_OK;
    for (int i = 0; i < 3 && !s; i++) {
        const int64_t rows = i < 2 ? F : D, cols = i < 2 ? D : F;
        mq_qtensor q;
        s = mq_layout_read(lin[i]->name, rows, cols, lookup, (void *)c->st, &q);
        if (!s) {
            const bool nv = q.spec.scheme == MQ_QS_NVFP4;
            if (!nv && q.spec.scheme != MQ_QS_INT4)
                s = mq_err(MOEQ_E_UNSUPPORTED, "%s: scheme %s (the GPU MoE op takes NVFP4 and INT4)", lin[i]->name,
                           mq_qscheme_name(q.spec.scheme));
            for (int64_t k = 0; !s && q.g_idx && k < cols; k++)
                if (q.g_idx[k] != k / q.group_size)
                    s = mq_err(MOEQ_E_UNSUPPORTED, "%s: act-order groups (g_idx)", lin[i]->name);
            if (!s && (nv ? q.group_size != 16 : q.group_size % 32 != 0))
                s = mq_err(MOEQ_E_UNSUPPORTED, "%s: group size %lld", lin[i]->name, (long long)q.group_size);
            if (!s && i == 0) {
                c->spec[e] = q.spec;
                c->group[e] = q.group_size;
            } else if (!s && (q.spec.scheme != c->spec[e].scheme || q.spec.asym != c->spec[e].asym ||
                              q.spec.nvfp4_conv != c->spec[e].nvfp4_conv || q.group_size != c->group[e])) {
                s = mq_err(MOEQ_E_UNSUPPORTED, "%s: stored unlike the expert's gate_proj", lin[i]->name);
            }
        }
        if (!s) {
            const bool nv = q.spec.scheme == MQ_QS_NVFP4;
            const int64_t ng = cols / q.group_size, n = rows * cols;
            uint8_t *codes = i < 2 ? x->gu_codes + (size_t)(e * 2 * F * D + i * F * D) : x->dn_codes + (size_t)(e * D * F);
            memcpy(codes, q.codes, (size_t)n);
            const size_t sbase = i < 2 ? (size_t)(e * 2 * F + i * F) * (size_t)(D / q.group_size)
                                       : (size_t)(e * D) * (size_t)(F / q.group_size);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t g = 0; g < ng; g++) {
                    const mq_gparams *p = &q.params[r * ng + g];
                    const size_t at = sbase + (size_t)(r * ng + g);
                    if (nv) {
                        (i < 2 ? x->gu_scales : x->dn_scales)[at] = p->scale_code;
                    } else {
                        float *sc = (float *)(void *)(i < 2 ? x->gu_scales : x->dn_scales);
                        sc[at] = p->scale;
                        if (q.spec.asym) (i < 2 ? x->gu_zero : x->dn_zero)[at] = (uint8_t)p->zero;
                    }
                }
            c->global[e * 3 + i] = q.global_scale;
        }
        mq_qtensor_free(&q);
    }
    c->status[e] = s;
    if (s) snprintf(c->msg[e], sizeof c->msg[e], "%s", moeq_last_error());
}

moeq_status mq_gpu_experts_read(const mq_st *st, const mq_config *cf, const mq_layer *ly, int l, mq_gpu_experts *x) {
    memset(x, 0, sizeof *x);
    const int64_t E = cf->n_experts, D = cf->D, F = cf->moe_ffn;
    if (!ly->is_moe || E < 1) return mq_err(MOEQ_E_ARG, "layer %d has no routed experts", l);
    for (int64_t e = 0; e < E; e++)
        if (!ly->exp_gate[e].stored_quantized || !ly->exp_up[e].stored_quantized || !ly->exp_down[e].stored_quantized ||
            !ly->exp_gate[e].name || !ly->exp_up[e].name || !ly->exp_down[e].name)
            return mq_err(MOEQ_E_UNSUPPORTED, "layer %d, expert %lld: not stored quantized", l, (long long)e);
    /* the first expert's gate decides the types (the scheme is per layer in every layout moeq reads) */
    mq_qtensor q0;
    moeq_status s = mq_layout_read(ly->exp_gate[0].name, F, D, lookup, (void *)st, &q0);
    const bool nv = !s && q0.spec.scheme == MQ_QS_NVFP4;
    const bool asym = !s && !nv && q0.spec.asym;
    const int64_t G = s ? 0 : q0.group_size;
    mq_qtensor_free(&q0);
    if (s) return s;
    if (G <= 0 || D % G || F % G) return mq_err(MOEQ_E_UNSUPPORTED, "layer %d: group size %lld", l, (long long)G);
    const size_t ssz = nv ? 1 : sizeof(float);
    x->gu_codes = mq_alloc((size_t)(E * 2 * F * D), "GPU experts' codes");
    x->dn_codes = mq_alloc((size_t)(E * D * F), "GPU experts' codes");
    x->gu_scales = mq_alloc((size_t)(E * 2 * F * (D / G)) * ssz, "GPU experts' scales");
    x->dn_scales = mq_alloc((size_t)(E * D * (F / G)) * ssz, "GPU experts' scales");
    if (asym) {
        x->gu_zero = mq_alloc((size_t)(E * 2 * F * (D / G)), "GPU experts' zero points");
        x->dn_zero = mq_alloc((size_t)(E * D * (F / G)), "GPU experts' zero points");
    }
    x->gu_global = malloc((size_t)(2 * E) * sizeof(float));
    x->dn_global = malloc((size_t)E * sizeof(float));
    moeq_status *status = calloc((size_t)E, sizeof *status);
    mq_qspec *spec = calloc((size_t)E, sizeof *spec);
    float *global = malloc((size_t)(3 * E) * sizeof *global);
    int64_t *group = calloc((size_t)E, sizeof *group);
    char(*msg)[256] = calloc((size_t)E, sizeof *msg);
    if (!msg || !x->gu_codes || !x->dn_codes || !x->gu_scales || !x->dn_scales || (asym && (!x->gu_zero || !x->dn_zero)) ||
        !x->gu_global || !x->dn_global || !status || !spec || !global || !group) {
        s = mq_err(MOEQ_E_NOMEM, "layer %d: out of memory for the experts' codes", l);
    } else {
        read_ctx c = {st, ly, x, D, F, status, spec, global, group, msg};
        mq_parallel_for(E, read_expert, &c);
        for (int64_t e = 0; e < E && !s; e++) {
            s = status[e];
            if (s) {
                s = mq_err(s, "layer %d: %s", l, msg[e]);
                break;
            }
            if ((spec[e].scheme == MQ_QS_NVFP4) != nv || (!nv && spec[e].asym != asym) || group[e] != G ||
                spec[e].nvfp4_conv != spec[0].nvfp4_conv)
                s = mq_err(MOEQ_E_UNSUPPORTED, "layer %d, expert %lld: stored unlike expert 0", l, (long long)e);
            x->gu_global[2 * e] = global[3 * e];
            x->gu_global[2 * e + 1] = global[3 * e + 1];
            x->dn_global[e] = global[3 * e + 2];
        }
    }
    if (!s) {
        moeq_moe_experts_desc *d = &x->desc;
        d->scheme = nv ? MOEQ_MOE_NVFP4 : MOEQ_MOE_INT4;
        d->group_size = (int32_t)G;
        d->nvfp4_global_multiplier = nv && spec[0].nvfp4_conv == MQ_NVFP4_MUL;
        d->n_experts = (int32_t)E;
        d->hidden = (int32_t)D;
        d->ffn = (int32_t)F;
        const moeq_dtype sdt = nv ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32;
        d->gate_up.codes = (moeq_tensor_ref){x->gu_codes, MOEQ_DT_U8, 3, {E, 2 * F, D, 0}, (size_t)(E * 2 * F * D)};
        d->gate_up.scales = (moeq_tensor_ref){x->gu_scales, sdt, 3, {E, 2 * F, D / G, 0}, (size_t)(E * 2 * F * (D / G)) * ssz};
        d->down.codes = (moeq_tensor_ref){x->dn_codes, MOEQ_DT_U8, 3, {E, D, F, 0}, (size_t)(E * D * F)};
        d->down.scales = (moeq_tensor_ref){x->dn_scales, sdt, 3, {E, D, F / G, 0}, (size_t)(E * D * (F / G)) * ssz};
        if (nv) {
            d->gate_up.global_scale = (moeq_tensor_ref){x->gu_global, MOEQ_DT_F32, 2, {E, 2, 0, 0}, (size_t)(2 * E) * 4};
            d->down.global_scale = (moeq_tensor_ref){x->dn_global, MOEQ_DT_F32, 1, {E, 0, 0, 0}, (size_t)E * 4};
        }
        if (asym) {
            x->zp.gate_up = (moeq_tensor_ref){x->gu_zero, MOEQ_DT_U8, 3, {E, 2 * F, D / G, 0}, (size_t)(E * 2 * F * (D / G))};
            x->zp.down = (moeq_tensor_ref){x->dn_zero, MOEQ_DT_U8, 3, {E, D, F / G, 0}, (size_t)(E * D * (F / G))};
            x->has_zp = true;
        }
    }
    free(status);
    free(spec);
    free(global);
    free(group);
    free(msg);
    if (s) mq_gpu_experts_free(x);
    return s;
}
