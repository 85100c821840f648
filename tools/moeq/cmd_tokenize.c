/*
 * moeq tokenize MODEL_DIR (--text T | --file F) [--json]: encodes text with the model's
 * tokenizer.json (only the tokenizer is loaded, never the weights). With --json stdout is exactly
 * one JSON array of ids; otherwise one line per token: id, vocabulary string, decoded bytes.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"

/* The whole of path into *out (malloc'd, NUL-terminated); false after printing why not. */
static bool read_all(const char *path, char **out, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {   /* the library's wording for the same failure */
        fprintf(stderr, "moeq tokenize: error: %s: cannot open: %s\n", path, strerror(errno));
        return false;
    }
    char *b = NULL;
    size_t n = 0, cap = 0;
    bool full = false;   /* out of memory */
    for (;;) {
        if (n + 65536 + 1 > cap) {
            char *g = realloc(b, cap = 2 * cap + 65536 + 1);
            if (!g) {
                full = true;
                break;
            }
            b = g;
        }
        size_t got = fread(b + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    const bool ok = !ferror(f) && !full;
    fclose(f);
    if (!ok) {
        free(b);
        fprintf(stderr, "moeq tokenize: error: %s: %s\n", path, full ? "out of memory" : "read error");
        return false;
    }
    b[n] = 0;
    *out = b;
    *len = n;
    return true;
}

/* MODEL_DIR/tokenizer.json, or the argument itself when it names a file. */
/* Prints bytes quoted, escaping control bytes and bytes that are not whole UTF-8 characters
 * (a token may hold part of a character). */
static void print_quoted(FILE *f, const char *b, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n;) {
        uint8_t c = (uint8_t)b[i];
        size_t k = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : 2;
        if (c >= 0x80 && k <= n - i && moeq_utf8_valid_prefix(b + i, k) == k) {
            fwrite(b + i, 1, k, f);
            i += k;
            continue;
        }
        switch (c) {
        case '\n': fputs("\\n", f); break;
        case '\t': fputs("\\t", f); break;
        case '\r': fputs("\\r", f); break;
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        default:
            if (c < 0x20 || c >= 0x7f)
                fprintf(f, "\\x%02x", c);
            else
                fputc(c, f);
        }
        i++;
    }
    fputc('"', f);
}

int cmd_tokenize(int argc, char **argv) {
    const char *text = NULL, *file = NULL, *revision = NULL;
    bool json = false;
    const cli_opt opts[] = {
        CLI_REVISION_OPT(revision),
        {"--text", OPT_STRING, &text, "T", "the text to encode", NULL, 0, 0, NULL},
        {"--file", OPT_STRING, &file, "F", "encode this UTF-8 file instead", NULL, 0, 0, NULL},
        {"--json", OPT_FLAG, &json, NULL, "print exactly one JSON array of ids on stdout", NULL, 0, 0,
         NULL},
    };
    const cli_command cmd = {
        "tokenize", "MODEL_DIR (--text T | --file F) [--json]",
        "Encodes text with MODEL_DIR's tokenizer.json or tiktoken.model (MODEL_DIR may also be that\n"
        "file) as Hugging Face tokenizers does with add_special_tokens=False (tiktoken: as tiktoken\n"
        "does): special tokens written in the text are matched, none are added.",
        opts, (int)(sizeof opts / sizeof opts[0]), 1, 1, "MODEL_DIR"};
    const char *pos[1];
    int n_pos, rc = cli_parse(&cmd, argc, argv, pos, &n_pos);
    if (rc >= 0) return rc;
    if (!text == !file) return cli_usage_error("tokenize", "give exactly one of --text and --file");

    const char *dir = cli_model_dir("tokenize", pos[0], revision);
    if (!dir) return CLI_FAIL;
    moeq_tokenizer *tok = NULL;
    char *buf = NULL;
    int32_t *ids = NULL;
    size_t len = text ? strlen(text) : 0, n = 0;
    moeq_status st = moeq_tokenizer_load(dir, &tok);
    if (st == MOEQ_OK && file && !read_all(file, &buf, &len)) {
        moeq_tokenizer_free(tok);
        return CLI_FAIL;
    }
    if (st == MOEQ_OK) st = moeq_tokenizer_encode(tok, file ? buf : text, len, &ids, &n);
    if (st != MOEQ_OK && file && buf) {   /* the encoder's message ("at byte offset N") names the file */
        fprintf(stderr, "moeq tokenize: error: %s: %s\n", file, moeq_last_error());
        free(buf);
        moeq_tokenizer_free(tok);
        return st == MOEQ_E_INTERRUPTED ? CLI_INTERRUPTED : CLI_FAIL;
    }
    if (st == MOEQ_OK) {
        if (json) {
            putchar('[');
            for (size_t i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
            puts("]");
        } else {
            printf("%8s  %-24s %s\n", "id", "token", "bytes");
            for (size_t i = 0; i < n; i++) {
                size_t blen = 0;
                const char *bytes = moeq_tokenizer_token_bytes(tok, ids[i], &blen);
                const char *name = moeq_tokenizer_token(tok, ids[i]);
                printf("%8d  ", ids[i]);
                print_quoted(stdout, name, strlen(name));
                int width = 0;   /* characters, not bytes */
                for (const char *c = name; *c; c++) width += ((uint8_t)*c & 0xc0) != 0x80;
                int pad = 22 - width;
                printf("%*s ", pad > 0 ? pad : 0, "");
                print_quoted(stdout, bytes, blen);
                putchar('\n');
            }
            fprintf(stderr, "%zu tokens from %zu bytes\n", n, len);
        }
    }
    free(ids);
    free(buf);
    moeq_tokenizer_free(tok);
    return st == MOEQ_OK ? CLI_OK : cli_fail("tokenize", st);
}
