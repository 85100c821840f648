/*
 * moeq generate MODEL_DIR --prompt P -n N [--greedy | --temp T --top-p P --seed S]: text
 * generation with the forward pass and its KV cache (a quantized checkpoint on the packed
 * kernels unless --dequantize; --act-quant nvfp4 emulates W4A4 on the dequantized path, q8_0
 * llama.cpp's Q8_0 activations). stdout gets the prompt followed by the generated text as it is
 * produced; stderr gets prefill and decode tokens/s, the resident weight bytes and the peak RSS.
 * Greedy picks the largest logit (ties to the lower id); sampling draws from softmax(logits / T)
 * cut to the smallest set of most likely tokens whose probability reaches top_p, with a seeded
 * generator, so a given seed always gives the same text.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "model/model.h"

typedef struct {
    double p;
    int32_t id;
} cand;

static int cmp_cand(const void *x, const void *y) {
    const cand *a = x, *b = y;
    if (a->p != b->p) return a->p > b->p ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* splitmix64: a small, well-mixed generator; uniform double in [0, 1). */
static double next_uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1p-53;
}

static int32_t pick_greedy(const float *logits, int32_t V) {
    int32_t best = 0;
    for (int32_t i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

static int32_t pick_sample(const float *logits, int32_t V, double temp, double top_p, cand *c,
                           uint64_t *rng) {
    double mx = logits[0];
    for (int32_t i = 1; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int32_t i = 0; i < V; i++) {
        c[i].id = i;
        c[i].p = exp(((double)logits[i] - mx) / temp);
        sum += c[i].p;
    }
    qsort(c, (size_t)V, sizeof *c, cmp_cand);
    int32_t keep = 0;
    double mass = 0;
    while (keep < V && (keep == 0 || mass < top_p * sum)) mass += c[keep++].p;
    double u = next_uniform(rng) * mass, acc = 0;
    for (int32_t i = 0; i < keep; i++) {
        acc += c[i].p;
        if (u < acc) return c[i].id;
    }
    return c[keep - 1].id;
}

/* Prints the newly decoded text of ids[0..n) beyond *printed bytes; a trailing U+FFFD (a
 * character cut between tokens) is held back until more tokens complete it, or final is set. */
static moeq_status stream_text(const moeq_tokenizer *tok, const int32_t *ids, size_t n, size_t *printed,
                               bool final) {
    char *text = NULL;
    size_t len = 0;
    moeq_status st = moeq_tokenizer_decode(tok, ids, n, &text, &len);
    if (st) return st;
    size_t end = len;
    if (!final && end >= 3 && !memcmp(text + end - 3, "\xef\xbf\xbd", 3)) end -= 3;
    if (end > *printed) {
        fwrite(text + *printed, 1, end - *printed, stdout);
        fflush(stdout);
        *printed = end;
    }
    free(text);
    return MOEQ_OK;
}

static bool is_eos(const moeq_model *m, int32_t id) {
    for (int i = 0; i < m->cfg.n_eos; i++)
        if (m->cfg.eos_ids[i] == id) return true;
    return m->cfg.n_eos == 0 && id == m->info.eos_token_id;
}

int cmd_generate(int argc, char **argv) {
    const char *prompt = NULL;
    int64_t n_new = -1, seed = 0, threads = 0;
    double temp = 1.0, top_p = 1.0;
    const char *act_quant = NULL;
    bool greedy = false, ignore_eos = false, no_bos = false, temp_seen = false, top_p_seen = false,
         seed_seen = false, dequantize = false;
    const char *revision = NULL;
    const cli_opt opts[] = {
        CLI_REVISION_OPT(revision),
        {"--prompt", OPT_STRING, &prompt, "P", "the prompt text", NULL, 0, 0, NULL},
        {"-n", OPT_INT, &n_new, "N", "number of tokens to generate", NULL, 0, 1 << 24, NULL},
        {"--greedy", OPT_FLAG, &greedy, NULL, "always take the most likely token (the default)",
         NULL, 0, 0, NULL},
        {"--temp", OPT_DOUBLE, &temp, "T", "sample with temperature T > 0", NULL, 0, 0, &temp_seen},
        {"--top-p", OPT_DOUBLE, &top_p, "P", "sample from the smallest set of tokens with "
                                             "probability >= P (0 < P <= 1, default 1)",
         NULL, 0, 0, &top_p_seen},
        {"--seed", OPT_INT, &seed, "S", "random seed for sampling (default 0)", NULL, 0, -1,
         &seed_seen},
        {"--ignore-eos", OPT_FLAG, &ignore_eos, NULL, "do not stop at the end-of-sequence token",
         NULL, 0, 0, NULL},
        {"--no-bos", OPT_FLAG, &no_bos, NULL, "do not put the BOS token before the prompt", NULL, 0,
         0, NULL},
        {"--threads", OPT_INT, &threads, "N", "worker threads (default: every CPU it may use)", NULL, 0, 1024,
         NULL},
        {"--dequantize", OPT_FLAG, &dequantize, NULL, CLI_HELP_DEQUANTIZE, NULL, 0, 0, NULL},
        {"--act-quant", OPT_CHOICE, &act_quant, NULL, CLI_HELP_ACT_QUANT, "none|nvfp4|q8_0", 0, 0, NULL},
    };
    const cli_command cmd = {
        "generate", "MODEL_DIR --prompt P -n N [--greedy | --temp T --top-p P --seed S]",
        "Generates up to N tokens after the prompt and prints the prompt and the continuation on\n"
        "stdout (stopping at the end-of-sequence token unless --ignore-eos); prefill and decode\n"
        "speeds, resident weights and peak RSS go to stderr. A quantized checkpoint runs packed\n"
        "on the quantized kernels unless --dequantize. The model's BOS token, when it has one,\n"
        "is put before the prompt.",
        opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!prompt) return cli_usage_error("generate", "--prompt is required");
    if (n_new < 0) return cli_usage_error("generate", "-n is required");
    if (greedy && (temp_seen || top_p_seen || seed_seen))
        return cli_usage_error("generate", "--greedy cannot be combined with --temp/--top-p/--seed");
    if (temp_seen && !(temp > 0 && isfinite(temp)))
        return cli_usage_error("generate", "--temp must be a positive number, got %g", temp);
    if (!(top_p > 0 && top_p <= 1))
        return cli_usage_error("generate", "--top-p must be in (0, 1], got %g", top_p);
    bool sample = temp_seen || top_p_seen || seed_seen;
    if (threads > 0) moeq_set_threads((int)threads);

    int aqk = !act_quant                        ? MOEQ_ACT_QUANT_NONE
              : strcmp(act_quant, "nvfp4") == 0 ? MOEQ_ACT_QUANT_NVFP4
              : strcmp(act_quant, "q8_0") == 0  ? MOEQ_ACT_QUANT_Q8_0
                                                : MOEQ_ACT_QUANT_NONE;
    bool aq = aqk != MOEQ_ACT_QUANT_NONE;
    moeq_model_options mo = {.keep_packed = !dequantize && !aq, .act_quant = aqk};
    moeq_model *m = NULL;
    const char *dir = cli_model_dir("generate", pos[0], revision);
    if (!dir) return CLI_FAIL;
    moeq_status st = moeq_model_open(dir, &mo, &m);
    if (st) return cli_fail("generate", st);
    const moeq_tokenizer *tok = moeq_model_tokenizer(m);
    if (!tok) {
        moeq_model_free(m);
        return cli_fail("generate", mq_err(MOEQ_E_NOTFOUND, "%s: no tokenizer.json", pos[0]));
    }
    int32_t *enc = NULL, *ids = NULL;
    size_t n_enc = 0;
    float *logits = NULL;
    cand *cands = NULL;
    moeq_session *s = NULL;
    int ret = CLI_OK;
    st = moeq_tokenizer_encode(tok, prompt, strlen(prompt), &enc, &n_enc);
    if (st) {
        ret = cli_fail("generate", st);
        goto out;
    }
    int32_t bos = no_bos ? -1 : m->info.bos_token_id;
    size_t n_prompt = n_enc + (bos >= 0);
    if (n_prompt == 0) {
        ret = cli_usage_error("generate", "the prompt is empty and the model has no BOS token");
        goto out;
    }
    if ((int64_t)n_prompt + n_new > m->cfg.max_pos) {
        ret = cli_usage_error("generate", "the prompt (%zu tokens) plus -n %lld exceeds the model's "
                              "context of %d tokens", n_prompt, (long long)n_new, m->cfg.max_pos);
        goto out;
    }
    int32_t V = m->cfg.vocab;
    ids = malloc(sizeof(int32_t) * (size_t)(n_prompt + (size_t)n_new + 1));
    logits = malloc(sizeof(float) * (size_t)V);
    cands = sample ? malloc(sizeof(cand) * (size_t)V) : NULL;
    if (!ids || !logits || (sample && !cands)) {
        ret = cli_fail("generate", mq_err(MOEQ_E_NOMEM, "out of memory"));
        goto out;
    }
    if (bos >= 0) ids[0] = bos;
    memcpy(ids + (bos >= 0), enc, sizeof(int32_t) * n_enc);
    st = moeq_session_create(m, (int32_t)(n_prompt + (size_t)n_new), &s);
    if (st) {
        ret = cli_fail("generate", st);
        goto out;
    }

    fputs(prompt, stdout);
    fflush(stdout);
    /* Prefill: logits are needed for the last prompt token only. */
    double t0 = mq_now();
    st = moeq_session_forward(s, ids, (int32_t)n_prompt - 1, NULL);
    if (!st) st = moeq_session_forward(s, ids + n_prompt - 1, 1, logits);
    double t_prefill = mq_now() - t0, t_decode = 0;
    uint64_t rng = (uint64_t)seed;
    size_t n_gen = 0, printed = 0;
    cli_install_sigint();
    while (!st && (int64_t)n_gen < n_new) {
        int32_t next = sample ? pick_sample(logits, V, temp, top_p, cands, &rng)
                              : pick_greedy(logits, V);
        if (!ignore_eos && is_eos(m, next)) break;
        ids[n_prompt + n_gen++] = next;
        st = stream_text(tok, ids + n_prompt, n_gen, &printed, false);
        if (st || (int64_t)n_gen == n_new) break;
        if (moeq_interrupted()) {
            st = mq_err(MOEQ_E_INTERRUPTED, "interrupted");
            break;
        }
        double t1 = mq_now();
        st = moeq_session_forward(s, &next, 1, logits);
        t_decode += mq_now() - t1;
    }
    if (n_gen > 0) stream_text(tok, ids + n_prompt, n_gen, &printed, true);
    fputc('\n', stdout);
    fflush(stdout);
    if (st) {
        ret = cli_fail("generate", st);
        goto out;
    }
    /* n_gen tokens came from 1 prefill and n_gen - 1 decode steps. */
    fprintf(stderr, "prefill: %zu tokens in %.3f s (%.1f tokens/s); decode: %zu tokens in %.3f s "
            "(%.1f tokens/s)\n", n_prompt, t_prefill, (double)n_prompt / t_prefill,
            n_gen > 0 ? n_gen - 1 : 0, t_decode,
            n_gen > 1 && t_decode > 0 ? (double)(n_gen - 1) / t_decode : 0.0);
    cli_report_memory("generate", moeq_model_get_info(m));
out:
    moeq_session_free(s);
    free(enc);
    free(ids);
    free(logits);
    free(cands);
    moeq_model_free(m);
    return ret;
}
