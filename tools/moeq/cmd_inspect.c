/*
 * moeq inspect MODEL_DIR [--tensors]: what a checkpoint holds, read from config.json and the
 * safetensors headers only (no weight is loaded, so it is instant on any size): architecture,
 * layer and expert layout, parameter counts (total and active per token), values and bytes per
 * dtype, the quantization scheme when config.json has a quantization_config, the storage of the
 * 2-D weights (dense or a quantized layout, src/export/layout.h) with their bits per weight, and
 * with --tensors every tensor's dtype, shape and size, with --weights every weight's storage.
 */
#include <cjson/cJSON.h>
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "export/layout.h"
#include "model/model.h"

/* "9.45M" style figure. */
static void human(char *buf, size_t n, double v, const char *unit) {
    const char *suffix[] = {"", "K", "M", "G", "T"};
    int k = 0;
    while (v >= 1000 && k < 4) {
        v /= 1000;
        k++;
    }
    snprintf(buf, n, k ? "%.2f %s%s" : "%.0f %s%s", v, suffix[k], unit);
}

/* Orders tensor names with digit runs compared as numbers (layers.2 before layers.10). */
static int natural_cmp(const char *a, const char *b) {
    while (*a && *b) {
        if (isdigit((unsigned char)*a) && isdigit((unsigned char)*b)) {
            char *ea, *eb;
            unsigned long long x = strtoull(a, &ea, 10), y = strtoull(b, &eb, 10);
            if (x != y) return x < y ? -1 : 1;
            a = ea;
            b = eb;
            continue;
        }
        if (*a != *b) return (unsigned char)*a < (unsigned char)*b ? -1 : 1;
        a++;
        b++;
    }
    return *a ? 1 : *b ? -1 : 0;
}

static int cmp_views(const void *x, const void *y) {
    const mq_tensor_view *a = *(const mq_tensor_view *const *)x, *b = *(const mq_tensor_view *const *)y;
    return natural_cmp(a->name, b->name);
}

/* ---- quantization_config ------------------------------------------------------------------- */
static const char *jstr(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static void print_json_compact(const char *label, const cJSON *v) {
    char *s = cJSON_PrintUnformatted(v);
    if (s) printf("  %-20s %s\n", label, s);
    free(s);
}

/* compressed-tensors: one line per config group (targets, weight / activation scheme). */
static void print_ct_groups(const cJSON *q) {
    const cJSON *groups = cJSON_GetObjectItemCaseSensitive(q, "config_groups"), *g;
    cJSON_ArrayForEach(g, groups) {
        printf("  group %-14s", g->string);
        const char *parts[] = {"weights", "input_activations"};
        for (int i = 0; i < 2; i++) {
            const cJSON *w = cJSON_GetObjectItemCaseSensitive(g, parts[i]);
            if (!cJSON_IsObject(w)) continue;
            const cJSON *bits = cJSON_GetObjectItemCaseSensitive(w, "num_bits");
            const cJSON *gs = cJSON_GetObjectItemCaseSensitive(w, "group_size");
            printf(" %s: %s%d", i ? "activations" : "weights", jstr(w, "type") ? jstr(w, "type") : "?",
                   cJSON_IsNumber(bits) ? bits->valueint : 0);
            if (jstr(w, "strategy")) printf(" %s", jstr(w, "strategy"));
            if (cJSON_IsNumber(gs)) printf(" g%d", gs->valueint);
            const cJSON *sym = cJSON_GetObjectItemCaseSensitive(w, "symmetric");
            if (cJSON_IsBool(sym)) printf(" %s", cJSON_IsTrue(sym) ? "sym" : "asym");
            printf(";");
        }
        const cJSON *targets = cJSON_GetObjectItemCaseSensitive(g, "targets");
        if (targets) {
            char *t = cJSON_PrintUnformatted(targets);
            printf(" targets %s", t ? t : "?");
            free(t);
        }
        printf("\n");
    }
}

/* Prints the scheme of a quantized checkpoint. Each quant_method gets its own branch here;
 * unknown ones are shown as raw JSON. */
static void print_quantization(const char *config_path) {
    char *json = NULL;
    size_t len = 0;
    if (mq_read_file(config_path, &json, &len) != MOEQ_OK) return;
    cJSON *root = cJSON_ParseWithLength(json, len);
    free(json);
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(root, "quantization_config");
    if (!cJSON_IsObject(q)) {
        printf("quantization          none (unquantized checkpoint)\n");
        cJSON_Delete(root);
        return;
    }
    const char *method = jstr(q, "quant_method");
    printf("quantization          %s", method ? method : "(no quant_method)");
    if (jstr(q, "format")) printf(", format %s", jstr(q, "format"));
    printf("\n");
    if (method && !strcmp(method, "compressed-tensors")) {
        print_ct_groups(q);
        const cJSON *ign = cJSON_GetObjectItemCaseSensitive(q, "ignore");
        if (ign) print_json_compact("ignore", ign);
    } else if (method && !strcmp(method, "fp8")) {
        /* an FP8 block-quantized source (io/fp8.h): read dequantized to fp32 */
        const cJSON *bs = cJSON_GetObjectItemCaseSensitive(q, "weight_block_size");
        const cJSON *b0 = cJSON_GetArrayItem(bs, 0), *b1 = cJSON_GetArrayItem(bs, 1);
        if (cJSON_IsNumber(b0) && cJSON_IsNumber(b1))
            printf("  %-20s FP8 %s weights with one weight_scale_inv per %d x %d block "
                   "(dequantized to fp32 when loaded)\n", "source", jstr(q, "fmt") ? jstr(q, "fmt") : "e4m3",
                   b0->valueint, b1->valueint);
        const char *keys[] = {"activation_scheme", "modules_to_not_convert"};
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(q, keys[i]);
            if (v) print_json_compact(keys[i], v);
        }
    } else if (method && (!strcmp(method, "gptq") || !strcmp(method, "awq"))) {
        const char *keys[] = {"bits", "group_size", "desc_act", "sym", "checkpoint_format"};
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(q, keys[i]);
            if (v) print_json_compact(keys[i], v);
        }
    } else {
        print_json_compact("config", q);
    }
    cJSON_Delete(root);
}

/* ---- weight storage (scheme and bits per weight of every 2-D weight) ------------------------- */
/* Module name of a tensor that carries a weight: P.weight (2-D), P.weight_packed, P.qweight. */
static char *weight_module(const mq_tensor_view *t) {
    const char *dot = strrchr(t->name, '.');
    if (!dot) return NULL;
    const char *suf = dot + 1;
    if ((!strcmp(suf, "weight") && t->ndim == 2) || !strcmp(suf, "weight_packed") ||
        !strcmp(suf, "qweight"))
        return mq_strndup(t->name, (size_t)(dot - t->name));
    return NULL;
}

typedef struct {
    mq_linear_kind kind;
    int64_t n, weights;
    double bits;   /* sum of bits */
} storage_sum;

static int cmp_names(const void *x, const void *y) {
    return natural_cmp(*(char *const *)x, *(char *const *)y);
}

/* One summary line per storage kind; with list, one indented line per weight in layer order. */
static moeq_status print_storage(const mq_st *sf, bool list) {
    storage_sum sum[MQ_LIN_FP8_BLOCK + 1];
    memset(sum, 0, sizeof sum);
    size_t n = 0, cnt = mq_st_count(sf);
    char **mods = malloc(sizeof *mods * (cnt ? cnt : 1));
    if (!mods) return mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t i = 0; i < cnt; i++) {
        char *m = weight_module(mq_st_at(sf, i));
        if (m) mods[n++] = m;
    }
    qsort(mods, n, sizeof *mods, cmp_names);
    if (list) printf("\n  %-62s %-28s %6s %6s\n", "weight", "storage", "group", "bits");
    moeq_status s = MOEQ_OK;
    for (size_t i = 0; i < n && !s; i++) {
        mq_linear_qinfo qi;
        if ((s = mq_linear_qinfo_get(sf, mods[i], &qi))) break;
        if (list) {
            char g[16] = "-";
            if (qi.scheme != MQ_QS_NONE) snprintf(g, sizeof g, "%lld", (long long)qi.group_size);
            if (qi.kind == MQ_LIN_FP8_BLOCK) {
                const mq_tensor_view *t = NULL;
                char wn[1024];
                if (snprintf(wn, sizeof wn, "%s.weight", mods[i]) < (int)sizeof wn) t = mq_st_find(sf, wn);
                if (t) snprintf(g, sizeof g, "%dx%d", t->block_rows, t->block_cols);
            }
            printf("  %-62s %-28s %6s %6.3f\n", mods[i], mq_linear_kind_name(qi.kind), g,
                   qi.bits_per_weight);
        }
        sum[qi.kind].n++;
        sum[qi.kind].weights += qi.rows * qi.cols;
        sum[qi.kind].bits += qi.bits_per_weight * (double)qi.rows * (double)qi.cols;
    }
    for (size_t i = 0; i < n; i++) free(mods[i]);
    free(mods);
    for (int k = MQ_LIN_DENSE; k <= MQ_LIN_FP8_BLOCK && !list && !s; k++) {
        if (!sum[k].n) continue;
        char a[32];
        human(a, sizeof a, (double)sum[k].weights, "");
        printf("  %-20s %lld weights (%s values), %.3f bits per weight\n",
               mq_linear_kind_name((mq_linear_kind)k), (long long)sum[k].n, a,
               sum[k].bits / (double)sum[k].weights);
    }
    return s;
}

/* ---- the command --------------------------------------------------------------------------- */
static const char *arch_notes(const mq_config *c) {
    switch (c->arch) {
    case MQ_ARCH_LLAMA: return "dense";
    case MQ_ARCH_OLMOE: return "MoE, q/k RMSNorm over the whole projection";
    case MQ_ARCH_QWEN2_MOE: return "MoE with a shared expert (sigmoid gate), q/k/v bias";
    case MQ_ARCH_QWEN3_MOE: return "MoE, per-head q/k RMSNorm";
    case MQ_ARCH_MIXTRAL: return "MoE (block_sparse_moe)";
    case MQ_ARCH_DEEPSEEK_V3:
        return "MoE, multi-head latent attention, sigmoid group-limited routing";
    }
    return "";
}

static int inspect(const char *dir, bool tensors, bool weights) {
    mq_config c;
    moeq_status st = mq_config_load(dir, &c);
    if (st) return cli_fail("inspect", st);
    mq_st *sf = NULL;
    st = mq_st_open_dir(dir, &sf);
    if (st) {
        mq_config_free(&c);
        return cli_fail("inspect", st);
    }
    char a[32], b[32];
    int n_moe = 0;
    for (int l = 0; l < c.n_layers; l++) n_moe += c.layer_is_moe[l];
    printf("model                 %s\n", dir);
    printf("architecture          %s (%s)\n", c.model_type, arch_notes(&c));
    printf("layers                %d (%d MoE, %d dense)\n", c.n_layers, n_moe, c.n_layers - n_moe);
    printf("hidden size           %d\n", c.D);
    printf("attention             %d heads, %d kv heads, head_dim %d%s%s\n", c.n_heads,
           c.n_kv_heads, c.head_dim, c.qkv_bias ? ", q/k/v bias" : "",
           c.sliding_window > 0 ? ", sliding window" : "");
    if (c.mla) {
        char qr[32] = "none (q_proj)";
        if (c.q_lora_rank > 0) snprintf(qr, sizeof qr, "%d", c.q_lora_rank);
        printf("latent attention      q_lora_rank %s, kv_lora_rank %d, q/k head %d + %d rope, "
               "v head %d%s\n", qr, c.kv_lora_rank, c.qk_nope, c.qk_rope, c.v_head_dim,
               c.rope_interleave ? ", interleaved rope" : "");
    }
    printf("rope theta            %g", c.rope_theta);
    if (c.yarn)
        printf(", YaRN factor %g (original context %d), cos/sin x %.6g, softmax scale %.6g",
               c.yarn_factor, c.yarn_orig_max_pos, c.rope_attn_factor, c.attn_scale);
    printf("\n");
    printf("vocab / context       %d / %d\n", c.vocab, c.max_pos);
    if (n_moe > 0) {
        printf("experts               %d per MoE layer, top-%d, expert ffn %d, top-k weights %s\n",
               c.n_experts, c.top_k, c.moe_ffn, c.norm_topk_prob ? "renormalised" : "as softmax");
        if (c.shared_ffn > 0) printf("shared expert         ffn %d%s\n", c.shared_ffn,
                                     c.shared_gate ? ", sigmoid gate" : "");
        if (c.sigmoid_router)
            printf("routing               sigmoid scores%s, %d groups (top %d eligible), "
                   "weights x %g\n", c.router_bias ? " + e_score_correction_bias for the choice" : "",
                   c.n_group, c.topk_group, (double)c.routed_scale);
    }
    if (c.arch == MQ_ARCH_DEEPSEEK_V3) {
        /* multi-token prediction layers: past num_hidden_layers, never run, kept by quantize */
        size_t n_mtp_t = 0, mtp_bytes = 0;
        for (size_t i = 0; i < mq_st_count(sf); i++) {
            int l;
            const mq_tensor_view *t = mq_st_at(sf, i);
            if (sscanf(t->name, "model.layers.%d.", &l) == 1 && l >= c.n_layers) {
                n_mtp_t++;
                mtp_bytes += t->nbytes;
            }
        }
        human(a, sizeof a, (double)mtp_bytes, "B");
        printf("MTP layers            %d (num_nextn_predict_layers): %zu tensors, %s in the "
               "checkpoint%s\n", c.n_mtp, n_mtp_t, a,
               n_mtp_t ? " (not run; quantize passes them through, --drop-mtp drops them)" : "");
    }
    if (n_moe < c.n_layers) printf("dense ffn             %d\n", c.ffn);
    printf("tied embeddings       %s\n", c.tie_embeddings ? "yes" : "no");
    int64_t total = 0, active = 0;
    mq_config_param_counts(&c, &total, &active);
    human(a, sizeof a, (double)total, "");
    human(b, sizeof b, (double)active, "");
    printf("parameters            %s total (%lld), %s active per token (%lld)\n", a,
           (long long)total, b, (long long)active);

    int64_t numel[MOEQ_DT_COUNT] = {0};
    size_t bytes[MOEQ_DT_COUNT] = {0}, all_bytes = 0;
    size_t n = mq_st_count(sf);
    for (size_t i = 0; i < n; i++) {
        const mq_tensor_view *t = mq_st_at(sf, i);
        numel[t->dtype] += t->numel;
        bytes[t->dtype] += t->nbytes;
        all_bytes += t->nbytes;
    }
    human(a, sizeof a, (double)all_bytes, "B");
    printf("tensors               %zu, %s of data\n", n, a);
    for (int d = 0; d < MOEQ_DT_COUNT; d++) {
        if (!bytes[d] && !numel[d]) continue;
        human(a, sizeof a, (double)bytes[d], "B");
        printf("  %-20s %lld values, %s\n", moeq_dtype_name((moeq_dtype)d), (long long)numel[d], a);
    }
    char *cfg_path = mq_path_join(dir, "config.json");
    if (cfg_path) print_quantization(cfg_path);
    free(cfg_path);
    printf("2-D weights by storage\n");
    st = print_storage(sf, false);
    if (st) {
        mq_st_close(sf);
        mq_config_free(&c);
        return cli_fail("inspect", st);
    }

    if (tensors) {
        const mq_tensor_view **v = malloc(sizeof *v * (n ? n : 1));
        if (!v) {
            mq_st_close(sf);
            mq_config_free(&c);
            return cli_fail("inspect", mq_err(MOEQ_E_NOMEM, "out of memory"));
        }
        for (size_t i = 0; i < n; i++) v[i] = mq_st_at(sf, i);
        qsort(v, n, sizeof *v, cmp_views);
        printf("\n%-64s %-8s %-20s %12s\n", "tensor", "dtype", "shape", "bytes");
        for (size_t i = 0; i < n; i++) {
            char shape[96];
            size_t k = (size_t)snprintf(shape, sizeof shape, "[");
            for (int d = 0; d < v[i]->ndim && k < sizeof shape; d++)
                k += (size_t)snprintf(shape + k, sizeof shape - k, "%s%lld", d ? ", " : "",
                                      (long long)v[i]->shape[d]);
            if (k < sizeof shape) snprintf(shape + k, sizeof shape - k, "]");
            printf("%-64s %-8s %-20s %12zu\n", v[i]->name, moeq_dtype_name(v[i]->dtype), shape,
                   v[i]->nbytes);
        }
        free(v);
    }
    if (weights) st = print_storage(sf, true);
    mq_st_close(sf);
    if (st) {
        mq_config_free(&c);
        return cli_fail("inspect", st);
    }
    mq_config_free(&c);
    return CLI_OK;
}

int cmd_inspect(int argc, char **argv) {
    bool tensors = false, weights = false;
    const char *revision = NULL;
    const cli_opt opts[] = {
        CLI_REVISION_OPT(revision),
        {"--tensors", OPT_FLAG, &tensors, NULL, "also list every tensor: dtype, shape, bytes", NULL,
         0, 0, NULL},
        {"--weights", OPT_FLAG, &weights, NULL, "also list every 2-D weight: storage (dense or "
         "quantized layout), group size, bits per weight", NULL, 0, 0, NULL},
    };
    const cli_command cmd = {
        "inspect", "MODEL_DIR|FILE.gguf [--tensors] [--weights]",
        "Shows a checkpoint's architecture, layer and expert layout, parameter counts (total and\n"
        "active per token), values and bytes per dtype and its quantization scheme, from\n"
        "config.json and the safetensors headers (no weights are loaded).",
        opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (cli_is_gguf(pos[0])) return cli_inspect_gguf(pos[0], tensors || weights);
    const char *dir = cli_model_dir("inspect", pos[0], revision);
    return dir ? inspect(dir, tensors, weights) : CLI_FAIL;
}
