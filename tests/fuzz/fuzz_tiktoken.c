/*
 * libFuzzer target for Kimi's tiktoken.model with its tokenizer_config.json (io/tokenizer.c):
 * the input is up to three parts cut at FUZZ_SEP lines (fuzz_common.h): tiktoken.model,
 * tokenizer_config.json, a text to encode. Loading gives MOEQ_OK or an input error naming one of
 * the two files; a loaded tokenizer encodes into ids inside its vocabulary and decodes them.
 * Seeds: tests/fuzz/corpus.py (from tests/data/kimi-tiny-tokenizer).
 */
#include "fuzz_tokenizer_common.h"

static const char k_text[] = "[BOS]The tower is 324 metres tall. \xe4\xb8\xad\xe6\x96\x87\xe3\x80\x82 it's "
                             "<|reserved_token_5|>\r\n\n  x";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[3];
    size_t len[3];
    static const char *const files[] = {"tiktoken.model", "tokenizer_config.json"};
    const char *path;
    const int n = fuzz_split_files(data, size, 3, part, len, 2, files, &path);
    moeq_tokenizer *t = NULL;
    moeq_status s = moeq_tokenizer_load(path, &t);
    if (s != MOEQ_OK) {
        const char *msg = moeq_last_error();
        fuzz_check_error(s, NULL, "tiktoken.model");
        if (!strstr(msg, "tiktoken.model") && !strstr(msg, "tokenizer_config.json")) {
            fprintf(stderr, "the error names neither file: %s\n", msg);
            abort();
        }
        return 0;
    }
    fuzz_tok_encode_decode(t, k_text, sizeof k_text - 1, false);
    if (n > 2) fuzz_tok_encode_decode(t, (const char *)part[2], len[2], false);
    fuzz_tok_check_tables(t);
    moeq_tokenizer_free(t);
    return 0;
}
