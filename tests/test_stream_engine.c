/* The streaming engine (src/stream/) with fake clients, against expectations the tests compute
 * on their own:
 *  - order: with two streams of different depths, every item passes layer l of a stream before
 *    any item passes layer l + 1, stream 1's layer l before stream 0's, each (stream, layer, item)
 *    exactly once, begin/end around each step and layer_done after each layer, at 1, 3 and 8
 *    workers;
 *  - the boundary store: a boundary in two mapped files (swapped by the engine) ends with the
 *    same bytes as one in memory, and both equal a plain loop over the rows;
 *  - Ctrl-C between layers stops the loop before the next layer with the client's message; an
 *    item's failure comes back with its own message;
 *  - progress: units added on any worker all counted, printed by the caller, capped at the total;
 *  - loading: the lazy model's layer is loaded during its step and released after it, read ahead
 *    or not (the bundled olmoe-tiny). */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "stream/engine.h"

enum { N_ITEMS = 7, MAX_L = 4 };

/* ---- order ----------------------------------------------------------------------------------- */
typedef struct {
    atomic_int seq;
    /* the sequence number of each (stream, layer, item) run, and how often it ran */
    int at[2][MAX_L][N_ITEMS];
    atomic_int runs[2][MAX_L][N_ITEMS];
    int begin_seq[2][MAX_L], end_seq[2][MAX_L], done_seq[MAX_L];
    int begun, ended;
} order_log;

static moeq_status ord_begin(void *user, int k, int l) {
    order_log *g = user;
    g->begin_seq[k][l] = atomic_fetch_add(&g->seq, 1);
    g->begun++;
    return MOEQ_OK;
}

static moeq_status ord_item(void *user, int k, int l, int64_t item, int worker) {
    (void)worker;
    order_log *g = user;
    g->at[k][l][item] = atomic_fetch_add(&g->seq, 1);
    atomic_fetch_add(&g->runs[k][l][item], 1);
    usleep(100 * (unsigned)(item % 3));   /* items finish out of order */
    return MOEQ_OK;
}

static void ord_end(void *user, int k, int l) {
    order_log *g = user;
    g->end_seq[k][l] = atomic_fetch_add(&g->seq, 1);
    g->ended++;
}

static moeq_status ord_done(void *user, int l, double seconds) {
    order_log *g = user;
    ASSERT_TRUE(seconds >= 0);
    g->done_seq[l] = atomic_fetch_add(&g->seq, 1);
    return MOEQ_OK;
}

static void test_every_item_through_layer_l_first(void) {
    static const int workers[] = {1, 3, 8};
    for (size_t wi = 0; wi < sizeof workers / sizeof workers[0]; wi++) {
        order_log *g = calloc(1, sizeof *g);
        ASSERT_TRUE(g != NULL);
        mq_engine_client c = {.user = g, .n_streams = 2, .first = 0, .end = 4,
                              .n_layers = {4, 2}, .begin_layer = ord_begin, .run_item = ord_item,
                              .end_layer = ord_end, .layer_done = ord_done, .n_items = N_ITEMS,
                              .workers = workers[wi]};
        ASSERT_OK(mq_engine_run(&c));
        /* steps: layers 0, 1 of both streams, 2, 3 of stream 0 alone */
        ASSERT_EQ_INT(6, g->begun);
        ASSERT_EQ_INT(6, g->ended);
        int prev_end = -1;
        for (int l = 0; l < 4; l++) {
            for (int k = 1; k >= 0; k--) {
                if (l >= c.n_layers[k]) continue;
                ASSERT_TRUE(g->begin_seq[k][l] > prev_end);
                for (int i = 0; i < N_ITEMS; i++) {
                    ASSERT_EQ_INT(1, atomic_load(&g->runs[k][l][i]));
                    ASSERT_TRUE(g->at[k][l][i] > g->begin_seq[k][l]);
                    ASSERT_TRUE(g->at[k][l][i] < g->end_seq[k][l]);
                }
                prev_end = g->end_seq[k][l];
            }
            ASSERT_TRUE(g->done_seq[l] > prev_end);
            prev_end = g->done_seq[l];
        }
        for (int i = 0; i < N_ITEMS; i++)   /* stream 1 has two layers only */
            for (int l = 2; l < 4; l++) ASSERT_EQ_INT(0, atomic_load(&g->runs[1][l][i]));
        free(g);
    }
}

/* ---- the boundary store ---------------------------------------------------------------------- */
enum { D = 5, ROWS_PER = 3 };

typedef struct {
    mq_actbuf *cur, *next;
    bool ram;
} rows_client;

/* The rows' layer function: each value from its row's values, the layer and the item (a value
 * of another row would make a wrong swap show). */
static float layer_fn(const float *row, int j, int l, int64_t item) {
    float s = 0;
    for (int i = 0; i < D; i++) s += row[i] * (float)(i + 1);
    return 0.5f * row[j] + 0.01f * s + (float)(l + 1) * 0.25f - (float)item * 0.125f;
}

static moeq_status rows_item(void *user, int k, int l, int64_t item, int worker) {
    (void)k, (void)worker;
    rows_client *rc = user;
    for (int r = 0; r < ROWS_PER; r++) {
        const size_t off = (size_t)(item * ROWS_PER + r) * D;
        float in[D], out[D];
        memcpy(in, rc->cur->f + off, sizeof in);
        for (int j = 0; j < D; j++) out[j] = layer_fn(in, j, l, item);
        memcpy((rc->ram ? rc->cur : rc->next)->f + off, out, sizeof out);
    }
    return MOEQ_OK;
}

static void fill_rows(float *f) {
    for (int i = 0; i < N_ITEMS * ROWS_PER * D; i++) f[i] = (float)((i * 37) % 11) - 5.0f;
}

static void test_spilled_boundary_equals_memory(void) {
    const size_t n = (size_t)N_ITEMS * ROWS_PER * D;
    const int layers = 5;
    /* the plain loop */
    float want[N_ITEMS * ROWS_PER * D];
    fill_rows(want);
    for (int l = 0; l < layers; l++)
        for (int64_t item = 0; item < N_ITEMS; item++)
            for (int r = 0; r < ROWS_PER; r++) {
                float *row = want + (size_t)(item * ROWS_PER + r) * D, out[D];
                for (int j = 0; j < D; j++) out[j] = layer_fn(row, j, l, item);
                memcpy(row, out, sizeof out);
            }
    /* in memory, updated in place */
    mq_actbuf ram, none;
    ASSERT_OK(mq_actbuf_init(&ram, MQ_ACT_RAM, n, NULL, "test rows"));
    memset(&none, 0, sizeof none);
    fill_rows(ram.f);
    rows_client rc = {&ram, &none, true};
    mq_engine_client c = {.user = &rc, .n_streams = 1, .end = layers, .n_layers = {layers},
                          .run_item = rows_item, .n_items = N_ITEMS, .workers = 3,
                          .cur = {&ram}, .next = {&none}};
    ASSERT_OK(mq_engine_run(&c));
    ASSERT_TRUE(memcmp(want, ram.f, sizeof want) == 0);
    /* in two mapped files: the engine swaps them after each layer */
    char *pa = mq_asprintf("%s/engine-a.f32", mq_test_tmpdir());
    char *pb = mq_asprintf("%s/engine-b.f32", mq_test_tmpdir());
    mq_actbuf fa, fb;
    ASSERT_OK(mq_actbuf_init(&fa, MQ_ACT_DISK, n, pa, "test rows"));
    ASSERT_OK(mq_actbuf_init(&fb, MQ_ACT_DISK, n, pb, "test rows"));
    fill_rows(fa.f);
    mq_actbuf *a = &fa, *b = &fb;
    rows_client rd = {a, b, false};
    c.user = &rd;
    c.cur[0] = a;
    c.next[0] = b;
    ASSERT_OK(mq_engine_run(&c));
    /* five layers: the pair swapped five times, so the rows are in the file that started as b,
     * now a's slot; the other holds layer 3's output */
    ASSERT_TRUE(strcmp(fa.path, pb) == 0);
    ASSERT_TRUE(memcmp(want, fa.f, sizeof want) == 0);
    ASSERT_TRUE(memcmp(want, fb.f, sizeof want) != 0);
    /* the files hold the same bytes once synced (a resume reads them) */
    ASSERT_OK(mq_actbuf_sync(&fa));
    size_t len = 0;
    char *bytes = mq_test_slurp(pb, &len);
    ASSERT_EQ_INT((int)sizeof want, (int)len);
    ASSERT_TRUE(memcmp(want, bytes, sizeof want) == 0);
    free(bytes);
    mq_actbuf_free(&fa);
    mq_actbuf_free(&fb);
    ASSERT_TRUE(access(pa, F_OK) != 0);   /* fresh files go with their buffers */
    /* a kept file outlives its buffer and is reopened with its contents */
    mq_actbuf kept;
    ASSERT_OK(mq_actbuf_open_kept(&kept, n, pa, "test rows"));
    memcpy(kept.f, want, sizeof want);
    mq_actbuf_free(&kept);
    ASSERT_OK(mq_actbuf_open_kept(&kept, n, pa, "test rows"));
    ASSERT_TRUE(memcmp(want, kept.f, sizeof want) == 0);
    mq_actbuf_free(&kept);
    ASSERT_EQ_INT(0, unlink(pa));
    mq_actbuf_free(&ram);
    free(pa);
    free(pb);
}

/* ---- interrupts and failures ----------------------------------------------------------------- */
typedef struct {
    int interrupt_after;   /* layer_done of this layer presses Ctrl-C */
    int fail_layer;        /* run_item fails at this layer's item 4 */
    atomic_int max_layer;
} stop_client;

static moeq_status stop_item(void *user, int k, int l, int64_t item, int worker) {
    (void)k, (void)worker;
    stop_client *sc = user;
    int m = atomic_load(&sc->max_layer);
    while (l > m && !atomic_compare_exchange_weak(&sc->max_layer, &m, l)) {
    }
    if (l == sc->fail_layer && item == 4) return mq_err(MOEQ_E_FORMAT, "item %lld of layer %d is bad", (long long)item, l);
    return MOEQ_OK;
}

static moeq_status stop_done(void *user, int l, double seconds) {
    (void)seconds;
    stop_client *sc = user;
    if (l == sc->interrupt_after) moeq_interrupt();
    return MOEQ_OK;
}

static void test_interrupt_stops_between_layers(void) {
    stop_client sc = {.interrupt_after = 1, .fail_layer = -1};
    atomic_store(&sc.max_layer, -1);
    mq_engine_client c = {.user = &sc, .n_streams = 1, .end = 6, .n_layers = {6}, .run_item = stop_item,
                          .layer_done = stop_done, .n_items = N_ITEMS, .workers = 2,
                          .interrupt_msg = "test run interrupted"};
    moeq_status s = mq_engine_run(&c);
    moeq_clear_interrupt();
    ASSERT_EQ_INT(MOEQ_E_INTERRUPTED, s);
    ASSERT_EQ_STR("test run interrupted", moeq_last_error());
    ASSERT_EQ_INT(1, atomic_load(&sc.max_layer));   /* layer 2 never started */
    /* a failing item: its message, from its worker's thread, and no later layer */
    stop_client sf = {.interrupt_after = -1, .fail_layer = 3};
    atomic_store(&sf.max_layer, -1);
    c.user = &sf;
    c.workers = 4;
    s = mq_engine_run(&c);
    ASSERT_EQ_INT(MOEQ_E_FORMAT, s);
    ASSERT_EQ_STR("item 4 of layer 3 is bad", moeq_last_error());
    ASSERT_EQ_INT(3, atomic_load(&sf.max_layer));
}

/* ---- loading through the lazy model ------------------------------------------------------------ */
typedef struct {
    mq_lazy_model *lz;
    int steps, loaded_seen;
} load_client;

static unsigned load_parts(void *user, int k, int l) {
    (void)user, (void)k, (void)l;
    return MQ_PART_LAYER;
}

static moeq_status load_layer(void *user, int k, int l) {
    (void)k;
    load_client *lc = user;
    const moeq_model *m = mq_lazy_model_of(lc->lz);
    for (int j = 0; j < m->cfg.n_layers; j++) {   /* this layer alone is resident */
        const bool have = m->layers[j].q.w != NULL || m->layers[j].q.qw != NULL;
        if (have != (j == l)) FAIL("layer %d loaded=%d during layer %d's step", j, have, l);
    }
    lc->loaded_seen += m->layers[l].attn_norm != NULL;
    lc->steps++;
    return MOEQ_OK;
}

static void test_layers_loaded_one_at_a_time(void) {
    for (int ahead = 0; ahead < 2; ahead++) {
        load_client lc = {0};
        ASSERT_OK(mq_lazy_open(mq_test_repo("models/olmoe-tiny"), false, &lc.lz));
        const int L = mq_lazy_model_of(lc.lz)->cfg.n_layers;
        mq_engine_client c = {.user = &lc, .n_streams = 1, .end = L, .n_layers = {L},
                              .lz = {lc.lz}, .parts = load_parts, .read_ahead = ahead,
                              .begin_layer = load_layer};
        ASSERT_OK(mq_engine_run(&c));
        ASSERT_EQ_INT(L, lc.steps);
        ASSERT_EQ_INT(L, lc.loaded_seen);
        const moeq_model *m = mq_lazy_model_of(lc.lz);
        for (int j = 0; j < L; j++) ASSERT_TRUE(m->layers[j].q.w == NULL);   /* all released */
        mq_lazy_close(lc.lz);
    }
}

/* ---- progress ------------------------------------------------------------------------------- */
static int64_t g_calls, g_last_done, g_last_total;

static void on_progress(void *user, const char *label, int64_t done, int64_t total) {
    (void)user;
    ASSERT_EQ_STR("test", label);
    g_calls++;
    g_last_done = done;
    g_last_total = total;
}

static mq_engine_progress g_pr;

static moeq_status progress_item(void *user, int64_t item, int worker) {
    (void)user, (void)item, (void)worker;
    mq_engine_progress_add(&g_pr, 2);
    return MOEQ_OK;
}

static void test_progress_counts_every_thread(void) {
    moeq_set_progress(on_progress, NULL);
    mq_engine_progress_init(&g_pr, "test", 100);
    ASSERT_OK(mq_engine_items(40, 4, progress_item, NULL));
    /* 40 items of 2 units, on 4 workers: every unit counted, printed by the caller's thread only
     * (the items it ran itself, if any) */
    ASSERT_EQ_INT(80, (int)atomic_load(&g_pr.done));
    ASSERT_TRUE(g_calls <= 40);
    mq_engine_progress_add(&g_pr, 0);
    ASSERT_EQ_INT(80, (int)g_last_done);
    ASSERT_EQ_INT(100, (int)g_last_total);
    /* 80 done, 60 of them since the mark, in 3 s: 20 left take 1 s */
    ASSERT_NEAR(1.0, mq_engine_progress_eta(&g_pr, 20, 3.0), 1e-12);
    mq_engine_progress_add(&g_pr, 50);
    ASSERT_EQ_INT(100, (int)g_last_done);   /* an estimate that falls short stops at the total */
    ASSERT_NEAR(0.0, mq_engine_progress_eta(&g_pr, 20, 3.0), 1e-12);
    moeq_set_progress(NULL, NULL);
}

TEST_MAIN(T(test_progress_counts_every_thread), T(test_every_item_through_layer_l_first), T(test_spilled_boundary_equals_memory),
          T(test_interrupt_stops_between_layers), T(test_layers_loaded_one_at_a_time))
