/*
 * moeq eval MODEL_DIR --task wikitext|text --data FILE [options]: perplexity exactly as
 * lm-evaluation-harness's loglikelihood_rolling (wikitext task: detokenizer, word/byte perplexity,
 * bits per byte), and KL divergence against a base model or saved top-k logits. With --json,
 * stdout is exactly one JSON object. Ctrl-C prints the result of the documents finished so far
 * and exits 130. A quantized checkpoint runs on the packed kernels unless --dequantize;
 * --act-quant nvfp4 emulates W4A4 on the dequantized path, --act-quant q8_0 llama.cpp's
 * Q8_0 activations. The resident weight bytes and the
 * peak RSS go to stderr, or with --json into the object.
 * A model too large for memory is streamed (--stream): every window through layer l before
 * layer l + 1, one layer's weights in memory, within --max-memory; --dry-run prints the plan.
 * --device cuda[:N] runs that stream's layers and the scores on a GPU (fp32 weights: a quantized
 * checkpoint is dequantized as it streams), within a derived tolerance of the CPU's figures.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* A JSON number, or null for NaN/inf (JSON has neither). */
static void json_num(FILE *f, const char *key, double v, bool last) {
    fprintf(f, "  \"%s\": ", key);
    if (isfinite(v))
        fprintf(f, "%.17g", v);
    else
        fputs("null", f);
    fputs(last ? "\n" : ",\n", f);
}

static void json_int(FILE *f, const char *key, long long v) {
    fprintf(f, "  \"%s\": %lld,\n", key, v);
}

/* How the model ran: weights in memory, process peak RSS, CPU time of the evaluation. */
typedef struct {
    const moeq_model_info *info;
    int64_t peak_rss;
    double cpu_seconds;
} run_stats;

static void print_json(const char *model_dir, const char *data, const char *task,
                       const moeq_eval_options *o, const moeq_eval_result *r, const moeq_docs *docs,
                       const double *doc_ll, const int64_t *doc_tok, const run_stats *rs) {
    FILE *f = stdout;
    fputs("{\n  \"model\": ", f);
    cli_print_json_string(f, model_dir);
    fputs(",\n  \"data\": ", f);
    cli_print_json_string(f, data);
    fprintf(f, ",\n  \"task\": \"%s\",\n", task);
    char *settings = moeq_eval_settings_json(o);   /* the library's options as given, by their keys */
    fprintf(f, "  \"settings\": %s,\n", settings ? settings : "null");
    moeq_string_free(settings);
    json_int(f, "max_length", r->max_length);
    json_int(f, "prefix_token", r->prefix_token);
    json_num(f, "word_perplexity", r->word_perplexity, false);
    json_num(f, "byte_perplexity", r->byte_perplexity, false);
    json_num(f, "bits_per_byte", r->bits_per_byte, false);
    json_num(f, "token_perplexity", r->token_perplexity, false);
    json_num(f, "loglikelihood", r->loglikelihood, false);
    json_int(f, "tokens", r->tokens);
    json_int(f, "words", r->words);
    json_int(f, "bytes", r->bytes);
    json_int(f, "documents", r->documents);
    json_int(f, "empty_documents", r->empty_documents);
    if (r->has_kl) {
        json_num(f, "kl_mean", r->kl_mean, false);
        json_num(f, "kl_p99", r->kl_p99, false);
        json_num(f, "top1_changed", r->top1_changed, false);
        json_int(f, "kl_tokens", r->kl_tokens);
        json_int(f, "kl_top_k", r->kl_top_k);
        if (r->kl_top_k) json_num(f, "kl_gap_bound", r->kl_gap_bound, false);
        if (r->has_base) json_num(f, "base_word_perplexity", r->base_word_perplexity, false);
    }
    if (r->has_entropy) json_num(f, "entropy_mean", r->entropy_mean, false);
    if (doc_ll) {
        fputs("  \"per_doc\": [", f);
        bool first = true;
        for (int64_t d = 0; d < moeq_docs_count(docs); d++) {
            if (doc_tok[d] < 0) continue; /* not evaluated (--limit, interrupted) */
            size_t len = 0;
            const char *t = moeq_docs_text(docs, d, &len);
            fprintf(f,
                    "%s\n    {\"doc\": %lld, \"loglikelihood\": %.17g, \"tokens\": %lld, "
                    "\"words\": %lld, \"bytes\": %zu}",
                    first ? "" : ",", (long long)d, doc_ll[d], (long long)doc_tok[d],
                    (long long)moeq_count_words(t, len), len);
            first = false;
        }
        fputs("\n  ],\n", f);
    }
    fprintf(f, "  \"act_quant\": \"%s\",\n",
            rs->info->act_quant == MOEQ_ACT_QUANT_NVFP4  ? "nvfp4"
            : rs->info->act_quant == MOEQ_ACT_QUANT_Q8_0 ? "q8_0"
                                                         : "none");
    json_int(f, "packed_linears", rs->info->packed_linears);
    json_int(f, "fallback_linears", rs->info->fallback_linears);
    json_int(f, "weight_bytes", rs->info->weight_bytes);
    json_int(f, "weight_bytes_fp32", rs->info->weight_bytes_fp32);
    json_int(f, "peak_rss_bytes", rs->peak_rss);
    fprintf(f, "  \"plan\": {\"streamed\": %s, \"threads\": %d, \"budget_bytes\": %lld, "
            "\"peak_bytes\": %lld, \"resident_bytes\": %lld, \"layer_bytes\": %lld, "
            "\"read_ahead_bytes\": %lld, \"head_bytes\": %lld, \"window_bytes\": %lld, "
            "\"score_bytes\": %lld, "
            "\"boundary_bytes\": %lld, \"boundary_in_memory\": [%s, %s], \"disk_bytes\": %lld, "
            "\"windows\": %lld, \"rows\": %lld, \"flops\": %.6g, \"core_gflops\": %.6g, "
            "\"eta_seconds\": %.6g, \"layers_resumed\": %d, \"peak_anon_bytes\": %lld, "
            "\"forward_gflops\": %.6g},\n",
            r->plan.streamed ? "true" : "false", r->plan.threads, (long long)r->plan.budget,
            (long long)r->plan.peak_bytes, (long long)r->plan.resident_bytes,
            (long long)r->plan.layer_bytes, (long long)r->plan.read_ahead_bytes,
            (long long)r->plan.head_bytes,
            (long long)r->plan.window_bytes, (long long)r->plan.score_bytes,
            (long long)r->plan.boundary_bytes, r->plan.boundary_in_memory[0] ? "true" : "false",
            r->plan.boundary_in_memory[1] ? "true" : "false", (long long)r->plan.disk_bytes,
            (long long)r->plan.windows, (long long)r->plan.rows, r->plan.flops,
            r->plan.core_gflops, r->plan.eta_seconds, r->plan.layers_resumed,
            (long long)r->plan.peak_anon_bytes, r->plan.forward_gflops);
    fputs("  \"device\": ", f);
    cli_print_json_string(f, r->device[0] ? r->device : "cpu");
    fputs(",\n", f);
    fprintf(f, "  \"interrupted\": %s,\n", r->interrupted ? "true" : "false");
    json_num(f, "seconds", r->seconds, false);
    json_num(f, "cpu_seconds", rs->cpu_seconds, false);
    json_num(f, "tokens_per_second", r->tokens_per_second, true);
    fputs("}\n", f);
}

static void print_text(const char *model_dir, const char *task, const moeq_eval_result *r,
                       const moeq_docs *docs, const double *doc_ll, const int64_t *doc_tok,
                       const run_stats *rs) {
    FILE *f = stdout;
    if (doc_ll) {
        fprintf(f, "%6s %18s %8s %8s %8s\n", "doc", "loglikelihood", "tokens", "words", "bytes");
        for (int64_t d = 0; d < moeq_docs_count(docs); d++) {
            if (doc_tok[d] < 0) continue;
            size_t len = 0;
            const char *t = moeq_docs_text(docs, d, &len);
            fprintf(f, "%6lld %18.6f %8lld %8lld %8zu\n", (long long)d, doc_ll[d],
                    (long long)doc_tok[d], (long long)moeq_count_words(t, len), len);
        }
        fputc('\n', f);
    }
    fprintf(f, "%s: %s, max_length %d, prefix token %d%s\n", model_dir, task, r->max_length,
            r->prefix_token, r->interrupted ? "  (INTERRUPTED: partial result)" : "");
    fprintf(f, "  word_perplexity   %.6f\n", r->word_perplexity);
    fprintf(f, "  byte_perplexity   %.6f\n", r->byte_perplexity);
    fprintf(f, "  bits_per_byte     %.6f\n", r->bits_per_byte);
    fprintf(f, "  token_perplexity  %.6f\n", r->token_perplexity);
    fprintf(f, "  loglikelihood     %.4f\n", r->loglikelihood);
    fprintf(f, "  documents %lld (%lld empty), tokens %lld, words %lld, bytes %lld\n",
            (long long)r->documents, (long long)r->empty_documents, (long long)r->tokens,
            (long long)r->words, (long long)r->bytes);
    if (r->has_kl) {
        fprintf(f, "  kl_mean           %.6g nats/token (%s)\n", r->kl_mean,
                r->kl_top_k ? "from saved top-k logits: a lower bound" : "exact");
        fprintf(f, "  kl_p99            %.6g\n", r->kl_p99);
        fprintf(f, "  top1_changed      %.6f\n", r->top1_changed);
        if (r->has_base) fprintf(f, "  base word_perplexity %.6f (the --kl-base model on the same windows)\n", r->base_word_perplexity);
        if (r->kl_top_k)
            fprintf(f, "  top-%d: the exact mean KL is at most %.4g higher\n", r->kl_top_k,
                    r->kl_gap_bound);
    }
    if (r->has_entropy) fprintf(f, "  entropy_mean      %.6f nats/token\n", r->entropy_mean);
    fprintf(f, "  %.1f s, %.0f tokens/s (%.1f CPU s)%s%s\n", r->seconds, r->tokens_per_second,
            rs->cpu_seconds, r->device[0] ? " on " : "", r->device);
    if (r->plan.streamed)
        fprintf(f, "  streamed: peak %.2f GB planned, %.2f GB measured; forward %.1f GFLOP/s, "
                "%.2f of the cores' sgemm rate%s\n", r->plan.peak_bytes / 1e9,
                r->plan.peak_anon_bytes / 1e9, r->plan.forward_gflops,
                r->plan.core_gflops > 0 ? r->plan.forward_gflops / r->plan.core_gflops : 0.0,
                r->plan.layers_resumed ? " (resumed layers not counted)" : "");
}

static const char *gb(double bytes, char *buf, size_t n) {
    snprintf(buf, n, "%.2f GB", bytes / 1e9);
    return buf;
}

/* --dry-run: what the run would hold and cost. */
static void print_plan(FILE *f, const moeq_eval_result *r, bool has_base) {
    char a[32];
    fprintf(f, "eval plan: %s, %lld windows (%lld rows), %d in flight\n",
            r->plan.streamed ? "streamed layer by layer" : "whole models in memory",
            (long long)r->plan.windows, (long long)r->plan.rows, r->plan.threads);
    fprintf(f, "  budget            %s\n", gb((double)r->plan.budget, a, sizeof a));
    fprintf(f, "  peak (planned)    %s\n", gb((double)r->plan.peak_bytes, a, sizeof a));
    if (r->plan.resident_bytes) fprintf(f, "  models held whole %s\n", gb((double)r->plan.resident_bytes, a, sizeof a));
    if (r->plan.streamed) {
        fprintf(f, "  largest layer     %s\n", gb((double)r->plan.layer_bytes, a, sizeof a));
        if (r->plan.read_ahead_bytes)
            fprintf(f, "  read ahead        %s (the next layer)\n", gb((double)r->plan.read_ahead_bytes, a, sizeof a));
        fprintf(f, "  output layers     %s (while scoring)\n", gb((double)r->plan.head_bytes, a, sizeof a));
        fprintf(f, "  boundary          %s a model: model %s", gb((double)r->plan.boundary_bytes, a, sizeof a),
                r->plan.boundary_in_memory[0] ? "in memory" : "in files");
        if (has_base) fprintf(f, ", base %s", r->plan.boundary_in_memory[1] ? "in memory" : "in files");
        fprintf(f, "\n  work directory    up to %s\n", gb((double)r->plan.disk_bytes, a, sizeof a));
    }
    char b2[32];
    fprintf(f, "  per window        %s (state and scratch), %s scoring\n",
            gb((double)r->plan.window_bytes, a, sizeof a), gb((double)r->plan.score_bytes, b2, sizeof b2));
    fprintf(f, "  forward           %.3g TFLOP; at the cores' sgemm rate (%.1f GFLOP/s) %.0f s\n",
            r->plan.flops / 1e12, r->plan.core_gflops, r->plan.eta_seconds);
}

/* The command's own flags (the model and how it is opened, the documents, what is printed),
 * each placed in --help before the library's row `before` (NULL: after the last). */
typedef struct {
    const char *before;
    cli_opt opt;
} own_flag;

enum { MAX_FLAGS = 32, MAX_OWN = 16 };

int cmd_eval(int argc, char **argv) {
    const char *data = NULL, *layout = NULL, *kl_base = NULL, *html = NULL, *act_quant = NULL;
    const char *revision = NULL, *stream = "auto";
    int64_t threads = 0;
    bool json = false, quiet = false, per_doc = false, dequantize = false;
    const own_flag own[] = {
        {"max-memory", {"--stream", OPT_CHOICE, &stream, NULL, "run layer by layer, one layer's weights in "
         "memory (auto, the default: when the models do not fit half of --max-memory whole)", "auto|on|off",
         0, 0, NULL}},
        {"task", CLI_REVISION_OPT(revision)},
        {"task", {"--html", OPT_STRING, &html, "FILE", "also draw the evaluation as one self-contained HTML "
         "page (KL and top-1 changes per document, the per-token KL distribution, perplexity per document "
         "against the base)", NULL, 0, 0, NULL}},
        {"max-length", {"--data", OPT_STRING, &data, "FILE", "the documents (required)", NULL, 0, 0, NULL}},
        {"max-length", {"--data-format", OPT_CHOICE, &layout, NULL, "documents: ' = Title = ' pages, JSONL "
         "page/text, or one (default: jsonl for *.jsonl, else wikitext for --task wikitext, whole for text)",
         "wikitext|jsonl|whole", 0, 0, NULL}},
        {"add-bos", {"--threads", OPT_INT, &threads, "N", "worker threads (default: every CPU it may use)",
         NULL, 1, 1024, NULL}},
        {"save-logits", {"--kl-base", OPT_STRING, &kl_base, "DIR", "KL divergence against this "
         "(unquantized) model", NULL, 0, 0, NULL}},
        {"temperature", {"--dequantize", OPT_FLAG, &dequantize, NULL, CLI_HELP_DEQUANTIZE, NULL, 0, 0, NULL}},
        {"temperature", {"--act-quant", OPT_CHOICE, &act_quant, NULL, CLI_HELP_ACT_QUANT, "none|nvfp4|q8_0",
         0, 0, NULL}},
        {NULL, {"--per-doc", OPT_FLAG, &per_doc, NULL, "also print each document's log-likelihood", NULL, 0,
         0, NULL}},
        {NULL, {"--json", OPT_FLAG, &json, NULL, "print exactly one JSON object on stdout", NULL, 0, 0,
         NULL}},
        {NULL, {"--quiet", OPT_FLAG, &quiet, NULL, "no progress bar", NULL, 0, 0, NULL}},
    };
    const int n_own = (int)(sizeof own / sizeof own[0]);
    _Static_assert(sizeof own / sizeof own[0] <= MAX_OWN, "raise MAX_OWN");
    cli_table_flag t[MAX_FLAGS];
    cli_opt opts[MAX_FLAGS + MAX_OWN];
    int n = 0, n_opts = 0;
    for (const moeq_option_info *x;; n++) {
        x = n < MAX_FLAGS ? moeq_eval_option_info(n) : NULL;
        for (int k = 0; k < n_own; k++)
            if (x ? own[k].before && !strcmp(own[k].before, x->key) : !own[k].before)
                opts[n_opts++] = own[k].opt;
        if (!x) break;
        opts[n_opts++] = cli_table_opt(&t[n], x);
    }
    if (moeq_eval_option_info(n) || n_opts != n + n_own) {   /* a library this command does not know */
        fprintf(stderr, "moeq eval: error: the library's %d options (MAX_FLAGS %d) do not take the "
                "command's own flags (%d of %d placed)\n", n, MAX_FLAGS, n_opts - n, n_own);
        return CLI_FAIL;
    }
    const cli_command cmd = {
        "eval",
        "MODEL_DIR --data FILE [--task wikitext|text] [options]",
        "Perplexity as lm-evaluation-harness computes loglikelihood_rolling: each document\n"
        "(wikitext-detokenized for --task wikitext) is tokenized without special tokens and "
        "scored\n"
        "in disjoint windows of --max-length tokens, each conditioned on one token (BOS, else "
        "EOS,\n"
        "before the first). Reports word and byte perplexity, bits per byte and token perplexity;\n"
        "words and bytes are counted on the original text. A document that tokenizes to nothing\n"
        "counts with 0 tokens (a warning says so). --kl-base or --kl-logits adds the mean and "
        "99th\n"
        "percentile of KL(p_base || p_model) per token and the share of changed top-1 "
        "predictions;\n"
        "saved logits keep the top-k logits of each token, so that KL is a lower bound (tokens\n"
        "outside the top-k form one bucket). A quantized checkpoint runs packed on the quantized\n"
        "kernels (within a small tolerance of --dequantize); stderr (or the --json object)\n"
        "reports the resident weights and peak RSS. Ctrl-C prints the partial result and exits 130.\n"
        "Models that do not fit memory whole are streamed (--stream): every window goes through\n"
        "layer l before layer l + 1 with one layer's weights in memory (a --kl-base in lockstep),\n"
        "within --max-memory, the boundary activations in files where memory is short; the results\n"
        "are the whole-model forward's, bit for bit. An interrupted streamed run continues with\n"
        "--resume. --dry-run prints the plan. MODEL_DIR may be a .gguf file: read in place (its\n"
        "blocks decoded to fp32 as each layer is loaded), streamed like any model too large.",
        opts,
        n_opts,
        1,
        1,
        "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!data) return cli_usage_error("eval", "--data FILE is required");
    if (kl_base && cli_table_given(t, n, "kl-logits"))
        return cli_usage_error("eval", "give only one of --kl-base and --kl-logits");
    const cli_table_flag *temp = cli_table_find(t, n, "temperature");
    if (temp && temp->seen && (!(temp->d > 0) || !isfinite((float)temp->d)))
        return cli_usage_error("eval", "--temperature must be a positive finite number");
    /* the table's flags go to the library as text, checked there (--device before any file is read) */
    moeq_eval_options o;
    moeq_eval_options_init(&o);
    for (int i = 0; i < n && rc < 0; i++) {
        char text[64];
        const char *v = cli_table_value(&t[i], text, sizeof text);
        if (t[i].seen && moeq_eval_options_set(&o, t[i].info->key, v))
            rc = cli_table_refused("eval", &t[i], v, true);
    }
    if (rc >= 0) return rc;
    const char *model_dir = cli_model_dir("eval", pos[0], revision);
    if (!model_dir) return CLI_FAIL;
    if (kl_base && !(kl_base = cli_model_dir("eval", kl_base, NULL))) return CLI_FAIL;
    const bool wikitext = o.task == MOEQ_TASK_WIKITEXT;
    const char *task = wikitext ? "wikitext" : "text";
    moeq_docs_layout lay = wikitext ? MOEQ_DOCS_WIKITEXT : MOEQ_DOCS_WHOLE;
    if (layout)
        lay = !strcmp(layout, "jsonl")   ? MOEQ_DOCS_JSONL
              : !strcmp(layout, "whole") ? MOEQ_DOCS_WHOLE
                                         : MOEQ_DOCS_WIKITEXT;
    else if (ends_with(data, ".jsonl"))
        lay = MOEQ_DOCS_JSONL;
    if (threads) moeq_set_threads((int)threads);
    cli_install_sigint();
    cli_progress_enable(quiet);

    moeq_docs *docs = NULL;
    moeq_model *m = NULL, *base = NULL;
    double *doc_ll = NULL, *doc_kl = NULL, *doc_top1 = NULL, *doc_llb = NULL;
    int64_t *doc_tok = NULL;
    int aqk = !act_quant                        ? MOEQ_ACT_QUANT_NONE
              : strcmp(act_quant, "nvfp4") == 0 ? MOEQ_ACT_QUANT_NVFP4
              : strcmp(act_quant, "q8_0") == 0  ? MOEQ_ACT_QUANT_Q8_0
                                                : MOEQ_ACT_QUANT_NONE;
    bool aq = aqk != MOEQ_ACT_QUANT_NONE;
    if (o.resume && strcmp(stream, "off") == 0)
        return cli_usage_error("eval", "--resume continues a streamed run: drop --stream off");
    const bool gpu = o.device >= 0;
    if (cli_table_given(t, n, "gpu-precision") && !gpu)
        return cli_usage_error("eval", "--gpu-precision needs --device cuda");
    if (cli_table_given(t, n, "max-gpu-memory") && !gpu)
        return cli_usage_error("eval", "--max-gpu-memory needs --device cuda");
    if (gpu && strcmp(stream, "off") == 0)
        return cli_usage_error("eval", "--device cuda runs layer by layer (streamed): drop --stream off");
    /* a GPU takes each layer's fp32 weights up from the stream: a quantized checkpoint dequantized */
    moeq_model_options mo = {.keep_packed = !dequantize && !aq && !gpu, .act_quant = aqk, .stream = 1};
    moeq_model_options bo = {.keep_packed = !dequantize && !gpu, .stream = 1};
    moeq_status st = moeq_docs_load(data, lay, &docs);
    /* open streamed first (the structure only), then whole where that fits */
    if (!st) st = moeq_model_open(model_dir, &mo, &m);
    if (!st && kl_base) st = moeq_model_open(kl_base, &bo, &base);
    if (!st && strcmp(stream, "on") != 0 && !gpu) {
        int64_t budget = o.max_memory ? o.max_memory : moeq_default_memory_budget();
        int64_t whole = moeq_model_get_info(m)->weight_bytes_whole +
                        (base ? moeq_model_get_info(base)->weight_bytes_whole : 0);
        if (strcmp(stream, "off") == 0 || (!o.resume && whole <= budget / 2)) {
            moeq_model_free(m);
            moeq_model_free(base);
            m = base = NULL;
            mo.stream = bo.stream = 0;
            st = moeq_model_open(model_dir, &mo, &m);
            if (!st && kl_base) st = moeq_model_open(kl_base, &bo, &base);
        } else if (!quiet && !json && isatty(STDERR_FILENO)) {
            fprintf(stderr, "moeq eval: streaming layer by layer (the weights take %.1f GB whole, "
                    "the budget is %.1f GB)\n", whole / 1e9, budget / 1e9);
        }
    }
    if (!st && (per_doc || html)) {
        doc_ll = calloc((size_t)moeq_docs_count(docs), sizeof *doc_ll);
        doc_tok = calloc((size_t)moeq_docs_count(docs), sizeof *doc_tok);
        if (!doc_ll || !doc_tok) st = MOEQ_E_NOMEM;
    }
    if (!st && html) {
        doc_kl = calloc((size_t)moeq_docs_count(docs), sizeof *doc_kl);
        doc_top1 = calloc((size_t)moeq_docs_count(docs), sizeof *doc_top1);
        doc_llb = calloc((size_t)moeq_docs_count(docs), sizeof *doc_llb);
        if (!doc_kl || !doc_top1 || !doc_llb) st = MOEQ_E_NOMEM;
    }
    moeq_eval_result r;
    memset(&r, 0, sizeof r);
    bool evaluated = false;   /* Ctrl-C while the models load: nothing to print but the message */
    run_stats rs = {m ? moeq_model_get_info(m) : NULL, 0, 0};
    double cpu0 = cli_cpu_seconds();
    if (!st) {
        o.kl_base = base;
        moeq_eval_options_set_docs(&o, doc_ll, doc_tok, doc_kl, doc_top1, doc_llb);
        st = moeq_eval(m, docs, &o, &r);
        evaluated = true;
    }
    cli_progress_finish();
    if (st == MOEQ_OK && o.dry_run) {   /* the plan only */
        if (json) {
            rs.peak_rss = cli_peak_rss_bytes();
            print_json(model_dir, data, task, &o, &r, docs, NULL, doc_tok, &rs);
        } else {
            print_plan(stdout, &r, base != NULL);
        }
    } else if (evaluated && (st == MOEQ_OK || st == MOEQ_E_INTERRUPTED)) {
        rs.cpu_seconds = cli_cpu_seconds() - cpu0;
        rs.peak_rss = cli_peak_rss_bytes();
        if (!json) cli_report_memory("eval", rs.info);   /* --json: in the object (stderr stays quiet) */
        if (json)
            print_json(model_dir, data, task, &o, &r, docs, per_doc ? doc_ll : NULL, doc_tok, &rs);
        else
            print_text(model_dir, task, &r, docs, per_doc ? doc_ll : NULL, doc_tok, &rs);
        fflush(stdout);
    }
    if (st == MOEQ_OK && !o.dry_run && html && moeq_dist_rank() == 0) {   /* rank 0 holds the result */
        moeq_eval_page pg = {model_dir, kl_base, data, docs, &r, doc_ll, doc_llb, doc_kl, doc_top1, doc_tok};
        st = moeq_eval_html(html, &pg);
    }
    int code = st == MOEQ_OK ? CLI_OK : cli_fail("eval", st);
    free(doc_kl);
    free(doc_top1);
    free(doc_llb);
    free(doc_ll);
    free(doc_tok);
    moeq_model_free(base);
    moeq_model_free(m);
    moeq_docs_free(docs);
    return code;
}
