/*
 * moeq bench tokenizer MODEL_DIR [--file F] [--min-time S] [--json]: single-thread encoding and
 * decoding speed of MODEL_DIR/tokenizer.json on a text file (default: the shared wikitext-2 test
 * split). Each repetition is one encode call on the whole file (its word cache starts empty); the
 * best repetition is reported, with the mean beside it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "cli.h"
#include "core/core.h"
#include "io/tokenizer.h"

int bench_tokenizer(int argc, char **argv) {
    const char *file = NULL;
    double min_time = 2.0;
    bool json = false;
    const cli_opt opts[] = {
        {"--file", OPT_STRING, &file, "F",
         "UTF-8 text to encode (default: <shared>/fixtures/text/wikitext2_test.txt)", NULL, 0, 0, NULL},
        {"--min-time", OPT_DOUBLE, &min_time, "S", "repeat for at least S seconds (default 2)", NULL,
         0, 0, NULL},
        {"--json", OPT_FLAG, &json, NULL, "print one JSON object on stdout", NULL, 0, 0, NULL},
    };
    const cli_command cmd = {
        "bench tokenizer", "MODEL_DIR [--file F] [--min-time S] [--json]",
        "Measures single-thread tokenizer speed: encode MB/s and tokens/s, decode MB/s.",
        opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!(min_time >= 0 && min_time <= 3600))
        return cli_usage_error("bench tokenizer", "--min-time must be between 0 and 3600");

    char *default_file = NULL;
    if (!file) {
        const char *shared = cli_shared_dir();
        if (!shared)
            return cli_usage_error("bench tokenizer", "no --file given and the shared fixtures folder "
                                   "was not found (set MOEQ_SHARED)");
        file = default_file = mq_path_join(shared, "fixtures/text/wikitext2_test.txt");
    }
    char *path = mq_tokenizer_find(pos[0]);   /* tokenizer.json, else tiktoken.model */
    moeq_tokenizer *tok = NULL;
    char *text = NULL, *back = NULL;
    int32_t *ids = NULL;
    size_t len = 0, n = 0, back_len = 0;
    int reps = 0;
    double load_s = 0, enc_best = 1e30, enc_sum = 0, dec_best = 1e30;

    double t0 = mq_now();
    moeq_status st = path ? moeq_tokenizer_load(path, &tok)
                          : mq_err(MOEQ_E_NOTFOUND, "%s: no tokenizer.json or tiktoken.model", pos[0]);
    load_s = mq_now() - t0;
    if (st == MOEQ_OK) st = mq_read_file(file, &text, &len);
    /* At least three repetitions; then until min_time has passed. */
    double start = mq_now();
    while (st == MOEQ_OK && (reps < 3 || mq_now() - start < min_time)) {
        free(ids);
        ids = NULL;
        t0 = mq_now();
        st = moeq_tokenizer_encode(tok, text, len, &ids, &n);
        double dt = mq_now() - t0;
        if (st) break;
        enc_sum += dt;
        if (dt < enc_best) enc_best = dt;
        free(back);
        back = NULL;
        t0 = mq_now();
        st = moeq_tokenizer_decode(tok, ids, n, &back, &back_len);
        dt = mq_now() - t0;
        if (dt < dec_best) dec_best = dt;
        reps++;
    }
    if (st == MOEQ_OK && (back_len != len || memcmp(back, text, len) != 0))
        st = mq_err(MOEQ_E_NUMERIC, "%s: decode(encode(text)) differs from the text", file);
    if (st == MOEQ_OK) {
        double mb = (double)len / 1e6;
        if (json) {
            printf("{\"bench\":\"tokenizer\",\"tokenizer\":");
            cli_print_json_string(stdout, path);
            printf(",\"file\":");
            cli_print_json_string(stdout, file);
            printf(",\"bytes\":%zu,\"tokens\":%zu,\"threads\":1,\"reps\":%d,\"load_s\":%.6f,"
                   "\"encode_best_s\":%.6f,\"encode_mean_s\":%.6f,\"encode_mb_per_s\":%.3f,"
                   "\"encode_tokens_per_s\":%.1f,\"decode_mb_per_s\":%.3f}\n",
                   len, n, reps, load_s, enc_best, enc_sum / reps, mb / enc_best, (double)n / enc_best,
                   mb / dec_best);
        } else {
            printf("tokenizer  %s (loaded in %.3f s)\n", path, load_s);
            printf("text       %s: %zu bytes -> %zu tokens (%.3f bytes/token)\n", file, len, n,
                   (double)len / (double)(n ? n : 1));
            printf("encode     %.2f MB/s, %.0f tokens/s (best of %d; mean %.2f MB/s), 1 thread\n",
                   mb / enc_best, (double)n / enc_best, reps, mb * reps / enc_sum);
            printf("decode     %.2f MB/s\n", mb / dec_best);
        }
    }
    free(ids);
    free(back);
    free(text);
    free(path);
    free(default_file);
    moeq_tokenizer_free(tok);
    return st == MOEQ_OK ? CLI_OK : cli_fail("bench tokenizer", st);
}
