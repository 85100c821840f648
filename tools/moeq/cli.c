/* Option parsing, usage, the progress bar and signal handling for the moeq CLI. */
#define _POSIX_C_SOURCE 200809L
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef MOEQ_SOURCE_DIR
#define MOEQ_SOURCE_DIR "."
#endif

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "moeq %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n(see 'moeq %s --help')\n", cmd);
    return CLI_USAGE;
}

int cli_session_options(const char *cmd, const char *device, const char *precision, const char *max_memory,
                        moeq_session_options *o) {
    moeq_session_options_init(o);
    if ((precision || max_memory) && (!device || !strcmp(device, "cpu")))
        return cli_usage_error(cmd, "--gpu-precision and --max-gpu-memory need --device cuda");
    const char *const keys[3] = {"device", "gpu-precision", "max-gpu-memory"};
    const char *const vals[3] = {device, precision, max_memory};
    for (int k = 0; k < 3; k++)
        if (vals[k] && moeq_session_options_set(o, keys[k], vals[k]))
            return cli_usage_error(cmd, "--%s: %s", keys[k], moeq_last_error());
    return -1;
}

int cli_fail(const char *cmd, moeq_status st) {
    cli_progress_finish();
    const char *msg = moeq_last_error();
    fprintf(stderr, "moeq %s: error: %s\n", cmd, msg && *msg ? msg : moeq_status_text(st));
    return st == MOEQ_E_INTERRUPTED ? CLI_INTERRUPTED : CLI_FAIL;
}

static char *g_models[8];
static int g_n_models;
static void free_models(void) {
    for (int i = 0; i < g_n_models; i++) free(g_models[i]);
    g_n_models = 0;
}

const char *cli_model_dir(const char *cmd, const char *arg, const char *revision) {
    struct stat st;
    /* a directory, a GGUF file (moeq_model_open and moeq_tokenizer_load read it in place), or
     * tokenize's file */
    if (!revision && stat(arg, &st) == 0) return arg;
    char *dir = NULL;
    moeq_status s = moeq_resolve_model(arg, revision, &dir);
    if (s) {
        cli_fail(cmd, s);
        return NULL;
    }
    if (g_n_models == (int)(sizeof g_models / sizeof g_models[0])) {
        free(dir);
        cli_fail(cmd, MOEQ_E_NOMEM);
        return NULL;
    }
    if (!g_n_models) atexit(free_models);
    g_models[g_n_models++] = dir;
    return dir;
}

const char *cli_checkpoint_dir(const char *cmd, const char *arg, const char *revision) {
    struct stat st;
    if (!revision && stat(arg, &st) == 0 && S_ISREG(st.st_mode) && cli_is_gguf(arg))
        return cli_gguf_model_dir(cmd, arg);   /* a GGUF file: decoded into a temporary checkpoint */
    return cli_model_dir(cmd, arg, revision);
}

void cli_usage(const cli_command *cmd, FILE *to) {
    fprintf(to, "usage: moeq %s %s\n\n%s\n", cmd->name, cmd->synopsis, cmd->description);
    if (cmd->n_opts) fprintf(to, "\noptions:\n");
    for (int i = 0; i < cmd->n_opts; i++) {
        const cli_opt *o = &cmd->opts[i];
        char left[96];
        if (o->kind == OPT_FLAG)
            snprintf(left, sizeof left, "%s", o->name);
        else if (o->kind == OPT_CHOICE)
            snprintf(left, sizeof left, "%s %s", o->name, o->choices);
        else
            snprintf(left, sizeof left, "%s %s", o->name, o->metavar ? o->metavar : "X");
        fprintf(to, "  %-30s %s\n", left, o->help ? o->help : "");
    }
    fprintf(to, "  %-30s %s\n", "--help", "show this help");
}

static int set_value(const cli_command *cmd, const cli_opt *o, const char *v) {
    char *end = NULL;
    switch (o->kind) {
    case OPT_INT: {
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (errno || end == v || *end)
            return cli_usage_error(cmd->name, "%s expects an integer, got '%s'", o->name, v);
        if (o->min <= o->max && (x < o->min || x > o->max))
            return cli_usage_error(cmd->name, "%s must be between %lld and %lld, got %lld", o->name,
                                   (long long)o->min, (long long)o->max, x);
        *(int64_t *)o->dest = x;
        break;
    }
    case OPT_DOUBLE: {
        errno = 0;
        double x = strtod(v, &end);
        if (errno || end == v || *end || x != x)
            return cli_usage_error(cmd->name, "%s expects a number, got '%s'", o->name, v);
        *(double *)o->dest = x;
        break;
    }
    case OPT_STRING: *(const char **)o->dest = v; break;
    case OPT_CHOICE: {
        size_t n = strlen(v);
        const char *c = o->choices;
        bool ok = false;
        while (c && *c) {
            const char *bar = strchr(c, '|');
            size_t len = bar ? (size_t)(bar - c) : strlen(c);
            if (len == n && n > 0 && strncmp(c, v, n) == 0) ok = true;
            c = bar ? bar + 1 : NULL;
        }
        if (!ok) return cli_usage_error(cmd->name, "%s must be one of %s, got '%s'", o->name, o->choices, v);
        *(const char **)o->dest = v;
        break;
    }
    case OPT_LIST: {
        cli_list *l = o->dest;
        const char **items = realloc(l->items, sizeof(char *) * (size_t)(l->n + 1));
        if (!items) return cli_usage_error(cmd->name, "out of memory");
        l->items = items;
        l->items[l->n++] = v;
        break;
    }
    case OPT_FLAG: *(bool *)o->dest = true; break;
    }
    if (o->seen) *o->seen = true;
    return -1;
}

int cli_parse(const cli_command *cmd, int argc, char **argv, const char **pos, int *n_pos) {
    *n_pos = 0;
    bool only_positional = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!only_positional && strcmp(a, "--") == 0) {
            only_positional = true;
            continue;
        }
        if (!only_positional && (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)) {
            cli_usage(cmd, stdout);
            return CLI_OK;
        }
        if (!only_positional && a[0] == '-' && a[1] != 0) {
            const char *eq = strchr(a, '=');
            size_t name_len = eq ? (size_t)(eq - a) : strlen(a);
            const cli_opt *o = NULL;
            for (int k = 0; k < cmd->n_opts; k++)
                if (strlen(cmd->opts[k].name) == name_len && strncmp(cmd->opts[k].name, a, name_len) == 0)
                    o = &cmd->opts[k];
            if (!o) return cli_usage_error(cmd->name, "unknown option '%.*s'", (int)name_len, a);
            if (o->kind == OPT_FLAG) {
                if (eq) return cli_usage_error(cmd->name, "%s takes no value", o->name);
                set_value(cmd, o, "");
                continue;
            }
            const char *v = eq ? eq + 1 : NULL;
            if (!v) {
                if (i + 1 >= argc) return cli_usage_error(cmd->name, "%s needs a value (%s)", o->name, o->metavar ? o->metavar : o->choices);
                v = argv[++i];
            }
            int rc = set_value(cmd, o, v);
            if (rc >= 0) return rc;
            continue;
        }
        if (*n_pos >= cmd->max_positional)
            return cli_usage_error(cmd->name, "unexpected argument '%s'", a);
        pos[(*n_pos)++] = a;
    }
    if (*n_pos < cmd->min_positional)
        return cli_usage_error(cmd->name, "missing %s", cmd->positional_names ? cmd->positional_names : "argument");
    return -1;
}

bool cli_parse_size(const char *s, uint64_t *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v > 0)) return false;
    while (*end == ' ') end++;
    static const struct { const char *suf; double mul; } units[] = {
        {"", 1}, {"B", 1}, {"K", 1e3}, {"KB", 1e3}, {"M", 1e6}, {"MB", 1e6}, {"G", 1e9},
        {"GB", 1e9}, {"T", 1e12}, {"TB", 1e12}, {"KiB", 1024.0}, {"MiB", 1048576.0},
        {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        size_t n = strlen(units[i].suf);
        bool same = strlen(end) == n;
        for (size_t k = 0; same && k < n; k++)
            same = toupper((unsigned char)end[k]) == toupper((unsigned char)units[i].suf[k]);
        if (same) {
            double b = v * units[i].mul;
            if (b < 1 || b > 1e18) return false;
            *out = (uint64_t)b;
            return true;
        }
    }
    return false;
}

/* ---- flags of the library's option tables ---------------------------------------------- */
cli_opt cli_table_opt(cli_table_flag *f, const moeq_option_info *x) {
    memset(f, 0, sizeof *f);
    f->info = x;
    snprintf(f->name, sizeof f->name, "--%s", x->key);
    cli_opt c = {f->name, OPT_STRING, &f->s, x->metavar, x->help, NULL, 0, 0, &f->seen};
    switch (x->kind) {
    case MOEQ_OPTION_SWITCH: c.kind = OPT_FLAG, c.dest = &f->on; break;
    case MOEQ_OPTION_INT: c.kind = OPT_INT, c.dest = &f->i, c.min = x->min, c.max = x->max; break;
    case MOEQ_OPTION_NUMBER: c.kind = OPT_DOUBLE, c.dest = &f->d; break;
    case MOEQ_OPTION_CHOICE: c.kind = OPT_CHOICE, c.choices = x->choices; break;
    case MOEQ_OPTION_LIST: c.kind = OPT_LIST, c.dest = &f->list; break;
    case MOEQ_OPTION_TEXT: break;
    }
    return c;
}

const char *cli_table_value(const cli_table_flag *f, char *buf, size_t cap) {
    switch (f->info->kind) {
    case MOEQ_OPTION_SWITCH: return "true";
    case MOEQ_OPTION_INT: snprintf(buf, cap, "%lld", (long long)f->i); return buf;
    case MOEQ_OPTION_NUMBER: snprintf(buf, cap, "%.17g", f->d); return buf;   /* read back exactly */
    case MOEQ_OPTION_LIST: return NULL;
    default: return f->s;
    }
}

int cli_table_refused(const char *cmd, const cli_table_flag *f, const char *v, bool quoted) {
    const char *msg = moeq_last_error(), *why = strstr(msg, ": expected ");
    if (!why) why = ": not accepted";
    if (quoted) return cli_usage_error(cmd, "%s: cannot read '%s'%s", f->name, v, why);
    return cli_usage_error(cmd, "%s %s%s", f->name, v, why);
}

const cli_table_flag *cli_table_find(const cli_table_flag *t, int n, const char *key) {
    for (int i = 0; i < n; i++)
        if (!strcmp(t[i].info->key, key)) return &t[i];
    return NULL;
}

bool cli_table_given(const cli_table_flag *t, int n, const char *key) {
    const cli_table_flag *f = cli_table_find(t, n, key);
    return f && f->seen;
}

bool cli_table_build(cli_table *tb, const char *cmd, const moeq_option_info *(*info)(int), const cli_own_flag *own,
                     int n_own) {
    int n = 0, n_opts = 0;
    for (const moeq_option_info *x; n_own <= CLI_OWN_MAX; n++) {
        x = n < CLI_TABLE_MAX ? info(n) : NULL;
        for (int k = 0; k < n_own; k++)
            if (x ? own[k].before && !strcmp(own[k].before, x->key) : !own[k].before) tb->opts[n_opts++] = own[k].opt;
        if (!x) break;
        tb->opts[n_opts++] = cli_table_opt(&tb->t[n], x);
    }
    if (n_own > CLI_OWN_MAX || info(n) || n_opts != n + n_own) {
        fprintf(stderr, "moeq %s: error: the library's %d options (at most %d here) do not take the "
                "command's %d own flags (%d placed)\n", cmd, n, CLI_TABLE_MAX, n_own, n_opts - n);
        return false;
    }
    tb->n = n;
    tb->n_opts = n_opts;
    return true;
}

int cli_gen_options(const char *cmd, const cli_table_flag *t, int n, bool greedy, moeq_gen_options *o) {
    moeq_gen_options_init(o);
    for (int i = 0; i < n; i++)
        if (t[i].seen && t[i].info->identity) {   /* sampling asked for: from temperature 1 */
            if (greedy) return cli_usage_error(cmd, "--greedy cannot be combined with %s", t[i].name);
            moeq_gen_options_set(o, "temp", "1");
            break;
        }
    for (int i = 0; i < n; i++) {
        char text[64];
        const char *v = cli_table_value(&t[i], text, sizeof text);
        if (t[i].seen && moeq_gen_options_set(o, t[i].info->key, v)) return cli_table_refused(cmd, &t[i], v, false);
    }
    return -1;
}

bool cli_buf_put(cli_buf *b, const char *s, size_t n) {
    if (b->cap - b->n < n + 1) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap - b->n < n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return false;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return true;
}

/* ---- progress bar ---------------------------------------------------------------------- */
static struct {
    bool on;
    double t_start;
    double t_last;
    char label[64];
    int drawn;
} g_bar;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fmt_secs(char *buf, size_t n, double s) {
    if (s < 0 || s != s || s > 1e7) {
        snprintf(buf, n, "--:--");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
    else
        snprintf(buf, n, "%02ld:%02ld", t / 60, t % 60);
}

static void progress_cb(void *user, const char *label, int64_t done, int64_t total) {
    (void)user;
    double t = now_s();
    if (strncmp(g_bar.label, label, sizeof g_bar.label - 1) != 0) {
        if (g_bar.drawn) fputc('\n', stderr);
        snprintf(g_bar.label, sizeof g_bar.label, "%s", label);
        g_bar.t_start = t;
        g_bar.t_last = 0;
        g_bar.drawn = 0;
    }
    bool final = total > 0 && done >= total;
    if (!final && t - g_bar.t_last < 0.1) return;   /* at most 10 redraws a second */
    g_bar.t_last = t;
    double frac = total > 0 ? (double)done / (double)total : 0;
    if (frac > 1) frac = 1;
    int width = 30, fill = (int)(frac * width);
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    double el = t - g_bar.t_start;
    char e1[32], e2[32];
    fmt_secs(e1, sizeof e1, el);
    fmt_secs(e2, sizeof e2, frac > 0 ? el / frac - el : -1);
    fprintf(stderr, "\r%-18.18s [%s] %5.1f%% %lld/%lld  %s elapsed, ETA %s ", label, bar,
            100 * frac, (long long)done, (long long)total, e1, e2);
    fflush(stderr);
    g_bar.drawn = 1;
    if (final) {
        fputc('\n', stderr);
        g_bar.drawn = 0;
        g_bar.label[0] = 0;
    }
}

/* Log lines while a bar is drawn: the bar's line ends first, and the bar is drawn again below
 * (its ETA keeps counting). */
static void bar_log(void *user, int level, const char *msg) {
    (void)user;
    if (g_bar.drawn) {
        fputs("\r\033[K", stderr);
        g_bar.drawn = 0;
        g_bar.t_last = 0;
    }
    fprintf(stderr, "moeq: %s%s\n", level > 0 ? "warning: " : "", msg);
}

void cli_progress_enable(bool quiet) {
    g_bar.on = !quiet && isatty(STDERR_FILENO);
    if (g_bar.on) {
        moeq_set_progress(progress_cb, NULL);
        moeq_set_log(bar_log, NULL);
    }
}

void cli_progress_finish(void) {
    if (g_bar.on && g_bar.drawn) {
        fputc('\n', stderr);
        g_bar.drawn = 0;
        g_bar.label[0] = 0;
    }
}

static volatile sig_atomic_t g_sigint_count;
static void on_sigint(int sig) {
    (void)sig;
    if (++g_sigint_count >= 2) _exit(CLI_INTERRUPTED);
    moeq_interrupt();
}

void cli_install_sigint(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

const char *cli_blas_kernels(void) {
    static char buf[256];
    const char *was = getenv("MOEQ_BLAS_REEXEC"), *ct = getenv("OPENBLAS_CORETYPE");
    if (was && *was && ct && *ct)   /* main's blas_reexec chose the set */
        snprintf(buf, sizeof buf, "OpenBLAS %s (OPENBLAS_CORETYPE=%s set by moeq: OpenBLAS chose %s on this CPU)",
                 moeq_blas_kernels(), ct, was);
    else
        snprintf(buf, sizeof buf, "OpenBLAS %s", moeq_blas_kernels());
    return buf;
}

const char *cli_shared_dir(void) {
    static char buf[4096];
    const char *root = getenv("MOEQ_SHARED");
    if (root && *root)
        snprintf(buf, sizeof buf, "%s", root);
    else
        snprintf(buf, sizeof buf, "%s/../shared", MOEQ_SOURCE_DIR);
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode)) return NULL;
    return buf;
}

void cli_print_json_bytes(FILE *f, const char *s, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        case '\n': fputs("\\n", f); break;
        case '\r': fputs("\\r", f); break;
        case '\t': fputs("\\t", f); break;
        default:
            if (c < 0x20)
                fprintf(f, "\\u%04x", c);
            else
                fputc(c, f);
        }
    }
    fputc('"', f);
}

void cli_print_json_string(FILE *f, const char *s) { cli_print_json_bytes(f, s, strlen(s)); }

int64_t cli_peak_rss_bytes(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return -1;
    return (int64_t)ru.ru_maxrss * 1024;   /* Linux reports KiB */
}

int cli_parse_counts(const char *s, int *out, int max, int lo, int hi) {
    int n = 0;
    for (const char *c = s; *c;) {
        char *end;
        long v = strtol(c, &end, 10);
        if (end == c || v < lo || v > hi || n == max || (*end && *end != ',') || (*end == ',' && !end[1]))
            return -1;
        out[n++] = (int)v;
        c = *end ? end + 1 : end;
    }
    return n > 0 ? n : -1;
}

double cli_cpu_seconds(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec +
           (double)ru.ru_stime.tv_sec + 1e-6 * (double)ru.ru_stime.tv_usec;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double cli_median(const double *v, int n) {
    double s[64];
    if (n <= 0) return 0;
    if (n > 64) n = 64;
    memcpy(s, v, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof s[0], cmp_double);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

size_t cli_llc_bytes(void) {
    long v = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
    v = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return v > 0 ? (size_t)v : 0;
}

void cli_report_memory(const char *cmd, const moeq_model_info *info) {
    const double mib = 1024.0 * 1024.0;
    fprintf(stderr, "%s: weights %.2f MiB resident", cmd, (double)info->weight_bytes / mib);
    if (info->packed_linears > 0)
        fprintf(stderr, " (%d Linears packed, %d dequantized; fp32 would take %.2f MiB)",
                info->packed_linears, info->fallback_linears,
                (double)info->weight_bytes_fp32 / mib);
    else
        fputs(" (fp32)", stderr);
    fprintf(stderr, "; peak RSS %.2f MiB\n", (double)cli_peak_rss_bytes() / mib);
}
