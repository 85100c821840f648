/*
 * What the libFuzzer targets share: a scratch folder of their own for the readers that take a
 * path (removed at exit), the input cut into the files of one model folder, and the contract every
 * reader keeps on any input: MOEQ_OK, or an error status whose message names the file. A target
 * abort()s where the contract breaks, so libFuzzer reports it as a crash; ASan and UBSan report
 * the rest. The same sources build without libFuzzer into replay_<target> (replay.c), which runs
 * the regression files under tests/fuzz/regressions/ in ctest.
 */
#ifndef MOEQ_FUZZ_COMMON_H
#define MOEQ_FUZZ_COMMON_H

#include <dirent.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moeq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char fuzz_dir_path[512];

/* The scratch folder holds files only (the targets write no folders). */
static inline void fuzz_cleanup(void) {
    if (!fuzz_dir_path[0]) return;
    DIR *d = opendir(fuzz_dir_path);
    for (struct dirent *e; d && (e = readdir(d));) {
        char path[800];
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
            snprintf(path, sizeof path, "%s/%s", fuzz_dir_path, e->d_name) < (int)sizeof path)
            unlink(path);
    }
    if (d) closedir(d);
    rmdir(fuzz_dir_path);
}

/* The scratch folder, made on first use under $TMPDIR (default /tmp). */
static inline const char *fuzz_dir(void) {
    if (fuzz_dir_path[0]) return fuzz_dir_path;
    const char *t = getenv("TMPDIR");
    snprintf(fuzz_dir_path, sizeof fuzz_dir_path, "%s/moeq-fuzz-XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(fuzz_dir_path)) {
        perror(fuzz_dir_path);
        abort();
    }
    atexit(fuzz_cleanup);
    return fuzz_dir_path;
}

/* Writes n bytes as the scratch folder's file `name` (replacing it); returns its path (static
 * storage, one per name slot: slot 0..3). */
static inline const char *fuzz_file(int slot, const char *name, const void *data, size_t n) {
    static char paths[4][600];
    snprintf(paths[slot], sizeof paths[slot], "%s/%s", fuzz_dir(), name);
    FILE *f = fopen(paths[slot], "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        perror(paths[slot]);
        abort();
    }
    return paths[slot];
}

static inline void fuzz_unlink(const char *name) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", fuzz_dir(), name);
    unlink(path);
}

/* The input's parts, cut at each line FUZZ_SEP: up to `max` parts; absent parts are empty. */
#define FUZZ_SEP "\n--moeq-fuzz-next-file--\n"
static inline int fuzz_split(const uint8_t *data, size_t size, int max, const uint8_t **part, size_t *len) {
    const size_t sl = strlen(FUZZ_SEP);
    int n = 0;
    for (int i = 0; i < max; i++) part[i] = data + size, len[i] = 0;
    while (n < max) {
        const uint8_t *at = NULL;
        if (n < max - 1 && size >= sl)
            for (size_t i = 0; i + sl <= size && !at; i++)
                if (data[i] == '\n' && !memcmp(data + i, FUZZ_SEP, sl)) at = data + i;
        part[n] = data;
        len[n] = at ? (size_t)(at - data) : size;
        n++;
        if (!at) break;
        size -= (size_t)(at - data) + sl;
        data = at + sl;
    }
    return n;
}

/* The input cut as fuzz_split does into up to `max` parts, of which the first n_files (<= 4) are
 * files: part i written as names[i] (slot i) where present, removed where not (a part left out is
 * an absent file). Returns the number of parts; *path0: the path of names[0] (always written). */
static inline int fuzz_split_files(const uint8_t *data, size_t size, int max, const uint8_t **part,
                                   size_t *len, int n_files, const char *const *names, const char **path0) {
    const int n = fuzz_split(data, size, max, part, len);
    *path0 = NULL;
    for (int i = 0; i < n_files; i++) {
        const char *path = i < n ? fuzz_file(i, names[i], part[i], len[i]) : NULL;
        if (!path) fuzz_unlink(names[i]);
        if (i == 0) *path0 = path;
    }
    return n;
}

/* The contract on a failed call: a status a reader may give on bad input, and a message naming
 * `name` (a file's base name or path). */
static inline void fuzz_check_error(moeq_status s, const char *name, const char *what) {
    if (s == MOEQ_OK) return;
    const char *msg = moeq_last_error();
    const bool allowed = s == MOEQ_E_FORMAT || s == MOEQ_E_UNSUPPORTED || s == MOEQ_E_NOTFOUND ||
                         s == MOEQ_E_NOMEM || s == MOEQ_E_SHAPE || s == MOEQ_E_ARG || s == MOEQ_E_IO;
    if (!allowed || !msg || (name && !strstr(msg, name))) {
        fprintf(stderr, "%s: status %s, message '%s' (expected an input error naming '%s')\n", what,
                moeq_status_name(s), msg ? msg : "(none)", name ? name : "");
        abort();
    }
}

#endif
