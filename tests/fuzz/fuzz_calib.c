/*
 * libFuzzer target for the calibration file (quant/calib.c): text, JSONL ({"text": ...} or chat
 * "messages") and either gzip-compressed, and the evaluation's documents (eval/docs.c, the same
 * kind of outside text). The first input byte chooses: bits 0-1 the file (0: calib.txt, 1:
 * calib.jsonl, 2: calib.jsonl.gz compressed here, so the records behind the gzip layer are
 * fuzzed, 3: the bytes as calib.jsonl.gz, the gzip layer itself); bits 2-3 --calib-field (none,
 * text, messages, content); bit 4 tokenizes the documents into samples with the bundled
 * olmoe-tiny tokenizer (bit 5: one document a sample); bits 6-7 also reads the rest as eval
 * documents (wikitext, JSONL, whole). Each call gives MOEQ_OK or an input error naming the
 * file; samples hold ids of the vocabulary, none longer than seqlen. Seeds: tests/fuzz/corpus.py.
 */
#include <zlib.h>

#include "fuzz_common.h"
#include "quant/calib.h"

#ifndef MOEQ_SOURCE_DIR
#define MOEQ_SOURCE_DIR "."
#endif

static moeq_tokenizer *g_tok;

static const moeq_tokenizer *tokenizer(void) {
    if (!g_tok) {
        const char *p = getenv("MOEQ_FUZZ_TOKENIZER");
        if (moeq_tokenizer_load(p && *p ? p : MOEQ_SOURCE_DIR "/models/olmoe-tiny/tokenizer.json", &g_tok)) {
            fprintf(stderr, "fuzz_calib: %s\n", moeq_last_error());
            abort();
        }
    }
    return g_tok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const unsigned mode = data[0];
    data++, size--;
    static const char *const names[4] = {"calib.txt", "calib.jsonl", "calib.jsonl.gz", "calib.jsonl.gz"};
    static const char *const fields[4] = {NULL, "text", "messages", "content"};
    const char *name = names[mode & 3], *field = fields[(mode >> 2) & 3];
    const char *path;
    if ((mode & 3) == 2) {
        path = fuzz_file(0, name, "", 0);
        gzFile g = gzopen(path, "wb");
        if (!g || (size && gzwrite(g, data, (unsigned)size) != (int)size) || gzclose(g) != Z_OK) abort();
    } else {
        path = fuzz_file(0, name, data, size);
    }
    char *text = NULL;
    size_t len = 0;
    moeq_status s = mq_calib_read_all(path, field, &text, &len);
    fuzz_check_error(s, name, "mq_calib_read_all");
    if (!s && (!text || strlen(text) > len)) abort();
    free(text);
    if (mode & 16) {
        mq_calib_opts o;
        mq_calib_opts_init(&o);
        o.path = path;
        o.field = field;
        o.nsamples = 4;
        o.seqlen = 16;
        o.mode = mode & 32 ? MQ_CALIB_DOCS : MQ_CALIB_CHUNKS;
        o.bos = (mode & 3) == 1;
        mq_calib_set cs;
        s = mq_calib_load(tokenizer(), &o, &cs);
        fuzz_check_error(s, name, "mq_calib_load");
        if (!s) {
            const int32_t V = moeq_tokenizer_vocab_size(tokenizer());
            if (cs.n < 1 || cs.n > o.nsamples) abort();
            for (int64_t i = 0; i < cs.n; i++) {
                if (cs.len[i] < 1 || cs.len[i] > o.seqlen) abort();
                for (int64_t t = 0; t < cs.len[i]; t++)
                    if (cs.ids[i][t] < 0 || cs.ids[i][t] >= V) abort();
            }
            mq_calib_free(&cs);
        }
    }
    if (mode >> 6) {
        static const moeq_docs_layout lay[4] = {MOEQ_DOCS_WIKITEXT, MOEQ_DOCS_WIKITEXT, MOEQ_DOCS_JSONL,
                                                MOEQ_DOCS_WHOLE};
        moeq_docs *d = NULL;
        s = moeq_docs_parse("eval-data", (const char *)data, size, lay[mode >> 6], &d);
        fuzz_check_error(s, "eval-data", "moeq_docs_parse");
        if (!s) {
            for (int64_t i = 0; i < moeq_docs_count(d); i++) {
                size_t dl = 0;
                const char *t = moeq_docs_text(d, i, &dl);
                if (!t && dl) abort();
            }
            moeq_docs_free(d);
        }
    }
    return 0;
}
