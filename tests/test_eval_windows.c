/* Rolling windows against a line-by-line transliteration of lm-eval's get_rolling_token_windows,
 * make_disjoint_window and the HF model's (context + continuation)[-(L+1):][:-1] input, with
 * Python slice semantics written out here. */
#include <stdlib.h>

#include "eval/eval.h"
#include "harness.h"

/* Python list slice a[lo:hi] (step 1) of an array of n ints: negative indices count from the end,
 * out-of-range bounds clamp. Returns the length written to out. */
static int64_t pyslice(const int32_t *a, int64_t n, int64_t lo, int64_t hi, int32_t *out) {
    if (lo < 0) lo += n;
    if (hi < 0) hi += n;
    if (lo < 0) lo = 0;
    if (hi < 0) hi = 0;
    if (lo > n) lo = n;
    if (hi > n) hi = n;
    int64_t k = 0;
    for (int64_t i = lo; i < hi; i++) out[k++] = a[i];
    return k;
}

typedef struct {
    int32_t *input; /* model input */
    int64_t n_input;
    int32_t *cont; /* scored targets: the logits of the last n_cont input positions */
    int64_t n_cont;
} ref_window;

/* Emits one (context, continuation) pair the way lm-eval's HF model consumes it. */
static void ref_emit(const int32_t *ctx_full, int64_t n_ctx_full, const int32_t *cont,
                     int64_t n_cont, int32_t L, ref_window *w) {
    /* make_disjoint_window: a[: len(a) - (len(b) - 1)] */
    int32_t *joined = malloc(sizeof(int32_t) * (size_t)(n_ctx_full + n_cont + 1));
    int64_t nc = pyslice(ctx_full, n_ctx_full, 0, n_ctx_full - (n_cont - 1), joined);
    for (int64_t i = 0; i < n_cont; i++) joined[nc + i] = cont[i];
    int64_t nj = nc + n_cont;
    /* inp = (context_enc + continuation_enc)[-(max_length + 1):][:-1] */
    int32_t *tail = malloc(sizeof(int32_t) * (size_t)(nj + 1));
    int64_t nt = pyslice(joined, nj, -(int64_t)(L + 1), nj, tail);
    w->input = malloc(sizeof(int32_t) * (size_t)(nt + 1));
    w->n_input = pyslice(tail, nt, 0, -1, w->input);
    w->cont = malloc(sizeof(int32_t) * (size_t)(n_cont + 1));
    memcpy(w->cont, cont, sizeof(int32_t) * (size_t)n_cont);
    w->n_cont = n_cont;
    free(joined);
    free(tail);
}

/* get_rolling_token_windows(token_list, prefix_token, max_seq_len=L, context_len=1). */
static int64_t ref_windows(const int32_t *T, int64_t n, int32_t P, int32_t L, ref_window *out) {
    if (n == 0) return 0;
    const int64_t context_len = 1, pred_len = L - context_len + 1;
    int64_t predicted = 0, count = 0;
    int64_t first_seq_len = n < L ? n : L;
    int32_t *a = calloc((size_t)(n + L + 2), sizeof(int32_t));
    int32_t *b = calloc((size_t)(n + L + 2), sizeof(int32_t));
    a[0] = P;
    int64_t na = 1 + pyslice(T, n, 0, first_seq_len - 1, a + 1);
    int64_t nb = pyslice(T, n, 0, first_seq_len, b);
    ref_emit(a, na, b, nb, L, &out[count++]);
    predicted += first_seq_len;
    while (predicted < n) {
        int64_t window_pred_len = n - predicted < pred_len ? n - predicted : pred_len;
        int64_t window_end = predicted + window_pred_len;
        na = pyslice(T, n, window_end - L - 1, window_end - 1, a);
        nb = pyslice(T, n, window_end - window_pred_len, window_end, b);
        ref_emit(a, na, b, nb, L, &out[count++]);
        predicted += window_pred_len;
    }
    free(a);
    free(b);
    return count;
}

static void check_case(int64_t n, int32_t L) {
    int32_t *T = malloc(sizeof(int32_t) * (size_t)(n + 1));
    for (int64_t i = 0; i < n; i++) T[i] = (int32_t)(1000 + i);
    const int32_t P = 7;
    ref_window *ref = calloc((size_t)(n + 2), sizeof *ref);
    int64_t nref = ref_windows(T, n, P, L, ref);
    int64_t nw = mq_rolling_window_count(n, L);
    if (nw != nref)
        FAIL("n=%lld L=%d: %lld windows, reference %lld", (long long)n, L, (long long)nw,
             (long long)nref);
    mq_window *w = calloc((size_t)(nw + 1), sizeof *w);
    mq_rolling_windows(n, L, w);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(L + 1));
    int64_t scored = 0;
    for (int64_t k = 0; k < nw; k++) {
        if (w[k].n_input != ref[k].n_input || w[k].n_score != ref[k].n_cont)
            FAIL("n=%lld L=%d window %lld: input %d score %d, reference %lld/%lld", (long long)n, L,
                 (long long)k, w[k].n_input, w[k].n_score, (long long)ref[k].n_input,
                 (long long)ref[k].n_cont);
        ASSERT_TRUE(w[k].n_input <= L && w[k].n_score >= 1 && w[k].n_score <= w[k].n_input);
        mq_window_input(&w[k], T, P, ids);
        for (int32_t i = 0; i < w[k].n_input; i++)
            if (ids[i] != ref[k].input[i])
                FAIL("n=%lld L=%d window %lld input[%d]: %d, reference %d", (long long)n, L,
                     (long long)k, i, ids[i], ref[k].input[i]);
        for (int32_t i = 0; i < w[k].n_score; i++)
            ASSERT_EQ_INT(ref[k].cont[i], T[w[k].first_target + i]);
        /* the input position before each target is that target's predecessor (or the prefix) */
        for (int32_t i = 0; i < w[k].n_score; i++) {
            int64_t t = w[k].first_target + i;
            int32_t before = ids[w[k].n_input - w[k].n_score + i];
            ASSERT_EQ_INT(t == 0 ? P : T[t - 1], before);
        }
        ASSERT_EQ_INT(scored, w[k].first_target); /* disjoint and in order */
        scored += w[k].n_score;
        free(ref[k].input);
        free(ref[k].cont);
    }
    ASSERT_EQ_INT(n, scored); /* every token scored exactly once */
    free(ids);
    free(w);
    free(ref);
    free(T);
}

static void test_named_cases(void) {
    const int32_t L = 16;
    check_case(0, L);
    check_case(1, L);
    check_case(5, L);     /* n < L */
    check_case(L, L);     /* n == L */
    check_case(L + 1, L); /* one more: the second window has L inputs and scores 1 */
    check_case(3 * L + 5, L);
    check_case(4 * L, L);
    check_case(3, 1); /* L = 1: each token conditioned on its predecessor only */
    ASSERT_EQ_INT(1, mq_rolling_window_count(L, L));
    ASSERT_EQ_INT(2, mq_rolling_window_count(L + 1, L));
    ASSERT_EQ_INT(4, mq_rolling_window_count(3 * L + 5, L));
}

static void test_second_window_shape(void) {
    /* n = L + 1: the second window feeds T[0 : L] and scores only T[L]. */
    const int32_t L = 4;
    mq_window w[2];
    ASSERT_EQ_INT(2, mq_rolling_window_count(5, L));
    mq_rolling_windows(5, L, w);
    ASSERT_EQ_INT(1, w[0].has_prefix);
    ASSERT_EQ_INT(4, w[0].n_score);
    ASSERT_EQ_INT(0, w[1].in_start);
    ASSERT_EQ_INT(4, w[1].n_input);
    ASSERT_EQ_INT(1, w[1].n_score);
    ASSERT_EQ_INT(4, w[1].first_target);
}

static void test_many_sizes(void) {
    static const int32_t Ls[] = {1, 2, 3, 7, 32};
    for (size_t i = 0; i < sizeof Ls / sizeof Ls[0]; i++)
        for (int64_t n = 0; n <= 5 * Ls[i] + 3; n++) check_case(n, Ls[i]);
}

TEST_MAIN(T(test_named_cases), T(test_second_window_shape), T(test_many_sizes))
