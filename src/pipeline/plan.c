/*
 * The output plan (see plan.h). Names and the Linear/pass-through split follow formats.md
 * sections 1 and 2: vLLM loads every decoder Linear through the checkpoint's quantization scheme
 * except the ones in the config's ignore list, and needs one scheme per fused layer.
 */
#define PCRE2_CODE_UNIT_WIDTH 8

#include "pipeline/plan.h"

#include <pcre2.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const char *mq_fusion_tag(const char *leaf) {
    static const char *const map[][2] = {
        {"q_proj", "qkv"},   {"k_proj", "qkv"},     {"v_proj", "qkv"},
        {"gate_proj", "gate_up"}, {"up_proj", "gate_up"}, {"w1", "w13"}, {"w3", "w13"},
        {"q_a_proj", "q_a"}, {"kv_a_proj_with_mqa", "q_a"}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(leaf, map[i][0]) == 0) return map[i][1];
    return NULL;
}

void mq_out_plan_free(mq_out_plan *p) {
    for (size_t i = 0; i < p->n_items; i++) {
        free(p->items[i].module);
        free(p->items[i].src_module);
    }
    for (size_t i = 0; i < p->n_pass; i++) free(p->pass[i].name);
    for (int g = 0; g < p->n_groups; g++) free(p->group_keys[g]);
    for (size_t i = 0; i < p->n_decls; i++) free(p->decl_names[i]);
    for (size_t i = 0; i < p->n_dq; i++) {
        mq_free((void *)p->dq[i]->data);
        free(p->dq[i]);
    }
    MQ_FREE_EACH(p->dq, p->items, p->pass, p->group_keys, p->by_name, p->decls, p->decl_names);
    memset(p, 0, sizeof *p);
}

/* Output name of a source tensor or module. Mixtral re-saved by transformers 5 keeps its MoE
 * block under "mlp."; per-expert checkpoints (what vLLM and the hub use) name it
 * "block_sparse_moe.", so its names move back there. */
static char *out_name(const char *name, bool mixtral) {
    int l, n = 0;
    if (mixtral && sscanf(name, "model.layers.%d.mlp.%n", &l, &n) == 1 && n > 0)
        return mq_asprintf("%.*sblock_sparse_moe.%s", n - 4, name, name + n);
    return mq_strdup(name);
}

static int layer_of(const char *name) {
    int l, n = 0;
    if (sscanf(name, "model.layers.%d.%n", &l, &n) == 1 && n > 0 && l >= 0) return l;
    return -1;
}

static const char *leaf_of(const char *module) {
    const char *d = strrchr(module, '.');
    return d ? d + 1 : module;
}

static bool is_float(moeq_dtype dt) {
    return dt == MOEQ_DT_BF16 || dt == MOEQ_DT_F16 || dt == MOEQ_DT_F32;
}

/* A float tensor, or an FP8 block-quantized weight (dequantized when read). */
static bool is_weight_dtype(const mq_tensor_view *t) { return is_float(t->dtype) || t->scale_inv; }

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

#define PLAN_WHAT "the checkpoint's plan"   /* what runs out of memory in mq_grow's message */

/* src_module: the source's name of the module (malloc'ed, owned from here). */
static moeq_status item_add(mq_out_plan *p, char *src_module, bool mixtral,
                            const mq_tensor_view *src, int64_t offset, int64_t rows, int64_t cols) {
    char *module = src_module ? out_name(src_module, mixtral) : NULL;
    moeq_status s = module ? mq_grow(&p->items, p->n_items, &p->cap_items, sizeof *p->items, 64,
                                     PLAN_WHAT)
                           : mq_err(MOEQ_E_NOMEM, "out of memory planning the checkpoint");
    if (s) {
        free(src_module);
        free(module);
        return s;
    }
    int layer = layer_of(module);
    p->items[p->n_items++] = (mq_plan_item){module, src_module, src, offset, rows, cols, layer,
                                            true, false, -1, {0}};
    if (layer + 1 > p->n_layers) p->n_layers = layer + 1;
    return MOEQ_OK;
}

/* A pass-through tensor under `name` (malloc'ed, owned from here; NULL: out of memory), in the
 * decoder layer its name says unless raw (an MTP layer's: outside them). */
static moeq_status pass_add(mq_out_plan *p, char *name, const mq_tensor_view *src, bool raw) {
    moeq_status s = name ? mq_grow(&p->pass, p->n_pass, &p->cap_pass, sizeof *p->pass, 64, PLAN_WHAT)
                         : mq_err(MOEQ_E_NOMEM, "out of memory planning the checkpoint");
    if (s) {
        free(name);
        return s;
    }
    const int layer = raw ? -1 : layer_of(name);
    p->pass[p->n_pass++] = (mq_plan_pass){name, src, layer, raw};
    if (layer + 1 > p->n_layers) p->n_layers = layer + 1;
    return MOEQ_OK;
}

static char *fmt_name(const char *fmt, ...) MQ_PRINTF(1, 2);
static char *fmt_name(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return k < 0 || k >= (int)sizeof buf ? NULL : mq_strdup(buf);
}

/* An MTP layer's tensor (mq_plan_opts.mtp_from): passed through raw, or dropped. */
static moeq_status plan_mtp(mq_out_plan *p, const mq_tensor_view *t, const mq_plan_opts *o) {
    if (o->drop_mtp) {
        p->n_mtp_dropped++;
        return MOEQ_OK;
    }
    moeq_status s = pass_add(p, mq_strdup(t->name), t, true);
    if (!s) p->n_mtp_pass++;
    return s;
}

/* Linears and pass-through tensors, in the source's (name) order. */
static moeq_status plan_tensors(mq_out_plan *p, const mq_st *st, bool mixtral,
                                const mq_plan_opts *o) {
    const char *gn = mixtral ? "w1" : "gate_proj", *un = mixtral ? "w3" : "up_proj",
               *dn = mixtral ? "w2" : "down_proj";
    for (size_t i = 0; i < mq_st_count(st); i++) {
        const mq_tensor_view *t = mq_st_at(st, i);
        if (o->mtp_from > 0 && layer_of(t->name) >= o->mtp_from) {
            moeq_status s = plan_mtp(p, t, o);
            if (s) return s;
            continue;
        }
        if (t->is_block_scale) continue;   /* consumed by its FP8 weight */
        bool in_layers = strncmp(t->name, "model.layers.", 13) == 0 && is_weight_dtype(t);
        moeq_status s = MOEQ_OK;
        if (in_layers && t->ndim == 2 && ends_with(t->name, ".weight")) {
            s = item_add(p, mq_strndup(t->name, strlen(t->name) - 7), mixtral, t, 0, t->shape[0],
                         t->shape[1]);
        } else if (in_layers && t->ndim == 3 && (ends_with(t->name, ".experts.gate_up_proj") ||
                                                 ends_with(t->name, ".experts.down_proj"))) {
            bool gu = ends_with(t->name, ".gate_up_proj");
            int plen = (int)(strlen(t->name) - strlen(gu ? ".gate_up_proj" : ".down_proj"));
            int64_t E = t->shape[0], R = t->shape[1], C = t->shape[2];
            if (gu && R % 2)
                return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': odd gate_up rows %lld", t->file,
                              t->name, (long long)R);
            for (int64_t e = 0; e < E && !s; e++) {
                if (gu) {
                    int64_t F = R / 2;
                    s = item_add(p, fmt_name("%.*s.%lld.%s", plen, t->name, (long long)e, gn),
                                 mixtral, t, e * R * C, F, C);
                    if (!s)
                        s = item_add(p, fmt_name("%.*s.%lld.%s", plen, t->name, (long long)e, un),
                                     mixtral, t, e * R * C + F * C, F, C);
                } else {
                    s = item_add(p, fmt_name("%.*s.%lld.%s", plen, t->name, (long long)e, dn),
                                 mixtral, t, e * R * C, R, C);
                }
            }
        } else {
            s = pass_add(p, out_name(t->name, mixtral), t, false);
        }
        if (s) return s;
    }
    const mq_tensor_view *e = mq_st_find(st, "model.embed_tokens.weight");
    if (o->untie_lm_head && e && !mq_st_find(st, "lm_head.weight"))
        return pass_add(p, mq_strdup("lm_head.weight"), e, false);
    return MOEQ_OK;
}

/* The fusion groups' keys in an open-addressing table (slots hold group + 1, 0 free): a full
 * DeepSeek-V3 has some 31,000 groups among 47,000 Linears, too many to search one by one. */
typedef struct {
    int *slot;
    size_t mask;
} group_table;

static size_t key_hash(const char *k) {   /* FNV-1a */
    uint64_t h = 1469598103934665603ull;
    for (; *k; k++) h = (h ^ (unsigned char)*k) * 1099511628211ull;
    return (size_t)h;
}

/* The group of key, a new one (numbered in order of first appearance) if unseen. */
static moeq_status group_of(mq_out_plan *p, group_table *t, const char *key, int *out) {
    size_t i = key_hash(key) & t->mask;
    for (; t->slot[i]; i = (i + 1) & t->mask)
        if (strcmp(p->group_keys[t->slot[i] - 1], key) == 0) {
            *out = t->slot[i] - 1;
            return MOEQ_OK;
        }
    char **v = realloc(p->group_keys, (size_t)(p->n_groups + 1) * sizeof *v);
    if (!v) return mq_err(MOEQ_E_NOMEM, "out of memory");
    p->group_keys = v;
    if (!(v[p->n_groups] = mq_strdup(key))) return MOEQ_E_NOMEM;
    t->slot[i] = p->n_groups + 1;
    *out = p->n_groups++;
    return MOEQ_OK;
}

/* Routers and the shared-expert gate stay unquantized (vLLM builds them without a quant method);
 * user patterns; then a fusion group is quantized all or nothing. */
static moeq_status plan_select(mq_out_plan *p, const mq_plan_opts *o) {
    pcre2_code **re = NULL;
    moeq_status s = MOEQ_OK;
    if (o->n_ignore > 0 && !(re = calloc((size_t)o->n_ignore, sizeof *re)))
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (int i = 0; i < o->n_ignore && !s; i++) {
        int code;
        PCRE2_SIZE off;
        re[i] = pcre2_compile((PCRE2_SPTR)o->ignore[i], PCRE2_ZERO_TERMINATED, 0, &code, &off, NULL);
        if (!re[i]) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(code, msg, sizeof msg);
            s = mq_err(MOEQ_E_ARG, "--ignore '%s': bad regular expression at offset %zu: %s",
                       o->ignore[i], (size_t)off, (const char *)msg);
        }
    }
    pcre2_match_data *md = s ? NULL : pcre2_match_data_create(4, NULL);
    if (!s && !md) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    group_table gt = {NULL, 0};
    size_t cap = 16;
    while (cap < 2 * p->n_items) cap *= 2;   /* at most half full: one group per item */
    if (!s && !(gt.slot = calloc(cap, sizeof *gt.slot))) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    gt.mask = cap - 1;
    for (size_t k = 0; k < p->n_items && !s; k++) {
        mq_plan_item *it = &p->items[k];
        const char *leaf = leaf_of(it->module);
        if (strcmp(leaf, "gate") == 0 || strcmp(leaf, "shared_expert_gate") == 0) it->quantize = false;
        for (int i = 0; i < o->n_ignore && it->quantize; i++)
            if (pcre2_match(re[i], (PCRE2_SPTR)it->module, PCRE2_ZERO_TERMINATED, 0, 0, md, NULL) >= 0) {
                it->quantize = false;
                it->user_ignored = true;
            }
        const char *tag = mq_fusion_tag(leaf);
        char *key = tag ? mq_asprintf("%.*s#%s", (int)(leaf - it->module), it->module, tag)
                        : mq_strdup(it->module);
        s = key ? group_of(p, &gt, key, &it->group) : mq_err(MOEQ_E_NOMEM, "out of memory");
        free(key);
    }
    free(gt.slot);
    /* all or nothing per fusion group: vLLM needs one scheme per fused layer (off[g]: the
     * group's first unquantized Linear + 1) */
    size_t *off = s ? NULL : calloc((size_t)p->n_groups + 1, sizeof *off);
    if (!s && !off) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t k = 0; k < p->n_items && !s; k++)
        if (!p->items[k].quantize && !off[p->items[k].group]) off[p->items[k].group] = k + 1;
    for (size_t j = 0; j < p->n_items && !s; j++)
        if (p->items[j].quantize && off[p->items[j].group]) {
            mq_warn("%s stays unquantized because '%s' (fused with it in vLLM) does", p->items[j].module,
                    p->items[off[p->items[j].group] - 1].module);
            p->items[j].quantize = false;
        }
    free(off);
    pcre2_match_data_free(md);
    for (int i = 0; re && i < o->n_ignore; i++) pcre2_code_free(re[i]);
    free(re);
    return s;
}

static const mq_out_plan *g_name_plan;   /* qsort context; plans are built on one thread */
static int cmp_item_name(const void *a, const void *b) {
    return strcmp(g_name_plan->items[*(const size_t *)a].module,
                  g_name_plan->items[*(const size_t *)b].module);
}

static const char *item_by_name(const void *ctx, size_t i) {
    const mq_out_plan *p = ctx;
    return p->items[p->by_name[i]].module;
}

const mq_plan_item *mq_out_plan_find(const mq_out_plan *p, const char *module) {
    const int64_t k = mq_find_name(module, p->n_items, item_by_name, p);
    if (k >= 0) return &p->items[p->by_name[k]];
    for (size_t i = 0; i < p->n_items; i++)   /* a source name (rare: Mixtral under mlp.) */
        if (strcmp(p->items[i].src_module, module) == 0) return &p->items[i];
    return NULL;
}

/* ---- FP8 sources: what stays unquantized, as BF16 ------------------------------------------ */

/* *src (an FP8 block-quantized weight) becomes an owned BF16 view of its dequantized values. */
static moeq_status dequant_bf16(mq_out_plan *p, const mq_tensor_view **src) {
    const mq_tensor_view *t = *src;
    moeq_status s = mq_grow(&p->dq, p->n_dq, &p->cap_dq, sizeof *p->dq, 64, PLAN_WHAT);
    if (s) return s;
    mq_tensor_view *v = calloc(1, sizeof *v);
    float *f = mq_alloc_array((size_t)t->numel, sizeof(float), t->name);
    uint16_t *h = mq_alloc_array((size_t)t->numel, sizeof(uint16_t), t->name);
    if (!v || !f || !h) {
        free(v);
        mq_free(f);
        mq_free(h);
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory for its BF16 copy", t->name);
    }
    s = mq_tensor_to_f32(t, f);
    for (int64_t i = 0; !s && i < t->numel; i++) h[i] = mq_f32_to_bf16(f[i]);
    mq_free(f);
    if (s) {
        free(v);
        mq_free(h);
        return s;
    }
    *v = *t;
    v->dtype = MOEQ_DT_BF16;
    v->data = (const uint8_t *)h;
    v->nbytes = (size_t)t->numel * 2;
    v->scale_inv = NULL;
    v->block_rows = v->block_cols = 0;
    p->dq[p->n_dq++] = v;
    p->dequant_bytes += (int64_t)v->nbytes;
    *src = v;
    return MOEQ_OK;
}

static moeq_status plan_dequant(mq_out_plan *p) {
    moeq_status s = MOEQ_OK;
    for (size_t k = 0; k < p->n_items && !s; k++)
        if (!p->items[k].quantize && p->items[k].src->scale_inv) s = dequant_bf16(p, &p->items[k].src);
    for (size_t k = 0; k < p->n_pass && !s; k++)
        if (p->pass[k].src->scale_inv && !p->pass[k].raw) s = dequant_bf16(p, &p->pass[k].src);
    return s;
}

static moeq_status decl_add(void *user, const char *name, moeq_dtype dtype, int ndim,
                            const int64_t *shape) {
    mq_out_plan *p = user;
    moeq_status s = mq_grow(&p->decls, p->n_decls, &p->cap_decls, sizeof *p->decls, 64,
                            PLAN_WHAT);
    if (s) return s;
    char **nv = realloc(p->decl_names, p->cap_decls * sizeof *nv);
    if (!nv) return mq_err(MOEQ_E_NOMEM, "out of memory");
    p->decl_names = nv;
    char *n = mq_strdup(name);
    if (!n) return MOEQ_E_NOMEM;
    mq_tensor_decl *d = &p->decls[p->n_decls];
    memset(d, 0, sizeof *d);
    d->name = n;
    d->dtype = dtype;
    d->ndim = ndim;
    for (int i = 0; i < ndim; i++) d->shape[i] = shape[i];
    p->decl_names[p->n_decls++] = n;
    return MOEQ_OK;
}

static moeq_status decl_pass(mq_out_plan *p, const mq_plan_pass *t) {
    return decl_add(p, t->name, t->src->dtype, t->src->ndim, t->src->shape);
}

static moeq_status decl_item(mq_out_plan *p, const mq_plan_item *it, const mq_plan_opts *o) {
    if (it->quantize)
        return mq_layout_describe(o->format, it->module, &it->spec, it->rows, it->cols, o->g_idx,
                                  o->input_scale, decl_add, p);
    char *name = mq_asprintf("%s.weight", it->module);
    if (!name) return MOEQ_E_NOMEM;
    int64_t shape[2] = {it->rows, it->cols};
    moeq_status s = decl_add(p, name, it->src->dtype, 2, shape);
    free(name);
    return s;
}

/* Output order: global tensors, then per layer its pass-through tensors and its Linears. */
static moeq_status plan_decls(mq_out_plan *p, const mq_plan_opts *o) {
    moeq_status s = MOEQ_OK;
    for (size_t i = 0; i < p->n_pass && !s; i++)
        if (p->pass[i].layer < 0) s = decl_pass(p, &p->pass[i]);
    for (size_t i = 0; i < p->n_items && !s; i++)
        if (p->items[i].layer < 0) s = decl_item(p, &p->items[i], o);
    for (int l = 0; l < p->n_layers && !s; l++) {
        for (size_t i = 0; i < p->n_pass && !s; i++)
            if (p->pass[i].layer == l) s = decl_pass(p, &p->pass[i]);
        for (size_t i = 0; i < p->n_items && !s; i++)
            if (p->items[i].layer == l) s = decl_item(p, &p->items[i], o);
    }
    return s;
}

moeq_status mq_out_plan_build(const mq_st *st, bool mixtral, const mq_plan_opts *o,
                              mq_out_plan *p) {
    memset(p, 0, sizeof *p);
    moeq_status s = plan_tensors(p, st, mixtral, o);
    if (!s) s = plan_select(p, o);
    for (size_t k = 0; k < p->n_items && !s; k++) {
        mq_plan_item *it = &p->items[k];
        if (!it->quantize) continue;
        it->spec = o->spec;
        if (o->spec_for && !o->spec_for(o->spec_user, it, &it->spec)) {
            it->quantize = false;
            continue;
        }
        if ((s = mq_qspec_check(&it->spec, it->rows, it->cols, it->module))) {
            mq_err_prefix(s, "%s (leave it unquantized with --ignore)", it->src->file);
            break;
        }
        p->quantized_params += it->rows * it->cols;
    }
    if (!s) {
        p->by_name = malloc((p->n_items ? p->n_items : 1) * sizeof *p->by_name);
        if (!p->by_name) s = mq_err(MOEQ_E_NOMEM, "out of memory");
        for (size_t i = 0; !s && i < p->n_items; i++) p->by_name[i] = i;
        g_name_plan = p;
        if (!s && p->n_items > 1) qsort(p->by_name, p->n_items, sizeof *p->by_name, cmp_item_name);
    }
    if (!s) s = plan_dequant(p);
    if (!s) s = plan_decls(p, o);
    if (s) mq_out_plan_free(p);
    return s;
}
