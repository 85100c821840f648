/*
 * Calibration data for GPTQ: a text file (one string) or JSONL (one {"text": ...} object per
 * line), tokenized with the model's tokenizer (no special tokens unless bos is set), cut into
 * samples:
 *   MQ_CALIB_CHUNKS  the first nsamples consecutive seqlen-token chunks of the whole text (the
 *                    protocol of ../shared/docs/gptq_reference_study.md);
 *   MQ_CALIB_RANDOM  nsamples windows of seqlen tokens at random offsets (seed);
 *   MQ_CALIB_DOCS    one document per sample (a JSONL record, or a non-empty line of a text
 *                    file), truncated to seqlen; the first nsamples documents.
 */
#ifndef MOEQ_CALIB_H
#define MOEQ_CALIB_H

#include "core/core.h"

typedef enum { MQ_CALIB_CHUNKS = 0, MQ_CALIB_RANDOM, MQ_CALIB_DOCS } mq_calib_mode;

typedef struct {
    const char *path;
    int64_t nsamples;    /* default 128 */
    int64_t seqlen;      /* default 512 */
    mq_calib_mode mode;
    uint64_t seed;       /* MQ_CALIB_RANDOM */
    bool bos;            /* prepend the tokenizer's BOS to every sample (counted in seqlen) */
    const char *field;   /* JSONL: the record field (NULL: "text", else "messages") */
    bool pool;           /* candidates to choose from (--calib-balance): a text with fewer
                            samples than nsamples is no warning */
} mq_calib_opts;

void mq_calib_opts_init(mq_calib_opts *o);

typedef struct {
    int64_t n;           /* samples */
    int32_t **ids;       /* [n] token ids of each sample */
    int64_t *len;        /* [n] tokens of each sample (1 .. seqlen) */
    int64_t max_len;
    int64_t total;       /* tokens over all samples */
} mq_calib_set;

/* The calibration file: plain text, or JSONL whose records give one document each (a string
 * field, or a "messages" list joined as "role: content" lines); either gzip-compressed
 * (.gz / the gzip magic). */
/* Every document of the file joined by blank lines (the W4A4 activation calibration). */
moeq_status mq_calib_read_all(const char *path, const char *field, char **text, size_t *len);
/* Fewer tokens (or documents) than asked for gives fewer samples with a warning; none at all is
 * MOEQ_E_FORMAT naming the file. A bad JSONL line is MOEQ_E_FORMAT naming file and line. */
moeq_status mq_calib_load(const moeq_tokenizer *tok, const mq_calib_opts *o, mq_calib_set *out);
/* Cuts samples from an already tokenized stream (MQ_CALIB_CHUNKS or MQ_CALIB_RANDOM). */
moeq_status mq_calib_from_ids(const int32_t *ids, int64_t n_ids, const mq_calib_opts *o,
                              mq_calib_set *out);
/* Every token of ids in consecutive samples of chunk tokens, the last one shorter (the W4A4
 * activation-scale calibration). */
moeq_status mq_calib_cover(const int32_t *ids, int64_t n_ids, int64_t chunk, mq_calib_set *out);
/* Keeps the samples keep[0..n) (increasing indices), in that order; frees the others. */
moeq_status mq_calib_keep(mq_calib_set *s, const int64_t *keep, int64_t n);
void mq_calib_free(mq_calib_set *s);

#endif
