/*
 * A libFuzzer target without libFuzzer: replay_<target> FILE|DIR... runs the target's
 * LLVMFuzzerTestOneInput on each file (a folder: each regular file in it, in name order), as the
 * fuzzer would, and says how many it ran. A broken contract aborts (the target's own checks), so
 * ctest fails on the regression file that brings a fixed crash back; built with -DMOEQ_SANITIZE=ON
 * ASan and UBSan check each run too. A missing argument path is an error, an empty folder is not.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return 1;
    }
    size_t cap = 1 << 16, n = 0;
    uint8_t *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap) {
            uint8_t *grown = realloc(buf, cap *= 2);
            if (!grown) free(buf);
            buf = grown;
        }
    }
    fclose(f);
    if (!buf) {
        fprintf(stderr, "%s: out of memory\n", path);
        return 1;
    }
    fprintf(stderr, "replay: %s (%zu bytes)\n", path, n);
    /* a copy of exactly n bytes, so that ASan sees a read past the input */
    uint8_t *exact = malloc(n ? n : 1);
    if (!exact) return 1;
    memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv) {
    int files = 0, bad = 0;
    for (int i = 1; i < argc; i++) {
        struct stat sb;
        if (stat(argv[i], &sb) != 0) {
            perror(argv[i]);
            bad++;
            continue;
        }
        if (!S_ISDIR(sb.st_mode)) {
            bad += run_file(argv[i]);
            files++;
            continue;
        }
        DIR *d = opendir(argv[i]);
        char **names = NULL;
        size_t n = 0;
        for (struct dirent *e; d && (e = readdir(d));) {
            if (e->d_name[0] == '.') continue;
            char **grown = realloc(names, (n + 1) * sizeof *names);
            if (!grown) break;
            names = grown;
            names[n] = malloc(strlen(argv[i]) + strlen(e->d_name) + 2);
            if (!names[n]) break;
            sprintf(names[n], "%s/%s", argv[i], e->d_name);
            n++;
        }
        if (d) closedir(d);
        if (n > 1) qsort(names, n, sizeof *names, cmp_names);
        for (size_t k = 0; k < n; k++) {
            struct stat fs;
            if (stat(names[k], &fs) == 0 && S_ISREG(fs.st_mode)) {
                bad += run_file(names[k]);
                files++;
            }
            free(names[k]);
        }
        free(names);
    }
    printf("replayed %d file(s)%s\n", files, bad ? ", some could not be read" : "");
    return bad ? 1 : 0;
}
