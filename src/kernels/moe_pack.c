/*
 * Packing of INT4 / NVFP4 weights into the kernels' row-block layout (src/kernels/moe_ffn.h):
 * row blocks, the choice of the INT4 scale storage (16 bits when lossless), value validation,
 * packed MoE experts from unpacked sources (the public descriptor or the formats module's
 * mq_qtensor), and a dense Linear kept packed (model.h's struct mq_packed_weight) with its
 * forward pass on the same GEMM kernels.
 */
#define _DEFAULT_SOURCE   /* madvise(MADV_HUGEPAGE) */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/moe_ffn.h"

size_t mq_moe_stype_bytes(mq_moe_stype t) {
    return t == MQ_MOE_S_F32 ? 4 : t == MQ_MOE_S_E4M3 ? 1 : 2;
}

size_t mq_moe_rb_bytes(int32_t cols, int32_t group, mq_moe_stype st) {
    size_t b = (size_t)cols * 4 + (size_t)(cols / group) * MQ_MOE_RB * mq_moe_stype_bytes(st);
    return (b + 63) & ~(size_t)63;
}

static float src_scale_f32(const mq_moe_src *s, int64_t r, int64_t ng, int64_t g) {
    float f;
    memcpy(&f, s->scales + ((size_t)r * (size_t)ng + (size_t)g) * s->scale_stride, 4);
    return f;
}

void mq_moe_pack_rb(const mq_moe_src *src, int64_t src_rows, int32_t cols, int32_t group, int nvfp4,
                    mq_moe_stype st, int64_t row0, uint8_t *dst) {
    /* the codes: column k of row l into byte (k / 8) * 32 + l * 4 + k % 4, its low nibble for
     * k % 8 < 4, else its high one; cols is a multiple of 8 (of the group), so each group of 8
     * codes of a row fills 4 bytes: its first four in the low nibbles, the next four shifted in
     * (codes are 0..15: a word's shift moves no bit across bytes) */
    memset(dst + (size_t)cols * 4, 0, mq_moe_rb_bytes(cols, group, st) - (size_t)cols * 4);
    const uint32_t zero_word = nvfp4 ? 0 : 0x88888888u;   /* weight 0's codes (padding rows) */
    for (int l = 0; l < MQ_MOE_RB; l++) {
        const bool pad = row0 + l >= src_rows;
        const uint8_t *c = pad ? NULL : src->codes + (size_t)(row0 + l) * (size_t)cols;
        uint8_t *d = dst + (size_t)l * 4;
        for (int32_t k8 = 0; k8 < cols / 8; k8++) {
            uint32_t w = zero_word, lo, hi;
            if (!pad) {
                memcpy(&lo, c + 8 * k8, 4);
                memcpy(&hi, c + 8 * k8 + 4, 4);
                w = lo | hi << 4;
            }
            memcpy(d + (size_t)k8 * 32, &w, 4);
        }
    }
    const int32_t ng = cols / group;
    const size_t sb = mq_moe_stype_bytes(st);
    uint8_t *s = dst + (size_t)cols * 4;
    for (int l = 0; l < MQ_MOE_RB; l++) {
        if (row0 + l >= src_rows) continue;   /* scale 0 */
        for (int32_t g = 0; g < ng; g++) {
            uint8_t *o = s + ((size_t)g * MQ_MOE_RB + (size_t)l) * sb;
            if (nvfp4) {
                *o = src->scales[((size_t)(row0 + l) * (size_t)ng + (size_t)g) * src->scale_stride];
                continue;
            }
            float f = src_scale_f32(src, row0 + l, ng, g);
            uint16_t h = st == MQ_MOE_S_F16 ? mq_f32_to_f16(f) : mq_f32_to_bf16(f);
            if (st == MQ_MOE_S_F32) memcpy(o, &f, 4);
            else memcpy(o, &h, 2);
        }
    }
}

/* ---- the INT4 scale storage ------------------------------------------------------------------- */
static bool f16_exact(float f) {
    float r = mq_f16_to_f32(mq_f32_to_f16(f));
    return memcmp(&r, &f, 4) == 0;
}
static bool bf16_exact(float f) {
    float r = mq_bf16_to_f32(mq_f32_to_bf16(f));
    return memcmp(&r, &f, 4) == 0;
}

/* Narrows *ok_f16 / *ok_bf16 by the scales of src (rows x ng). */
static void scan_scales(const mq_moe_src *s, int64_t rows, int64_t ng, bool *ok_f16, bool *ok_bf16) {
    for (int64_t r = 0; r < rows && (*ok_f16 || *ok_bf16); r++)
        for (int64_t g = 0; g < ng; g++) {
            float f = src_scale_f32(s, r, ng, g);
            if (*ok_f16 && !f16_exact(f)) *ok_f16 = false;
            if (*ok_bf16 && !bf16_exact(f)) *ok_bf16 = false;
        }
}

static mq_moe_stype pick_stype(bool ok_f16, bool ok_bf16) {
    return ok_f16 ? MQ_MOE_S_F16 : ok_bf16 ? MQ_MOE_S_BF16 : MQ_MOE_S_F32;
}

/* Whether any E4M3 scale of a [rows, cols / 16] NVFP4 source has its sign bit set. */
static int any_neg_scale(const mq_moe_src *s, int64_t rows, int64_t ng) {
    for (int64_t i = 0; i < rows * ng; i++)
        if (s->scales[(size_t)i * s->scale_stride] & 0x80) return 1;
    return 0;
}

/* ---- value validation ------------------------------------------------------------------------- */
/* Checks codes and scales of a [rows, cols] source; the first bad value sets the message. */
static moeq_status src_check(const mq_moe_src *s, int64_t rows, int32_t cols, int32_t group,
                             int nvfp4, const char *what, const char *tensor, int64_t expert,
                             int64_t row_off) {
    char ex[40] = "";
    if (expert >= 0) snprintf(ex, sizeof ex, "expert %lld ", (long long)expert);
    const int32_t ng = cols / group;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *c = s->codes + r * cols;
        /* the row's high nibbles first, 8 codes a word (cols is whole groups: a multiple of 8),
         * then the first bad code's place only where there is one */
        uint64_t high = 0;
        for (int32_t k = 0; k + 8 <= cols; k += 8) {
            uint64_t w;
            memcpy(&w, c + k, 8);
            high |= w;
        }
        for (int32_t k = cols / 8 * 8; k < cols; k++) high |= c[k];
        for (int32_t k = 0; k < cols && (high & 0xF0F0F0F0F0F0F0F0ull); k++)
            if (c[k] > 15)
                return mq_err(MOEQ_E_FORMAT, "%s: %s.codes: %srow %lld col %d: code %d > 15", what,
                              tensor, ex, (long long)(r + row_off), (int)k, c[k]);
        for (int32_t g = 0; g < ng; g++) {
            const uint8_t *p = s->scales + ((size_t)r * (size_t)ng + (size_t)g) * s->scale_stride;
            bool ok = nvfp4 ? (*p & 0x7f) != 0x7f : isfinite(src_scale_f32(s, r, ng, g));
            if (!ok)
                return mq_err(MOEQ_E_NUMERIC, "%s: %s.scales: %srow %lld group %d: %s", what,
                              tensor, ex, (long long)(r + row_off), (int)g,
                              nvfp4 ? "E4M3 NaN" : "not finite");
        }
    }
    return MOEQ_OK;
}

/* mul/div of a result from the source's global scale (2: the kernels use doubled E2M1 values). */
static moeq_status global_of(const mq_moe_src *s, int nvfp4, const char *what, const char *tensor,
                             int64_t expert, float *mul, float *div) {
    *mul = 1.0f;
    *div = 1.0f;
    if (!nvfp4) return MOEQ_OK;
    const float gs = s->global_scale;
    if (!(gs > 0.0f) || !isfinite(gs) || !isfinite(2.0f * gs)) {
        if (expert >= 0)
            return mq_err(MOEQ_E_NUMERIC, "%s: %s.global_scale: expert %lld: %g (must be finite and > 0)",
                          what, tensor, (long long)expert, (double)gs);
        return mq_err(MOEQ_E_NUMERIC, "%s: %s.global_scale: %g (must be finite and > 0)", what,
                      tensor, (double)gs);
    }
    if (s->global_mul) {
        *mul = gs;
        *div = 2.0f;
    } else {
        *div = 2.0f * gs;
    }
    return MOEQ_OK;
}

/* Packed weights on 2 MiB-aligned transparent huge pages where the kernel allows it: decoding
 * streams hundreds of MB, and with 4 KiB pages every page boundary stops the hardware prefetcher
 * and costs a TLB miss. Only the whole huge pages inside the n bytes are marked, so a small
 * matrix (a tiny model's attention projection) or the tail of a large one does not pin a whole
 * 2 MiB page in resident memory. Freed with free(). */
static uint8_t *alloc_huge(size_t n) {
    const size_t huge = (size_t)2 << 20;
    size_t r = (n + 4095) & ~(size_t)4095;
    if (r < n || r == 0) return NULL;
    void *p = NULL;
    if (posix_memalign(&p, n >= huge ? huge : 64, r) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (n >= huge) madvise(p, n & ~(huge - 1), MADV_HUGEPAGE);
#endif
    return p;
}

/* ---- experts ---------------------------------------------------------------------------------- */
typedef struct {
    int nvfp4;
    int32_t group, D;
    mq_moe_stype st;
    const mq_moe_expert_src *src;
    moeq_moe_experts *w;
    const mq_moe_names *names;
    int32_t E;
    int32_t *bad;          /* per task */
} build_ctx;

/* Task 2e: expert e's gate_up, task 2e+1: its down (value checks, then packing). */
static moeq_status build_check(const build_ctx *c, int64_t task) {
    const int64_t e = task / 2;
    const mq_moe_expert_src *s = &c->src[e];
    const int64_t ei = e < c->E ? e : -1;
    const char *what = c->names->what;
    char gn[64], un[64], dn[64];
    snprintf(gn, sizeof gn, "%s%s", ei < 0 ? "shared_" : "", c->names->gate);
    snprintf(un, sizeof un, "%s%s", ei < 0 ? "shared_" : "", c->names->up);
    snprintf(dn, sizeof dn, "%s%s", ei < 0 ? "shared_" : "", c->names->down);
    if (task % 2 == 0) {
        moeq_status st = src_check(&s->gate, s->ffn, c->D, c->group, c->nvfp4, what, gn, ei, 0);
        if (st) return st;
        return src_check(&s->up, s->ffn, c->D, c->group, c->nvfp4, what, un, ei,
                         c->names->up_row_offset ? s->ffn : 0);
    }
    return src_check(&s->down, c->D, s->ffn, c->group, c->nvfp4, what, dn, ei, 0);
}

static void build_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    build_ctx *c = ctx;
    if (build_check(c, task) != MOEQ_OK) {
        c->bad[task] = 1;
        return;
    }
    const mq_moe_expert_src *s = &c->src[task / 2];
    const mq_pexpert *x = &c->w->ex[task / 2];
    if (task % 2 == 0) {
        /* gate_up: row block 2i = gate rows 8i.., 2i+1 = up rows 8i.. */
        for (int32_t rb = 0; rb < 2 * s->ffn / MQ_MOE_RB; rb++)
            mq_moe_pack_rb((rb & 1) ? &s->up : &s->gate, s->ffn, c->D, c->group, c->nvfp4, c->st,
                           (int64_t)(rb / 2) * MQ_MOE_RB,
                           (uint8_t *)x->gate_up.data + (size_t)rb * x->gate_up.rb_bytes);
    } else {
        for (int32_t rb = 0; rb < c->D / MQ_MOE_RB; rb++)
            mq_moe_pack_rb(&s->down, c->D, s->ffn, c->group, c->nvfp4, c->st,
                           (int64_t)rb * MQ_MOE_RB, (uint8_t *)x->down.data + (size_t)rb * x->down.rb_bytes);
    }
}

void moeq_moe_experts_free(moeq_moe_experts *w) {
    if (!w) return;
    free(w->blob);
    mq_free(w->ex);
    mq_free(w);
}

size_t moeq_moe_experts_bytes(const moeq_moe_experts *w) { return w ? w->blob_bytes : 0; }

moeq_status mq_moe_experts_build(int nvfp4, int32_t group, int32_t E, int32_t D,
                                 const mq_moe_expert_src *src, int has_shared,
                                 const mq_moe_names *names, moeq_moe_experts **out) {
    *out = NULL;
    const int32_t n = E + (has_shared ? 1 : 0);
    moeq_moe_experts *w = mq_alloc_zero(sizeof *w, "moe experts");
    if (!w) return MOEQ_E_NOMEM;
    moeq_status st = MOEQ_OK;
    int32_t *bad = NULL;
    w->scheme = nvfp4 ? MOEQ_MOE_NVFP4 : MOEQ_MOE_INT4;
    w->group = group;
    w->E = E;
    w->D = D;
    w->F = src[0].ffn;
    w->Fs = has_shared ? src[E].ffn : 0;
    w->n_mats = n;
    w->ex = mq_alloc_zero(sizeof(mq_pexpert) * (size_t)n, "moe experts");
    bad = mq_alloc_zero(sizeof(int32_t) * 2 * (size_t)n, "moe pack tasks");
    if (!w->ex || !bad) {
        st = MOEQ_E_NOMEM;
        goto done;
    }
    /* the scale storage: one choice for the whole set (kernels read it per matrix anyway) */
    mq_moe_stype stype = MQ_MOE_S_E4M3;
    if (!nvfp4) {
        bool ok16 = true, okbf = true;
        for (int32_t e = 0; e < n; e++) {
            scan_scales(&src[e].gate, src[e].ffn, D / group, &ok16, &okbf);
            scan_scales(&src[e].up, src[e].ffn, D / group, &ok16, &okbf);
            scan_scales(&src[e].down, D, src[e].ffn / group, &ok16, &okbf);
        }
        stype = pick_stype(ok16, okbf);
    }
    size_t total = 0, rbd = mq_moe_rb_bytes(D, group, stype);
    for (int32_t e = 0; e < n; e++) {
        const int32_t F = src[e].ffn;
        size_t rbf = mq_moe_rb_bytes(F, group, stype);
        size_t gu = (size_t)(2 * F / MQ_MOE_RB) * rbd, dn = (size_t)(D / MQ_MOE_RB) * rbf;
        mq_pexpert *x = &w->ex[e];
        x->ffn = F;
        x->gate_up = (mq_pmat){(const uint8_t *)(uintptr_t)total, rbd, 2 * F, D, group, nvfp4,
                               stype, {1, 1}, {1, 1}, 0};
        x->down = (mq_pmat){(const uint8_t *)(uintptr_t)(total + gu), rbf, D, F, group, nvfp4,
                            stype, {1, 1}, {1, 1}, 0};
        if (nvfp4) {
            x->gate_up.neg_scales = any_neg_scale(&src[e].gate, F, D / 16) ||
                                    any_neg_scale(&src[e].up, F, D / 16);
            x->down.neg_scales = any_neg_scale(&src[e].down, D, F / 16);
        }
        if (!mq_add_size(total, gu, &total) || !mq_add_size(total, dn, &total)) {
            st = mq_err(MOEQ_E_NOMEM, "%s: packed size overflows", names->what);
            goto done;
        }
        const int64_t ei = e < E ? e : -1;
        char gn[64], un[64], dn_[64];
        snprintf(gn, sizeof gn, "%s%s", ei < 0 ? "shared_" : "", names->gate);
        snprintf(un, sizeof un, "%s%s", ei < 0 ? "shared_" : "", names->up);
        snprintf(dn_, sizeof dn_, "%s%s", ei < 0 ? "shared_" : "", names->down);
        if ((st = global_of(&src[e].gate, nvfp4, names->what, gn, ei, &x->gate_up.mul[0], &x->gate_up.div[0])) ||
            (st = global_of(&src[e].up, nvfp4, names->what, un, ei, &x->gate_up.mul[1], &x->gate_up.div[1])) ||
            (st = global_of(&src[e].down, nvfp4, names->what, dn_, ei, &x->down.mul[0], &x->down.div[0])))
            goto done;
        x->down.mul[1] = x->down.mul[0];
        x->down.div[1] = x->down.div[0];
    }
    w->blob = alloc_huge(total);
    if (!w->blob) {
        st = mq_err(MOEQ_E_NOMEM, "%s: out of memory for %zu packed bytes", names->what, total);
        goto done;
    }
    w->blob_bytes = total;
    for (int32_t e = 0; e < n; e++) {
        w->ex[e].gate_up.data = w->blob + (uintptr_t)w->ex[e].gate_up.data;
        w->ex[e].down.data = w->blob + (uintptr_t)w->ex[e].down.data;
    }
    build_ctx c = {nvfp4, group, D, stype, src, w, names, E, bad};
    mq_parallel_for(2 * (int64_t)n, build_task, &c);
    for (int32_t i = 0; i < 2 * n && !st; i++)
        if (bad[i]) st = build_check(&c, i);   /* the message, on this thread */
done:
    mq_free(bad);
    if (st) {
        moeq_moe_experts_free(w);
        return st;
    }
    *out = w;
    return MOEQ_OK;
}

/* ---- from the formats module's quantized tensors ---------------------------------------------- */
static moeq_status qt_check(const mq_qtensor *q, int nvfp4, int64_t group, int64_t rows,
                            int64_t cols, const char *what, const char *tensor, int64_t e) {
    char id[96];
    if (e >= 0) snprintf(id, sizeof id, "%s: expert %lld %s", what, (long long)e, tensor);
    else snprintf(id, sizeof id, "%s: %s", what, tensor);
    const mq_qscheme want = nvfp4 ? MQ_QS_NVFP4 : MQ_QS_INT4;
    if (q->spec.scheme != want)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: scheme %s, the layer uses %s", id,
                      mq_qscheme_name(q->spec.scheme), mq_qscheme_name(want));
    if (q->rows != rows || q->cols != cols)
        return mq_err(MOEQ_E_SHAPE, "%s: shape [%lld, %lld], expected [%lld, %lld]", id,
                      (long long)q->rows, (long long)q->cols, (long long)rows, (long long)cols);
    if (q->group_size != group)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: group size %lld, the layer uses %lld", id,
                      (long long)q->group_size, (long long)group);
    if (!nvfp4 && q->spec.asym)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: asymmetric INT4 is not supported by the kernels", id);
    if (q->g_idx)
        for (int64_t c = 0; c < cols; c++)
            if (q->g_idx[c] != c / group)
                return mq_err(MOEQ_E_UNSUPPORTED, "%s: act-order groups (g_idx) are not supported "
                              "by the kernels", id);
    return MOEQ_OK;
}

static mq_moe_src qt_src(const mq_qtensor *q, int nvfp4) {
    mq_moe_src s;
    s.codes = q->codes;
    s.scales = (const uint8_t *)q->params +
               (nvfp4 ? offsetof(mq_gparams, scale_code) : offsetof(mq_gparams, scale));
    s.scale_stride = sizeof(mq_gparams);
    s.global_scale = q->global_scale;
    s.global_mul = nvfp4 && q->spec.nvfp4_conv == MQ_NVFP4_MUL;
    return s;
}

moeq_status mq_moe_experts_from_qtensors(const mq_qtensor *gate, const mq_qtensor *up,
                                         const mq_qtensor *down, int32_t E,
                                         const mq_qtensor *sh_gate, const mq_qtensor *sh_up,
                                         const mq_qtensor *sh_down, const char *what,
                                         moeq_moe_experts **out) {
    if (!out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", what);
    *out = NULL;
    if (!gate || !up || !down || E < 1)
        return mq_err(MOEQ_E_ARG, "%s: expert tensors missing", what);
    const bool shared = sh_gate || sh_up || sh_down;
    if (shared && !(sh_gate && sh_up && sh_down))
        return mq_err(MOEQ_E_ARG, "%s: the shared expert needs gate, up and down", what);
    const int nvfp4 = gate[0].spec.scheme == MQ_QS_NVFP4;
    if (!nvfp4 && gate[0].spec.scheme != MQ_QS_INT4)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: scheme %s has no kernels (INT4 or NVFP4 only)", what,
                      mq_qscheme_name(gate[0].spec.scheme));
    const int64_t group = gate[0].group_size, D = gate[0].cols, F = gate[0].rows;
    if (nvfp4 ? group != 16 : (group <= 0 || group % 32 != 0))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: group size %lld (kernels: INT4 multiples of 32, NVFP4 16)",
                      what, (long long)group);
    if (D % group || F % group || D > INT32_MAX || F > INT32_MAX)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: hidden %lld / ffn %lld not multiples of the group %lld",
                      what, (long long)D, (long long)F, (long long)group);
    const int32_t n = E + (shared ? 1 : 0);
    mq_moe_expert_src *src = mq_alloc_zero(sizeof *src * (size_t)n, "moe expert sources");
    if (!src) return MOEQ_E_NOMEM;
    moeq_status st = MOEQ_OK;
    for (int32_t e = 0; e < n && !st; e++) {
        const bool sh = e == E;
        const mq_qtensor *g = sh ? sh_gate : &gate[e], *u = sh ? sh_up : &up[e], *d = sh ? sh_down : &down[e];
        const int64_t f = sh ? sh_gate->rows : F, ei = sh ? -1 : e;
        if (f % group || f > INT32_MAX) {
            st = mq_err(MOEQ_E_UNSUPPORTED, "%s: shared expert width %lld not a multiple of the group %lld",
                        what, (long long)f, (long long)group);
            break;
        }
        if ((st = qt_check(g, nvfp4, group, f, D, what, sh ? "shared gate" : "gate", ei)) ||
            (st = qt_check(u, nvfp4, group, f, D, what, sh ? "shared up" : "up", ei)) ||
            (st = qt_check(d, nvfp4, group, D, f, what, sh ? "shared down" : "down", ei)))
            break;
        src[e].ffn = (int32_t)f;
        src[e].gate = qt_src(g, nvfp4);
        src[e].up = qt_src(u, nvfp4);
        src[e].down = qt_src(d, nvfp4);
    }
    if (!st) {
        mq_moe_names names = {what, "gate", "up", "down", 0};
        st = mq_moe_experts_build(nvfp4, (int32_t)group, E, (int32_t)D, src, shared, &names, out);
    }
    mq_free(src);
    return st;
}

/* ---- a dense Linear kept packed --------------------------------------------------------------- */
void mq_packed_weight_free(struct mq_packed_weight *w) {
    if (!w) return;
    free(w->blob);
    mq_free(w);
}

size_t mq_packed_weight_bytes(const struct mq_packed_weight *w) { return w ? w->bytes : 0; }

moeq_status mq_packed_weight_from_qtensor(const mq_qtensor *q, const char *name,
                                          struct mq_packed_weight **out) {
    if (!out || !q) return mq_err(MOEQ_E_ARG, "%s: tensor or out is NULL", name);
    *out = NULL;
    const int nvfp4 = q->spec.scheme == MQ_QS_NVFP4;
    if (!nvfp4 && q->spec.scheme != MQ_QS_INT4)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: scheme %s has no kernels (INT4 or NVFP4 only)", name,
                      mq_qscheme_name(q->spec.scheme));
    const int64_t group = q->group_size;
    if (nvfp4 ? group != 16 : (group <= 0 || group % 32 != 0))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: group size %lld (kernels: INT4 multiples of 32, NVFP4 16)",
                      name, (long long)group);
    if (q->cols % group || q->rows < 1 || q->rows > INT32_MAX - 16 || q->cols > INT32_MAX)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: shape [%lld, %lld] with group %lld", name,
                      (long long)q->rows, (long long)q->cols, (long long)group);
    moeq_status st = qt_check(q, nvfp4, group, q->rows, q->cols, name, "weight", -1);
    if (st) return st;
    mq_moe_src src = qt_src(q, nvfp4);
    const int32_t rows = (int32_t)q->rows, cols = (int32_t)q->cols;
    if ((st = src_check(&src, rows, cols, (int32_t)group, nvfp4, name, "weight", -1, 0))) return st;
    struct mq_packed_weight *w = mq_alloc_zero(sizeof *w, "packed weight");
    if (!w) return MOEQ_E_NOMEM;
    mq_moe_stype stype = MQ_MOE_S_E4M3;
    if (!nvfp4) {
        bool ok16 = true, okbf = true;
        scan_scales(&src, rows, cols / group, &ok16, &okbf);
        stype = pick_stype(ok16, okbf);
    }
    const int32_t prow = (rows + 15) / 16 * 16;
    const size_t rbb = mq_moe_rb_bytes(cols, (int32_t)group, stype);
    w->out = rows;
    w->in = cols;
    w->bytes = rbb * (size_t)(prow / MQ_MOE_RB);
    w->W = (mq_pmat){NULL, rbb, prow, cols, (int32_t)group, nvfp4, stype, {1, 1}, {1, 1},
                     nvfp4 ? any_neg_scale(&src, rows, cols / 16) : 0};
    if ((st = global_of(&src, nvfp4, name, "weight", -1, &w->W.mul[0], &w->W.div[0]))) {
        mq_free(w);
        return st;
    }
    w->W.mul[1] = w->W.mul[0];
    w->W.div[1] = w->W.div[0];
    w->blob = alloc_huge(w->bytes);
    if (!w->blob) {
        mq_free(w);
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory for %zu packed bytes", name, w->bytes);
    }
    w->W.data = w->blob;
    for (int32_t rb = 0; rb < prow / MQ_MOE_RB; rb++)
        mq_moe_pack_rb(&src, rows, cols, (int32_t)group, nvfp4, stype, (int64_t)rb * MQ_MOE_RB,
                       w->blob + (size_t)rb * rbb);
    *out = w;
    return MOEQ_OK;
}
