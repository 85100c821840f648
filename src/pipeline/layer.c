/*
 * One decoder layer of the pipeline (see pipeline.h for the stages). The calibration forward of
 * every sample is the model's own forward cut into its parts (model.h: mq_attention_forward,
 * mq_ffn_norm, mq_moe_route, mq_mlp_forward, mq_shared_expert_add), with routed experts run on
 * the same blocks of rows, so the values equal a whole-model forward bit for bit; Hessians get one
 * update per sample, in sample order (IST-DASLab gptq's add_batch per forward), and the experts'
 * outputs are summed per token in increasing expert order, as the forward sums them.
 *
 * Memory: a layer's attention is loaded alone; routed experts are loaded, calibrated, quantized,
 * written and freed a chunk at a time (mq_mem_plan.chunk), so a layer never has to fit at once.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "dist/dist.h"
#include "kernels/gemm_det.h"
#include "kernels/vec.h"
#include "pipeline/internal.h"

/* The fallback Hessian of an expert's down projection (MQ_HOW_GPTQ_BLOCK_HESSIAN) is taken from
 * the first samples' tokens until this many: the shape of the distribution, not every token. */
enum { FALLBACK_TOKENS = 8192 };

const char *mq_how_name(mq_how h) {
    switch (h) {
    case MQ_HOW_GPTQ: return "gptq";
    case MQ_HOW_GPTQ_BLOCK_HESSIAN: return "gptq-block-hessian";
    default: return "rtn";
    }
}

void mq_pipe_progress(mq_pipe *p, int64_t units) {
    p->units_done += units;
    if (p->units_done > p->units_total) p->units_done = p->units_total;
    mq_progress("quantize", p->units_done, p->units_total);
}

static moeq_status check_interrupt(void) {
    return moeq_interrupted() ? mq_err(MOEQ_E_INTERRUPTED, "quantization interrupted") : MOEQ_OK;
}

/* Read-ahead (the plan's mp.read_ahead; MOEQ_READ_AHEAD=1 only, see memplan.c
 * read_ahead_wanted for why): parts `what` of layer l (experts [e0, e1)) converted on a thread
 * of the lowest priority while the pool computes, so that their read finds them done, or
 * nearly: it converts what is left on the pool. A MoE layer's first expert chunk goes
 * during its attention, each next chunk during the one before, the next layer's attention
 * during the last chunk. The read stage was memory-bound (about 100 GB/s of bf16 in and fp32
 * out at 16 threads on the GPU machine's Xeon: its efficiency 0.4-0.5 from 2 threads) and waits
 * for a disk where the source is not in the page cache (the callers ask the page cache to read
 * the same parts ahead, mq_lazy_prefetch, which is all that is done where the sources need more
 * than a conversion: mq_lazy_ahead_start). */
static moeq_status start_ahead(mq_pipe *p, int l, unsigned what, int e0, int e1) {
    if (p->mp.read_ahead <= 0 || p->ahead || ((what & MQ_PART_EXPERTS) && e0 >= e1)) return MOEQ_OK;
    const double t0 = mq_now(), c0 = mq_cpu_now();   /* the buffers' allocation: the read's */
    moeq_status st = mq_lazy_ahead_start(p->lz, l, what, e0, e1, &p->ahead);
    p->layers[l].read += mq_now() - t0;
    p->layers[l].cpu_read += mq_cpu_now() - c0;
    p->ahead_l = l, p->ahead_what = what, p->ahead_e0 = e0, p->ahead_e1 = e1;
    return st;
}

/* The parts attention_stage reads. */
static unsigned attention_parts(const mq_pipe *p, int l) {
    return MQ_PART_ATTN | MQ_PART_FFN_NORM | (p->m->layers[l].is_moe ? MQ_PART_ROUTER : 0);
}

/* The source's weights of a layer part, read into fp32 (mq_lazy_load_ex) or freed, timed as the
 * layer's read stage; a read-ahead of exactly these parts is finished first (one that overlaps
 * them otherwise is cancelled: no part may be read while its buffers are being filled). */
static moeq_status read_part(mq_pipe *p, int l, unsigned what, int e0, int e1,
                             bool (*alloc_only)(float **dest, void *user), void *user) {
    double t0 = mq_now(), c0 = mq_cpu_now();
    struct rusage r0, r1;
    const bool prof = getenv("MOEQ_PROFILE") != NULL;
    if (prof) getrusage(RUSAGE_SELF, &r0);
    moeq_status st = MOEQ_OK;
    int64_t by_thread = -1, pieces = 0;
    if (p->ahead && p->ahead_l == l && (p->ahead_what & what)) {
        const bool same = p->ahead_what == what && !alloc_only &&
                          (!(what & MQ_PART_EXPERTS) || (p->ahead_e0 == e0 && p->ahead_e1 == e1));
        if (same) st = mq_lazy_ahead_finish(p->ahead, &by_thread, &pieces);
        else mq_lazy_ahead_cancel(p->ahead);
        p->ahead = NULL;
    }
    if (!st) st = mq_lazy_load_ex(p->lz, l, what, e0, e1, alloc_only, user);
    p->layers[l].read += mq_now() - t0;
    p->layers[l].cpu_read += mq_cpu_now() - c0;
    if (prof && !getrusage(RUSAGE_SELF, &r1)) {   /* page faults: the source's mapping, fresh buffers */
        char ahead[96] = "";
        if (by_thread >= 0)
            snprintf(ahead, sizeof ahead, "; read ahead, %lld of %lld pieces by its thread", (long long)by_thread,
                     (long long)pieces);
        mq_info("layer %d read, part %u experts %d..%d: %.3f s (%.1f cores busy), %ld minor faults%s", l, what,
                e0, e1, mq_now() - t0, (mq_cpu_now() - c0) / (mq_now() - t0 + 1e-9), r1.ru_minflt - r0.ru_minflt,
                ahead);
    }
    return st;
}

static void drop_part(mq_pipe *p, int l, unsigned what, int e0, int e1) {
    double t0 = mq_now(), c0 = mq_cpu_now();
    mq_lazy_release(p->lz, l, what, e0, e1);
    p->layers[l].read += mq_now() - t0;
    p->layers[l].cpu_read += mq_cpu_now() - c0;
}

static void item_mark(mq_pipe *p, const mq_plan_item *it) { p->item_done[it - p->plan.items] = 1; }

/* ---- slots: the Linears that read one input and share its Hessian ------------------------- */

typedef struct {
    mq_linear *w[3];
    const mq_plan_item *it[3];
    int nw;                       /* Linears of the slot that the plan quantizes */
    int expert;                   /* routed expert, else -1 */
    bool down;                    /* reads the SwiGLU product (an MLP's down projection) */
    mq_how how;
    mq_hessian h;                 /* the sum while calibrating (on the GPU: h.n, and h.sum
                                     receives H at the end) */
    mq_gpu_hessians *gh;          /* the sum on the GPU (runs with a device), else NULL */
    float *H;                     /* the Hessian GPTQ uses (NULL: RTN or the block Hessian) */
    float *Hh;                    /* damping sweep: the Hessian of the held-out rows, else NULL */
    int64_t hold;                 /* damping sweep, routed expert: its rows before the held-out
                                     samples */
    int64_t n_fit, n_held;        /* damping sweep: rows before / of the held-out samples */
    int64_t tokens;
    float amax;                   /* W4A4: the input's amax over the calibration */
    float *G;                     /* asymmetric calibration: sum x_f x_q^T over the Hessian's rows
                                     (mq_cross_det_acc), else NULL */
    int64_t g_rows;
    int owner;                    /* the rank that calibrates and quantizes it */
    int lown[3];                  /* the rank that quantizes each of its Linears (owner, or with
                                     several ranks one each for the attention's Linears; each
                                     such rank then holds the slot's Hessian) */
    bool held;                    /* with several ranks: its results wait in q/qs for share_slots */
    mq_qtensor q[3];
    mq_gptq_stats qs[3];
} slot;

/* Whether this rank quantizes a Linear of slot s (and so holds its Hessian). */
static bool mine(const mq_pipe *p, const slot *s) {
    for (int k = 0; k < s->nw; k++)
        if (s->lown[k] == p->rank) return true;
    return s->nw == 0 && s->owner == p->rank;
}

/* Whether this rank quantizes the slot's k-th Linear. */
static bool mine_k(const mq_pipe *p, const slot *s, int k) { return s->lown[k] == p->rank; }

/* The slot and all its Linears to rank r. */
static void slot_own(slot *s, int r) { s->owner = s->lown[0] = s->lown[1] = s->lown[2] = r; }

/* The distinct ranks that quantize a Linear of s (at least its owner), in increasing order. */
static int slot_owners(const slot *s, int out[3]) {
    int n = 0;
    for (int k = 0; k < (s->nw > 0 ? s->nw : 1); k++) {
        const int r = s->nw > 0 ? s->lown[k] : s->owner;
        bool seen = false;
        for (int i = 0; i < n; i++) seen |= out[i] == r;
        if (!seen) out[n++] = r;
    }
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0 && out[b - 1] > out[b]; b--) {
            const int t = out[b];
            out[b] = out[b - 1];
            out[b - 1] = t;
        }
    return n;
}

static void slot_set(mq_pipe *p, slot *s, int expert, bool down, mq_linear *a, mq_linear *b,
                     mq_linear *c) {
    memset(s, 0, sizeof *s);
    slot_own(s, p->rank);   /* alone: everything is this process's */
    s->expert = expert;
    s->down = down;
    s->how = p->o->gptq ? MQ_HOW_GPTQ : MQ_HOW_RTN;
    mq_linear *ls[3] = {a, b, c};
    for (int i = 0; i < 3; i++) {
        if (!ls[i] || !ls[i]->name) continue;
        const mq_plan_item *it = mq_out_plan_find(&p->plan, ls[i]->name);
        if (!it || !it->quantize) continue;
        s->w[s->nw] = ls[i];
        s->it[s->nw++] = it;
    }
}

/* The Hessian sums and H (the held results stay). */
static void slot_drop_sums(slot *s) {
    mq_free(s->G);
    s->G = NULL;
    mq_gpu_hessians_free(s->gh);
    s->gh = NULL;
    mq_hessian_free(&s->h);
    mq_free(s->H);
    s->H = NULL;
    mq_free(s->Hh);
    s->Hh = NULL;
}

static void slot_free(slot *s) {
    for (int k = 0; k < 3; k++) mq_qtensor_free(&s->q[k]);
    s->held = false;
    slot_drop_sums(s);
}

/* The damping sweep's first held-out sample: the last eighth of the samples (at least one) are
 * held out, the rows GPTQ's damping is chosen on. */
static int64_t hold_sample(int64_t n) { return n - (n / 8 > 1 ? n / 8 : 1); }

/* Starts the Hessian sum of a slot GPTQ will use: on the run's GPU when it has one (the same
 * bits as the CPU's sum, backend/gpu.h). */
static moeq_status slot_hessian(mq_pipe *p, slot *s) {
    if (!s->nw || s->how != MQ_HOW_GPTQ || !mine(p, s)) return MOEQ_OK;
    char what[200];
    snprintf(what, sizeof what, "Hessian of %s", s->w[0]->name);
    moeq_status st;
    if (p->o->n_damp_sweep > 0) {   /* the damping sweep holds out the last samples' rows */
        int64_t hold = 0;
        for (int64_t i = 0; i < hold_sample(p->calib.n); i++) hold += p->calib.len[i];
        st = mq_hessian_init_split(&s->h, s->w[0]->in, s->expert >= 0 ? s->hold : hold, what);
    } else {
        st = mq_hessian_init(&s->h, s->w[0]->in, what);
    }
    if (!st && p->gpu) st = mq_gpu_hessians_new(p->gpu, 1, &s->h.K, &s->gh);
    if (!st && p->target) {   /* the cross sum beside it */
        /* zero as it comes (a fresh mapping): its pages are first touched by the sum's tasks on
         * the pool; a memset here took 0.3 s of one core a layer (16 MB per expert input) */
        s->G = mq_alloc_zero(sizeof(float) * (size_t)(s->h.K * s->h.K), "asymmetric calibration's cross sum");
        if (!s->G) return MOEQ_E_NOMEM;
        s->g_rows = 0;
    }
    return st;
}

/* G += x_f^T x_q for rows of the two streams that read the same token, in the Hessian's row
 * order (each element one fmaf chain over the rows, however they are grouped into calls). */
static void slot_cross(slot *s, const float *xf, const float *xq, int64_t rows) {
    if (!s->G || rows <= 0) return;
    mq_cross_det_acc_pool(s->h.K, rows, xf, s->h.K, xq, s->h.K, s->G, s->h.K);
    s->g_rows += rows;
}

/* Asymmetric calibration: each GPTQ slot's weights moved toward the unquantized model's outputs
 * (mq_gptq_target_many: the slots' factorisations, solves and products over the pool together,
 * the values of one mq_gptq_target each) before GPTQ quantizes them; G is freed. Timed as the
 * GPTQ stage. */
static double target_cost(const slot *s) {
    double K = (double)s->w[0]->in, rows = 0;
    for (int k = 0; k < s->nw; k++) rows += (double)s->w[k]->out;
    return K * K * (K + rows);
}

/* slots a[0..na) and b[0..nb) (a chunk's gate/up and down slots) */
static moeq_status target_slots(mq_pipe *p, int l, slot *a, int na, slot *b, int nb) {
    double t0 = mq_now(), c0 = mq_cpu_now();
    const int n = na + nb;
    slot **work = calloc((size_t)(n + 1), sizeof *work);
    mq_gptq_target_job *jobs = calloc((size_t)(n + 1), sizeof *jobs);
    float *(*w)[3] = calloc((size_t)(n + 1), sizeof *w);
    int64_t (*rows)[3] = calloc((size_t)(n + 1), sizeof *rows);
    moeq_status st = work && jobs && w && rows ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory in layer %d", l);
    int m = 0;
    for (int i = 0; i < n && !st; i++) {
        slot *x = i < na ? &a[i] : &b[i - na];
        if (x->G && x->H && x->how == MQ_HOW_GPTQ && x->g_rows > 0) work[m++] = x;
    }
    for (int i = 1; i < m; i++)   /* costliest first: the long factorisations before the short ones */
        for (int k = i; k > 0 && target_cost(work[k - 1]) < target_cost(work[k]); k--) {
            slot *t = work[k];
            work[k] = work[k - 1];
            work[k - 1] = t;
        }
    for (int i = 0; i < m && !st; i++) {
        const slot *x = work[i];
        for (int k = 0; k < x->nw; k++) {
            w[i][k] = x->w[k]->w;
            rows[i][k] = x->w[k]->out;
        }
        jobs[i] = (mq_gptq_target_job){x->H, x->G, x->w[0]->in, x->g_rows, p->o->target_share, p->o->g.percdamp,
                                       w[i], rows[i], x->nw, x->w[0]->name};
    }
    double sec[3] = {0, 0, 0};
    if (!st) st = mq_gptq_target_many(jobs, m, sec);
    for (int i = 0; i < n; i++) {
        slot *x = i < na ? &a[i] : &b[i - na];
        mq_free(x->G);
        x->G = NULL;
    }
    free(work);
    free(jobs);
    free(w);
    free(rows);
    if (getenv("MOEQ_PROFILE"))
        mq_info("layer %d target corrections, %d Linear inputs: %.2f s (%.1f cores busy; factorisations %.2f, "
                "solves %.2f, products %.2f s)", l, m, mq_now() - t0, (mq_cpu_now() - c0) / (mq_now() - t0 + 1e-9),
                sec[0], sec[1], sec[2]);
    p->layers[l].gptq += mq_now() - t0;
    p->layers[l].cpu_gptq += mq_cpu_now() - c0;
    return st;
}

/* Adds rows [rows, K] to the slot's sum. With a GPU: from one thread at a time. */
static moeq_status slot_add(slot *s, const float *x, int64_t rows) {
    if (!s->gh) {
        mq_hessian_add(&s->h, x, rows);
        return MOEQ_OK;
    }
    s->h.n += rows;
    return mq_gpu_hessians_add(s->gh, 0, x, rows);
}

/* Whether a slot's Hessian stays on the GPU for GPTQ, formed there from its sum (one process:
 * with several ranks the sums travel between them through host memory). */
static bool slot_keeps_device_sum(const mq_pipe *p, const slot *s) {
    return s->gh && p->ranks <= 1 && s->how == MQ_HOW_GPTQ && !s->h.fit;
}

/* The Hessian from the sum, formed in place (the sum's buffer becomes H); a sum GPTQ reads on
 * the GPU stays there (s->H NULL, s->gh kept). */
static moeq_status slot_form(const mq_pipe *p, slot *s) {
    if (!s->h.sum) return MOEQ_OK;
    if (slot_keeps_device_sum(p, s)) return MOEQ_OK;
    moeq_status st = MOEQ_OK;
    if (s->gh) {
        st = mq_gpu_hessians_get(s->gh, 0, s->h.sum, NULL);
        mq_gpu_hessians_free(s->gh);
        s->gh = NULL;
    } else if (s->h.fit) {
        mq_hessian_get_split(&s->h, s->h.sum, s->h.fit, &s->n_fit, &s->n_held);
        s->Hh = s->h.fit;
        s->h.fit = NULL;
    } else {
        mq_hessian_get(&s->h, s->h.sum);
    }
    s->H = s->h.sum;
    s->h.sum = NULL;
    return st;
}

/* slot_form timed as the layer's Hessian stage (the forming is O(K^2) on the pool). */
static moeq_status slot_form_timed(mq_pipe *p, int l, slot *s) {
    double t0 = mq_now(), c0 = mq_cpu_now();
    moeq_status st = slot_form(p, s);
    p->layers[l].hessian += mq_now() - t0;
    p->layers[l].cpu_hessian += mq_cpu_now() - c0;
    return st;
}

static void amax_update(float *a, const float *x, int64_t n) {
    if (n <= 0) return;
    float v = mq_absmax(x, n);
    if (v > *a) *a = v;   /* a NaN never wins */
}

/* ---- quantizing slots ------------------------------------------------------------------------- */

/* With act-order g_idx groups every quantized Linear carries g_idx, also the ones rounded to
 * nearest (fallback experts): theirs is the identity grouping. */
static moeq_status identity_gidx(mq_qtensor *q) {
    q->g_idx = mq_alloc_array((size_t)q->cols, sizeof(int32_t), "g_idx");
    if (!q->g_idx) return MOEQ_E_NOMEM;
    for (int64_t k = 0; k < q->cols; k++) q->g_idx[k] = (int32_t)(k / q->group_size);
    return MOEQ_OK;
}

static moeq_status add_module(mq_pipe *p, int l, const slot *s, const mq_linear *lin,
                              const mq_gptq_stats *st) {
    if (!p->o->gptq) return MOEQ_OK;
    mq_mod_report r = {lin->name, l, s->expert, s->tokens, s->how, *st};
    cJSON *j = mq_mod_report_json(&r);
    if (!j) return mq_err(MOEQ_E_NOMEM, "out of memory");
    cJSON_AddItemToArray(p->layers[l].modules, j);
    return MOEQ_OK;
}

/* Writing one quantized Linear comes in three parts: what must be done in order before (g_idx,
 * the input scale and its warning), the packing and writing to its planned place in the shard
 * files with the dequantized weights for later stages (sequential calibration), which the
 * Linears of a layer do on the pool at once, and the records after, in order. */
static float finish_prepare(mq_pipe *p, const slot *s, int k, mq_qtensor *q, moeq_status *st) {
    const mq_pipeline_opts *o = p->o;
    *st = MOEQ_OK;
    if (o->gptq && o->g.act_order && o->g.groups == MQ_GPTQ_GROUPS_GIDX && !q->g_idx) *st = identity_gidx(q);
    float in_amax = 0;
    if (!*st && o->act_quant) {
        in_amax = s->amax;
        if (!(in_amax > 0) || !isfinite(in_amax)) {
            /* a routed expert that saw no token gets the layer's largest expert amax at its
             * site once every chunk is done (routed_experts); anything else amax 1 */
            if (s->expert < 0) mq_warn("%s: no calibration activations; input scale from amax 1", s->w[k]->name);
            in_amax = 1.0f;
        }
    }
    return in_amax;
}

/* Packs and writes one Linear's quantized weight (the dequantization is put_and_record's). */
static moeq_status finish_put(mq_pipe *p, const slot *s, int k, const mq_qtensor *q, float in_amax) {
    return p->w ? mq_ckpt_writer_put_linear(p->w, s->w[k]->name, q, in_amax) : MOEQ_OK;
}

static moeq_status finish_record(mq_pipe *p, int l, const slot *s, int k, const mq_gptq_stats *stats) {
    moeq_status st = p->w ? add_module(p, l, s, s->w[k], stats) : MOEQ_OK;
    if (!st) item_mark(p, s->it[k]);
    if (!st) mq_fault_point("linear", l, p->layers[l].linears++);
    return st;
}

typedef struct {
    mq_pipe *p;
    const slot *slots;
    const mq_qtensor *q;
    const int *weight;     /* [n] 3 * slot + k */
    const float *amax;     /* [n] */
    moeq_status *st;       /* [n] */
    char (*msg)[320];      /* [n] the message of a failure (the pool thread's error state) */
} put_ctx;

static void put_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    const put_ctx *c = vctx;
    const int j = c->weight[t];
    c->st[t] = finish_put(c->p, &c->slots[j / 3], j % 3, &c->q[j], c->amax[t]);
    if (c->st[t]) snprintf(c->msg[t], sizeof c->msg[t], "%s", moeq_last_error());
}

/* The dequantized weights back into the Linears' host copies (sequential calibration) in pieces
 * of DEQ_ROWS rows of all the written weights, one pool loop: as a part of each weight's own task
 * the attention's four weights kept 4 of 16 threads busy. Elementwise: any split, the same values. */
enum { DEQ_ROWS = 64 };

typedef struct {
    const mq_qtensor *q;
    float *w;
    int64_t r0;
} deq_piece;

static void deq_piece_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    const deq_piece *pc = (const deq_piece *)vctx + t;
    mq_dequantize_rows(pc->q, pc->w, pc->r0, pc->r0 + DEQ_ROWS);
}

static moeq_status dequantize_back(mq_pipe *p, int l, const slot *slots, const mq_qtensor *q, const int *weight,
                                   const moeq_status *sts, int m, const bool *in_place) {
    int64_t n = 0;
    for (int t = 0; t < m; t++) {
        const int j = weight[t];
        if (!sts[t] && slots[j / 3].w[j % 3]->w && !(in_place && in_place[j]))
            n += (q[j].rows + DEQ_ROWS - 1) / DEQ_ROWS;
    }
    if (!n) return MOEQ_OK;
    deq_piece *pc = malloc((size_t)n * sizeof *pc);
    if (!pc) return mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    n = 0;
    for (int t = 0; t < m; t++) {
        const int j = weight[t];
        float *w = in_place && in_place[j] ? NULL : slots[j / 3].w[j % 3]->w;
        for (int64_t r0 = 0; !sts[t] && w && r0 < q[j].rows; r0 += DEQ_ROWS) pc[n++] = (deq_piece){&q[j], w, r0};
    }
    mq_parallel_for(n, deq_piece_task, pc);
    free(pc);
    return MOEQ_OK;
}

/* Packs and writes the m weights (weight[t] = 3 * slot + k, stats[t] its GPTQ stats) on the pool,
 * then records them in order (the first failure in that order is the one reported). deq: the
 * dequantized weights into the Linears' host copies for the stages after (sequential
 * calibration), unless the device already holds them and the host copy is dropped unread. */
static moeq_status put_and_record(mq_pipe *p, int l, const slot *slots, const mq_qtensor *q, const int *weight,
                                  const float *amax, const mq_gptq_stats *stats, int m, bool deq,
                                  const bool *in_place) {
    moeq_status *sts = calloc((size_t)(m + 1), sizeof *sts);
    char (*msg)[320] = calloc((size_t)(m + 1), sizeof *msg);
    moeq_status st = sts && msg ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    double t0 = mq_now(), c0 = mq_cpu_now(), t1 = t0, c1 = c0;
    const uint64_t w0 = mq_pwrite_ns();
    if (!st) {
        put_ctx c = {p, slots, q, weight, amax, sts, msg};
        mq_parallel_for(m, put_task, &c);
        t1 = mq_now(), c1 = mq_cpu_now();
        if (deq && p->seq) st = dequantize_back(p, l, slots, q, weight, sts, m, in_place);
    }
    p->layers[l].write += mq_now() - t0;
    p->layers[l].cpu_write += mq_cpu_now() - c0;
    if (getenv("MOEQ_PROFILE"))   /* the write stage's parts (the writer's thread writes meanwhile) */
        mq_info("layer %d write, %d weights: packing %.3f s (%.1f cores busy), dequantizing back %.3f s (%.1f "
                "cores busy); the writer's thread in pwrite meanwhile %.3f s", l, m, t1 - t0,
                (c1 - c0) / (t1 - t0 + 1e-9), mq_now() - t1, (mq_cpu_now() - c1) / (mq_now() - t1 + 1e-9),
                (double)(mq_pwrite_ns() - w0) * 1e-9);
    for (int t = 0; t < m && !st; t++) {
        const int j = weight[t];
        if (sts[t]) st = mq_err(sts[t], "%s", msg[t]);
        else st = finish_record(p, l, &slots[j / 3], j % 3, &stats[t]);
    }
    free(sts);
    free(msg);
    return st;
}

/* A GPU chunk's writes, left until its quantized pass is queued on the device (the host packs
 * and writes while the device computes). The device holds the dequantized weights GPTQ wrote
 * back; the others were dequantized on the host before (device_experts_follow uploads them). */
typedef struct mq_pending_write {
    int l, n, m;
    slot *slots;           /* [n] copies: the Linears and plan items the writes and records name */
    mq_qtensor *q;         /* [3 n + 1], owned */
    int *weight;           /* [m] */
    float *amax;           /* [m] */
    mq_gptq_stats *stats;  /* [m] */
} pending_write;

static void pending_free(pending_write *pw) {
    if (!pw) return;
    for (int j = 0; pw->q && j < 3 * pw->n + 1; j++) mq_qtensor_free(&pw->q[j]);
    free(pw->q);
    free(pw->slots);
    free(pw->weight);
    free(pw->amax);
    free(pw->stats);
    free(pw);
}

/* Writes and records the pending chunk (write: false after a failure: only frees it). */
static moeq_status write_pending(mq_pipe *p, bool write) {
    pending_write *pw = p->pending;
    if (!pw) return MOEQ_OK;
    p->pending = NULL;
    moeq_status st = write ? put_and_record(p, pw->l, pw->slots, pw->q, pw->weight, pw->amax, pw->stats, pw->m, false, NULL)
                           : MOEQ_OK;
    pending_free(pw);
    return st;
}

/* Leaves a GPU chunk's writes for write_pending; what the device does not hold (round to
 * nearest, fallbacks: not `written`, job -> dequantized on the device) is dequantized on the host
 * now, for device_experts_follow to upload. Takes q, weight, amax and stats when it succeeds. */
static moeq_status defer_slots(mq_pipe *p, int l, const slot *slots, int n, mq_qtensor *q, int *weight,
                               float *amax, mq_gptq_stats *stats, int m, const int *job_of, const bool *written) {
    pending_write *pw = calloc(1, sizeof *pw);
    slot *copy = malloc(sizeof *copy * (size_t)(n + 1));
    if (!pw || !copy) {
        free(pw), free(copy);
        return mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    }
    memcpy(copy, slots, sizeof *copy * (size_t)n);
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (int t = 0; t < m; t++) {
        const int j = weight[t];
        mq_linear *lin = slots[j / 3].w[j % 3];
        if (p->seq && lin->w && !(job_of[j] >= 0 && written[job_of[j]])) mq_dequantize(&q[j], lin->w);
    }
    p->layers[l].write += mq_now() - t0;
    p->layers[l].cpu_write += mq_cpu_now() - c0;
    *pw = (pending_write){l, n, m, copy, q, weight, amax, stats};
    pending_free(p->pending);   /* none: each chunk writes its own before the next */
    p->pending = pw;
    return MOEQ_OK;
}

/* finish_linear for the weights of quantize_slots at once: prepared in order, packed and written
 * on the pool, recorded in order. With `written` (a GPU chunk: job -> dequantized on the device)
 * the packing and writing wait for write_pending, which then owns q (*took_q). A job with deq
 * wrote its dequantized weights into the Linear's host copy already (quantize_slots). */
static moeq_status finish_slots(mq_pipe *p, int l, const slot *slots, int n, mq_qtensor *q,
                                const mq_gptq_job *jobs, const int *job_of, const mq_gptq_stats *stats,
                                const bool *written, bool *took_q) {
    *took_q = false;
    int *weight = calloc((size_t)(3 * n + 1), sizeof *weight);
    float *amax = calloc((size_t)(3 * n + 1), sizeof *amax);
    mq_gptq_stats *wst = calloc((size_t)(3 * n + 1), sizeof *wst);
    bool *in_place = calloc((size_t)(3 * n + 1), sizeof *in_place);
    moeq_status st = weight && amax && wst && in_place ? MOEQ_OK
                                                       : mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    for (int j = 0; j < 3 * n && !st; j++) in_place[j] = job_of[j] >= 0 && jobs[job_of[j]].deq != NULL;
    int m = 0;
    for (int i = 0; i < n && !st; i++)
        for (int k = 0; k < slots[i].nw && !st; k++) {
            if (!mine_k(p, &slots[i], k)) continue;
            const int j = 3 * i + k;
            amax[m] = finish_prepare(p, &slots[i], k, &q[j], &st);
            wst[m] = job_of[j] >= 0 ? jobs[job_of[j]].stats : stats[j];
            weight[m++] = j;
        }
    if (!st && written) {
        st = defer_slots(p, l, slots, n, q, weight, amax, wst, m, job_of, written);
        if (!st) {
            *took_q = true;
            free(in_place);
            return st;
        }
    } else if (!st) {
        st = put_and_record(p, l, slots, q, weight, amax, wst, m, true, in_place);
    }
    free(weight);
    free(amax);
    free(wst);
    free(in_place);
    return st;
}

/* The damping sweep of a slot (mq_gptq_damp_sweep): the percdamp among the run's candidates
 * whose GPTQ of the slot's Linears on the fitting rows' Hessian has the least loss on the
 * held-out rows. No held-out row (an expert routed to only in the fitting samples): percdamp. */
static moeq_status sweep_slot(mq_pipe *p, const slot *s, const float *gs, double *damp) {
    const mq_pipeline_opts *o = p->o;
    const int64_t K = s->w[0]->in;
    *damp = o->g.percdamp;
    if (!s->Hh || s->n_held == 0 || s->n_fit == 0) return MOEQ_OK;
    float *fit = mq_alloc_array((size_t)K * (size_t)K, sizeof(float), "damping sweep");
    if (!fit) return MOEQ_E_NOMEM;
    mq_hessian_fit_from_split(s->H, s->Hh, K, s->n_fit, s->n_held, fit);
    const float *w[3];
    int64_t rows[3];
    for (int k = 0; k < s->nw; k++) {
        w[k] = s->w[k]->w;
        rows[k] = s->w[k]->out;
    }
    int best = 0;
    double loss[8];
    moeq_status st = mq_gptq_damp_sweep(&o->spec, &o->g, fit, s->Hh, K, w, rows, gs, s->nw,
                                        o->damp_sweep, o->n_damp_sweep, s->w[0]->name, &best, loss);
    if (!st) *damp = o->damp_sweep[best];
    mq_free(fit);
    return st;
}

/* Quantizes every Linear of slots[0..n): GPTQ with the slot's Hessian (block-fallback gate/up
 * slots with block_H, factorised once for all of them), round to nearest for RTN slots. NVFP4
 * global scales are shared by a slot's Linears (vLLM's fused layers) unless no_fuse. */
/* A slot's NVFP4 global scales (fused: one for its Linears together). */
typedef struct {
    const mq_pipe *p;
    const slot *slots;
    float *gs;   /* [3 n] */
} gscale_ctx;

static void gscale_task(void *vctx, int64_t i, int thread) {
    (void)thread;
    const gscale_ctx *c = vctx;
    const slot *s = &c->slots[i];
    const mq_pipeline_opts *o = c->p->o;
    if (!mine(c->p, s)) return;   /* another rank's */
    float amax = 0, a[3] = {0, 0, 0};
    for (int k = 0; k < s->nw; k++) {
        a[k] = mq_absmax(s->w[k]->w, s->w[k]->out * s->w[k]->in);
        amax = fmaxf(amax, a[k]);
    }
    for (int k = 0; k < s->nw; k++) c->gs[3 * i + k] = mq_nvfp4_global_scale(&o->spec, o->no_fuse ? a[k] : amax);
}

/* The Linear k of slot s as one of the chunk's experts on the GPU (p->gx): 0 gate, 1 up,
 * 2 down; -1 when it is not there. */
static int device_expert_linear(const mq_pipe *p, int l, const slot *s, int k) {
    if (!p->gx || s->expert < p->gx_e0 || s->expert >= p->gx_e1) return -1;
    const mq_layer *ly = &p->m->layers[l];
    const mq_linear *lin = s->w[k];
    return lin == &ly->exp_gate[s->expert] ? 0 : lin == &ly->exp_up[s->expert] ? 1
                                           : lin == &ly->exp_down[s->expert] ? 2 : -1;
}

/* After a sequential chunk's quantization the device's experts must be the dequantized ones, as
 * the host's are: those GPTQ did not replace there (rounded to nearest) go up from the host. */
static moeq_status device_experts_follow(mq_pipe *p, int l, const slot *slots, int n, const int *job_of,
                                         const bool *written) {
    moeq_status st = MOEQ_OK;
    for (int i = 0; i < n && !st; i++)
        for (int k = 0; k < slots[i].nw && !st; k++) {
            const int dk = device_expert_linear(p, l, &slots[i], k), j = job_of[3 * i + k];
            if (dk < 0 || !mine_k(p, &slots[i], k) || (j >= 0 && written[j])) continue;
            st = mq_gpu_mlp_set(p->gx, slots[i].expert - p->gx_e0, dk, slots[i].w[k]->w);
        }
    return st;
}

static moeq_status quantize_slots(mq_pipe *p, int l, slot *slots, int n, float *block_H) {
    const mq_pipeline_opts *o = p->o;
    double t0 = mq_now(), c0 = mq_cpu_now();
    int nf = n + 1;
    const float **Hs = calloc((size_t)nf, sizeof *Hs);
    int64_t *Ks = calloc((size_t)nf, sizeof *Ks);
    const char **names = calloc((size_t)nf, sizeof *names);
    mq_gptq_factor *f = calloc((size_t)nf, sizeof *f);
    mq_gptq_job *jobs = calloc((size_t)(3 * n + 1), sizeof *jobs);
    mq_qtensor *q = calloc((size_t)(3 * n + 1), sizeof *q);
    float *gs = calloc((size_t)(3 * n + 1), sizeof *gs);
    mq_gptq_stats *stats = calloc((size_t)(3 * n + 1), sizeof *stats);
    int *job_of = calloc((size_t)(3 * n + 1), sizeof *job_of);   /* weight -> its GPTQ job */
    bool *written = calloc((size_t)(3 * n + 1), sizeof *written);  /* job -> dequantized on the device */
    moeq_status st = Hs && Ks && names && f && jobs && q && gs && stats && job_of && written
                         ? MOEQ_OK
                         : mq_err(MOEQ_E_NOMEM, "out of memory quantizing layer %d", l);
    int n_jobs = 0;
    bool factored = false;
    if (!st) {   /* the global scales: each slot's weights read on the pool */
        gscale_ctx gc = {p, slots, gs};
        mq_parallel_for(n, gscale_task, &gc);
    }
    for (int i = 0; i < n && !st; i++) {
        slot *s = &slots[i];
        if (!mine(p, s)) continue;   /* another rank's */
        if (!s->nw) continue;
        Ks[i] = s->w[0]->in;
        names[i] = s->w[0]->name;
        if (s->how == MQ_HOW_GPTQ || (s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && s->down)) Hs[i] = s->H;
        if (s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && !s->down) {
            Hs[n] = block_H;
            Ks[n] = s->w[0]->in;
            names[n] = "the MoE block's Hessian";
        }
    }
    /* the damping sweep: the swept slots are factorised one by one with their own damping */
    double *damp = o->n_damp_sweep > 0 ? calloc((size_t)nf, sizeof *damp) : NULL;
    const float **swept = o->n_damp_sweep > 0 ? calloc((size_t)nf, sizeof *swept) : NULL;
    if (!st && o->n_damp_sweep > 0 && (!damp || !swept)) st = mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int i = 0; i < n && !st && damp && o->gptq && !p->gpu; i++) {
        slot *s = &slots[i];
        if (!mine(p, s) || s->how != MQ_HOW_GPTQ || !Hs[i] || !s->Hh) continue;
        st = sweep_slot(p, s, gs + 3 * i, &damp[i]);
        swept[i] = Hs[i];
        Hs[i] = NULL;
    }
    const double tf0 = mq_now(), cf0 = mq_cpu_now();
    if (!st && o->gptq && !p->gpu) {
        st = mq_gptq_factor_many(Hs, Ks, nf, &o->g, o->g.rtn_loss, names, f);
        factored = !st;
        for (int i = 0; i < n && !st && swept; i++) {
            if (!swept[i]) continue;
            mq_gptq_opts oi = o->g;
            oi.percdamp = damp[i];
            st = mq_gptq_factor_init(swept[i], Ks[i], &oi, o->g.rtn_loss, names[i], &f[i]);
        }
    }
    free(damp);
    free(swept);
    for (int i = 0; i < n; i++) {   /* the held-out Hessians are no longer needed */
        mq_free(slots[i].Hh);
        slots[i].Hh = NULL;
    }
    if (!p->gpu || st)
        for (int i = 0; i < n; i++) {   /* factored: the Hessians are no longer needed */
            mq_free(slots[i].H);
            slots[i].H = NULL;
        }
    for (int i = 0; i < n && !st; i++) {
        slot *s = &slots[i];
        for (int k = 0; k < s->nw && !st; k++) {
            mq_linear *lin = s->w[k];
            int j = 3 * i + k;
            job_of[j] = -1;
            if (!mine_k(p, s, k)) continue;   /* another rank's Linear of this slot */
            if (s->how == MQ_HOW_RTN) {
                double tr = mq_now();
                st = mq_quantize_rtn(&o->spec, lin->w, lin->out, lin->in, gs[j], lin->name, &q[j]);
                stats[j] = (mq_gptq_stats){NAN, NAN, 0, 0, mq_now() - tr};
                continue;
            }
            const mq_gptq_factor *fi = s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && !s->down ? &f[n] : &f[i];
            job_of[j] = n_jobs;
            /* sequential calibration on the CPU, one process: GPTQ leaves the dequantized weights
             * in the host copy as each row block finishes (while it is in cache), instead of a
             * pass over every weight after the write (memory-bound: 16 threads ran it 5x faster
             * than 2) */
            float *deq = p->seq && !p->gpu && p->ranks <= 1 ? lin->w : NULL;
            jobs[n_jobs++] = (mq_gptq_job){fi, lin->w, lin->out, gs[j], lin->name, &q[j], deq, {0, 0, 0, 0, 0}};
        }
    }
    /* the GPTQ jobs ran into q[] through their out pointers; their stats go back by position */
    if (!st && n_jobs > 0 && p->gpu) {
        /* on the GPU the factorisations are part of the call: job -> its Hessian's index. The
         * Hessians kept on the device are read there, and so are the chunk's expert weights,
         * which the dequantized ones replace for the quantized pass */
        int32_t *job_h = calloc((size_t)n_jobs, sizeof *job_h);
        mq_gpu_hsrc *dH = calloc((size_t)nf, sizeof *dH);
        mq_gpu_wsrc *dW = calloc((size_t)n_jobs, sizeof *dW);
        if (!job_h || !dH || !dW) st = mq_err(MOEQ_E_NOMEM, "out of memory quantizing layer %d", l);
        for (int i = 0; i < n && !st; i++) {
            const slot *s = &slots[i];
            if (mine(p, s) && !Hs[i] && slot_keeps_device_sum(p, s)) dH[i] = (mq_gpu_hsrc){s->gh, 0};
            for (int k = 0; k < s->nw; k++) {
                const int j = job_of[3 * i + k];
                if (!mine_k(p, s, k) || j < 0) continue;
                job_h[j] = s->how == MQ_HOW_GPTQ_BLOCK_HESSIAN && !s->down ? n : i;
                const int dk = device_expert_linear(p, l, s, k);
                if (dk >= 0) dW[j] = (mq_gpu_wsrc){p->gx, s->expert - p->gx_e0, dk, p->seq};
            }
        }
        if (!st) st = mq_gpu_gptq_ex(p->gpu, &o->spec, &o->g, Hs, dH, Ks, names, nf, jobs, dW, job_h, n_jobs);
        for (int j = 0; j < n_jobs && !st && dW; j++)
            if (dW[j].mlp && dW[j].write_back) written[j] = true;
        free(job_h);
        free(dH);
        free(dW);
    } else if (!st && n_jobs > 0) {
        const double tr0 = mq_now(), cr0 = mq_cpu_now();
        /* the batch's seconds (each factor of a batch carries the whole batch's) */
        double fac_sec[3] = {0, 0, 0};
        for (int i = 0; i < nf && factored; i++) {
            fac_sec[0] = fmax(fac_sec[0], f[i].sec_cholesky);
            fac_sec[1] = fmax(fac_sec[1], f[i].sec_inverse);
            fac_sec[2] = fmax(fac_sec[2], f[i].sec_copies);
        }
        st = mq_gptq_run(&o->spec, &o->g, jobs, n_jobs);
        if (getenv("MOEQ_PROFILE"))   /* where GPTQ's time goes and how many cores it kept busy */
            mq_info("layer %d GPTQ, %d weights: factors %.2f s (%.1f cores busy; Cholesky %.2f, inverse %.2f, "
                    "copies %.2f s), column loops %.2f s (%.1f cores busy)", l, n_jobs, tr0 - tf0,
                    (cr0 - cf0) / (tr0 - tf0 + 1e-9), fac_sec[0], fac_sec[1], fac_sec[2], mq_now() - tr0,
                    (mq_cpu_now() - cr0) / (mq_now() - tr0 + 1e-9));
    }
    if (p->gpu)
        for (int i = 0; i < n; i++) {
            mq_free(slots[i].H);
            slots[i].H = NULL;
        }
    p->layers[l].gptq += mq_now() - t0;
    p->layers[l].cpu_gptq += mq_cpu_now() - c0;
    for (int i = 0; i < n && !st && p->ranks > 1; i++) {   /* kept for share_slots, which every rank runs */
        slot *s = &slots[i];
        for (int k = 0; k < s->nw && !st; k++) {
            if (!mine_k(p, s, k)) continue;
            int j = 3 * i + k;
            s->q[k] = q[j];
            memset(&q[j], 0, sizeof q[j]);
            s->qs[k] = job_of[j] >= 0 ? jobs[job_of[j]].stats : stats[j];
            s->held = true;
        }
    }
    /* a GPU chunk of experts writes while the device runs its quantized pass (routed_experts) */
    bool took_q = false;
    if (!st && p->ranks <= 1)
        st = finish_slots(p, l, slots, n, q, jobs, job_of, stats, p->gx ? written : NULL, &took_q);
    if (took_q) q = NULL;
    if (!st && p->gx && p->seq) st = device_experts_follow(p, l, slots, n, job_of, written);
    for (int j = 0; q && j < 3 * n + 1; j++) mq_qtensor_free(&q[j]);
    for (int i = 0; factored && i < nf; i++) mq_gptq_factor_free(&f[i]);
    free(Hs);
    free(Ks);
    free(names);
    free(f);
    free(jobs);
    free(q);
    free(gs);
    free(stats);
    free(job_of);
    free(written);
    return st;
}

/* A resumed run recomputing activations through a finished layer: the quantized weights are read
 * back from the checkpoint (sequential calibration continues with them). */
static moeq_status read_back_slots(mq_pipe *p, slot *slots, int n) {
    moeq_status st = MOEQ_OK;
    for (int i = 0; i < n && !st; i++)
        for (int k = 0; k < slots[i].nw && !st; k++) {
            mq_linear *lin = slots[i].w[k];
            mq_qtensor q;
            st = mq_ckpt_writer_read_linear(p->w, lin->name, lin->out, lin->in, &q);
            if (!st && p->seq) mq_dequantize(&q, lin->w);
            mq_qtensor_free(&q);
        }
    return st;
}

/* ---- several ranks: quantized Linears from their owners to everyone ---------------------------- */

/* One held Linear as bytes: what finish_linear needs on another rank (every rank runs this same
 * build, so the structs travel as they are). */
typedef struct {
    mq_qspec spec;
    int64_t rows, cols, group_size, n_groups, tokens;
    float global_scale, amax;
    int32_t how, has_gidx;
    mq_gptq_stats stats;
} wire_head;

/* 4-bit codes to and from the wire (two to a byte, the first in the low nibble) on the pool, in
 * pieces of WIRE_PIECE codes: a layer's experts are 192 Linears of 2M codes that every rank
 * packs or unpacks between broadcasts, one core each before. */
enum { WIRE_PIECE = 1 << 14 };   /* even: only the last piece of an odd count is odd; olmoe-tiny's experts are 4 */

typedef struct {
    const uint8_t *codes;        /* packing: codes to bytes_out */
    unsigned char *bytes_out;
    const unsigned char *bytes;  /* unpacking: bytes to codes_out */
    uint8_t *codes_out;
    int64_t n;
} wire_codes;

static void wire_codes_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const wire_codes *w = ctx;
    const int64_t a = t * WIRE_PIECE, e = a + WIRE_PIECE < w->n ? a + WIRE_PIECE : w->n;
    const int64_t even = (e - a) & ~(int64_t)1;
    if (w->codes) mq_pack_u4_bytes(w->codes + a, even, w->bytes_out + a / 2);
    else mq_unpack_u4_bytes(w->bytes + a / 2, even, w->codes_out + a);
    if (even < e - a) {   /* an odd count's last code: the low nibble of the last byte */
        if (w->codes) w->bytes_out[(e - 1) / 2] = (unsigned char)(w->codes[e - 1] & 15);
        else w->codes_out[e - 1] = w->bytes[(e - 1) / 2] & 15;
    }
}

static void wire_codes_run(wire_codes w) {
    mq_parallel_for((w.n + WIRE_PIECE - 1) / WIRE_PIECE, wire_codes_task, &w);
}

static moeq_status wire_pack(const slot *s, int k, void **out, size_t *n) {
    const mq_qtensor *q = &s->q[k];
    wire_head h;
    memset(&h, 0, sizeof h);
    h.spec = q->spec;
    h.rows = q->rows;
    h.cols = q->cols;
    h.group_size = q->group_size;
    h.n_groups = q->n_groups;
    h.tokens = s->tokens;
    h.global_scale = q->global_scale;
    h.amax = s->amax;
    h.how = (int32_t)s->how;
    h.has_gidx = q->g_idx != NULL;
    h.stats = s->qs[k];
    /* every scheme's codes are 4-bit: two to a byte on the wire */
    const size_t n_codes = (size_t)(q->rows * q->cols), nc = (n_codes + 1) / 2;
    const size_t np = (size_t)(q->rows * q->n_groups) * sizeof(mq_gparams);
    const size_t ng = h.has_gidx ? (size_t)q->cols * sizeof(int32_t) : 0;
    *n = sizeof h + nc + np + ng;
    unsigned char *b = malloc(*n);
    if (!b) return mq_err(MOEQ_E_NOMEM, "out of memory sending %s", s->w[k]->name);
    memcpy(b, &h, sizeof h);
    wire_codes_run((wire_codes){q->codes, b + sizeof h, NULL, NULL, (int64_t)n_codes});
    memcpy(b + sizeof h + nc, q->params, np);
    if (ng) memcpy(b + sizeof h + nc + np, q->g_idx, ng);
    *out = b;
    return MOEQ_OK;
}

static moeq_status wire_unpack(slot *s, int k, const void *data, size_t n) {
    const unsigned char *b = data;
    wire_head h;
    if (n < sizeof h) return mq_err(MOEQ_E_FORMAT, "%s: short message from rank %d", s->w[k]->name, s->lown[k]);
    memcpy(&h, b, sizeof h);
    const size_t n_codes = (size_t)(h.rows * h.cols), nc = (n_codes + 1) / 2;
    const size_t np = (size_t)(h.rows * h.n_groups) * sizeof(mq_gparams);
    const size_t ng = h.has_gidx ? (size_t)h.cols * sizeof(int32_t) : 0;
    if (n != sizeof h + nc + np + ng || h.rows != s->w[k]->out || h.cols != s->w[k]->in)
        return mq_err(MOEQ_E_FORMAT, "%s: the message from rank %d does not match its shape", s->w[k]->name, s->lown[k]);
    mq_qtensor *q = &s->q[k];
    moeq_status st = mq_qtensor_init(q, &h.spec, h.rows, h.cols, s->w[k]->name);
    if (st) return st;
    q->group_size = h.group_size;
    q->n_groups = h.n_groups;
    q->global_scale = h.global_scale;
    wire_codes_run((wire_codes){NULL, NULL, b + sizeof h, q->codes, (int64_t)n_codes});
    memcpy(q->params, b + sizeof h + nc, np);
    if (ng) {
        q->g_idx = mq_alloc_array((size_t)h.cols, sizeof(int32_t), "g_idx");
        if (!q->g_idx) return MOEQ_E_NOMEM;
        memcpy(q->g_idx, b + sizeof h + nc + np, ng);
    }
    s->qs[k] = h.stats;
    s->tokens = h.tokens;
    s->amax = h.amax;
    s->how = (mq_how)h.how;
    s->held = true;
    return MOEQ_OK;
}

/* Every rank runs this after the owners quantized slots[0..n) (and agreed on it): each Linear
 * goes from its owner to every rank, in slot order; then each rank finishes it as one process
 * would (rank 0 writes and records it; sequential calibration continues with its dequantized
 * weights everywhere). A local failure still takes part in every exchange, so that no rank waits
 * for one that left. */
static moeq_status share_slots(mq_pipe *p, int l, slot *slots, int n) {
    moeq_status st = MOEQ_OK;
    char step[64];
    snprintf(step, sizeof step, "layer %d: quantized weights", l);
    /* every Linear from its owner, in order (each rank takes part in every step, also after a
     * failure of its own), then their writes and dequantized copies on the pool: one Linear at a
     * time, every rank dequantized all of a layer's experts on one thread */
    for (int i = 0; i < n; i++) {
        slot *s = &slots[i];
        for (int k = 0; k < s->nw; k++) {
            void *buf = NULL;
            size_t len = 0;
            moeq_status ps = MOEQ_OK;
            if (mine_k(p, s, k)) ps = s->held ? wire_pack(s, k, &buf, &len)
                                         : mq_err(MOEQ_E_ARG, "%s: not quantized", s->w[k]->name);
            moeq_status cs = mq_dist_agree(ps, step);   /* the owner could not pack it */
            if (!cs) cs = mq_dist_bcast_blob(&buf, &len, s->lown[k], step);
            if (cs) {
                free(buf);
                st = st ? st : cs;
                goto done;
            }
            if (!mine_k(p, s, k) && !st) st = wire_unpack(s, k, buf, len);
            free(buf);
        }
    }
    mq_qtensor *q = calloc((size_t)(3 * n + 1), sizeof *q);
    int *weight = calloc((size_t)(3 * n + 1), sizeof *weight);
    float *amax = calloc((size_t)(3 * n + 1), sizeof *amax);
    mq_gptq_stats *wst = calloc((size_t)(3 * n + 1), sizeof *wst);
    if (!st && (!q || !weight || !amax || !wst)) st = mq_err(MOEQ_E_NOMEM, "out of memory writing layer %d", l);
    int m = 0;
    for (int i = 0; i < n && !st; i++)
        for (int k = 0; k < slots[i].nw && !st; k++) {
            const int j = 3 * i + k;
            q[j] = slots[i].q[k];   /* moved: freed below */
            memset(&slots[i].q[k], 0, sizeof slots[i].q[k]);
            amax[m] = finish_prepare(p, &slots[i], k, &q[j], &st);
            wst[m] = slots[i].qs[k];
            weight[m++] = j;
        }
    if (!st) st = put_and_record(p, l, slots, q, weight, amax, wst, m, true, NULL);
    for (int j = 0; q && j < 3 * n + 1; j++) mq_qtensor_free(&q[j]);
    free(q);
    free(weight);
    free(amax);
    free(wst);
done:
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < slots[i].nw; k++) mq_qtensor_free(&slots[i].q[k]);
        slots[i].held = false;
    }
    return st;
}

/* ---- the routed experts on the GPU: where their inputs and outputs live ----------------------- */

static bool experts_plain_as(const mq_pipe *p, int l, int e0, int e1, bool read);

/* Whether layer l's routed experts run on the GPU with their outputs combined there (p->gout):
 * one process, every chunk plain once read, and a pass whose rows may stay on the device. */
static bool experts_on_device(const mq_pipe *p, int l, bool replay) {
    const int E = p->c->n_experts;
    const int C = p->mp.chunk > 0 && p->mp.chunk < E ? p->mp.chunk : E;
    if (!p->gpu || p->ranks > 1 || !p->m->layers[l].is_moe) return false;
    bool plain = true;   /* once read: the weights are not in memory yet */
    for (int e0 = 0; e0 < E; e0 += C) plain &= experts_plain_as(p, l, e0, e0 + C < E ? e0 + C : E, false);
    return plain && (p->seq || replay || (!p->o->act_quant && !p->o->expert_weighting));
}

static void gpu_ffn_inputs_free(mq_pipe *p) {
    p->xn_device_only = false;   /* its only copy goes (a layer's end, or a host step took it) */
    mq_gpu_buf_free(p->gffn_xn);
    mq_gpu_buf_free(p->gffn_h);
    mq_gpu_buf_free(p->gbound);
    p->gffn_xn = p->gffn_h = p->gbound = NULL;
}

static mq_actbuf *out_buf(mq_pipe *p) { return p->X.kind == MQ_ACT_DISK ? &p->X2 : &p->X; }

/* Whether the FFN's outputs of layer l may be added to the boundary on the GPU (p->gbound) and
 * come back as the next boundary: the combined outputs are the whole FFN (no shared expert, no
 * unquantized stream beside) and the boundary is plain page-locked fp32 (not bf16 or a file). The
 * add is the host's add_out, one fp32 add a value: the same bits, 0.05 s a layer less of a host
 * pass over 2 GB on OLMoE-1B-7B at 128 x 2048 tokens. MOEQ_GPU_RESIDUAL=0 turns it off. */
static bool residual_on_device(mq_pipe *p) {
    const char *env = getenv("MOEQ_GPU_RESIDUAL");
    if (env && strcmp(env, "0") == 0) return false;
    const mq_actbuf *hb = out_buf(p);
    return p->c->shared_ffn == 0 && !p->target && hb->kind == MQ_ACT_RAM && hb->pinned;
}

/* The GPU attention's results that only the device reads stay there; each then crossed the bus
 * for nothing (2 GB a pass at 128 x 2048 tokens of OLMoE-1B-7B, 0.1 s). The result of the pass
 * that gives the boundary (h), where the FFN's outputs are added to it on the device (gbound) and
 * the host reads none of it before: sequential calibration's Hessians read the kept FFN input
 * (XN), its output pass the device's FFN input. The kept FFN input (XN) where everything of the
 * layer reads it on the device, unless a host step needs it after all: xn_to_host then (the
 * experts' fallback of a shared Hessian). MOEQ_GPU_HOST_COPIES=1 makes every copy as before. */
static bool host_copies_forced(void) {
    const char *env = getenv("MOEQ_GPU_HOST_COPIES");
    return env && strcmp(env, "1") == 0;
}

static bool boundary_device_only(const mq_pipe *p, bool pass_a) {
    return !host_copies_forced() && !pass_a && p->seq && !p->tseq && p->gbound;
}

static bool xn_device_only(const mq_pipe *p) {
    const mq_pipeline_opts *o = p->o;
    return !host_copies_forced() && p->gffn_xn && p->XN.kind == MQ_ACT_RAM && p->XN.pinned && p->ranks <= 1 &&
           !p->target && !o->act_quant && !o->expert_weighting && p->c->shared_ffn == 0;
}

/* A device buffer laid out as the activations (sample s at s * LD) into their page-locked host
 * copy, every sample, one wait (also after a failed copy: nothing is left in flight). */
static moeq_status gpu_acts_to_host(mq_pipe *p, mq_gpu_buf *b, mq_actbuf *dst) {
    moeq_status st = MOEQ_OK;
    for (int64_t s = 0; s < p->calib.n && !st; s++)
        st = mq_gpu_buf_read_async(b, s * p->LD, p->calib.len[s] * p->c->D, mq_actbuf_ptr(dst, (size_t)(s * p->LD)));
    moeq_status ss = mq_gpu_sync(p->gpu);
    return st ? st : ss;
}

/* XN's host copy from the device's, where the attention left it there only. */
static moeq_status xn_to_host(mq_pipe *p, int l) {
    if (!p->xn_device_only) return MOEQ_OK;
    moeq_status st = gpu_acts_to_host(p, p->gffn_xn, &p->XN);
    if (!st) p->xn_device_only = p->layers[l].gpu_xn_device_only = false;
    return st;
}

/* An activation-sized buffer on the device where it fits in a quarter of the free memory, else
 * none (*out stays NULL: the host's copy serves). */
static moeq_status gpu_acts_buf_if_room(mq_pipe *p, mq_gpu_buf **out) {
    const int64_t n = p->calib.n * p->LD;
    mq_gpu_info gi;
    mq_gpu_get_info(p->gpu, &gi);
    if ((int64_t)sizeof(float) * n > (int64_t)(gi.mem_free / 4)) return MOEQ_OK;
    moeq_status st = mq_gpu_buf_new(p->gpu, n, out);
    return st == MOEQ_E_NOMEM ? MOEQ_OK : st;
}

/* With the attention and the routed experts of layer l on the GPU, the experts' inputs stay there
 * from the attention (the FFN input it computed, sample s at s * LD) instead of going up again
 * from the host: the kept FFN input of pass A (sequential calibration) and the FFN norm of the
 * boundary it leaves (pass B, or the only pass). The experts then read the GPU's FFN norm, whose
 * double sum of squares may round apart from the CPU's in rare rows: so every batch of such a run
 * takes them from here, whatever its size. Where they do not fit beside the experts (a quarter of
 * the free memory), the host's go up as before. */
static moeq_status gpu_ffn_inputs_new(mq_pipe *p, int l, bool replay) {
    gpu_ffn_inputs_free(p);
    if (!p->gin_ready) {   /* not this layer's input */
        mq_gpu_buf_free(p->gin);
        p->gin = NULL;
    }
    if (!experts_on_device(p, l, replay)) return MOEQ_OK;
    const bool xn = !replay && p->seq && !p->tseq;
    const int64_t n = p->calib.n * p->LD;
    mq_gpu_info gi;
    mq_gpu_get_info(p->gpu, &gi);
    if ((int64_t)sizeof(float) * n * (xn ? 2 : 1) > (int64_t)(gi.mem_free / 4)) return MOEQ_OK;
    moeq_status st = xn ? mq_gpu_buf_new(p->gpu, n, &p->gffn_xn) : MOEQ_OK;
    if (!st) st = mq_gpu_buf_new(p->gpu, n, &p->gffn_h);
    if (st == MOEQ_E_NOMEM) {   /* the device's memory went elsewhere meanwhile: the host's go up */
        gpu_ffn_inputs_free(p);
        return MOEQ_OK;
    }
    if (st) {
        gpu_ffn_inputs_free(p);
        return st;
    }
    /* the boundary too, where it fits in the same share (else the host adds) */
    if (residual_on_device(p)) st = gpu_acts_buf_if_room(p, &p->gbound);
    /* and the layer's input, unless the layer before left it there: its first attention pass
     * keeps it for the second (the same X), which then need not send it up again */
    if (!st && p->gbound && !p->gin && !host_copies_forced()) st = gpu_acts_buf_if_room(p, &p->gin);
    return st;
}

/* ---- the attention stage ---------------------------------------------------------------------- */

typedef struct {
    slot *qkv, *o;
    float *arena_qkv, *arena_o;   /* the hook's inputs, copied for the Hessian updates */
    int64_t rows_qkv, rows_o;
    /* multi-head latent attention: q_b_proj and kv_b_proj read the normed latents (their own
     * Hessians); qkv is then q_a_proj (or q_proj) with kv_a_proj_with_mqa */
    slot *qb, *kvb;
    float *arena_qb, *arena_kvb;
    int64_t rows_qb, rows_kvb;
    bool store;                   /* several ranks: the arenas hold every sample of this rank's
                                     share (at: the sample's place), sent to the slots' owners */
    int64_t at, Lmax;
    bool amax;
    /* asymmetric calibration: while fp is set the hooks see the unquantized stream's sample,
     * whose inputs go to farena_* (laid out as the arenas: one sample, or with store the
     * rank's samples) to pair with the quantized stream's */
    bool fp;
    float *farena_qkv, *farena_o, *farena_qb, *farena_kvb;
} att_capture;

static void on_attention(void *user, int layer, mq_site site, int expert, const float *x,
                         int64_t rows, int64_t cols) {
    (void)layer;
    (void)expert;
    att_capture *c = user;
    if (c->fp) {
        float *fa = site == MQ_SITE_QKV ? c->farena_qkv : site == MQ_SITE_O ? c->farena_o
                  : site == MQ_SITE_Q_B ? c->farena_qb : site == MQ_SITE_KV_B ? c->farena_kvb : NULL;
        if (fa && rows > 0) mq_copy_floats(fa + c->at * c->Lmax * cols, x, (size_t)(rows * cols));
        return;
    }
    slot *s = site == MQ_SITE_QKV ? c->qkv : site == MQ_SITE_O ? c->o
            : site == MQ_SITE_Q_B ? c->qb : site == MQ_SITE_KV_B ? c->kvb : NULL;
    if (!s || rows <= 0) return;
    float *arena = site == MQ_SITE_QKV ? c->arena_qkv : site == MQ_SITE_O ? c->arena_o
                 : site == MQ_SITE_Q_B ? c->arena_qb : c->arena_kvb;
    int64_t *nr = site == MQ_SITE_QKV ? &c->rows_qkv : site == MQ_SITE_O ? &c->rows_o
                : site == MQ_SITE_Q_B ? &c->rows_qb : &c->rows_kvb;
    if (arena && (s->h.sum || c->store)) {
        mq_copy_floats(arena + c->at * c->Lmax * cols, x, (size_t)(rows * cols));
        *nr = rows;
    }
    if (c->amax) amax_update(&s->amax, x, rows * cols);
}

/* The activation buffer that receives h (the boundary after attention): the input buffer itself
 * in memory, its double on disk (so the snapshot of the layer's input stays intact). */
static int32_t *sel_of(int32_t *sel, const mq_pipe *p, int64_t s) {
    return sel + s * p->calib.max_len * p->c->top_k;
}
static float *wt_of(float *w, const mq_pipe *p, int64_t s) {
    return w + s * p->calib.max_len * p->c->top_k;
}

typedef struct {
    float *xt;                    /* [Lmax, D] the sample being run */
    float *xn;                    /* [Lmax, D] its FFN input */
    float *xf;                    /* [Lmax, D] asymmetric calibration: the unquantized stream's */
    float *probs;                 /* [Lmax, E] router scratch */
    bool gpu;                     /* the attention runs on p->gatt */
    bool pinned;                  /* xt and xn are page-locked (mq_gpu_host_alloc) */
    bool ahead;                   /* this pass reads and sends up the first expert chunk while
                                     the device runs it (experts_ahead) */
    double *prof;                 /* MOEQ_PROFILE: seconds of the inputs' copies, the FFN norm
                                     and routing, the outputs' copies [3], or NULL */
} att_scratch;

/* MOEQ_PROFILE's attention-stage parts (att_scratch.prof): the seconds since *t to part k. */
static void att_prof_add(const att_scratch *sc, int k, double *t) {
    if (!sc->prof) return;
    const double now = mq_now();
    sc->prof[k] += now - *t;
    *t = now;
}

/* Whether layer l's attention can run on the GPU: the standard attention of the families the
 * GPU twin implements, fp32 weights, no emulated activation quantizer (its amax and rounding
 * stay on the CPU). */
static bool gpu_attention_fits(const mq_pipe *p, int l) {
    const mq_config *c = p->c;
    const mq_layer *ly = &p->m->layers[l];
    const bool family = c->arch == MQ_ARCH_LLAMA || c->arch == MQ_ARCH_OLMOE || c->arch == MQ_ARCH_QWEN2_MOE ||
                        c->arch == MQ_ARCH_QWEN3_MOE || c->arch == MQ_ARCH_MIXTRAL;
    return p->gpu && family && !p->o->act_quant && ly->q.w && ly->k.w && ly->v.w && ly->o.w &&
           !ly->q.act_q && !ly->o.act_q && getenv("MOEQ_GPU_ATTENTION_OFF") == NULL;
}

/* Uploads layer l's attention weights (as they are now: the quantized ones for pass B) to the
 * GPU twin, made at the first call. */
static moeq_status gpu_attention_set(mq_pipe *p, int l) {
    const mq_config *c = p->c;
    const mq_layer *ly = &p->m->layers[l];
    moeq_status st = MOEQ_OK;
    if (!p->gatt) {
        mq_gpu_attn_shape sh = {.D = c->D, .H = c->n_heads, .KV = c->n_kv_heads, .hd = c->head_dim,
                                .max_T = p->calib.max_len, .eps = c->rms_eps,
                                .qk_norm = c->qk_norm == MQ_QKNORM_FULL ? 1 : c->qk_norm == MQ_QKNORM_HEAD ? 2 : 0,
                                .clip_qkv = c->clip_qkv, .E = c->n_experts, .top_k = c->top_k,
                                .norm_topk = c->norm_topk_prob};
        mq_state_rope_tables(p->state, &sh.rope_cos, &sh.rope_sin);
        if ((st = mq_gpu_attn_new(p->gpu, &sh, &p->gatt))) return st;
    }
    mq_gpu_attn_weights w = {.norm = ly->attn_norm, .q = ly->q.w, .k = ly->k.w, .v = ly->v.w, .o = ly->o.w,
                             .q_bias = ly->q.bias, .k_bias = ly->k.bias, .v_bias = ly->v.bias,
                             .o_bias = ly->o.bias, .q_norm = ly->q_norm, .k_norm = ly->k_norm,
                             .window = c->layer_sliding[l] ? c->sliding_window : 0,
                             .ffn_norm = ly->ffn_norm, .router = ly->is_moe ? ly->router : NULL};
    return mq_gpu_attn_set(p->gatt, &w);
}

static moeq_status read_part(mq_pipe *p, int l, unsigned what, int e0, int e1,
                             bool (*alloc_only)(float **dest, void *user), void *user);
static moeq_status gpu_experts(mq_pipe *p, int l, int e0, int e1, bool down, int64_t rows, mq_gpu_mlp **out);

/* One process on a GPU uploads each chunk of a layer's routed experts in routed_experts, where
 * the device waits for the host to read (bf16 -> fp32) and send them. The first chunk instead
 * goes while the layer's last attention pass runs there (mq_gpu_attn_io.meanwhile): 0.1-0.2 s a
 * layer less of an idle device on OLMoE-1B-7B (64 experts, 1.6 GB). The plan counts the chunk's
 * weights beside the attention stage (memplan.c). MOEQ_EXPERTS_AHEAD=0 turns it off. */
static int first_chunk_end(const mq_pipe *p) {
    const int E = p->c->n_experts;
    return p->mp.chunk > 0 && p->mp.chunk < E ? p->mp.chunk : E;
}

static bool experts_ahead_wanted(const mq_pipe *p, int l, bool replay) {
    const char *env = getenv("MOEQ_EXPERTS_AHEAD");
    if (env && strcmp(env, "0") == 0) return false;
    /* as routed_experts uploads: calibration in one process, experts plain once read */
    return p->gpu && p->ranks <= 1 && !replay && p->calibrate && p->m->layers[l].is_moe &&
           experts_plain_as(p, l, 0, first_chunk_end(p), false);
}

typedef struct {
    mq_pipe *p;
    int l;
    double seconds, cpu;          /* its wall and CPU time, which the attention's do not count */
} ahead_job;

static moeq_status experts_ahead(void *user) {
    ahead_job *j = user;
    mq_pipe *p = j->p;
    const int e1 = first_chunk_end(p);
    const double t0 = mq_now(), c0 = mq_cpu_now();
    moeq_status st = read_part(p, j->l, MQ_PART_EXPERTS, 0, e1, NULL, NULL);
    const double t1 = mq_now(), c1 = mq_cpu_now();
    mq_gpu_mlp *m = NULL;
    if (!st) st = gpu_experts(p, j->l, 0, e1, true, mq_plan_batch_rows(p, e1), &m);
    p->layers[j->l].forward += mq_now() - t1;   /* the upload, as the forward's (routed_experts) */
    p->layers[j->l].cpu_forward += mq_cpu_now() - c1;
    mq_gpu_mlp_free(p->gx_ahead);
    p->gx_ahead = m;
    p->gx_ahead_l = j->l;
    p->gx_ahead_e1 = e1;
    j->seconds += mq_now() - t0;
    j->cpu += mq_cpu_now() - c0;
    return st;
}

/* attention_pass on the GPU: the samples in batches of up to one group of the GPU twin
 * (mq_gpu_attn_rows tokens), each batch one call. Where the activations are page-locked
 * (alloc_activations) a sample goes up from them and its results come back into them directly;
 * otherwise through sc's page-locked rows (Lmax tokens a batch). */
static moeq_status attention_pass_gpu(mq_pipe *p, int l, bool pass_a, att_capture *cap, att_scratch *sc) {
    const mq_config *c = p->c;
    const bool moe = p->m->layers[l].is_moe;
    const int64_t D = c->D, Q = (int64_t)c->n_heads * c->head_dim, Lmax = p->calib.max_len;
    const int64_t s_lo = p->ranks > 1 ? p->s_lo : 0, s_hi = p->ranks > 1 ? p->s_hi : p->calib.n;
    /* what follows the attention (below) on the GPU too: only the results come back */
    const bool keep_xn = pass_a && p->seq && !p->tseq, keep_h = !pass_a || !p->seq;
    /* ... and of those the host's copies, unless only the device reads them */
    const bool host_xn = keep_xn && !(moe && xn_device_only(p)), host_h = keep_h && !(moe && boundary_device_only(p, pass_a));
    if (keep_xn) p->xn_device_only = p->layers[l].gpu_xn_device_only = !host_xn;
    if (keep_h) p->layers[l].gpu_h_device_only = !host_h;
    mq_actbuf *hb = out_buf(p);
    /* X from the device where it is there (gin), else from the host, kept there for pass B */
    mq_gpu_buf *x_from = p->gin && p->gin_ready ? p->gin : NULL;
    mq_gpu_buf *x_keep = !x_from && p->gin && pass_a && p->seq ? p->gin : NULL;
    const bool x_direct = p->X.pinned || x_from, h_direct = !host_h || hb->pinned, n_direct = !host_xn || p->XN.pinned;
    const bool staged = !x_direct || !h_direct || !n_direct;
    const int64_t rows_max = staged ? Lmax : mq_gpu_attn_rows(p->gatt);
    mq_gpu_attn_io io = {.ffn_dev = keep_xn ? p->gffn_xn : keep_h && moe ? p->gffn_h : NULL,
                         .h_dev = keep_h && moe && !keep_xn ? p->gbound : NULL, .x_from = x_from, .x_keep = x_keep};
    if (cap && !cap->store) {   /* the hooks' work done there: Hessian sums on the device */
        io.hq = cap->qkv->gh;
        io.ho = cap->o->gh;
    }
    ahead_job ahead = {p, l, 0, 0};
    if (sc->ahead) {
        io.meanwhile = experts_ahead;
        io.meanwhile_user = &ahead;
    }
    int64_t n_max = rows_max < s_hi - s_lo ? rows_max : s_hi - s_lo;
    mq_gpu_attn_sample *smp = mq_alloc_array((size_t)(n_max > 0 ? n_max : 1), sizeof *smp, "attention samples");
    if (!smp) return MOEQ_E_NOMEM;
    moeq_status st = MOEQ_OK;
    for (int64_t s0 = s_lo, s1; s0 < s_hi && !st; s0 = s1) {
        if ((st = check_interrupt())) break;
        double t0 = mq_now(), c0 = mq_cpu_now();
        int64_t n = 0, rows = 0;
        for (s1 = s0; s1 < s_hi && rows + p->calib.len[s1] <= rows_max; s1++) {
            const int64_t T = p->calib.len[s1];
            const size_t off = (size_t)(s1 * p->LD);
            float *xt = staged ? sc->xt + rows * D : NULL, *xn = staged ? sc->xn + rows * D : NULL;
            mq_gpu_attn_sample *m = &smp[n++];
            memset(m, 0, sizeof *m);
            m->T = T;
            if (x_from) {
                m->x = NULL;
            } else if (x_direct) {
                m->x = mq_actbuf_ptr(&p->X, off);
            } else {   /* bf16 or mapped: converted or copied into the staging rows */
                const float *v = mq_actbuf_view(&p->X, off, (size_t)(T * D), xt);
                if (v != xt) mq_copy_floats(xt, v, (size_t)(T * D));
                m->x = xt;
            }
            if (host_h) m->y = hb->pinned ? mq_actbuf_ptr(hb, off) : xt;
            if (host_xn) m->ffn_in = p->XN.pinned ? mq_actbuf_ptr(&p->XN, off) : xn;
            if (cap && cap->store) {   /* several ranks: the inputs kept for the Linears' owners */
                const int64_t at = s1 - s_lo;
                if (cap->arena_qkv) m->xn = cap->arena_qkv + at * Lmax * D;
                if (cap->arena_o) m->att = cap->arena_o + at * Lmax * Q;
            }
            if (moe && keep_xn) m->sel = sel_of(p->sel_a, p, s1), m->w = wt_of(p->w_a, p, s1);
            if (moe && keep_h)
                m->sel = sel_of(pass_a ? p->sel_a : p->sel_b, p, s1), m->w = wt_of(pass_a ? p->w_a : p->w_b, p, s1);
            m->ffn_dev_off = (int64_t)off;
            rows += T;
        }
        if (io.hq) cap->qkv->h.n += rows;
        if (io.ho) cap->o->h.n += rows;
        ahead.seconds = ahead.cpu = 0;
        st = mq_gpu_attn_run_samples(p->gatt, smp, n, &io);
        io.meanwhile = NULL;   /* once: with the first group */
        for (int64_t i = 0, r = 0; i < n && !st; r += smp[i].T, i++) {   /* the staged results */
            const size_t off = (size_t)((s0 + i) * p->LD), nv = (size_t)(smp[i].T * D);
            if (host_h && !hb->pinned) mq_actbuf_put(hb, off, nv, sc->xt + r * D);
            if (host_xn && !p->XN.pinned) mq_actbuf_put(&p->XN, off, nv, sc->xn + r * D);
        }
        /* the experts' read and upload meanwhile are counted as theirs (experts_ahead) */
        const double wall = mq_now() - t0 - ahead.seconds, cpu = mq_cpu_now() - c0 - ahead.cpu;
        p->layers[l].forward += wall;
        p->layers[l].cpu_forward += cpu;
        p->layers[l].attention += wall;
        p->layers[l].cpu_attention += cpu;
        mq_pipe_progress(p, p->mp_units.attention_sample * n * (p->ranks > 1 ? p->ranks : 1));
    }
    mq_free(smp);
    if (!st && x_keep) p->gin_ready = true;   /* for pass B */
    if (!st && x_from) p->layers[l].gpu_inputs_from_device++;
    return st;
}

/* Asymmetric calibration: sample s of the unquantized stream through the layer's attention (its
 * unquantized weights): h back into XF, its routing into sel_f / w_f; with cap, each Linear's
 * input into cap's farena_* for the quantized stream's pass that follows. */
static moeq_status fp_attention_sample(mq_pipe *p, int l, int64_t s, att_scratch *sc, att_capture *cap) {
    const int64_t T = p->calib.len[s], D = p->c->D;
    const size_t off = (size_t)(s * p->LD);
    double t = sc->prof ? mq_now() : 0;
    const float *x = mq_actbuf_view(&p->XF, off, (size_t)(T * D), sc->xf);
    if (x != sc->xf) mq_copy_floats(sc->xf, x, (size_t)(T * D));
    att_prof_add(sc, 0, &t);
    mq_hooks hooks = {on_attention, cap};
    if (cap) cap->fp = true;
    moeq_status st = mq_attention_forward(p->m, p->state, l, sc->xf, T, 0, cap ? &hooks : NULL);
    if (cap) cap->fp = false;
    if (st) return st;
    if (sc->prof) t = mq_now();
    mq_actbuf_put(&p->XF, off, (size_t)(T * D), sc->xf);
    att_prof_add(sc, 2, &t);
    if (p->m->layers[l].is_moe) {
        mq_ffn_norm(p->m, l, sc->xf, T, sc->xn);
        mq_moe_route(p->m, l, sc->xn, T, sc->probs, sel_of(p->sel_f, p, s), wt_of(p->w_f, p, s));
    }
    att_prof_add(sc, 1, &t);
    return MOEQ_OK;
}

/* The unquantized stream through the layer's attention without captures (a resumed run's
 * replay of a finished layer: before its quantized weights are read back). */
static moeq_status fp_attention_pass(mq_pipe *p, int l, att_scratch *sc) {
    moeq_status st = MOEQ_OK;
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (int64_t s = 0; s < p->calib.n && !st; s++)
        if (!(st = check_interrupt())) st = fp_attention_sample(p, l, s, sc, NULL);
    p->layers[l].forward += mq_now() - t0;
    p->layers[l].cpu_forward += mq_cpu_now() - c0;
    p->layers[l].attention += mq_now() - t0;
    p->layers[l].cpu_attention += mq_cpu_now() - c0;
    return st;
}

/* Runs every sample through the layer's attention. capture: pass A (hooks). Where the results go
 * depends on the mode (pipeline.h). */
static moeq_status attention_pass(mq_pipe *p, int l, bool pass_a, att_capture *cap,
                                  att_scratch *sc) {
    if (sc->gpu) return attention_pass_gpu(p, l, pass_a, cap, sc);
    const bool moe = p->m->layers[l].is_moe;
    const int64_t D = p->c->D;
    mq_hooks hooks = {on_attention, cap};
    moeq_status st = MOEQ_OK;
    /* several ranks: each runs its share of the samples */
    const int64_t s_lo = p->ranks > 1 ? p->s_lo : 0, s_hi = p->ranks > 1 ? p->s_hi : p->calib.n;
    for (int64_t s = s_lo; s < s_hi && !st; s++) {
        if ((st = check_interrupt())) break;
        int64_t T = p->calib.len[s];
        double t0 = mq_now(), c0 = mq_cpu_now(), tp = t0;
        const float *x = mq_actbuf_view(&p->X, (size_t)(s * p->LD), (size_t)(T * D), sc->xt);
        if (x != sc->xt) mq_copy_floats(sc->xt, x, (size_t)(T * D));   /* bf16: converted there */
        att_prof_add(sc, 0, &tp);
        if (cap) {
            cap->rows_qkv = cap->rows_o = cap->rows_qb = cap->rows_kvb = 0;
            cap->at = cap->store ? s - s_lo : 0;
        }
        const bool keep_xn = pass_a && p->seq && !p->tseq, keep_h = !pass_a || !p->seq;
        /* asymmetric calibration: the unquantized stream's sample first, its inputs kept */
        if (p->target && pass_a && cap) st = fp_attention_sample(p, l, s, sc, cap);
        if (!st) st = mq_attention_forward(p->m, p->state, l, sc->xt, T, 0, cap ? &hooks : NULL);
        double t1 = mq_now(), c1 = mq_cpu_now();
        if (!st && cap && !cap->store) {   /* each update over the whole pool */
            if (cap->rows_qkv) st = slot_add(cap->qkv, cap->arena_qkv, cap->rows_qkv);
            if (cap->rows_o && !st) st = slot_add(cap->o, cap->arena_o, cap->rows_o);
            if (cap->rows_qb && !st) st = slot_add(cap->qb, cap->arena_qb, cap->rows_qb);
            if (cap->rows_kvb && !st) st = slot_add(cap->kvb, cap->arena_kvb, cap->rows_kvb);
        }
        if (!st && cap && !cap->store && p->target) {   /* the cross sums, paired token for token */
            slot_cross(cap->qkv, cap->farena_qkv, cap->arena_qkv, cap->rows_qkv);
            slot_cross(cap->o, cap->farena_o, cap->arena_o, cap->rows_o);
            if (cap->qb) slot_cross(cap->qb, cap->farena_qb, cap->arena_qb, cap->rows_qb);
            if (cap->kvb) slot_cross(cap->kvb, cap->farena_kvb, cap->arena_kvb, cap->rows_kvb);
        }
        double t2 = mq_now(), c2 = mq_cpu_now();
        tp = t2;
        if (!st) {
            if (keep_xn) {   /* the FFN input, kept for the experts' Hessians */
                mq_ffn_norm(p->m, l, sc->xt, T, sc->xn);
                att_prof_add(sc, 1, &tp);
                mq_actbuf_put(&p->XN, (size_t)(s * p->LD), (size_t)(T * D), sc->xn);
                att_prof_add(sc, 2, &tp);
                if (moe) mq_moe_route(p->m, l, sc->xn, T, sc->probs, sel_of(p->sel_a, p, s), wt_of(p->w_a, p, s));
            } else if (keep_h) {   /* h: the next boundary, less the FFN */
                mq_actbuf_put(out_buf(p), (size_t)(s * p->LD), (size_t)(T * D), sc->xt);
                att_prof_add(sc, 2, &tp);
                if (moe) {
                    mq_ffn_norm(p->m, l, sc->xt, T, sc->xn);
                    mq_moe_route(p->m, l, sc->xn, T, sc->probs,
                                 sel_of(pass_a ? p->sel_a : p->sel_b, p, s),
                                 wt_of(pass_a ? p->w_a : p->w_b, p, s));
                }
            }
        }
        double t3 = mq_now(), c3 = mq_cpu_now();
        att_prof_add(sc, 1, &tp);
        p->layers[l].forward += (t1 - t0) + (t3 - t2);
        p->layers[l].cpu_forward += (c1 - c0) + (c3 - c2);
        p->layers[l].attention += (t1 - t0) + (t3 - t2);
        p->layers[l].cpu_attention += (c1 - c0) + (c3 - c2);
        p->layers[l].hessian += t2 - t1;
        p->layers[l].cpu_hessian += c2 - c1;
        mq_pipe_progress(p, p->mp_units.attention_sample * (p->ranks > 1 ? p->ranks : 1));
    }
    return st;
}

/* Several ranks: the Hessian of slot s from the inputs every rank kept of its samples (arena:
 * this rank's, width values per row), added on the owner in sample order, as one process adds
 * them. */
static moeq_status gather_hessian(mq_pipe *p, int l, slot *s, const float *arena, int64_t width) {
    if (!s->nw || s->how != MQ_HOW_GPTQ) return MOEQ_OK;
    const int64_t Lmax = p->calib.max_len;
    char step[64];
    snprintf(step, sizeof step, "layer %d: inputs of %s", l, s->w[0]->name);
    float *tmp = mine(p, s) ? mq_alloc_array((size_t)(Lmax * width), sizeof(float), "attention inputs") : NULL;
    moeq_status st = mine(p, s) && !tmp ? MOEQ_E_NOMEM : MOEQ_OK;
    st = mq_dist_agree(st, step);
    for (int r = 0; r < p->ranks && !st; r++) {
        int64_t lo, hi;
        mq_dist_share(p->calib.n, r, p->ranks, &lo, &hi);
        for (int64_t t = lo; t < hi && !st; t++) {
            const int64_t rows = p->calib.len[t];
            const size_t bytes = sizeof(float) * (size_t)(rows * width);
            const float *x = r == p->rank ? arena + (t - lo) * Lmax * width : tmp;
            if (r == p->rank) {   /* to every other rank that quantizes one of its Linears */
                int own[3];
                for (int i = 0, n = slot_owners(s, own); i < n && !st; i++)
                    if (own[i] != p->rank) st = mq_dist_send(x, bytes, own[i], step);
            } else if (mine(p, s)) {
                st = mq_dist_recv(tmp, bytes, r, step);
            }
            if (mine(p, s) && !st) {
                double t0 = mq_now(), c0 = mq_cpu_now();
                st = slot_add(s, x, rows);
                p->layers[l].hessian += mq_now() - t0;
                p->layers[l].cpu_hessian += mq_cpu_now() - c0;
            }
        }
    }
    mq_free(tmp);
    return st;
}

/* The first row of band r of a K x K lower triangle cut into n bands of equal area (row i has
 * i + 1 elements), so every band is about the same work. */
static int64_t band_start(int64_t K, int r, int n) {
    if (r <= 0) return 0;
    if (r >= n) return K;
    return (int64_t)llround((double)K * sqrt((double)r / (double)n));
}

/* Several ranks, on the CPU: the Hessian of slot s as a relay over the ranks in rank order,
 * which is sample order (contiguous shares). The lower triangle is cut into bands of rows of
 * equal area; rank 0 sums its samples' rows into band 0 and hands the band to rank 1, which goes
 * on with its samples (mq_syrk_det_acc: every element the same chain of fmaf in row order as
 * one process's) and hands it on, while rank 0 starts band 1, and so on: every rank works on its
 * own samples only, the bands pipeline through (idle at the start and end: (N - 1) bands of
 * RELAY_BANDS_PER_RANK * N), and what moves is the sum, K x K per rank, not every sample's
 * inputs. The last rank then sends the whole sum to each other rank that quantizes one of the
 * slot's Linears. */
enum { RELAY_BANDS_PER_RANK = 8 };

/* The relay itself: C, this rank's K x K buffer of the slot's sum, goes from rank to rank band by
 * band, each rank adding its samples' rows (arena: their inputs, width values a row) into the
 * band; with farena (the unquantized stream's inputs of the same rows) the cross sum's square in
 * bands of equal rows, else the Hessian's lower triangle in bands of equal area. Then the sum,
 * complete on the last rank, goes to the others that quantize one of the slot's Linears. */
static moeq_status relay_sum(mq_pipe *p, int l, const slot *s, float *C, const float *farena, const float *arena,
                             int64_t width, const char *step) {
    const int64_t Lmax = p->calib.max_len, K = width;
    const int last = p->ranks - 1;
    moeq_status st = MOEQ_OK;
    int64_t lo, hi;
    mq_dist_share(p->calib.n, p->rank, p->ranks, &lo, &hi);
    int64_t nb = (int64_t)RELAY_BANDS_PER_RANK * p->ranks;
    if (nb > K) nb = K;
    for (int64_t b = 0; b < nb && !st; b++) {
        const int64_t a = farena ? K * b / nb : band_start(K, (int)b, (int)nb);
        const int64_t e = farena ? K * (b + 1) / nb : band_start(K, (int)b + 1, (int)nb);
        const size_t bytes = sizeof(float) * (size_t)((e - a) * K);
        if (e <= a) continue;
        if (p->rank > 0) st = mq_dist_recv(C + a * K, bytes, p->rank - 1, step);
        double t0 = mq_now(), c0 = mq_cpu_now();
        for (int64_t t = lo; t < hi && !st; t++) {
            const float *x = arena + (t - lo) * Lmax * width;
            if (farena)
                mq_cross_det_acc_pool_rows(K, p->calib.len[t], farena + (t - lo) * Lmax * width, width, x, width, C,
                                           K, a, e);
            else
                mq_syrk_det_acc_pool_rows(K, p->calib.len[t], x, width, C, K, a, e);
        }
        p->layers[l].hessian += mq_now() - t0;
        p->layers[l].cpu_hessian += mq_cpu_now() - c0;
        if (!st && p->rank < last) st = mq_dist_send(C + a * K, bytes, p->rank + 1, step);
    }
    int own[3];
    const int n_own = slot_owners(s, own);
    for (int i = 0; i < n_own && !st; i++) {
        if (own[i] == last) continue;
        const size_t bytes = sizeof(float) * (size_t)(K * K);
        if (p->rank == last) st = mq_dist_send(C, bytes, own[i], step);
        else if (p->rank == own[i]) st = mq_dist_recv(C, bytes, last, step);
    }
    return st;
}

static moeq_status split_hessian(mq_pipe *p, int l, slot *s, const float *arena, int64_t width) {
    if (!s->nw || s->how != MQ_HOW_GPTQ) return MOEQ_OK;
    char step[64];
    snprintf(step, sizeof step, "layer %d: Hessian of %s", l, s->w[0]->name);
    mq_hessian part = {0};   /* the relay's sum on a rank that does not quantize the slot */
    moeq_status st = mine(p, s) ? MOEQ_OK : mq_hessian_init(&part, width, "a Hessian in relay");
    st = mq_dist_agree(st, step);
    if (!st) st = relay_sum(p, l, s, mine(p, s) ? s->h.sum : part.sum, NULL, arena, width, step);
    if (!st && mine(p, s))
        for (int64_t t = 0; t < p->calib.n; t++) s->h.n += p->calib.len[t];
    mq_hessian_free(&part);
    return st;
}

/* Several ranks, asymmetric calibration: the cross sum G of slot s by the same relay (every
 * element the one process's fmaf chain over the rows in sample order); farena / arena: this
 * rank's samples' inputs of the unquantized and the quantized stream. */
static moeq_status split_cross(mq_pipe *p, int l, slot *s, const float *farena, const float *arena, int64_t width) {
    if (!s->nw || s->how != MQ_HOW_GPTQ) return MOEQ_OK;
    char step[64];
    snprintf(step, sizeof step, "layer %d: cross sum of %s", l, s->w[0]->name);
    /* the relay's sum on a rank that does not quantize the slot (the owners' G is zeroed already) */
    float *part = mine(p, s) ? NULL : mq_alloc_zero(sizeof(float) * (size_t)(width * width), "a cross sum in relay");
    moeq_status st = mine(p, s) || part ? MOEQ_OK : MOEQ_E_NOMEM;
    st = mq_dist_agree(st, step);
    if (!st) st = relay_sum(p, l, s, mine(p, s) ? s->G : part, farena, arena, width, step);
    if (!st && mine(p, s)) {
        s->g_rows = 0;
        for (int64_t t = 0; t < p->calib.n; t++) s->g_rows += p->calib.len[t];
    }
    mq_free(part);
    return st;
}

/* Several ranks: what the FFN's calibration reads of every sample (pipeline.h), from the rank
 * that computed it to every rank: the FFN inputs (or the boundary after attention) and their
 * routing. */
static moeq_status share_ffn_inputs(mq_pipe *p, int l) {
    char step[48];
    snprintf(step, sizeof step, "layer %d: FFN inputs", l);
    const bool from_xn = p->seq && !p->tseq;
    moeq_status st = mq_pipe_share_samples(p, from_xn ? &p->XN : out_buf(p), step);
    if (!st && p->m->layers[l].is_moe) {
        const bool b = p->tseq;   /* pass B's routing */
        const size_t per = (size_t)(p->calib.max_len * p->c->top_k);
        st = mq_pipe_share_rows(p, b ? p->sel_b : p->sel_a, per * sizeof(int32_t), step);
        if (!st) st = mq_pipe_share_rows(p, b ? p->w_b : p->w_a, per * sizeof(float), step);
    }
    if (!st && p->target) {   /* the unquantized stream's boundary after attention, and its routing */
        st = mq_pipe_share_samples(p, &p->XF, step);
        const size_t per = (size_t)(p->calib.max_len * p->c->top_k);
        if (!st && p->m->layers[l].is_moe) st = mq_pipe_share_rows(p, p->sel_f, per * sizeof(int32_t), step);
        if (!st && p->m->layers[l].is_moe) st = mq_pipe_share_rows(p, p->w_f, per * sizeof(float), step);
    }
    return st;
}

static moeq_status attention_stage(mq_pipe *p, int l, bool replay) {
    const mq_config *c = p->c;
    mq_layer *ly = &p->m->layers[l];
    const int64_t Lmax = p->calib.max_len, D = c->D, Q = (int64_t)c->n_heads * c->v_head_dim;
    moeq_status st = read_part(p, l, attention_parts(p, l), 0, 0, NULL, NULL);
    /* the first expert chunk while the attention computes */
    if (!st && ly->is_moe && p->ranks <= 1 && !replay) st = start_ahead(p, l, MQ_PART_EXPERTS, 0, first_chunk_end(p));
    if (st) return st;
    /* slots: q/k/v (MLA: q_a or q_proj with kv_a), o; MLA also q_b and kv_b */
    slot sl[4];
    const int n_sl = c->mla ? 4 : 2;
    const int64_t width[4] = {D, Q, c->q_lora_rank, c->kv_lora_rank};
    if (c->mla) {
        slot_set(p, &sl[0], -1, false, c->q_lora_rank > 0 ? &ly->q_a : &ly->q, &ly->kv_a, NULL);
        slot_set(p, &sl[2], -1, false, &ly->q_b, NULL, NULL);
        slot_set(p, &sl[3], -1, false, &ly->kv_b, NULL, NULL);
    } else {
        slot_set(p, &sl[0], -1, false, &ly->q, &ly->k, &ly->v);
    }
    slot_set(p, &sl[1], -1, false, &ly->o, NULL, NULL);
    if (p->ranks > 1) {   /* every rank runs the attention; its Linears are quantized apart */
        int next = 0;
        for (int i = 0; i < n_sl; i++) {
            sl[i].owner = next % p->ranks;
            for (int k = 0; k < sl[i].nw; k++) sl[i].lown[k] = next++ % p->ranks;
        }
    }
    att_capture cap = {.qkv = &sl[0], .o = &sl[1], .amax = p->o->act_quant};
    if (c->mla) {
        cap.qb = &sl[2];
        cap.kvb = &sl[3];
    }
    att_scratch sc = {0};
    sc.gpu = gpu_attention_fits(p, l);
    if (sc.gpu) {   /* page-locked: each sample's input and results cross the bus at its speed */
        sc.xt = mq_gpu_host_alloc(p->gpu, sizeof(float) * (size_t)(Lmax * D));
        sc.xn = sc.xt ? mq_gpu_host_alloc(p->gpu, sizeof(float) * (size_t)(Lmax * D)) : NULL;
        sc.pinned = sc.xn != NULL;
        if (!sc.pinned) mq_gpu_host_free(sc.xt);
    }
    if (!sc.pinned) {
        sc.xt = mq_alloc_array((size_t)Lmax, (size_t)D * sizeof(float), "attention input");
        sc.xn = mq_alloc_array((size_t)Lmax, (size_t)D * sizeof(float), "FFN input");
    }
    sc.probs = mq_alloc_array((size_t)Lmax, (size_t)(c->n_experts > 0 ? c->n_experts : 1) * sizeof(float),
                              "router probabilities");
    if (p->target) sc.xf = mq_alloc_array((size_t)Lmax, (size_t)D * sizeof(float), "unquantized attention input");
    if (!sc.xt || !sc.xn || !sc.probs || (p->target && !sc.xf)) st = MOEQ_E_NOMEM;
    /* MOEQ_PROFILE on the CPU: where the stage's seconds go, logged at its end */
    double prof_model[MQ_ATT_PARTS] = {0}, prof_pipe[3] = {0};
    const bool prof = getenv("MOEQ_PROFILE") && !sc.gpu;
    if (prof) {
        mq_state_profile(p->state, prof_model);
        sc.prof = prof_pipe;
    }
    const double t_stage = mq_now();
    const bool pass_a = !replay || !p->seq;
    if (!st && sc.gpu && pass_a) st = gpu_attention_set(p, l);
    if (!st) {
        if (sc.gpu) st = gpu_ffn_inputs_new(p, l, replay);
        else gpu_ffn_inputs_free(p);
    }
    if (!st && !replay) {
        for (int i = 0; i < n_sl && !st; i++) st = slot_hessian(p, &sl[i]);
        /* several ranks: every rank keeps the inputs of its samples for the owners */
        const bool dist = p->ranks > 1;
        const int64_t keep = dist ? p->s_hi - p->s_lo : 1;
        const bool need0 = dist ? sl[0].nw && sl[0].how == MQ_HOW_GPTQ : sl[0].h.sum != NULL;
        const bool need1 = dist ? sl[1].nw && sl[1].how == MQ_HOW_GPTQ : sl[1].h.sum != NULL;
        cap.store = dist;
        cap.Lmax = Lmax;
        if (!st && need0 && keep > 0)
            cap.arena_qkv = mq_alloc_array((size_t)(keep * Lmax), (size_t)D * sizeof(float), "q/k/v inputs");
        if (!st && need1 && keep > 0)
            cap.arena_o = mq_alloc_array((size_t)(keep * Lmax), (size_t)Q * sizeof(float), "o_proj inputs");
        if (!st && keep > 0 && ((need0 && !cap.arena_qkv) || (need1 && !cap.arena_o))) st = MOEQ_E_NOMEM;
        for (int i = 2; i < n_sl && !st && keep > 0; i++) {   /* the latent slots of MLA */
            const bool need = dist ? sl[i].nw && sl[i].how == MQ_HOW_GPTQ : sl[i].h.sum != NULL;
            float **a = i == 2 ? &cap.arena_qb : &cap.arena_kvb;
            if (need && !(*a = mq_alloc_array((size_t)(keep * Lmax),
                                              (size_t)width[i] * sizeof(float),
                                              "latent attention inputs")))
                st = MOEQ_E_NOMEM;
        }
        /* asymmetric calibration: the unquantized stream's inputs per slot with a cross sum, as
         * the quantized one's (one process: one sample; several ranks: the rank's samples, every
         * rank, for the relay of the sums) */
        float **fa[4] = {&cap.farena_qkv, &cap.farena_o, &cap.farena_qb, &cap.farena_kvb};
        for (int i = 0; i < n_sl && !st && p->target && keep > 0; i++) {
            const bool need = dist ? sl[i].nw && sl[i].how == MQ_HOW_GPTQ : sl[i].G != NULL;
            if (need && !(*fa[i] = mq_alloc_array((size_t)(keep * Lmax), (size_t)width[i] * sizeof(float),
                                                  "unquantized attention inputs")))
                st = MOEQ_E_NOMEM;
        }
        if (!st) {   /* faulted in on the pool in 2 MB pieces, not by the first sample's copies (actbuf.c) */
            float *ar[8] = {cap.arena_qkv, cap.arena_o, cap.arena_qb, cap.arena_kvb,
                            cap.farena_qkv, cap.farena_o, cap.farena_qb, cap.farena_kvb};
            const int64_t wd[8] = {width[0], width[1], width[2], width[3], width[0], width[1], width[2], width[3]};
            void *base[8];
            size_t bytes[8];
            int64_t nb = 0;
            for (int i = 0; i < 8; i++)
                if (ar[i]) base[nb] = ar[i], bytes[nb++] = (size_t)(keep * Lmax * wd[i]) * sizeof(float);
            mq_touch_pages(base, bytes, nb);
        }
        /* pass A: the unquantized attention (nothing needed of it in a sequential replay); the
         * layer's last unless sequential */
        sc.ahead = !p->seq && experts_ahead_wanted(p, l, replay);
        if (!st) st = attention_pass(p, l, true, &cap, &sc);
        sc.ahead = false;
        if (dist) {
            char step[48];
            snprintf(step, sizeof step, "layer %d: attention inputs", l);
            st = mq_dist_agree(st, step);
            /* on the CPU every rank sums a band of each Hessian; a GPU sums them on the owner */
            moeq_status (*sum)(mq_pipe *, int, slot *, const float *, int64_t) =
                p->gpu ? gather_hessian : split_hessian;
            if (!st) st = sum(p, l, &sl[0], cap.arena_qkv, D);
            if (!st) st = sum(p, l, &sl[1], cap.arena_o, Q);
            if (!st && n_sl > 2) st = sum(p, l, &sl[2], cap.arena_qb, width[2]);
            if (!st && n_sl > 3) st = sum(p, l, &sl[3], cap.arena_kvb, width[3]);
            const float *qa[4] = {cap.arena_qkv, cap.arena_o, cap.arena_qb, cap.arena_kvb};
            for (int i = 0; i < n_sl && !st && p->target; i++) st = split_cross(p, l, &sl[i], *fa[i], qa[i], width[i]);
            for (int i = 0; i < n_sl && !st && p->o->act_quant; i++)
                st = mq_dist_max_f32(&sl[i].amax, step);
        }
        for (int i = 0; i < n_sl; i++) {
            sl[i].tokens = sl[i].h.n;
            moeq_status fs = slot_form_timed(p, l, &sl[i]);
            if (!st) st = fs;
        }
        if (!st && p->target) st = target_slots(p, l, sl, n_sl, NULL, 0);
        if (!st) st = quantize_slots(p, l, sl, n_sl, NULL);
        if (p->ranks > 1) {
            char step[48];
            snprintf(step, sizeof step, "layer %d: attention", l);
            st = mq_dist_agree(st, step);
            if (!st) st = share_slots(p, l, sl, n_sl);
        }
    } else if (!st && replay) {
        if (p->target) st = fp_attention_pass(p, l, &sc);   /* before the weights are read back */
        if (!st && p->seq) st = read_back_slots(p, sl, n_sl);
        else if (!st) st = attention_pass(p, l, true, NULL, &sc);
    }
    /* pass B: the quantized attention */
    if (!st && p->seq && sc.gpu) st = gpu_attention_set(p, l);
    sc.ahead = p->seq && experts_ahead_wanted(p, l, replay);
    if (!st && p->seq) st = attention_pass(p, l, false, NULL, &sc);
    if (p->ranks > 1 && !replay) {
        char step[48];
        snprintf(step, sizeof step, "layer %d: attention", l);
        st = mq_dist_agree(st, step);
        if (!st) st = share_ffn_inputs(p, l);
    }
    if (prof) {   /* the attention_block parts include the unquantized stream's samples */
        mq_state_profile(p->state, NULL);
        mq_info("layer %d attention stage %.2f s: inputs %.2f, attention norm %.2f, q/k/v %.2f, q/k norm and RoPE "
                "%.2f, scores %.2f, o_proj %.2f, residual %.2f, hooks %.2f, FFN norm and routing %.2f, outputs "
                "%.2f s (the rest: Hessians, GPTQ, other ranks)", l, mq_now() - t_stage, prof_pipe[0],
                prof_model[MQ_ATT_NORM], prof_model[MQ_ATT_QKV], prof_model[MQ_ATT_QK_ROPE],
                prof_model[MQ_ATT_SCORES], prof_model[MQ_ATT_O], prof_model[MQ_ATT_RESIDUAL],
                prof_model[MQ_ATT_HOOKS], prof_pipe[1], prof_pipe[2]);
    }
    for (int i = 0; i < n_sl; i++) slot_free(&sl[i]);
    mq_free(cap.arena_qkv);
    mq_free(cap.arena_o);
    mq_free(cap.arena_qb);
    mq_free(cap.arena_kvb);
    mq_free(cap.farena_qkv);
    mq_free(cap.farena_o);
    mq_free(cap.farena_qb);
    mq_free(cap.farena_kvb);
    mq_free(sc.xf);
    if (sc.pinned) {
        mq_gpu_host_free(sc.xt);
        mq_gpu_host_free(sc.xn);
    } else {
        mq_free(sc.xt);
        mq_free(sc.xn);
    }
    mq_free(sc.probs);
    /* the layer's input on the device has served both passes: the FFN's room */
    mq_gpu_buf_free(p->gin);
    p->gin = NULL;
    p->gin_ready = false;
    drop_part(p, l, MQ_PART_ATTN, 0, 0);
    mq_state_drop_layer(p->state, l);
    return st;
}

/* ---- the FFN stage: routed experts in chunks ------------------------------------------------- */

/* Where a step of the FFN stage takes its inputs: the kept FFN input (XN) or the FFN norm of the
 * boundary after attention, and which routing. */
typedef struct {
    bool from_xn;
    const int32_t *sel;
    const float *w;
    bool fp;                      /* the unquantized stream's (asymmetric calibration): the FFN
                                     norm of XF, its routing, the outputs into OUTF */
} ffn_source;

static ffn_source hessian_source(const mq_pipe *p) {
    if (p->seq && !p->tseq) return (ffn_source){true, p->sel_a, p->w_a, false};
    return (ffn_source){false, p->tseq ? p->sel_b : p->sel_a, p->tseq ? p->w_b : p->w_a, false};
}

static ffn_source output_source(const mq_pipe *p) {
    return (ffn_source){false, p->seq ? p->sel_b : p->sel_a, p->seq ? p->w_b : p->w_a, false};
}

static ffn_source fp_source(const mq_pipe *p) { return (ffn_source){false, p->sel_f, p->w_f, true}; }

/* A sample's FFN input: a view of XN, or the FFN norm of the boundary (XF's for the unquantized
 * stream) into scratch. */
static const float *ffn_input(mq_pipe *p, int l, const ffn_source *src, int64_t s, float *scratch) {
    const int64_t T = p->calib.len[s], D = p->c->D;
    if (src->from_xn) return mq_actbuf_view(&p->XN, (size_t)(s * p->LD), (size_t)(T * D), scratch);
    const float *h = mq_actbuf_view(src->fp ? &p->XF : out_buf(p), (size_t)(s * p->LD), (size_t)(T * D), scratch);
    mq_ffn_norm(p->m, l, h, T, scratch);   /* in place when h was converted into scratch */
    return scratch;
}

/* One band of rows of one expert's Hessian sum (or cross sum): expert << 34 | cross << 33 |
 * down << 32 | band, its cost. */
typedef struct {
    int64_t code, cost;
} hband;

/* A batch of samples whose rows for the chunk's experts are computed together: the rows are
 * laid out expert by expert (each expert's rows of every sample of the batch, sample after
 * sample, tokens in order), so each expert runs one call over all of them. Its products are
 * mq_gemm_det_nt's, whose values do not depend on how the rows are grouped: the same as the
 * model's forward gives running the samples one at a time. */
typedef struct ex_batch {
    mq_pipe *p;
    int l, e0, e1;
    int64_t s0, nb;
    ffn_source src;
    bool down, hess, amax;
    bool cross;                   /* asymmetric calibration: the cross sums beside the Hessians,
                                     from the unquantized stream's rows of the same tokens */
    mq_actbuf *out;               /* where the outputs are summed: OUT, or OUTF (src.fp) */
    slot *gu, *dn;                /* [E] */
    const float **xin;            /* [nb] */
    float *xin_buf;               /* [nb][LD] */
    const float **xinf;           /* cross: [nb] the unquantized stream's FFN inputs */
    float *xinf_buf;              /* cross: [nb][LD] */
    float *xgf, *hgf, *huf;       /* cross: [rows][D / F / F] its rows, gate/up of them */
    int32_t *cnt;                 /* [nb][C] rows of each expert in each sample */
    int64_t *pos;                 /* [nb][C] first row of (sample, expert) */
    int64_t *ebase;               /* [C + 1] first row of each expert */
    int32_t *tok, *tsample;       /* [rows] token and sample of each row */
    float *rw;                    /* [rows] expert weighting: each row's Hessian weight */
    int32_t *tok_row;             /* [nb][Lmax][K] row of (token, k), -1 outside the chunk */
    float *xg, *hg, *hu, *yg;     /* [rows][D / F / F / D] */
    int64_t *tasks, n_tasks;      /* expert << 32 | block of TASK_ROWS rows */
    mq_gpu_mlp *gmlp;             /* the chunk's experts on the GPU (runs with a device), or NULL */
    int32_t *grow;                /* [rows] GPU: each row's place in the batch's uploaded inputs */
    int64_t rows_cap;             /* the most rows any batch of the pass holds */
    int64_t *xrows, *xfirst;      /* [nb] GPU: the rows of each sample's uploaded input, its first */
    hband *htasks;                /* the CPU's Hessian bands (batch_hessian_bands) */
    int64_t n_htasks;
    int64_t *ctok;                /* [nb * Lmax] GPU combine: each token's output row, */
    int32_t *cfirst, *crow;       /* [nb * Lmax + 1] its first pair, [rows] the pairs' rows */
    float *cw;                    /* [rows] and weights, in the CPU combine's order */
    bool all_dev;                 /* GPU: as many samples in one batch as the device holds, the
                                     rows only there, the inputs up nb_in samples at a time */
    int64_t nb_in;                /* samples xin_buf holds */
    const struct ex_batch *pair;  /* the unquantized stream's outputs run beside a cross batch
                                     (batch_run_fp): that batch, whose rows of the same tokens and
                                     experts give their gate/up */
} ex_batch;

/* The FFN inputs of samples [g0, g0 + n) of the batch into xin_buf (which holds n): the whole
 * batch at once, or with all_dev nb_in samples at a time, each group then up to the device. */
typedef struct {
    ex_batch *b;
    int64_t g0;
} inputs_group;

static void group_inputs_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const inputs_group *g = ctx;
    ex_batch *b = g->b;
    b->xin[g->g0 + i] = ffn_input(b->p, b->l, &b->src, b->s0 + g->g0 + i, b->xin_buf + i * b->p->LD);
    if (b->cross) {
        const ffn_source fs = fp_source(b->p);
        b->xinf[g->g0 + i] = ffn_input(b->p, b->l, &fs, b->s0 + g->g0 + i, b->xinf_buf + i * b->p->LD);
    }
}

static moeq_status batch_inputs_device(ex_batch *b) {
    moeq_status st = mq_gpu_mlp_inputs_reserve(b->gmlp, b->xfirst[b->nb - 1] + b->xrows[b->nb - 1]);
    for (int64_t g0 = 0; g0 < b->nb && !st; g0 += b->nb_in) {
        const int64_t n = b->nb - g0 < b->nb_in ? b->nb - g0 : b->nb_in;
        inputs_group g = {b, g0};
        mq_parallel_for(n, group_inputs_task, &g);
        for (int64_t i = g0; i < g0 + n && !st; i++)
            st = mq_gpu_mlp_inputs_put(b->gmlp, b->xfirst[i], b->xin[i], b->xrows[i]);
    }
    return st;
}

/* A block of up to TASK_ROWS rows of one expert of the chunk (any cut gives the same values):
 * gathered, then gate, up, SwiGLU (and down). */
enum { TASK_ROWS = 256 };
static void batch_rows_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    mq_pipe *p = b->p;
    const int64_t D = p->c->D, F = p->c->moe_ffn;
    const mq_layer *ly = &p->m->layers[b->l];
    const int64_t ce = b->tasks[task] >> 32, blk = b->tasks[task] & 0xffffffff;
    const int64_t e = b->e0 + ce, r0 = b->ebase[ce] + blk * TASK_ROWS;
    const int64_t n = b->ebase[ce + 1] - r0 < TASK_ROWS ? b->ebase[ce + 1] - r0 : TASK_ROWS;
    for (int64_t r = r0; r < r0 + n; r++)
        memcpy(b->xg + r * D, b->xin[b->tsample[r]] + (int64_t)b->tok[r] * D, sizeof(float) * (size_t)D);
    (void)mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e], b->xg + r0 * D, n,
                         b->hg + r0 * F, b->hu + r0 * F, b->down ? b->yg + r0 * D : NULL);
    if (b->cross) {   /* the same tokens of the unquantized stream, its down input by gate/up */
        for (int64_t r = r0; r < r0 + n; r++)
            memcpy(b->xgf + r * D, b->xinf[b->tsample[r]] + (int64_t)b->tok[r] * D, sizeof(float) * (size_t)D);
        (void)mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], NULL, b->xgf + r0 * D, n, b->hgf + r0 * F,
                             b->huf + r0 * F, NULL);
    }
}

/* With the experts on the GPU: a block's rows gathered here, the MLP run there. */
static void batch_gather_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const int64_t D = b->p->c->D;
    const int64_t ce = b->tasks[task] >> 32, blk = b->tasks[task] & 0xffffffff;
    const int64_t r0 = b->ebase[ce] + blk * TASK_ROWS;
    const int64_t n = b->ebase[ce + 1] - r0 < TASK_ROWS ? b->ebase[ce + 1] - r0 : TASK_ROWS;
    for (int64_t r = r0; r < r0 + n; r++)
        memcpy(b->xg + r * D, b->xin[b->tsample[r]] + (int64_t)b->tok[r] * D, sizeof(float) * (size_t)D);
}

/* amax and the expert weighting of one expert's rows, before any Hessian update reads them (the
 * weighted rows are not read again) */
static void batch_prep_task(void *ctx, int64_t ce, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const int64_t D = b->p->c->D, F = b->p->c->moe_ffn;
    slot *gu = &b->gu[b->e0 + ce], *dn = &b->dn[b->e0 + ce];
    const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
    if (n == 0) return;
    if (b->amax) {
        amax_update(&gu->amax, b->xg + r0 * D, n * D);
        amax_update(&dn->amax, b->hg + r0 * F, n * F);
    }
    if (b->hess && b->p->o->expert_weighting) {
        if (gu->h.sum) mq_hessian_weight_rows(b->xg + r0 * D, n, D, b->rw + r0);
        if (dn->h.sum) mq_hessian_weight_rows(b->hg + r0 * F, n, F, b->rw + r0);
    }
}

/* One expert's Hessian updates and amax over the batch: its rows are the batch's samples in
 * order, so one update adds what one update per sample would (quant/hessian.h). */
static moeq_status batch_hessian_one(ex_batch *b, int64_t ce) {
    const int64_t D = b->p->c->D, F = b->p->c->moe_ffn;
    slot *gu = &b->gu[b->e0 + ce], *dn = &b->dn[b->e0 + ce];
    const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
    if (n == 0) return MOEQ_OK;
    batch_prep_task(b, ce, 0);
    moeq_status st = MOEQ_OK;
    if (b->hess && gu->h.sum) st = slot_add(gu, b->xg + r0 * D, n);
    if (b->hess && dn->h.sum && !st) st = slot_add(dn, b->hg + r0 * F, n);
    if (b->cross && !st) {
        slot_cross(gu, b->xgf + r0 * D, b->xg + r0 * D, n);
        slot_cross(dn, b->hgf + r0 * F, b->hg + r0 * F, n);
    }
    return st;
}

static void batch_hessian_task(void *ctx, int64_t ce, int thread) {
    (void)thread;
    (void)batch_hessian_one(ctx, ce);   /* the CPU's sums cannot fail */
}

/* The CPU's expert Hessians as bands of HBAND rows of every expert's sums, so a chunk of few (or
 * unevenly routed) experts still keeps every core busy: each element's sum is the same fmaf chain
 * over the expert's rows whichever band computes it (kernels/gemm_det.h). */
enum { HBAND = 96 };

static bool banded_hessians(const ex_batch *b) {
    for (int64_t ce = 0; ce < b->e1 - b->e0; ce++) {
        const slot *gu = &b->gu[b->e0 + ce], *dn = &b->dn[b->e0 + ce];
        if ((gu->h.sum && (gu->h.fit || gu->gh)) || (dn->h.sum && (dn->h.fit || dn->gh))) return false;
    }
    return true;
}

static void batch_band_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const int64_t code = b->htasks[t].code, ce = code >> 34, band = code & 0xffffffff;
    const bool down = (code >> 32) & 1, cross = (code >> 33) & 1;
    const int64_t K = down ? b->p->c->moe_ffn : b->p->c->D;
    const slot *s = down ? &b->dn[b->e0 + ce] : &b->gu[b->e0 + ce];
    const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
    const float *x = (down ? b->hg : b->xg) + r0 * K;
    const int64_t i0 = band * HBAND, i1 = i0 + HBAND < K ? i0 + HBAND : K;
    if (cross) mq_cross_det_acc(K, n, (down ? b->hgf : b->xgf) + r0 * K, K, x, K, s->G, K, i0, i1);
    else mq_syrk_det_acc(K, n, x, K, s->h.sum, K, i0, i1);
}

static int cmp_band(const void *a, const void *b) {
    const hband *x = a, *y = b;
    if (x->cost != y->cost) return x->cost > y->cost ? -1 : 1;
    return x->code < y->code ? -1 : x->code > y->code;
}

/* The bands of every routed expert's sums, the costliest (rows x width) first: the pool's
 * counter then hands out the long tasks before the short ones that fill the gaps. */
static void batch_hessian_bands(ex_batch *b) {
    const int64_t C = b->e1 - b->e0, D = b->p->c->D, F = b->p->c->moe_ffn;
    b->n_htasks = 0;
    for (int64_t ce = 0; ce < C && b->hess; ce++) {
        const int64_t n = b->ebase[ce + 1] - b->ebase[ce];
        if (n == 0) continue;
        for (int down = 0; down < 2; down++) {
            const int64_t K = down ? F : D;
            const slot *s = &(down ? b->dn : b->gu)[b->e0 + ce];
            if (!s->h.sum) continue;
            for (int64_t k = 0; k * HBAND < K; k++) {
                const int64_t i1 = (k + 1) * HBAND < K ? (k + 1) * HBAND : K;
                b->htasks[b->n_htasks++] = (hband){ce << 34 | (int64_t)down << 32 | k, n * i1};
                if (b->cross && s->G)   /* a band of the cross sum: every column */
                    b->htasks[b->n_htasks++] = (hband){ce << 34 | (int64_t)1 << 33 | (int64_t)down << 32 | k, n * K};
            }
        }
    }
    qsort(b->htasks, (size_t)b->n_htasks, sizeof *b->htasks, cmp_band);
    mq_parallel_for(C, batch_prep_task, b);
    mq_parallel_for(b->n_htasks, batch_band_task, b);
    for (int64_t ce = 0; ce < C; ce++) {
        const int64_t n = b->ebase[ce + 1] - b->ebase[ce];
        if (b->hess && b->gu[b->e0 + ce].h.sum) b->gu[b->e0 + ce].h.n += n;
        if (b->hess && b->dn[b->e0 + ce].h.sum) b->dn[b->e0 + ce].h.n += n;
        if (b->cross && b->gu[b->e0 + ce].G) b->gu[b->e0 + ce].g_rows += n;
        if (b->cross && b->dn[b->e0 + ce].G) b->dn[b->e0 + ce].g_rows += n;
    }
}

/* out[t] += w * y over the token's experts of the chunk, in increasing expert order. */
static void batch_combine_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    mq_pipe *p = b->p;
    const int64_t s = b->s0 + i, T = p->calib.len[s], K = p->c->top_k, D = p->c->D;
    const int32_t *sel = b->src.sel + s * p->calib.max_len * K;
    const float *w = b->src.w + s * p->calib.max_len * K;
    const int32_t *tr = b->tok_row + i * p->calib.max_len * K;
    float *out = mq_actbuf_ptr(b->out, (size_t)(s * p->LD));
    const mq_vec_kernels *vk = mq_vec();
    for (int64_t t = 0; t < T; t++) {
        int32_t order[64];
        int64_t kk = 0;
        for (int64_t k = 0; k < K && kk < 64; k++)
            if (tr[t * K + k] >= 0) order[kk++] = (int32_t)k;
        for (int64_t a = 1; a < kk; a++)   /* insertion sort by expert id */
            for (int64_t c = a; c > 0 && sel[t * K + order[c - 1]] > sel[t * K + order[c]]; c--) {
                int32_t tmp = order[c];
                order[c] = order[c - 1];
                order[c - 1] = tmp;
            }
        for (int64_t k = 0; k < kk; k++)
            vk->axpy(w[t * K + order[k]], b->yg + (int64_t)tr[t * K + order[k]] * D, out + t * D, D);
    }
}

static void batch_free(ex_batch *b) {
    free(b->xin);
    mq_free(b->xin_buf);
    free(b->xinf);
    mq_free(b->xinf_buf);
    mq_free(b->xgf);
    mq_free(b->hgf);
    mq_free(b->huf);
    free(b->cnt);
    free(b->pos);
    free(b->ebase);
    mq_free(b->tok);
    mq_free(b->tsample);
    mq_free(b->rw);
    mq_free(b->tok_row);
    mq_free(b->xg);
    mq_free(b->hg);
    mq_free(b->hu);
    mq_free(b->yg);
    mq_free(b->tasks);
    mq_free(b->grow);
    free(b->xrows);
    free(b->xfirst);
    mq_free(b->htasks);
    mq_free(b->ctok);
    mq_free(b->cfirst);
    mq_free(b->crow);
    mq_free(b->cw);
}

/* Buffers for batches of up to nb samples and `rows` expert rows of a chunk of C experts. */
/* host_rows false: the rows live on the device only (all_dev), so their host buffers are not
 * made; xin_buf holds nb_in samples. */
static moeq_status batch_alloc(ex_batch *b, const mq_pipe *p, int64_t nb, int64_t C, int64_t rows, int64_t nb_in,
                               bool host_rows, bool cross) {
    const mq_config *c = p->c;
    const int64_t Lmax = p->calib.max_len, K = c->top_k, D = c->D, F = c->moe_ffn;
    const int64_t hr = host_rows ? rows : 0;
    b->nb_in = nb_in;
    b->xin = calloc((size_t)nb, sizeof *b->xin);
    b->xin_buf = mq_alloc_array((size_t)(nb_in * p->LD), sizeof(float), "expert inputs");
    b->cnt = calloc((size_t)(nb * C), sizeof *b->cnt);
    b->pos = calloc((size_t)(nb * C), sizeof *b->pos);
    b->ebase = calloc((size_t)(C + 1), sizeof *b->ebase);
    b->tok = mq_alloc_array((size_t)rows + 1, sizeof(int32_t), "expert rows");
    b->tsample = mq_alloc_array((size_t)rows + 1, sizeof(int32_t), "expert rows");
    b->rw = mq_alloc_array((size_t)rows + 1, sizeof(float), "expert rows");
    b->tok_row = mq_alloc_array((size_t)(nb * Lmax * K), sizeof(int32_t), "expert rows");
    b->xg = mq_alloc_array((size_t)hr + 1, (size_t)D * sizeof(float), "expert inputs");
    b->hg = mq_alloc_array((size_t)hr + 1, (size_t)F * sizeof(float), "expert activations");
    b->hu = mq_alloc_array((size_t)hr + 1, (size_t)F * sizeof(float), "expert activations");
    b->yg = mq_alloc_array((size_t)hr + 1, (size_t)D * sizeof(float), "expert outputs");
    b->tasks = mq_alloc_array((size_t)(C + rows / 256 + 1), sizeof(int64_t), "expert tasks");
    b->grow = mq_alloc_array((size_t)rows + 1, sizeof(int32_t), "expert rows");
    b->xrows = calloc((size_t)nb, sizeof *b->xrows);
    b->xfirst = calloc((size_t)nb, sizeof *b->xfirst);
    b->htasks = mq_alloc_array((size_t)(2 * C * ((c->D + HBAND - 1) / HBAND + (F + HBAND - 1) / HBAND) + 1),
                               sizeof(hband), "expert Hessian bands");
    if (cross) {   /* asymmetric calibration: the unquantized stream's inputs and rows */
        b->xinf = calloc((size_t)nb, sizeof *b->xinf);
        b->xinf_buf = mq_alloc_array((size_t)(nb_in * p->LD), sizeof(float), "unquantized expert inputs");
        b->xgf = mq_alloc_array((size_t)hr + 1, (size_t)D * sizeof(float), "unquantized expert inputs");
        b->hgf = mq_alloc_array((size_t)hr + 1, (size_t)F * sizeof(float), "unquantized expert activations");
        b->huf = mq_alloc_array((size_t)hr + 1, (size_t)F * sizeof(float), "unquantized expert activations");
        if (!b->xinf || !b->xinf_buf || !b->xgf || !b->hgf || !b->huf) {
            batch_free(b);
            return mq_err(MOEQ_E_NOMEM, "out of memory for the expert batch scratch");
        }
    }
    if (p->gout) {
        b->ctok = mq_alloc_array((size_t)(nb * Lmax) + 1, sizeof(int64_t), "expert combine");
        b->cfirst = mq_alloc_array((size_t)(nb * Lmax) + 1, sizeof(int32_t), "expert combine");
        b->crow = mq_alloc_array((size_t)rows + 1, sizeof(int32_t), "expert combine");
        b->cw = mq_alloc_array((size_t)rows + 1, sizeof(float), "expert combine");
    }
    if (!b->htasks || !b->xin || !b->xin_buf || !b->cnt || !b->pos || !b->ebase || !b->tok || !b->tsample ||
        !b->rw || !b->tok_row || !b->xg || !b->hg || !b->hu || !b->yg || !b->tasks || !b->grow || !b->xrows ||
        !b->xfirst || (p->gout && (!b->ctok || !b->cfirst || !b->crow || !b->cw))) {
        batch_free(b);
        return mq_err(MOEQ_E_NOMEM, "out of memory for the expert batch scratch");
    }
    return MOEQ_OK;
}

/* The batch's token outputs combined on the GPU into p->gout (batch_combine_task's order and
 * arithmetic: each token's experts of the chunk by increasing id, one axpy each). */
static moeq_status batch_combine_device(ex_batch *b) {
    mq_pipe *p = b->p;
    const int64_t K = p->c->top_k, Lmax = p->calib.max_len;
    int64_t n_tok = 0, np = 0;
    for (int64_t i = 0; i < b->nb; i++) {
        const int64_t s = b->s0 + i, T = p->calib.len[s];
        const int32_t *sel = b->src.sel + s * Lmax * K;
        const float *w = b->src.w + s * Lmax * K;
        const int32_t *tr = b->tok_row + i * Lmax * K;
        for (int64_t t = 0; t < T; t++) {
            int32_t order[64];
            int64_t kk = 0;
            for (int64_t k = 0; k < K && kk < 64; k++)
                if (tr[t * K + k] >= 0) order[kk++] = (int32_t)k;
            if (!kk) continue;
            for (int64_t a = 1; a < kk; a++)   /* insertion sort by expert id */
                for (int64_t c = a; c > 0 && sel[t * K + order[c - 1]] > sel[t * K + order[c]]; c--) {
                    int32_t tmp = order[c];
                    order[c] = order[c - 1];
                    order[c - 1] = tmp;
                }
            b->ctok[n_tok] = s * Lmax + t;
            b->cfirst[n_tok++] = (int32_t)np;
            for (int64_t k = 0; k < kk; k++) {
                b->crow[np] = tr[t * K + order[k]];
                b->cw[np++] = w[t * K + order[k]];
            }
        }
    }
    b->cfirst[n_tok] = (int32_t)np;
    return mq_gpu_mlp_combine(b->gmlp, p->gout, b->ctok, b->cfirst, b->crow, b->cw, n_tok);
}

/* Runs samples [s0, s0 + nb) through experts [e0, e1): inputs, the rows of each expert (tokens
 * in order, as the forward groups them), gate/up (and down), then Hessians / amax / combine. */
/* MOEQ_PROFILE=1 with a GPU: the experts' batches' seconds by step, logged per layer
 * (routed_experts): FFN inputs, routing bookkeeping, inputs up, the experts on the device (to
 * their end), the combine. */
static double g_ex_prof[5];

/* The batch's routing bookkeeping, sample by sample on the pool (each sample writes only its own
 * counts, and rows from its own place in every expert's rows: the same layout in any order).
 * Counts: rows of each (sample, expert of the chunk). */
static void batch_count_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const mq_pipe *p = b->p;
    const int64_t C = b->e1 - b->e0, K = p->c->top_k, s = b->s0 + i;
    const int32_t *sel = b->src.sel + s * p->calib.max_len * K;
    int32_t *cnt = b->cnt + i * C;
    memset(cnt, 0, sizeof(int32_t) * (size_t)C);
    for (int64_t j = 0; j < p->calib.len[s] * K; j++)
        if (sel[j] >= b->e0 && sel[j] < b->e1) cnt[sel[j] - b->e0]++;
}

/* Each row's token, sample and Hessian weight, and each (token, k)'s row, from the sample's first
 * row of every expert (pos). */
static void batch_fill_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const mq_pipe *p = b->p;
    const int64_t C = b->e1 - b->e0, K = p->c->top_k, Lmax = p->calib.max_len;
    const int64_t s = b->s0 + i, T = p->calib.len[s];
    const int32_t *sel = b->src.sel + s * Lmax * K;
    const float *gw = b->src.w + s * Lmax * K;
    const int ew = p->o->expert_weighting;
    int32_t *tr = b->tok_row + i * Lmax * K;
    int64_t *next = b->pos + i * C;   /* advanced while filling, rebuilt below */
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = sel[t * K + k];
            if (e < b->e0 || e >= b->e1) {
                tr[t * K + k] = -1;
                continue;
            }
            int64_t r = next[e - b->e0]++;
            b->tok[r] = (int32_t)t;
            b->tsample[r] = (int32_t)i;
            b->rw[r] = ew == 2 ? gw[t * K + k] * gw[t * K + k] : gw[t * K + k];
            tr[t * K + k] = (int32_t)r;
        }
    for (int64_t e = 0; e < C; e++) next[e] -= b->cnt[i * C + e];
}

/* The batch's rows: expert by expert, each expert's rows of every sample in order (the counts,
 * each expert's first row, each row's token and sample), and the row blocks' tasks. */
static void batch_layout(ex_batch *b) {
    const int64_t C = b->e1 - b->e0;
    mq_parallel_for(b->nb, batch_count_task, b);
    b->ebase[0] = 0;
    for (int64_t e = 0; e < C; e++) {
        int64_t r = b->ebase[e];
        for (int64_t i = 0; i < b->nb; i++) {
            b->pos[i * C + e] = r;
            r += b->cnt[i * C + e];
        }
        b->ebase[e + 1] = r;
    }
    mq_parallel_for(b->nb, batch_fill_task, b);
    /* The blocks largest first: the pool hands tasks out in order, and each expert's last block
     * holds 1 to 255 rows, so in expert order a full block could start last while the other
     * threads idle (0.82 of 16 threads, simulated). Every block writes only its own rows: the
     * order changes no value. */
    b->n_tasks = 0;
    for (int64_t e = 0; e < C; e++)
        for (int64_t blk = 0; blk < (b->ebase[e + 1] - b->ebase[e]) / TASK_ROWS; blk++)
            b->tasks[b->n_tasks++] = e << 32 | blk;
    for (int64_t rest = TASK_ROWS - 1; rest > 0; rest--)
        for (int64_t e = 0; e < C; e++) {
            const int64_t rows = b->ebase[e + 1] - b->ebase[e];
            if (rows % TASK_ROWS == rest) b->tasks[b->n_tasks++] = e << 32 | rows / TASK_ROWS;
        }
}

/* A block of the unquantized stream's output rows (batch_run_fp): a row whose token the paired
 * cross batch routed to the same expert takes that batch's SwiGLU of gate/up (the same
 * deterministic products of the same input: the same bits); the others are gathered and run
 * through gate/up here; then down over the block, as batch_rows_task computes every row. */
static void batch_rows_fp_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    ex_batch *b = ctx;
    const ex_batch *q = b->pair;
    mq_pipe *p = b->p;
    const int64_t D = p->c->D, F = p->c->moe_ffn, K = p->c->top_k, Lmax = p->calib.max_len;
    const mq_layer *ly = &p->m->layers[b->l];
    const int64_t ce = b->tasks[task] >> 32, blk = b->tasks[task] & 0xffffffff;
    const int32_t e = (int32_t)(b->e0 + ce);
    const int64_t r0 = b->ebase[ce] + blk * TASK_ROWS;
    const int64_t n = b->ebase[ce + 1] - r0 < TASK_ROWS ? b->ebase[ce + 1] - r0 : TASK_ROWS;
    int32_t *from = b->grow + r0;   /* each row's row in q, or -1 */
    int64_t m = 0;                  /* rows to compute, gathered at the block's start */
    for (int64_t r = r0; r < r0 + n; r++) {
        const int64_t i = b->tsample[r], t = b->tok[r];
        const int32_t *qsel = q->src.sel + (b->s0 + i) * Lmax * K + t * K;
        const int32_t *qrow = q->tok_row + i * Lmax * K + t * K;
        int32_t at = -1;
        for (int64_t k = 0; k < K && at < 0; k++)
            if (qsel[k] == e) at = qrow[k];
        from[r - r0] = at;
        if (at < 0)
            memcpy(b->xg + (r0 + m++) * D, b->xin[i] + t * D, sizeof(float) * (size_t)D);
    }
    if (m) (void)mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], NULL, b->xg + r0 * D, m, b->hg + r0 * F,
                                b->hu + r0 * F, NULL);
    /* computed rows to their places (last first: a row's place is at or after its gathered one),
     * then the paired batch's */
    for (int64_t j = n - 1, c = m - 1; j >= 0; j--)
        if (from[j] < 0) {
            if (c != j) memcpy(b->hg + (r0 + j) * F, b->hg + (r0 + c) * F, sizeof(float) * (size_t)F);
            c--;
        }
    for (int64_t j = 0; j < n; j++)
        if (from[j] >= 0) memcpy(b->hg + (r0 + j) * F, q->hgf + (int64_t)from[j] * F, sizeof(float) * (size_t)F);
    (void)mq_linear_forward(&ly->exp_down[e], b->hg + r0 * F, n, b->yg + r0 * D);
}

/* The unquantized stream's expert outputs for the samples of the cross batch q, into OUTF: the
 * separate pass (experts_pass with fp_source) computed gate/up of every row again; here the rows
 * q has computed for the same (token, expert) are reused. Same rows, products and combine: the
 * same bits (tests/test_pipeline.c against the reference loop). */
static void batch_run_fp(ex_batch *b, const ex_batch *q) {
    mq_pipe *p = b->p;
    double t0 = mq_now(), c0 = mq_cpu_now();
    b->s0 = q->s0;
    b->nb = q->nb;
    b->pair = q;
    for (int64_t i = 0; i < b->nb; i++) b->xin[i] = q->xinf[i];   /* XF's FFN inputs, made by q */
    batch_layout(b);
    mq_parallel_for(b->n_tasks, batch_rows_fp_task, b);
    mq_parallel_for(b->nb, batch_combine_task, b);
    p->layers[b->l].forward += mq_now() - t0;
    p->layers[b->l].cpu_forward += mq_cpu_now() - c0;
}

static moeq_status batch_run(ex_batch *b, mq_pipe *p, int l) {
    const int64_t C = b->e1 - b->e0, Lmax = p->calib.max_len;
    double t0 = mq_now(), c0 = mq_cpu_now();
    /* On the GPU the rows stay there, their Hessians summed on the device, unless the CPU must see
     * them (amax, weighted rows): only the samples' FFN inputs and the rows' indices go up, or
     * only the indices where the inputs are there already (din, gpu_ffn_inputs_new). */
    const bool dev_rows = b->gmlp && !b->amax && !(b->hess && p->o->expert_weighting);
    mq_gpu_buf *din = !dev_rows ? NULL : b->src.from_xn ? p->gffn_xn : p->gffn_h;
    if (!b->all_dev && !din) {   /* all_dev: below, in groups */
        inputs_group g = {b, 0};
        mq_parallel_for(b->nb, group_inputs_task, &g);
    }
    double tp = mq_now();
    g_ex_prof[0] += tp - t0;
    batch_layout(b);
    moeq_status st = MOEQ_OK;
    p->layers[l].gpu_device_batches += dev_rows;
    p->layers[l].gpu_kept_inputs += din != NULL;
    if (dev_rows) {   /* the same values as batch_rows_task's (backend/gpu.h) */
        const int64_t D = p->c->D;
        int64_t at = 0;
        for (int64_t i = 0; i < b->nb; i++) {
            b->xrows[i] = p->calib.len[b->s0 + i];
            b->xfirst[i] = din ? (b->s0 + i) * Lmax : at;
            at += b->xrows[i];
        }
        for (int64_t r = 0; r < b->ebase[C]; r++) b->grow[r] = (int32_t)(b->xfirst[b->tsample[r]] + b->tok[r]);
        double tq = mq_now();
        g_ex_prof[1] += tq - tp;
        if (din) st = mq_gpu_mlp_inputs_from(b->gmlp, din, p->calib.n * Lmax);
        else st = b->all_dev ? batch_inputs_device(b) : mq_gpu_mlp_inputs(b->gmlp, b->xin, b->xrows, b->nb);
        /* room for the pass's largest batch at once: a larger one later would wait for the device */
        if (!st && b->all_dev && b->down && p->gout) st = mq_gpu_mlp_reserve_kept(b->gmlp, b->rows_cap);
        /* the whole batch's row indices up at once, unless the outputs come back to the host */
        const bool indexed = !b->down || p->gout;
        if (!st && indexed) st = mq_gpu_mlp_rows_index(b->gmlp, b->grow, b->ebase[C]);
        tp = mq_now();
        g_ex_prof[2] += tp - tq;
        for (int64_t ce = 0; ce < C && !st; ce++) {
            slot *gu = &b->gu[b->e0 + ce], *dn = &b->dn[b->e0 + ce];
            const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
            mq_gpu_hessians *hin = b->hess && gu->h.sum ? gu->gh : NULL, *hdn = b->hess && dn->h.sum ? dn->gh : NULL;
            if (indexed)   /* down: the outputs stay there for the combine */
                st = mq_gpu_mlp_run_indexed(b->gmlp, ce, r0, n, b->down, hin, hdn);
            else
                st = mq_gpu_mlp_run_rows(b->gmlp, ce, b->grow + r0, n, NULL, NULL, b->down ? b->yg + r0 * D : NULL,
                                         hin, hdn);
            if (hin) gu->h.n += n;
            if (hdn) dn->h.n += n;
        }
        if (!st) st = mq_gpu_mlp_join(b->gmlp);   /* the experts ran on several streams */
        if (getenv("MOEQ_PROFILE") && !st) st = mq_gpu_sync(p->gpu);
        tq = mq_now();
        g_ex_prof[3] += tq - tp;
        if (!st && b->down && p->gout) st = batch_combine_device(b);
        g_ex_prof[4] += mq_now() - tq;
        if (st) return st;
    } else if (b->gmlp) {
        const int64_t D = p->c->D, F = p->c->moe_ffn;
        mq_parallel_for(b->n_tasks, batch_gather_task, b);
        for (int64_t ce = 0; ce < C && !st; ce++) {
            const int64_t r0 = b->ebase[ce], n = b->ebase[ce + 1] - r0;
            st = mq_gpu_mlp_run(b->gmlp, ce, b->xg + r0 * D, n, b->hg + r0 * F, NULL,
                                b->down ? b->yg + r0 * D : NULL, NULL, NULL);
        }
        if (st) return st;
    } else {
        mq_parallel_for(b->n_tasks, batch_rows_task, b);
    }
    double t1 = mq_now(), c1 = mq_cpu_now();
    if (dev_rows)
        ;   /* summed on the device already */
    else if ((b->hess || b->amax) && p->gpu)   /* the GPU's sums in turn, each on the device */
        for (int64_t ce = 0; ce < C && !st; ce++) st = batch_hessian_one(b, ce);
    else if ((b->hess || b->amax) && banded_hessians(b))
        batch_hessian_bands(b);
    else if (b->hess || b->amax)
        mq_parallel_for(C, batch_hessian_task, b);
    if (st) return st;
    double t2 = mq_now(), c2 = mq_cpu_now();
    if (b->down && p->gout && !dev_rows)   /* routed_experts keeps gout to runs that allow it */
        return mq_err(MOEQ_E_UNSUPPORTED, "layer %d: experts' outputs on the GPU but not their rows", l);
    if (b->down && !p->gout) mq_parallel_for(b->nb, batch_combine_task, b);
    double t3 = mq_now(), c3 = mq_cpu_now();
    p->layers[l].forward += (t1 - t0) + (t3 - t2);
    p->layers[l].cpu_forward += (c1 - c0) + (c3 - c2);
    p->layers[l].hessian += t2 - t1;
    p->layers[l].cpu_hessian += c2 - c1;
    return MOEQ_OK;
}

/* Rows of sample s for experts [e0, e1). */
static int64_t sample_rows(const mq_pipe *p, const ffn_source *src, int64_t s, int e0, int e1) {
    const int64_t K = p->c->top_k;
    const int32_t *sel = src->sel + s * p->calib.max_len * K;
    int64_t n = 0;
    for (int64_t j = 0; j < p->calib.len[s] * K; j++) n += sel[j] >= e0 && sel[j] < e1;
    return n;
}

/* The chunk's experts on the GPU when they are plain deterministic fp32 Linears (the weights as
 * they are now: unquantized, or dequantized for the quantized output); else *out stays NULL and
 * the CPU runs them. read: their weights must be in memory (false: whether they will be plain
 * once read, as routed_experts asks before reading them). */
static bool experts_plain_as(const mq_pipe *p, int l, int e0, int e1, bool read) {
    const mq_layer *ly = &p->m->layers[l];
    bool plain = true;
    for (int e = e0; e < e1; e++) {
        const mq_linear *lin[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
        for (int k = 0; k < 3; k++) plain &= (lin[k]->w || !read) && lin[k]->det && !lin[k]->qw && !lin[k]->bias;
    }
    return plain;
}
static bool experts_plain(const mq_pipe *p, int l, int e0, int e1) { return experts_plain_as(p, l, e0, e1, true); }

static moeq_status gpu_experts(mq_pipe *p, int l, int e0, int e1, bool down, int64_t rows, mq_gpu_mlp **out) {
    *out = NULL;
    if (p->gx && p->gx_e0 == e0 && p->gx_e1 == e1) {   /* the chunk's, on the device already */
        *out = p->gx;
        return MOEQ_OK;
    }
    const mq_layer *ly = &p->m->layers[l];
    const int n = e1 - e0;
    const float **w = calloc((size_t)(3 * n), sizeof *w);
    if (!w) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int e = e0; e < e1; e++) {
        const mq_linear *lin[3] = {&ly->exp_gate[e], &ly->exp_up[e], &ly->exp_down[e]};
        for (int k = 0; k < 3; k++) w[k * n + (e - e0)] = lin[k]->w;
    }
    const bool plain = experts_plain(p, l, e0, e1);
    moeq_status st = MOEQ_OK;
    if (plain)
        st = mq_gpu_mlp_new(p->gpu, n, p->c->D, p->c->moe_ffn, w, w + n, down ? w + 2 * n : NULL, rows, out);
    free(w);
    return st;
}

/* The GPU's expert batches: how many rows (token, expert) pairs one batch may hold on the device,
 * a third of its free memory at 2 D floats per row, 4 when down runs (its kept output, and
 * the tokens' inputs, fewer than the rows), at most GPU_BATCH_MAX_ROWS for the host's per-row
 * bookkeeping (24 bytes a row: 100 MB). MOEQ_GPU_BATCH_ROWS=N sets it (the tests' small batches).
 * Unless MOEQ_GPU_BATCH=plan (experts_pass). */
enum { GPU_BATCH_MAX_ROWS = 1 << 22, GPU_DEVICE_BATCHES_DEFAULT = 1 };
#define GPU_BATCH_HOST_ROUTES ((int64_t)1 << 23)

static int64_t gpu_batch_rows(const mq_pipe *p, bool down) {
    const char *env = getenv("MOEQ_GPU_BATCH_ROWS");
    if (env && atoll(env) > 0) return atoll(env);
    mq_gpu_info gi;
    mq_gpu_get_info(p->gpu, &gi);
    const int64_t per_row = (int64_t)sizeof(float) * p->c->D * (down ? 2 : 1) * 2;
    int64_t rows = gi.mem_free / 3 / per_row;
    if (rows > GPU_BATCH_MAX_ROWS) rows = GPU_BATCH_MAX_ROWS;
    return rows > 1 ? rows : 1;
}

/* Every sample through experts [e0, e1), in batches of as many samples as the plan's rows hold
 * (enough rows for every thread; which samples go together does not change any value) or, on the
 * GPU, as the device holds. own: only this rank's samples (outputs with several ranks), else all
 * of them. */
/* fp_done (asked for, else NULL): a cross pass on the CPU gives the unquantized stream's outputs
 * of the same samples too, batch by batch (batch_run_fp), and says so in *fp_done; else they
 * need their own pass with fp_source. */
static moeq_status experts_pass(mq_pipe *p, int l, int e0, int e1, ffn_source src, bool down,
                                bool hess, bool amax, slot *gu, slot *dn, bool own, bool *fp_done) {
    const int64_t s_lo = own ? p->s_lo : 0, s_hi = own ? p->s_hi : p->calib.n;
    if (s_hi <= s_lo) return MOEQ_OK;
    int64_t nb = p->mp.batch > 0 ? p->mp.batch : 1;
    if (nb > s_hi - s_lo) nb = s_hi - s_lo;
    const int64_t plan_rows = mq_plan_batch_rows(p, e1 - e0);
    int64_t rows_cap = plan_rows, nb_in = nb;
    /* On the GPU (unless MOEQ_GPU_BATCH=plan) every expert's GEMMs take as many rows as the device
     * holds (all the samples' on OLMoE-1B-7B at 128 x 2048 tokens) instead of the CPU threads'
     * batches (about 1,000 rows an expert there, which leaves the GPU's GEMMs small): possible
     * where the rows stay on the device (batch_run's dev_rows) and the outputs are combined there.
     * Measured faster on the H200 (OLMoE-1B-7B, 128 x 2048: 214 s against 235 s extrapolated)
     * and byte-identical (test_gpu_pipeline compares both, killed and resumed too), so the
     * default; MOEQ_GPU_BATCH=plan takes the CPU plan's batches. */
    const char *gb = getenv("MOEQ_GPU_BATCH");
    const bool dev_batches = gb ? strcmp(gb, "plan") != 0 : GPU_DEVICE_BATCHES_DEFAULT;
    /* the experts on the device: plain ones go up for this pass, quantized ones are there already
     * (p->gx: GPTQ left their dequantized weights there for the output pass) */
    const bool on_dev = experts_plain(p, l, e0, e1) || (p->gx && p->gx_e0 == e0 && p->gx_e1 == e1);
    /* the rows stay on the device (batch_run's dev_rows), else the batches take their inputs from
     * the host, which then needs XN's host copy */
    const bool dev_rows = p->gpu && on_dev && !amax && !(hess && p->o->expert_weighting);
    const bool all_dev = dev_rows && dev_batches && (!down || p->gout);
    if (src.from_xn && !dev_rows) {
        moeq_status xs = xn_to_host(p, l);
        if (xs) return xs;
    }
    if (all_dev) {
        int64_t worst = 1, total = 0;
        for (int64_t s = s_lo; s < s_hi; s++) {
            const int64_t r = sample_rows(p, &src, s, e0, e1);
            total += r;
            if (r > worst) worst = r;
        }
        rows_cap = gpu_batch_rows(p, down);
        if (rows_cap < worst) rows_cap = worst;   /* one sample always fits */
        if (rows_cap > total) rows_cap = total > 0 ? total : 1;
        /* the host's per-sample bookkeeping (tok_row and the combine's, about 16 bytes per
         * token and route) stays under GPU_BATCH_HOST_ROUTES */
        const int64_t per_sample = p->calib.max_len * p->c->top_k;
        int64_t nb_cap = GPU_BATCH_HOST_ROUTES / (per_sample > 0 ? per_sample : 1);
        if (nb_cap < nb) nb_cap = nb;
        nb = s_hi - s_lo < nb_cap ? s_hi - s_lo : nb_cap;
    }
    ex_batch b, bf;
    memset(&b, 0, sizeof b);
    memset(&bf, 0, sizeof bf);
    const bool cross = hess && p->target;
    const bool with_fp = fp_done && cross && !all_dev && !p->gpu;
    if (fp_done) *fp_done = with_fp;
    moeq_status st = batch_alloc(&b, p, nb, e1 - e0, rows_cap, nb_in, !all_dev, cross);
    if (st) return st;
    const ffn_source fsrc = fp_source(p);
    if (with_fp) {
        if ((st = batch_alloc(&bf, p, nb, e1 - e0, rows_cap, 1, true, false))) {
            batch_free(&b);
            return st;
        }
        bf.p = p;
        bf.l = l;
        bf.e0 = e0;
        bf.e1 = e1;
        bf.src = fsrc;
        bf.down = true;
        bf.out = &p->OUTF;
        bf.gu = gu;
        bf.dn = dn;
    }
    b.all_dev = all_dev;
    b.rows_cap = rows_cap;
    b.p = p;
    b.l = l;
    b.e0 = e0;
    b.e1 = e1;
    b.src = src;
    b.down = down;
    b.hess = hess;
    b.amax = amax;
    b.cross = cross;
    b.out = src.fp ? &p->OUTF : &p->OUT;
    b.gu = gu;
    b.dn = dn;
    if (p->gpu && (st = gpu_experts(p, l, e0, e1, down, plan_rows, &b.gmlp))) {
        batch_free(&b);
        return st;
    }
    for (int64_t s0 = s_lo; s0 < s_hi && !st; s0 += b.nb) {
        if ((st = check_interrupt())) break;
        int64_t rows = sample_rows(p, &src, s0, e0, e1);
        b.s0 = s0;
        b.nb = 1;   /* one sample always fits: rows_cap holds a sample's worst case */
        int64_t rows_f = with_fp ? sample_rows(p, &fsrc, s0, e0, e1) : 0;
        while (b.nb < nb && s0 + b.nb < s_hi) {
            int64_t r = sample_rows(p, &src, s0 + b.nb, e0, e1);
            int64_t rf = with_fp ? sample_rows(p, &fsrc, s0 + b.nb, e0, e1) : 0;
            if (rows + r > rows_cap || rows_f + rf > rows_cap) break;
            rows += r;
            rows_f += rf;
            b.nb++;
        }
        st = batch_run(&b, p, l);
        if (!st && with_fp) batch_run_fp(&bf, &b);
    }
    if (b.gmlp != p->gx) mq_gpu_mlp_free(b.gmlp);
    batch_free(&b);
    if (with_fp) batch_free(&bf);
    return st;
}

/* The block Hessian of the fallback: every token's FFN input, one update per sample. */
static moeq_status block_hessian(mq_pipe *p, int l, float **out) {
    ffn_source src = hessian_source(p);
    mq_hessian h;
    moeq_status st = mq_hessian_init(&h, p->c->D, "the MoE block's Hessian");
    float *scratch = mq_alloc_array((size_t)p->LD, sizeof(float), "FFN input");
    if (!st && !scratch) st = MOEQ_E_NOMEM;
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (int64_t s = 0; s < p->calib.n && !st; s++) {
        if ((st = check_interrupt())) break;
        mq_hessian_add(&h, ffn_input(p, l, &src, s, scratch), p->calib.len[s]);
    }
    p->layers[l].hessian += mq_now() - t0;
    p->layers[l].cpu_hessian += mq_cpu_now() - c0;
    mq_free(scratch);
    if (st) {
        mq_hessian_free(&h);
        return st;
    }
    mq_hessian_get(&h, h.sum);
    *out = h.sum;
    return MOEQ_OK;
}

/* Hessian of expert e's down input had every token been routed to it: its gate/up on the first
 * FALLBACK_TOKENS tokens, whole samples (each product over the whole pool). */
static moeq_status fallback_down_one(mq_pipe *p, int l, int e, slot *dn, float *g, float *u,
                                     float *scratch) {
    const mq_layer *ly = &p->m->layers[l];
    const int64_t F = ly->exp_gate[e].out;
    ffn_source src = hessian_source(p);
    moeq_status st = mq_hessian_init(&dn->h, F, "fallback down Hessian");
    for (int64_t s = 0, used = 0; s < p->calib.n && used < FALLBACK_TOKENS && !st; s++) {
        const int64_t T = p->calib.len[s];
        used += T;
        const float *x = ffn_input(p, l, &src, s, scratch);
        st = mq_mlp_forward(&ly->exp_gate[e], &ly->exp_up[e], NULL, x, T, g, u, NULL);
        if (!st) mq_hessian_add(&dn->h, g, T);
    }
    if (!st) st = slot_form(p, dn);
    return st;
}

static moeq_status fallback_down(mq_pipe *p, int l, slot *dn, int e0, int e1) {
    const int64_t Lmax = p->calib.max_len, F = p->c->moe_ffn;
    float *g = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "fallback activations");
    float *u = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "fallback activations");
    float *scratch = mq_alloc_array((size_t)p->LD, sizeof(float), "FFN input");
    moeq_status st = g && u && scratch ? MOEQ_OK : MOEQ_E_NOMEM;
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (int e = e0; e < e1 && !st; e++)
        if (dn[e].nw && dn[e].how == MQ_HOW_GPTQ_BLOCK_HESSIAN) st = fallback_down_one(p, l, e, &dn[e], g, u, scratch);
    p->layers[l].hessian += mq_now() - t0;
    p->layers[l].cpu_hessian += mq_cpu_now() - c0;
    mq_free(g);
    mq_free(u);
    mq_free(scratch);
    return st;
}

/* W4A4: experts that saw no calibration token take the layer's largest expert amax at the same
 * site (gate/up input, down input), as engines that keep one activation scale per layer do. */
static moeq_status unseen_expert_scales(mq_pipe *p, const slot *gu, const slot *dn, int E) {
    for (int site = 0; site < 2; site++) {
        const slot *v = site == 0 ? gu : dn;
        float mx = 0;
        for (int e = 0; e < E; e++) mx = fmaxf(mx, v[e].amax);
        if (!(mx > 0)) continue;
        for (int e = 0; e < E; e++) {
            if (v[e].amax > 0) continue;
            for (int k = 0; k < v[e].nw; k++) {
                moeq_status st = mq_ckpt_writer_put_input_scale(p->w, v[e].w[k]->name, mx);
                if (st) return st;
            }
        }
    }
    return MOEQ_OK;
}

/* mq_lazy_load_ex's test: a weight of a Linear that one of n gate/up and down slots quantizes. */
typedef struct {
    const slot *gu, *dn;
    int n;
} quantized_in;

static bool is_quantized_in(float **dest, void *user) {
    const quantized_in *q = user;
    for (int i = 0; i < q->n; i++)
        for (int k = 0; k < 3; k++)
            if ((k < q->gu[i].nw && dest == &q->gu[i].w[k]->w) || (k < q->dn[i].nw && dest == &q->dn[i].w[k]->w))
                return true;
    return false;
}

/* An expert's work on its rank, in FLOPs: its calibration grows with its routed tokens (part 0:
 * gate/up and down in every pass, the Hessian updates) and its GPTQ does not (part 1: the
 * factorisations, the column loops and each refinement pass, counted twice: GPTQ runs at about
 * half the GEMMs' FLOP rate, rank 0's stages on OLMoE-1B-7B shapes). */
static void expert_flops(const mq_pipe *p, int64_t tokens, double part[2]) {
    const double D = p->c->D, F = p->c->moe_ffn;
    const mq_pipeline_opts *o = p->o;
    const double per_token = 2 * F * D * (p->seq ? 5 : 3) + (o->gptq ? D * D + F * F : 0);
    const double loop = 4 * F * D * D + 2 * D * F * F;   /* gate/up and down column loops */
    part[0] = (double)tokens * per_token;
    part[1] = o->gptq ? 2 * ((loop + D * D * D + F * F * F) * (o->spec.mse ? 1.3 : 1.0) * (1 + o->n_damp_sweep) +
                             loop * o->g.refine_passes)
                      : 0;
}

/* Each expert's work for the ranks' shares (mq_dist_share_weighted), in MFLOP: expert_flops, the
 * GPTQ part weighted by share_gptq. With the old constant (tokens plus half the mean) the ranks
 * with many lightly routed experts got the most GPTQ and the others waited for them. No token
 * counts (a resumed layer's replay): equal shares. The same on every rank: every rank has every
 * token's routing. */
static void expert_costs(const mq_pipe *p, const int64_t *tokens, int E, int64_t *cost) {
    int64_t total = 0;
    for (int e = 0; e < E; e++) total += tokens[e];
    for (int e = 0; e < E; e++) {
        double f[2];
        expert_flops(p, tokens[e], f);
        cost[e] = total > 0 ? (int64_t)((f[0] + f[1] * p->share_gptq) * 1e-6) + 1 : 0;
    }
}

/* Several ranks, MOEQ_DIST_SHARES=measured (p->fit_shares; an experiment, the default shares by
 * FLOPs): the
 * weight of GPTQ in the next layer's shares from this layer's seconds. The FLOPs may say too
 * little about a rank's time (GPTQ's column loops run far from the products' rate, by how much
 * depends on the machine): a rank r that spent w[r] seconds on its experts' calibration and GPTQ,
 * x[r] and g[r] FLOPs of each, gives w[r] = a x[r] + b g[r]; a, b by least squares over the
 * ranks, and GPTQ's weight becomes (b / a) against the FLOPs' 1, damped (the geometric mean with
 * the weight before) and kept within [1/8, 8]. Every rank fits the same numbers in the same
 * order, so they agree on the shares; the shares change the speed only (the checkpoint is the
 * same for any split). On this project's 2-core VM (a 1024-wide, 16-expert OLMoE, 48 x 256
 * tokens, 2 ranks of 1 thread, two runs each) it did not help: 13.84 and 14.58 s a layer against
 * 13.37 and 13.58 s with the FLOPs' shares, the ranks waiting 0.1-0.5 s either way; where ranks
 * wait seconds at the experts' hand-over (4 ranks on the GPU machine) it is yet to be measured. */
static void fit_shares(mq_pipe *p, const double *w, const double *x, const double *g) {
    double xx = 0, xg = 0, gg = 0, xw = 0, gw = 0;
    for (int r = 0; r < p->ranks; r++) {
        xx += x[r] * x[r], xg += x[r] * g[r], gg += g[r] * g[r];
        xw += x[r] * w[r], gw += g[r] * w[r];
    }
    const double det = xx * gg - xg * xg;
    if (!(det > 1e-9 * xx * gg)) return;   /* the ranks' mixes too alike to tell the parts apart */
    const double a = (gg * xw - xg * gw) / det, b = (xx * gw - xg * xw) / det;
    if (!(a > 0 && b > 0)) return;
    double ratio = sqrt(p->share_gptq * (b / a));
    ratio = ratio < 0.125 ? 0.125 : ratio > 8 ? 8 : ratio;
    if (getenv("MOEQ_DIST_PROFILE") && p->rank == 0)
        mq_info("experts' shares: GPTQ weighted %.3g x its FLOPs (fit %.3g)", ratio, b / a);
    p->share_gptq = ratio;
}

static moeq_status routed_experts(mq_pipe *p, int l, bool replay) {
    const mq_config *c = p->c;
    const int E = c->n_experts, K = c->top_k;
    const mq_pipeline_opts *o = p->o;
    mq_layer *ly = &p->m->layers[l];
    slot *gu = calloc((size_t)E, sizeof *gu), *dn = calloc((size_t)E, sizeof *dn);
    int64_t *tokens = calloc((size_t)E, sizeof *tokens);
    if (!gu || !dn || !tokens) {
        free(gu);
        free(dn);
        free(tokens);
        return mq_err(MOEQ_E_NOMEM, "out of memory for %d experts", E);
    }
    ffn_source hs = hessian_source(p);
    int64_t *fit = calloc((size_t)E, sizeof *fit);   /* ... before the held-out samples */
    for (int64_t s = 0; s < p->calib.n && !replay; s++) {   /* routed tokens of each expert */
        const int32_t *sel = hs.sel + s * p->calib.max_len * K;
        for (int64_t j = 0; j < p->calib.len[s] * K; j++) tokens[sel[j]]++;
        if (s + 1 == hold_sample(p->calib.n) && fit) memcpy(fit, tokens, (size_t)E * sizeof *fit);
    }
    /* several ranks: each calibrates and quantizes its share of the experts over every token,
     * then every rank runs every quantized expert on its share of the samples */
    const bool dist = p->ranks > 1;
    int64_t own_lo = 0, own_hi = E;
    int64_t *cost = calloc((size_t)E, sizeof *cost);
    if (!cost) {
        free(gu), free(dn), free(tokens), free(fit);
        return mq_err(MOEQ_E_NOMEM, "out of memory for %d experts", E);
    }
    expert_costs(p, tokens, E, cost);
    if (dist) mq_dist_share_weighted(cost, E, p->rank, p->ranks, &own_lo, &own_hi);
    /* each rank's FLOPs by part, for fit_shares */
    const bool measure = dist && p->fit_shares && p->calibrate && !replay && o->gptq;
    double *rank_x = measure ? calloc((size_t)(2 * p->ranks), sizeof *rank_x) : NULL;
    double *rank_g = rank_x ? rank_x + p->ranks : NULL;
    for (int r = 0; rank_x && r < p->ranks; r++) {
        int64_t lo, hi;
        mq_dist_share_weighted(cost, E, r, p->ranks, &lo, &hi);
        for (int64_t e = lo; e < hi; e++) {
            double f[2];
            expert_flops(p, tokens[e], f);
            rank_x[r] += f[0], rank_g[r] += f[1];
        }
    }
    const double t_work = mq_now();
    bool need_block = false;
    for (int e = 0; e < E; e++) {
        slot_set(p, &gu[e], e, false, &ly->exp_gate[e], &ly->exp_up[e], NULL);
        slot_set(p, &dn[e], e, true, &ly->exp_down[e], NULL, NULL);
        for (int r = 0; dist && r < p->ranks; r++) {
            int64_t lo, hi;
            mq_dist_share_weighted(cost, E, r, p->ranks, &lo, &hi);
            if (e >= lo && e < hi) slot_own(&gu[e], r), slot_own(&dn[e], r);
        }
        gu[e].tokens = dn[e].tokens = tokens[e];
        gu[e].hold = dn[e].hold = fit ? fit[e] : 0;
        if (o->gptq && tokens[e] < o->min_expert_tokens) {
            mq_how h = o->fallback_rtn ? MQ_HOW_RTN : MQ_HOW_GPTQ_BLOCK_HESSIAN;
            gu[e].how = dn[e].how = h;
            need_block |= h == MQ_HOW_GPTQ_BLOCK_HESSIAN && gu[e].nw > 0 && mine(p, &gu[e]);
        }
    }
    free(tokens);
    free(cost);
    moeq_status st = fit && (!measure || rank_x) ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory for %d experts", E);
    free(fit);
    float *block_H = NULL;
    if (!st && need_block && !replay) {   /* the fallback's inputs, on the host */
        st = xn_to_host(p, l);
        if (!st) st = block_hessian(p, l, &block_H);
    }
    const int C = p->mp.chunk > 0 && p->mp.chunk < E ? p->mp.chunk : E;
    const bool calib = p->calibrate && !replay;
    /* one process on a GPU: the experts' outputs are combined there, over every chunk, and read
     * back once; the passes that give them must keep their rows there (batch_run's dev_rows) */
    if (!st && experts_on_device(p, l, replay)) st = mq_gpu_buf_new(p->gpu, p->calib.n * p->LD, &p->gout);
    p->layers[l].gpu_combined = p->gout != NULL;
    for (int e0 = (int)own_lo; e0 < own_hi && !st; e0 += C) {
        const int e1 = e0 + C < own_hi ? e0 + C : (int)own_hi;
        if ((st = read_part(p, l, MQ_PART_EXPERTS, e0, e1, NULL, NULL))) break;
        /* the next chunk while this one computes, during the last the next layer's attention (one
         * process: else only the page cache) */
        const int e2 = e1 + C < own_hi ? e1 + C : (int)own_hi;
        if (e1 < own_hi) mq_lazy_prefetch(p->lz, l, MQ_PART_EXPERTS, e1, e2);
        if (e1 < own_hi && !dist && !replay) st = start_ahead(p, l, MQ_PART_EXPERTS, e1, e2);
        else if (!dist && !replay && l + 1 < p->plan.n_layers) st = start_ahead(p, l + 1, attention_parts(p, l + 1), 0, 0);
        if (st) break;
        /* one process on a GPU: the chunk's experts go up once, gate, up and down, for both
         * passes and GPTQ (which leaves the dequantized weights there) */
        if (p->gpu && !dist && !replay && calib) {
            mq_gpu_mlp *m = NULL;
            double t0 = mq_now(), c0 = mq_cpu_now();   /* the upload, as the forward's */
            if (p->gx_ahead && p->gx_ahead_l == l && e0 == 0 && e1 == p->gx_ahead_e1) {
                m = p->gx_ahead;   /* sent during the attention (experts_ahead) */
                p->gx_ahead = NULL;
                p->layers[l].gpu_experts_ahead = true;
            } else {
                st = gpu_experts(p, l, e0, e1, true, mq_plan_batch_rows(p, e1 - e0), &m);
            }
            p->layers[l].forward += mq_now() - t0;
            p->layers[l].cpu_forward += mq_cpu_now() - c0;
            p->gx = m;
            p->gx_e0 = e0;
            p->gx_e1 = e1;
            if (st) break;
        }
        for (int e = e0; e < e1 && !st && calib; e++)
            if (!(st = slot_hessian(p, &gu[e]))) st = slot_hessian(p, &dn[e]);
        /* calibration: Hessians (and amax) from the experts' routed tokens; without sequential
         * calibration (and alone) this pass also gives the layer's output */
        /* asymmetric calibration in one process: the unquantized stream's expert outputs come
         * with the calibration pass where it can give them (it has most of their gate/up rows) */
        bool fp_done = false;
        if (!st && calib)
            st = experts_pass(p, l, e0, e1, hs, !p->seq && !dist, o->gptq, o->act_quant, gu, dn, false,
                              p->target && !dist ? &fp_done : NULL);
        /* else the unquantized stream's outputs of the chunk's experts in a pass of their own,
         * before their weights change (a replay: before the quantized ones are read back) */
        if (!st && p->target && !dist && !fp_done)
            st = experts_pass(p, l, e0, e1, fp_source(p), true, false, false, gu, dn, false, NULL);
        if (!st && calib && o->gptq) st = fallback_down(p, l, dn, e0, e1);
        for (int e = e0; e < e1 && calib; e++) {
            moeq_status fa = slot_form_timed(p, l, &gu[e]), fb = slot_form_timed(p, l, &dn[e]);
            if (!st) st = fa ? fa : fb;
        }
        if (!st && calib && p->target) st = target_slots(p, l, gu + e0, e1 - e0, dn + e0, e1 - e0);
        if (!st && !replay) {
            /* gate/up slots then down slots of the chunk, in one run */
            slot *q = calloc((size_t)(2 * (e1 - e0)), sizeof *q);
            if (!q) st = mq_err(MOEQ_E_NOMEM, "out of memory");
            for (int e = e0; !st && e < e1; e++) {
                q[e - e0] = gu[e];
                q[(e1 - e0) + (e - e0)] = dn[e];
            }
            if (!st) st = quantize_slots(p, l, q, 2 * (e1 - e0), block_H);
            for (int e = e0; q && e < e1; e++) {   /* quantize_slots took the Hessians */
                slot *qa = &q[e - e0], *qb = &q[(e1 - e0) + (e - e0)];
                gu[e].H = dn[e].H = gu[e].Hh = dn[e].Hh = NULL;
                mq_hessian_free(&qa->h);
                mq_hessian_free(&qb->h);
                gu[e].h = dn[e].h = (mq_hessian){0};
                /* results held for share_slots (several ranks) */
                memcpy(gu[e].q, qa->q, sizeof gu[e].q);
                memcpy(gu[e].qs, qa->qs, sizeof gu[e].qs);
                gu[e].held = qa->held;
                memcpy(dn[e].q, qb->q, sizeof dn[e].q);
                memcpy(dn[e].qs, qb->qs, sizeof dn[e].qs);
                dn[e].held = qb->held;
            }
            free(q);
        } else if (!st && replay && p->seq) {
            st = read_back_slots(p, gu + e0, e1 - e0);
            if (!st) st = read_back_slots(p, dn + e0, e1 - e0);
        }
        /* the output of the quantized experts on the quantized attention's FFN input */
        if (!dist && !st && p->seq)
            st = experts_pass(p, l, e0, e1, output_source(p), true, false, false, gu, dn, false, NULL);
        if (!dist && !st && replay && !p->seq)
            st = experts_pass(p, l, e0, e1, output_source(p), true, false, false, gu, dn, false, NULL);
        /* the chunk's writes, while the device runs the pass just queued */
        moeq_status ws = write_pending(p, !st);
        if (!st) st = ws;
        for (int e = e0; e < e1; e++) {
            slot_drop_sums(&gu[e]);
            slot_drop_sums(&dn[e]);
        }
        {   /* freeing waits for the device to finish the chunk's quantized pass: forward time */
            double t0 = mq_now(), c0 = mq_cpu_now();
            mq_gpu_mlp_free(p->gx);
            p->layers[l].forward += mq_now() - t0;
            p->layers[l].cpu_forward += mq_cpu_now() - c0;
        }
        p->gx = NULL;
        drop_part(p, l, MQ_PART_EXPERTS, e0, e1);
        p->layers[l].chunks++;
        if (!st && mq_fault_point("chunk", l, (e0 - (int)own_lo) / C))
            st = mq_err(MOEQ_E_IO, "layer %d, expert chunk %d: injected fault (MOEQ_FAULT)", l, (e0 - (int)own_lo) / C);
        if (!dist) mq_pipe_progress(p, p->mp_units.expert * (e1 - e0));
    }
    if (dist) {
        /* every expert from its owner, chunk by chunk in expert order; each rank's samples
         * through them (unquantized ones without sequential calibration). With sequential
         * calibration a quantized Linear's weights are its dequantized codes: only the others
         * are read from the checkpoint. */
        char step[48];
        snprintf(step, sizeof step, "layer %d: experts", l);
        const double work = mq_now() - t_work;   /* this rank's experts, before it waits */
        st = mq_dist_agree(st, step);
        if (!st && measure) {
            int64_t us = (int64_t)(work * 1e6), most, *all = calloc((size_t)p->ranks, sizeof *all);
            double *w = calloc((size_t)p->ranks, sizeof *w);
            st = all && w ? mq_dist_gather_i64(us, &most, all, step) : mq_err(MOEQ_E_NOMEM, "out of memory");
            for (int r = 0; !st && r < p->ranks; r++) w[r] = (double)all[r] * 1e-6;
            if (!st) fit_shares(p, w, rank_x, rank_g);
            free(all);
            free(w);
        }
        for (int e0 = 0; e0 < E && !st; e0 += C) {
            const int e1 = e0 + C < E ? e0 + C : E;
            quantized_in qi = {gu + e0, dn + e0, e1 - e0};
            /* asymmetric calibration: every expert's source weights, for the unquantized stream's
             * outputs of this rank's samples first */
            st = read_part(p, l, MQ_PART_EXPERTS, e0, e1, p->seq && !p->target ? is_quantized_in : NULL, &qi);
            if (!st && p->target) st = experts_pass(p, l, e0, e1, fp_source(p), true, false, false, gu, dn, true, NULL);
            st = mq_dist_agree(st, step);
            if (!st) st = share_slots(p, l, gu + e0, e1 - e0);
            if (!st) st = share_slots(p, l, dn + e0, e1 - e0);
            if (!st) st = experts_pass(p, l, e0, e1, output_source(p), true, false, false, gu, dn, true, NULL);
            drop_part(p, l, MQ_PART_EXPERTS, e0, e1);
            mq_pipe_progress(p, p->mp_units.expert * (e1 - e0));
        }
    }
    if (!st && o->act_quant && !replay && p->w) st = unseen_expert_scales(p, gu, dn, E);
    if (p->gpu && getenv("MOEQ_PROFILE")) {
        mq_info("layer %d experts on the GPU: FFN inputs %.2f s, routing %.2f s, inputs up %.2f s, experts %.2f s, "
                "combine %.2f s", l, g_ex_prof[0], g_ex_prof[1], g_ex_prof[2], g_ex_prof[3], g_ex_prof[4]);
        memset(g_ex_prof, 0, sizeof g_ex_prof);
    }
    if (p->gout) {   /* the combined outputs into OUT, or added to the boundary there */
        double t0 = mq_now(), c0 = mq_cpu_now();
        mq_actbuf *dst = &p->OUT;
        if (p->gbound && !st) {
            st = mq_gpu_buf_add(p->gout, p->gbound, p->calib.n * p->LD);
            dst = out_buf(p);
            p->layers[l].gpu_residual = !st;
        }
        if (!st) st = gpu_acts_to_host(p, p->gout, dst);
        else mq_gpu_sync(p->gpu);   /* nothing left in flight */
        p->layers[l].forward += mq_now() - t0;
        p->layers[l].cpu_forward += mq_cpu_now() - c0;
        /* the boundary there is the next layer's input (gin), X's bits */
        if (!st && p->layers[l].gpu_residual && !host_copies_forced()) {
            mq_gpu_buf_free(p->gin);
            p->gin = p->gout;
            p->gin_ready = true;
        } else {
            mq_gpu_buf_free(p->gout);
        }
        p->gout = NULL;
    }
    gpu_ffn_inputs_free(p);
    mq_gpu_mlp_free(p->gx_ahead);   /* not taken (a failure before its chunk) */
    p->gx_ahead = NULL;
    mq_free(block_H);
    free(rank_x);
    for (int e = 0; e < E; e++) {
        slot_free(&gu[e]);
        slot_free(&dn[e]);
    }
    free(gu);
    free(dn);
    return st;
}

/* ---- shared expert and dense MLP: one unit over all tokens ----------------------------------- */

/* One pass of the samples through the unit: Hessians and amax (calibration), and/or its output
 * into OUT. */
/* Asymmetric calibration's scratch of mlp_pass (calibration): the unquantized stream's FFN input
 * and its gate/up, [Lmax, D] and [Lmax, F] twice; NULL members without it. */
typedef struct {
    float *xs, *hg, *hu;
} fp_scratch;

static moeq_status mlp_pass(mq_pipe *p, int l, bool shared, slot *sl, ffn_source src, bool calib,
                            bool out, float *xs, float *hg, float *hu, float *y, float *sgate, bool own,
                            const fp_scratch *fs) {
    mq_layer *ly = &p->m->layers[l];
    mq_linear *g = shared ? &ly->sh_gate : &ly->gate, *u = shared ? &ly->sh_up : &ly->up,
              *d = shared ? &ly->sh_down : &ly->down;
    const int64_t D = p->c->D, F = g->out;
    moeq_status st = MOEQ_OK;
    const int64_t s_lo = own ? p->s_lo : 0, s_hi = own ? p->s_hi : p->calib.n;
    for (int64_t s = s_lo; s < s_hi && !st; s++) {
        if ((st = check_interrupt())) break;
        const int64_t T = p->calib.len[s];
        double t0 = mq_now(), c0 = mq_cpu_now();
        const float *x = ffn_input(p, l, &src, s, xs);
        st = mq_mlp_forward(g, u, d, x, T, hg, hu, out ? y : NULL);
        double t1 = mq_now(), c1 = mq_cpu_now();
        if (!st && calib) {
            if (sl[0].h.sum) st = slot_add(&sl[0], x, T);
            if (sl[1].h.sum && !st) st = slot_add(&sl[1], hg, T);
            if (p->o->act_quant) {
                amax_update(&sl[0].amax, x, T * D);
                amax_update(&sl[1].amax, hg, T * F);
            }
        }
        if (!st && calib && fs && fs->xs) {   /* the same tokens of the unquantized stream */
            const ffn_source f = fp_source(p);
            const float *xf = ffn_input(p, l, &f, s, fs->xs);
            st = mq_mlp_forward(g, u, NULL, xf, T, fs->hg, fs->hu, NULL);
            if (!st) {
                slot_cross(&sl[0], xf, x, T);
                slot_cross(&sl[1], fs->hg, hg, T);
            }
        }
        double t2 = mq_now(), c2 = mq_cpu_now();
        if (!st && out) {
            float *o = mq_actbuf_ptr(src.fp ? &p->OUTF : &p->OUT, (size_t)(s * p->LD));
            if (shared) mq_shared_expert_add(p->m, l, x, T, y, sgate, o);
            else memcpy(o, y, sizeof(float) * (size_t)(T * D));
        }
        p->layers[l].forward += (t1 - t0) + (mq_now() - t2);
        p->layers[l].cpu_forward += (c1 - c0) + (mq_cpu_now() - c2);
        p->layers[l].hessian += t2 - t1;
        p->layers[l].cpu_hessian += c2 - c1;
    }
    return st;
}

/* The shared expert or the dense MLP: one unit over every token. */
static moeq_status mlp_unit(mq_pipe *p, int l, bool shared, bool replay) {
    mq_layer *ly = &p->m->layers[l];
    const unsigned part = shared ? MQ_PART_SHARED : MQ_PART_MLP;
    moeq_status st = read_part(p, l, part, 0, 0, NULL, NULL);
    if (st) return st;
    mq_linear *g = shared ? &ly->sh_gate : &ly->gate;
    slot sl[2];
    slot_set(p, &sl[0], -1, false, g, shared ? &ly->sh_up : &ly->up, NULL);
    slot_set(p, &sl[1], -1, true, shared ? &ly->sh_down : &ly->down, NULL, NULL);
    const bool dist = p->ranks > 1;
    if (dist) slot_own(&sl[0], p->ranks - 1), slot_own(&sl[1], p->ranks - 1);   /* rank 0 has the attention's q */
    const int64_t Lmax = p->calib.max_len, D = p->c->D, F = g->out;
    float *xs = mq_alloc_array((size_t)p->LD, sizeof(float), "FFN input");
    float *hg = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "MLP activations");
    float *hu = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "MLP activations");
    float *y = mq_alloc_array((size_t)(Lmax * D), sizeof(float), "MLP output");
    float *sgate = mq_alloc_array((size_t)Lmax, sizeof(float), "shared expert gate");
    if (!xs || !hg || !hu || !y || !sgate) st = MOEQ_E_NOMEM;
    fp_scratch fs = {NULL, NULL, NULL};
    if (!st && p->target) {
        fs.xs = mq_alloc_array((size_t)p->LD, sizeof(float), "unquantized FFN input");
        fs.hg = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "unquantized MLP activations");
        fs.hu = mq_alloc_array((size_t)(Lmax * F), sizeof(float), "unquantized MLP activations");
        if (!fs.xs || !fs.hg || !fs.hu) st = MOEQ_E_NOMEM;
    }
    /* asymmetric calibration: first the unquantized stream's output of the unit (the source
     * weights, before anything changes them), of this rank's samples */
    const ffn_source fsrc = fp_source(p);
    if (!st && p->target) st = mlp_pass(p, l, shared, sl, fsrc, false, true, xs, hg, hu, y, sgate, dist, NULL);
    if (!st && p->calibrate && !replay && mine(p, &sl[0])) {
        /* calibration; without sequential calibration (and alone) it also gives the output */
        for (int i = 0; i < 2 && !st; i++) st = slot_hessian(p, &sl[i]);
        if (!st)
            st = mlp_pass(p, l, shared, sl, hessian_source(p), true, !p->seq && !dist, xs, hg, hu, y, sgate, false, &fs);
        for (int i = 0; i < 2; i++) {
            sl[i].tokens = sl[i].h.n;
            moeq_status fst = slot_form_timed(p, l, &sl[i]);
            if (!st) st = fst;
        }
        if (!st && p->target) st = target_slots(p, l, sl, 2, NULL, 0);
        if (!st) st = quantize_slots(p, l, sl, 2, NULL);
    } else if (!st && replay) {
        if (p->seq) st = read_back_slots(p, sl, 2);
        else st = mlp_pass(p, l, shared, sl, output_source(p), false, true, xs, hg, hu, y, sgate, false, NULL);
    }
    if (dist && !replay) {
        /* from its owner to every rank; then each rank's samples through it */
        char step[48];
        snprintf(step, sizeof step, "layer %d: %s", l, shared ? "shared expert" : "MLP");
        st = mq_dist_agree(st, step);
        if (!st) st = share_slots(p, l, sl, 2);
        if (!st) st = mlp_pass(p, l, shared, sl, output_source(p), false, true, xs, hg, hu, y, sgate, true, NULL);
    } else if (!st && p->seq) {
        /* the quantized unit's output on the quantized attention's FFN input */
        st = mlp_pass(p, l, shared, sl, output_source(p), false, true, xs, hg, hu, y, sgate, false, NULL);
    }
    for (int i = 0; i < 2; i++) slot_free(&sl[i]);
    mq_free(fs.xs);
    mq_free(fs.hg);
    mq_free(fs.hu);
    mq_free(xs);
    mq_free(hg);
    mq_free(hu);
    mq_free(y);
    mq_free(sgate);
    drop_part(p, l, part, 0, 0);
    mq_pipe_progress(p, shared ? p->mp_units.shared : p->mp_units.mlp);
    return st;
}

/* ---- plain RTN and pass-through tensors -------------------------------------------------------- */

/* fp32 copy of rows x cols values of src from element offset on, rotated as the output tensor
 * `name` when the run rotates the residual stream (model/rotate.h). */
static moeq_status load_rotated(const mq_pipe *p, const mq_tensor_view *src, int64_t offset,
                                int64_t rows, int64_t cols, const char *name, float **out) {
    size_t n = (size_t)(rows * cols);
    float *w = mq_alloc_array(n, sizeof(float), name);
    if (!w) return MOEQ_E_NOMEM;
    mq_tensor_view v = *src;
    size_t es = moeq_dtype_size(v.dtype);
    v.data += (size_t)offset * es;
    v.ndim = 2;
    v.shape[0] = rows;
    v.shape[1] = cols;
    v.numel = (int64_t)n;
    v.nbytes = n * es;
    moeq_status s = mq_tensor_to_f32(&v, w);
    if (s) s = mq_err(s, "tensor '%s': cannot convert to fp32", src->name);
    if (!s && p->rotated) {
        int layer;
        mq_rot_kind k = mq_rot_classify(name, &layer);
        s = mq_rotation_apply(&p->rot, k, layer, w, rows, cols, name);
    }
    if (s) {
        mq_free(w);
        return s;
    }
    *out = w;
    return MOEQ_OK;
}

/* fp32 copy of an item's weight from the source (rotated with the run's rotation). */
static moeq_status item_load(const mq_pipe *p, const mq_plan_item *it, float **out) {
    char *name = mq_asprintf("%s.weight", it->module);
    if (!name) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status s = load_rotated(p, it->src, it->offset, it->rows, it->cols, name, out);
    free(name);
    return s;
}

/* A pass-through tensor or kept Linear that the rotation changes: rotated in fp32, written in
 * its source dtype (rounded to nearest even). */
static moeq_status put_rotated(mq_pipe *p, const char *name, const mq_tensor_view *src,
                               int64_t offset, int64_t rows, int64_t cols) {
    if (src->dtype != MOEQ_DT_F32 && src->dtype != MOEQ_DT_BF16 && src->dtype != MOEQ_DT_F16)
        return mq_err(MOEQ_E_UNSUPPORTED, "rotate: tensor '%s': dtype %s is not F32, BF16 or F16",
                      name, moeq_dtype_name(src->dtype));
    /* fp32 in pieces of whole rows (a writer's rows are its columns' transforms: all at once),
     * the output in the source dtype (mq_pipe.rot_bytes in the memory plan) */
    int layer;
    const bool writer = mq_rot_classify(name, &layer) == MQ_ROT_WRITE;
    const int64_t piece = writer ? rows : (MQ_ROT_PIECE / cols > 0 ? MQ_ROT_PIECE / cols : 1);
    const size_t es = moeq_dtype_size(src->dtype), n = (size_t)(rows * cols);
    uint8_t *out = mq_alloc_array(n, es, name);
    if (!out) return MOEQ_E_NOMEM;
    moeq_status s = MOEQ_OK;
    for (int64_t r0 = 0; r0 < rows && !s; r0 += piece) {
        const int64_t nr = rows - r0 < piece ? rows - r0 : piece;
        float *w;
        if ((s = load_rotated(p, src, offset + r0 * cols, nr, cols, name, &w))) break;
        const size_t k = (size_t)(nr * cols), at = (size_t)(r0 * cols);
        if (src->dtype == MOEQ_DT_F32) {
            memcpy(out + at * 4, w, k * 4);
        } else {
            uint16_t *h = (uint16_t *)(void *)out + at;
            for (size_t i = 0; i < k; i++)
                h[i] = src->dtype == MOEQ_DT_BF16 ? mq_f32_to_bf16(w[i]) : mq_f32_to_f16(w[i]);
        }
        mq_free(w);
    }
    if (!s) s = mq_ckpt_writer_put(p->w, name, src->dtype, out, n * es);
    mq_free(out);
    return s;
}

static bool rotates(const mq_pipe *p, const char *name) {
    int layer;
    return p->rotated && mq_rot_classify(name, &layer) != MQ_ROT_NONE;
}

moeq_status mq_pipe_layer_rtn(mq_pipe *p, int l) {
    if (!p->w) return MOEQ_OK;   /* several ranks: rank 0's work */
    const mq_pipeline_opts *o = p->o;
    const mq_out_plan *pl = &p->plan;
    moeq_status st = MOEQ_OK;
    size_t idx[8];
    for (size_t i = 0; i < pl->n_items && !st; i++) {
        const mq_plan_item *first = &pl->items[i];
        if (first->layer != l || !first->quantize || p->item_done[i]) continue;
        if ((st = check_interrupt())) break;
        /* the fusion group's members not written yet: its joint amax gives the NVFP4 scale */
        size_t n = 0;
        for (size_t j = i; j < pl->n_items && n < 8; j++)
            if (pl->items[j].group == first->group && pl->items[j].quantize && !p->item_done[j])
                idx[n++] = j;
        float *w[8] = {0};
        float amax = 0;
        double t0 = mq_now(), c0 = mq_cpu_now();
        for (size_t k = 0; k < n && !st; k++) {
            const mq_plan_item *it = &pl->items[idx[k]];
            if ((st = item_load(p, it, &w[k]))) break;
            if ((st = mq_check_finite(w[k], it->rows, it->cols, it->module))) break;
            amax = fmaxf(amax, mq_absmax(w[k], it->rows * it->cols));
        }
        for (size_t k = 0; k < n && !st; k++) {
            const mq_plan_item *it = &pl->items[idx[k]];
            float gs = mq_nvfp4_global_scale(&o->spec, o->no_fuse ? mq_absmax(w[k], it->rows * it->cols) : amax);
            mq_qtensor q;
            st = mq_quantize_rtn(&o->spec, w[k], it->rows, it->cols, gs, it->module, &q);
            if (!st && o->gptq && o->g.act_order && o->g.groups == MQ_GPTQ_GROUPS_GIDX)
                st = identity_gidx(&q);
            if (!st) {
                if (p->lz) mq_info("%s: not part of the model's forward; rounded to nearest", it->module);
                st = mq_ckpt_writer_put_linear(p->w, it->module, &q, o->act_quant ? 1.0f : 0.0f);
            }
            mq_qtensor_free(&q);
            if (!st) p->item_done[idx[k]] = 1;
        }
        for (size_t k = 0; k < n; k++) mq_free(w[k]);
        if (l >= 0) p->layers[l].write += mq_now() - t0;
        if (l >= 0) p->layers[l].cpu_write += mq_cpu_now() - c0;
    }
    return st;
}

moeq_status mq_pipe_write_passthrough(mq_pipe *p, int l) {
    if (!p->w) return MOEQ_OK;   /* several ranks: rank 0's work */
    const mq_out_plan *pl = &p->plan;
    moeq_status st = MOEQ_OK;
    double t0 = mq_now(), c0 = mq_cpu_now();
    for (size_t i = 0; i < pl->n_pass && !st; i++) {
        const mq_plan_pass *t = &pl->pass[i];
        if (t->layer != l) continue;
        if (!t->raw && rotates(p, t->name)) {
            int64_t cols = t->src->ndim >= 1 ? t->src->shape[t->src->ndim - 1] : 1;
            st = put_rotated(p, t->name, t->src, 0, cols ? t->src->numel / cols : 0, cols);
        } else {
            st = mq_ckpt_writer_put(p->w, t->name, t->src->dtype, t->src->data, t->src->nbytes);
        }
    }
    for (size_t i = 0; i < pl->n_items && !st; i++) {
        const mq_plan_item *it = &pl->items[i];
        if (it->layer != l || it->quantize) continue;
        size_t es = moeq_dtype_size(it->src->dtype);
        char *name = mq_asprintf("%s.weight", it->module);
        if (!name) return mq_err(MOEQ_E_NOMEM, "out of memory");
        if (rotates(p, name))
            st = put_rotated(p, name, it->src, it->offset, it->rows, it->cols);
        else
            st = mq_ckpt_writer_put(p->w, name, it->src->dtype, it->src->data + (size_t)it->offset * es,
                                    (size_t)(it->rows * it->cols) * es);
        free(name);
        if (!st) p->item_done[i] = 1;
    }
    if (l >= 0) p->layers[l].write += mq_now() - t0;
    if (l >= 0) p->layers[l].cpu_write += mq_cpu_now() - c0;
    return st;
}

/* ---- the layer ----------------------------------------------------------------------------- */

moeq_status mq_pipe_share_rows(mq_pipe *p, void *base, size_t per_sample, const char *step) {
    moeq_status st = MOEQ_OK;
    for (int r = 0; r < p->ranks && !st; r++) {
        int64_t lo, hi;
        mq_dist_share(p->calib.n, r, p->ranks, &lo, &hi);
        if (hi > lo) st = mq_dist_bcast((char *)base + (size_t)lo * per_sample, (size_t)(hi - lo) * per_sample, r, step);
    }
    return st;
}

moeq_status mq_pipe_share_samples(mq_pipe *p, mq_actbuf *b, const char *step) {
    size_t es;
    char *base = mq_actbuf_raw(b, 0, &es);
    return mq_pipe_share_rows(p, base, (size_t)p->LD * es, step);
}

moeq_status mq_pipe_gather_samples(mq_pipe *p, mq_actbuf *b, const char *step) {
    size_t es;
    char *base = mq_actbuf_raw(b, 0, &es);
    const size_t per = (size_t)p->LD * es;
    moeq_status st = MOEQ_OK;
    for (int r = 1; r < p->ranks && !st; r++) {
        int64_t lo, hi;
        mq_dist_share(p->calib.n, r, p->ranks, &lo, &hi);
        if (hi <= lo || (p->rank != 0 && p->rank != r)) continue;
        char *at = base + (size_t)lo * per;
        st = p->rank == 0 ? mq_dist_recv(at, (size_t)(hi - lo) * per, r, step)
                          : mq_dist_send(at, (size_t)(hi - lo) * per, 0, step);
    }
    return st;
}

/* zero_out and add_out go over the pool a sample at a time (gigabytes a layer at real size; each
 * value is set or added alone, so the bytes do not depend on the threads). */
static void zero_out_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    mq_pipe *p = ctx;
    const int64_t s = p->s_lo + i;
    memset(mq_actbuf_ptr(&p->OUT, (size_t)(s * p->LD)), 0, sizeof(float) * (size_t)(p->calib.len[s] * p->c->D));
    if (p->target)
        memset(mq_actbuf_ptr(&p->OUTF, (size_t)(s * p->LD)), 0, sizeof(float) * (size_t)(p->calib.len[s] * p->c->D));
}

static void zero_out(mq_pipe *p) {   /* the samples whose outputs this rank computes */
    if (p->s_hi > p->s_lo) mq_parallel_for(p->s_hi - p->s_lo, zero_out_task, p);
}

typedef struct {
    mq_pipe *p;
    mq_actbuf *h, *out;
} add_out_job;

static void add_out_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    const add_out_job *j = ctx;
    const int64_t s = j->p->s_lo + i;
    const size_t off = (size_t)(s * j->p->LD);
    mq_vec()->axpy(1.0f, mq_actbuf_ptr(j->out, off), mq_actbuf_ptr(j->h, off), j->p->calib.len[s] * j->p->c->D);
}

/* boundary h += out, sample by sample (x += out, as the forward adds the FFN's output), for
 * this rank's samples: the quantized stream's (out_buf += OUT) and the unquantized one's
 * (XF += OUTF). */
static void add_out(mq_pipe *p, mq_actbuf *h, mq_actbuf *out) {
    const mq_vec_kernels *vk = mq_vec();
    const int64_t D = p->c->D;
    float *tmp = NULL;
    if (h->kind != MQ_ACT_BF16) {
        add_out_job j = {p, h, out};
        if (p->s_hi > p->s_lo) mq_parallel_for(p->s_hi - p->s_lo, add_out_task, &j);
        return;
    }
    tmp = mq_alloc_array((size_t)p->LD, sizeof(float), "boundary");
    for (int64_t s = p->s_lo; s < p->s_hi; s++) {
        size_t off = (size_t)(s * p->LD), n = (size_t)(p->calib.len[s] * D);
        const float *o = mq_actbuf_ptr(out, off);
        if (!tmp) continue;   /* out of memory: caught by the caller's check below */
        mq_actbuf_view(h, off, n, tmp);   /* bf16: converted into tmp */
        vk->axpy(1.0f, o, tmp, (int64_t)n);
        mq_actbuf_put(h, off, n, tmp);
    }
    mq_free(tmp);
}

moeq_status mq_pipe_layer(mq_pipe *p, int l, bool replay) {
    double t0 = mq_now(), c0 = mq_cpu_now(), w0, x0, pool0 = mq_pool_seconds(), sim0[2];
    mq_dist_seconds(&w0, &x0);
    mq_pool_simulated(&sim0[0], &sim0[1]);
    mq_layer *ly = &p->m->layers[l];
    /* the source is read ahead of the compute: the first expert chunk during the attention, the
     * next chunk during each chunk (routed_experts), the next layer's attention during the FFN */
    if (ly->is_moe) {   /* the page cache's part (converted ahead too with MOEQ_READ_AHEAD=1: attention_stage) */
        int64_t lo = 0, hi = p->c->n_experts;
        if (p->ranks > 1) mq_dist_share(p->c->n_experts, p->rank, p->ranks, &lo, &hi);
        const int C = p->mp.chunk > 0 ? p->mp.chunk : p->c->n_experts;
        mq_lazy_prefetch(p->lz, l, MQ_PART_EXPERTS, (int)lo, (int)(lo + C < hi ? lo + C : hi));
    }
    moeq_status st = attention_stage(p, l, replay);
    /* GPTQ's kept scratch goes with each stage (here, after the routed experts and after the FFN):
     * the plan counts one stage's (K = the attention's widest input; DeepSeek-V3's o_proj, 16384,
     * is 2.3x its experts' 7168) */
    mq_gptq_release_scratch();
    if (!st && l + 1 < p->c->n_layers)
        mq_lazy_prefetch(p->lz, l + 1, attention_parts(p, l + 1), 0, 0);
    if (!st) {
        /* OUT gathers the FFN's outputs, unless the GPU's combined ones overwrite all of it */
        if (!experts_on_device(p, l, replay) || p->target) zero_out(p);
        if (ly->is_moe) {
            st = routed_experts(p, l, replay);
            mq_gptq_release_scratch();
            if (!st && p->c->shared_ffn > 0) st = mlp_unit(p, l, true, replay);
        } else {
            st = mlp_unit(p, l, false, replay);
        }
    }
    mq_gptq_release_scratch();   /* the dense or shared FFN's */
    if (!st && !p->layers[l].gpu_residual) add_out(p, out_buf(p), &p->OUT);
    if (!st && p->target) add_out(p, &p->XF, &p->OUTF);
    if (p->ranks > 1) {
        /* each rank goes on with its samples; rank 0 gathers the boundary for its snapshot */
        char step[48];
        snprintf(step, sizeof step, "layer %d: outputs", l);
        st = mq_dist_agree(st, step);
        if (!st && !replay && l + 1 < p->plan.n_layers) st = mq_pipe_gather_samples(p, out_buf(p), step);
        if (!st && !replay && l + 1 < p->plan.n_layers && p->target) st = mq_pipe_gather_samples(p, &p->XF, step);
    }
    if (!st) {
        if (p->X.kind == MQ_ACT_DISK) {   /* the next layer reads what this one wrote */
            mq_actbuf t = p->X;
            p->X = p->X2;
            p->X2 = t;
        }
    }
    if (!st && !replay) st = mq_pipe_layer_rtn(p, l);   /* Linears the model's forward lacks */
    if (!st && !replay) st = mq_pipe_write_passthrough(p, l);
    drop_part(p, l, MQ_PART_FFN_NORM | MQ_PART_ROUTER | MQ_PART_SHARED | MQ_PART_MLP, 0, 0);
    if (!st && p->w) {   /* the writer's queue, the layer's last (usually done by now) */
        const double tw = mq_now(), cw = mq_cpu_now();
        st = mq_ckpt_writer_flush(p->w);
        if (getenv("MOEQ_PROFILE")) mq_info("layer %d write: %.3f s waiting for the writer's queue", l, mq_now() - tw);
        p->layers[l].write += mq_now() - tw;
        p->layers[l].cpu_write += mq_cpu_now() - cw;
    }
    p->layers[l].total += mq_now() - t0;
    p->layers[l].cpu_total += mq_cpu_now() - c0;
    p->layers[l].pooled += mq_pool_seconds() - pool0;
    double sim1[2];   /* bench quantize --simulate-threads */
    mq_pool_simulated(&sim1[0], &sim1[1]);
    p->layers[l].sim_tasks += sim1[0] - sim0[0];
    p->layers[l].sim_span += sim1[1] - sim0[1];
    double w1, x1;
    mq_dist_seconds(&w1, &x1);
    p->layers[l].wait += w1 - w0;
    p->layers[l].exchange += x1 - x0;
    return st;
}
