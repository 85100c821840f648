/*
 * moeq inspect MODEL_DIR [--tensors]: what a checkpoint holds, read from config.json and the
 * safetensors headers only (no weight is loaded, so it is instant on any size): architecture,
 * layer and expert layout, parameter counts (total and active per token), values and bytes per
 * dtype, the quantization scheme when config.json has a quantization_config, the storage of the
 * 2-D weights (dense or a quantized layout) with their bits per weight, and with --tensors every
 * tensor's dtype, shape and size, with --weights every weight's storage. The facts are the
 * library's (moeq_inspect_json_ex); this file renders them as text.
 */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

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

static void print_quantization(const cJSON *q) {
    if (!cJSON_IsObject(q)) {
        printf("quantization          none (unquantized checkpoint)\n");
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
        /* an FP8 block-quantized source (moeq reads it dequantized): read dequantized to fp32 */
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
}

/* ---- reading the facts ------------------------------------------------------------------- */
static double num(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : 0;
}
static int inum(const cJSON *o, const char *k) { return (int)num(o, k); }
static long long llnum(const cJSON *o, const char *k) { return (long long)num(o, k); }
static bool flag(const cJSON *o, const char *k) { return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, k)); }
static const cJSON *obj(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }

static void print_model(const char *dir, const cJSON *j) {
    char a[32], b[32];
    const int layers = inum(j, "layers"), n_moe = inum(j, "moe_layers");
    printf("model                 %s\n", dir);
    printf("architecture          %s (%s)\n", jstr(j, "model_type"), jstr(j, "architecture"));
    printf("layers                %d (%d MoE, %d dense)\n", layers, n_moe, layers - n_moe);
    printf("hidden size           %d\n", inum(j, "hidden_size"));
    const cJSON *at = obj(j, "attention"), *m = obj(j, "latent_attention");
    printf("attention             %d heads, %d kv heads, head_dim %d%s%s\n", inum(at, "heads"),
           inum(at, "kv_heads"), inum(at, "head_dim"), flag(at, "qkv_bias") ? ", q/k/v bias" : "",
           flag(at, "sliding_window") ? ", sliding window" : "");
    if (m) {
        char qr[32] = "none (q_proj)";
        if (inum(m, "q_lora_rank") > 0) snprintf(qr, sizeof qr, "%d", inum(m, "q_lora_rank"));
        printf("latent attention      q_lora_rank %s, kv_lora_rank %d, q/k head %d + %d rope, "
               "v head %d%s\n", qr, inum(m, "kv_lora_rank"), inum(m, "qk_nope_head_dim"),
               inum(m, "qk_rope_head_dim"), inum(m, "v_head_dim"),
               flag(m, "rope_interleave") ? ", interleaved rope" : "");
    }
    const cJSON *rope = obj(j, "rope"), *yarn = obj(rope, "yarn");
    printf("rope theta            %g", num(rope, "theta"));
    if (yarn)
        printf(", YaRN factor %g (original context %d), cos/sin x %.6g, softmax scale %.6g",
               num(yarn, "factor"), inum(yarn, "original_context"), num(yarn, "attention_factor"),
               num(yarn, "softmax_scale"));
    printf("\n");
    printf("vocab / context       %d / %d\n", inum(j, "vocab_size"), inum(j, "context"));
    if (n_moe > 0) {
        printf("experts               %d per MoE layer, top-%d, expert ffn %d, top-k weights %s\n",
               inum(j, "experts"), inum(j, "experts_per_token"), inum(j, "expert_ffn"),
               flag(j, "norm_topk_prob") ? "renormalised" : "as softmax");
        if (inum(j, "shared_expert_ffn") > 0)
            printf("shared expert         ffn %d%s\n", inum(j, "shared_expert_ffn"),
                   flag(j, "shared_expert_gate") ? ", sigmoid gate" : "");
        const cJSON *r = obj(j, "sigmoid_routing");
        if (r)
            printf("routing               sigmoid scores%s, %d groups (top %d eligible), "
                   "weights x %g\n", flag(r, "selection_bias") ? " + e_score_correction_bias for the choice" : "",
                   inum(r, "groups"), inum(r, "topk_group"), num(r, "scale"));
    }
    const cJSON *mtp = obj(j, "mtp");
    if (mtp) {
        human(a, sizeof a, num(mtp, "bytes"), "B");
        printf("MTP layers            %d (num_nextn_predict_layers): %lld tensors, %s in the "
               "checkpoint%s\n", inum(mtp, "layers"), llnum(mtp, "tensors"), a,
               llnum(mtp, "tensors") ? " (not run; quantize passes them through, --drop-mtp drops them)" : "");
    }
    if (n_moe < layers) printf("dense ffn             %d\n", inum(j, "dense_ffn"));
    printf("tied embeddings       %s\n", flag(j, "tied_embeddings") ? "yes" : "no");
    human(a, sizeof a, num(j, "parameters"), "");
    human(b, sizeof b, num(j, "active_parameters"), "");
    printf("parameters            %s total (%lld), %s active per token (%lld)\n", a,
           llnum(j, "parameters"), b, llnum(j, "active_parameters"));
    human(a, sizeof a, num(j, "tensor_bytes"), "B");
    printf("tensors               %lld, %s of data\n", llnum(j, "tensors"), a);
    const cJSON *d;
    cJSON_ArrayForEach(d, obj(j, "dtypes")) {
        human(a, sizeof a, num(d, "bytes"), "B");
        printf("  %-20s %lld values, %s\n", jstr(d, "dtype"), llnum(d, "values"), a);
    }
    print_quantization(obj(j, "quantization_config"));
    printf("2-D weights by storage\n");
    cJSON_ArrayForEach(d, obj(j, "storage")) {
        human(a, sizeof a, num(d, "values"), "");
        printf("  %-20s %lld weights (%s values), %.3f bits per weight\n", jstr(d, "storage"),
               llnum(d, "weights"), a, num(d, "bits_per_weight"));
    }
}

static void print_tensors(const cJSON *list) {
    const cJSON *t;
    printf("\n%-64s %-8s %-20s %12s\n", "tensor", "dtype", "shape", "bytes");
    cJSON_ArrayForEach(t, list) {
        char shape[96];
        size_t k = (size_t)snprintf(shape, sizeof shape, "[");
        int d = 0;
        const cJSON *x;
        cJSON_ArrayForEach(x, obj(t, "shape")) {
            if (k < sizeof shape)
                k += (size_t)snprintf(shape + k, sizeof shape - k, "%s%lld", d++ ? ", " : "", (long long)x->valuedouble);
        }
        if (k < sizeof shape) snprintf(shape + k, sizeof shape - k, "]");
        printf("%-64s %-8s %-20s %12zu\n", jstr(t, "name"), jstr(t, "dtype"), shape, (size_t)num(t, "bytes"));
    }
}

static void print_weights(const cJSON *list) {
    const cJSON *w;
    printf("\n  %-62s %-28s %6s %6s\n", "weight", "storage", "group", "bits");
    cJSON_ArrayForEach(w, list)
        printf("  %-62s %-28s %6s %6.3f\n", jstr(w, "module"), jstr(w, "storage"), jstr(w, "group"),
               num(w, "bits_per_weight"));
}

static int inspect(const char *dir, bool tensors, bool weights) {
    char *text = NULL;
    unsigned flags = (tensors ? MOEQ_INSPECT_TENSORS : 0u) | (weights ? MOEQ_INSPECT_WEIGHTS : 0u);
    moeq_status st = moeq_inspect_json_ex(dir, flags, &text);
    if (st) return cli_fail("inspect", st);
    cJSON *j = cJSON_Parse(text);
    moeq_string_free(text);
    if (!j) return cli_fail("inspect", MOEQ_E_NOMEM);
    print_model(dir, j);
    if (tensors) print_tensors(obj(j, "tensor_list"));
    if (weights) print_weights(obj(j, "weight_list"));
    cJSON_Delete(j);
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
