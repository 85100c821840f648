/*
 * The public quantization entry point (moeq_quantize in include/moeq.h): checks the public
 * options, translates them into the export driver's (export/quantize.h) and GPTQ's
 * (quant/gptq_model.h, quant/calib.h) and runs one of three flows:
 *   RTN:  mq_quantize_checkpoint with round to nearest;
 *   W4A4: the fp32 model's activation amax on the calibration text first (export/act_amax.h),
 *         then RTN (or GPTQ) with those input scales;
 *   GPTQ: mq_gptq_quantize_checkpoint (calibration, GPTQ per block, checkpoint, JSON report).
 * Settings follow `moeq quantize` exactly (the CLI is a thin layer over this file).
 */
#define PCRE2_CODE_UNIT_WIDTH 8

#include <math.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#include "export/act_amax.h"
#include "export/quantize.h"
#include "quant/gptq_model.h"

void moeq_quant_options_init(moeq_quant_options *o) {
    memset(o, 0, sizeof *o);
    o->scheme = MOEQ_QUANT_SCHEME_UNSET;
    o->method = MOEQ_QUANT_RTN;
    o->format = MOEQ_FORMAT_COMPRESSED_TENSORS;
    o->calib_tokens = 65536;
    o->gptq.nsamples = 128;
    o->gptq.seqlen = 512;
    o->gptq.sampling = MOEQ_CALIB_CHUNKS;
    o->gptq.percdamp = 0.01;
    o->gptq.block_size = 128;
    o->gptq.act_order = -1;
    o->gptq.groups = MOEQ_GPTQ_GROUPS_DYNAMIC;
    o->gptq.mse = 1;
    o->gptq.mse_weight = MOEQ_GPTQ_MSE_AUTO;
    o->gptq.mode = MOEQ_GPTQ_SEQUENTIAL;
    o->gptq.min_expert_tokens = 32;
    o->gptq.expert_fallback = MOEQ_EXPERT_FALLBACK_BLOCK;
}

#define BAD(...) mq_err(MOEQ_E_ARG, "moeq_quantize: " __VA_ARGS__)

static moeq_status check_gptq(const moeq_quant_options *o) {
    if (o->gptq.nsamples < 1)
        return BAD("gptq.nsamples must be >= 1, got %lld", (long long)o->gptq.nsamples);
    if (o->gptq.seqlen < 2)
        return BAD("gptq.seqlen must be >= 2, got %lld", (long long)o->gptq.seqlen);
    if ((unsigned)o->gptq.sampling > MOEQ_CALIB_DOCS)
        return BAD("gptq.sampling: unknown value %d", (int)o->gptq.sampling);
    if (!isfinite(o->gptq.percdamp) || o->gptq.percdamp < 0)
        return BAD("gptq.percdamp must be finite and >= 0, got %g", o->gptq.percdamp);
    if (o->gptq.block_size < 1)
        return BAD("gptq.block_size must be >= 1, got %d", o->gptq.block_size);
    if (o->gptq.act_order < -1 || o->gptq.act_order > 1)
        return BAD("gptq.act_order must be -1 (per scheme), 0 or 1, got %d", o->gptq.act_order);
    if ((unsigned)o->gptq.groups > MOEQ_GPTQ_GROUPS_GIDX)
        return BAD("gptq.groups: unknown value %d", (int)o->gptq.groups);
    if (o->gptq.mse_weight < MOEQ_GPTQ_MSE_AUTO || o->gptq.mse_weight > MOEQ_GPTQ_MSE_GPTQ)
        return BAD("gptq.mse_weight: unknown value %d", (int)o->gptq.mse_weight);
    if ((unsigned)o->gptq.mode > MOEQ_GPTQ_NONSEQUENTIAL)
        return BAD("gptq.mode: unknown value %d", (int)o->gptq.mode);
    if ((unsigned)o->gptq.expert_fallback > MOEQ_EXPERT_FALLBACK_RTN)
        return BAD("gptq.expert_fallback: unknown value %d", (int)o->gptq.expert_fallback);
    if (o->gptq.min_expert_tokens < 0)
        return BAD("gptq.min_expert_tokens must be >= 0, got %lld",
                   (long long)o->gptq.min_expert_tokens);
    if (o->gptq.true_sequential && o->gptq.mode != MOEQ_GPTQ_SEQUENTIAL)
        return BAD("gptq.true_sequential needs gptq.mode MOEQ_GPTQ_SEQUENTIAL");
    bool int4 = o->scheme == MOEQ_QUANT_INT4;
    bool act_order = o->gptq.act_order < 0 ? int4 : o->gptq.act_order != 0;
    if (o->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX && !act_order)
        return BAD("gptq.groups MOEQ_GPTQ_GROUPS_GIDX needs gptq.act_order");
    if (o->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX && !int4)
        return BAD("gptq.groups MOEQ_GPTQ_GROUPS_GIDX stores g_idx, which only INT4 checkpoints "
                   "hold");
    return MOEQ_OK;
}

/* Every field of the public options; messages name the field. */
static moeq_status check_options(const moeq_quant_options *o) {
    if (o->scheme == MOEQ_QUANT_SCHEME_UNSET)
        return BAD("scheme is required (MOEQ_QUANT_NVFP4, MOEQ_QUANT_NVFP4A16 or MOEQ_QUANT_INT4)");
    if (o->scheme < MOEQ_QUANT_NVFP4 || o->scheme > MOEQ_QUANT_INT4)
        return BAD("scheme: unknown value %d", (int)o->scheme);
    if ((unsigned)o->method > MOEQ_QUANT_GPTQ)
        return BAD("method: unknown value %d", (int)o->method);
    if ((unsigned)o->format > MOEQ_FORMAT_GPTQ)
        return BAD("format: unknown value %d", (int)o->format);
    bool nv = o->scheme != MOEQ_QUANT_INT4;
    if (nv && o->format == MOEQ_FORMAT_GPTQ) return BAD("format MOEQ_FORMAT_GPTQ holds INT4 only");
    if (!nv && o->format == MOEQ_FORMAT_MODELOPT)
        return BAD("format MOEQ_FORMAT_MODELOPT holds NVFP4 only");
    if (nv && o->asym) return BAD("asym: NVFP4 is symmetric (asym is for INT4)");
    if (nv && o->group_size != 0 && o->group_size != 16)
        return BAD("group_size: NVFP4 has groups of 16, got %d", o->group_size);
    if (!nv && o->group_size < -1)
        return BAD("group_size must be positive, -1 (per row) or 0 (default 128), got %d",
                   o->group_size);
    if (o->scheme == MOEQ_QUANT_NVFP4 && !o->calib)
        return BAD("scheme MOEQ_QUANT_NVFP4 (W4A4) needs calib for its activation scales");
    if (o->method == MOEQ_QUANT_GPTQ && !o->calib) return BAD("method MOEQ_QUANT_GPTQ needs calib");
    if (o->calib && o->scheme != MOEQ_QUANT_NVFP4 && o->method != MOEQ_QUANT_GPTQ)
        return BAD("calib is only used by scheme MOEQ_QUANT_NVFP4 and method MOEQ_QUANT_GPTQ");
    if (o->calib_tokens < 1)
        return BAD("calib_tokens must be >= 1, got %lld", (long long)o->calib_tokens);
    if (o->max_shard_bytes < 0)
        return BAD("max_shard_bytes must be >= 0 (0: 5 GB), got %lld",
                   (long long)o->max_shard_bytes);
    if (o->n_ignore < 0 || (o->n_ignore > 0 && !o->ignore))
        return BAD("ignore: %d patterns but no array", o->n_ignore);
    for (int32_t i = 0; i < o->n_ignore; i++)
        if (!o->ignore[i]) return BAD("ignore[%d] is NULL", i);
    return o->method == MOEQ_QUANT_GPTQ ? check_gptq(o) : MOEQ_OK;
}

/* The compiled ignore patterns: checked before any work (the writer would only report a bad one
 * at the end of a GPTQ run) and used by GPTQ to skip the modules the writer keeps. */
typedef struct {
    pcre2_code **re;
    int32_t n;
} ignore_set;

static void ignore_free(ignore_set *s) {
    for (int32_t i = 0; i < s->n; i++) pcre2_code_free(s->re[i]);
    free(s->re);
    memset(s, 0, sizeof *s);
}

static moeq_status ignore_compile(const moeq_quant_options *o, ignore_set *s) {
    memset(s, 0, sizeof *s);
    if (o->n_ignore == 0) return MOEQ_OK;
    s->re = calloc((size_t)o->n_ignore, sizeof *s->re);
    if (!s->re) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (; s->n < o->n_ignore; s->n++) {
        int code;
        PCRE2_SIZE off;
        s->re[s->n] = pcre2_compile((PCRE2_SPTR)o->ignore[s->n], PCRE2_ZERO_TERMINATED, 0, &code,
                                    &off, NULL);
        if (!s->re[s->n]) {
            /* the writer's wording, so RTN and GPTQ runs report it alike */
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(code, msg, sizeof msg);
            moeq_status st = mq_err(MOEQ_E_ARG, "--ignore '%s': bad regular expression at offset "
                                    "%zu: %s", o->ignore[s->n], (size_t)off, (const char *)msg);
            ignore_free(s);
            return st;
        }
    }
    return MOEQ_OK;
}

/* Match data per call: GPTQ may ask from several threads. */
static bool want_module(void *user, const char *module) {
    const ignore_set *s = user;
    bool keep = true;
    for (int32_t i = 0; i < s->n && keep; i++) {
        pcre2_match_data *md = pcre2_match_data_create_from_pattern(s->re[i], NULL);
        if (!md) continue;
        keep = pcre2_match(s->re[i], (PCRE2_SPTR)module, PCRE2_ZERO_TERMINATED, 0, 0, md, NULL) < 0;
        pcre2_match_data_free(md);
    }
    return keep;
}

/* The writer's options, as `moeq quantize` sets them. */
static void writer_options(const moeq_quant_options *po, mq_quantize_opts *o) {
    mq_ckpt_format fmt = po->format == MOEQ_FORMAT_MODELOPT ? MQ_FMT_MODELOPT
                         : po->format == MOEQ_FORMAT_GPTQ   ? MQ_FMT_GPTQ
                                                            : MQ_FMT_CT;
    bool nv = po->scheme != MOEQ_QUANT_INT4;
    mq_quantize_opts_init(o, nv ? MQ_QS_NVFP4 : MQ_QS_INT4, fmt);
    o->max_shard_bytes = (size_t)po->max_shard_bytes;
    if (!nv && po->group_size != 0) o->spec.group_size = po->group_size;
    o->spec.asym = po->asym != 0;
    /* GPTQ searches scales by default; the writer checks its spec against GPTQ's */
    o->spec.mse = po->method == MOEQ_QUANT_GPTQ ? po->gptq.mse != 0 : po->mse != 0;
    o->no_fuse = po->no_fuse != 0;
    if (po->reference) {
        /* reference.json: NVFP4 per-tensor scales, block scales clamped to [2^-9, 448];
         * INT4 symmetric amax/7, scales kept in F32 (GPTQ stores F16 whatever) */
        o->no_fuse = true;
        o->spec.nvfp4_scale_min = 0x1p-9f;
        o->spec.int4_sym_div = 7.0f;
        if (fmt == MQ_FMT_CT) o->spec.scale_dtype = MOEQ_DT_F32;
    }
    o->act_quant = po->scheme == MOEQ_QUANT_NVFP4;
    o->ignore = po->ignore;
    o->n_ignore = (int)po->n_ignore;
    o->force = po->force != 0;
}

static void gptq_options(const moeq_quant_options *po, const mq_quantize_opts *o,
                         mq_gptq_model_opts *go, mq_calib_opts *co) {
    mq_gptq_model_opts_init(go, &o->spec);
    go->spec.mse = o->spec.mse;
    go->no_fuse = o->no_fuse;
    go->gptq.percdamp = po->gptq.percdamp;
    go->gptq.block_size = po->gptq.block_size;
    if (po->gptq.mse_weight != MOEQ_GPTQ_MSE_AUTO)   /* else mq_gptq_model_opts_init's choice */
        go->gptq.mse_weight = po->gptq.mse_weight == MOEQ_GPTQ_MSE_HESSIAN ? MQ_GPTQ_MSE_HDIAG
                              : po->gptq.mse_weight == MOEQ_GPTQ_MSE_OBQ   ? MQ_GPTQ_MSE_OBQ
                              : po->gptq.mse_weight == MOEQ_GPTQ_MSE_GPTQ  ? MQ_GPTQ_MSE_LOOP
                                                                           : MQ_GPTQ_MSE_PLAIN;
    /* measured on olmoe-tiny and qwen2moe-tiny (docs/gptq_results.md): act order helps INT4
     * g128 a little and hurts NVFP4's 16-column groups */
    go->gptq.act_order = po->gptq.act_order < 0 ? o->spec.scheme == MQ_QS_INT4
                                                : po->gptq.act_order != 0;
    go->gptq.groups = po->gptq.groups == MOEQ_GPTQ_GROUPS_STATIC ? MQ_GPTQ_GROUPS_STATIC
                      : po->gptq.groups == MOEQ_GPTQ_GROUPS_GIDX ? MQ_GPTQ_GROUPS_GIDX
                                                                 : MQ_GPTQ_GROUPS_DYNAMIC;
    go->mode = po->gptq.mode == MOEQ_GPTQ_NONSEQUENTIAL ? MQ_GPTQ_NONSEQUENTIAL
                                                        : MQ_GPTQ_SEQUENTIAL;
    go->true_sequential = po->gptq.true_sequential != 0;
    go->min_expert_tokens = po->gptq.min_expert_tokens;
    go->fallback = po->gptq.expert_fallback == MOEQ_EXPERT_FALLBACK_RTN ? MQ_FALLBACK_RTN
                                                                        : MQ_FALLBACK_BLOCK;
    mq_calib_opts_init(co);
    co->path = po->calib;
    co->nsamples = po->gptq.nsamples;
    co->seqlen = po->gptq.seqlen;
    co->seed = po->gptq.seed;
    co->bos = po->gptq.calib_bos != 0;
    co->mode = po->gptq.sampling == MOEQ_CALIB_RANDOM ? MQ_CALIB_RANDOM
               : po->gptq.sampling == MOEQ_CALIB_DOCS ? MQ_CALIB_DOCS
                                                      : MQ_CALIB_CHUNKS;
}

static float amax_lookup(void *user, const char *module) {
    return mq_act_amax_get(user, module);
}

/* W4A4: activation amax of every Linear input over the first calib_tokens tokens of calib. */
static moeq_status calibrate(const char *model_dir, const char *calib, int64_t calib_tokens,
                             mq_act_amax **out) {
    moeq_model *m = NULL;
    char *text = NULL;
    size_t len = 0;
    int32_t *ids = NULL;
    size_t n = 0;
    moeq_status s = moeq_model_open(model_dir, NULL, &m);
    if (!s && !moeq_model_tokenizer(m))
        s = mq_err(MOEQ_E_NOTFOUND, "%s: no tokenizer.json to tokenize the calibration text",
                   model_dir);
    if (!s) s = mq_read_file(calib, &text, &len);
    if (!s) {
        s = moeq_tokenizer_encode(moeq_model_tokenizer(m), text, len, &ids, &n);
        if (s) mq_err_prefix(s, "%s", calib);
    }
    if (!s && n == 0) s = mq_err(MOEQ_E_ARG, "%s: the calibration text has no tokens", calib);
    if (!s) {
        int64_t chunk = m->cfg.max_pos > 0 && m->cfg.max_pos < 512 ? m->cfg.max_pos : 512;
        int64_t use = (int64_t)n < calib_tokens ? (int64_t)n : calib_tokens;
        s = mq_act_amax_collect(m, ids, use, chunk, out);
    }
    free(ids);
    free(text);
    moeq_model_free(m);
    return s;
}

static void gptq_summary(const mq_gptq_results *r, moeq_quant_result *res) {
    res->gptq_samples = r->samples;
    res->gptq_tokens = r->tokens;
    res->gptq_linears = r->n;
    for (int64_t i = 0; i < r->n; i++) {
        res->gptq_fallback_linears += r->r[i].how != MQ_HOW_GPTQ;
        if (r->r[i].how == MQ_HOW_RTN) continue;
        res->gptq_loss += r->r[i].stats.loss;
        res->gptq_rtn_loss += r->r[i].stats.rtn_loss;
        res->gptq_worse_than_rtn += r->r[i].stats.loss > r->r[i].stats.rtn_loss;
    }
    res->gptq_seconds = r->seconds_total;
    res->gptq_seconds_forward = r->seconds_forward;
    res->gptq_seconds_hessian = r->seconds_hessian;
    res->gptq_seconds_solve = r->seconds_gptq;
}

moeq_status moeq_quantize(const char *model_dir, const char *out_dir,
                          const moeq_quant_options *opts, moeq_quant_result *result) {
    double t0 = mq_now();
    moeq_quant_result res;
    memset(&res, 0, sizeof res);
    if (result) memset(result, 0, sizeof *result);
    if (!model_dir || !out_dir || !opts)
        return BAD("%s is NULL", !model_dir ? "model_dir" : !out_dir ? "out_dir" : "opts");
    moeq_status st = check_options(opts);
    ignore_set ig;
    if (!st) st = ignore_compile(opts, &ig);
    if (st) return st;
    /* before any calibration or GPTQ work; the writer checks again when it starts */
    st = mq_quantize_check_out(model_dir, out_dir, opts->force != 0, NULL);

    mq_quantize_opts o;
    writer_options(opts, &o);
    mq_act_amax *amax = NULL;
    if (!st && o.act_quant) {
        st = calibrate(model_dir, opts->calib, opts->calib_tokens, &amax);
        o.input_amax = amax_lookup;
        o.amax_user = amax;
    }
    mq_quantize_stats stats;
    memset(&stats, 0, sizeof stats);
    if (!st && opts->method == MOEQ_QUANT_GPTQ) {
        mq_gptq_model_opts go;
        mq_calib_opts co;
        gptq_options(opts, &o, &go, &co);
        if (ig.n) {
            go.want = want_module;
            go.want_user = &ig;
        }
        char *report = opts->gptq.report ? mq_strdup(opts->gptq.report)
                                         : mq_path_join(out_dir, "gptq_report.json");
        mq_gptq_results gr;
        memset(&gr, 0, sizeof gr);
        st = report ? mq_gptq_quantize_checkpoint(model_dir, out_dir, &o, &go, &co, report, &gr,
                                                  &stats)
                    : mq_err(MOEQ_E_NOMEM, "out of memory");
        if (!st) gptq_summary(&gr, &res);
        mq_gptq_results_free(&gr);
        free(report);
    } else if (!st) {
        st = mq_quantize_checkpoint(model_dir, out_dir, &o, &stats);
    }
    mq_act_amax_free(amax);
    ignore_free(&ig);
    if (st) return st;
    res.linears_quantized = stats.n_quantized;
    res.linears_kept = stats.n_kept;
    res.weights_quantized = stats.quantized_params;
    res.tensors_written = stats.n_tensors;
    res.bytes_written = (int64_t)stats.bytes_written;
    res.seconds = mq_now() - t0;
    if (result) *result = res;
    return MOEQ_OK;
}
