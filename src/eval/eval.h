/*
 * Evaluation internals: text handling for lm-evaluation-harness's wikitext task (documents,
 * detokenizer, Python-compatible whitespace and word counts, UTF-8 checks) and the rolling
 * log-likelihood windows. The public entry points are the moeq_docs_* / moeq_eval_* functions in
 * moeq.h.
 */
#ifndef MOEQ_EVAL_H
#define MOEQ_EVAL_H

#include "core/core.h"

/* ---- text ------------------------------------------------------------------------------- */
/* Python's str.isspace() (= re's \s for str patterns): \t\n\v\f\r, U+001C..U+001F, space, U+0085,
 * U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000. */
bool mq_py_isspace(uint32_t cp);
/* Byte length of the whitespace character that starts at s[0] (n bytes available), 0 when s[0]
 * does not start one. Malformed UTF-8 is never whitespace. */
size_t mq_utf8_space_len(const char *s, size_t n);
/* Strict UTF-8 check (no overlong forms, no surrogates, nothing above U+10FFFF). On failure
 * returns false and sets *bad_offset to the offset of the first byte of the bad sequence. */
bool mq_utf8_valid(const char *s, size_t n, size_t *bad_offset);

/* ---- rolling windows (lm-eval get_rolling_token_windows + make_disjoint_window, context 1) -- */
/* A window feeds n_input tokens to the model and scores the targets predicted by its last n_score
 * positions. With has_prefix the input is [prefix] + T[0 : n_input-1] (the first window), else
 * T[in_start : in_start + n_input]. The scored targets are T[first_target : first_target+n_score]. */
typedef struct {
    int64_t in_start;
    int64_t first_target;
    int32_t n_input;
    int32_t n_score;
    int32_t has_prefix;
} mq_window;

/* Number of windows for a document of n tokens with max_length L (0 when n == 0). */
int64_t mq_rolling_window_count(int64_t n, int32_t L);
/* Fills out[0 .. mq_rolling_window_count(n, L)) in order. */
void mq_rolling_windows(int64_t n, int32_t L, mq_window *out);
/* ids[0 .. w->n_input) = the window's model input. */
void mq_window_input(const mq_window *w, const int32_t *T, int32_t prefix, int32_t *ids);

#endif
