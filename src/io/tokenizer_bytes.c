/* The tokenizer's byte-level helpers in the public API (moeq.h), for `moeq tokenize`. */
#include "io/tokenizer.h"

const char *moeq_tokenizer_token_bytes(const moeq_tokenizer *tok, int32_t id, size_t *len) {
    return mq_tokenizer_token_bytes(tok, id, len);
}

size_t moeq_utf8_valid_prefix(const char *s, size_t n) { return mq_utf8_check(s, n); }
