/*
 * The sampler (moeq.h, "Sampling") against a slow, obvious reference written here from the
 * header's rules: penalties by counting each id over the window, candidates ordered by selection
 * sort, each filter as a plain loop over that order, and the draw walking the running sum. The
 * library's sampler takes shortcuts (a heap for top-k, min-p before the sort, counting with an
 * array), so agreement on random logits with ties and -inf entries, for each option alone and
 * for all together, over many seeds and 24 tokens each (the history growing with the samples),
 * checks both the rules and the shortcuts. Also:
 *  - the draw's distribution: frequencies over 200,000 draws against softmax(l / T) restricted to
 *    the survivors, computed by hand for a 6-token vector;
 *  - greedy ties go to the lower id (and top_k 1 / min_p 1 sampling agrees with greedy);
 *  - penalties on hand-made vectors, with the values worked out in the comments;
 *  - a seed reproduces its ids (also after moeq_sampler_reset and with another thread count),
 *    and the options the old `moeq generate` sampler had give its ids (its code copied here);
 *  - bad options: MOEQ_E_ARG naming the field; NaN/+inf logits: MOEQ_E_NUMERIC naming the id;
 *  - generation helpers: the lenient decode skips ids the tokenizer lacks and keeps the strict
 *    decode's contract; moeq_model_eos_ids returns a config's list.
 */
#include <stdlib.h>
#include <unistd.h>

#include "harness.h"

/* ---- reference -------------------------------------------------------------------------- */

/* splitmix64 as published by Vigna, the header's generator; a 53-bit uniform in [0, 1). */
static double ref_uniform(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z = z ^ (z >> 31);
    return (double)(z >> 11) / 9007199254740992.0;
}

#define REF_MAXV 50304

typedef struct {
    double l;   /* a logit, or a weight (the old sampler's) */
    int32_t id;
} ref_cand;
/* larger logit first, then the lower id */
static int ref_cmp(const void *x, const void *y) {
    const ref_cand *a = x, *b = y;
    if (a->l > b->l) return -1;
    if (a->l < b->l) return 1;
    return a->id < b->id ? -1 : 1;
}
static double g_l[REF_MAXV];
static int32_t g_ord[REF_MAXV], g_keep[REF_MAXV];
static char g_used[REF_MAXV];
static ref_cand g_rc[REF_MAXV];

/* One step of the header's rules; hist[0..n_hist) is everything accepted so far. */
static int32_t ref_sample(const moeq_sampler_options *o, const int32_t *hist, size_t n_hist,
                          const float *logits, int32_t V, uint64_t *rng) {
    double *l = g_l;
    for (int32_t i = 0; i < V; i++) l[i] = logits[i];
    size_t start = 0;
    if (o->repeat_last_n == 0) start = n_hist;
    else if (o->repeat_last_n > 0 && n_hist > (size_t)o->repeat_last_n) start = n_hist - (size_t)o->repeat_last_n;
    for (int32_t v = 0; v < V; v++) {
        int c = 0;
        for (size_t j = start; j < n_hist; j++) c += hist[j] == v;
        if (c == 0) continue;
        if (l[v] > 0) l[v] = l[v] / o->repeat_penalty;
        else l[v] = l[v] * o->repeat_penalty;
        l[v] = l[v] - (double)c * o->frequency_penalty - o->presence_penalty;
    }
    if (o->temperature == 0) {
        int32_t best = 0;
        for (int32_t i = 1; i < V; i++)
            if (l[i] > l[best]) best = i;
        return best;
    }
    /* selection sort: position k gets the best id not yet placed (qsort with the plain
     * comparator past 1024 ids, where V^2 steps would take too long) */
    int32_t *ord = g_ord;
    if (V <= 1024) {
        char *used = g_used;
        memset(used, 0, 1024);   /* V <= 1024 here */
        for (int32_t k = 0; k < V; k++) {
            int32_t b = -1;
            for (int32_t i = 0; i < V; i++)
                if (!used[i] && (b < 0 || l[i] > l[b])) b = i;   /* first of equals: the lower id */
            used[b] = 1;
            ord[k] = b;
        }
    } else {
        for (int32_t i = 0; i < V; i++) g_rc[i] = (ref_cand){l[i], i};
        qsort(g_rc, (size_t)V, sizeof g_rc[0], ref_cmp);
        for (int32_t i = 0; i < V; i++) ord[i] = g_rc[i].id;
    }
    double lmax = l[ord[0]];
    int32_t n = V;
    if (o->top_k > 0 && o->top_k < n) n = o->top_k;
    if (o->top_p < 1) {
        double z = 0;
        for (int32_t i = 0; i < n; i++) z += exp(l[ord[i]] - lmax);
        for (int32_t m = 1; m <= n; m++) {
            double run = 0;
            for (int32_t i = 0; i < m; i++) run += exp(l[ord[i]] - lmax);
            if (run >= o->top_p * z || m == n) {
                n = m;
                break;
            }
        }
    }
    int32_t *keep = g_keep, nk = 0;
    for (int32_t i = 0; i < n; i++)
        if (o->min_p <= 0 || exp(l[ord[i]] - lmax) >= o->min_p) keep[nk++] = ord[i];
    double sum = 0;
    for (int32_t i = 0; i < nk; i++) sum += exp((l[keep[i]] - lmax) / o->temperature);
    double u = ref_uniform(rng) * sum, acc = 0;
    for (int32_t i = 0; i < nk; i++) {
        acc += exp((l[keep[i]] - lmax) / o->temperature);
        if (u < acc) return keep[i];
    }
    return keep[nk - 1];
}

/* ---- random inputs ---------------------------------------------------------------------- */

static uint64_t g_state = 12345;
static uint64_t rnd64(void) {
    g_state ^= g_state << 13;
    g_state ^= g_state >> 7;
    g_state ^= g_state << 17;
    return g_state;
}
static double rnd01(void) { return (double)(rnd64() >> 11) * 0x1p-53; }

/* Logits of a given flavour: spread out, ties on a coarse grid, a few -inf, a peaked one. */
static void random_logits(float *l, int32_t V, int flavour) {
    for (int32_t i = 0; i < V; i++) {
        double g = 0;
        for (int k = 0; k < 4; k++) g += rnd01() - 0.5;   /* roughly normal, sd ~0.58 */
        double x = 6 * g;
        if (flavour == 1) x = floor(x * 2) / 2;           /* many exact ties */
        if (flavour == 1 && rnd64() % 5 == 0) x = rnd64() % 2 ? -0.0 : 0.0;   /* equal, too */
        if (flavour == 2 && rnd64() % 5 == 0) x = -INFINITY;
        if (flavour == 3) x = x * 5;                      /* very peaked: tiny tail weights */
        l[i] = (float)x;
    }
    if (flavour == 2) l[rnd64() % (uint64_t)V] = 1.0f;    /* at least one finite */
}

static moeq_sampler_options random_options(int which) {
    moeq_sampler_options o;
    moeq_sampler_options_init(&o);
    o.seed = rnd64();
    o.temperature = 0.2 + 1.8 * rnd01();
    /* which: 0 temperature only, 1 top-k, 2 top-p, 3 min-p, 4 repeat, 5 presence, 6 frequency,
     * 7 all of them, 8 all with greedy */
    if (which == 1 || which >= 7) o.top_k = (int32_t)(rnd64() % 12);
    if (which == 2 || which >= 7) o.top_p = 0.05 + 0.95 * rnd01();
    if (which == 3 || which >= 7) o.min_p = rnd64() % 4 == 0 ? 1.0 : 0.3 * rnd01();
    if (which == 4 || which >= 7) o.repeat_penalty = 0.5 + 2 * rnd01();
    if (which == 5 || which >= 7) o.presence_penalty = 4 * rnd01() - 1;
    if (which == 6 || which >= 7) o.frequency_penalty = 3 * rnd01() - 0.5;
    if (which >= 4) o.repeat_last_n = (int32_t)(rnd64() % 12) - 1;   /* -1 .. 10 */
    if (which == 8) o.temperature = 0;
    return o;
}

/* The sampler and the reference on the same options and logits for 24 tokens, the prompt and
 * the sampled ids forming the history; returns how many tokens were compared. */
static int compare_run(const moeq_sampler_options *o, int32_t V, int flavour, const char *what) {
    moeq_sampler *s = NULL;
    ASSERT_OK(moeq_sampler_create(o, &s));
    if (!s) return 0;
    int32_t hist[64];
    size_t n_hist = 0;
    int32_t prompt[8];
    for (int i = 0; i < 8; i++) prompt[i] = (int32_t)(rnd64() % (uint64_t)(V + 2)) - 1;  /* -1, V too */
    ASSERT_OK(moeq_sampler_accept(s, prompt, 8));
    memcpy(hist, prompt, sizeof prompt);
    n_hist = 8;
    uint64_t rng = o->seed;
    float l[512];
    int done = 0;
    for (int t = 0; t < 24; t++) {
        random_logits(l, V, flavour);
        int32_t want = ref_sample(o, hist, n_hist, l, V, &rng), got = -2;
        ASSERT_OK(moeq_sampler_sample(s, l, V, &got));
        if (got != want) {
            FAIL("%s: V %d flavour %d token %d: expected id %d, got %d (T %g k %d p %g min_p %g rp %g "
                 "last_n %d pres %g freq %g seed %llu)", what, V, flavour, t, want, got, o->temperature,
                 o->top_k, o->top_p, o->min_p, o->repeat_penalty, o->repeat_last_n,
                 o->presence_penalty, o->frequency_penalty, (unsigned long long)o->seed);
            break;
        }
        hist[n_hist++] = got;
        done++;
    }
    moeq_sampler_free(s);
    return done;
}

static const int32_t g_vocabs[] = {1, 2, 3, 7, 16, 64, 300, 512};

static void run_cases(int which, const char *what) {
    int compared = 0;
    for (size_t vi = 0; vi < sizeof g_vocabs / sizeof g_vocabs[0]; vi++)
        for (int flavour = 0; flavour < 4; flavour++)
            for (int rep = 0; rep < 6; rep++) {
                moeq_sampler_options o = random_options(which);
                compared += compare_run(&o, g_vocabs[vi], flavour, what);
            }
    ASSERT_EQ_INT(8 * 4 * 6 * 24, compared);
}

static void test_temperature_alone(void) { run_cases(0, "temperature"); }
static void test_top_k_alone(void) { run_cases(1, "top_k"); }
static void test_top_p_alone(void) { run_cases(2, "top_p"); }
static void test_min_p_alone(void) { run_cases(3, "min_p"); }
static void test_repeat_penalty_alone(void) { run_cases(4, "repeat_penalty"); }
static void test_presence_penalty_alone(void) { run_cases(5, "presence_penalty"); }
static void test_frequency_penalty_alone(void) { run_cases(6, "frequency_penalty"); }
static void test_chain(void) { run_cases(7, "chain"); }
static void test_chain_greedy(void) { run_cases(8, "chain, greedy"); }

/* A real vocabulary's size (OLMoE's 50,304 rows), where the library sorts by radix: a few tokens
 * of every flavour and option set. */
static void test_large_vocabulary(void) {
    static float l[50304];
    int compared = 0;
    for (int which = 0; which <= 8; which++)
        for (int flavour = 0; flavour < 4; flavour++) {
            moeq_sampler_options o = random_options(which);
            moeq_sampler *s = NULL;
            ASSERT_OK(moeq_sampler_create(&o, &s));
            if (!s) return;
            uint64_t rng = o.seed;
            int32_t hist[4];
            for (int t = 0; t < 4; t++) {
                random_logits(l, 50304, flavour);
                int32_t want = ref_sample(&o, hist, (size_t)t, l, 50304, &rng), got = -1;
                ASSERT_OK(moeq_sampler_sample(s, l, 50304, &got));
                if (want != got) {
                    FAIL("option set %d flavour %d token %d: expected %d, got %d", which, flavour, t,
                         want, got);
                    break;
                }
                hist[t] = got;
                compared++;
            }
            moeq_sampler_free(s);
        }
    ASSERT_EQ_INT(9 * 4 * 4, compared);
}

/* A long history (the library keeps only the window's tail once it is long): 700 tokens on a
 * vocabulary of 40 with windows around the buffer's sizes, against the reference that keeps all. */
static void test_long_history(void) {
    static const int32_t windows[] = {-1, 0, 1, 100, 127, 128, 255, 256, 257, 300, 1000};
    enum { N = 700, V = 40 };
    static int32_t hist[N + N / 7 + 8];   /* every token, and every 7th step one accepted from outside */
    float l[V];
    for (size_t w = 0; w < sizeof windows / sizeof windows[0]; w++) {
        moeq_sampler_options o;
        moeq_sampler_options_init(&o);
        o.repeat_last_n = windows[w];
        o.repeat_penalty = 1.3;
        o.frequency_penalty = 0.05;
        o.presence_penalty = 0.2;
        o.temperature = w % 2 ? 0.8 : 0;
        o.seed = (uint64_t)w;
        moeq_sampler *s = NULL;
        ASSERT_OK(moeq_sampler_create(&o, &s));
        if (!s) return;
        uint64_t rng = o.seed;
        size_t n = 0;
        for (int t = 0; t < N; t++) {
            random_logits(l, V, 0);
            if (t % 7 == 3) {   /* some ids come from outside (accepted, not sampled) */
                hist[n++] = (int32_t)(rnd64() % V);
                ASSERT_OK(moeq_sampler_accept(s, &hist[n - 1], 1));
            }
            int32_t want = ref_sample(&o, hist, n, l, V, &rng), got = -1;
            ASSERT_OK(moeq_sampler_sample(s, l, V, &got));
            if (want != got) {
                FAIL("repeat_last_n %d, token %d: expected %d, got %d", o.repeat_last_n, t, want, got);
                break;
            }
            hist[n++] = got;
        }
        moeq_sampler_free(s);
    }
}

/* The id a fresh sampler with options o draws first from logits l[0..V). */
static int32_t sample_once(const moeq_sampler_options *o, const float *l, int32_t V) {
    moeq_sampler *s = NULL;
    int32_t id = -1;
    ASSERT_OK(moeq_sampler_create(o, &s));
    ASSERT_OK(moeq_sampler_sample(s, l, V, &id));
    moeq_sampler_free(s);
    return id;
}

/* top-p's cut at an exact tie with top_p * Z: four equal logits have w = 1 each and Z = 4, so
 * top_p 0.5 keeps exactly two ids (running sum 2 reaches 0.5 * 4) and 0.25 one. */
static void test_top_p_exact_boundary(void) {
    const float l[4] = {0.25f, 0.25f, 0.25f, 0.25f};
    for (int k = 0; k < 2; k++) {
        moeq_sampler_options o;
        moeq_sampler_options_init(&o);
        o.top_p = k ? 0.25 : 0.5;
        int seen[4] = {0};
        for (uint64_t seed = 0; seed < 400; seed++) {
            o.seed = seed;
            const int32_t id = sample_once(&o, l, 4);
            if (id >= 0 && id < 4) seen[id]++;
        }
        ASSERT_TRUE(seen[0] > 0);
        if (k) ASSERT_EQ_INT(400, seen[0]);
        else ASSERT_TRUE(seen[1] > 0 && seen[0] + seen[1] == 400);
    }
}

/* The draw's distribution, worked out by hand: l = {2, 1, 1, 0, -1, -3}, top_k 4 keeps ids
 * 0..3 (1 and 2 tie: both in), min_p 0.3 keeps exp(l - 2) >= 0.3, i.e. l >= 2 + ln 0.3 = 0.796:
 * ids 0, 1, 2. At T = 0.5 the weights are exp(2 (l - 2)) = 1, e^-2, e^-2. */
static void test_distribution(void) {
    const float l[6] = {2, 1, 1, 0, -1, -3};
    moeq_sampler_options o;
    moeq_sampler_options_init(&o);
    o.temperature = 0.5;
    o.top_k = 4;
    o.min_p = 0.3;
    o.seed = 99;
    moeq_sampler *s = NULL;
    ASSERT_OK(moeq_sampler_create(&o, &s));
    if (!s) return;
    long hits[6] = {0};
    const int N = 200000;
    for (int i = 0; i < N; i++) {
        int32_t id = -1;
        ASSERT_OK(moeq_sampler_sample(s, l, 6, &id));
        if (id < 0 || id > 5) {
            FAIL("id %d out of range", id);
            break;
        }
        hits[id]++;
    }
    double e2 = exp(-2.0), z = 1 + 2 * e2, p[6] = {1 / z, e2 / z, e2 / z, 0, 0, 0};
    for (int i = 0; i < 6; i++) {
        double f = (double)hits[i] / N, sd = sqrt(p[i] * (1 - p[i]) / N);
        ASSERT_NEAR(p[i], f, 5 * sd + 1e-12);   /* 5 standard deviations; 0 exactly for the cut */
    }
    moeq_sampler_free(s);
}

/* Greedy: ties to the lower id, with temperature 0 and by the filters that keep only the top. */
static void test_greedy_ties(void) {
    const float l[8] = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f, 3.0f, -INFINITY, 1.0f};
    moeq_sampler_options o;
    moeq_sampler_options_init(&o);
    for (int mode = 0; mode < 3; mode++) {
        o.temperature = mode == 0 ? 0.0 : 1.7;
        o.top_k = mode == 1 ? 1 : 0;
        o.min_p = mode == 2 ? 1.0 : 0.0;
        for (uint64_t seed = 0; seed < 20; seed++) {
            o.seed = seed;
            const int32_t id = sample_once(&o, l, 8);
            if (mode == 2) ASSERT_TRUE(id == 1 || id == 3 || id == 5);   /* min_p 1 keeps the ties */
            else ASSERT_EQ_INT(1, id);
        }
    }
    /* every logit equal: id 0 */
    const float flat[5] = {-2, -2, -2, -2, -2};
    o.temperature = 0;
    o.top_k = 0;
    o.min_p = 0;
    ASSERT_EQ_INT(0, sample_once(&o, flat, 5));
}

/* Greedy ids after the given history, one option set per call. */
static int32_t greedy_after(const moeq_sampler_options *base, const int32_t *hist, size_t n,
                            const float *l, int32_t V) {
    moeq_sampler_options o = *base;
    o.temperature = 0;
    moeq_sampler *s = NULL;
    int32_t id = -1;
    if (moeq_sampler_create(&o, &s)) return -2;
    if (moeq_sampler_accept(s, hist, n) || moeq_sampler_sample(s, l, V, &id)) id = -3;
    moeq_sampler_free(s);
    return id;
}

static void test_penalties_hand_made(void) {
    moeq_sampler_options o;
    moeq_sampler_options_init(&o);
    /* repeat penalty 2 on id 0 (positive: 4 / 2 = 2 < 3) gives id 1 the lead */
    const float a[3] = {4.0f, 3.0f, -1.0f};
    const int32_t h0[1] = {0};
    ASSERT_EQ_INT(0, greedy_after(&o, h0, 1, a, 3));
    o.repeat_penalty = 2;
    ASSERT_EQ_INT(1, greedy_after(&o, h0, 1, a, 3));
    /* a negative logit is multiplied: -0.5 * 3 = -1.5 < -1.2, so id 1 (-1.2) wins; dividing
     * instead (-0.1667) would keep id 0 */
    const float b[2] = {-0.5f, -1.2f};
    o.repeat_penalty = 3;
    ASSERT_EQ_INT(1, greedy_after(&o, h0, 1, b, 2));
    /* a penalty below 1 favours repeats: 3 / 0.5 = 6 > 5 */
    const float c[2] = {3.0f, 5.0f};
    o.repeat_penalty = 0.5;
    ASSERT_EQ_INT(0, greedy_after(&o, h0, 1, c, 2));
    /* the window: id 0 three tokens back is outside repeat_last_n 2 */
    const int32_t h1[3] = {0, 2, 2};
    o.repeat_penalty = 2;
    o.repeat_last_n = 2;
    ASSERT_EQ_INT(0, greedy_after(&o, h1, 3, a, 3));
    o.repeat_last_n = 3;
    ASSERT_EQ_INT(1, greedy_after(&o, h1, 3, a, 3));
    o.repeat_last_n = 0;   /* none */
    ASSERT_EQ_INT(0, greedy_after(&o, h1, 3, a, 3));
    o.repeat_last_n = -1;  /* all */
    ASSERT_EQ_INT(1, greedy_after(&o, h1, 3, a, 3));

    /* presence and frequency: l = {5, 4.5, 4}, id 0 seen 3 times, id 1 once.
     * frequency 0.3: 5 - 0.9 = 4.1, 4.5 - 0.3 = 4.2, 4 -> id 1.
     * presence 0.6 alone: 4.4, 3.9, 4 -> id 0.
     * both (0.3, 0.6): 3.5, 3.6, 4 -> id 2. */
    moeq_sampler_options_init(&o);
    const float d[3] = {5.0f, 4.5f, 4.0f};
    const int32_t h2[4] = {0, 1, 0, 0};
    o.frequency_penalty = 0.3;
    ASSERT_EQ_INT(1, greedy_after(&o, h2, 4, d, 3));
    o.frequency_penalty = 0;
    o.presence_penalty = 0.6;
    ASSERT_EQ_INT(0, greedy_after(&o, h2, 4, d, 3));
    o.frequency_penalty = 0.3;
    ASSERT_EQ_INT(2, greedy_after(&o, h2, 4, d, 3));
    /* negative penalties encourage repeats: 4 + 0.6 = 4.6 beats 4.5 */
    const float e[3] = {4.5f, 4.0f, 3.0f};
    const int32_t h3[1] = {1};
    o.frequency_penalty = 0;
    o.presence_penalty = -0.6;
    ASSERT_EQ_INT(1, greedy_after(&o, h3, 1, e, 3));
    /* repeat then frequency: (6 / 2) - 2 * 0.4 = 2.2 against 2.3 */
    const float f[2] = {6.0f, 2.3f};
    const int32_t h4[2] = {0, 0};
    moeq_sampler_options_init(&o);
    o.repeat_penalty = 2;
    o.frequency_penalty = 0.4;
    ASSERT_EQ_INT(1, greedy_after(&o, h4, 2, f, 2));
    o.frequency_penalty = 0.3;   /* 3 - 0.6 = 2.4 */
    ASSERT_EQ_INT(0, greedy_after(&o, h4, 2, f, 2));
    /* ids outside [0, V) in the history are ignored, the sampled id joins the history */
    const int32_t h5[3] = {-1, 7, 1000};
    ASSERT_EQ_INT(0, greedy_after(&o, h5, 3, f, 2));
    moeq_sampler_options_init(&o);
    o.temperature = 0;
    o.repeat_penalty = 10;
    moeq_sampler *s = NULL;
    ASSERT_OK(moeq_sampler_create(&o, &s));
    const float g[3] = {3.0f, 2.0f, 1.0f};
    int32_t ids[3];
    for (int i = 0; i < 3; i++) ASSERT_OK(moeq_sampler_sample(s, g, 3, &ids[i]));
    /* 0; then 0 is 0.3: 1; then 1 is 0.2: 2 */
    ASSERT_EQ_INT(0, ids[0]);
    ASSERT_EQ_INT(1, ids[1]);
    ASSERT_EQ_INT(2, ids[2]);
    moeq_sampler_free(s);
}

/* 200 ids from a sampler on fixed pseudo-random logits. */
static void draw_ids(const moeq_sampler_options *o, int32_t *out, int n) {
    moeq_sampler *s = NULL;
    ASSERT_OK(moeq_sampler_create(o, &s));
    if (!s) return;
    uint64_t keep = g_state;
    g_state = 777;
    float l[300];
    for (int i = 0; i < n; i++) {
        random_logits(l, 300, 0);
        ASSERT_OK(moeq_sampler_sample(s, l, 300, &out[i]));
    }
    g_state = 777;   /* the same again after a reset */
    moeq_sampler_reset(s);
    for (int i = 0; i < n; i++) {
        int32_t id = -1;
        random_logits(l, 300, 0);
        ASSERT_OK(moeq_sampler_sample(s, l, 300, &id));
        if (id != out[i]) {
            FAIL("after reset: token %d is %d, first time %d", i, id, out[i]);
            break;
        }
    }
    g_state = keep;
    moeq_sampler_free(s);
}

static void test_reproducible_by_seed(void) {
    moeq_sampler_options o;
    moeq_sampler_options_init(&o);
    o.temperature = 0.9;
    o.top_p = 0.95;
    o.repeat_penalty = 1.1;
    o.seed = 42;
    int32_t a[200], b[200], c[200];
    moeq_set_threads(1);
    draw_ids(&o, a, 200);
    moeq_set_threads(2);
    draw_ids(&o, b, 200);
    moeq_set_threads(0);
    ASSERT_TRUE(memcmp(a, b, sizeof a) == 0);
    o.seed = 43;
    draw_ids(&o, c, 200);
    int same = 0;
    for (int i = 0; i < 200; i++) same += a[i] == c[i];
    ASSERT_TRUE(same < 150);   /* another seed, other ids (most of them) */
}

/* The sampler `moeq generate` had before this one (tools/moeq/cmd_generate.c, copied as it was):
 * temperature first, then top-p on the tempered probabilities, the same generator and walk. With
 * top_p 1, or temperature 1, the library gives the same ids, so `--temp T --seed S` texts made
 * before stay the same (with both --temp != 1 and --top-p < 1 top-p now cuts the untempered
 * distribution, as llama.cpp does). */
/* (its candidates sorted as the reference's are: larger weight first, then the lower id) */
static int32_t old_pick_sample(const float *logits, int32_t V, double temp, double top_p, ref_cand *c,
                               uint64_t *rng) {
    double mx = logits[0];
    for (int32_t i = 1; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int32_t i = 0; i < V; i++) {
        c[i].id = i;
        c[i].l = exp(((double)logits[i] - mx) / temp);
        sum += c[i].l;
    }
    qsort(c, (size_t)V, sizeof *c, ref_cmp);
    int32_t keep = 0;
    double mass = 0;
    while (keep < V && (keep == 0 || mass < top_p * sum)) mass += c[keep++].l;
    double u = ref_uniform(rng) * mass, acc = 0;
    for (int32_t i = 0; i < keep; i++) {
        acc += c[i].l;
        if (u < acc) return c[i].id;
    }
    return c[keep - 1].id;
}

static void test_old_generate_draws(void) {
    ref_cand c[512];
    float l[512];
    int compared = 0;
    for (int rep = 0; rep < 60; rep++) {
        moeq_sampler_options o;
        moeq_sampler_options_init(&o);
        o.seed = rnd64();
        if (rep % 2) o.temperature = 0.3 + 1.5 * rnd01();
        else o.top_p = 0.1 + 0.9 * rnd01();
        moeq_sampler *s = NULL;
        ASSERT_OK(moeq_sampler_create(&o, &s));
        if (!s) return;
        uint64_t rng = o.seed;
        int32_t V = rep % 3 == 0 ? 512 : 50;
        for (int t = 0; t < 30; t++) {
            random_logits(l, V, 0);
            int32_t want = old_pick_sample(l, V, o.temperature, o.top_p, c, &rng), got = -1;
            ASSERT_OK(moeq_sampler_sample(s, l, V, &got));
            if (want != got) {
                FAIL("rep %d token %d: the old sampler gives %d, the library %d", rep, t, want, got);
                break;
            }
            compared++;
        }
        moeq_sampler_free(s);
    }
    ASSERT_EQ_INT(60 * 30, compared);
}

static void test_bad_options(void) {
    moeq_sampler_options o;
    moeq_sampler *s = NULL;
#define EXPECT_BAD(field, value)                                                                   \
    do {                                                                                           \
        moeq_sampler_options_init(&o);                                                             \
        o.field = value;                                                                           \
        s = (moeq_sampler *)&o;                                                                    \
        ASSERT_STATUS(MOEQ_E_ARG, moeq_sampler_create(&o, &s));                                    \
        ASSERT_ERROR_MENTIONS(#field);                                                             \
        ASSERT_TRUE(s == NULL);                                                                    \
    } while (0)
    EXPECT_BAD(temperature, -0.5);
    EXPECT_BAD(temperature, NAN);
    EXPECT_BAD(temperature, INFINITY);
    EXPECT_BAD(top_k, -1);
    EXPECT_BAD(top_p, 0.0);
    EXPECT_BAD(top_p, 1.5);
    EXPECT_BAD(top_p, NAN);
    EXPECT_BAD(min_p, -0.1);
    EXPECT_BAD(min_p, 1.01);
    EXPECT_BAD(min_p, NAN);
    EXPECT_BAD(repeat_penalty, 0.0);
    EXPECT_BAD(repeat_penalty, -1.0);
    EXPECT_BAD(repeat_penalty, INFINITY);
    EXPECT_BAD(repeat_last_n, -2);
    EXPECT_BAD(presence_penalty, NAN);
    EXPECT_BAD(frequency_penalty, -INFINITY);
#undef EXPECT_BAD
    /* the edges that are allowed */
    moeq_sampler_options_init(&o);
    o.temperature = 0;
    o.top_p = 1;
    o.min_p = 1;
    o.repeat_last_n = -1;
    o.presence_penalty = -2;
    ASSERT_OK(moeq_sampler_create(&o, &s));
    /* bad calls */
    const float l[3] = {1, NAN, 2};
    int32_t id = 5;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_sampler_sample(s, l, 0, &id));
    ASSERT_ERROR_MENTIONS("n_vocab");
    ASSERT_STATUS(MOEQ_E_ARG, moeq_sampler_sample(s, NULL, 3, &id));
    ASSERT_STATUS(MOEQ_E_ARG, moeq_sampler_accept(s, NULL, 2));
    ASSERT_OK(moeq_sampler_accept(s, NULL, 0));
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_sampler_sample(s, l, 3, &id));
    ASSERT_ERROR_MENTIONS("id 1");
    const float inf[2] = {0, INFINITY};
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_sampler_sample(s, inf, 2, &id));
    ASSERT_ERROR_MENTIONS("id 1");
    const float none[2] = {-INFINITY, -INFINITY};
    ASSERT_STATUS(MOEQ_E_NUMERIC, moeq_sampler_sample(s, none, 2, &id));
    ASSERT_ERROR_MENTIONS("-inf");
    moeq_sampler_free(s);
    ASSERT_STATUS(MOEQ_E_ARG, moeq_sampler_create(NULL, &s));
    moeq_sampler_free(NULL);
    moeq_sampler_reset(NULL);
}

/* ---- generation helpers ------------------------------------------------------------------- */

static void test_decode_skip_unknown(void) {
    moeq_tokenizer *tok = mq_test_tokenizer(mq_test_model("olmoe-tiny"));   /* its tokenizer.json */
    if (!tok) return;
    ASSERT_EQ_INT(4096, moeq_tokenizer_vocab_size(tok));
    int32_t *known = NULL;
    size_t n_known = 0;
    const char *text = "The history of the world, 日本.";
    ASSERT_OK(moeq_tokenizer_encode(tok, text, strlen(text), &known, &n_known));
    /* the same ids with unknown ones in between (past the vocabulary, negative, at both ends) */
    int32_t mixed[64];
    size_t n = 0;
    mixed[n++] = 4096;
    for (size_t i = 0; i < n_known && n < 60; i++) {
        mixed[n++] = known[i];
        if (i % 2) mixed[n++] = i % 4 == 1 ? 20019 : -3;
    }
    mixed[n++] = INT32_MAX;
    char *got = NULL, *want = NULL;
    size_t got_len = 0;
    ASSERT_OK(moeq_tokenizer_decode_ex(tok, mixed, n, MOEQ_DECODE_SKIP_UNKNOWN, &got, &got_len));
    ASSERT_OK(moeq_tokenizer_decode(tok, known, n_known, &want, NULL));
    ASSERT_EQ_STR(text, want);
    ASSERT_EQ_STR(want, got);
    ASSERT_EQ_INT(strlen(text), got_len);
    free(got);
    free(want);
    /* only unknown ids: the empty string */
    const int32_t unk[2] = {5000, 50303};
    ASSERT_OK(moeq_tokenizer_decode_ex(tok, unk, 2, MOEQ_DECODE_SKIP_UNKNOWN, &got, &got_len));
    ASSERT_EQ_STR("", got);
    ASSERT_EQ_INT(0, got_len);
    free(got);
    /* a character cut between ids still becomes U+FFFD (skipping does not join bytes across an
     * unknown id any differently than leaving it out) */
    int32_t *jp = NULL;
    size_t n_jp = 0;
    ASSERT_OK(moeq_tokenizer_encode(tok, "本", strlen("本"), &jp, &n_jp));
    ASSERT_TRUE(n_jp >= 2);
    int32_t cut[3] = {jp[0], 4097, 0};
    ASSERT_OK(moeq_tokenizer_decode_ex(tok, cut, 2, MOEQ_DECODE_SKIP_UNKNOWN, &got, NULL));
    ASSERT_EQ_STR("\xef\xbf\xbd", got);
    free(got);
    free(jp);
    /* the strict contract stays: flags 0 and moeq_tokenizer_decode fail naming the id */
    got = (char *)"x";
    ASSERT_STATUS(MOEQ_E_ARG, moeq_tokenizer_decode_ex(tok, mixed, n, 0, &got, NULL));
    ASSERT_ERROR_MENTIONS("id 4096 at position 0");
    ASSERT_TRUE(got == NULL);
    ASSERT_STATUS(MOEQ_E_ARG, moeq_tokenizer_decode(tok, mixed + 1, n - 1, &got, NULL));
    ASSERT_ERROR_MENTIONS("20019");
    ASSERT_STATUS(MOEQ_E_ARG, moeq_tokenizer_decode_ex(tok, known, n_known, 2u, &got, NULL));
    ASSERT_ERROR_MENTIONS("flags");
    free(known);
    moeq_tokenizer_free(tok);
}

static void test_model_eos_ids(void) {
    char src[1200];
    snprintf(src, sizeof src, "%s", mq_test_model("olmoe-tiny"));
    moeq_model_options mo = {.no_tokenizer = 1};
    moeq_model *m = mq_test_open_model(src, &mo);
    if (!m) return;
    int32_t eos[4] = {-5, -5, -5, -5};
    ASSERT_EQ_INT(1, moeq_model_eos_ids(m, eos, 4));   /* config.json: "eos_token_id": 0 */
    ASSERT_EQ_INT(0, eos[0]);
    ASSERT_EQ_INT(-5, eos[1]);
    moeq_model_free(m);
    /* a list in config.json (Llama-3 instruct style), in a copy of the model */
    char path[1300], cfg_path[1300];
    snprintf(path, sizeof path, "%s/config.json", src);
    size_t n = 0;
    char *cfg = mq_test_slurp(path, &n);
    ASSERT_TRUE(cfg != NULL);
    if (!cfg) return;
    const char *key = "\"eos_token_id\": 0";
    char *at = strstr(cfg, key);
    ASSERT_TRUE(at != NULL);
    if (!at) {
        free(cfg);
        return;
    }
    const char *tmp = mq_test_tmpdir();
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", tmp);
    FILE *f = fopen(cfg_path, "w");
    ASSERT_TRUE(f != NULL);
    if (!f) {
        free(cfg);
        return;
    }
    fprintf(f, "%.*s\"eos_token_id\": [270, 5, 9]%s", (int)(at - cfg), cfg, at + strlen(key));
    fclose(f);
    free(cfg);
    char link_from[1300], link_to[1300];
    snprintf(link_from, sizeof link_from, "%s/model.safetensors", src);
    snprintf(link_to, sizeof link_to, "%s/model.safetensors", tmp);
    ASSERT_TRUE(symlink(link_from, link_to) == 0);
    ASSERT_OK(moeq_model_open(tmp, &mo, &m));
    if (!m) return;
    ASSERT_EQ_INT(3, moeq_model_eos_ids(m, NULL, 0));
    ASSERT_EQ_INT(3, moeq_model_eos_ids(m, eos, 2));   /* the count, the first two stored */
    ASSERT_EQ_INT(270, eos[0]);
    ASSERT_EQ_INT(5, eos[1]);
    ASSERT_EQ_INT(3, moeq_model_eos_ids(m, eos, 4));
    ASSERT_EQ_INT(9, eos[2]);
    moeq_model_free(m);
    ASSERT_EQ_INT(0, moeq_model_eos_ids(NULL, eos, 4));
}

TEST_MAIN(T(test_temperature_alone), T(test_top_k_alone), T(test_top_p_alone), T(test_min_p_alone),
          T(test_repeat_penalty_alone), T(test_presence_penalty_alone),
          T(test_frequency_penalty_alone), T(test_chain), T(test_chain_greedy), T(test_large_vocabulary),
          T(test_long_history),
          T(test_top_p_exact_boundary), T(test_distribution),
          T(test_greedy_ties), T(test_penalties_hand_made), T(test_reproducible_by_seed),
          T(test_old_generate_draws), T(test_bad_options), T(test_decode_skip_unknown),
          T(test_model_eos_ids))
