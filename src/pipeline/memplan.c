/*
 * The memory plan: before any compute, the pipeline's working set (calibration activations at
 * the layer boundary, routing, the attention state, one layer's attention with its Hessians and
 * factors, one chunk of experts with theirs, the shared expert or dense MLP, scratch) is computed
 * from the config and the options, and the largest expert chunk and the activation storage that
 * fit the budget are chosen; or the run stops with what does not fit and what would. Sizes are
 * those the stages allocate (layer*.c), in bytes of anonymous memory. The FLOP counts give the
 * time estimate (against this machine's sgemm rate) and the progress units.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"
#include "core/env.h"

static double gb(int64_t b) { return (double)b / 1e9; }

typedef struct {
    int64_t acts, routing, state, attention, chunk, ffn_other, peak;
    int64_t batch;
    int64_t ahead;   /* the read-ahead's largest part (plan_sizes' ahead) */
} sizes;

/* The largest fp32 bytes any layer loads for `what` (experts [0, e)). */
static int64_t max_part(const mq_pipe *p, unsigned what, int e) {
    int64_t m = 0;
    for (int l = 0; l < p->c->n_layers; l++) {
        int64_t b = mq_lazy_bytes(p->lz, l, what, 0, e);
        if (b > m) m = b;
    }
    return m;
}

/* Codes, group parameters and the packed copy the writer makes, per quantized weight. */
static double code_bytes_per_weight(const mq_qspec *s) {
    /* a K-quant file's Linears each have their type: the worst, 16-value sub-blocks and Q8_0 rows */
    if (s->scheme == MQ_QS_KQUANT) return 1.0 + (double)sizeof(mq_gparams) / 16.0 + 34.0 / 32.0;
    int64_t g = s->group_size > 0 ? s->group_size : 128;
    return 1.0 + (double)sizeof(mq_gparams) / (double)g + 0.5;
}

/* Each fusion group's quantized fp32 bytes (plain RTN quantizes a group at a time), summed in
 * one pass; NULL when out of memory. */
static int64_t *group_fp32_bytes(const mq_pipe *p) {
    int64_t *g = calloc((size_t)p->plan.n_groups + 1, sizeof *g);
    for (size_t i = 0; g && i < p->plan.n_items; i++) {
        const mq_plan_item *a = &p->plan.items[i];
        if (a->quantize && a->group >= 0 && a->group < p->plan.n_groups) g[a->group] += a->rows * a->cols * 4;
    }
    return g;
}

/* The checkpoint writer's queue (mq_ckpt_writer_behind), a ring mapped once: the packed bytes
 * (4-bit codes and their scales, 9/16 of a byte a weight at most) of the most weights one write
 * puts at once: a chunk of C experts, a layer's attention or its dense MLP or shared expert. The
 * plan counts every weight's packed copy beside its codes (code_bytes_per_weight): the ring is
 * where the FFN stage's copies go; beside the attention it is counted in full (plan_sizes). */
static int64_t write_behind_bytes(const mq_pipe *p, int C) {
    int64_t b = 0;
    if (p->calibrate && p->lz) {
        const int E = p->c->n_experts;
        C = C > 0 && C < E ? C : E;
        const int64_t parts[4] = {max_part(p, MQ_PART_ATTN, 0), max_part(p, MQ_PART_MLP, 0),
                                  max_part(p, MQ_PART_SHARED, 0), E > 0 ? max_part(p, MQ_PART_EXPERTS, C) : 0};
        for (int i = 0; i < 4; i++) b = parts[i] > b ? parts[i] : b;
    } else {   /* plain RTN: a fusion group at a time, as planned; each group's sum in one pass */
        int64_t *g = group_fp32_bytes(p);
        for (int k = 0; g && k < p->plan.n_groups; k++) b = g[k] > b ? g[k] : b;
        free(g);   /* out of memory: the smallest ring; larger tensors queue alone */
    }
    return b / 4 * 9 / 16 + (1 << 20);   /* fp32 bytes -> packed; scalars and g_idx */
}

/* The CPU reads the next expert chunk ahead on a thread of its own (mq_pipe_start_ahead) only
 * when MOEQ_READ_AHEAD=1 asks for it: one process without a GPU (which has its own,
 * experts_ahead), the source read as it is (no rotation). Off by default: on the GPU machine's
 * 16-core Xeon at 16 threads a full-width OLMoE-1B-7B layer took 20.4, 23.0, 20.7 s with it
 * against 20.0, 18.4, 19.1 without (alternated; the build before it 20.9 and 20.1 against 23.3
 * and 20.8), the attention and the Hessians slower while the thread converted beside them, for
 * a read stage of 0.05-0.1 s: its traffic through the cores' caches costs the pool more than the
 * conversion it takes off the path. The page cache's read-ahead of the same parts stays on. */
static bool read_ahead_wanted(const mq_pipe *p) {
    const char *env = mq_env(MQ_ENV_READ_AHEAD);
    return p->calibrate && p->lz && !p->gpu && p->ranks <= 1 && !p->rotated && env && strcmp(env, "1") == 0;
}

int64_t mq_plan_write_behind(const mq_pipe *p) { return write_behind_bytes(p, p->mp.chunk); }

/* GPTQ's per-thread scratch for weights with K inputs (gptq.c scratch_new: its rows per task). */
static int64_t gptq_scratch(int64_t K) { return (int64_t)mq_pool_size() * K * mq_gptq_row_block() * 4 * 5; }

int64_t mq_plan_batch_rows(const mq_pipe *p, int64_t C) {
    const int64_t K = p->c->top_k, worst = p->calib.max_len * (K < C ? K : C);
    const int64_t busy = 16 * (int64_t)mq_pool_size() * (MQ_MOE_ROWS / 2);
    return worst > busy ? worst : busy;
}

/* ahead: with the CPU's read-ahead (layer_read.c mq_pipe_start_ahead) */
static sizes plan_sizes(const mq_pipe *p, mq_act_storage kind, int C, int64_t batch, bool ahead) {
    const mq_config *c = p->c;
    const mq_pipeline_opts *o = p->o;
    sizes z;
    memset(&z, 0, sizeof z);
    const int64_t S = p->calib.n, L = p->calib.max_len, D = c->D, K = c->top_k > 0 ? c->top_k : 1;
    const int64_t Q = (int64_t)c->n_heads * c->head_dim, KV = (int64_t)c->n_kv_heads * c->head_dim;
    const int64_t E = c->n_experts, F = c->moe_ffn;
    const int64_t SLD = S * L * D;
    const bool keep_xn = p->seq && !p->tseq;
    /* several ranks: a rank fills X (rank 0 all of it, for its snapshots) and OUT for its share
     * of the samples only; the FFN inputs of every sample */
    const int64_t share = p->ranks > 1 ? (S + p->ranks - 1) / p->ranks : S;
    const int64_t SLDo = share * L * D;
    if (kind == MQ_ACT_RAM) z.acts = (SLD + SLDo + keep_xn * SLD) * 4;
    else if (kind == MQ_ACT_BF16) z.acts = (1 + keep_xn) * SLD * 2 + SLDo * 4;
    /* asymmetric calibration: the unquantized stream's boundary (stored as X) and FFN outputs */
    const int64_t tgt = p->target;
    if (tgt && kind == MQ_ACT_RAM) z.acts += 2 * SLD * 4;
    else if (tgt && kind == MQ_ACT_BF16) z.acts += SLD * (2 + 4);
    z.acts += p->calib.total * 4;   /* the token ids */
    z.routing = E > 0 ? S * L * K * 8 * (p->seq ? 2 + tgt : 1) : 0;
    int64_t Fx = c->ffn > c->shared_ffn ? c->ffn : c->shared_ffn;
    /* the values of the KV cache: v_head_dim wide (MLA's values are narrower than its keys) */
    const int64_t KVv = (int64_t)c->n_kv_heads * c->v_head_dim;
    const int64_t Qo = (int64_t)c->n_heads * c->v_head_dim;
    z.state = L * (2 * D + 2 * Q + 2 * Fx) * 4 + (int64_t)mq_pool_size() * 64 * L * 4 +
              L * c->head_dim * 4 + L * (KV + KVv) * 4;
    const int64_t qr = c->q_lora_rank, lr = c->kv_lora_rank;
    if (c->mla)   /* its latents: q_a's output, kv_a's, the normed latents, kv_b's output */
        z.state += L * (qr + 2 * lr + c->qk_rope +
                        (int64_t)c->n_heads * (c->qk_nope + c->v_head_dim)) * 4;
    /* attention: weights, two Hessians that become H + the factor's A and U, their inputs, the
     * codes of q/k/v/o and GPTQ's scratch */
    int64_t att_w = max_part(p, MQ_PART_ATTN | MQ_PART_FFN_NORM | MQ_PART_ROUTER, 0);
    /* Hessians of q/k/v (MLA: q_a with kv_a) and o_proj, MLA's q_b and kv_b inputs too */
    int64_t hs = (D * D + Qo * Qo + (c->mla ? qr * qr + lr * lr : 0)) * 4;
    /* Hessian-sized buffers per input: the sum (then H), the factor, U; a damping sweep adds
     * the held-out rows' Hessian (and one fitting Hessian at a time) */
    /* asymmetric calibration: the cross sum G beside each Hessian (freed before the factors) */
    const int64_t nh = 3 + (o->n_damp_sweep > 0) + (o->g.refine_passes > 0) + tgt;   /* refine: H' kept */
    /* ... and its correction: (H + damping), the solution and a weight's copy, per input at once
     * (mq_pipe_target_slots: each of a chunk's slots its own task, up to one per thread) */
    const int64_t Kmax = D > Qo ? D : Qo;
    const int64_t par = mq_pool_size();
    z.attention = att_w + (o->gptq ? nh * hs + gptq_scratch(D > Qo ? D : Qo) : 0) +
                  tgt * ((2 * Kmax * Kmax + (Q + 2 * KV > D ? Q + 2 * KV : D) * Kmax) * 4 +
                         L * (2 * D + Qo + (c->mla ? qr + lr : 0)) * 4) +
                  L * (3 * D + Qo + (c->mla ? qr + lr : 0)) * 4 +
                  L * (E > 0 ? E : 1) * 4 + (int64_t)(code_bytes_per_weight(&o->spec) * (double)att_w / 4) +
                  write_behind_bytes(p, C);   /* the writer's ring, filled by the FFN stage before */
    /* the FFN stage keeps the norms and the router */
    int64_t ffn_fixed = max_part(p, MQ_PART_FFN_NORM | MQ_PART_ROUTER, 0);
    bool block = o->gptq && !o->fallback_rtn && o->min_expert_tokens > 0 && E > 0;
    if (block) ffn_fixed += 3 * D * D * 4;
    if (E > 0 && C > 0) {
        int64_t w1 = 3 * F * D * 4;   /* one expert's fp32 weights */
        int64_t h1 = o->gptq ? nh * (D * D + F * F) * 4 : 0;
        int64_t rows = mq_plan_batch_rows(p, C);
        z.batch = batch;
        /* asymmetric calibration: the cross batch's unquantized rows, and beside it the batch
         * of the unquantized stream's outputs (batch_run_fp: its rows, routing and one sample's
         * input), and the corrections' scratch */
        int64_t bscratch = batch * (L * D + L * K) * 4 + rows * (2 * D + 2 * F + 1) * 4 +
                           tgt * (batch * L * D + rows * (D + 2 * F) +
                                  rows * (2 * D + 2 * F + 4) + batch * L * K + L * D +
                                  (2 * C < par ? 2 * C : par) * (2 * (D > F ? D * D : F * F) + 2 * F * D)) * 4;
        z.chunk = C * (w1 + h1 + (int64_t)(code_bytes_per_weight(&o->spec) * (double)(3 * F * D))) +
                  bscratch + (o->gptq ? gptq_scratch(D > F ? D : F) : 0);
        if (block) z.chunk += (2 * L * F + L * D) * 4;   /* fallback down: its scratch */
        /* one process on a GPU reads the first chunk's weights during the attention
         * (layer_attention.c experts_ahead) */
        if (p->gpu && p->ranks <= 1) z.attention += C * w1;
        /* the CPU's read-ahead (layer_read.c mq_pipe_start_ahead): the first chunk beside the
         * attention, the next chunk beside the one before, the next layer's attention beside the
         * last */
        if (ahead) {
            z.ahead = C * w1 > att_w ? C * w1 : att_w;
            z.attention += C * w1;
            z.chunk += z.ahead;
        }
    }
    int64_t unit = 0;
    int64_t Fu = c->shared_ffn > 0 ? c->shared_ffn : (E == 0 ? c->ffn : 0);
    for (int l = 0; l < c->n_layers && E > 0; l++)   /* dense layers of a MoE model (deepseek_v3's
                                                        first ones, qwen2_moe's mlp_only_layers) */
        if (!c->layer_is_moe[l] && c->ffn > Fu) Fu = c->ffn;
    if (Fu > 0) {
        int64_t w = 3 * Fu * D * 4;
        const int64_t Ku = D > Fu ? D : Fu;
        unit = w + (o->gptq ? nh * (D * D + Fu * Fu) * 4 + gptq_scratch(D > Fu ? D : Fu) : 0) +
               tgt * (L * D + 2 * L * Fu + 2 * Ku * Ku + 2 * Fu * D) * 4 + (L * D * 2 + 2 * L * Fu + L) * 4 + (int64_t)(code_bytes_per_weight(&o->spec) * (double)(3 * Fu * D));
    }
    z.ffn_other = ffn_fixed + unit;
    int64_t ffn = ffn_fixed + (z.chunk > unit ? z.chunk : unit);
    z.peak = z.acts + z.routing + z.state + (z.attention > ffn ? z.attention : ffn);
    /* the allocator's and the process's own share (code, the source's index, small buffers) */
    z.peak += 64 << 20;
    /* an FP8 source's unquantized tensors, held as BF16 from the plan on (plan.h) */
    z.peak += p->plan.dequant_bytes;
    /* --rotate: one unquantized tensor rotated at a time (the embeddings, lm_head) */
    z.peak += p->rot_bytes;
    return z;
}

/* Samples an expert batch may hold at most (their inputs are kept while it runs); the rows of
 * mq_plan_batch_rows decide how many it takes. */
static int64_t batch_for(const mq_pipe *p, int C) {
    (void)C;
    int64_t b = 16;
    if (b > p->calib.n) b = p->calib.n > 0 ? p->calib.n : 1;
    return b;
}

/* The chunk: enough experts for every thread to have two (their Hessians, factorisations and
 * GPTQ runs are per expert) and at least 8, fewer when the budget says so; more buy no speed and
 * only hold memory. With a GPU (one process), as many as fit in half its free memory with their
 * Hessians and factors: the device runs a chunk's experts and GPTQ in one wave each, and fewer
 * waves are faster there (OLMoE-1B-7B at 128 x 2048 tokens on an H200: 68.3 -> 65.9 s end to end
 * with one chunk of 64 instead of two of 32). 0 when not even one expert fits. */
static int best_chunk(const mq_pipe *p, mq_act_storage kind, int64_t budget) {
    int E = p->c->n_experts;
    if (E == 0) return plan_sizes(p, kind, 0, 1, false).peak <= budget ? 1 : 0;
    int want = 2 * mq_pool_size() > 8 ? 2 * mq_pool_size() : 8;
    const int64_t gpu_free = p->gpu ? 0 : p->o->max_gpu_memory;   /* a dry run without a GPU: the bound */
    if ((p->gpu || (gpu_free > 0 && p->o->device >= 0)) && p->ranks <= 1) {
        mq_gpu_info gi;
        gi.mem_free = gpu_free;
        if (p->gpu) mq_gpu_get_info(p->gpu, &gi);
        const int64_t D = p->c->D, F = p->c->moe_ffn;
        const int64_t per_expert = 4 * (3 * F * D + 2 * (D * D + F * F));   /* weights, Hessians and factors */
        const int64_t fit = per_expert > 0 ? gi.mem_free / 2 / per_expert : 0;
        if (fit > want) want = fit < E ? (int)fit : E;
    }
    for (int C = want < E ? want : E; C >= 1; C--)
        if (plan_sizes(p, kind, C, batch_for(p, C), false).peak <= budget) return C;
    return 0;
}

/* ---- GPU memory (GPTQ with a device) ----------------------------------------------------------
 * What one layer needs on the device at the least, from the backend's own arithmetic (gpu.h
 * mq_gpu_*_bytes): the attention object, made at the first layer and kept (groups of one
 * sample's tokens at the least), beside the larger of two stages: the attention's (its two
 * Hessian sums, the first expert sent up beside it, GPTQ of the Hessian whose weights take the
 * most) and one expert's (its weights with a lane of the plan's batch rows, its two Hessian sums,
 * one sample's routed rows in and out, GPTQ likewise), or of the shared expert / dense MLP. The
 * rest (more experts a chunk, larger batches and GPTQ waves, the layer's outputs kept on the
 * device) is sized by the run from what the budget leaves. */
mq_gpu_layer_need mq_plan_gpu_layer(const mq_config *c, int64_t max_len, int64_t batch_rows, const mq_qspec *s,
                                    const mq_gptq_opts *o) {
    mq_gpu_layer_need n;
    memset(&n, 0, sizeof n);
    const int64_t D = c->D, QD = (int64_t)c->n_heads * c->head_dim, KVD = (int64_t)c->n_kv_heads * c->head_dim;
    const int64_t T = max_len > 0 ? max_len : 1, E = c->n_experts, F = c->moe_ffn;
    const mq_gpu_attn_shape sh = {.D = D, .H = c->n_heads, .KV = c->n_kv_heads, .hd = c->head_dim, .max_T = T,
                                  .E = E, .top_k = c->top_k};
    n.attention = mq_gpu_attn_bytes(&sh, T);
    const int64_t gq = mq_gpu_gptq_bytes(s, o, D, QD + 2 * KVD), go = mq_gpu_gptq_bytes(s, o, QD, D);
    n.attention_stage = mq_gpu_hessians_bytes(D) + mq_gpu_hessians_bytes(QD) + (gq > go ? gq : go);
    /* one MLP of width W: weights and a lane, Hessians of gate/up and down, a sample's rows, GPTQ */
    int64_t Fu = c->shared_ffn > 0 ? c->shared_ffn : (E == 0 ? c->ffn : 0);
    for (int l = 0; l < c->n_layers && E > 0 && c->layer_is_moe; l++)
        if (!c->layer_is_moe[l] && c->ffn > Fu) Fu = c->ffn;
    const int64_t rows = T * (c->top_k > 0 ? c->top_k : 1);
    for (int k = 0; k < 2; k++) {
        const int64_t W = k == 0 ? (E > 0 ? F : 0) : Fu;
        if (W <= 0) continue;
        const int64_t gu = mq_gpu_gptq_bytes(s, o, D, 2 * W), gd = mq_gpu_gptq_bytes(s, o, W, D);
        const int64_t b = mq_gpu_mlp_bytes(1, D, W, true, batch_rows, 1) + mq_gpu_hessians_bytes(D) +
                          mq_gpu_hessians_bytes(W) + 2 * rows * D * 4 + (gu > gd ? gu : gd);
        if (b > n.expert) n.expert = b;
        if (k == 0) {
            n.per_expert = 3 * F * D * 4 + mq_gpu_hessians_bytes(D) + mq_gpu_hessians_bytes(F);
            /* the first chunk goes up during the attention: an expert's weights and its lane */
            n.attention_stage += mq_gpu_mlp_bytes(1, D, F, true, batch_rows, 1);
        }
    }
    n.least = n.attention + (n.attention_stage > n.expert ? n.attention_stage : n.expert);
    return n;
}

/* The GPU's part of the plan: the budget (the bound, at most the card's free memory), what a
 * layer needs, and the chunk capped at what the device holds; an error naming what one layer
 * needs where the budget is short of it. *C may shrink. */
static moeq_status plan_gpu(mq_pipe *p, int *C) {
    const mq_pipeline_opts *o = p->o;
    mq_mem_plan *mp = &p->mp;
    if (!(o->gptq && o->device >= 0 && p->calibrate)) return MOEQ_OK;
    const int Cs = *C > 0 ? *C : 1;
    const mq_gpu_layer_need n =
        mq_plan_gpu_layer(p->c, p->calib.max_len, mq_plan_batch_rows(p, Cs), &o->spec, &o->g);
    int64_t budget = o->max_gpu_memory, card = 0;
    if (p->gpu) mq_gpu_set_sizing_reserve(p->gpu, 0);   /* the card's whole free memory to plan with */
    if (p->gpu) {
        mq_gpu_info gi;
        mq_gpu_get_info(p->gpu, &gi);   /* under the bound: what it leaves */
        card = gi.mem_free;
        if (budget <= 0 || card < budget) budget = card;
    }
    mp->gpu_budget = budget;
    mp->gpu_attention = n.attention;
    mp->gpu_attention_stage = n.attention_stage;
    mp->gpu_expert = n.expert;
    mp->gpu_least = n.least;
    if (budget > 0 && n.least > budget) {
        char who[160];
        if (o->max_gpu_memory > 0 && (!p->gpu || o->max_gpu_memory <= card))
            snprintf(who, sizeof who, "--max-gpu-memory %.3f GB is too small", gb(o->max_gpu_memory));
        else
            snprintf(who, sizeof who, "cuda:%d has %.3f GB of memory free", o->device, gb(card));
        return mq_err(MOEQ_E_NOMEM,
                      "%s: one layer needs %.3f GB on the GPU (the attention %.3f GB for %lld-token samples, "
                      "beside the larger of its Hessians and GPTQ %.3f GB or one expert with its Hessians, rows "
                      "and GPTQ %.3f GB)", who, gb(n.least), gb(n.attention), (long long)p->calib.max_len,
                      gb(n.attention_stage), gb(n.expert));
    }
    if (budget > 0 && p->c->n_experts > 0 && n.per_expert > 0) {
        /* every expert of a chunk is on the device with its Hessian sums at once */
        const int64_t fit = 1 + (budget - n.least) / n.per_expert;
        if (*C > fit) {
            mq_info("the GPU holds %lld expert%s at a time within %.2f GB: chunks of %lld, not %d",
                    (long long)fit, fit == 1 ? "" : "s", gb(budget), (long long)fit, *C);
            *C = (int)fit;
        }
    }
    mp->gpu_chunk = p->c->n_experts > 0 ? (*C > 0 ? *C : 1) : 0;
    /* the first chunk of a layer's experts goes up on a thread of its own while the attention's
     * stage sizes its GPTQ waves and buffers from the free memory: they leave it room */
    mp->gpu_ahead_reserve = 0;
    if (p->gpu && mp->gpu_chunk > 0) {
        mp->gpu_ahead_reserve =
            mq_gpu_mlp_bytes(mp->gpu_chunk, p->c->D, p->c->moe_ffn, true, mq_plan_batch_rows(p, mp->gpu_chunk), 1);
        mq_gpu_set_sizing_reserve(p->gpu, mp->gpu_ahead_reserve);
    }
    return MOEQ_OK;
}

static int64_t default_budget(void) {
    int64_t avail = mq_mem_available_bytes(), total = mq_mem_total_bytes();
    int64_t b = (int64_t)(0.85 * (double)(avail > 0 ? avail : total));
    if (total > 0 && b > total - ((int64_t)2 << 30)) b = total - ((int64_t)2 << 30);
    return b > ((int64_t)1 << 30) ? b : ((int64_t)1 << 30);
}

/* ---- FLOPs ---------------------------------------------------------------------------------- */

typedef struct {
    double forward, hessian, gptq;   /* one layer */
    double att_sample, expert, mlp;  /* progress units' FLOPs */
} layer_flops;

static layer_flops flops_of(const mq_pipe *p, int l) {
    const mq_config *c = p->c;
    const mq_pipeline_opts *o = p->o;
    layer_flops f;
    memset(&f, 0, sizeof f);
    const double D = c->D, Q = (double)c->n_heads * c->head_dim, KV = (double)c->n_kv_heads * c->head_dim;
    const double T = (double)p->calib.total, L = (double)p->calib.max_len, K = c->top_k;
    const double passes = p->seq ? 2 : 1;
    double att = 2 * D * (Q + 2 * KV) + 2 * Q * D + 2 * Q * L;   /* per token */
    f.hessian = o->gptq ? (D * D + Q * Q) * T : 0;
    f.gptq = o->gptq ? 2 * (Q + 2 * KV) * D * D + 2 * D * Q * Q + D * D * D + Q * Q * Q : 0;
    if (c->mla) {   /* q_a (or q_proj), kv_a, q_b, kv_b, o_proj: out x in each */
        const double H = c->n_heads, qr = c->q_lora_rank, lr = c->kv_lora_rank;
        const double Qo = H * c->v_head_dim, kva = lr + c->qk_rope;
        const double kvb = H * (c->qk_nope + c->v_head_dim);
        const double qin = qr > 0 ? qr : D, qout = qr > 0 ? qr : Q;
        att = 2 * (D * qout + (qr > 0 ? qr * Q : 0) + D * kva + lr * kvb + Qo * D) +
              2 * (Q + Qo) * L;
        f.hessian = o->gptq ? (D * D + Qo * Qo + qr * qr + lr * lr) * T : 0;
        f.gptq = o->gptq ? 2 * (qout + kva) * D * D + D * D * D + 2 * D * Qo * Qo + Qo * Qo * Qo +
                               (qr > 0 ? 2 * Q * qin * qin + qin * qin * qin : 0) +
                               2 * kvb * lr * lr + lr * lr * lr
                         : 0;
    }
    f.att_sample = att * L * (p->calibrate ? 1 : 0);
    /* asymmetric calibration: the unquantized stream's pass of every part, gate/up once more on
     * its routed rows, and the cross sums (twice a Hessian's work: the whole square) */
    const double tgt = p->target;
    f.forward = att * T * (passes + tgt);
    f.hessian *= 1 + 2 * tgt;
    const double mse = o->spec.mse ? 1.3 : 1.0;
    if (c->layer_is_moe[l]) {
        const double E = c->n_experts, F = c->moe_ffn;
        /* calibration gate/up + output; the unquantized stream's gate/up of the pairing (its
         * output reuses them where the routes agree, batch_run_fp) and its down */
        double fw = K * T * 2 * F * D * (p->seq ? 2 + 3 + 3 * tgt : 3);
        double hs = o->gptq ? K * T * (D * D + F * F) * (1 + 2 * tgt) : 0;
        double gq = o->gptq ? E * (2 * 2 * F * D * D + D * D * D + 2 * D * F * F + F * F * F) * mse : 0;
        f.forward += fw + 2 * E * D * T * passes;
        f.hessian += hs;
        f.gptq += gq;
        f.expert = (fw + hs + gq) / E;
    }
    double Fu = c->layer_is_moe[l] ? c->shared_ffn : c->ffn;
    if (Fu > 0) {
        double fw = T * 2 * Fu * D * (p->seq ? 2 + 3 + 5 * tgt : 3);
        double hs = o->gptq ? T * (D * D + Fu * Fu) * (1 + 2 * tgt) : 0;
        double gq = o->gptq ? (2 * 2 * Fu * D * D + D * D * D + 2 * D * Fu * Fu + Fu * Fu * Fu) * mse : 0;
        f.forward += fw;
        f.hessian += hs;
        f.gptq += gq;
        f.mlp = fw + hs + gq;
    }
    return f;
}

static int64_t units(double flops) { return (int64_t)(flops / 1e6) + 1; }

moeq_status mq_plan_memory(mq_pipe *p) {
    const mq_pipeline_opts *o = p->o;
    mq_mem_plan *mp = &p->mp;
    memset(mp, 0, sizeof *mp);
    mp->budget = o->max_memory > 0 ? o->max_memory : default_budget();
    mp->disk_output = (int64_t)p->plan_bytes;
    mp->layers = p->plan.n_layers;
    if (!p->calibrate) {
        /* plain RTN: one fusion group's fp32 weights, their codes and packed copies */
        int64_t worst = 0, group = 0;
        const char *name = NULL;
        int64_t *sum = group_fp32_bytes(p);
        if (!sum) return mq_err(MOEQ_E_NOMEM, "out of memory");
        for (size_t i = 0; i < p->plan.n_items; i++) {
            const mq_plan_item *a = &p->plan.items[i];
            if (!a->quantize) continue;
            const int64_t b = sum[a->group] + (int64_t)(code_bytes_per_weight(&o->spec) * (double)(a->rows * a->cols));
            if (b > group) {
                group = b;
                name = a->module;
            }
        }
        free(sum);
        worst = group + (64 << 20) + p->plan.dequant_bytes;
        mp->expert_chunk = group;
        mp->peak = worst;
        mp->storage = MQ_ACT_RAM;
        for (int l = 0; l < p->plan.n_layers; l++) p->progress.total += 1;
        p->mp_units.rtn_layer = 1;
        if (worst > mp->budget)
            return mq_err(MOEQ_E_NOMEM, "--max-memory %.2f GB is too small: round to nearest of "
                          "%s and its fused group needs %.2f GB", gb(mp->budget), name, gb(worst));
        return MOEQ_OK;
    }
    const mq_config *c = p->c;
    mp->samples = p->calib.n;
    mp->tokens = p->calib.total;
    mp->attention_passes = p->seq ? 2 + p->target : 1;   /* the unquantized stream's own pass */
    mp->ffn_passes = p->seq ? 2 + p->target : 1;
    int E = c->n_experts;
    mq_act_storage kind = o->act_storage;
    int C = 0;
    if (o->expert_chunk > 0) {
        C = o->expert_chunk < E ? o->expert_chunk : (E > 0 ? E : 1);
        if (kind == MQ_ACT_AUTO)
            kind = plan_sizes(p, MQ_ACT_RAM, C, batch_for(p, C), false).peak <= mp->budget ? MQ_ACT_RAM : MQ_ACT_DISK;
    } else if (kind != MQ_ACT_AUTO) {
        C = best_chunk(p, kind, mp->budget);
    } else {
        int cr = best_chunk(p, MQ_ACT_RAM, mp->budget);
        int want = E < 4 ? E : 4;
        if (cr >= want && cr > 0) {
            kind = MQ_ACT_RAM;
            C = cr;
        } else {
            int cd = best_chunk(p, MQ_ACT_DISK, mp->budget);
            kind = cd > cr ? MQ_ACT_DISK : MQ_ACT_RAM;
            C = cd > cr ? cd : cr;
        }
    }
    if (kind == MQ_ACT_AUTO) kind = MQ_ACT_RAM;
    /* several ranks: a rank holds at most its share of a layer's experts at once (the plan is
     * each rank's) */
    if (p->ranks > 1 && E > 0 && C > (E + p->ranks - 1) / p->ranks) C = (E + p->ranks - 1) / p->ranks;
    /* the GPU's refusal after the rest of the plan is filled (a dry run prints it whole) */
    const moeq_status gs = plan_gpu(p, &C);
    char gpu_msg[1024] = "";
    if (gs) snprintf(gpu_msg, sizeof gpu_msg, "%s", moeq_last_error());
    int Cs = C > 0 ? C : 1;
    sizes z = plan_sizes(p, kind, Cs, batch_for(p, Cs), false);
    mp->storage = kind;
    mp->chunk = E > 0 ? Cs : 0;
    const int share = p->ranks > 1 ? (E + p->ranks - 1) / p->ranks : E;   /* experts of this rank */
    mp->n_chunks = E > 0 ? (share + Cs - 1) / Cs : 0;
    mp->batch = (int32_t)batch_for(p, Cs);
    mp->activations = z.acts;
    mp->routing = z.routing;
    mp->state = z.state;
    mp->attention = z.attention;
    mp->expert_chunk = z.chunk;
    mp->ffn_other = z.ffn_other;
    mp->peak = z.peak;
    /* the activation snapshot (workdir.c): a copy written to disk behind the next layer where it
     * fits beside the rest (one process: several ranks gather theirs to rank 0 in place;
     * MOEQ_DEBUG_SNAPSHOT_IN_PLACE=1, for the tests: never) */
    const int64_t copy = p->calib.total * (int64_t)c->D * 4 * (1 + p->target);   /* both streams */
    const bool snap_copy = p->ranks <= 1 && z.peak + copy <= mp->budget && !mq_env(MQ_ENV_SNAPSHOT_IN_PLACE);
    /* the read-ahead where it fits beside the rest, as the chunk and the snapshot's copy are */
    if (read_ahead_wanted(p) && E > 0 && C > 0) {
        const sizes za = plan_sizes(p, kind, Cs, batch_for(p, Cs), true);
        if (za.peak + (snap_copy ? copy : 0) <= mp->budget) {
            z = za;
            mp->read_ahead = z.ahead;
            mp->attention = z.attention;
            mp->expert_chunk = z.chunk;
            mp->peak = z.peak;
        }
    }
    if (snap_copy) {
        mp->snapshot_copy = copy;
        mp->peak += copy;
    }
    const int64_t SLD4 = p->calib.n * p->calib.max_len * (int64_t)c->D * 4;
    mp->disk_work = 2 * SLD4 + (kind == MQ_ACT_DISK ? (3 + (p->seq && !p->tseq) + 2 * p->target) * SLD4 : 0);
    /* FLOPs, time and progress units */
    for (int l = 0; l < c->n_layers; l++) {
        layer_flops f = flops_of(p, l);
        mp->flops_forward += f.forward;
        mp->flops_hessian += f.hessian;
        mp->flops_gptq += f.gptq;
        p->progress.total += units(f.att_sample) * p->calib.n * (p->seq ? 2 : 1) +
                          (c->layer_is_moe[l] ? units(f.expert) * E : 0) + (f.mlp > 0 ? units(f.mlp) : 0);
        if (l == 0 || f.expert > 0) p->mp_units.expert = units(f.expert);
        p->mp_units.attention_sample = units(f.att_sample);
        if (f.mlp > 0 && c->layer_is_moe[l]) p->mp_units.shared = units(f.mlp);
        else if (f.mlp > 0) p->mp_units.mlp = units(f.mlp);
    }
    if (gs) return mq_err(gs, "%s", gpu_msg);
    if (C == 0 || z.peak > mp->budget) {
        sizes d = plan_sizes(p, MQ_ACT_DISK, 1, batch_for(p, 1), false);
        char what[160] = "";
        if (E > 0)
            snprintf(what, sizeof what, ", %d expert%s at a time %.2f GB", Cs, Cs > 1 ? "s" : "",
                     gb(z.chunk));
        return mq_err(MOEQ_E_NOMEM,
                      "--max-memory %.2f GB is too small for this run: it needs %.2f GB "
                      "(calibration activations %.2f GB for %lld samples x %lld tokens x %d "
                      "hidden in %s, routing %.2f GB, attention state %.2f GB, one layer's "
                      "attention with its Hessians %.2f GB%s, shared/dense MLP %.2f GB); with "
                      "--activations disk and one expert at a time it needs %.2f GB",
                      gb(mp->budget), gb(z.peak), gb(z.acts), (long long)p->calib.n,
                      (long long)p->calib.max_len, c->D, mq_act_storage_name(kind), gb(z.routing),
                      gb(z.state), gb(z.attention), what, gb(z.ffn_other), gb(d.peak));
    }
    return MOEQ_OK;
}

void mq_plan_estimate_time(mq_pipe *p) {
    mq_mem_plan *mp = &p->mp;
    if (!p->calibrate) return;
    mp->sgemm_gflops = mq_measure_sgemm_gflops(1024, 0.3);
    double r = mp->sgemm_gflops > 0 ? mp->sgemm_gflops * 1e9 : 1e10;
    mp->seconds = mp->flops_forward / (0.5 * r) + mp->flops_hessian / (0.5 * r) +
                  mp->flops_gptq / (0.45 * r);
}
