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
 * T[in_start : in_start + n_input]. The scored targets are
 * T[first_target : first_target + n_score]. */
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

/* ---- per-row scoring math (score.c) ------------------------------------------------------ */
/* log(sum(exp(l))) of a logits row: max subtraction, expf terms summed in double. *argmax (may
 * be NULL) gets the first index of the largest logit. Not finite if the row holds a NaN/inf. */
double mq_logsumexp(const float *l, int64_t V, int32_t *argmax);
/* KL(p_b || p_m) in nats between the softmaxes of two logits rows with their log-sum-exps.
 * Exactly 0 for identical rows. */
double mq_kl_rows(const float *lb, double lse_b, const float *lm, double lse_m, int64_t V);
/* Entropy -sum p log p in nats of the softmax of a logits row with its log-sum-exp: log V minus
 * the row's KL to the uniform distribution (the KL kernel against zeros: V zero floats). */
double mq_entropy_row(const float *l, double lse, const float *zeros, int64_t V);
/* The k largest logits of a row, in decreasing order (ties: smaller id first). */
void mq_topk(const float *l, int64_t V, int32_t k, uint32_t *ids, float *vals);
/* KL from a base distribution known only by its top-k logits (ids, vals, decreasing) and its
 * log-sum-exp: the KL between the two distributions coarsened to the k tokens plus one "rest"
 * bucket, sum_topk p (log p - log q) + p_rest (log p_rest - log q_rest). It never exceeds the
 * true KL (data-processing inequality); the gap is p_rest * KL(p | rest || q | rest), and *bound
 * (may be NULL) gets an upper bound of it that needs no more base information:
 * p_rest * (log(p_k / p_rest) - log min_rest(q / q_rest)), p_k the k-th base probability.
 * mark is scratch of V bytes, all zero on entry and on return. */
double mq_kl_topk(const uint32_t *ids, const float *vals, int32_t k, double lse_b, const float *lm,
                  double lse_m, int64_t V, uint8_t *mark, double *bound);
/* numpy.percentile(v, q) with linear interpolation (sorts v in place); NaN when n == 0. */
double mq_percentile(double *v, int64_t n, double q);

/* ---- saved top-k logits (logits_file.c) -------------------------------------------------- */
/* File layout, little-endian: a 64-byte header
 *   0 magic "MQTOPKLG" | 8 u32 version (1) | 12 u32 vocab | 16 u32 k | 20 u32 max_length
 *  24 u32 flags (bit 0: --add-bos) | 28 i32 prefix token | 32 u64 tokens | 40 u64 documents
 *  48 u64 FNV-1a-64 checksum of the token ids | 56 u64 FNV-1a-64 of bytes 0..55
 * then one record per scored token, documents and tokens in order:
 *   f64 log-sum-exp of the full row | u32 ids[k] | f32 logits[k] (decreasing; fp32 logits are
 *   stored exactly). */
#define MQ_LOGITS_MAGIC "MQTOPKLG"
#define MQ_LOGITS_VERSION 1u
#define MQ_LOGITS_HEADER 64
typedef struct {
    uint32_t vocab, k, max_length, flags;
    int32_t prefix;
    uint64_t tokens, documents, ids_checksum;
} mq_logits_header;

static inline size_t mq_logits_record_size(uint32_t k) { return 8 + 8 * (size_t)k; }
void mq_logits_header_encode(const mq_logits_header *h, uint8_t out[MQ_LOGITS_HEADER]);
/* Checks magic, version, header checksum, k and the file size; errors name path. */
moeq_status mq_logits_header_decode(const char *path, const uint8_t *data, size_t size,
                                    mq_logits_header *h);
void mq_logits_record_encode(uint8_t *out, double lse, const uint32_t *ids, const float *vals,
                             uint32_t k);
void mq_logits_record_decode(const uint8_t *in, uint32_t k, double *lse, uint32_t *ids,
                             float *vals);
/* FNV-1a 64 over bytes, continuing from h (start with MQ_FNV_INIT). */
#define MQ_FNV_INIT 0xcbf29ce484222325ull
uint64_t mq_fnv1a(uint64_t h, const void *data, size_t n);

#endif
