/*
 * GGUF matrices read in place (ggml_mat.h): row decoding, y = x W^T over decoded rows, and the
 * repack of Q4_0 / NVFP4 experts into the fused MoE op's layout. The block layouts are ggml's
 * (ggml-common.h: block_q8_0 {f16 d; int8 qs[32]}, block_q4_0 {f16 d; uint8 qs[16]} with value j
 * in the low nibble of qs[j] and value j + 16 in its high nibble, block_q4_1 {f16 d, m; qs[16]},
 * block_nvfp4 {uint8 d[4] (UE4M3); uint8 qs[32]} with sub-block s's value j low and j + 8 high in
 * qs[8s + j]); the arithmetic is io/gguf.c's decoder's, term for term, so the values are the same
 * bits the fp32 path computes with.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "formats/kquant.h"
#include "kernels/ggml_mat.h"
#include "kernels/vec.h"

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

bool mq_ggml_mat_type_ok(uint32_t type, int64_t *block, size_t *block_bytes) {
    int64_t b = 0;
    size_t bb = 0;
    switch (type) {
    case MQ_GM_F32: b = 1, bb = 4; break;
    case MQ_GM_F16: b = 1, bb = 2; break;
    case MQ_GM_BF16: b = 1, bb = 2; break;
    case MQ_GM_Q8_0: b = 32, bb = 34; break;
    case MQ_GM_Q4_0: b = 32, bb = 18; break;
    case MQ_GM_Q4_1: b = 32, bb = 20; break;
    case MQ_GM_NVFP4: b = 64, bb = 36; break;
    case MQ_GM_Q5_0: case MQ_GM_Q5_1: case MQ_GM_Q3_K: case MQ_GM_Q4_K: case MQ_GM_Q5_K:
    case MQ_GM_Q6_K: case MQ_GM_IQ4_NL: case MQ_GM_IQ4_XS: {
        mq_kq_type k;
        if (!mq_kq_of_ggml(type, &k)) return false;
        b = mq_kq_info_of(k)->block, bb = (size_t)mq_kq_info_of(k)->bytes;
        break;
    }
    default: return false;
    }
    if (block) *block = b;
    if (block_bytes) *block_bytes = bb;
    return true;
}

moeq_status mq_ggml_mat_init(mq_ggml_mat *m, const uint8_t *data, uint32_t type, int64_t rows,
                             int64_t cols, float scale, int32_t perm_hd, const char *name) {
    int64_t b;
    size_t bb;
    memset(m, 0, sizeof *m);
    if (!mq_ggml_mat_type_ok(type, &b, &bb))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: ggml type %u is not read in place", name, type);
    if (rows <= 0 || cols <= 0 || cols % b)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: [%lld, %lld] is not whole blocks of %lld", name,
                      (long long)rows, (long long)cols, (long long)b);
    if (perm_hd > 0 && (perm_hd % 2 || rows % perm_hd))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: rows %lld are not heads of %d", name,
                      (long long)rows, perm_hd);
    *m = (mq_ggml_mat){data, type, rows, cols, (size_t)(cols / b) * bb, scale, perm_hd};
    return MOEQ_OK;
}

size_t mq_ggml_mat_bytes(const mq_ggml_mat *m) { return (size_t)m->rows * m->row_bytes; }

static float e2m1(uint8_t c) {
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return c & 8 && c != 8 ? -mag[c & 7] : mag[c & 7];
}

/* UE4M3 as ggml reads it: the sign bit ignored, 0 and 0x7F give 0 (io/gguf.c's). */
static float ue4m3(uint8_t x) {
    if (x == 0 || x == 0x7F) return 0.0f;
    int e = (x >> 3) & 0xF, mt = x & 7;
    return e == 0 ? ldexpf((float)mt, -9) : ldexpf(1.0f + (float)mt / 8.0f, e - 7);
}

static int64_t stored_row(const mq_ggml_mat *m, int64_t r) {
    if (m->perm_hd <= 0) return r;
    const int64_t hd = m->perm_hd, half = hd / 2, h = r / hd, k = r % hd;
    return h * hd + 2 * (k % half) + k / half;   /* k = j * half + i -> 2i + j */
}

void mq_ggml_mat_row(const mq_ggml_mat *m, int64_t r, float *y) {
    const uint8_t *p = m->data + (size_t)stored_row(m, r) * m->row_bytes;
    const int64_t n = m->cols;
    float *const y0 = y;
    switch (m->type) {
    case MQ_GM_F32: memcpy(y, p, (size_t)n * 4); break;
    case MQ_GM_F16:
        for (int64_t i = 0; i < n; i++) y[i] = mq_f16_to_f32(rd16(p + 2 * i));
        break;
    case MQ_GM_BF16:
        for (int64_t i = 0; i < n; i++) y[i] = mq_bf16_to_f32(rd16(p + 2 * i));
        break;
    case MQ_GM_Q8_0:
        for (int64_t b = 0; b < n / 32; b++, p += 34, y += 32) {
            const float d = mq_f16_to_f32(rd16(p));
            for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)p[2 + j] * d;
        }
        break;
    case MQ_GM_Q4_0:
        for (int64_t b = 0; b < n / 32; b++, p += 18, y += 32) {
            const float d = mq_f16_to_f32(rd16(p));
            for (int j = 0; j < 16; j++) {
                y[j] = (float)((p[2 + j] & 0xF) - 8) * d;
                y[j + 16] = (float)((p[2 + j] >> 4) - 8) * d;
            }
        }
        break;
    case MQ_GM_Q4_1:
        for (int64_t b = 0; b < n / 32; b++, p += 20, y += 32) {
            const float d = mq_f16_to_f32(rd16(p)), mn = mq_f16_to_f32(rd16(p + 2));
            for (int j = 0; j < 16; j++) {
                y[j] = (float)(p[4 + j] & 0xF) * d + mn;
                y[j + 16] = (float)(p[4 + j] >> 4) * d + mn;
            }
        }
        break;
    case MQ_GM_NVFP4:
        for (int64_t b = 0; b < n / 64; b++, p += 36, y += 64)
            for (int s = 0; s < 4; s++) {
                const float d = ue4m3(p[s]);
                const uint8_t *q = p + 4 + s * 8;
                for (int j = 0; j < 8; j++) {
                    y[s * 16 + j] = e2m1(q[j] & 0xF) * d;
                    y[s * 16 + j + 8] = e2m1(q[j] >> 4) * d;
                }
            }
        break;
    default: {   /* the K-quants and Q5_0 / Q5_1: formats/kquant.h's unpacking, ggml's operations */
        mq_kq_type k;
        MQ_ASSERT(mq_kq_of_ggml(m->type, &k));
        const mq_kq_info *t = mq_kq_info_of(k);
        mq_gparams g[16];
        uint8_t c[256];
        for (int64_t b = 0; b < n / t->block; b++, p += t->bytes, y += t->block) {
            mq_kq_unpack_block(t, p, g, c);
            for (int i = 0; i < t->block; i++) y[i] = mq_kq_value(t, &g[i / t->sub], c[i]);
        }
    }
    }
    if (m->scale != 1.0f) {
        for (int64_t i = 0; i < n; i++) y0[i] *= m->scale;
    }
}

/* ---- y = x W^T --------------------------------------------------------------------------------- */
#define GM_ROWS 8   /* rows decoded together: each token's x row is then read once per 8 rows */

typedef struct {
    const mq_ggml_mat *m;
    const float *x;
    int64_t T, task_rows;
    float *y;
    int32_t *oom;
} gm_job;

/* Rows [task * task_rows, ...) in groups of GM_ROWS: decoded, then each token's dot products. */
static void gm_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    gm_job *j = ctx;
    const mq_ggml_mat *m = j->m;
    const int64_t end = (task + 1) * j->task_rows < m->rows ? (task + 1) * j->task_rows : m->rows;
    float *w = mq_alloc_array((size_t)(GM_ROWS * m->cols), sizeof(float), "ggml rows");
    if (!w) {
        *j->oom = 1;
        return;
    }
    const mq_vec_kernels *vk = mq_vec();
    const mq_ggml_dot_kernels *dk = mq_ggml_dot();
    const bool q8 = m->type == MQ_GM_Q8_0, bf = m->type == MQ_GM_BF16 && m->cols % 8 == 0;
    if (bf && m->scale == 1.0f) {   /* straight from the stored rows, several at once */
        for (int64_t r0 = task * j->task_rows; r0 < end; r0 += MQ_GM_BF16_ROWS) {
            const uint8_t *p[MQ_GM_BF16_ROWS];
            const int64_t nr = end - r0 < MQ_GM_BF16_ROWS ? end - r0 : MQ_GM_BF16_ROWS;
            for (int64_t r = 0; r < nr; r++) p[r] = m->data + (size_t)stored_row(m, r0 + r) * m->row_bytes;
            dk->bf16_rows(p, nr, j->x, m->cols, j->T, m->cols, j->y + r0, m->rows);
        }
        mq_free(w);
        return;
    }
    if (q8 && m->scale == 1.0f) {   /* straight from the stored rows */
        for (int64_t r = task * j->task_rows; r < end; r++) {
            const uint8_t *p = m->data + (size_t)stored_row(m, r) * m->row_bytes;
            for (int64_t t = 0; t < j->T; t++) j->y[t * m->rows + r] = dk->q8_0(p, j->x + t * m->cols, m->cols / 32);
        }
        mq_free(w);
        return;
    }
    for (int64_t r0 = task * j->task_rows; r0 < end; r0 += GM_ROWS) {
        const int64_t nr = end - r0 < GM_ROWS ? end - r0 : GM_ROWS;
        for (int64_t r = 0; r < nr; r++) mq_ggml_mat_row(m, r0 + r, w + r * m->cols);
        for (int64_t t = 0; t < j->T; t++)
            vk->gemv(w, m->cols, nr, j->x + t * m->cols, m->cols, 1.0f, j->y + t * m->rows + r0);
    }
    mq_free(w);
}

moeq_status mq_ggml_mat_forward(const mq_ggml_mat *m, const float *x, int64_t T, float *y) {
    int32_t oom = 0;
    /* about four tasks a thread (a task's rows are whole groups): the results do not depend on
     * the split, as every output is one dot product */
    const int64_t groups = (m->rows + GM_ROWS - 1) / GM_ROWS, want = 4 * (int64_t)mq_pool_size();
    const int64_t per = groups > want ? (groups + want - 1) / want : 1;
    gm_job j = {m, x, T, per * GM_ROWS, y, &oom};
    mq_parallel_for((groups + per - 1) / per, gm_task, &j);
    return oom ? mq_err(MOEQ_E_NOMEM, "out of memory for decoded rows") : MOEQ_OK;
}

/* ---- experts into the MoE op's layout --------------------------------------------------------- */
typedef struct {
    const mq_ggml_expert *src;
    moeq_moe_experts *w;
    int nvfp4;
    int32_t *bad;   /* per task: an NVFP4 scale byte 0xFF (ggml's 480, no E4M3 value) */
} gp_job;

/* Rows [row0, row0 + 8) of m as a one-row-block mq_moe_src: codes [8, cols] and scales (INT4:
 * floats [8, cols / 32]; NVFP4: E4M3 bytes [8, cols / 16]). Returns false for a 0xFF scale. */
static bool gp_unpack(const mq_ggml_mat *m, int64_t row0, int nvfp4, uint8_t *codes, uint8_t *sc) {
    const int64_t n = m->cols;
    for (int64_t l = 0; l < MQ_MOE_RB && row0 + l < m->rows; l++) {
        const uint8_t *p = m->data + (size_t)stored_row(m, row0 + l) * m->row_bytes;
        uint8_t *c = codes + l * n;
        if (!nvfp4) {
            float *s = (float *)(void *)sc + l * (n / 32);
            for (int64_t b = 0; b < n / 32; b++, p += 18, c += 32) {
                s[b] = mq_f16_to_f32(rd16(p));
                for (int j = 0; j < 16; j++) {
                    c[j] = p[2 + j] & 0xF;
                    c[j + 16] = p[2 + j] >> 4;
                }
            }
            continue;
        }
        uint8_t *s = sc + l * (n / 16);
        for (int64_t b = 0; b < n / 64; b++, p += 36, c += 64)
            for (int k = 0; k < 4; k++) {
                if (p[k] == 0xFF) return false;
                s[b * 4 + k] = p[k] == 0x7F ? 0 : p[k] & 0x7F;
                for (int j = 0; j < 8; j++) {
                    c[k * 16 + j] = p[4 + k * 8 + j] & 0xF;
                    c[k * 16 + j + 8] = p[4 + k * 8 + j] >> 4;
                }
            }
    }
    return true;
}

static void gp_pack(const mq_ggml_mat *m, const mq_pmat *dst, int64_t rb_src, int64_t rb_dst,
                    int nvfp4, uint8_t *codes, uint8_t *sc, int32_t *bad) {
    const int64_t row0 = rb_src * MQ_MOE_RB;
    if (!gp_unpack(m, row0, nvfp4, codes, sc)) {
        *bad = 1;
        return;
    }
    mq_moe_src s = {codes, sc, nvfp4 ? 1 : 4, 1.0f, 1};
    const int64_t left = m->rows - row0 > 0 ? m->rows - row0 : 0;
    mq_moe_pack_rb(&s, left < MQ_MOE_RB ? left : MQ_MOE_RB, (int32_t)m->cols, dst->group, nvfp4,
                   (mq_moe_stype)dst->stype, 0,
                   (uint8_t *)dst->data + (size_t)rb_dst * dst->rb_bytes);
}

/* Task 2e: expert e's gate_up (gate row block i at 2i, up's at 2i + 1), 2e + 1: its down. */
static void gp_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    gp_job *j = ctx;
    const mq_ggml_expert *s = &j->src[task / 2];
    const mq_pexpert *x = &j->w->ex[task / 2];
    const int64_t cols = task % 2 ? s->down.cols : s->gate.cols;
    uint8_t *codes = mq_alloc((size_t)(MQ_MOE_RB * cols), "repack rows");
    uint8_t *sc = mq_alloc((size_t)(MQ_MOE_RB * (cols / 16) * 4), "repack scales");
    if (!codes || !sc) {
        j->bad[task] = 2;
    } else if (task % 2 == 0) {
        for (int64_t rb = 0; rb < s->gate.rows / MQ_MOE_RB && !j->bad[task]; rb++) {
            gp_pack(&s->gate, &x->gate_up, rb, 2 * rb, j->nvfp4, codes, sc, &j->bad[task]);
            gp_pack(&s->up, &x->gate_up, rb, 2 * rb + 1, j->nvfp4, codes, sc, &j->bad[task]);
        }
    } else {
        for (int64_t rb = 0; rb < s->down.rows / MQ_MOE_RB && !j->bad[task]; rb++)
            gp_pack(&s->down, &x->down, rb, rb, j->nvfp4, codes, sc, &j->bad[task]);
    }
    mq_free(codes);
    mq_free(sc);
}

/* The blob, on transparent huge pages where it spans them (as the op's own packing does). */
static uint8_t *blob_alloc(size_t n) {
    const size_t huge = (size_t)2 << 20;
    size_t r = (n + 4095) & ~(size_t)4095;
    void *p = NULL;
    if (r < n || r == 0 || posix_memalign(&p, n >= huge ? huge : 64, r) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (n >= huge) madvise(p, n & ~(huge - 1), MADV_HUGEPAGE);
#endif
    return p;
}

static moeq_status shape_ok(const mq_ggml_expert *s, uint32_t type, int64_t D, int32_t group,
                            const char *what, int e) {
    const mq_ggml_mat *m[3] = {&s->gate, &s->up, &s->down};
    const int64_t F = s->gate.rows;
    for (int i = 0; i < 3; i++) {
        if (m[i]->type != type || m[i]->perm_hd)
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: expert %d: its matrices are not all of one "
                          "packable type (%u against %u)", what, e, m[i]->type, type);
        if (i < 2 ? (m[i]->rows != F || m[i]->cols != D) : (m[i]->rows != D || m[i]->cols != F))
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: expert %d: shapes do not fit", what, e);
    }
    if (F % 16 || D % 16 || F % group || D % group)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: expert %d: widths %lld and %lld are not multiples of "
                      "16 and %d", what, e, (long long)D, (long long)F, group);
    if (type == MQ_GM_Q4_0 && s->gate.scale != 1.0f)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: expert %d: a scaled Q4_0 matrix", what, e);
    return MOEQ_OK;
}

moeq_status mq_moe_experts_ggml_check(const mq_ggml_expert *src, int32_t E, int has_shared,
                                      const char *what) {
    const uint32_t type = src[0].gate.type;
    if (type != MQ_GM_Q4_0 && type != MQ_GM_NVFP4)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: experts of ggml type %u have no packed kernel", what,
                      type);
    const int32_t group = type == MQ_GM_NVFP4 ? 16 : 32, n = E + (has_shared ? 1 : 0);
    const int64_t D = src[0].gate.cols;
    if (D > INT32_MAX) return mq_err(MOEQ_E_UNSUPPORTED, "%s: too wide", what);
    for (int32_t e = 0; e < n; e++) {
        moeq_status s = shape_ok(&src[e], type, D, group, what, e);
        if (s) return s;
        if (e < E && src[e].gate.rows != src[0].gate.rows)
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: experts of different widths", what);
    }
    return MOEQ_OK;
}

moeq_status mq_moe_experts_from_ggml(const mq_ggml_expert *src, int32_t E, int has_shared,
                                     const char *what, moeq_moe_experts **out) {
    *out = NULL;
    moeq_status cs = mq_moe_experts_ggml_check(src, E, has_shared, what);
    if (cs) return cs;
    const uint32_t type = src[0].gate.type;
    const int nvfp4 = type == MQ_GM_NVFP4;
    const int32_t group = nvfp4 ? 16 : 32, n = E + (has_shared ? 1 : 0);
    const int64_t D = src[0].gate.cols;
    const mq_moe_stype st = nvfp4 ? MQ_MOE_S_E4M3 : MQ_MOE_S_F16;
    moeq_moe_experts *w = mq_alloc_zero(sizeof *w, "moe experts");
    int32_t *bad = mq_alloc_zero(sizeof(int32_t) * 2 * (size_t)n, "repack tasks");
    moeq_status s = MOEQ_OK;
    if (!w || !bad || !(w->ex = mq_alloc_zero(sizeof(mq_pexpert) * (size_t)n, "moe experts"))) {
        s = MOEQ_E_NOMEM;
        goto done;
    }
    w->scheme = nvfp4 ? MOEQ_MOE_NVFP4 : MOEQ_MOE_INT4;
    w->group = group;
    w->E = E;
    w->D = (int32_t)D;
    w->F = (int32_t)src[0].gate.rows;
    w->Fs = has_shared ? (int32_t)src[E].gate.rows : 0;
    w->n_mats = n;
    size_t total = 0, rbd = mq_moe_rb_bytes((int32_t)D, group, st);
    for (int32_t e = 0; e < n; e++) {
        const int32_t F = (int32_t)src[e].gate.rows;
        const size_t rbf = mq_moe_rb_bytes(F, group, st);
        const size_t gu = (size_t)(2 * F / MQ_MOE_RB) * rbd, dn = (size_t)(D / MQ_MOE_RB) * rbf;
        mq_pexpert *x = &w->ex[e];
        x->ffn = F;
        /* NVFP4: the op's ModelOpt form, result = acc * global / 2 (moe_ffn.h) */
        const float gm = nvfp4 ? src[e].gate.scale : 1, um = nvfp4 ? src[e].up.scale : 1,
                    dm = nvfp4 ? src[e].down.scale : 1, dv = nvfp4 ? 2 : 1;
        x->gate_up = (mq_pmat){(const uint8_t *)(uintptr_t)total, rbd, 2 * F, (int32_t)D, group,
                               nvfp4, st, {gm, um}, {dv, dv}, 0};
        x->down = (mq_pmat){(const uint8_t *)(uintptr_t)(total + gu), rbf, (int32_t)D, F, group,
                            nvfp4, st, {dm, dm}, {dv, dv}, 0};
        if (!mq_add_size(total, gu, &total) || !mq_add_size(total, dn, &total)) {
            s = mq_err(MOEQ_E_NOMEM, "%s: packed size overflows", what);
            goto done;
        }
    }
    if (!(w->blob = blob_alloc(total))) {
        s = mq_err(MOEQ_E_NOMEM, "%s: out of memory for %zu packed bytes", what, total);
        goto done;
    }
    w->blob_bytes = total;
    for (int32_t e = 0; e < n; e++) {
        w->ex[e].gate_up.data = w->blob + (uintptr_t)w->ex[e].gate_up.data;
        w->ex[e].down.data = w->blob + (uintptr_t)w->ex[e].down.data;
    }
    gp_job j = {src, w, nvfp4, bad};
    mq_parallel_for(2 * (int64_t)n, gp_task, &j);
    for (int32_t i = 0; i < 2 * n && !s; i++)
        if (bad[i] == 2) s = mq_err(MOEQ_E_NOMEM, "%s: out of memory", what);
        else if (bad[i])
            s = mq_err(MOEQ_E_UNSUPPORTED, "%s: expert %d: an NVFP4 scale byte 0xFF (no E4M3 "
                       "value)", what, i / 2);
done:
    mq_free(bad);
    if (s) {
        moeq_moe_experts_free(w);
        return s;
    }
    *out = w;
    return MOEQ_OK;
}

/* ---- asymmetric blocks (Q4_1, Q4_K) as symmetric INT4 plus offsets ----------------------------- */
/* Row r's codes, steps and offsets: value (r, c) = step[c / 32] * code[c] - off0[c / 32] in the
 * file (Q4_1: d * q + m, off0 = -m; Q4_K: (d * sc) * q - dmin * m, kquant.h), kept as
 * step * (code - 8) (the packed kernels' symmetric INT4 with the exact fp32 step as its scale)
 * plus off = 8 * step - off0 per block of 32 (one rounding). */
static void asym_row(const mq_ggml_mat *m, int64_t r, uint8_t *codes, float *step, float *off) {
    const uint8_t *p = m->data + (size_t)stored_row(m, r) * m->row_bytes;
    if (m->type == MQ_GM_Q4_1) {
        for (int64_t b = 0; b < m->cols / 32; b++, p += 20, codes += 32) {
            const float d = mq_f16_to_f32(rd16(p)), mn = mq_f16_to_f32(rd16(p + 2));
            step[b] = d;
            off[b] = 8.0f * d + mn;
            for (int j = 0; j < 16; j++) {
                codes[j] = p[4 + j] & 0xF;
                codes[j + 16] = p[4 + j] >> 4;
            }
        }
        return;
    }
    const mq_kq_info *t = mq_kq_info_of(MQ_KQ_Q4_K);
    mq_gparams g[8];
    for (int64_t b = 0; b < m->cols / 256; b++, p += t->bytes, codes += 256) {
        mq_kq_unpack_block(t, p, g, codes);
        for (int j = 0; j < 8; j++) {
            step[8 * b + j] = g[j].scale;
            off[8 * b + j] = 8.0f * g[j].scale - g[j].zero;
        }
    }
}

static bool asym_type(uint32_t type) { return type == MQ_GM_Q4_1 || type == MQ_GM_Q4_K; }

/* ---- a dense Linear into the packed Linear's layout ------------------------------------------- */
moeq_status mq_packed_weight_ggml_check(const mq_ggml_mat *m, const char *name) {
    if (m->type != MQ_GM_Q4_0 && m->type != MQ_GM_NVFP4 && !asym_type(m->type))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: ggml type %u has no packed kernel", name, m->type);
    const int32_t group = m->type == MQ_GM_NVFP4 ? 16 : 32;
    if (m->rows > INT32_MAX - 16 || m->cols > INT32_MAX || m->cols % group ||
        (m->type != MQ_GM_NVFP4 && m->scale != 1.0f))
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: [%lld, %lld] does not fit the packed kernels", name,
                      (long long)m->rows, (long long)m->cols);
    return MOEQ_OK;
}

moeq_status mq_packed_weight_from_ggml(const mq_ggml_mat *m, const char *name,
                                       struct mq_packed_weight **out) {
    *out = NULL;
    moeq_status cs = mq_packed_weight_ggml_check(m, name);
    if (cs) return cs;
    const int nvfp4 = m->type == MQ_GM_NVFP4, asym = asym_type(m->type);
    const int32_t group = nvfp4 ? 16 : 32;
    /* Q4_K's steps d * sc have up to 17 significant bits: fp32 */
    const mq_moe_stype st = nvfp4 ? MQ_MOE_S_E4M3 : m->type == MQ_GM_Q4_K ? MQ_MOE_S_F32 : MQ_MOE_S_F16;
    const int32_t prow = (int32_t)((m->rows + 15) / 16 * 16), cols = (int32_t)m->cols;
    const size_t rbb = mq_moe_rb_bytes(cols, group, st);
    struct mq_packed_weight *w = mq_alloc_zero(sizeof *w, "packed weight");
    uint8_t *codes = mq_alloc((size_t)(MQ_MOE_RB * cols), "repack rows");
    uint8_t *sc = mq_alloc((size_t)(MQ_MOE_RB * (cols / 16) * 4), "repack scales");
    moeq_status s = MOEQ_OK;
    if (!w || !codes || !sc) {
        s = MOEQ_E_NOMEM;
        goto done;
    }
    w->out = (int32_t)m->rows;
    w->in = cols;
    w->bytes = rbb * (size_t)(prow / MQ_MOE_RB);
    const size_t off_bytes = asym ? (size_t)m->rows * (size_t)(cols / 32) * 4 : 0;
    if (asym) {   /* the offsets after the row blocks, 64-byte aligned */
        w->off_at = (w->bytes + 63) & ~(size_t)63;
        w->bytes = w->off_at + off_bytes;
    }
    const float gm = nvfp4 ? m->scale : 1, dv = nvfp4 ? 2 : 1;
    w->W = (mq_pmat){NULL, rbb, prow, cols, group, nvfp4, st, {gm, gm}, {dv, dv}, 0};
    if (!(w->blob = blob_alloc(w->bytes))) {
        s = mq_err(MOEQ_E_NOMEM, "%s: out of memory for %zu packed bytes", name, w->bytes);
        goto done;
    }
    w->W.data = w->blob;
    int32_t bad = 0;
    if (asym) {
        float *off = (float *)(void *)(w->blob + w->off_at);
        w->off = off;
        for (int32_t rb = 0; rb < prow / MQ_MOE_RB; rb++) {
            const int64_t r0 = (int64_t)rb * MQ_MOE_RB;
            for (int64_t l = 0; l < MQ_MOE_RB && r0 + l < m->rows; l++)
                asym_row(m, r0 + l, codes + l * cols, (float *)(void *)sc + l * (cols / 32),
                         off + (r0 + l) * (cols / 32));
            mq_moe_src src = {codes, sc, 4, 1.0f, 1};
            const int64_t left = m->rows - r0 > 0 ? m->rows - r0 : 0;
            mq_moe_pack_rb(&src, left < MQ_MOE_RB ? left : MQ_MOE_RB, cols, group, 0, st, 0,
                           w->blob + (size_t)rb * rbb);
        }
    }
    for (int32_t rb = 0; !asym && rb < prow / MQ_MOE_RB && !bad; rb++)
        gp_pack(m, &w->W, rb, rb, nvfp4, codes, sc, &bad);
    if (bad) s = mq_err(MOEQ_E_UNSUPPORTED, "%s: an NVFP4 scale byte 0xFF (no E4M3 value)", name);
done:
    mq_free(codes);
    mq_free(sc);
    if (s) {
        mq_packed_weight_free(w);
        return s;
    }
    *out = w;
    return MOEQ_OK;
}
