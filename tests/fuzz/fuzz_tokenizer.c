/*
 * libFuzzer target for tokenizer.json (io/tokenizer.c) with the tokenizer_config.json and
 * config.json beside it (special ids): the input is up to four parts cut at FUZZ_SEP lines
 * (fuzz_common.h): tokenizer.json, tokenizer_config.json, config.json, and a text to encode.
 * Loading gives MOEQ_OK or an input error naming tokenizer.json (or the side file at fault); a
 * loaded tokenizer encodes the text and a fixed one into ids inside its vocabulary, decodes them,
 * and hands out its merges and tokens. Seeds: tests/fuzz/corpus.py.
 */
#include "fuzz_common.h"
#include "io/tokenizer.h"

static const char k_text[] = "The tower is 324 metres tall, \xc3\xa9t\xc3\xa9 caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 "
                             "<|endoftext|>  \n\n\t it's 1,000,000! \xf0\x9f\x98\x80";

static void encode_decode(const moeq_tokenizer *t, const char *text, size_t len) {
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
    } else if (s != MOEQ_E_FORMAT && s != MOEQ_E_NOMEM && s != MOEQ_E_UNSUPPORTED) {
        abort();   /* invalid UTF-8 is the text's error; nothing else may fail */
    }
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[4];
    size_t len[4];
    int n = fuzz_split(data, size, 4, part, len);
    const char *path = fuzz_file(0, "tokenizer.json", part[0], len[0]);
    if (n > 1) fuzz_file(1, "tokenizer_config.json", part[1], len[1]);
    else fuzz_unlink("tokenizer_config.json");
    if (n > 2) fuzz_file(2, "config.json", part[2], len[2]);
    else fuzz_unlink("config.json");
    moeq_tokenizer *t = NULL;
    moeq_status s = moeq_tokenizer_load(path, &t);
    if (s != MOEQ_OK) {
        fuzz_check_error(s, ".json", "tokenizer.json");
        return 0;
    }
    encode_decode(t, k_text, sizeof k_text - 1);
    if (n > 3) encode_decode(t, (const char *)part[3], len[3]);
    const int32_t V = moeq_tokenizer_vocab_size(t);
    for (int32_t id = 0; id < V && id < 4096; id++) {
        size_t bl;
        (void)moeq_tokenizer_token(t, id);
        (void)mq_tokenizer_token_bytes(t, id, &bl);
    }
    int32_t *pairs = NULL;
    size_t np = 0;
    if (mq_tokenizer_merges(t, &pairs, &np) == MOEQ_OK)
        for (size_t i = 0; i < 2 * np; i++)
            if (pairs[i] < 0 || pairs[i] >= V) abort();
    free(pairs);
    const int32_t bos = moeq_tokenizer_bos(t), eos = moeq_tokenizer_eos(t);
    if (bos >= V || eos >= V || bos < -1 || eos < -1) abort();
    moeq_tokenizer_free(t);
    return 0;
}
