/*
 * libFuzzer target for tokenizer.json (io/tokenizer.c) with the tokenizer_config.json and
 * config.json beside it (special ids): the input is up to four parts cut at FUZZ_SEP lines
 * (fuzz_common.h): tokenizer.json, tokenizer_config.json, config.json, and a text to encode.
 * Loading gives MOEQ_OK or an input error naming tokenizer.json (or the side file at fault); a
 * loaded tokenizer encodes the text and a fixed one into ids inside its vocabulary, decodes them,
 * and hands out its merges and tokens. Seeds: tests/fuzz/corpus.py.
 */
#include "fuzz_tokenizer_common.h"

static const char k_text[] = "The tower is 324 metres tall, \xc3\xa9t\xc3\xa9 caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 "
                             "<|endoftext|>  \n\n\t it's 1,000,000! \xf0\x9f\x98\x80";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[4];
    size_t len[4];
    static const char *const files[] = {"tokenizer.json", "tokenizer_config.json", "config.json"};
    const char *path;
    const int n = fuzz_split_files(data, size, 4, part, len, 3, files, &path);
    moeq_tokenizer *t = NULL;
    moeq_status s = moeq_tokenizer_load(path, &t);
    if (s != MOEQ_OK) {
        fuzz_check_error(s, ".json", "tokenizer.json");
        return 0;
    }
    fuzz_tok_encode_decode(t, k_text, sizeof k_text - 1, true);
    if (n > 3) fuzz_tok_encode_decode(t, (const char *)part[3], len[3], true);
    const int32_t V = moeq_tokenizer_vocab_size(t);
    for (int32_t id = 0; id < V && id < 4096; id++) {
        size_t bl;
        (void)moeq_tokenizer_token(t, id);
        (void)mq_tokenizer_token_bytes(t, id, &bl);
    }
    fuzz_tok_check_tables(t);
    moeq_tokenizer_free(t);
    return 0;
}
