/*
 * The pipeline's driver (see pipeline.h): checks, the source opened once (mapped, lazily
 * loaded), the output plan, the calibration samples, the memory plan, the work directory (fresh
 * or resumed), the global tensors, the layer loop with a line per layer, the checkpoint finished
 * and renamed over OUT_DIR, the report.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dist/dist.h"
#include "core/env.h"
#include "formats/kquant.h"
#include "pipeline/internal.h"

void mq_pipeline_opts_init(mq_pipeline_opts *o, mq_qscheme scheme, mq_ckpt_format format) {
    memset(o, 0, sizeof *o);
    o->spec = mq_qspec_default(scheme);
    o->format = format;
    if (format == MQ_FMT_MODELOPT) o->spec.nvfp4_conv = MQ_NVFP4_MUL;
    if (format == MQ_FMT_GPTQ) {
        o->spec.scale_dtype = MOEQ_DT_F16;
        o->spec.int4_zero_min = 1;
    }
    if (format == MQ_FMT_GGUF) o->spec.scale_dtype = MOEQ_DT_F16;   /* Q4_0/Q4_1 hold f16 scales */
    o->g = mq_gptq_opts_default();
    o->sequential = true;
    o->device = -1;
    o->min_expert_tokens = 32;
    mq_calib_opts_init(&o->calib);
    o->act_calib_tokens = 65536;
}

static moeq_status check_opts(const mq_pipeline_opts *o) {
    mq_qscheme sch = o->spec.scheme;
    if (sch == MQ_QS_KQUANT && (o->format != MQ_FMT_GGUF || o->device >= 0 || mq_dist_size() > 1))
        return mq_err(MOEQ_E_ARG, "llama.cpp's K-quants are written as GGUF, by one process on the CPU");
    if (sch != MQ_QS_NVFP4 && sch != MQ_QS_INT4 && sch != MQ_QS_KQUANT)
        return mq_err(MOEQ_E_ARG, "scheme %s cannot be written as a checkpoint", mq_qscheme_name(sch));
    if (sch == MQ_QS_NVFP4 && o->format == MQ_FMT_GPTQ)
        return mq_err(MOEQ_E_ARG, "--format gptq holds INT4 only (use compressed-tensors or modelopt for NVFP4)");
    if (sch == MQ_QS_INT4 && o->format == MQ_FMT_MODELOPT)
        return mq_err(MOEQ_E_ARG, "--format modelopt holds NVFP4 only (use compressed-tensors or gptq for INT4)");
    if (o->act_quant && sch != MQ_QS_NVFP4)
        return mq_err(MOEQ_E_ARG, "activation quantization is only defined for NVFP4");
    if (o->format == MQ_FMT_GPTQ && o->spec.asym && o->spec.int4_zero_min < 1)
        return mq_err(MOEQ_E_ARG, "GPTQ v1 cannot store a zero point of 0: set int4_zero_min to 1");
    if (o->gptq && !o->calib.path) return mq_err(MOEQ_E_ARG, "GPTQ needs a calibration file");
    if (o->act_quant && !o->gptq && !o->act_calib)
        return mq_err(MOEQ_E_ARG, "W4A4 NVFP4 needs calibration activations for its input scales");
    if (o->max_memory < 0) return mq_err(MOEQ_E_ARG, "--max-memory must be positive");
    if (o->expert_chunk < 0) return mq_err(MOEQ_E_ARG, "--expert-chunk must be positive");
    if (o->act_calib_tokens < 1) return mq_err(MOEQ_E_ARG, "--calib-tokens must be >= 1");
    return MOEQ_OK;
}

/* A report is written after the checkpoint is in place, so a folder that cannot take it must be
 * refused before any work: found at the end, the run failed with its checkpoint published. The
 * report may go into OUT_DIR itself, which exists by then. */
static moeq_status check_report_dir(const char *path, const char *out_dir, const char *what) {
    if (!path) return MOEQ_OK;
    const char *slash = strrchr(path, '/');
    if (!slash) return MOEQ_OK;   /* the working directory */
    size_t n = (size_t)(slash - path);
    while (n > 1 && path[n - 1] == '/') n--;
    char *dir = n ? mq_strndup(path, n) : mq_strdup("/");
    if (!dir) return MOEQ_E_NOMEM;
    moeq_status s = MOEQ_OK;
    struct stat sb;
    if (strcmp(dir, out_dir) != 0 && (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)))
        s = mq_err(MOEQ_E_NOTFOUND, "%s: cannot write the %s there: %s is not a directory", path, what, dir);
    free(dir);
    return s;
}

/* The source's config.json, read once for the whole run: p->src_config (what the output's
 * config.json is made from), its FP8 block size and, where the run needs it (need_cfg), its
 * mq_config. GGUF output refuses what llama.cpp would compute differently here, before any
 * work. */
static moeq_status read_source(mq_pipe *p, const char *model_dir, bool need_cfg) {
    char *path = NULL;
    cJSON *j = NULL;
    moeq_status s = mq_dir_exists(model_dir) ? mq_config_file_parse(model_dir, &path, &j)
                                             : mq_err(MOEQ_E_NOTFOUND, "model directory '%s' not found", model_dir);
    if (s) return s;
    /* An FP8 block-quantized source is read dequantized (io/fp8.h), any other quantized one
     * refused; the source's quantization_config never reaches the output's config.json. */
    const cJSON *qc = cJSON_GetObjectItemCaseSensitive(j, "quantization_config");
    if (qc && !(s = mq_fp8_parse_qconfig(qc, path, &p->src_fp8)) && p->src_fp8.rows == 0)
        s = mq_err(MOEQ_E_UNSUPPORTED, "%s: the model is already quantized (quantization_config); "
                   "quantize an unquantized checkpoint (or an FP8 block-quantized one)", path);
    const mq_pipeline_opts *o = p->o;
    if (!s && o->format == MQ_FMT_GGUF) s = mq_gguf_check_config(j, model_dir, o->spec.scheme, o->act_quant);
    if (!s && need_cfg) s = mq_config_from_json(j, path, &p->src_cfg);
    if (s) {
        cJSON_Delete(j);
    } else {
        cJSON_DeleteItemFromObjectCaseSensitive(j, "quantization_config");
        const cJSON *mt = cJSON_GetObjectItemCaseSensitive(j, "model_type");
        p->mixtral = cJSON_IsString(mt) && strcmp(mt->valuestring, "mixtral") == 0;
        p->src_config = j;
    }
    free(path);
    return s;
}

/* The first multi-token-prediction layer of the source (its num_hidden_layers), when the config
 * declares such layers (num_nextn_predict_layers, or transformers 5's num_mtp_layers, > 0); 0
 * otherwise. */
static int mtp_first_layer(const cJSON *cfg) {
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(cfg, "num_nextn_predict_layers");
    if (!cJSON_IsNumber(n)) n = cJSON_GetObjectItemCaseSensitive(cfg, "num_mtp_layers");
    const cJSON *L = cJSON_GetObjectItemCaseSensitive(cfg, "num_hidden_layers");
    return cJSON_IsNumber(n) && n->valuedouble > 0 && cJSON_IsNumber(L) && L->valuedouble > 0
               ? (int)L->valuedouble : 0;
}

static int layer_of(const char *name) {
    int l, n = 0;
    if (sscanf(name, "model.layers.%d.%n", &l, &n) == 1 && n > 0 && l >= 0) return l;
    return -1;
}

/* RTN W4A4: the first act_calib_tokens tokens of the text in consecutive chunks of 512 (or the
 * model's positions), the last one shorter. */
static moeq_status act_calibration(mq_pipe *p) {
    const mq_pipeline_opts *o = p->o;
    const moeq_tokenizer *tok = moeq_model_tokenizer(p->m);
    if (!tok) return mq_err(MOEQ_E_NOTFOUND, "%s: no tokenizer.json or tiktoken.model to tokenize the calibration text", p->model_dir);
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL;
    size_t n = 0;
    moeq_status s = mq_calib_read_all(o->act_calib, o->calib.field, &text, &len);
    if (!s) {
        s = moeq_tokenizer_encode(tok, text, len, &ids, &n);
        if (s) mq_err_prefix(s, "%s", o->act_calib);
    }
    free(text);
    if (!s && n == 0) s = mq_err(MOEQ_E_ARG, "%s: the calibration text has no tokens", o->act_calib);
    if (!s) {
        int64_t chunk = p->c->max_pos > 0 && p->c->max_pos < 512 ? p->c->max_pos : 512;
        int64_t use = (int64_t)n < o->act_calib_tokens ? (int64_t)n : o->act_calib_tokens;
        s = mq_calib_cover(ids, use, chunk, &p->calib);
    }
    free(ids);
    return s;
}

static moeq_status embed_all(mq_pipe *p) {
    float *tmp = mq_alloc_array((size_t)p->LD, sizeof(float), "embeddings");
    if (!tmp) return MOEQ_E_NOMEM;
    moeq_status s = MOEQ_OK;
    for (int64_t i = p->s_lo; i < p->s_hi && !s; i++) {   /* several ranks: this rank's share */
        s = mq_lazy_embed(p->lz, p->calib.ids[i], p->calib.len[i], tmp);
        if (!s) mq_actbuf_put(&p->X, (size_t)(i * p->LD), (size_t)(p->calib.len[i] * p->c->D), tmp);
        if (!s && p->target) mq_actbuf_put(&p->XF, (size_t)(i * p->LD), (size_t)(p->calib.len[i] * p->c->D), tmp);
    }
    mq_free(tmp);
    return s;
}

static moeq_status alloc_activations(mq_pipe *p) {
    const size_t n = (size_t)(p->calib.n * p->LD);
    mq_act_storage k = p->mp.storage;
    if (!p->work_dir) {
        /* a rank past 0 has no work directory: its activation files (if on disk) go beside it,
         * in a directory of its own that goes when the run ends */
        const char *base = p->o->work_dir;
        p->work_dir = base ? mq_asprintf("%s.rank%d", base, p->rank)
                           : mq_asprintf("%s.moeq-work.rank%d", p->out_dir, p->rank);
        if (!p->work_dir) return mq_err(MOEQ_E_NOMEM, "out of memory");
        if (k == MQ_ACT_DISK) {
            if (mkdir(p->work_dir, 0755) != 0 && errno != EEXIST)
                return mq_err(MOEQ_E_IO, "%s: cannot create: %s", p->work_dir, strerror(errno));
            p->rank_dir = true;
        }
    }
    char *px = mq_path_join(p->work_dir, "x.bin"), *px2 = mq_path_join(p->work_dir, "x2.bin"),
         *pn = mq_path_join(p->work_dir, "xn.bin"), *po = mq_path_join(p->work_dir, "out.bin"),
         *pf = mq_path_join(p->work_dir, "xf.bin"), *pof = mq_path_join(p->work_dir, "outf.bin");
    moeq_status s = px && px2 && pn && po && pf && pof ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s) s = mq_actbuf_init(&p->X, k, n, px, "calibration activations");
    if (!s && k == MQ_ACT_DISK) s = mq_actbuf_init(&p->X2, k, n, px2, "calibration activations");
    if (!s && p->seq && !p->tseq) s = mq_actbuf_init(&p->XN, k, n, pn, "FFN inputs");
    if (!s) s = mq_actbuf_init(&p->OUT, k == MQ_ACT_DISK ? k : MQ_ACT_RAM, n, po, "FFN outputs");
    /* asymmetric calibration: the unquantized model's stream, stored as the quantized one */
    if (!s && p->target) s = mq_actbuf_init(&p->XF, k, n, pf, "unquantized calibration activations");
    if (!s && p->target) s = mq_actbuf_init(&p->OUTF, k == MQ_ACT_DISK ? k : MQ_ACT_RAM, n, pof, "unquantized FFN outputs");
    MQ_FREE_EACH(px, px2, pn, po, pf, pof);
    if (s) return s;
    if (p->c->n_experts > 0) {
        size_t r = (size_t)(p->calib.n * p->calib.max_len * p->c->top_k);
        p->sel_a = mq_alloc_array(r, sizeof(int32_t), "routing");
        p->w_a = mq_alloc_array(r, sizeof(float), "routing");
        if (!p->sel_a || !p->w_a) return MOEQ_E_NOMEM;
        if (p->target) {
            p->sel_f = mq_alloc_array(r, sizeof(int32_t), "routing");
            p->w_f = mq_alloc_array(r, sizeof(float), "routing");
            if (!p->sel_f || !p->w_f) return MOEQ_E_NOMEM;
        }
        if (p->seq) {
            p->sel_b = mq_alloc_array(r, sizeof(int32_t), "routing");
            p->w_b = mq_alloc_array(r, sizeof(float), "routing");
            if (!p->sel_b || !p->w_b) return MOEQ_E_NOMEM;
        }
    }
    if (p->gpu) {   /* every sample crosses the bus to and from these, several times a layer */
        double t0 = mq_now();
        mq_actbuf *bufs[] = {&p->X, &p->X2, &p->XN, &p->OUT};
        size_t pinned = 0;
        for (int i = 0; i < 4; i++) {
            mq_actbuf_pin(bufs[i], p->gpu);
            if (bufs[i]->pinned) pinned += bufs[i]->n * sizeof(float);
        }
        if (pinned) mq_info("calibration activations page-locked for the GPU: %.2f GB in %.2f s", (double)pinned / 1e9,
                            mq_now() - t0);
    }
    return mq_state_new_ex(p->m, (int32_t)p->calib.max_len, false, &p->state);
}

/* Hadamard blocks as wide as the scheme's groups (NVFP4 16, INT4 its group size; 64 per
 * channel), as MR-GPTQ matches them: the best of the blocks measured on every fixture
 * (docs/results/gptq_results.md); halved until they divide the hidden size. */
static int default_rotate_block(const mq_qspec *spec, int64_t D) {
    int b = spec->group_size > 0 ? spec->group_size : 64;
    while (b > 2 && (D % b || (b & (b - 1)))) b /= 2;
    return b;
}

/* --rotate residual: refused before any work where it is not exact (model/rotate.h); the norms
 * read, the lazy model told; a tied model is untied (the output's config says so). */
static moeq_status rotation_setup(mq_pipe *p, const char *model_dir, bool *untie) {
    /* the source's config as read_source parsed it (the lazy model took it where it calibrates) */
    const mq_config *c = p->m ? &p->m->cfg : &p->src_cfg;
    int b = p->o->rotate_block > 0 ? p->o->rotate_block : default_rotate_block(&p->o->spec, c->D);
    moeq_status s = mq_rotation_check(c, b);
    if (!s) s = mq_rotation_init(&p->rot, c, p->st, b, MQ_ROTATE_SEED);
    *untie = c->tie_embeddings;
    if (s) return mq_err_prefix(s, "%s", model_dir);
    p->rotated = true;
    if (p->lz) mq_lazy_set_rotation(p->lz, &p->rot);
    if (*untie) {
        cJSON_DeleteItemFromObjectCaseSensitive(p->src_config, "tie_word_embeddings");
        if (!cJSON_AddBoolToObject(p->src_config, "tie_word_embeddings", false))
            return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    mq_info("%s: residual stream rotated (Hadamard blocks of %d, signs from seed %#llx)%s",
            model_dir, b, (unsigned long long)MQ_ROTATE_SEED, *untie ? "; lm_head untied" : "");
    return MOEQ_OK;
}

/* The memory of the largest unquantized tensor the rotation rewrites (layer_quantize.c
 * put_rotated). */
static void rotated_bytes(mq_pipe *p) {
    int layer;
    int64_t most = 0;
    for (size_t i = 0; i < p->plan.n_pass; i++) {
        const mq_plan_pass *t = &p->plan.pass[i];
        if (t->raw || mq_rot_classify(t->name, &layer) == MQ_ROT_NONE) continue;
        const int64_t cols = t->src->ndim ? t->src->shape[t->src->ndim - 1] : 1;
        const int64_t piece = 4 * (cols < MQ_ROT_PIECE ? MQ_ROT_PIECE : cols);
        if ((int64_t)t->src->nbytes + piece > most) most = (int64_t)t->src->nbytes + piece;
    }
    for (size_t i = 0; i < p->plan.n_items; i++) {   /* kept Linears: at most one weight in fp32 */
        const mq_plan_item *it = &p->plan.items[i];
        const int64_t n = it->rows * it->cols;
        if (!it->quantize && n * (4 + (int64_t)moeq_dtype_size(it->src->dtype)) > most)
            most = n * (4 + (int64_t)moeq_dtype_size(it->src->dtype));
    }
    p->rot_bytes = most;
}

static void pipe_free(mq_pipe *p) {
    mq_work_join(p);   /* nothing may still write from behind the layers (a no-op normally) */
    mq_rotation_free(&p->rot);
    mq_actbuf_free(&p->X);
    mq_actbuf_free(&p->X2);
    mq_actbuf_free(&p->XN);
    mq_actbuf_free(&p->OUT);
    mq_actbuf_free(&p->XF);
    mq_actbuf_free(&p->OUTF);
    if (p->rank_dir) mq_remove_tree(p->work_dir);
    MQ_RELEASE_EACH(p->sel_f, p->w_f, p->sel_a, p->sel_b, p->w_a, p->w_b);
    mq_state_free(p->state);
    mq_gpu_attn_free(p->gatt);
    mq_gpu_mlp_free(p->gx);
    mq_gpu_mlp_free(p->gx_ahead);
    mq_gpu_buf_free(p->gout);
    mq_gpu_buf_free(p->gffn_xn);
    mq_gpu_buf_free(p->gffn_h);
    mq_gpu_buf_free(p->gbound);
    mq_gpu_buf_free(p->gin);
    mq_gpu_close(p->gpu);
    mq_ckpt_writer_close(p->w);
    for (int l = 0; p->layers && l < p->plan.n_layers; l++) cJSON_Delete(p->layers[l].modules);
    MQ_FREE_EACH(p->layers, p->decl_layer, p->item_done, p->recipe_table);
    cJSON_Delete(p->budget_json);
    mq_out_plan_free(&p->plan);
    mq_calib_free(&p->calib);
    free(p->balance_record);
    mq_free(p->snap_spare);
    mq_readahead_cancel(&p->ahead);
    if (p->lz) mq_lazy_close(p->lz);
    else mq_st_close(p->st);
    cJSON_Delete(p->src_config);
    mq_config_free(&p->src_cfg);
    cJSON_Delete(p->manifest);
    MQ_FREE_EACH(p->out_dir, p->work_dir, p->build_dir);
    mq_mem_release();   /* the blocks kept for reuse between chunks and layers go back now */
}

/* The GPTQ totals of every layer's module records (those of resumed layers included). */
static void sum_modules(mq_pipe *p) {
    mq_pipeline_result *r = p->res;
    for (int l = 0; l < p->plan.n_layers; l++) {
        const cJSON *m;
        cJSON_ArrayForEach(m, p->layers[l].modules) {
            r->linears++;
            const cJSON *how = cJSON_GetObjectItemCaseSensitive(m, "method");
            bool gptq = cJSON_IsString(how) && strcmp(how->valuestring, "gptq") == 0;
            bool rtn = cJSON_IsString(how) && strcmp(how->valuestring, "rtn") == 0;
            r->fallbacks += !gptq;
            const cJSON *a = cJSON_GetObjectItemCaseSensitive(m, "loss"),
                        *b = cJSON_GetObjectItemCaseSensitive(m, "rtn_loss");
            if (rtn || !cJSON_IsNumber(a) || !cJSON_IsNumber(b)) continue;
            r->loss += a->valuedouble;
            r->rtn_loss += b->valuedouble;
            r->worse_than_rtn += a->valuedouble > b->valuedouble;
        }
        r->seconds_forward += p->layers[l].forward;
        r->seconds_hessian += p->layers[l].hessian;
        r->seconds_gptq += p->layers[l].gptq;
        r->seconds_write += p->layers[l].write;
        r->seconds_read += p->layers[l].read;
    }
}

static void log_layer(const mq_pipe *p, int l, double t_start) {
    const mq_layer_report *lr = &p->layers[l];
    double el = mq_now() - t_start;
    double left = mq_engine_progress_eta(&p->progress, p->units_run0, el);
    char chunks[48] = "";
    if (lr->chunks > 0) snprintf(chunks, sizeof chunks, ", %d expert chunk%s", lr->chunks, lr->chunks > 1 ? "s" : "");
    char ranks[96] = "";
    if (p->ranks > 1)
        snprintf(ranks, sizeof ranks, ", waiting for other ranks %.1f, moving data %.1f", lr->wait, lr->exchange);
    char snap[96] = "";
    if (lr->snapshot >= 0.05)
        snprintf(snap, sizeof snap, ", then %.1f s to record it (the record before %.1f, activations %.1f)",
                 lr->snapshot, lr->snapshot_sync, lr->snapshot_copy);
    mq_info("layer %d/%d: %.1f s (read %.1f, forward %.1f of which attention %.1f, Hessians %.1f, GPTQ %.1f, "
            "write %.1f%s)%s%s, peak %.2f GB; about %.0f s left", l + 1, p->plan.n_layers, lr->total,
            lr->read, lr->forward, lr->attention, lr->hessian, lr->gptq, lr->write, ranks, chunks, snap,
            (double)lr->peak_anon / 1e9, left);
}

/* Layer l through the engine's loop (a client that reads its own parts, a chunk of experts at a
 * time, and swaps its boundary pair itself: the replays of a resume call mq_pipe_layer too). */
static moeq_status layer_step(void *user, int k, int l) {
    (void)k;
    mq_pipe *p = user;
    moeq_status s = MOEQ_OK;
    if (p->replay) {
        mq_info("recomputing the activations through layer %d/%d%s", l + 1, p->plan.n_layers, p->replay_from);
        return mq_pipe_layer(p, l, true);
    }
    const double t_layers = p->t_layers;
    mq_mem_watch_take_peak();
    if (p->calibrate) {
        s = mq_pipe_layer(p, l, false);
    } else {
        double t0 = mq_now(), c0 = mq_cpu_now(), pool0 = mq_pool_seconds();
        s = mq_pipe_layer_rtn(p, l);
        if (!s) s = mq_pipe_write_passthrough(p, l);
        p->layers[l].pooled = mq_pool_seconds() - pool0;
        p->layers[l].total = mq_now() - t0;
        p->layers[l].cpu_total = mq_cpu_now() - c0;
        mq_pipe_progress(p, p->mp_units.rtn_layer);
    }
    p->layers[l].peak_anon = mq_mem_watch_take_peak();
    if (!s && p->w) s = mq_work_layer_done(p, l);
    if (p->ranks > 1) {
        char step[48];
        snprintf(step, sizeof step, "layer %d: done", l);
        s = mq_dist_agree(s, step);
        if (!s) p->layers_done = l + 1;
    }
    if (!s && p->calibrate && p->rank == 0) log_layer(p, l, t_layers);
    if (!s && p->res->layers_run < 512) {
        const mq_layer_report *lr = &p->layers[l];
        p->res->layer[p->res->layers_run++] = (mq_layer_stats){
            lr->forward, lr->attention, lr->hessian, lr->gptq, lr->write, lr->total,
            lr->cpu_forward, lr->cpu_attention, lr->cpu_hessian, lr->cpu_gptq, lr->cpu_write,
            lr->cpu_total, lr->wait, lr->exchange, lr->peak_anon, lr->chunks, lr->read, lr->cpu_read,
            lr->pooled, lr->sim_tasks, lr->sim_span};
    }
    return s;
}

/* Layers [first, end) on the streaming engine (stream/engine.h): one stream, the layer's own
 * stages in one step; Ctrl-C polled between layers by a single process (ranks poll inside their
 * steps, where they agree). replay: the finished layers' activations recomputed for a resume. */
static moeq_status run_layers(mq_pipe *p, int first, int end, bool replay) {
    p->replay = replay;
    mq_engine_client e = {.user = p, .n_streams = 1, .first = first, .end = end,
                          .n_layers = {p->plan.n_layers}, .run_layer = layer_step,
                          .interrupt_msg = p->ranks <= 1 ? "quantization interrupted" : NULL};
    moeq_status s = mq_engine_run(&e);
    p->replay = false;
    return s;
}

static moeq_status run(mq_pipe *p) {
    const mq_pipeline_opts *o = p->o;
    moeq_status s = MOEQ_OK;
    if (p->w && !mq_work_globals_done(p)) {   /* rank 0 writes */
        s = mq_pipe_write_passthrough(p, -1);
        if (!s) s = mq_work_globals_written(p);
    }
    if ((s = mq_dist_agree(s, "the global tensors"))) return s;
    const int n_layers = p->plan.n_layers, start = p->layers_done;
    p->first_layer = start;
    p->res->layers_resumed = start;
    /* the units of the finished layers count as done */
    for (int l = 0; l < start; l++)
        atomic_fetch_add(&p->progress.done, p->progress.total / (n_layers > 0 ? n_layers : 1));
    if (p->calibrate && start < n_layers) {
        s = alloc_activations(p);
        int snap = 0;   /* the snapshot's layer: the layers from there to start are replayed */
        if (!s && start > 0 && p->rank == 0) s = mq_work_load_boundary(p, start, &snap);
        bool have = snap > 0 && snap == start;
        if (p->ranks <= 1 && snap > 0 && snap < start) {
            snprintf(p->replay_from, sizeof p->replay_from, " (from the snapshot at the input of layer %d)",
                     snap + 1);
            s = run_layers(p, snap, start, true);
            if (s) return s;
            have = true;
        }
        if (p->ranks > 1) {
            /* the snapshot from rank 0; without one, recomputing the finished layers needs the
             * checkpoint being written, which only rank 0 has */
            if ((s = mq_dist_agree(s, "the resumed activations"))) return s;
            int32_t h = have;
            if ((s = mq_dist_bcast(&h, sizeof h, 0, "the resumed activations"))) return s;
            have = h != 0;
            if (start > 0 && !have)
                s = mq_err(MOEQ_E_NOTFOUND, "%s: no usable activation snapshot at layer %d to resume "
                           "from with %d ranks: resume without mpirun once (one process recomputes "
                           "them), or start over", p->work_dir ? p->work_dir : "the work directory",
                           start, p->ranks);
            if ((s = mq_dist_agree(s, "the resumed activations"))) return s;
            for (int k = 0; have && k < 1 + p->target; k++) {   /* every sample from rank 0 (both streams) */
                size_t es;
                char *at = mq_actbuf_raw(k ? &p->XF : &p->X, 0, &es);
                s = mq_dist_bcast(at, (size_t)(p->calib.n * p->LD) * es, 0, "the resumed activations");
                if (s) return s;
            }
        }
        if (s) return s;
        if (!have) {
            if ((s = embed_all(p))) return s;
            /* a resumed run whose snapshot is gone: the finished layers again, from what the
             * checkpoint holds */
            p->replay_from[0] = 0;
            s = run_layers(p, 0, start, true);
            if (s) return s;
        }
    }
    int end = o->stop_after > 0 && start + o->stop_after < n_layers ? start + o->stop_after : n_layers;
    const double t_layers = mq_now();   /* after any recomputation of finished layers */
    p->units_run0 = atomic_load(&p->progress.done);
    p->t_layers = t_layers;
    if (!s) s = run_layers(p, start, end, false);
    if (!s) s = mq_work_snapshot_wait(p);   /* a run that stops early (--stop-after) names it */
    return s;
}

/* Opening the GPU (its context, streams, cuBLAS and cuSOLVER handles) runs on a thread of its
 * own while the config, the model's index and the tokenizer are read and the calibration text is
 * tokenized, and is waited for before the memory plan, the first step that asks the device: the
 * first layer started about 0.2 s sooner on an H200. The probe first, so a machine without the
 * device still fails at once. MOEQ_DEBUG_GPU_OPEN_AHEAD=0 opens it in place (to measure it). */
/* Ctrl-C between the steps before the layers (the steps that can take long poll inside) */
static moeq_status interrupted(void) {
    return moeq_interrupted() ? mq_err(MOEQ_E_INTERRUPTED, "quantization interrupted") : MOEQ_OK;
}

struct mq_gpu_opening {
    pthread_t th;
    int device;
    mq_gpu *gpu;
    moeq_status st;
    char msg[1024];   /* the thread's error message (messages are per thread) */
};

static void *gpu_open_main(void *arg) {
    struct mq_gpu_opening *g = arg;
    g->st = mq_gpu_open(g->device, &g->gpu);
    if (g->st) snprintf(g->msg, sizeof g->msg, "%s", moeq_last_error());
    return NULL;
}

static moeq_status gpu_open_start(mq_pipe *p, int device) {
    moeq_status s = mq_gpu_probe(device);
    if (s) return s;
    const char *env = mq_env(MQ_ENV_GPU_OPEN_AHEAD);
    if (env && strcmp(env, "0") == 0) return mq_gpu_open(device, &p->gpu);
    struct mq_gpu_opening *g = calloc(1, sizeof *g);
    if (!g) return mq_err(MOEQ_E_NOMEM, "out of memory");
    g->device = device;
    if (pthread_create(&g->th, NULL, gpu_open_main, g) != 0) {   /* then in place */
        free(g);
        return mq_gpu_open(device, &p->gpu);
    }
    p->opening = g;
    return MOEQ_OK;
}

/* Waits for the opening thread; its device becomes p->gpu (also after an error elsewhere, so
 * that it is closed with the rest: `quiet` then keeps that error's message). */
static moeq_status gpu_open_wait(mq_pipe *p, bool quiet) {
    struct mq_gpu_opening *g = p->opening;
    if (!g) return MOEQ_OK;
    pthread_join(g->th, NULL);
    p->opening = NULL;
    p->gpu = g->gpu;
    moeq_status s = g->st;
    if (s && !quiet) mq_err(s, "%s", g->msg);
    free(g);
    return s;
}

/* The device open: its line in the log and the precision asked for. */
static moeq_status gpu_ready(mq_pipe *p) {
    moeq_status s = gpu_open_wait(p, false);
    if (s || !p->gpu) return s;
    const mq_pipeline_opts *o = p->o;
    /* the bound before anything is put on the device; its peak from here */
    mq_gpu_set_memory_limit(p->gpu, o->max_gpu_memory);
    mq_gpu_memory_reset_peak(p->gpu);
    mq_gpu_info gi;
    mq_gpu_get_info(p->gpu, &gi);
    mq_info("GPTQ on cuda:%d, %s (compute %d.%d, %d SMs, %.1f GB free of %.1f GB)%s", gi.device, gi.name,
            gi.cc_major, gi.cc_minor, gi.sm_count, (double)gi.mem_free / 1e9, (double)gi.mem_total / 1e9,
            o->gpu_precision == MOEQ_GPU_TF32     ? ", TF32 products"
            : o->gpu_precision == MOEQ_GPU_TF32X3 ? ", products as three TF32 ones (tf32x3)"
                                                  : "");
    return o->gpu_precision ? mq_gpu_set_precision(p->gpu, o->gpu_precision) : MOEQ_OK;
}

/* K-quants: the model's counts the recipe's rules read (layers, experts, a tied output). */
static moeq_status kquant_recipe(mq_pipe *p) {
    return mq_gguf_recipe_init(&p->recipe, p->src_config, p->model_dir, p->o->spec.kq, p->o->kq_mixture);
}

/* A Linear's block type under the recipe (mq_plan_opts.spec_for), the run's scale search kept. */
static bool kquant_spec(void *user, const mq_plan_item *it, mq_qspec *spec) {
    const mq_pipe *p = user;
    int layer;
    const mq_gguf_cat cat = mq_gguf_category_hf(it->module, &layer);
    const int t = mq_gguf_recipe_type(&p->recipe, cat, layer, it->cols);
    if (t < 0) return false;
    const mq_qspec run = p->o->spec;
    *spec = mq_kq_spec((mq_kq_type)t);
    spec->mse = run.mse;
    spec->mse_steps = run.mse_steps;
    spec->mse_lo = run.mse_lo;
    spec->mse_hi = run.mse_hi;
    return true;
}

/* The finished checkpoint: config and tokenizer files, renamed over OUT_DIR. */
static moeq_status finish(mq_pipe *p) {
    size_t n_kept = 0;
    const char **kept = malloc((p->plan.n_items + 1) * sizeof *kept);
    if (!kept) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t i = 0; i < p->plan.n_items; i++)
        if (!p->plan.items[i].quantize) kept[n_kept++] = p->plan.items[i].module;
    moeq_status s = mq_ckpt_writer_finish(p->w, p->src_config, p->model_dir, kept, n_kept);
    free(kept);
    mq_ckpt_writer_close(p->w);
    p->w = NULL;
    if (s) return s;
    mq_fault_point("rename", 0, 0);
    if (p->o->format == MQ_FMT_GGUF)
        return mq_gguf_export_recipe(p->build_dir, p->out_dir, p->o->gguf_rest,
                                     p->o->spec.scheme == MQ_QS_KQUANT ? &p->recipe : NULL);
    return mq_ckpt_publish(p->build_dir, p->out_dir);
}

moeq_status mq_pipeline_run(const char *model_dir, const char *out_dir, const mq_pipeline_opts *o,
                            mq_pipeline_result *result) {
    mq_pipeline_result res;
    memset(&res, 0, sizeof res);
    if (result) memset(result, 0, sizeof *result);
    mq_env_reload();   /* the run sees the environment switches as they are when it starts */
    double t0 = mq_now();
    moeq_status s = check_opts(o);
    if (s) return s;
    mq_pipe pp, *p = &pp;
    memset(p, 0, sizeof *p);
    mq_engine_progress_init(&p->progress, "quantize", 0);   /* the plan adds its units */
    p->o = o;
    p->res = &res;
    p->lock_fd = -1;
    p->model_dir = model_dir;
    p->rank = mq_dist_rank();
    p->ranks = mq_dist_size();
    p->share_gptq = 1.0;
    mq_dist_reset();
    mq_dist_set_timeout(o->mpi_timeout);
    size_t olen = strlen(out_dir);
    while (olen > 1 && out_dir[olen - 1] == '/') olen--;
    p->out_dir = mq_strndup(out_dir, olen);
    if (!p->out_dir) return MOEQ_E_NOMEM;
    bool exists = false;
    bool watching = false, work = false;
    if (p->ranks > 1) {   /* before any rank can fail alone */
        const char *shares = mq_env(MQ_ENV_DIST_SHARES);
        int32_t fit = p->rank == 0 && shares && strcmp(shares, "measured") == 0;
        if ((s = mq_dist_bcast(&fit, sizeof fit, 0, "the options"))) goto done;
        p->fit_shares = fit != 0;
    }
    if (p->rank == 0 && (s = mq_ckpt_check_out(model_dir, p->out_dir, o->force, &exists))) goto done;
    if (p->rank == 0 && !o->dry_run &&
        ((s = check_report_dir(o->report_path, p->out_dir, "report")) ||
         (s = check_report_dir(o->report_html_path, p->out_dir, "report page"))))
        goto done;
    /* first, so that a missing GPU costs nothing; opened beside what follows up to the plan. A
     * dry run with --max-gpu-memory plans against the bound where there is no GPU to open */
    if (o->gptq && o->device >= 0 && (s = gpu_open_start(p, o->device))) {
        if (!(o->dry_run && o->max_gpu_memory > 0)) goto done;
        mq_info("no GPU at hand (%s): the plan's GPU memory is against --max-gpu-memory alone", moeq_last_error());
        s = MOEQ_OK;
    }
    p->calibrate = o->gptq || o->act_quant;
    if ((s = read_source(p, model_dir, p->calibrate || o->rotate_block))) goto done;
    p->seq = o->gptq && o->sequential;
    p->tseq = p->seq && o->true_sequential;
    p->target = o->target_share > 0;
    if (p->target && (!p->seq || p->tseq || o->device >= 0 || o->expert_weighting || o->n_damp_sweep)) {
        s = mq_err(MOEQ_E_ARG, "the unquantized target (asymmetric calibration) runs with GPTQ in sequential mode, "
                   "not true-sequential, on the CPU, without expert weighting or a damping sweep");
        goto done;
    }
    if (p->calibrate) {
        if ((s = mq_lazy_open_config(model_dir, &p->src_cfg, true, &p->lz))) goto done;
        p->m = mq_lazy_model_of(p->lz);
        p->c = &p->m->cfg;
        p->st = (mq_st *)mq_lazy_st(p->lz);
        if (!moeq_model_tokenizer(p->m)) {
            s = mq_err(MOEQ_E_NOTFOUND, "%s: no tokenizer.json or tiktoken.model to tokenize the calibration text", model_dir);
            goto done;
        }
    } else if ((s = mq_st_open_dir_blocks(model_dir, p->src_fp8, &p->st))) {
        goto done;
    }
    bool untie = false;
    if (o->rotate_block && (s = rotation_setup(p, model_dir, &untie))) goto done;
    if (o->spec.scheme == MQ_QS_KQUANT && (s = kquant_recipe(p))) goto done;
    /* (a dry run plans with the file type's rules: the probe is compute) */
    if (o->spec.scheme == MQ_QS_KQUANT && o->target_bpw > 0 && !o->dry_run && (s = mq_pipe_kquant_budget(p))) goto done;
    mq_plan_opts po = {o->format, o->spec,
                       o->gptq && o->g.act_order && o->g.groups == MQ_GPTQ_GROUPS_GIDX &&
                           o->spec.scheme == MQ_QS_INT4,
                       o->act_quant, o->ignore, o->n_ignore, mtp_first_layer(p->src_config),
                       o->drop_mtp, untie, o->spec.scheme == MQ_QS_KQUANT ? kquant_spec : NULL, p};
    if ((s = mq_out_plan_build(p->st, p->mixtral, &po, &p->plan))) goto done;
    if (p->plan.n_mtp_pass || p->plan.n_mtp_dropped)
        mq_info("%s: %d tensors of the multi-token-prediction layers %s", model_dir,
                p->plan.n_mtp_pass + p->plan.n_mtp_dropped,
                o->drop_mtp ? "left out (--drop-mtp)" : "passed through unchanged");
    if (o->drop_mtp && po.mtp_from > 0) {   /* the output has none */
        cJSON_DeleteItemFromObjectCaseSensitive(p->src_config, "num_nextn_predict_layers");
        cJSON_DeleteItemFromObjectCaseSensitive(p->src_config, "num_mtp_layers");
        if (!cJSON_AddNumberToObject(p->src_config, "num_nextn_predict_layers", 0)) {
            s = mq_err(MOEQ_E_NOMEM, "out of memory");
            goto done;
        }
    }
    if (p->rotated) rotated_bytes(p);
    if (p->calibrate && p->plan.n_layers < p->c->n_layers) p->plan.n_layers = p->c->n_layers;
    p->decl_layer = calloc(p->plan.n_decls ? p->plan.n_decls : 1, sizeof *p->decl_layer);
    p->item_done = calloc(p->plan.n_items ? p->plan.n_items : 1, 1);
    p->layers = calloc((size_t)(p->plan.n_layers > 0 ? p->plan.n_layers : 1), sizeof *p->layers);
    if (!p->decl_layer || !p->item_done || !p->layers) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < p->plan.n_decls; i++) {
        p->decl_layer[i] = layer_of(p->plan.decls[i].name);
        if (po.mtp_from > 0 && p->decl_layer[i] >= po.mtp_from)
            p->decl_layer[i] = -1;   /* MTP: with the global tensors */
        int64_t numel = 1;
        for (int d = 0; d < p->plan.decls[i].ndim; d++) numel *= p->plan.decls[i].shape[d];
        p->plan_bytes += (uint64_t)numel * moeq_dtype_size(p->plan.decls[i].dtype);
    }
    for (int l = 0; l < p->plan.n_layers; l++) {
        p->layers[l].layer = l;
        if (!(p->layers[l].modules = cJSON_CreateArray())) {
            s = mq_err(MOEQ_E_NOMEM, "out of memory");
            goto done;
        }
    }
    p->ckpt_opts = (mq_ckpt_opts){o->format, o->spec, o->act_quant, po.g_idx, o->max_shard_bytes};
    if (!o->dry_run) {   /* from here: an expert-balanced calibration streams the model first */
        mq_mem_watch_start();
        watching = true;
    }
    if (o->gptq) {
        mq_calib_opts co = o->calib;
        if (o->calib_balance) {   /* the candidates to choose from */
            co.nsamples = o->calib_pool > 0 ? o->calib_pool : 4 * o->calib.nsamples;
            co.pool = true;
        }
        s = mq_calib_load(moeq_model_tokenizer(p->m), &co, &p->calib);
        if (!s && o->calib_balance) {
            p->LD = p->calib.max_len * p->c->D;
            s = mq_pipe_balance(p);
        }
    } else if (o->act_quant) {
        s = act_calibration(p);
    }
    if (!s) s = interrupted();   /* Ctrl-C during the calibration's tokenizing */
    if (s) goto done;
    p->LD = p->calibrate ? p->calib.max_len * p->c->D : 0;
    p->s_lo = 0;
    p->s_hi = p->calib.n;
    mq_dist_share(p->calib.n, p->rank, p->ranks, &p->s_lo, &p->s_hi);
    if ((s = gpu_ready(p)) || (s = interrupted())) goto done;
    if ((s = mq_plan_memory(p))) goto done;
    if ((s = mq_dist_agree(s, "planning"))) goto done;
    if (o->dry_run) mq_plan_estimate_time(p);
    res.plan = p->mp;
    res.samples = p->calib.n;
    res.tokens = p->calib.total;
    if (o->dry_run) goto done;
    if (p->rank == 0) {   /* the work directory and the writer are rank 0's */
        s = mq_work_prepare(p);
        work = !s;
        if (!s && p->balance_record) {   /* a resume takes the choice from here */
            char *path = mq_path_join(p->work_dir, MQ_BALANCE_RECORD);
            s = path ? mq_write_file_atomic(path, p->balance_record, strlen(p->balance_record))
                     : mq_err(MOEQ_E_NOMEM, "out of memory");
            free(path);
        }
    }
    /* the packing goes on while one thread writes (export/writer.h) */
    if (!s && p->w) s = mq_ckpt_writer_behind(p->w, (size_t)mq_plan_write_behind(p));
    if (!s) s = interrupted();
    if ((s = mq_dist_agree(s, "the work directory"))) goto done;
    if (p->ranks > 1) {
        int32_t done_layers = p->layers_done;
        if ((s = mq_dist_bcast(&done_layers, sizeof done_layers, 0, "the work directory"))) goto done;
        p->layers_done = done_layers;
    }
    s = run(p);
    if (!s && !o->stop_after && p->w) s = finish(p);
    s = mq_dist_agree(s, "the checkpoint");
    res.ranks = p->ranks;
    if (!s) {
        int64_t peak = 0;
        s = mq_dist_gather_i64(mq_mem_watch_peak(), &peak, p->ranks <= 64 ? res.rank_peak : NULL, "memory");
        if (!s && p->ranks > 1 && p->rank == 0)
            for (int r = 0; r < p->ranks && r < 64; r++)
                mq_info("rank %d: peak memory %.2f GB", r, (double)res.rank_peak[r] / 1e9);
    }
    if (!s && o->report_path && !o->stop_after && p->rank == 0) {
        res.peak_anon = mq_mem_watch_peak();
        res.seconds_total = mq_now() - t0;
        sum_modules(p);
        s = mq_report_write(p, o->report_path, o->report_html_path);
    }
done:
    if (p->opening) gpu_open_wait(p, true);   /* an error before the plan: the device is closed below */
    /* a snapshot still being written: kept for the resume */
    if (s) mq_work_snapshot_wait(p);
    s = mq_dist_agree(s, "the end of the run");   /* a rank that failed early meets the others */
    mq_dist_profile_report();
    if (watching) {
        res.peak_anon = mq_mem_watch_peak();
        mq_mem_watch_stop();
    }
    if (!s && !o->dry_run) {
        if (!o->report_path) sum_modules(p);
        for (size_t i = 0; i < p->plan.n_items; i++) {
            res.n_quantized += p->plan.items[i].quantize;
            res.n_kept += !p->plan.items[i].quantize;
        }
        res.quantized_params = p->plan.quantized_params;
        res.n_tensors = (int64_t)p->plan.n_decls;
        res.bytes_written = p->plan_bytes;
        for (size_t i = 0; p->w && i < p->plan.n_decls; i++) {
            uint32_t c;
            if (!mq_ckpt_writer_crc(p->w, p->plan.decls[i].name, &c)) continue;
            res.tensors_crc = mq_crc32(res.tensors_crc, &c, sizeof c);
            res.tensors_written++;
        }
    }
    if (!work && p->lock_fd >= 0) {
        mq_work_release(p, !p->work_fresh);   /* a failed start: a new directory goes again */
    } else if (work) {
        bool keep = s && p->layers_done > 0 && !o->stop_after;
        if (s && keep)
            mq_info("the finished layers are kept in %s: the same command with --resume continues",
                    p->work_dir);
        mq_work_release(p, keep);
    }
    res.seconds_total = mq_now() - t0;
    res.plan = p->mp;
    if (p->gpu) mq_gpu_memory(p->gpu, NULL, &res.gpu_peak, NULL);
    if (!s && result) *result = res;
    else if (s && result && o->dry_run) *result = res;
    pipe_free(p);
    return s;
}
