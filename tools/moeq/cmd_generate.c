/*
 * moeq generate MODEL_DIR (--prompt P | --prompt-file F | stdin) -n N [sampling options]: text
 * generation with the forward pass and its KV cache (a quantized checkpoint on the packed
 * kernels unless --dequantize; --act-quant nvfp4 emulates W4A4 on the dequantized path, q8_0
 * llama.cpp's Q8_0 activations). stdout gets the prompt followed by the generated text as it is
 * produced (with --json: one JSON object at the end instead); stderr gets prefill and decode
 * tokens/s, the resident weight bytes and the peak RSS. Each token is chosen by the library's
 * sampler (moeq.h, "Sampling": penalties, then greedy or top-k, top-p, min-p and temperature),
 * so a given seed always gives the same text. Only moeq.h and cli.h are used: this is also an
 * example of a program on the public API.
 *
 * With --device cuda[:N] the session runs on that GPU (moeq_session_create_ex: every layer, its KV
 * cache and the output layer resident there; --gpu-precision, --max-gpu-memory); the embeddings
 * and the sampler stay on the host.
 *
 * Streaming holds text back in two cases: a trailing U+FFFD (a character cut between tokens,
 * completed by the next ones) and a tail that may be the start of a --stop string (printed once
 * the next tokens show it is not, or cut with the stop string). Ids the tokenizer lacks (embedding
 * rows past it) print as nothing; --json lists every generated id.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"

#define CMD "generate"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The whole stream into a malloc'ed, NUL-terminated buffer; one trailing '\n' is dropped, as
 * llama.cpp does for -f (a file's last line ends in one; the prompt should not). NULL on a read
 * error (errno set) or out of memory. */
static char *read_prompt(FILE *f, size_t *len) {
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    while (b) {
        n += fread(b + n, 1, cap - n - 1, f);
        if (ferror(f)) break;
        if (feof(f)) {
            if (n > 0 && b[n - 1] == '\n') n--;
            b[n] = 0;
            *len = n;
            return b;
        }
        if (cap - n - 1 == 0) {
            char *g = realloc(b, 2 * cap);
            if (!g) break;
            b = g;
            cap *= 2;
        }
    }
    free(b);
    return NULL;
}

static void json_ids(FILE *f, const char *key, const int32_t *ids, size_t n) {
    fprintf(f, "  \"%s\": [", key);
    for (size_t i = 0; i < n; i++) fprintf(f, "%s%d", i ? ", " : "", ids[i]);
    fputs("],\n", f);
}

/* Reports an error of the library with what it concerns first ("--prompt-file F: ..."). */
static int fail_about(const char *what, moeq_status st) {
    const char *msg = moeq_last_error();
    fprintf(stderr, "moeq %s: error: %s: %s\n", CMD, what, msg && *msg ? msg : moeq_status_text(st));
    return st == MOEQ_E_INTERRUPTED ? CLI_INTERRUPTED : CLI_FAIL;
}

int cmd_generate(int argc, char **argv) {
    const char *prompt_arg = NULL, *prompt_file = NULL, *messages_file = NULL;
    int64_t n_new = -1, threads = 0;
    const char *act_quant = NULL, *pack_cache = NULL;
    const char *device = NULL, *gpu_precision = NULL, *max_gpu_memory = NULL;
    cli_list stops = {NULL, 0};
    bool greedy = false, no_bos = false, dequantize = false, json = false;
    const char *revision = NULL;
    /* the sampling options are the library's table (moeq_gen_option_info), placed before --stop */
    const cli_own_flag own[] = {
        {"temp", CLI_REVISION_OPT(revision)},
        {"temp", {"--prompt", OPT_STRING, &prompt_arg, "P", "the prompt text; '-' reads it from stdin (as does "
         "no prompt at all when stdin is not a terminal)", NULL, 0, 0, NULL}},
        {"temp", {"--prompt-file", OPT_STRING, &prompt_file, "FILE", "read the prompt from FILE (one trailing "
         "newline dropped, as llama.cpp's -f; also for stdin)", NULL, 0, 0, NULL}},
        {"temp", {"--messages", OPT_STRING, &messages_file, "FILE", "a JSON list of chat messages ({\"role\", "
         "\"content\"}) rendered with the model's chat template and add_generation_prompt (no BOS "
         "added: the template writes it); stdout gets the reply only", NULL, 0, 0, NULL}},
        {"temp", {"-n", OPT_INT, &n_new, "N", "number of tokens to generate", NULL, 0, 1 << 24, NULL}},
        {"temp", {"--greedy", OPT_FLAG, &greedy, NULL, "always take the most likely token, ties to the lower "
         "id (the default when no sampling option is given; the same as --temp 0)", NULL, 0, 0, NULL}},
        {NULL, {"--stop", OPT_LIST, &stops, "S", "stop when the generated text contains S, printing it up to "
         "S (repeatable)", NULL, 0, 0, NULL}},
        {NULL, {"--json", OPT_FLAG, &json, NULL, "print one JSON object at the end instead of streaming: "
         "prompt, text, prompt_ids, ids (every generated id), finish_reason, speeds", NULL, 0, 0, NULL}},
        {NULL, {"--no-bos", OPT_FLAG, &no_bos, NULL, "do not put the BOS token before the prompt", NULL, 0,
         0, NULL}},
        {NULL, CLI_THREADS_OPT(threads)},
        {NULL, CLI_DEQUANTIZE_OPT(dequantize)},
        {NULL, {"--act-quant", OPT_CHOICE, &act_quant, NULL, CLI_HELP_ACT_QUANT, "none|nvfp4|q8_0", 0, 0, NULL}},
        {NULL, CLI_DEVICE_OPT(device)},
        {NULL, CLI_PRECISION_OPT(gpu_precision)},
        {NULL, CLI_GPUMEM_OPT(max_gpu_memory)},
        {NULL, {"--pack-cache", OPT_STRING, &pack_cache, "DIR", "folder of the packed-layout cache that the "
         "next run maps instead of repacking ('off': none; default: beside the model when its folder "
         "is writable, else $XDG_CACHE_HOME/moeq)", NULL, 0, 0, NULL}},
    };
    static cli_table tb;
    if (!cli_table_build(&tb, CMD, moeq_gen_option_info, own, (int)(sizeof own / sizeof own[0]))) return CLI_FAIL;
    const cli_command cmd = {
        CMD, "MODEL_DIR (--prompt P | --prompt-file F | < stdin) -n N [--greedy | --temp T --top-k K "
        "--top-p P --min-p P --seed S] [--repeat-penalty R ...] [--stop S ...] [--json]",
        "Generates up to N tokens after the prompt and prints the prompt and the continuation on\n"
        "stdout as it comes (stopping at the end-of-sequence token unless --ignore-eos, or at a\n"
        "--stop string, which is not printed); prefill and decode speeds, resident weights and peak\n"
        "RSS go to stderr. A quantized checkpoint runs packed on the quantized kernels unless\n"
        "--dequantize. The model's BOS token, when it has one, is put before the prompt.\n"
        "Each token is greedy (the default) or sampled once --temp, --top-k, --top-p, --min-p or\n"
        "--seed is given. The steps run in llama.cpp's order: the penalties (repeat, presence,\n"
        "frequency, over the last --repeat-last-n ids of prompt and output; they apply to greedy\n"
        "too), then top-k, top-p and min-p on the untempered probabilities, then a draw from\n"
        "softmax(logits / T) over what is left (include/moeq.h, \"Sampling\", has the exact rules).\n"
        "Ids past the tokenizer's vocabulary (models pad their embeddings) print as nothing;\n"
        "--json lists them with the others.",
        tb.opts, tb.n_opts, 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) {
        free(stops.items);
        return rc;
    }
    /* Usage checks first, each naming its flag, before anything is read or loaded. */
    const char *bad = NULL;
    if (prompt_arg && prompt_file) bad = "--prompt and --prompt-file cannot be combined (give one)";
    else if (messages_file && (prompt_arg || prompt_file)) bad = "--messages cannot be combined with --prompt or --prompt-file";
    else if (n_new < 0) bad = "-n is required";
    for (int k = 0; !bad && k < stops.n; k++)
        if (!stops.items[k][0]) bad = "--stop needs a non-empty string";
    moeq_gen_options go;   /* the sampling and device flags, each checked by the library's setter */
    moeq_session_options so;
    if (bad) rc = cli_usage_error(CMD, "%s", bad);
    else rc = cli_gen_options(CMD, tb.t, tb.n, greedy, &go);
    if (rc < 0) rc = cli_session_options(CMD, device, gpu_precision, max_gpu_memory, &so);
    if (rc >= 0) {
        free(stops.items);
        return rc;
    }
    const bool ignore_eos = go.ignore_eos;
    moeq_sampler *smp = NULL;
    moeq_status st = moeq_sampler_create(&go.sampling, &smp);
    if (st) {   /* the setter checked every option: this would be a missing one */
        free(stops.items);
        return cli_usage_error(CMD, "%s", moeq_last_error());
    }

    /* The prompt: --prompt, --prompt-file, or stdin ('-', or nothing given and stdin not a
     * terminal, so that `echo text | moeq generate M -n 8` works). */
    char *prompt = NULL;
    size_t prompt_len = 0;
    char prompt_src[64 + 4096];   /* for messages: "--prompt", "--prompt-file F" or "stdin" */
    snprintf(prompt_src, sizeof prompt_src, "--prompt");
    if (prompt_arg && strcmp(prompt_arg, "-") != 0) {
        prompt_len = strlen(prompt_arg);
        prompt = malloc(prompt_len + 1);
        if (prompt) memcpy(prompt, prompt_arg, prompt_len + 1);
    } else if (prompt_file || messages_file) {
        const char *flag = prompt_file ? "--prompt-file" : "--messages", *fn = prompt_file ? prompt_file : messages_file;
        snprintf(prompt_src, sizeof prompt_src, "%s %s", flag, fn);
        FILE *f = fopen(fn, "rb");
        if (!f) {
            fprintf(stderr, "moeq %s: error: %s %s: cannot open: %s\n", CMD, flag, fn, strerror(errno));
            moeq_sampler_free(smp);
            free(stops.items);
            return CLI_FAIL;
        }
        prompt = read_prompt(f, &prompt_len);
        int e = errno;
        fclose(f);
        errno = e;
    } else if (prompt_arg || !isatty(STDIN_FILENO)) {
        snprintf(prompt_src, sizeof prompt_src, "stdin (the prompt)");
        prompt = read_prompt(stdin, &prompt_len);
    } else {
        moeq_sampler_free(smp);
        free(stops.items);
        return cli_usage_error(CMD, "no prompt: give --prompt P, --prompt-file FILE or text on stdin");
    }
    if (!prompt) {
        fprintf(stderr, "moeq %s: error: %s: cannot read: %s\n", CMD, prompt_src, strerror(errno));
        moeq_sampler_free(smp);
        free(stops.items);
        return CLI_FAIL;
    }

    if (threads > 0) moeq_set_threads((int)threads);
    if (pack_cache) {
        moeq_status ps = moeq_set_pack_cache_dir(strcmp(pack_cache, "off") ? pack_cache : "");
        if (ps) return cli_fail("generate", ps);
    }
    int aqk = !act_quant                        ? MOEQ_ACT_QUANT_NONE
              : strcmp(act_quant, "nvfp4") == 0 ? MOEQ_ACT_QUANT_NVFP4
              : strcmp(act_quant, "q8_0") == 0  ? MOEQ_ACT_QUANT_Q8_0
                                                : MOEQ_ACT_QUANT_NONE;
    bool aq = aqk != MOEQ_ACT_QUANT_NONE;
    moeq_model_options mo = {.keep_packed = !dequantize && !aq, .act_quant = aqk};
    moeq_model *m = NULL;
    int32_t *enc = NULL, *ids = NULL;
    size_t n_enc = 0;
    float *logits = NULL;
    char *text = NULL;
    moeq_session *s = NULL;
    int ret = CLI_OK;
    const char *dir = cli_model_dir(CMD, pos[0], revision);
    if (!dir) {
        ret = CLI_FAIL;
        goto out;
    }
    st = moeq_model_open(dir, &mo, &m);
    if (st) {
        ret = cli_fail(CMD, st);
        goto out;
    }
    const moeq_model_info *info = moeq_model_get_info(m);
    const moeq_tokenizer *tok = moeq_model_tokenizer(m);
    if (!tok) {
        fprintf(stderr, "moeq %s: error: %s: no tokenizer.json\n", CMD, pos[0]);
        ret = CLI_FAIL;
        goto out;
    }
    if (messages_file) {   /* the messages through the model's chat template */
        moeq_chat_template *ct = NULL;
        char *chat = NULL;
        size_t chat_len = 0;
        st = moeq_chat_template_load(dir, NULL, &ct);
        if (!st) st = moeq_chat_apply(ct, prompt, prompt_len, 1, NULL, &chat, &chat_len);
        moeq_chat_template_free(ct);
        if (st) {
            ret = fail_about(prompt_src, st);
            goto out;
        }
        free(prompt);
        prompt = chat;
        prompt_len = chat_len;
        no_bos = true;
    }
    int32_t eos[64];
    int32_t n_eos = moeq_model_eos_ids(m, eos, 64);
    if (n_eos > 64) n_eos = 64;   /* config parsing keeps at most 8 */
    st = moeq_tokenizer_encode(tok, prompt, prompt_len, &enc, &n_enc);
    if (st) {
        ret = fail_about(prompt_src, st);
        goto out;
    }
    int32_t bos = no_bos ? -1 : info->bos_token_id;
    size_t n_prompt = n_enc + (bos >= 0);
    if (n_prompt == 0) {
        ret = cli_usage_error(CMD, "the prompt is empty and the model has no BOS token");
        goto out;
    }
    if ((int64_t)n_prompt + n_new > info->max_position_embeddings) {
        ret = cli_usage_error(CMD, "the prompt (%zu tokens) plus -n %lld exceeds the model's "
                              "context of %d tokens", n_prompt, (long long)n_new,
                              info->max_position_embeddings);
        goto out;
    }
    const int32_t V = info->vocab_size;
    ids = malloc(sizeof(int32_t) * (n_prompt + (size_t)n_new + 1));
    logits = malloc(sizeof(float) * (size_t)V);
    if (!ids || !logits) {
        fprintf(stderr, "moeq %s: error: out of memory\n", CMD);
        ret = CLI_FAIL;
        goto out;
    }
    if (bos >= 0) ids[0] = bos;
    memcpy(ids + (bos >= 0), enc, sizeof(int32_t) * n_enc);
    int32_t *gen = ids + n_prompt;
    /* The prompt (BOS included, as llama.cpp feeds it) is history for the penalties. */
    st = moeq_sampler_accept(smp, ids, n_prompt);
    if (!st) st = moeq_session_create_ex(m, (int32_t)(n_prompt + (size_t)n_new), &so, &s);
    if (st) {
        ret = cli_fail(CMD, st);
        goto out;
    }
    if (so.device >= 0) fprintf(stderr, "device: %s\n", moeq_session_device(s));

    if (!json && !messages_file) {
        fwrite(prompt, 1, prompt_len, stdout);
        fflush(stdout);
    }
    /* Prefill: logits are needed for the last prompt token only. */
    double t0 = now_s();
    st = moeq_session_forward(s, ids, (int32_t)n_prompt - 1, NULL);
    if (!st) st = moeq_session_forward(s, ids + n_prompt - 1, 1, logits);
    double t_prefill = now_s() - t0, t_decode = 0;
    size_t n_gen = 0, n_text_ids = 0, printed = 0, text_len = 0, cut = 0;
    const char *finish = "length";
    int32_t stop_which = -1;
    cli_install_sigint();
    while (!st && (int64_t)n_gen < n_new) {
        int32_t next;
        st = moeq_sampler_sample(smp, logits, V, &next);
        if (st) break;
        gen[n_gen++] = next;
        bool is_eos = false;
        for (int32_t k = 0; k < n_eos && !ignore_eos; k++) is_eos |= next == eos[k];
        if (is_eos) {   /* listed in --json's ids, never printed */
            finish = "eos";
            break;
        }
        n_text_ids = n_gen;
        free(text);
        text = NULL;
        st = moeq_tokenizer_decode_ex(tok, gen, n_gen, MOEQ_DECODE_SKIP_UNKNOWN, &text, &text_len);
        if (st) break;
        /* A stop string cannot start before the printed text ends (what might begin one was held
         * back), hence the search from there. */
        size_t at = moeq_gen_find_stop(text, text_len, printed, stops.items, stops.n, &stop_which);
        if (at <= text_len) {
            cut = at;
            finish = "stop";
            break;
        }
        cut = moeq_gen_certain(text, text_len, stops.items, stops.n);
        if (!json && cut > printed) {
            fwrite(text + printed, 1, cut - printed, stdout);
            fflush(stdout);
            printed = cut;
        }
        if ((int64_t)n_gen == n_new) break;
        if (moeq_interrupted()) {
            st = MOEQ_E_INTERRUPTED;
            break;
        }
        double t1 = now_s();
        st = moeq_session_forward(s, &next, 1, logits);
        t_decode += now_s() - t1;
    }
    /* The end: everything decoded, or up to the stop string. */
    if (strcmp(finish, "stop") != 0) {
        free(text);
        text = NULL;
        text_len = 0;
        moeq_status st2 = moeq_tokenizer_decode_ex(tok, gen, n_text_ids, MOEQ_DECODE_SKIP_UNKNOWN,
                                                   &text, &text_len);
        if (st2 && !st) st = st2;
        cut = text ? text_len : 0;
    }
    if (st == MOEQ_E_INTERRUPTED) finish = "interrupted";
    if (!json) {
        if (text && cut > printed) fwrite(text + printed, 1, cut - printed, stdout);
        fputc('\n', stdout);
        fflush(stdout);
    }
    if (st && st != MOEQ_E_INTERRUPTED) {
        ret = cli_fail(CMD, st);
        goto out;
    }
    /* n_gen tokens came from 1 prefill and n_gen - 1 decode steps. */
    size_t n_decode = n_gen > 0 ? n_gen - 1 : 0;
    double prefill_tps = (double)n_prompt / t_prefill,
           decode_tps = n_decode > 0 && t_decode > 0 ? (double)n_decode / t_decode : 0.0;
    if (json) {
        FILE *f = stdout;
        fputs("{\n  \"prompt\": ", f);
        cli_print_json_bytes(f, prompt, prompt_len);
        fputs(",\n  \"text\": ", f);
        cli_print_json_bytes(f, text ? text : "", text ? cut : 0);
        fputs(",\n", f);
        json_ids(f, "prompt_ids", ids, n_prompt);
        json_ids(f, "ids", gen, n_gen);
        /* The generated ids that printed as nothing because the tokenizer lacks them. */
        int32_t n_tok = moeq_tokenizer_vocab_size(tok);
        fputs("  \"ids_without_text\": [", f);
        bool first = true;
        for (size_t i = 0; i < n_gen; i++)
            if (gen[i] < 0 || gen[i] >= n_tok || !moeq_tokenizer_token(tok, gen[i])) {
                fprintf(f, "%s%d", first ? "" : ", ", gen[i]);
                first = false;
            }
        fprintf(f, "],\n  \"finish_reason\": \"%s\",\n  \"stop\": ", finish);
        if (stop_which >= 0 && !strcmp(finish, "stop"))
            cli_print_json_bytes(f, stops.items[stop_which], strlen(stops.items[stop_which]));
        else
            fputs("null", f);
        fprintf(f, ",\n  \"prompt_tokens\": %zu,\n  \"generated_tokens\": %zu,\n"
                "  \"prefill_seconds\": %.6f,\n  \"prefill_tokens_per_second\": %.3f,\n"
                "  \"decode_seconds\": %.6f,\n  \"decode_tokens_per_second\": %.3f\n}\n",
                n_prompt, n_gen, t_prefill, prefill_tps, t_decode, decode_tps);
        fflush(f);
    }
    fprintf(stderr, "prefill: %zu tokens in %.3f s (%.1f tokens/s); decode: %zu tokens in %.3f s "
            "(%.1f tokens/s)\n", n_prompt, t_prefill, prefill_tps, n_decode, t_decode, decode_tps);
    cli_report_memory(CMD, info);
    if (st == MOEQ_E_INTERRUPTED) {
        fprintf(stderr, "moeq %s: interrupted\n", CMD);
        ret = CLI_INTERRUPTED;
    }
out:
    moeq_session_free(s);
    moeq_sampler_free(smp);
    free(enc);
    free(ids);
    free(logits);
    free(text);
    free(prompt);
    free(stops.items);
    moeq_model_free(m);
    return ret;
}
