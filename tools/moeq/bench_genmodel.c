/*
 * moeq bench gen-model --like NAME --out DIR [options]: writes a Hugging Face checkpoint with a
 * real model's config.json, tensor names and shapes, and random bf16 weights, so that benchmarks
 * (and quantize / eval runs) can use full-size shapes without downloading anything.
 *
 * The configs are the hub config.json values of each model (g_likes below); --layers, --experts,
 * --hidden, --ffn and --vocab make smaller variants with the same names and layout. Before a byte
 * is written, the config text goes through the project's own parser (mq_config_parse) and the
 * parameter count it implies is compared with the planned tensors, so what is written loads.
 *
 * Weights are a pure function of (seed, tensor name, element index): a per-tensor key from the
 * seed and an FNV-1a hash of the name; value i is quantile u of N(0, 0.02) (0.02: transformers'
 * initializer_range), where u is the 16-bit part i % 4 of splitmix64(key + (i / 4 + 1) * golden).
 * The 65536 quantiles, bf16(0.02 * PHI^-1((u + 0.5) / 65536)) with PHI^-1 by Wichura's AS241
 * (the algorithm of Python's statistics.NormalDist.inv_cdf), are a table made once: a lookup per
 * value and a hash per four values took 1.6 ns a value on one core here, against 4.5 ns for a
 * hash per value summed as four uniforms, and gives true normal tails out to 4.17 sigma. Norm
 * weights are 1. So chunks fill in parallel on the pool in any
 * order, the bytes never depend on the thread count, and a tensor keeps its values whatever
 * --layers or --max-shard-size is.
 *
 * Files (../shared/docs/formats.md section 1): the tensors are planned in a fixed order
 * (embeddings, layer by layer, final norm, lm_head), cut into shards of at most --max-shard-size
 * bytes of tensor data (a larger tensor gets a shard of its own), and each shard is streamed: the
 * 8-byte little-endian header length, the JSON header padded with spaces to a multiple of 8, then
 * the data in the header's order. Data goes out in chunks of 8 MiB, double-buffered: in each pool
 * job one task writes the previous chunk while the others fill the next, so memory stays at two
 * chunks whatever the model size. Everything is written into DIR.tmp-PID, renamed to DIR at the
 * end; a failure or Ctrl-C removes it.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <unistd.h>

#include "commands.h"
#include "cli.h"
#include "core/core.h"
#include "core/page.h"
#include "model/model.h"

#ifndef MOEQ_SOURCE_DIR
#define MOEQ_SOURCE_DIR "."
#endif

#define CMD "bench gen-model"

/* ---- the models ---------------------------------------------------------------------------- */
typedef enum { FAM_LLAMA, FAM_OLMOE, FAM_QWEN2_MOE, FAM_QWEN3_MOE, FAM_MIXTRAL, FAM_DEEPSEEK_V3 } family;

/* One hub config.json. ffn is the width --ffn replaces: the routed experts' for MoE models, the
 * MLP's for dense ones; inter is intermediate_size where it is a separate field (qwen), shared the
 * shared expert's width (qwen2_moe). -1 ids are null / absent. */
typedef struct {
    const char *name, *hub, *model_type, *architecture, *tf_version;
    family fam;
    int64_t hidden, ffn, inter, shared, layers, heads, kv_heads, head_dim, experts, top_k, vocab,
        max_pos, bos, eos, pad, max_window_layers, sliding_window;
    double rope_theta, rms_eps, aux_loss;
    bool norm_topk, tie, head_dim_derived;   /* head_dim = hidden / heads in the family */
} like;

static const like g_likes[] = {
    {.name = "olmoe-1b-7b", .hub = "allenai/OLMoE-1B-7B-0924", .model_type = "olmoe",
     .architecture = "OlmoeForCausalLM", .tf_version = "4.43.0.dev0", .fam = FAM_OLMOE,
     .hidden = 2048, .ffn = 1024, .layers = 16, .heads = 16, .kv_heads = 16, .experts = 64,
     .top_k = 8, .vocab = 50304, .max_pos = 4096, .bos = -1, .eos = 50279, .pad = 1,
     .rope_theta = 10000, .rms_eps = 1e-5, .aux_loss = 0.01, .head_dim_derived = true},
    {.name = "qwen3-30b-a3b", .hub = "Qwen/Qwen3-30B-A3B", .model_type = "qwen3_moe",
     .architecture = "Qwen3MoeForCausalLM", .tf_version = "4.51.0", .fam = FAM_QWEN3_MOE,
     .hidden = 2048, .ffn = 768, .inter = 6144, .layers = 48, .heads = 32, .kv_heads = 4,
     .head_dim = 128, .experts = 128, .top_k = 8, .vocab = 151936, .max_pos = 40960,
     .bos = 151643, .eos = 151645, .pad = -1, .max_window_layers = 48, .rope_theta = 1e6,
     .rms_eps = 1e-6, .aux_loss = 0.001, .norm_topk = true},
    {.name = "mixtral-8x7b", .hub = "mistralai/Mixtral-8x7B-v0.1", .model_type = "mixtral",
     .architecture = "MixtralForCausalLM", .tf_version = "4.36.0.dev0", .fam = FAM_MIXTRAL,
     .hidden = 4096, .ffn = 14336, .layers = 32, .heads = 32, .kv_heads = 8, .experts = 8,
     .top_k = 2, .vocab = 32000, .max_pos = 32768, .bos = 1, .eos = 2, .pad = -1,
     .rope_theta = 1e6, .rms_eps = 1e-5, .aux_loss = 0.02, .norm_topk = true,
     .head_dim_derived = true},
    {.name = "qwen2-moe-a2.7b", .hub = "Qwen/Qwen1.5-MoE-A2.7B", .model_type = "qwen2_moe",
     .architecture = "Qwen2MoeForCausalLM", .tf_version = "4.39.0.dev0", .fam = FAM_QWEN2_MOE,
     .hidden = 2048, .ffn = 1408, .inter = 5632, .shared = 5632, .layers = 24, .heads = 16,
     .kv_heads = 16, .experts = 60, .top_k = 4, .vocab = 151936, .max_pos = 8192, .bos = 151643,
     .eos = 151643, .pad = -1, .max_window_layers = 21, .sliding_window = 32768,
     .rope_theta = 1e6, .rms_eps = 1e-6, .aux_loss = 0.001, .head_dim_derived = true},
    {.name = "llama-3.2-1b", .hub = "meta-llama/Llama-3.2-1B", .model_type = "llama",
     .architecture = "LlamaForCausalLM", .tf_version = "4.45.0.dev0", .fam = FAM_LLAMA,
     .hidden = 2048, .ffn = 8192, .layers = 16, .heads = 32, .kv_heads = 8, .head_dim = 64,
     .vocab = 128256, .max_pos = 131072, .bos = 128000, .eos = 128001, .pad = -1,
     .rope_theta = 500000, .rms_eps = 1e-5, .tie = true, .head_dim_derived = true},
    /* MLA shapes (q_lora 1536, kv_lora 512, heads of 128 + 64 rope, values 128), 8 groups of
     * 32 experts, 3 dense layers (fewer with --layers: at least one MoE layer), YaRN x40; its
     * MTP layer is not generated. ffn: the experts' width, inter the dense layers' */
    {.name = "deepseek-v3", .hub = "deepseek-ai/DeepSeek-V3", .model_type = "deepseek_v3",
     .architecture = "DeepseekV3ForCausalLM", .tf_version = "4.33.1", .fam = FAM_DEEPSEEK_V3,
     .hidden = 7168, .ffn = 2048, .inter = 18432, .shared = 2048, .layers = 61, .heads = 128,
     .kv_heads = 128, .head_dim = 192, .experts = 256, .top_k = 8, .vocab = 129280,
     .max_pos = 163840, .bos = 0, .eos = 1, .pad = -1, .rope_theta = 10000, .rms_eps = 1e-6,
     .norm_topk = true},
};
#define N_LIKES (sizeof g_likes / sizeof g_likes[0])

/* The shapes after the overrides. */
typedef struct {
    const like *m;
    int64_t D, F, inter, shared, layers, heads, kv, hd, E, K, V;
    int64_t bos, eos, pad;   /* the model's, or the bundled tokenizer's past --vocab */
} spec;

static bool is_moe(const spec *s) { return s->m->fam != FAM_LLAMA; }

/* deepseek-v3: dense layers first (3, fewer when --layers leaves no MoE layer), expert groups (8
 * while they divide the experts into groups of at least 2, else 1; half of them eligible). */
static int64_t deepseek_dense(const spec *s) { return s->layers > 3 ? 3 : s->layers - 1; }
static int64_t deepseek_groups(const spec *s) { return s->E % 8 == 0 && s->E >= 16 ? 8 : 1; }

/* ---- config.json --------------------------------------------------------------------------- */
/* Keys are collected and printed sorted, as transformers' to_json_string writes them. */
typedef struct {
    const char *key;
    char val[192];
} kv;

typedef struct {
    kv items[64];
    int n;
} kvs;

static void put(kvs *c, const char *key, const char *fmt, ...) MQ_PRINTF(3, 4);
static void put(kvs *c, const char *key, const char *fmt, ...) {
    MQ_ASSERT(c->n < (int)(sizeof c->items / sizeof c->items[0]));
    kv *e = &c->items[c->n++];
    e->key = key;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->val, sizeof e->val, fmt, ap);
    va_end(ap);
}

static void put_id(kvs *c, const char *key, int64_t id) {
    if (id >= 0) put(c, key, "%lld", (long long)id);
    else put(c, key, "null");
}

static int cmp_kv(const void *a, const void *b) {
    return strcmp(((const kv *)a)->key, ((const kv *)b)->key);
}

static char *kvs_json(kvs *c) {
    qsort(c->items, (size_t)c->n, sizeof c->items[0], cmp_kv);
    mq_page b = {0};
    mq_page_printf(&b, "{\n");
    for (int i = 0; i < c->n; i++)
        mq_page_printf(&b, "  \"%s\": %s%s\n", c->items[i].key, c->items[i].val,
                  i + 1 < c->n ? "," : "");
    mq_page_printf(&b, "}\n");
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

static char *config_json(const spec *s) {
    const like *m = s->m;
    kvs c = {.n = 0};
    put(&c, "architectures", "[\"%s\"]", m->architecture);
    put(&c, "attention_dropout", "0.0");
    put_id(&c, "bos_token_id", s->bos);
    put_id(&c, "eos_token_id", s->eos);
    put(&c, "hidden_act", "\"silu\"");
    put(&c, "hidden_size", "%lld", (long long)s->D);
    put(&c, "initializer_range", "0.02");
    put(&c, "max_position_embeddings", "%lld", (long long)m->max_pos);
    put(&c, "model_type", "\"%s\"", m->model_type);
    put(&c, "num_attention_heads", "%lld", (long long)s->heads);
    put(&c, "num_hidden_layers", "%lld", (long long)s->layers);
    put(&c, "num_key_value_heads", "%lld", (long long)s->kv);
    put(&c, "rms_norm_eps", "%g", m->rms_eps);
    put(&c, "rope_theta", "%.1f", m->rope_theta);
    put(&c, "tie_word_embeddings", "%s", m->tie ? "true" : "false");
    put(&c, "torch_dtype", "\"bfloat16\"");
    put(&c, "dtype", "\"bfloat16\"");
    put(&c, "transformers_version", "\"%s\"", m->tf_version);
    put(&c, "use_cache", "true");
    put(&c, "vocab_size", "%lld", (long long)s->V);
    if (is_moe(s)) {
        put(&c, "num_experts_per_tok", "%lld", (long long)s->K);
        if (m->fam != FAM_DEEPSEEK_V3) {
            put(&c, "output_router_logits", "false");
            put(&c, "router_aux_loss_coef", "%g", m->aux_loss);
        }
    }
    int64_t window_layers = m->max_window_layers < s->layers ? m->max_window_layers : s->layers;
    switch (m->fam) {
    case FAM_LLAMA:
        put(&c, "attention_bias", "false");
        put(&c, "head_dim", "%lld", (long long)s->hd);
        put(&c, "intermediate_size", "%lld", (long long)s->F);
        put(&c, "mlp_bias", "false");
        put(&c, "pretraining_tp", "1");
        break;
    case FAM_OLMOE:
        put(&c, "attention_bias", "false");
        put(&c, "clip_qkv", "null");
        put(&c, "intermediate_size", "%lld", (long long)s->F);
        put(&c, "norm_topk_prob", "false");
        put(&c, "num_experts", "%lld", (long long)s->E);
        put_id(&c, "pad_token_id", s->pad);
        put(&c, "rope_scaling", "null");
        break;
    case FAM_MIXTRAL:
        put(&c, "intermediate_size", "%lld", (long long)s->F);
        put(&c, "num_local_experts", "%lld", (long long)s->E);
        put(&c, "sliding_window", "null");
        break;
    case FAM_QWEN2_MOE:
    case FAM_QWEN3_MOE:
        put(&c, "decoder_sparse_step", "1");
        put(&c, "intermediate_size", "%lld", (long long)s->inter);
        put(&c, "max_window_layers", "%lld", (long long)window_layers);
        put(&c, "mlp_only_layers", "[]");
        put(&c, "moe_intermediate_size", "%lld", (long long)s->F);
        put(&c, "norm_topk_prob", "%s", m->norm_topk ? "true" : "false");
        put(&c, "num_experts", "%lld", (long long)s->E);
        put(&c, "use_sliding_window", "false");
        if (m->sliding_window > 0) put(&c, "sliding_window", "%lld", (long long)m->sliding_window);
        else put(&c, "sliding_window", "null");
        if (m->fam == FAM_QWEN2_MOE) {
            put(&c, "shared_expert_intermediate_size", "%lld", (long long)s->shared);
        } else {
            put(&c, "attention_bias", "false");
            put(&c, "head_dim", "%lld", (long long)s->hd);
            put(&c, "rope_scaling", "null");
        }
        break;
    case FAM_DEEPSEEK_V3: {   /* the hub's config.json fields */
        const int64_t G = deepseek_groups(s);
        put(&c, "attention_bias", "false");
        put(&c, "first_k_dense_replace", "%lld", (long long)deepseek_dense(s));
        put(&c, "intermediate_size", "%lld", (long long)s->inter);
        put(&c, "kv_lora_rank", "512");
        put(&c, "moe_intermediate_size", "%lld", (long long)s->F);
        put(&c, "moe_layer_freq", "1");
        put(&c, "n_group", "%lld", (long long)G);
        put(&c, "n_routed_experts", "%lld", (long long)s->E);
        put(&c, "n_shared_experts", "1");
        put(&c, "norm_topk_prob", "true");
        put(&c, "num_nextn_predict_layers", "0");
        put(&c, "q_lora_rank", "1536");
        put(&c, "qk_nope_head_dim", "128");
        put(&c, "qk_rope_head_dim", "64");
        put(&c, "rope_scaling", "{\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 40, \"mscale\": "
            "1.0, \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096, \"type\": "
            "\"yarn\"}");
        put(&c, "routed_scaling_factor", "2.5");
        put(&c, "scoring_func", "\"sigmoid\"");
        put(&c, "topk_group", "%lld", (long long)(G > 1 ? G / 2 : 1));
        put(&c, "topk_method", "\"noaux_tc\"");
        put(&c, "v_head_dim", "128");
        break;
    }
    }
    return kvs_json(&c);
}

static char *generation_config_json(const spec *s) {
    kvs c = {.n = 0};
    put(&c, "_from_model_config", "true");
    if (s->bos >= 0) put_id(&c, "bos_token_id", s->bos);
    if (s->eos >= 0) put_id(&c, "eos_token_id", s->eos);
    if (s->pad >= 0) put_id(&c, "pad_token_id", s->pad);
    put(&c, "transformers_version", "\"%s\"", s->m->tf_version);
    return kvs_json(&c);
}

/* ---- the tensor plan ----------------------------------------------------------------------- */
typedef enum { INIT_NORMAL, INIT_ONES } init_kind;

typedef struct {
    char *name;
    int ndim;
    int64_t shape[2];
    int64_t numel;
    init_kind init;
    uint64_t key;     /* random stream of this tensor */
    int shard;        /* 0-based */
    uint64_t begin;   /* data offset in its shard */
} planned;

typedef struct {
    planned *t;
    size_t n, cap;
    bool oom;
} plan;

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
#define GOLDEN 0x9e3779b97f4a7c15ull

static uint64_t tensor_key(uint64_t seed, const char *name) {
    uint64_t h = 0xcbf29ce484222325ull;   /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    return mix64(mix64(seed + GOLDEN) ^ h);
}

/* rows x cols (cols = 0: a 1-D tensor of rows values). */
static void add(plan *p, uint64_t seed, init_kind init, int64_t rows, int64_t cols,
                const char *fmt, ...) MQ_PRINTF(6, 7);
static void add(plan *p, uint64_t seed, init_kind init, int64_t rows, int64_t cols,
                const char *fmt, ...) {
    if (p->oom) return;
    if (p->n == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 256;
        planned *t = realloc(p->t, cap * sizeof *t);
        if (!t) {
            p->oom = true;
            return;
        }
        p->t = t;
        p->cap = cap;
    }
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    planned *t = &p->t[p->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = mq_strdup(name))) {
        p->oom = true;
        return;
    }
    t->ndim = cols ? 2 : 1;
    t->shape[0] = rows;
    t->shape[1] = cols;
    t->numel = rows * (cols ? cols : 1);
    t->init = init;
    t->key = tensor_key(seed, name);
    p->n++;
}

static void plan_free(plan *p) {
    for (size_t i = 0; i < p->n; i++) free(p->t[i].name);
    free(p->t);
    memset(p, 0, sizeof *p);
}

/* A gated MLP of F x D at "<where>.<name>.weight": gate and up [F, D], down [D, F], in the
 * order of names (the down projection at names[down]). */
static const char *const MLP_NAMES[3] = {"gate_proj", "up_proj", "down_proj"};
static void add_mlp(plan *p, uint64_t seed, int64_t F, int64_t D, const char *where, const char *const names[3],
                    int down) {
    for (int j = 0; j < 3; j++)
        add(p, seed, INIT_NORMAL, j == down ? D : F, j == down ? F : D, "%s.%s.weight", where, names[j]);
}

/* The routed experts, each a gated MLP at "<where>.<e>" (with names and down as add_mlp's). */
static void add_experts(plan *p, uint64_t seed, int64_t E, int64_t F, int64_t D, const char *where,
                        const char *const names[3], int down) {
    for (int64_t e = 0; e < E; e++) {
        char at[128];
        snprintf(at, sizeof at, "%.96s.%lld", where, (long long)e);
        add_mlp(p, seed, F, D, at, names, down);
    }
}

/* One deepseek_v3 layer after its input norm: latent attention, then the dense MLP or the MoE
 * block (router and its selection bias, experts, the shared expert). */
static void plan_deepseek_layer(plan *p, const spec *s, uint64_t seed, const char *pre, bool moe) {
    const int64_t D = s->D, F = s->F, H = s->heads;
    add(p, seed, INIT_NORMAL, 1536, D, "%s.self_attn.q_a_proj.weight", pre);
    add(p, seed, INIT_ONES, 1536, 0, "%s.self_attn.q_a_layernorm.weight", pre);
    add(p, seed, INIT_NORMAL, H * 192, 1536, "%s.self_attn.q_b_proj.weight", pre);
    add(p, seed, INIT_NORMAL, 512 + 64, D, "%s.self_attn.kv_a_proj_with_mqa.weight", pre);
    add(p, seed, INIT_ONES, 512, 0, "%s.self_attn.kv_a_layernorm.weight", pre);
    add(p, seed, INIT_NORMAL, H * (128 + 128), 512, "%s.self_attn.kv_b_proj.weight", pre);
    add(p, seed, INIT_NORMAL, D, H * 128, "%s.self_attn.o_proj.weight", pre);
    add(p, seed, INIT_ONES, D, 0, "%s.post_attention_layernorm.weight", pre);
    char at[96];
    if (!moe) {
        snprintf(at, sizeof at, "%s.mlp", pre);
        add_mlp(p, seed, s->inter, D, at, MLP_NAMES, 2);
        return;
    }
    add(p, seed, INIT_NORMAL, s->E, D, "%s.mlp.gate.weight", pre);
    add(p, seed, INIT_NORMAL, s->E, 0, "%s.mlp.gate.e_score_correction_bias", pre);
    snprintf(at, sizeof at, "%s.mlp.experts", pre);
    add_experts(p, seed, s->E, F, D, at, MLP_NAMES, 2);
    snprintf(at, sizeof at, "%s.mlp.shared_experts", pre);
    add_mlp(p, seed, s->shared, D, at, MLP_NAMES, 2);
}

/* The hub's tensor names and [out, in] shapes, in the fixed order. */
static void plan_model(plan *p, const spec *s, uint64_t seed) {
    const family fam = s->m->fam;
    const int64_t D = s->D, F = s->F, q = s->heads * s->hd, kvd = s->kv * s->hd;
    const bool bias = fam == FAM_QWEN2_MOE;
    add(p, seed, INIT_NORMAL, s->V, D, "model.embed_tokens.weight");
    for (int64_t l = 0; l < s->layers; l++) {
        char pre[64];
        snprintf(pre, sizeof pre, "model.layers.%lld", (long long)l);
        add(p, seed, INIT_ONES, D, 0, "%s.input_layernorm.weight", pre);
        if (fam == FAM_DEEPSEEK_V3) {
            plan_deepseek_layer(p, s, seed, pre, l >= deepseek_dense(s));
            continue;
        }
        const char *proj[3] = {"q", "k", "v"};
        for (int j = 0; j < 3; j++) {
            int64_t out = j == 0 ? q : kvd;
            add(p, seed, INIT_NORMAL, out, D, "%s.self_attn.%s_proj.weight", pre, proj[j]);
            if (bias) add(p, seed, INIT_NORMAL, out, 0, "%s.self_attn.%s_proj.bias", pre, proj[j]);
        }
        add(p, seed, INIT_NORMAL, D, q, "%s.self_attn.o_proj.weight", pre);
        if (fam == FAM_OLMOE) {
            add(p, seed, INIT_ONES, q, 0, "%s.self_attn.q_norm.weight", pre);
            add(p, seed, INIT_ONES, kvd, 0, "%s.self_attn.k_norm.weight", pre);
        } else if (fam == FAM_QWEN3_MOE) {
            add(p, seed, INIT_ONES, s->hd, 0, "%s.self_attn.q_norm.weight", pre);
            add(p, seed, INIT_ONES, s->hd, 0, "%s.self_attn.k_norm.weight", pre);
        }
        add(p, seed, INIT_ONES, D, 0, "%s.post_attention_layernorm.weight", pre);
        static const char *const W123[3] = {"w1", "w2", "w3"};   /* gate, down, up */
        char at[96];
        if (fam == FAM_LLAMA) {
            snprintf(at, sizeof at, "%s.mlp", pre);
            add_mlp(p, seed, F, D, at, MLP_NAMES, 2);
        } else if (fam == FAM_MIXTRAL) {
            add(p, seed, INIT_NORMAL, s->E, D, "%s.block_sparse_moe.gate.weight", pre);
            snprintf(at, sizeof at, "%s.block_sparse_moe.experts", pre);
            add_experts(p, seed, s->E, F, D, at, W123, 1);
        } else {
            add(p, seed, INIT_NORMAL, s->E, D, "%s.mlp.gate.weight", pre);
            snprintf(at, sizeof at, "%s.mlp.experts", pre);
            add_experts(p, seed, s->E, F, D, at, MLP_NAMES, 2);
            if (fam == FAM_QWEN2_MOE) {
                snprintf(at, sizeof at, "%s.mlp.shared_expert", pre);
                add_mlp(p, seed, s->shared, D, at, MLP_NAMES, 2);
                add(p, seed, INIT_NORMAL, 1, D, "%s.mlp.shared_expert_gate.weight", pre);
            }
        }
    }
    add(p, seed, INIT_ONES, D, 0, "model.norm.weight");
    if (!s->m->tie) add(p, seed, INIT_NORMAL, s->V, D, "lm_head.weight");
}

/* Cuts the plan into shards of at most max_bytes of data; returns the number of shards. */
static int assign_shards(plan *p, uint64_t max_bytes) {
    int shard = 0;
    uint64_t used = 0;
    for (size_t i = 0; i < p->n; i++) {
        uint64_t b = 2 * (uint64_t)p->t[i].numel;
        if (used > 0 && used + b > max_bytes) {
            shard++;
            used = 0;
        }
        p->t[i].shard = shard;
        p->t[i].begin = used;
        used += b;
    }
    return shard + 1;
}

/* ---- filling and streaming ---------------------------------------------------------------- */
#define CHUNK_VALUES ((int64_t)4 << 20)   /* 8 MiB of bf16 per chunk */
#define PIECE_VALUES ((int64_t)1 << 16)   /* one fill task */

/* PHI^-1(p) for 0 < p < 1: Wichura, "Algorithm AS 241: The percentage points of the normal
 * distribution" (1988), PPND16, relative error about 1e-16. Each polynomial is evaluated by
 * Horner's rule from the highest coefficient, as the reference does. */
static double horner8(const double c[8], double r) {
    double v = c[0];
    for (int k = 1; k < 8; k++) v = v * r + c[k];
    return v;
}

static double normal_quantile(double p) {
    static const double a[8] = {2.5090809287301226727e+3, 3.3430575583588128105e+4,
                                6.7265770927008700853e+4, 4.5921953931549871457e+4,
                                1.3731693765509461125e+4, 1.9715909503065514427e+3,
                                1.3314166789178437745e+2, 3.3871328727963666080e+0};
    static const double b[8] = {5.2264952788528545610e+3, 2.8729085735721942674e+4,
                                3.9307895800092710610e+4, 2.1213794301586595867e+4,
                                5.3941960214247511077e+3, 6.8718700749205790830e+2,
                                4.2313330701600911252e+1, 1.0};
    static const double c[8] = {7.7454501427834140764e-4, 2.2723844989269184583e-2,
                                2.4178072517745061177e-1, 1.2704582524523683826e+0,
                                3.6478483247632045368e+0, 5.7694972214606914055e+0,
                                4.6303378461565452959e+0, 1.4234371107496835773e+0};
    static const double d[8] = {1.0507500716444168432e-9, 5.4759380849953449460e-4,
                                1.5198666563616457197e-2, 1.4810397642748007459e-1,
                                6.8976733498510000455e-1, 1.6763848301838038494e+0,
                                2.0531916266377588219e+0, 1.0};
    static const double e[8] = {2.0103343992922881327e-7, 2.7115555687434875782e-5,
                                1.2426609473880784386e-3, 2.6532189526576123093e-2,
                                2.9656057182850489123e-1, 1.7848265399172913358e+0,
                                5.4637849111641143699e+0, 6.6579046435011037772e+0};
    static const double f[8] = {2.0442631033899397856e-15, 1.4215117583164458887e-7,
                                1.8463183175100546818e-5, 7.8686913114561329059e-4,
                                1.4875361290850614852e-2, 1.3692988092273580531e-1,
                                5.9983220655588793769e-1, 1.0};
    double q = p - 0.5;
    if (fabs(q) <= 0.425) {
        double r = 0.180625 - q * q;
        return horner8(a, r) * q / horner8(b, r);
    }
    double r = sqrt(-log(q <= 0.0 ? p : 1.0 - p)), x;
    if (r <= 5.0) {
        r -= 1.6;
        x = horner8(c, r) / horner8(d, r);
    } else {
        r -= 5.0;
        x = horner8(e, r) / horner8(f, r);
    }
    return q < 0.0 ? -x : x;
}

/* bf16 quantiles of N(0, 0.02) at (u + 0.5) / 65536 (made by the first generate, before any
 * pool job reads it). */
static uint16_t g_quantiles[65536];

static void make_quantiles(void) {
    for (int u = 0; u < 65536; u++)
        g_quantiles[u] = mq_f32_to_bf16((float)(0.02 * normal_quantile((u + 0.5) / 65536.0)));
}

/* Values [first, first + count) of t as little-endian bf16 bytes. */
static void fill_values(const planned *t, int64_t first, int64_t count, uint8_t *out) {
    if (t->init == INIT_ONES) {
        for (int64_t i = 0; i < count; i++) {
            out[2 * i] = 0x80;   /* bf16 1.0 = 0x3F80 */
            out[2 * i + 1] = 0x3F;
        }
        return;
    }
    int64_t i = 0;
    while (i < count) {
        uint64_t v = (uint64_t)(first + i);
        uint64_t r = mix64(t->key + (v / 4 + 1) * GOLDEN);
        if (v % 4 == 0 && count - i >= 4) {   /* the usual case: four values of one hash */
            for (int j = 0; j < 4; j++) {
                uint16_t h = g_quantiles[(r >> (16 * j)) & 0xffff];
                out[2 * (i + j)] = (uint8_t)(h & 0xff);
                out[2 * (i + j) + 1] = (uint8_t)(h >> 8);
            }
            i += 4;
            continue;
        }
        uint16_t h = g_quantiles[(r >> (16 * (v % 4))) & 0xffff];
        out[2 * i] = (uint8_t)(h & 0xff);
        out[2 * i + 1] = (uint8_t)(h >> 8);
        i++;
    }
}

/* One pool job: task 0 writes the previous chunk (when there is one), the others fill pieces of
 * the next one. The write error goes back as errno: a worker's mq_err would land on its thread. */
typedef struct {
    FILE *f;
    const uint8_t *wbuf;
    size_t wlen;
    int werr;
    const planned *t;
    int64_t first, count;
    uint8_t *fbuf;
} step;

static void step_task(void *ctx, int64_t task, int thread) {
    (void)thread;
    step *s = ctx;
    if (s->wlen > 0) {
        if (task == 0) {
            errno = 0;
            if (fwrite(s->wbuf, 1, s->wlen, s->f) != s->wlen) s->werr = errno ? errno : EIO;
            return;
        }
        task--;
    }
    int64_t a = task * PIECE_VALUES, n = s->count - a < PIECE_VALUES ? s->count - a : PIECE_VALUES;
    fill_values(s->t, s->first + a, n, s->fbuf + 2 * a);
}

/* What the shard writers share: the plan, the two chunk buffers, the file names. */
typedef struct {
    plan *p;
    int n_shards;
    uint8_t *buf[2];
    char **shard_names;
} gen;

static char *shard_header(const gen *g, int shard, size_t *len) {
    mq_page b = {0};
    mq_page_printf(&b, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < g->p->n; i++) {
        const planned *t = &g->p->t[i];
        if (t->shard != shard) continue;
        mq_page_printf(&b, ",\"%s\":{\"dtype\":\"BF16\",\"shape\":[%lld", t->name,
                  (long long)t->shape[0]);
        if (t->ndim == 2) mq_page_printf(&b, ",%lld", (long long)t->shape[1]);
        mq_page_printf(&b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)t->begin,
                  (unsigned long long)(t->begin + 2 * (uint64_t)t->numel));
    }
    mq_page_printf(&b, "}");
    while (!b.oom && b.n % 8 != 0) mq_page_printf(&b, " ");
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    *len = b.n;
    return b.s;
}

static moeq_status io_error(const char *path, int err) {
    return mq_err(MOEQ_E_IO, "%s: write failed: %s", path, strerror(err ? err : EIO));
}

static moeq_status write_shard(gen *g, int shard, const char *path, uint64_t *bytes_out) {
    size_t hlen = 0;
    char *header = shard_header(g, shard, &hlen);
    if (!header) return mq_err(MOEQ_E_NOMEM, "%s: out of memory for the header", path);
    FILE *f = fopen(path, "wb");
    if (!f) {
        moeq_status st = mq_err(MOEQ_E_IO, "%s: cannot create: %s", path, strerror(errno));
        free(header);
        return st;
    }
    moeq_status st = MOEQ_OK;
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    errno = 0;
    if (fwrite(len8, 1, 8, f) != 8 || fwrite(header, 1, hlen, f) != hlen)
        st = io_error(path, errno);
    free(header);
    uint64_t data = 0, shard_data = 0;
    for (size_t i = 0; i < g->p->n; i++)
        if (g->p->t[i].shard == shard) shard_data += 2 * (uint64_t)g->p->t[i].numel;
    char label[48];
    snprintf(label, sizeof label, "shard %d/%d", shard + 1, g->n_shards);
    int cur = 0;
    step s = {.f = f};
    for (size_t i = 0; i < g->p->n && !st; i++) {
        const planned *t = &g->p->t[i];
        if (t->shard != shard) continue;
        for (int64_t first = 0; first < t->numel && !st; first += CHUNK_VALUES) {
            int64_t count = t->numel - first < CHUNK_VALUES ? t->numel - first : CHUNK_VALUES;
            s.t = t;
            s.first = first;
            s.count = count;
            s.fbuf = g->buf[cur];
            int64_t pieces = (count + PIECE_VALUES - 1) / PIECE_VALUES;
            mq_parallel_for(pieces + (s.wlen > 0), step_task, &s);
            if (s.werr) st = io_error(path, s.werr);
            else if (moeq_interrupted()) st = mq_err(MOEQ_E_INTERRUPTED, "interrupted");
            s.wbuf = g->buf[cur];
            s.wlen = (size_t)(2 * count);
            data += 2 * (uint64_t)count;
            cur ^= 1;
            mq_progress(label, (int64_t)(data >> 20), (int64_t)(shard_data >> 20) + 1);
        }
    }
    if (!st && s.wlen > 0) {
        errno = 0;
        if (fwrite(s.wbuf, 1, s.wlen, f) != s.wlen) st = io_error(path, errno);
    }
    if (!st) mq_progress(label, (int64_t)(shard_data >> 20) + 1, (int64_t)(shard_data >> 20) + 1);
    errno = 0;
    if (!st && fflush(f) != 0) st = io_error(path, errno);
    if (!st && ftello(f) != (off_t)(8 + hlen + data))
        st = mq_err(MOEQ_E_IO, "%s: wrote %lld bytes, expected %llu", path, (long long)ftello(f),
                    (unsigned long long)(8 + hlen + data));
    errno = 0;
    if (fclose(f) != 0 && !st) st = io_error(path, errno);
    *bytes_out = 8 + hlen + data;
    return st;
}

/* ---- small files ---------------------------------------------------------------------------- */
static moeq_status write_text(const char *dir, const char *name, const char *text, size_t len) {
    char *path = mq_path_join(dir, name);
    if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status st = MOEQ_OK;
    FILE *f = fopen(path, "wb");
    if (!f) {
        st = mq_err(MOEQ_E_IO, "%s: cannot create: %s", path, strerror(errno));
    } else {
        errno = 0;
        bool ok = fwrite(text, 1, len, f) == len;
        int err = errno;
        if (fclose(f) != 0 && ok) {
            ok = false;
            err = errno;
        }
        if (!ok) st = io_error(path, err);
    }
    free(path);
    return st;
}

static moeq_status write_index(const gen *g, const char *dir, uint64_t total) {
    mq_page b = {0};
    mq_page_printf(&b, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {",
              (unsigned long long)total);
    for (size_t i = 0; i < g->p->n; i++)
        mq_page_printf(&b, "%s\n    \"%s\": \"%s\"", i ? "," : "", g->p->t[i].name,
                  g->shard_names[g->p->t[i].shard]);
    mq_page_printf(&b, "\n  }\n}\n");
    moeq_status st = b.oom ? mq_err(MOEQ_E_NOMEM, "out of memory for the shard index")
                           : write_text(dir, "model.safetensors.index.json", b.s, b.n);
    free(b.s);
    return st;
}

/* The directory of the tokenizer to copy: --tokenizer DIR, else the bundled olmoe-tiny's (its
 * ids are < 4096, valid for every vocabulary here) found beside the executable (a build
 * directory in the source tree, or a copy of the tree with the binary) or in the source tree it
 * was built from; NULL if none has a tokenizer.json. */
static char *tokenizer_dir(const char *given) {
    if (given) return mq_strdup(given);
    char exe[4096];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) *slash = 0;
        static const char *const rel[] = {"%s/../models/olmoe-tiny", "%s/models/olmoe-tiny"};
        for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++) {
            char *d = mq_asprintf(rel[i], exe), *f = d ? mq_asprintf("%s/tokenizer.json", d) : NULL;
            const bool found = f && mq_file_exists(f);
            free(f);
            if (found) return d;
            free(d);
        }
    }
    char *f = mq_asprintf("%s/models/olmoe-tiny/tokenizer.json", MOEQ_SOURCE_DIR);
    const bool found = f && mq_file_exists(f);
    free(f);
    return found ? mq_asprintf("%s/models/olmoe-tiny", MOEQ_SOURCE_DIR) : NULL;
}

/* tokenizer.json (and tokenizer_config.json where there is one) from tokenizer_dir(given): a
 * given directory must have a tokenizer whose ids fit the vocabulary; without one and none
 * bundled, a warning and no tokenizer. */
static moeq_status copy_tokenizer(const char *dir, const char *given, int64_t vocab, bool quiet) {
    char *from = tokenizer_dir(given);
    if (!from) {
        if (!quiet) fprintf(stderr, "moeq %s: warning: the bundled tokenizer (models/olmoe-tiny) was not found "
                                    "beside the executable or in %s; no tokenizer written (--tokenizer DIR names one)\n",
                            CMD, MOEQ_SOURCE_DIR);
        return MOEQ_OK;
    }
    static const char *const files[] = {"tokenizer.json", "tokenizer_config.json"};
    moeq_status st = MOEQ_OK;
    if (given) {   /* its ids must be rows of the embeddings */
        char *tj = mq_asprintf("%s/tokenizer.json", from);
        moeq_tokenizer *tok = NULL;
        st = tj ? moeq_tokenizer_load(tj, &tok) : mq_err(MOEQ_E_NOMEM, "out of memory");
        if (st) st = mq_err_prefix(st, "--tokenizer %s", given);
        else if (moeq_tokenizer_vocab_size(tok) > vocab)
            st = mq_err(MOEQ_E_ARG, "--tokenizer %s: its %d token ids do not fit vocab_size %lld (--vocab)", given,
                        moeq_tokenizer_vocab_size(tok), (long long)vocab);
        moeq_tokenizer_free(tok);
        free(tj);
    }
    for (size_t i = 0; i < sizeof files / sizeof files[0] && !st; i++) {
        char *src = mq_asprintf("%s/%s", from, files[i]);
        if (!src) {
            st = mq_err(MOEQ_E_NOMEM, "out of memory");
            break;
        }
        char *text = NULL;
        size_t len = 0;
        st = mq_file_exists(src) ? mq_read_file(src, &text, &len) : MOEQ_E_NOTFOUND;
        if (st == MOEQ_E_NOTFOUND && i > 0) st = MOEQ_OK;   /* tokenizer_config.json is optional */
        else if (st == MOEQ_E_NOTFOUND) st = mq_err(MOEQ_E_NOTFOUND, "%s: not found", src);
        else if (st == MOEQ_OK) st = write_text(dir, files[i], text, len);
        free(text);
        free(src);
    }
    free(from);
    return st;
}

/* Puts tmp at out; an existing out (allowed by --force) is moved aside first and removed last. */
static moeq_status publish(const char *tmp, const char *out, bool exists) {
    if (!exists) {
        if (rename(tmp, out) != 0)
            return mq_err(MOEQ_E_IO, "%s: cannot rename %s into place: %s", out, tmp,
                          strerror(errno));
        return MOEQ_OK;
    }
    char *old = mq_asprintf("%s.old-%ld", out, (long)getpid());
    if (!old) return mq_err(MOEQ_E_NOMEM, "out of memory");
    moeq_status st = MOEQ_OK;
    if (rename(out, old) != 0) {
        st = mq_err(MOEQ_E_IO, "%s: cannot move the existing directory aside: %s", out,
                    strerror(errno));
    } else if (rename(tmp, out) != 0) {
        st = mq_err(MOEQ_E_IO, "%s: cannot rename %s into place: %s", out, tmp, strerror(errno));
        if (rename(old, out) != 0)
            fprintf(stderr, "moeq %s: the previous %s is left at %s\n", CMD, out, old);
    } else {
        mq_remove_tree(old);
    }
    free(old);
    return st;
}

/* ---- flags ---------------------------------------------------------------------------------- */
static int unknown_like(const char *name) {
    fprintf(stderr, "moeq %s: --like: unknown model '%s'; known models:\n", CMD, name);
    for (size_t i = 0; i < N_LIKES; i++)
        fprintf(stderr, "  %-18s %s (%s)\n", g_likes[i].name, g_likes[i].hub,
                g_likes[i].model_type);
    fprintf(stderr, "(see 'moeq %s --help')\n", CMD);
    return CLI_USAGE;
}

/* Applies the overrides (0 = keep); returns -1, or the exit code of a usage error. */
static int resolve(const like *m, int64_t layers, int64_t experts, int64_t top_k, int64_t hidden,
                   int64_t ffn, int64_t vocab, bool quiet, spec *s) {
    memset(s, 0, sizeof *s);
    s->m = m;
    s->D = hidden ? hidden : m->hidden;
    s->F = ffn ? ffn : m->ffn;
    s->layers = layers ? layers : m->layers;
    s->heads = m->heads;
    s->kv = m->kv_heads;
    s->V = vocab ? vocab : m->vocab;
    s->E = m->experts;
    s->K = m->top_k;
    /* The other widths keep their ratio to the expert width where it is a whole number
     * (qwen2_moe's shared expert and intermediate_size are 4x the expert's, qwen3_moe's unused
     * dense width 8x), so small variants stay small. */
    s->inter = m->inter;
    s->shared = m->shared;
    if (ffn && m->inter % m->ffn == 0) s->inter = ffn * (m->inter / m->ffn);
    if (ffn && m->shared % m->ffn == 0) s->shared = ffn * (m->shared / m->ffn);
    if (!is_moe(s) && (experts || top_k))
        return cli_usage_error(CMD, "--%s: %s is a dense model (no experts)",
                               experts ? "experts" : "top-k", m->name);
    if (experts) s->E = experts;
    if (top_k) {
        if (top_k > s->E)
            return cli_usage_error(CMD, "--top-k %lld exceeds the number of experts %lld",
                                   (long long)top_k, (long long)s->E);
        s->K = top_k;
    } else if (s->K > s->E) {
        if (!quiet)
            fprintf(stderr, "moeq %s: %lld experts: num_experts_per_tok %lld -> %lld\n", CMD,
                    (long long)s->E, (long long)s->K, (long long)s->E);
        s->K = s->E;
    }
    if (s->K > 64) return cli_usage_error(CMD, "--top-k: at most 64 experts per token");
    if (m->head_dim_derived) {
        if (s->D % s->heads != 0 || (s->D / s->heads) % 2 != 0)
            return cli_usage_error(CMD, "--hidden %lld: must be a multiple of 2 * "
                                   "num_attention_heads = %lld for %s (head_dim = hidden / heads, "
                                   "even)",
                                   (long long)s->D, (long long)(2 * s->heads), m->name);
        s->hd = s->D / s->heads;
    } else {
        s->hd = m->head_dim;
    }
    if (vocab && vocab < 4096 && !quiet)
        fprintf(stderr, "moeq %s: warning: --vocab %lld is below the bundled tokenizer's 4096 "
                "ids\n", CMD, (long long)vocab);
    /* Special ids past a smaller vocabulary would make generate's BOS an invalid token: they
     * become the bundled tokenizer's (<|endoftext|> = 0, <|padding|> = 1). */
    s->bos = m->bos;
    s->eos = m->eos;
    s->pad = m->pad;
    if (s->bos >= s->V || s->eos >= s->V || s->pad >= s->V) {
        if (s->bos >= 0) s->bos = s->bos < s->V ? s->bos : 0;
        if (s->eos >= 0) s->eos = s->eos < s->V ? s->eos : 0;
        if (s->pad >= 0) s->pad = s->pad < s->V && s->V > 1 ? s->pad : 1 % s->V;
        if (!quiet)
            fprintf(stderr, "moeq %s: vocab %lld: special token ids outside it replaced by the "
                    "bundled tokenizer's (bos/eos 0, pad 1)\n", CMD, (long long)s->V);
    }
    return -1;
}

/* ---- the command ---------------------------------------------------------------------------- */
static void human_bytes(char *buf, size_t n, double b) {
    if (b >= 1e9) snprintf(buf, n, "%.2f GB", b / 1e9);
    else if (b >= 1e6) snprintf(buf, n, "%.2f MB", b / 1e6);
    else if (b >= 1e3) snprintf(buf, n, "%.1f KB", b / 1e3);
    else snprintf(buf, n, "%.0f B", b);
}

/* Parses the config text with the project's parser and checks its parameter count; *active: the
 * parameters one token uses, as the parser's model counts them. */
static moeq_status check_config(const char *json, const char *label, int64_t planned_params,
                                int64_t *active) {
    mq_config c;
    moeq_status st = mq_config_parse(json, strlen(json), label, &c);
    if (st) return st;
    int64_t total = 0;
    mq_config_param_counts(&c, &total, active);
    mq_config_free(&c);
    if (total != planned_params)
        return mq_err(MOEQ_E_NUMERIC, "%s: implies %lld parameters but %lld are planned", label,
                      (long long)total, (long long)planned_params);
    return MOEQ_OK;
}

/* dry_run: plan and check only; config.json and the summary go to stdout, nothing is written. */
static moeq_status generate(const spec *sp, const char *out, bool exists, uint64_t seed,
                            uint64_t max_shard, const char *tokenizer, bool quiet, bool dry_run) {
    gen g = {.p = NULL};
    plan p = {0};
    g.p = &p;
    char *tmp = NULL, *cfg = NULL, *gcfg = NULL, *parent = NULL, *slash = NULL;
    bool made_tmp = false;
    int64_t params = 0, active = 0;
    uint64_t data_total = 0, file_bytes = 0;
    struct statvfs vfs;
    moeq_status st = MOEQ_OK;
    double t0 = mq_now();

    make_quantiles();
    plan_model(&p, sp, seed);
    if (p.oom) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory planning the tensors");
        goto done;
    }
    for (size_t i = 0; i < p.n; i++) params += p.t[i].numel;
    data_total = 2 * (uint64_t)params;
    g.n_shards = assign_shards(&p, max_shard);

    cfg = config_json(sp);
    gcfg = generation_config_json(sp);
    if (!cfg || !gcfg) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    if ((st = check_config(cfg, "generated config.json", params, &active))) goto done;
    if (dry_run) {
        char b[32];
        human_bytes(b, sizeof b, (double)data_total);
        printf("%sgen-model %s: %lld parameters (%lld active), %zu tensors, %llu bytes of data "
               "(%s) in %d shard%s (dry run: nothing written)\n",
               cfg, sp->m->name, (long long)params, (long long)active, p.n,
               (unsigned long long)data_total, b, g.n_shards, g.n_shards > 1 ? "s" : "");
        goto done;
    }

    /* Fail before writing when the file system cannot hold it (headers: well under 1%). */
    parent = mq_strdup(out);
    if (!parent) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    slash = strrchr(parent, '/');
    if (slash == parent) slash[1] = 0;   /* "/x": the root */
    else if (slash) *slash = 0;
    if (statvfs(slash ? parent : ".", &vfs) == 0) {
        double avail = (double)vfs.f_bavail * (double)vfs.f_frsize;
        if ((double)data_total > avail) {
            char need[32], have[32];
            human_bytes(need, sizeof need, (double)data_total);
            human_bytes(have, sizeof have, avail);
            st = mq_err(MOEQ_E_IO, "%s: needs %s but its file system has %s free", out, need, have);
        }
    }
    free(parent);
    parent = NULL;
    if (st) goto done;

    if (!(tmp = mq_asprintf("%s.tmp-%ld", out, (long)getpid()))) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    mq_remove_tree(tmp);   /* a stale one from an earlier process with this pid */
    if (mkdir(tmp, 0755) != 0) {
        /* named by the directory asked for, not the temporary one that no longer exists */
        st = mq_err(MOEQ_E_IO, "%s: cannot create: %s", out, strerror(errno));
        goto done;
    }
    made_tmp = true;
    if (!quiet) {
        char b[32];
        human_bytes(b, sizeof b, (double)data_total);
        fprintf(stderr, "moeq %s: %s (%s): %zu tensors, %lld parameters, %s in %d shard%s -> %s\n",
                CMD, sp->m->name, sp->m->hub, p.n, (long long)params, b, g.n_shards,
                g.n_shards > 1 ? "s" : "", out);
    }

    if ((st = write_text(tmp, "config.json", cfg, strlen(cfg)))) goto done;
    if ((st = write_text(tmp, "generation_config.json", gcfg, strlen(gcfg)))) goto done;
    if ((st = copy_tokenizer(tmp, tokenizer, sp->V, quiet))) goto done;

    g.shard_names = calloc((size_t)g.n_shards, sizeof *g.shard_names);
    g.buf[0] = mq_alloc((size_t)(2 * CHUNK_VALUES), "gen-model chunk");
    g.buf[1] = mq_alloc((size_t)(2 * CHUNK_VALUES), "gen-model chunk");
    if (!g.shard_names || !g.buf[0] || !g.buf[1]) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    for (int k = 0; k < g.n_shards; k++) {
        g.shard_names[k] = g.n_shards == 1 ? mq_strdup("model.safetensors")
                                           : mq_asprintf("model-%05d-of-%05d.safetensors", k + 1,
                                                         g.n_shards);
        if (!g.shard_names[k]) {
            st = mq_err(MOEQ_E_NOMEM, "out of memory");
            goto done;
        }
    }
    for (int k = 0; k < g.n_shards && !st; k++) {
        char *path = mq_path_join(tmp, g.shard_names[k]);
        if (!path) {
            st = mq_err(MOEQ_E_NOMEM, "out of memory");
            break;
        }
        double ts = mq_now();
        uint64_t bytes = 0;
        st = write_shard(&g, k, path, &bytes);
        free(path);
        file_bytes += bytes;
        if (!st && !quiet) {
            double dt = mq_now() - ts;
            char b[32];
            human_bytes(b, sizeof b, (double)bytes);
            fprintf(stderr, "moeq %s: [%d/%d] %s: %s in %.2f s (%.2f GB/s)\n", CMD, k + 1,
                    g.n_shards, g.shard_names[k], b, dt, dt > 0 ? (double)bytes / dt / 1e9 : 0.0);
        }
    }
    if (!st && g.n_shards > 1) st = write_index(&g, tmp, data_total);
    if (!st) st = publish(tmp, out, exists);
    if (!st) {
        made_tmp = false;
        double dt = mq_now() - t0;
        char b[32];
        human_bytes(b, sizeof b, (double)file_bytes);
        printf("gen-model %s: %lld parameters (%lld active), %llu bytes (%s) in %d shard%s, "
               "%.2f s, %.2f GB/s, %d threads -> %s\n",
               sp->m->name, (long long)params, (long long)active, (unsigned long long)file_bytes, b,
               g.n_shards,
               g.n_shards > 1 ? "s" : "", dt, dt > 0 ? (double)file_bytes / dt / 1e9 : 0.0,
               moeq_threads(), out);
    }

done:
    if (made_tmp) mq_remove_tree(tmp);
    if (g.shard_names)
        for (int k = 0; k < g.n_shards; k++) free(g.shard_names[k]);
    free(g.shard_names);
    mq_free(g.buf[0]);
    mq_free(g.buf[1]);
    free(parent);
    free(tmp);
    free(cfg);
    free(gcfg);
    plan_free(&p);
    return st;
}

int bench_gen_model(int argc, char **argv) {
    const char *name = NULL, *out = NULL, *max_shard_text = NULL, *tokenizer = NULL;
    int64_t layers = 0, experts = 0, top_k = 0, hidden = 0, ffn = 0, vocab = 0, seed = 0,
            threads = 0;
    bool force = false, quiet = false, dry_run = false;
    const cli_opt opts[] = {
        {"--like", OPT_STRING, &name, "NAME", "the model to copy (required; names below)", NULL, 0,
         0, NULL},
        {"--out", OPT_STRING, &out, "DIR", "output checkpoint directory (required)", NULL, 0, 0,
         NULL},
        {"--layers", OPT_INT, &layers, "N", "num_hidden_layers (default: the model's)", NULL, 1,
         4096, NULL},
        {"--experts", OPT_INT, &experts, "N", "routed experts per layer (top-k is capped at N)",
         NULL, 1, 65536, NULL},
        {"--top-k", OPT_INT, &top_k, "K", "num_experts_per_tok (default: the model's)", NULL, 1,
         64, NULL},
        {"--hidden", OPT_INT, &hidden, "N", "hidden_size (heads kept; head_dim = N / heads where "
         "the family derives it)", NULL, 2, 1 << 20, NULL},
        {"--ffn", OPT_INT, &ffn, "N", "expert width (MoE) or intermediate_size (dense)", NULL, 1,
         1 << 22, NULL},
        {"--vocab", OPT_INT, &vocab, "N", "vocab_size", NULL, 1, 1 << 26, NULL},
        {"--seed", OPT_INT, &seed, "S", "random seed (default 0); same seed, same bytes", NULL, 0,
         INT64_MAX, NULL},
        {"--max-shard-size", OPT_STRING, &max_shard_text, "SIZE", "largest shard's tensor data "
         "(bytes, or 500MB, 5GB, 2GiB; default 5GB)", NULL, 0, 0, NULL},
        {"--threads", OPT_INT, &threads, "N", "worker threads (default: every CPU it may use)", NULL, 1, 1024,
         NULL},
        {"--tokenizer", OPT_STRING, &tokenizer, "DIR", "copy DIR's tokenizer.json (and tokenizer_config.json); "
         "its ids must fit the vocabulary (default: the bundled olmoe-tiny's, found beside the executable or in the "
         "source tree)", NULL, 0, 0, NULL},
        {"--force", OPT_FLAG, &force, NULL, "replace an existing DIR", NULL, 0, 0, NULL},
        {"--quiet", OPT_FLAG, &quiet, NULL, "no progress lines on stderr", NULL, 0, 0, NULL},
        {"--dry-run", OPT_FLAG, &dry_run, NULL, "plan and check only: print config.json and the "
         "counts, write nothing (--out not needed)", NULL, 0, 0, NULL},
    };
    const cli_command cmd = {
        CMD, "--like NAME --out DIR [options]",
        "Writes a Hugging Face checkpoint (config.json, generation_config.json, bf16 safetensors\n"
        "shards with their index, the bundled tokenizer) with a real model's config and tensor\n"
        "names and shapes and random weights, N(0, 0.02) with norms at 1, deterministic in\n"
        "--seed.\n"
        "--layers/--experts/--hidden/--ffn/--vocab make smaller variants of the same layout.\n"
        "NAME: olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b, qwen2-moe-a2.7b, llama-3.2-1b, deepseek-v3.",
        opts, (int)(sizeof opts / sizeof opts[0]), 0, 0, NULL};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!name) return cli_usage_error(CMD, "--like NAME is required");
    if ((!out || !*out) && !dry_run) return cli_usage_error(CMD, "--out DIR is required");
    const like *m = NULL;
    for (size_t i = 0; i < N_LIKES; i++)
        if (!strcmp(name, g_likes[i].name)) m = &g_likes[i];
    if (!m) return unknown_like(name);
    uint64_t max_shard = 5000000000ull;
    if (max_shard_text && !cli_parse_size(max_shard_text, &max_shard))
        return cli_usage_error(CMD, "--max-shard-size: cannot read '%s' (bytes, or e.g. 500MB, "
                               "5GB, 2GiB)", max_shard_text);
    spec sp;
    if ((rc = resolve(m, layers, experts, top_k, hidden, ffn, vocab, quiet, &sp)) >= 0) return rc;

    if (dry_run) {
        moeq_status st =
            generate(&sp, out ? out : "", false, (uint64_t)seed, max_shard, tokenizer, true, true);
        return st ? cli_fail(CMD, st) : CLI_OK;
    }
    size_t olen = strlen(out);
    while (olen > 1 && out[olen - 1] == '/') olen--;
    char *dir = mq_strndup(out, olen);
    if (!dir) return cli_fail(CMD, mq_err(MOEQ_E_NOMEM, "out of memory"));
    struct stat so;
    bool exists = stat(dir, &so) == 0;
    moeq_status st = MOEQ_OK;
    if (exists && !force)
        st = mq_err(MOEQ_E_EXISTS, "%s: already exists (use --force to replace it)", dir);
    else if (exists && !S_ISDIR(so.st_mode))
        st = mq_err(MOEQ_E_EXISTS, "%s: exists and is not a directory", dir);
    if (!st) {
        if (threads > 0) moeq_set_threads((int)threads);
        cli_install_sigint();
        cli_progress_enable(quiet);
        st = generate(&sp, dir, exists, (uint64_t)seed, max_shard, tokenizer, quiet, false);
    }
    free(dir);
    return st ? cli_fail(CMD, st) : CLI_OK;
}
