/*
 * What the tokenizer fuzz targets (fuzz_tokenizer.c: tokenizer.json; fuzz_tiktoken.c:
 * tiktoken.model) check of a tokenizer that loaded: every id encode hands out lies in the
 * vocabulary and decodes, merge pairs and special ids lie in it too.
 */
#ifndef MOEQ_FUZZ_TOKENIZER_COMMON_H
#define MOEQ_FUZZ_TOKENIZER_COMMON_H

#include "fuzz_common.h"
#include "io/tokenizer.h"

/* Encodes text and decodes the ids; an encode error other than MOEQ_E_FORMAT, MOEQ_E_NOMEM and,
 * when unsupported_ok, MOEQ_E_UNSUPPORTED aborts (invalid UTF-8 is the text's error; nothing else
 * may fail). */
static inline void fuzz_tok_encode_decode(const moeq_tokenizer *t, const char *text, size_t len,
                                          bool unsupported_ok) {
    int32_t *ids = NULL;
    size_t n = 0;
    moeq_status s = moeq_tokenizer_encode(t, text, len, &ids, &n);
    if (s == MOEQ_OK) {
        const int32_t V = moeq_tokenizer_vocab_size(t);
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= V) abort();
        char *back = NULL;
        size_t blen = 0;
        if (moeq_tokenizer_decode(t, ids, n, &back, &blen) != MOEQ_OK) abort();
        free(back);
    } else if (s != MOEQ_E_FORMAT && s != MOEQ_E_NOMEM &&
               !(unsupported_ok && s == MOEQ_E_UNSUPPORTED)) {
        abort();
    }
    free(ids);
}

/* The merge pairs and the BOS / EOS ids lie in the vocabulary (-1: none). */
static inline void fuzz_tok_check_tables(const moeq_tokenizer *t) {
    const int32_t V = moeq_tokenizer_vocab_size(t);
    int32_t *pairs = NULL;
    size_t np = 0;
    if (mq_tokenizer_merges(t, &pairs, &np) == MOEQ_OK)
        for (size_t i = 0; i < 2 * np; i++)
            if (pairs[i] < 0 || pairs[i] >= V) abort();
    free(pairs);
    const int32_t bos = moeq_tokenizer_bos(t), eos = moeq_tokenizer_eos(t);
    if (bos >= V || eos >= V || bos < -1 || eos < -1) abort();
}

#endif
