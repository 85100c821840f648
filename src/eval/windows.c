/*
 * Rolling log-likelihood windows as lm-evaluation-harness builds them for loglikelihood_rolling
 * (lm_eval/utils.py get_rolling_token_windows + make_disjoint_window, with context_len = 1, and
 * the HF model's (context + continuation)[-(L+1):][:-1] input):
 *   first window: input [prefix] + T[0 : k-1], scores T[0 : k], k = min(L, n);
 *   then, while pos < n: m = min(n - pos, L), end = pos + m,
 *        input T[end-L-1 : end-1] (L tokens), scores its last m targets T[pos : end].
 * Every token is scored exactly once; each chunk after the first sees L - m + 1 tokens of context.
 */
#include "eval/eval.h"

int64_t mq_rolling_window_count(int64_t n, int32_t L) {
    if (n <= 0 || L <= 0) return 0;
    int64_t first = n < L ? n : L;
    return 1 + (n - first + L - 1) / L;
}

void mq_rolling_windows(int64_t n, int32_t L, mq_window *out) {
    if (n <= 0 || L <= 0) return;
    int64_t k = n < L ? n : L;
    out[0] = (mq_window){.in_start = 0,
                         .first_target = 0,
                         .n_input = (int32_t)k,
                         .n_score = (int32_t)k,
                         .has_prefix = 1};
    int64_t pos = k, w = 1;
    while (pos < n) {
        int64_t m = n - pos < L ? n - pos : L, end = pos + m;
        out[w++] = (mq_window){.in_start = end - L - 1,
                               .first_target = pos,
                               .n_input = L,
                               .n_score = (int32_t)m,
                               .has_prefix = 0};
        pos = end;
    }
}

void mq_window_input(const mq_window *w, const int32_t *T, int32_t prefix, int32_t *ids) {
    if (w->has_prefix) {
        ids[0] = prefix;
        for (int32_t i = 1; i < w->n_input; i++) ids[i] = T[w->in_start + i - 1];
    } else {
        for (int32_t i = 0; i < w->n_input; i++) ids[i] = T[w->in_start + i];
    }
}
