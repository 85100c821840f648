/*
 * moeq chat MODEL_DIR: an interactive chat. Each turn the whole conversation (an optional
 * --system message, every user and assistant turn so far, the new user message) goes through the
 * model's chat template with add_generation_prompt, and the reply is generated on a moeq_gen that
 * keeps its KV cache between turns: when the new prompt's ids begin with the ids it holds (the
 * previous prompt and reply), only the rest is fed. /reset forgets the conversation, /exit (or
 * the end of the input) ends it; Ctrl-C stops the current reply, which stays in the history as
 * far as it got. On a terminal it prompts with "> "; otherwise (tests, pipes) each input line is
 * one user message and each reply is printed on its own line, nothing else on stdout. A turn's
 * token counts (prompt, reused from the cache, generated) go to stderr.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"

#define CMD "chat"

/* A JSON string of s[0..n). */
static bool sb_json(cli_buf *b, const char *s, size_t n) {
    bool ok = cli_buf_put(b, "\"", 1);
    for (size_t i = 0; i < n && ok; i++) {
        unsigned char c = (unsigned char)s[i];
        char t[8];
        if (c == '"' || c == '\\') t[0] = '\\', t[1] = (char)c, ok = cli_buf_put(b, t, 2);
        else if (c == '\n') ok = cli_buf_put(b, "\\n", 2);
        else if (c == '\r') ok = cli_buf_put(b, "\\r", 2);
        else if (c == '\t') ok = cli_buf_put(b, "\\t", 2);
        else if (c < 0x20) ok = cli_buf_put(b, t, (size_t)snprintf(t, sizeof t, "\\u%04x", c));
        else ok = cli_buf_put(b, (const char *)&s[i], 1);
    }
    return ok && cli_buf_put(b, "\"", 1);
}

static bool add_message(cli_buf *msgs, const char *role, const char *text, size_t n) {
    if (msgs->n > 1 && !cli_buf_put(msgs, ", ", 2)) return false;
    return cli_buf_put(msgs, "{\"role\": ", 9) && sb_json(msgs, role, strlen(role)) && cli_buf_put(msgs, ", \"content\": ", 13) &&
           sb_json(msgs, text, n) && cli_buf_put(msgs, "}", 1);
}

static volatile sig_atomic_t g_in_reply;
static void on_sigint(int sig) {
    (void)sig;
    if (!g_in_reply) _exit(CLI_INTERRUPTED);   /* at the prompt: Ctrl-C leaves */
    moeq_interrupt();
}

static int print_piece(void *user, const char *text, size_t len) {
    (void)user;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return 0;
}

int cmd_chat(int argc, char **argv) {
    const char *system_msg = NULL, *revision = NULL, *kwargs = NULL, *template_name = NULL;
    int64_t n_max = 0, ctx = 0, threads = 0;
    bool dequantize = false;
    const char *device = NULL, *gpu_precision = NULL, *max_gpu_memory = NULL;
    /* the sampling options are the library's table (moeq_gen_option_info), as moeq generate's */
    const cli_own_flag own[] = {
        {"temp", CLI_REVISION_OPT(revision)},
        {"temp", {"--system", OPT_STRING, &system_msg, "TEXT", "a system message before the conversation", NULL, 0, 0, NULL}},
        {"temp", {"-n", OPT_INT, &n_max, "N", "tokens per reply at most (default: up to the context's end)", NULL, 0, 1 << 24, NULL}},
        {"temp", CLI_CTX_OPT(ctx, "the context in tokens, the whole conversation (default: the model's)")},
        {"temp", CLI_TEMPLATE_OPT(template_name)},
        {"temp", {"--template-kwargs", OPT_STRING, &kwargs, "JSON", "more variables for the template, a JSON object "
         "(e.g. '{\"enable_thinking\": false}')", NULL, 0, 0, NULL}},
        {NULL, CLI_THREADS_OPT(threads)},
        {NULL, CLI_DEQUANTIZE_OPT(dequantize)},
        {NULL, CLI_DEVICE_OPT(device)},
        {NULL, CLI_PRECISION_OPT(gpu_precision)},
        {NULL, CLI_GPUMEM_OPT(max_gpu_memory)},
    };
    static cli_table tb;
    if (!cli_table_build(&tb, CMD, moeq_gen_option_info, own, (int)(sizeof own / sizeof own[0]))) return CLI_FAIL;
    const cli_command cmd = {
        CMD, "MODEL_DIR [--system TEXT] [-n N] [--temp T --top-p P ...]",
        "An interactive chat with the model, through its chat template (tokenizer_config.json,\n"
        "chat_template.jinja or the GGUF's). The conversation is kept; each turn reuses the KV\n"
        "cache of what the previous turns fed. Type /reset to start over, /exit or Ctrl-D to leave;\n"
        "Ctrl-C stops the current reply. When stdin is not a terminal, every line is a user message\n"
        "and every reply is printed on one line of stdout (token counts per turn on stderr).\n"
        "Each reply is greedy unless a sampling option is given, as in moeq generate.",
        tb.opts, tb.n_opts, 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    moeq_gen_options go;   /* every option checked here, before anything loads */
    if ((rc = cli_gen_options(CMD, tb.t, tb.n, false, &go)) >= 0) return rc;
    moeq_session_options so;   /* --device: the session on a GPU */
    if ((rc = cli_session_options(CMD, device, gpu_precision, max_gpu_memory, &so)) >= 0) return rc;
    go.max_tokens = (int32_t)n_max;
    moeq_status st;
    if (threads > 0) moeq_set_threads((int)threads);

    const char *dir = cli_model_dir(CMD, pos[0], revision);
    if (!dir) return CLI_FAIL;
    moeq_model_options mo = {.keep_packed = !dequantize};
    moeq_model *m = NULL;
    moeq_chat_template *ct = NULL;
    moeq_gen *g = NULL;
    cli_buf msgs = {0}, line = {0};
    char *prompt = NULL;
    int32_t *ids = NULL;
    int ret = CLI_OK;
    st = moeq_chat_template_load(dir, template_name, &ct);
    if (!st) st = moeq_model_open(dir, &mo, &m);
    if (!st && !moeq_model_tokenizer(m)) {
        fprintf(stderr, "moeq %s: error: %s: no tokenizer\n", CMD, pos[0]);
        ret = CLI_FAIL;
        goto out;
    }
    if (!st) st = moeq_gen_create_ex(m, (int32_t)ctx, &so, &g);
    if (st) {
        ret = cli_fail(CMD, st);
        goto out;
    }
    const moeq_tokenizer *tok = moeq_model_tokenizer(m);
    bool tty = isatty(STDIN_FILENO);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    if (tty)
        fprintf(stderr, "moeq chat: %s, a context of %d tokens. /reset starts over, /exit leaves, "
                        "Ctrl-C stops a reply.\n", pos[0], moeq_gen_n_ctx(g));
    if (!cli_buf_put(&msgs, "[", 1)) goto nomem;
    if (system_msg && !add_message(&msgs, "system", system_msg, strlen(system_msg))) goto nomem;
    size_t base = msgs.n;   /* the conversation before any turn */
    int turn = 0;
    for (;;) {
        if (tty) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        line.n = 0;
        int c;
        while ((c = getchar()) != EOF && c != '\n') {
            char ch = (char)c;
            if (!cli_buf_put(&line, &ch, 1)) goto nomem;
        }
        if (c == EOF && line.n == 0) break;
        if (!line.p && !cli_buf_put(&line, "", 0)) goto nomem;
        if (line.n && line.p[line.n - 1] == '\r') line.p[--line.n] = 0;
        if (!strcmp(line.p, "/exit") || !strcmp(line.p, "/quit")) break;
        if (!strcmp(line.p, "/reset")) {
            msgs.n = base;
            msgs.p[msgs.n] = 0;
            moeq_gen_reset(g);
            if (tty) fputs("(the conversation is forgotten)\n", stderr);
            continue;
        }
        size_t before = msgs.n;
        if (!add_message(&msgs, "user", line.p, line.n) || !cli_buf_put(&msgs, "]", 1)) goto nomem;
        size_t plen;
        free(prompt);
        prompt = NULL;
        st = moeq_chat_apply(ct, msgs.p, msgs.n, 1, kwargs, &prompt, &plen);
        msgs.n--;   /* drop the "]" again */
        msgs.p[msgs.n] = 0;
        size_t n_ids = 0;
        free(ids);
        ids = NULL;
        if (!st) st = moeq_tokenizer_encode(tok, prompt, plen, &ids, &n_ids);
        if (!st && n_ids == 0) {
            msgs.n = before;
            msgs.p[msgs.n] = 0;
            continue;
        }
        moeq_gen_result r;
        if (!st) {
            g_in_reply = 1;
            st = moeq_gen_run(g, ids, n_ids, &go, print_piece, NULL, &r);
            g_in_reply = 0;
        }
        if (st) {   /* this turn did not happen: report, forget it and go on */
            fprintf(stderr, "moeq %s: error: %s\n", CMD, moeq_last_error());
            msgs.n = before;
            msgs.p[msgs.n] = 0;
            if (!tty) {
                ret = CLI_FAIL;
                break;
            }
            continue;
        }
        turn++;
        fputc('\n', stdout);
        fflush(stdout);
        fprintf(stderr, "chat: turn %d: %d prompt tokens (%d reused), %d generated, %s\n", turn, r.prompt_tokens,
                r.reused_tokens, r.completion_tokens, r.finish_reason);
        bool ok = add_message(&msgs, "assistant", r.text, r.text_len);
        moeq_gen_result_free(&r);
        if (!ok) goto nomem;
        if (moeq_interrupted()) moeq_clear_interrupt();
    }
    goto out;
nomem:
    fprintf(stderr, "moeq %s: error: out of memory\n", CMD);
    ret = CLI_FAIL;
out:
    free(prompt);
    free(ids);
    free(msgs.p);
    free(line.p);
    moeq_gen_free(g);
    moeq_chat_template_free(ct);
    moeq_model_free(m);
    return ret;
}
