/*
 * The quantized MoE feed-forward op (moeq_moe_ffn, semantics in include/moeq.h): argument
 * validation (the shape function, like ExecuTorch's Meta kernel for llama::quantized_moe_ffn),
 * packing of canonical INT4 / NVFP4 weights into the kernel layout (src/kernels/moe_ffn.h), routing
 * (fp32 router, softmax or sigmoid scores, top-k, renormalisation as in transformers'
 * Mixtral/Qwen2-MoE/OLMoE/DeepSeek-V3 and ExecuTorch's op), a counting sort of (token, slot)
 * pairs by expert, and two parallel phases over (expert, row range) tasks: fused gate+up GEMM
 * with SwiGLU and int8 re-quantization, then the down GEMM. Each token finally sums its slots in
 * slot order, so the result does not depend on the thread count.
 */
#define _DEFAULT_SOURCE   /* madvise(MADV_HUGEPAGE) */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/moe_ffn.h"

typedef struct {
    int32_t ffn;
    mq_pmat gate_up;   /* 2F rows, gate/up row blocks interleaved */
    mq_pmat down;      /* D rows */
} mq_pexpert;

struct moeq_moe_experts {
    moeq_moe_scheme scheme;
    int32_t group, E, D, F, Fs;
    int32_t n_mats;        /* E, plus 1 for the shared expert (last) */
    mq_pexpert *ex;
    uint8_t *blob;
    size_t blob_bytes;
};

/* ---- small helpers ------------------------------------------------------------------------- */
static const char *dt_name(moeq_dtype dt) {
    static const char *const names[MOEQ_DT_COUNT] = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3",
                                                     "I16", "U16", "F16", "BF16", "I32", "U32",
                                                     "F32", "F64", "I64", "U64"};
    return (dt >= 0 && dt < MOEQ_DT_COUNT) ? names[dt] : "unknown";
}

static size_t dt_size(moeq_dtype dt) {
    switch (dt) {
        case MOEQ_DT_BOOL: case MOEQ_DT_U8: case MOEQ_DT_I8: case MOEQ_DT_F8_E5M2:
        case MOEQ_DT_F8_E4M3: return 1;
        case MOEQ_DT_I16: case MOEQ_DT_U16: case MOEQ_DT_F16: case MOEQ_DT_BF16: return 2;
        case MOEQ_DT_I32: case MOEQ_DT_U32: case MOEQ_DT_F32: return 4;
        default: return 8;
    }
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && o < n; i++)
        o += (size_t)snprintf(buf + o, n - o, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

static bool tref_present(const moeq_tensor_ref *r) { return r->data != NULL; }

/* Checks one tensor argument against the expected dtype and shape. */
static moeq_status check_tref(const char *op, const char *name, const moeq_tensor_ref *r,
                              moeq_dtype dt, int ndim, const int64_t *shape) {
    char want[96], got[96];
    if (!r->data) return mq_err(MOEQ_E_ARG, "%s: %s: data is NULL", op, name);
    if (r->dtype != dt)
        return mq_err(MOEQ_E_ARG, "%s: %s: dtype %s, expected %s", op, name, dt_name(r->dtype),
                      dt_name(dt));
    shape_str(want, sizeof want, ndim, shape);
    if (r->ndim < 0 || r->ndim > 4)
        return mq_err(MOEQ_E_SHAPE, "%s: %s: ndim %d, expected shape %s", op, name, (int)r->ndim,
                      want);
    shape_str(got, sizeof got, r->ndim, r->shape);
    bool same = r->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = r->shape[i] == shape[i];
    if (!same) return mq_err(MOEQ_E_SHAPE, "%s: %s: shape %s, expected %s", op, name, got, want);
    size_t need = dt_size(dt);
    for (int i = 0; i < ndim; i++)
        if (!mq_mul_size(need, (size_t)shape[i], &need))
            return mq_err(MOEQ_E_SHAPE, "%s: %s: shape %s is too large", op, name, got);
    if (r->nbytes < need)
        return mq_err(MOEQ_E_ARG, "%s: %s: buffer of %zu bytes, shape %s %s needs %zu", op, name,
                      r->nbytes, got, dt_name(dt), need);
    return MOEQ_OK;
}

static moeq_status check_absent(const char *op, const char *name, const moeq_tensor_ref *r,
                                const char *why) {
    if (tref_present(r)) return mq_err(MOEQ_E_ARG, "%s: %s: must be absent (%s)", op, name, why);
    return MOEQ_OK;
}

/* ---- experts: validation ------------------------------------------------------------------- */
static const char *k_ex = "moe_experts";

/* One quantized weight: E matrices (E = 0: a single matrix without the leading dimension). */
static moeq_status check_qweight(const moeq_moe_experts_desc *d, const char *name,
                                 const moeq_moe_qweight *w, int64_t E, int64_t rows, int64_t cols,
                                 bool fused) {
    char nm[64];
    int64_t sh[3];
    int n = 0;
    if (E > 0) sh[n++] = E;
    sh[n] = rows;
    sh[n + 1] = cols;
    snprintf(nm, sizeof nm, "%s.codes", name);
    moeq_status st = check_tref(k_ex, nm, &w->codes, MOEQ_DT_U8, n + 2, sh);
    if (st) return st;
    sh[n + 1] = cols / d->group_size;
    snprintf(nm, sizeof nm, "%s.scales", name);
    st = check_tref(k_ex, nm, &w->scales,
                    d->scheme == MOEQ_MOE_NVFP4 ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32, n + 2, sh);
    if (st) return st;
    snprintf(nm, sizeof nm, "%s.global_scale", name);
    if (d->scheme == MOEQ_MOE_INT4) return check_absent(k_ex, nm, &w->global_scale, "INT4");
    /* NVFP4: [E] / [1], or [E, 2] / [2] with separate gate and up scales for gate_up */
    int64_t gs[2] = {E > 0 ? E : 1, 2};
    int gnd = 1;
    if (fused && w->global_scale.data && w->global_scale.ndim == (E > 0 ? 2 : 1) &&
        w->global_scale.shape[w->global_scale.ndim - 1] == 2) {
        if (E > 0) gnd = 2;
        else gs[0] = 2;
    }
    return check_tref(k_ex, nm, &w->global_scale, MOEQ_DT_F32, gnd, gs);
}

moeq_status moeq_moe_experts_check(const moeq_moe_experts_desc *d) {
    if (!d) return mq_err(MOEQ_E_ARG, "%s: descriptor is NULL", k_ex);
    if (d->scheme != MOEQ_MOE_INT4 && d->scheme != MOEQ_MOE_NVFP4)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: scheme %d (expected INT4 or NVFP4)", k_ex,
                      (int)d->scheme);
    if (d->scheme == MOEQ_MOE_NVFP4 && d->group_size != 16)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: group_size %d: NVFP4 needs 16", k_ex,
                      (int)d->group_size);
    if (d->scheme == MOEQ_MOE_INT4 && (d->group_size <= 0 || d->group_size % 32 != 0))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: group_size %d: INT4 needs a positive multiple of 32",
                      k_ex, (int)d->group_size);
    if (d->n_experts < 1) return mq_err(MOEQ_E_ARG, "%s: n_experts %d < 1", k_ex, (int)d->n_experts);
    if (d->hidden < 1) return mq_err(MOEQ_E_ARG, "%s: hidden %d < 1", k_ex, (int)d->hidden);
    if (d->ffn < 1) return mq_err(MOEQ_E_ARG, "%s: ffn %d < 1", k_ex, (int)d->ffn);
    if (d->shared_ffn < 0) return mq_err(MOEQ_E_ARG, "%s: shared_ffn %d < 0", k_ex, (int)d->shared_ffn);
    const char *gname = d->scheme == MOEQ_MOE_NVFP4 ? "NVFP4 block" : "group_size";
    if (d->hidden % d->group_size)
        return mq_err(MOEQ_E_SHAPE, "%s: hidden %d is not a multiple of the %s %d", k_ex,
                      (int)d->hidden, gname, (int)d->group_size);
    if (d->ffn % d->group_size)
        return mq_err(MOEQ_E_SHAPE, "%s: ffn %d is not a multiple of the %s %d", k_ex,
                      (int)d->ffn, gname, (int)d->group_size);
    if (d->shared_ffn % d->group_size)
        return mq_err(MOEQ_E_SHAPE, "%s: shared_ffn %d is not a multiple of the %s %d", k_ex,
                      (int)d->shared_ffn, gname, (int)d->group_size);
    const int64_t E = d->n_experts, D = d->hidden, F = d->ffn, Fs = d->shared_ffn;
    moeq_status st = check_qweight(d, "gate_up", &d->gate_up, E, 2 * F, D, true);
    if (!st) st = check_qweight(d, "down", &d->down, E, D, F, false);
    if (st) return st;
    if (Fs > 0) {
        st = check_qweight(d, "shared_gate_up", &d->shared_gate_up, 0, 2 * Fs, D, true);
        if (!st) st = check_qweight(d, "shared_down", &d->shared_down, 0, D, Fs, false);
        return st;
    }
    const moeq_moe_qweight *sw[2] = {&d->shared_gate_up, &d->shared_down};
    const char *sn[2] = {"shared_gate_up", "shared_down"};
    for (int i = 0; i < 2; i++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%s.codes", sn[i]);
        if ((st = check_absent(k_ex, nm, &sw[i]->codes, "shared_ffn is 0"))) return st;
        snprintf(nm, sizeof nm, "%s.scales", sn[i]);
        if ((st = check_absent(k_ex, nm, &sw[i]->scales, "shared_ffn is 0"))) return st;
        snprintf(nm, sizeof nm, "%s.global_scale", sn[i]);
        if ((st = check_absent(k_ex, nm, &sw[i]->global_scale, "shared_ffn is 0"))) return st;
    }
    return MOEQ_OK;
}

/* ---- experts: packing ---------------------------------------------------------------------- */
size_t mq_moe_rb_bytes(int32_t cols, int32_t group, int nvfp4) {
    size_t b = (size_t)cols * 4 + (size_t)(cols / group) * MQ_MOE_RB * (nvfp4 ? 1 : 4);
    return (b + 63) & ~(size_t)63;
}

void mq_moe_pack_rb(const mq_moe_src *src, int32_t cols, int32_t group, int nvfp4, int64_t row0,
                    uint8_t *dst) {
    const size_t rb_bytes = mq_moe_rb_bytes(cols, group, nvfp4);
    memset(dst, 0, rb_bytes);
    for (int l = 0; l < MQ_MOE_RB; l++) {
        const uint8_t *c = src->codes + (size_t)(row0 + l) * (size_t)cols;
        for (int32_t k = 0; k < cols; k++) {
            uint8_t *byte = dst + (size_t)(k / 8) * 32 + (size_t)l * 4 + (size_t)(k % 4);
            *byte |= (k % 8) < 4 ? c[k] : (uint8_t)(c[k] << 4);
        }
    }
    const int32_t ng = cols / group;
    uint8_t *s = dst + (size_t)cols * 4;
    const size_t sb = nvfp4 ? 1 : 4;
    for (int l = 0; l < MQ_MOE_RB; l++)
        for (int32_t g = 0; g < ng; g++)
            memcpy(s + ((size_t)g * MQ_MOE_RB + (size_t)l) * sb,
                   src->scales + ((size_t)(row0 + l) * (size_t)ng + (size_t)g) * src->scale_stride, sb);
}

/* One matrix to pack: source rows of its row blocks come from `a` (first half, or all rows) and
 * `b` (second half of gate_up: up_proj). */
typedef struct {
    mq_moe_src a, b;
    int32_t rows, cols;       /* of the packed matrix */
    int interleave;           /* gate_up: row block 2i from a (rows 8i..), 2i+1 from b */
    uint8_t *dst;
    const char *tensor;       /* for messages */
    int64_t expert;           /* -1: shared */
} pack_job;

typedef struct {
    const moeq_moe_experts_desc *d;
    moeq_moe_experts *w;
    pack_job *jobs;
    int32_t *bad;             /* per job: 1 if a value failed validation */
} pack_ctx;

/* Validates the codes and scales of a job (the first bad value sets the error message). */
static moeq_status job_check(const pack_job *j, int nvfp4, int32_t group) {
    char ex[40] = "";
    if (j->expert >= 0) snprintf(ex, sizeof ex, "expert %lld ", (long long)j->expert);
    const int32_t half = j->interleave ? j->rows / 2 : j->rows, ng = j->cols / group;
    for (int h = 0; h < (j->interleave ? 2 : 1); h++) {
        const mq_moe_src *s = h ? &j->b : &j->a;
        for (int64_t r = 0; r < half; r++) {
            const uint8_t *c = s->codes + r * j->cols;
            for (int32_t k = 0; k < j->cols; k++)
                if (c[k] > 15)
                    return mq_err(MOEQ_E_FORMAT, "%s: %s.codes: %srow %lld col %d: code %d > 15",
                                  k_ex, j->tensor, ex, (long long)(r + h * half), (int)k, c[k]);
            for (int32_t g = 0; g < ng; g++) {
                const uint8_t *p = s->scales + ((size_t)r * (size_t)ng + (size_t)g) * s->scale_stride;
                float f = 0.0f;
                if (!nvfp4) memcpy(&f, p, 4);
                if (nvfp4 ? (*p & 0x7f) == 0x7f : !isfinite(f))
                    return mq_err(MOEQ_E_NUMERIC, "%s: %s.scales: %srow %lld group %d: %s", k_ex,
                                  j->tensor, ex, (long long)(r + h * half), (int)g,
                                  nvfp4 ? "E4M3 NaN" : "not finite");
            }
        }
    }
    return MOEQ_OK;
}

static void pack_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    pack_ctx *c = ctx;
    const pack_job *j = &c->jobs[task];
    const int nvfp4 = c->d->scheme == MOEQ_MOE_NVFP4;
    const int32_t group = c->d->group_size;
    if (job_check(j, nvfp4, group) != MOEQ_OK) {
        c->bad[task] = 1;
        return;
    }
    const size_t rbb = mq_moe_rb_bytes(j->cols, group, nvfp4);
    for (int32_t rb = 0; rb < j->rows / MQ_MOE_RB; rb++) {
        const mq_moe_src *s = &j->a;
        int64_t row0 = (int64_t)rb * MQ_MOE_RB;
        if (j->interleave) {
            s = (rb & 1) ? &j->b : &j->a;
            row0 = (int64_t)(rb / 2) * MQ_MOE_RB;
        }
        mq_moe_pack_rb(s, j->cols, group, nvfp4, row0, j->dst + (size_t)rb * rbb);
    }
}

/* Source of expert e's matrix (e < 0: a shared one without the leading dimension). */
static mq_moe_src src_of(const moeq_moe_qweight *w, int64_t e, int64_t rows, int64_t cols,
                         int64_t group, int nvfp4, int64_t row_off) {
    const size_t sb = nvfp4 ? 1 : 4;
    const int64_t ng = cols / group;
    const int64_t base = e < 0 ? 0 : e * rows;
    mq_moe_src s;
    s.codes = (const uint8_t *)w->codes.data + (size_t)(base + row_off) * (size_t)cols;
    s.scales = (const uint8_t *)w->scales.data + (size_t)(base + row_off) * (size_t)ng * sb;
    s.scale_stride = sb;
    return s;
}

static moeq_status global_divs(const moeq_moe_qweight *w, int64_t e, bool fused, const char *tensor,
                               float div[2]) {
    const float *g = w->global_scale.data;
    int per = fused && w->global_scale.shape[w->global_scale.ndim - 1] == 2 &&
                      (w->global_scale.ndim == 2 || e < 0)
                  ? 2
                  : 1;
    int64_t i0 = (e < 0 ? 0 : e) * per;
    for (int h = 0; h < 2; h++) {
        float gs = g[i0 + (per == 2 ? h : 0)];
        div[h] = 2.0f * gs;
        if (!(gs > 0.0f) || !isfinite(div[h])) {
            if (e >= 0)
                return mq_err(MOEQ_E_NUMERIC, "%s: %s.global_scale: expert %lld: %g (must be finite and > 0)",
                              k_ex, tensor, (long long)e, (double)gs);
            return mq_err(MOEQ_E_NUMERIC, "%s: %s.global_scale: %g (must be finite and > 0)", k_ex,
                          tensor, (double)gs);
        }
    }
    return MOEQ_OK;
}

/* Packed weights on 2 MiB-aligned transparent huge pages where the kernel allows it: decoding
 * streams hundreds of MB, and with 4 KiB pages every page boundary stops the hardware prefetcher
 * and costs a TLB miss. Freed with free(). */
static uint8_t *alloc_huge(size_t n) {
    const size_t huge = (size_t)2 << 20;
    size_t r = (n + huge - 1) & ~(huge - 1);
    if (r < n) return NULL;
    uint8_t *p = aligned_alloc(huge, r);
#ifdef MADV_HUGEPAGE
    if (p) madvise(p, r, MADV_HUGEPAGE);
#endif
    return p;
}

void moeq_moe_experts_free(moeq_moe_experts *w) {
    if (!w) return;
    free(w->blob);
    mq_free(w->ex);
    mq_free(w);
}

size_t moeq_moe_experts_bytes(const moeq_moe_experts *w) { return w ? w->blob_bytes : 0; }

moeq_status moeq_moe_experts_pack(const moeq_moe_experts_desc *d, moeq_moe_experts **out) {
    if (!out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", k_ex);
    *out = NULL;
    moeq_status st = moeq_moe_experts_check(d);
    if (st) return st;
    const int nvfp4 = d->scheme == MOEQ_MOE_NVFP4;
    const int32_t group = d->group_size, E = d->n_experts, D = d->hidden;
    moeq_moe_experts *w = mq_alloc_zero(sizeof *w, "moe experts");
    if (!w) return MOEQ_E_NOMEM;
    w->scheme = d->scheme;
    w->group = group;
    w->E = E;
    w->D = D;
    w->F = d->ffn;
    w->Fs = d->shared_ffn;
    w->n_mats = E + (d->shared_ffn > 0);
    w->ex = mq_alloc_zero(sizeof(mq_pexpert) * (size_t)w->n_mats, "moe experts");
    pack_job *jobs = mq_alloc_zero(sizeof(pack_job) * 2 * (size_t)w->n_mats, "moe pack jobs");
    int32_t *bad = mq_alloc_zero(sizeof(int32_t) * 2 * (size_t)w->n_mats, "moe pack jobs");
    if (!w->ex || !jobs || !bad) {
        st = MOEQ_E_NOMEM;
        goto done;
    }
    /* sizes and offsets */
    size_t total = 0;
    for (int32_t e = 0; e < w->n_mats; e++) {
        const int32_t F = e < E ? d->ffn : d->shared_ffn;
        size_t gu = (size_t)(2 * F / MQ_MOE_RB) * mq_moe_rb_bytes(D, group, nvfp4);
        size_t dn = (size_t)(D / MQ_MOE_RB) * mq_moe_rb_bytes(F, group, nvfp4);
        w->ex[e].ffn = F;
        w->ex[e].gate_up.data = (const uint8_t *)(uintptr_t)total;   /* offsets for now */
        w->ex[e].down.data = (const uint8_t *)(uintptr_t)(total + gu);
        if (!mq_add_size(total, gu, &total) || !mq_add_size(total, dn, &total)) {
            st = mq_err(MOEQ_E_NOMEM, "%s: packed size overflows", k_ex);
            goto done;
        }
    }
    w->blob = alloc_huge(total);
    if (!w->blob) {
        st = mq_err(MOEQ_E_NOMEM, "%s: out of memory for %zu packed bytes", k_ex, total);
        goto done;
    }
    w->blob_bytes = total;
    for (int32_t e = 0; e < w->n_mats; e++) {
        const bool shared = e >= E;
        const int64_t ei = shared ? -1 : e;
        const int32_t F = w->ex[e].ffn;
        const moeq_moe_qweight *gu = shared ? &d->shared_gate_up : &d->gate_up;
        const moeq_moe_qweight *dn = shared ? &d->shared_down : &d->down;
        mq_pexpert *x = &w->ex[e];
        x->gate_up.data = w->blob + (uintptr_t)x->gate_up.data;
        x->down.data = w->blob + (uintptr_t)x->down.data;
        x->gate_up = (mq_pmat){x->gate_up.data, mq_moe_rb_bytes(D, group, nvfp4), 2 * F, D,
                               nvfp4 ? 16 : group, nvfp4, {1.0f, 1.0f}};
        x->down = (mq_pmat){x->down.data, mq_moe_rb_bytes(F, group, nvfp4), D, F,
                            nvfp4 ? 16 : group, nvfp4, {1.0f, 1.0f}};
        const char *gun = shared ? "shared_gate_up" : "gate_up", *dnn = shared ? "shared_down" : "down";
        if (nvfp4) {
            if ((st = global_divs(gu, ei, true, gun, x->gate_up.div))) goto done;
            if ((st = global_divs(dn, ei, false, dnn, x->down.div))) goto done;
        }
        pack_job *j = &jobs[2 * e];
        j->a = src_of(gu, ei, 2 * F, D, group, nvfp4, 0);
        j->b = src_of(gu, ei, 2 * F, D, group, nvfp4, F);
        j->rows = 2 * F;
        j->cols = D;
        j->interleave = 1;
        j->dst = (uint8_t *)x->gate_up.data;
        j->tensor = gun;
        j->expert = ei;
        j = &jobs[2 * e + 1];
        j->a = src_of(dn, ei, D, F, group, nvfp4, 0);
        j->rows = D;
        j->cols = F;
        j->dst = (uint8_t *)x->down.data;
        j->tensor = dnn;
        j->expert = ei;
    }
    pack_ctx c = {d, w, jobs, bad};
    mq_parallel_for(2 * (int64_t)w->n_mats, pack_task, &c);
    for (int32_t i = 0; i < 2 * w->n_mats && !st; i++)
        if (bad[i]) st = job_check(&jobs[i], nvfp4, group);   /* the message, on this thread */
done:
    mq_free(jobs);
    mq_free(bad);
    if (st) {
        moeq_moe_experts_free(w);
        return st;
    }
    *out = w;
    return MOEQ_OK;
}

/* ---- the op: validation -------------------------------------------------------------------- */
static const char *k_op = "moe_ffn";

moeq_status moeq_moe_ffn_check(const moeq_moe_ffn_args *a, int64_t out_shape[2]) {
    if (!a) return mq_err(MOEQ_E_ARG, "%s: args is NULL", k_op);
    if (!out_shape) return mq_err(MOEQ_E_ARG, "%s: out_shape is NULL", k_op);
    const moeq_moe_experts *w = a->experts;
    if (!w) return mq_err(MOEQ_E_ARG, "%s: experts is NULL", k_op);
    const int64_t E = w->E, D = w->D;
    if (a->x.ndim != 2)
        return mq_err(MOEQ_E_SHAPE, "%s: x: ndim %d, expected 2 ([tokens, %lld])", k_op,
                      (int)a->x.ndim, (long long)D);
    const int64_t T = a->x.shape[0];
    if (T < 0) return mq_err(MOEQ_E_SHAPE, "%s: x: %lld tokens", k_op, (long long)T);
    moeq_status st;
    if (T > 0) {
        if ((st = check_tref(k_op, "x", &a->x, MOEQ_DT_F32, 2, (int64_t[]){T, D}))) return st;
    } else if (a->x.dtype != MOEQ_DT_F32 || a->x.shape[1] != D) {
        return mq_err(MOEQ_E_SHAPE, "%s: x: empty input must be F32 [0, %lld]", k_op, (long long)D);
    }
    if ((st = check_tref(k_op, "router", &a->router, MOEQ_DT_F32, 2, (int64_t[]){E, D}))) return st;
    if (tref_present(&a->router_bias) &&
        (st = check_tref(k_op, "router_bias", &a->router_bias, MOEQ_DT_F32, 1, (int64_t[]){E})))
        return st;
    if (tref_present(&a->shared_gate)) {
        if (w->Fs == 0)
            return mq_err(MOEQ_E_ARG, "%s: shared_gate given but the experts have no shared expert",
                          k_op);
        if (a->shared_gate.ndim == 2)
            st = check_tref(k_op, "shared_gate", &a->shared_gate, MOEQ_DT_F32, 2, (int64_t[]){1, D});
        else
            st = check_tref(k_op, "shared_gate", &a->shared_gate, MOEQ_DT_F32, 1, (int64_t[]){D});
        if (st) return st;
    }
    if (a->top_k < 1 || a->top_k > E)
        return mq_err(MOEQ_E_ARG, "%s: top_k %d: must be in 1..%lld (n_experts)", k_op,
                      (int)a->top_k, (long long)E);
    if (a->scoring != MOEQ_MOE_SOFTMAX && a->scoring != MOEQ_MOE_SIGMOID)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: scoring %d (expected softmax or sigmoid)", k_op,
                      (int)a->scoring);
    if (a->renormalize != 0 && a->renormalize != 1)
        return mq_err(MOEQ_E_ARG, "%s: renormalize %d (expected 0 or 1)", k_op, (int)a->renormalize);
    if (!isfinite(a->route_scale))
        return mq_err(MOEQ_E_ARG, "%s: route_scale %g is not finite", k_op, (double)a->route_scale);
    out_shape[0] = T;
    out_shape[1] = D;
    return MOEQ_OK;
}

/* ---- the op: compute ----------------------------------------------------------------------- */
enum {
    PAIRS_A = 8,   /* gate_up tile pairs per task: 64 outputs of gate and of up */
    PAIRS_B = 8,   /* down tile pairs per task: 128 output rows */
    TOK_CHUNK = 8, /* tokens per task of the per-token phases */
};

typedef struct {
    const moeq_moe_experts *w;
    const mq_moe_kernels *K;
    const float *x, *router, *bias, *sgate;
    int64_t T, P;
    int32_t k;
    moeq_moe_scoring scoring;
    int32_t renorm;
    float route_scale;
    float *logits;        /* [T, E] */
    float *gsh;           /* [T] shared expert gate logits, then weights */
    int32_t *sel;         /* [T, k] */
    float *wt;            /* [T, k] */
    int64_t *off;         /* [n_mats + 1] first permuted row of each matrix */
    int32_t *perm_tok;    /* [P] */
    int64_t *pos;         /* [T, k] permuted row of (token, slot) */
    int32_t *task_mat, *task_chunk;
    mq_qact xq, mq;       /* x [T, D]; mid [P, Fmax] */
    float *y;             /* [P, D] */
    float *scratch;       /* [threads][scratch_stride] */
    size_t scratch_stride;
    float *out;
} run_ctx;

static float sigmoidf(float v) { return 1.0f / (1.0f + expf(-v)); }

/* NaN ranks below every number; among equal scores the earlier (lower) index stays. */
static bool score_better(float a, float b) { return !isnan(a) && (isnan(b) || a > b); }

static void route_token(const run_ctx *c, int64_t t, float *p, uint8_t *taken) {
    const int64_t E = c->w->E;
    const float *lg = c->logits + t * E;
    if (c->scoring == MOEQ_MOE_SOFTMAX) {
        float mx = lg[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++)
            if (lg[e] > mx) mx = lg[e];
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(lg[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
    } else {
        for (int64_t e = 0; e < E; e++) p[e] = sigmoidf(lg[e]);
    }
    memset(taken, 0, (size_t)E);
    int32_t *sel = c->sel + t * c->k;
    float *wt = c->wt + t * c->k, sum = 0.0f;
    for (int32_t j = 0; j < c->k; j++) {
        int64_t best = -1;
        float bs = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            if (taken[e]) continue;
            float s = c->bias ? p[e] + c->bias[e] : p[e];
            if (best < 0 || score_better(s, bs)) {
                best = e;
                bs = s;
            }
        }
        taken[best] = 1;
        sel[j] = (int32_t)best;
        wt[j] = p[best];
        sum += wt[j];
    }
    for (int32_t j = 0; j < c->k; j++) {
        if (c->renorm && sum != 0.0f) wt[j] = wt[j] / sum;
        wt[j] *= c->route_scale;
    }
    if (c->sgate) c->gsh[t] = sigmoidf(c->gsh[t]);
}

static void quant_x_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    run_ctx *c = ctx;
    for (int64_t t = task * TOK_CHUNK; t < c->T && t < (task + 1) * TOK_CHUNK; t++)
        c->K->quant_act(c->x + t * c->w->D, c->w->D, &c->xq, t, 0);
}

static void phase_a_task(void *ctx, int64_t task, int thread) {
    run_ctx *c = ctx;
    const int32_t e = c->task_mat[task];
    const mq_pexpert *ex = &c->w->ex[e];
    const int64_t p0 = (int64_t)c->task_chunk[task] * PAIRS_A;
    const int64_t np = ex->ffn / 8, p1 = p0 + PAIRS_A < np ? p0 + PAIRS_A : np;
    const int64_t r0 = c->off[e], m = c->off[e + 1] - r0, ldo = 8 * (p1 - p0);
    float *s = c->scratch + (size_t)thread * c->scratch_stride;
    c->K->gemm(&ex->gate_up, p0, p1, &c->xq, c->perm_tok + r0, 0, m, s, ldo, 1);
    for (int64_t i = 0; i < m; i++) c->K->quant_act(s + i * ldo, ldo, &c->mq, r0 + i, 8 * p0);
}

static void phase_b_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    run_ctx *c = ctx;
    const int32_t e = c->task_mat[task];
    const mq_pexpert *ex = &c->w->ex[e];
    const int64_t D = c->w->D, p0 = (int64_t)c->task_chunk[task] * PAIRS_B;
    const int64_t np = D / 16, p1 = p0 + PAIRS_B < np ? p0 + PAIRS_B : np;
    const int64_t r0 = c->off[e], m = c->off[e + 1] - r0;
    c->K->gemm(&ex->down, p0, p1, &c->mq, NULL, r0, m, c->y + r0 * D, D, 0);
}

/* out[t] = sum_j wt[t,j] * y[pos(t,j)], slot by slot, then + g[t] * y_shared[t]. */
static void combine_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    run_ctx *c = ctx;
    const int64_t D = c->w->D, E = c->w->E;
    for (int64_t t = task * TOK_CHUNK; t < c->T && t < (task + 1) * TOK_CHUNK; t++) {
        float *o = c->out + t * D;
        const float *y0 = c->y + c->pos[t * c->k] * D;
        const float w0 = c->wt[t * c->k];
        for (int64_t d = 0; d < D; d++) o[d] = w0 * y0[d];
        for (int32_t j = 1; j < c->k; j++) {
            const float *yj = c->y + c->pos[t * c->k + j] * D;
            const float wj = c->wt[t * c->k + j];
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + wj * yj[d];
        }
        if (c->w->Fs > 0) {
            const float *ys = c->y + (c->off[E] + t) * D;
            const float g = c->sgate ? c->gsh[t] : 1.0f;
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + g * ys[d];
        }
    }
}

/* Lays out n buffers in one allocation (64-byte aligned pieces). */
static void *alloc_pieces(size_t n, const size_t *sizes, void **ptrs) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        size_t s = (sizes[i] + 63) & ~(size_t)63;
        if (s < sizes[i] || !mq_add_size(total, s, &total)) {
            mq_err(MOEQ_E_NOMEM, "%s: workspace size overflows", k_op);
            return NULL;
        }
    }
    uint8_t *base = mq_alloc(total ? total : 64, "moe_ffn workspace");
    if (!base) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        ptrs[i] = base + o;
        o += (sizes[i] + 63) & ~(size_t)63;
    }
    return base;
}

static moeq_status moe_run(const moeq_moe_experts *w, const float *x, int64_t T, const float *router,
                           const float *bias, const float *sgate, int32_t k,
                           moeq_moe_scoring scoring, int32_t renorm, float route_scale,
                           float *out) {
    if (T == 0) return MOEQ_OK;
    const int64_t E = w->E, D = w->D, nm = w->n_mats;
    const int nvfp4 = w->scheme == MOEQ_MOE_NVFP4;
    const int32_t B = nvfp4 ? 16 : 32;
    const int64_t Fmax = w->Fs > w->F ? w->Fs : w->F;
    int64_t P;
    if (!mq_mul_i64(T, k + (w->Fs > 0), &P)) return mq_err(MOEQ_E_NOMEM, "%s: too many tokens", k_op);
    const int threads = mq_pool_size();
    int64_t max_tasks = 0;
    for (int64_t e = 0; e < nm; e++) {
        int64_t a = (w->ex[e].ffn / 8 + PAIRS_A - 1) / PAIRS_A, b = (D / 16 + PAIRS_B - 1) / PAIRS_B;
        max_tasks += a > b ? a : b;
    }
    run_ctx c = {.w = w, .K = mq_moe_kernels_active(), .x = x, .router = router, .bias = bias,
                 .sgate = sgate, .T = T, .P = P, .k = k, .scoring = scoring, .renorm = renorm,
                 .route_scale = route_scale, .out = out};
    c.scratch_stride = (size_t)T * 8 * PAIRS_A;
    /* every size below is bounded by P * max(D, Fmax) elements, checked first */
    size_t big;
    if (!mq_mul_size((size_t)P, (size_t)(D > Fmax ? D : Fmax) * 4, &big) ||
        !mq_mul_size(c.scratch_stride * 4, (size_t)threads, &big) ||
        !mq_mul_size((size_t)T, (size_t)E * 4, &big))
        return mq_err(MOEQ_E_NOMEM, "%s: %lld tokens need too much memory", k_op, (long long)T);
    void *ptr[17];
    const size_t sizes[17] = {
        (size_t)T * E * 4,                   /* logits */
        (size_t)T * 4,                       /* gsh */
        (size_t)T * k * 4,                   /* sel */
        (size_t)T * k * 4,                   /* wt */
        (size_t)(nm + 1) * 8,                /* off */
        (size_t)P * 4,                       /* perm_tok */
        (size_t)T * k * 8,                   /* pos */
        (size_t)max_tasks * 4,               /* task_mat */
        (size_t)max_tasks * 4,               /* task_chunk */
        (size_t)T * D * 2,                   /* xq.q, xq.q2 */
        (size_t)T * (D / B) * 8,             /* xq.scale + corr */
        (size_t)P * Fmax * 2,                /* mq.q, mq.q2 */
        (size_t)P * (Fmax / B) * 8,          /* mq.scale + corr */
        (size_t)P * D * 4,                   /* y */
        c.scratch_stride * 4 * (size_t)threads,
        (size_t)E * 5,                       /* routing scratch: probabilities + taken flags */
        (size_t)nm * 8,                      /* counting-sort cursors */
    };
    void *base = alloc_pieces(17, sizes, ptr);
    if (!base) return MOEQ_E_NOMEM;
    c.logits = ptr[0];
    c.gsh = ptr[1];
    c.sel = ptr[2];
    c.wt = ptr[3];
    c.off = ptr[4];
    c.perm_tok = ptr[5];
    c.pos = ptr[6];
    c.task_mat = ptr[7];
    c.task_chunk = ptr[8];
    /* x and the SwiGLU output as split int16 (see moe_ffn.h) */
    c.xq = (mq_qact){ptr[9], (int8_t *)ptr[9] + T * D, ptr[10], (int32_t *)ptr[10] + T * (D / B), D, B, nvfp4 ? 12 : 8};
    c.mq = (mq_qact){ptr[11], (int8_t *)ptr[11] + P * Fmax, ptr[12], (int32_t *)ptr[12] + P * (Fmax / B),
                     Fmax, B, nvfp4 ? 12 : 8};
    c.y = ptr[13];
    c.scratch = ptr[14];

    /* routing (fp32): logits, scores, top-k, weights */
    mq_gemm_nt(T, E, D, 1.0f, x, D, router, D, 0.0f, c.logits, E);
    if (sgate) mq_gemm_nt(T, 1, D, 1.0f, x, D, sgate, D, 0.0f, c.gsh, 1);
    float *p = ptr[15];
    uint8_t *taken = (uint8_t *)(p + E);
    for (int64_t t = 0; t < T; t++) route_token(&c, t, p, taken);

    /* counting sort of (token, slot) by expert; the shared expert takes every token, last */
    int64_t *cnt = c.off;
    memset(cnt, 0, sizeof(int64_t) * (size_t)(nm + 1));
    for (int64_t i = 0; i < T * k; i++) cnt[c.sel[i] + 1]++;
    if (w->Fs > 0) cnt[E + 1] = T;
    for (int64_t e = 0; e < nm; e++) cnt[e + 1] += cnt[e];
    int64_t *cur = ptr[16];
    memcpy(cur, c.off, sizeof(int64_t) * (size_t)nm);
    for (int64_t t = 0; t < T; t++)
        for (int32_t j = 0; j < k; j++) {
            int64_t r = cur[c.sel[t * k + j]]++;
            c.perm_tok[r] = (int32_t)t;
            c.pos[t * k + j] = r;
        }
    if (w->Fs > 0)
        for (int64_t t = 0; t < T; t++) c.perm_tok[c.off[E] + t] = (int32_t)t;

    /* x -> int8 blocks */
    mq_parallel_for((T + TOK_CHUNK - 1) / TOK_CHUNK, quant_x_task, &c);

    /* phase A: gate+up, SwiGLU, mid -> int8 */
    int64_t n = 0;
    for (int64_t e = 0; e < nm; e++) {
        if (c.off[e + 1] == c.off[e]) continue;
        int64_t chunks = (w->ex[e].ffn / 8 + PAIRS_A - 1) / PAIRS_A;
        for (int64_t i = 0; i < chunks; i++, n++) {
            c.task_mat[n] = (int32_t)e;
            c.task_chunk[n] = (int32_t)i;
        }
    }
    mq_parallel_for(n, phase_a_task, &c);

    /* phase B: down */
    n = 0;
    for (int64_t e = 0; e < nm; e++) {
        if (c.off[e + 1] == c.off[e]) continue;
        int64_t chunks = (D / 16 + PAIRS_B - 1) / PAIRS_B;
        for (int64_t i = 0; i < chunks; i++, n++) {
            c.task_mat[n] = (int32_t)e;
            c.task_chunk[n] = (int32_t)i;
        }
    }
    mq_parallel_for(n, phase_b_task, &c);

    mq_parallel_for((T + TOK_CHUNK - 1) / TOK_CHUNK, combine_task, &c);
    mq_free(base);
    return MOEQ_OK;
}

moeq_status moeq_moe_ffn(const moeq_moe_ffn_args *a, float *out, size_t out_capacity) {
    int64_t shape[2];
    moeq_status st = moeq_moe_ffn_check(a, shape);
    if (st) return st;
    size_t need = (size_t)shape[0] * (size_t)shape[1];
    if (shape[0] > 0 && !out) return mq_err(MOEQ_E_ARG, "%s: out is NULL", k_op);
    if (out_capacity < need)
        return mq_err(MOEQ_E_ARG, "%s: out holds %zu floats, [%lld, %lld] needs %zu", k_op,
                      out_capacity, (long long)shape[0], (long long)shape[1], need);
    const float *sg = a->shared_gate.data;
    return moe_run(a->experts, a->x.data, shape[0], a->router.data, a->router_bias.data, sg,
                   a->top_k, a->scoring, a->renormalize, a->route_scale, out);
}

/* ---- runtime entry points ------------------------------------------------------------------ */
const mq_moe_kernels *mq_moe_kernels_active(void) {
#if defined(__x86_64__) || defined(__i386__)
    if (mq_cpu_has_avx2_fma() && !mq_force_ref()) return &mq_moe_kernels_avx2;
#endif
    return &mq_moe_kernels_ref;
}

moeq_status mq_moe_layer_forward(const mq_moe_layer *L, const float *x, int64_t T, float *out) {
    if (!L || !L->experts || !L->router || (T > 0 && (!x || !out)))
        return mq_err(MOEQ_E_ARG, "%s: layer, router, x or out is NULL", k_op);
    const moeq_moe_experts *w = L->experts;
    size_t xb = (size_t)T * (size_t)w->D * 4;
    moeq_moe_ffn_args a = {
        .x = {x, MOEQ_DT_F32, 2, {T, w->D}, xb},
        .router = {L->router, MOEQ_DT_F32, 2, {w->E, w->D}, (size_t)w->E * (size_t)w->D * 4},
        .router_bias = {L->router_bias, MOEQ_DT_F32, 1, {w->E}, (size_t)w->E * 4},
        .shared_gate = {L->shared_gate, MOEQ_DT_F32, 1, {w->D}, (size_t)w->D * 4},
        .experts = w, .top_k = L->top_k, .scoring = L->scoring, .renormalize = L->renormalize,
        .route_scale = L->route_scale};
    return moeq_moe_ffn(&a, out, xb / 4);
}

void mq_moe_layer_free(mq_moe_layer *L) {
    if (!L) return;
    moeq_moe_experts_free(L->experts);
    L->experts = NULL;
}
