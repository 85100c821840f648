/*
 * moeq serve MODEL_DIR --port P [--host H] [--parallel N]: an OpenAI-compatible HTTP server on
 * libmicrohttpd (one thread per connection). Routes: POST /v1/completions and
 * /v1/chat/completions (a JSON answer, or server-sent events "data: {...}\n\n" ending with
 * "data: [DONE]\n\n" when "stream" is true), GET /health and GET /v1/models. The request and
 * response objects are the library's (moeq_openai_*); generation runs on N slots, each a moeq_gen
 * with its own session (and KV cache, reused when a request extends what the slot holds). A
 * request waits for a free slot while at most --queue others wait; beyond that it is answered 503.
 * Errors are OpenAI error objects: a body that is not JSON or a bad field 400, a prompt that does
 * not fit the context 400, an unknown path 404, a wrong method 405, a body over 16 MiB 413. A
 * client that goes away (its socket closed) stops its generation at the next token and frees its
 * slot. SIGTERM or SIGINT stops the server: running generations end, connections close, exit 0.
 * Each request is logged on stderr. Built only where libmicrohttpd-dev was found.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "commands.h"

#define CMD "serve"

#ifndef MOEQ_HAVE_MICROHTTPD
int cmd_serve(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq %s: not built: libmicrohttpd was not found when moeq was built. Install "
                    "libmicrohttpd-dev (scripts/install-deps.sh does) and build again.\n", CMD);
    return CLI_FAIL;
}
#else
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <microhttpd.h>

#define MAX_BODY (16u << 20)

typedef struct {
    const moeq_model *m;
    const moeq_tokenizer *tok;
    moeq_chat_template *ct;   /* NULL: the model has none (chat answers 400) */
    const char *model_name;
    int n_slots, max_queue;
    moeq_gen **gen;
    bool *busy;
    int waiting;
    bool stopping;
    unsigned long next_id;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} server;

static server g_srv;
static volatile sig_atomic_t g_stop;

static void on_stop(int sig) {
    (void)sig;
    g_stop = 1;
}

/* ---- small helpers ---------------------------------------------------------------------- */
static enum MHD_Result send_text(struct MHD_Connection *c, unsigned status, char *text, const char *type) {
    if (!text) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_error(struct MHD_Connection *c, unsigned status, const char *msg, const char *type,
                                  const char *code, const char *allow) {
    char *text = moeq_openai_error(msg, type, NULL, code);
    if (!text) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "application/json");
    if (allow) MHD_add_response_header(r, "Allow", allow);
    if (status == MHD_HTTP_SERVICE_UNAVAILABLE) MHD_add_response_header(r, "Retry-After", "1");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

/* Whether the peer has closed its end (a read would return 0 or fail). */
static bool peer_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {fd, POLLIN | POLLRDHUP, 0};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
    char ch;
    ssize_t k = recv(fd, &ch, 1, MSG_PEEK | MSG_DONTWAIT);
    return k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* A free slot's index; -1 when the queue is full (503), -2 when the server stops, -3 when the
 * client left while it waited. */
static int slot_acquire(int fd) {
    server *s = &g_srv;
    pthread_mutex_lock(&s->mu);
    int got = -1;
    for (int i = 0; i < s->n_slots && got < 0; i++)
        if (!s->busy[i]) got = i;
    if (got < 0 && s->waiting < s->max_queue && !s->stopping) {
        s->waiting++;
        while (got < 0 && !s->stopping) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100000000;
            if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
            for (int i = 0; i < s->n_slots && got < 0; i++)
                if (!s->busy[i]) got = i;
            if (got < 0 && peer_gone(fd)) {
                got = -3;
                break;
            }
        }
        s->waiting--;
        if (got == -1) got = -2;
    }
    if (s->stopping && got >= 0) got = -2;
    if (got >= 0) s->busy[got] = true;
    pthread_mutex_unlock(&s->mu);
    return got;
}

static void slot_release(int i) {
    pthread_mutex_lock(&g_srv.mu);
    g_srv.busy[i] = false;
    pthread_cond_broadcast(&g_srv.cv);
    pthread_mutex_unlock(&g_srv.mu);
}

/* printf into a new malloc'ed string */
static char *fmt_alloc(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *fmt_alloc(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *r = NULL;
    if (vasprintf(&r, fmt, ap) < 0) r = NULL;
    va_end(ap);
    return r;
}

static bool stopping(void) {
    pthread_mutex_lock(&g_srv.mu);
    bool r = g_srv.stopping;
    pthread_mutex_unlock(&g_srv.mu);
    return r;
}

/* ---- one request ------------------------------------------------------------------------- */
typedef struct {
    cli_buf body;
    bool too_big;   /* the body passed MAX_BODY: answered 413 */
} conn_state;

/* A streamed run: the worker thread writes events, the response's reader hands them to MHD. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cli_buf out;       /* events not yet sent */
    size_t sent;
    bool done, cancelled;
    int refs;          /* the worker and the response */
    int fd, slot;
    moeq_openai_request req;
    int32_t *ids;
    size_t n_ids;
    char id[64];
    int64_t created;
    bool first;
    char path[32];
} stream_t;

static void stream_unref(stream_t *st) {
    pthread_mutex_lock(&st->mu);
    int left = --st->refs;
    pthread_mutex_unlock(&st->mu);
    if (left) return;
    moeq_openai_request_free(&st->req);
    free(st->ids);
    free(st->out.p);
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->cv);
    free(st);
}

/* Appends "data: JSON\n\n" (or the [DONE] line when json is NULL); false when the client left. */
static bool stream_event(stream_t *st, char *json) {
    pthread_mutex_lock(&st->mu);
    bool ok = !st->cancelled;
    if (ok) {
        ok = cli_buf_put(&st->out, "data: ", 6) && cli_buf_put(&st->out, json ? json : "[DONE]", json ? strlen(json) : 6) &&
             cli_buf_put(&st->out, "\n\n", 2);
        pthread_cond_broadcast(&st->cv);
    }
    pthread_mutex_unlock(&st->mu);
    free(json);
    return ok;
}

static int stream_piece(void *user, const char *text, size_t len) {
    stream_t *st = user;
    if (stopping() || peer_gone(st->fd)) return 1;
    bool first = st->first;
    st->first = false;
    return !stream_event(st, moeq_openai_chunk(&st->req, st->id, g_srv.model_name, st->created, text, len, first, NULL, NULL));
}

static void log_request(const char *path, int status, const moeq_gen_result *r) {
    if (r)
        fprintf(stderr, "moeq serve: POST %s %d: %d prompt tokens (%d reused), %d generated, %s; prefill %.3f s, "
                "decode %.1f tokens/s\n", path, status, r->prompt_tokens, r->reused_tokens, r->completion_tokens,
                r->finish_reason, r->prefill_seconds,
                r->completion_tokens > 1 && r->decode_seconds > 0 ? (r->completion_tokens - 1) / r->decode_seconds : 0.0);
    else
        fprintf(stderr, "moeq serve: POST %s %d\n", path, status);
}

static void *stream_worker(void *arg) {
    stream_t *st = arg;
    moeq_gen_result r;
    moeq_status s = moeq_gen_run(g_srv.gen[st->slot], st->ids, st->n_ids, &st->req.gen, stream_piece, st, &r);
    slot_release(st->slot);
    if (s) {
        char *e = moeq_openai_error(moeq_last_error(), "server_error", NULL, NULL);
        stream_event(st, e);
        log_request(st->path, 500, NULL);
    } else {
        if (st->first) stream_piece(st, "", 0);   /* a chat stream opens with the role even when empty */
        stream_event(st, moeq_openai_chunk(&st->req, st->id, g_srv.model_name, st->created, "", 0, 0,
                                           r.finish_reason, NULL));
        if (st->req.include_usage)
            stream_event(st, moeq_openai_chunk(&st->req, st->id, g_srv.model_name, st->created, NULL, 0, 0, NULL, &r));
        log_request(st->path, 200, &r);
        moeq_gen_result_free(&r);
    }
    stream_event(st, NULL);
    pthread_mutex_lock(&st->mu);
    st->done = true;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    stream_unref(st);
    return NULL;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_t *st = cls;
    pthread_mutex_lock(&st->mu);
    while (st->sent == st->out.n && !st->done) pthread_cond_wait(&st->cv, &st->mu);
    ssize_t k;
    if (st->sent == st->out.n) {
        k = MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        size_t n = st->out.n - st->sent;
        if (n > max) n = max;
        memcpy(buf, st->out.p + st->sent, n);
        st->sent += n;
        k = (ssize_t)n;
        if (st->sent == st->out.n) st->sent = st->out.n = 0;
    }
    pthread_mutex_unlock(&st->mu);
    return k;
}

static void stream_gone(void *cls) {   /* MHD is done with the response: sent, or the client left */
    stream_t *st = cls;
    pthread_mutex_lock(&st->mu);
    st->cancelled = true;
    pthread_mutex_unlock(&st->mu);
    stream_unref(st);
}

typedef struct {
    int fd;
} plain_ctx;

static int plain_piece(void *user, const char *text, size_t len) {
    (void)text;
    (void)len;
    const plain_ctx *p = user;
    return stopping() || peer_gone(p->fd);
}

static enum MHD_Result completion(struct MHD_Connection *c, const char *path, int chat, const cli_buf *body) {
    moeq_openai_request req;
    moeq_status s = moeq_openai_parse(body->p ? body->p : "", body->n, chat, g_srv.ct, &req);
    if (s) {
        log_request(path, 400, NULL);
        return send_error(c, MHD_HTTP_BAD_REQUEST, moeq_last_error(), "invalid_request_error", NULL, NULL);
    }
    int32_t *enc = NULL, *ids = NULL;
    size_t n_enc = 0;
    s = moeq_tokenizer_encode(g_srv.tok, req.prompt, req.prompt_len, &enc, &n_enc);
    int32_t bos = req.add_bos ? moeq_model_get_info(g_srv.m)->bos_token_id : -1;
    size_t n_ids = n_enc + (bos >= 0);
    if (!s) ids = malloc(sizeof(int32_t) * (n_ids + 1));
    if (s || !ids) {
        char msg[600];
        snprintf(msg, sizeof msg, "%s", s ? moeq_last_error() : "out of memory");
        free(enc);
        moeq_openai_request_free(&req);
        log_request(path, 400, NULL);
        return send_error(c, MHD_HTTP_BAD_REQUEST, msg, "invalid_request_error", NULL, NULL);
    }
    if (bos >= 0) ids[0] = bos;
    memcpy(ids + (bos >= 0), enc, sizeof(int32_t) * n_enc);
    free(enc);
    int32_t n_ctx = moeq_gen_n_ctx(g_srv.gen[0]);
    if (n_ids == 0 || n_ids >= (size_t)n_ctx) {
        char msg[200];
        if (n_ids == 0) snprintf(msg, sizeof msg, "the prompt is empty and the model has no BOS token");
        else snprintf(msg, sizeof msg, "the prompt of %zu tokens does not fit the context of %d tokens "
                      "(with room for one new token)", n_ids, n_ctx);
        free(ids);
        moeq_openai_request_free(&req);
        log_request(path, 400, NULL);
        return send_error(c, MHD_HTTP_BAD_REQUEST, msg, "invalid_request_error",
                          n_ids ? "context_length_exceeded" : NULL, NULL);
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    int fd = ci ? ci->connect_fd : -1;
    int slot = slot_acquire(fd);
    if (slot < 0) {
        free(ids);
        moeq_openai_request_free(&req);
        log_request(path, 503, NULL);
        return send_error(c, MHD_HTTP_SERVICE_UNAVAILABLE,
                          slot == -1   ? "every slot is busy and the queue is full: try again"
                          : slot == -3 ? "the client left while its request waited"
                                       : "the server is stopping",
                          "server_error", "overloaded", NULL);
    }
    pthread_mutex_lock(&g_srv.mu);
    unsigned long nid = ++g_srv.next_id;
    pthread_mutex_unlock(&g_srv.mu);
    char id[64];
    snprintf(id, sizeof id, "%s-%lx%lx", chat ? "chatcmpl" : "cmpl", (unsigned long)time(NULL), nid);
    int64_t created = (int64_t)time(NULL);
    if (!req.stream) {
        plain_ctx pc = {fd};
        moeq_gen_result r;
        s = moeq_gen_run(g_srv.gen[slot], ids, n_ids, &req.gen, plain_piece, &pc, &r);
        slot_release(slot);
        free(ids);
        if (s) {
            moeq_openai_request_free(&req);
            log_request(path, 500, NULL);
            return send_error(c, MHD_HTTP_INTERNAL_SERVER_ERROR, moeq_last_error(), "server_error", NULL, NULL);
        }
        log_request(path, 200, &r);
        char *json = moeq_openai_response(&req, id, g_srv.model_name, created, &r);
        moeq_gen_result_free(&r);
        moeq_openai_request_free(&req);
        return send_text(c, MHD_HTTP_OK, json, "application/json");
    }
    stream_t *st = calloc(1, sizeof *st);
    if (!st) {
        slot_release(slot);
        free(ids);
        moeq_openai_request_free(&req);
        return MHD_NO;
    }
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    st->refs = 2;
    st->fd = fd;
    st->slot = slot;
    st->req = req;
    st->ids = ids;
    st->n_ids = n_ids;
    st->created = created;
    st->first = true;
    snprintf(st->id, sizeof st->id, "%s", id);
    snprintf(st->path, sizeof st->path, "%s", path);
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, st, stream_gone);
    if (!resp) {
        slot_release(slot);
        st->refs = 1;
        stream_unref(st);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&th, &at, stream_worker, st) != 0) {
        pthread_attr_destroy(&at);
        slot_release(slot);
        pthread_mutex_lock(&st->mu);
        st->done = true;   /* the response ends at once */
        st->refs--;
        pthread_mutex_unlock(&st->mu);
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_INTERNAL_SERVER_ERROR, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    pthread_attr_destroy(&at);
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)cls;
    (void)version;
    conn_state *cs = *con_cls;
    if (!cs) {
        cs = calloc(1, sizeof *cs);
        if (!cs) return MHD_NO;
        *con_cls = cs;
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cs->too_big && (cs->body.n + *upload_size > MAX_BODY || !cli_buf_put(&cs->body, upload, *upload_size)))
            cs->too_big = true;
        *upload_size = 0;
        return MHD_YES;
    }
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    int chat = !strcmp(url, "/v1/chat/completions");
    if (chat || !strcmp(url, "/v1/completions")) {
        if (!post) return send_error(c, MHD_HTTP_METHOD_NOT_ALLOWED, "use POST", "invalid_request_error", NULL, "POST");
        if (cs->too_big)
            return send_error(c, 413, "the request body is over 16 MiB", "invalid_request_error", NULL, NULL);
        return completion(c, url, chat, &cs->body);
    }
    if (!strcmp(url, "/health") || !strcmp(url, "/v1/models")) {
        if (!get) return send_error(c, MHD_HTTP_METHOD_NOT_ALLOWED, "use GET", "invalid_request_error", NULL, "GET");
        char *json = NULL;
        if (url[1] == 'h') {
            pthread_mutex_lock(&g_srv.mu);
            int idle = 0;
            for (int i = 0; i < g_srv.n_slots; i++) idle += !g_srv.busy[i];
            json = fmt_alloc("{\"status\":\"ok\",\"slots\":%d,\"slots_idle\":%d,\"queued\":%d}", g_srv.n_slots,
                                   idle, g_srv.waiting);
            pthread_mutex_unlock(&g_srv.mu);
        } else {
            json = fmt_alloc("{\"object\":\"list\",\"data\":[{\"id\":\"%s\",\"object\":\"model\",\"created\":0,"
                                   "\"owned_by\":\"moeq\"}]}", g_srv.model_name);
        }
        return send_text(c, MHD_HTTP_OK, json, "application/json");
    }
    char msg[600];
    snprintf(msg, sizeof msg, "no route %s %.200s (there are POST /v1/completions, POST /v1/chat/completions, "
             "GET /v1/models and GET /health)", method, url);
    return send_error(c, MHD_HTTP_NOT_FOUND, msg, "invalid_request_error", "not_found", NULL);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)cls;
    (void)c;
    (void)toe;
    conn_state *cs = *con_cls;
    if (!cs) return;
    free(cs->body.p);
    free(cs);
    *con_cls = NULL;
}

int cmd_serve(int argc, char **argv) {
    const char *host = "127.0.0.1", *revision = NULL, *alias = NULL, *template_name = NULL;
    int64_t port = -1, parallel = 1, queue = -1, ctx = 0, threads = 0;
    bool dequantize = false;
    const cli_opt opts[] = {
        CLI_REVISION_OPT(revision),
        {"--port", OPT_INT, &port, "P", "the TCP port (0: a free one, printed on stderr)", NULL, 0, 65535, NULL},
        {"--host", OPT_STRING, &host, "H", "the IPv4 address to listen on (default 127.0.0.1; 0.0.0.0: every one)", NULL, 0, 0, NULL},
        {"--parallel", OPT_INT, &parallel, "N", "requests generated at once, each on its own session (default 1)", NULL, 1, 256, NULL},
        {"--queue", OPT_INT, &queue, "N", "requests that may wait for a slot; more are answered 503 (default 4 x --parallel)", NULL, 0, 4096, NULL},
        CLI_CTX_OPT(ctx, "each slot's context in tokens (default: the model's)"),
        {"--alias", OPT_STRING, &alias, "NAME", "the model's name in responses and /v1/models (default: MODEL_DIR's last part)", NULL, 0, 0, NULL},
        CLI_TEMPLATE_OPT(template_name),
        CLI_THREADS_OPT(threads),
        CLI_DEQUANTIZE_OPT(dequantize),
    };
    const cli_command cmd = {
        CMD, "MODEL_DIR --port P [--host H] [--parallel N] [--queue N] [--ctx N]",
        "An OpenAI-compatible HTTP server: POST /v1/completions and /v1/chat/completions (streamed as\n"
        "server-sent events with \"stream\": true), GET /v1/models and /health. Sampling fields map to\n"
        "the library's sampler (temperature, top_p, top_k, min_p, seed, presence/frequency/repeat\n"
        "penalties, max_tokens, stop). --parallel requests run at once, --queue more wait, the rest\n"
        "get 503. SIGTERM or Ctrl-C stops it cleanly.",
        opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (port < 0) return cli_usage_error(CMD, "--port is required (0 picks a free one)");
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1)
        return cli_usage_error(CMD, "--host %s: expected an IPv4 address such as 127.0.0.1", host);
    if (queue < 0) queue = 4 * parallel;
    if (threads > 0) moeq_set_threads((int)threads);
    const char *dir = cli_model_dir(CMD, pos[0], revision);
    if (!dir) return CLI_FAIL;

    server *s = &g_srv;
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->n_slots = (int)parallel;
    s->max_queue = (int)queue;
    int ret = CLI_OK;
    moeq_model *m = NULL;
    struct MHD_Daemon *d = NULL;
    moeq_model_options mo = {.keep_packed = !dequantize};
    moeq_status st = moeq_model_open(dir, &mo, &m);
    if (st) {
        ret = cli_fail(CMD, st);
        goto out;
    }
    s->m = m;
    s->tok = moeq_model_tokenizer(m);
    if (!s->tok) {
        fprintf(stderr, "moeq %s: error: %s: no tokenizer\n", CMD, pos[0]);
        ret = CLI_FAIL;
        goto out;
    }
    st = moeq_chat_template_load(dir, template_name, &s->ct);
    if (st == MOEQ_E_NOTFOUND && !template_name)
        fprintf(stderr, "moeq %s: %s has no chat template: /v1/chat/completions answers 400\n", CMD, pos[0]);
    else if (st) {
        ret = cli_fail(CMD, st);
        goto out;
    }
    const char *base = strrchr(pos[0], '/');
    while (base && !base[1] && base > pos[0]) {   /* "dir/" */
        const char *b = base - 1;
        while (b > pos[0] && *b != '/') b--;
        base = *b == '/' ? b : NULL;
    }
    static char name[256];
    snprintf(name, sizeof name, "%s", alias ? alias : base ? base + 1 : pos[0]);
    size_t nl = strlen(name);
    if (nl && name[nl - 1] == '/') name[nl - 1] = 0;
    s->model_name = name;
    s->gen = calloc((size_t)parallel, sizeof *s->gen);
    s->busy = calloc((size_t)parallel, sizeof *s->busy);
    if (!s->gen || !s->busy) {
        fprintf(stderr, "moeq %s: error: out of memory\n", CMD);
        ret = CLI_FAIL;
        goto out;
    }
    for (int i = 0; i < s->n_slots && !st; i++) st = moeq_gen_create(m, (int32_t)ctx, &s->gen[i]);
    if (st) {
        ret = cli_fail(CMD, st);
        goto out;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG, 0, NULL,
                         NULL, on_request, NULL, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
                         MHD_OPTION_NOTIFY_COMPLETED, on_completed, NULL, MHD_OPTION_CONNECTION_TIMEOUT,
                         (unsigned int)600, MHD_OPTION_CONNECTION_LIMIT, (unsigned int)(parallel + queue + 64),
                         MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "moeq %s: error: cannot listen on %s:%lld: %s\n", CMD, host, (long long)port, strerror(errno));
        ret = CLI_FAIL;
        goto out;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    fprintf(stderr, "moeq serve: %s on http://%s:%u (%d slot%s of %d tokens, queue %d, chat template: %s)\n",
            s->model_name, host, di ? di->port : (unsigned)port, s->n_slots, s->n_slots > 1 ? "s" : "",
            moeq_gen_n_ctx(s->gen[0]), s->max_queue, s->ct ? "yes" : "none");
    fflush(stderr);
    while (!g_stop) {
        struct timespec ts = {0, 50000000};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "moeq serve: stopping\n");
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    moeq_interrupt();   /* a generation between two pieces stops at its next token */
    MHD_stop_daemon(d);
    /* detached stream workers finish their run (the interrupt ends it) before a slot is idle */
    for (int tries = 0; tries < 600; tries++) {
        pthread_mutex_lock(&s->mu);
        int busy = 0;
        for (int i = 0; i < s->n_slots; i++) busy += s->busy[i];
        pthread_mutex_unlock(&s->mu);
        if (!busy) break;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "moeq serve: stopped\n");
out:
    for (int i = 0; s->gen && i < s->n_slots; i++) moeq_gen_free(s->gen[i]);
    free(s->gen);
    free(s->busy);
    moeq_chat_template_free(s->ct);
    moeq_model_free(m);
    return ret;
}
#endif
