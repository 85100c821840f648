/* File helpers: read-only mappings, whole-file reads, and atomic (temp + rename) output. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "core.h"

moeq_status mq_map_file(const char *path, mq_map *out) {
    memset(out, 0, sizeof *out);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mq_err(MOEQ_E_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return mq_err(MOEQ_E_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return mq_err(MOEQ_E_IO, "%s: not a regular file", path);
    }
    out->size = (size_t)st.st_size;
    if (out->size == 0) {
        close(fd);
        out->data = calloc(1, 1);
        return out->data ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    void *p = mmap(NULL, out->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) return mq_err(MOEQ_E_IO, "%s: cannot map: %s", path, strerror(e));
    out->data = p;
    out->is_mmap = 1;
    return MOEQ_OK;
}

void mq_prefetch(const void *p, size_t n) {
    if (!p || n == 0) return;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t e = (uintptr_t)p + n;
    /* in pieces: the kernel reads at most a readahead window's worth per call */
    const uintptr_t piece = (uintptr_t)2 << 20;
    for (uintptr_t a = (uintptr_t)p & ~(page - 1); a < e; a += piece)
        (void)madvise((void *)a, (size_t)(e - a < piece ? e - a : piece), MADV_WILLNEED);
}

void mq_unmap(mq_map *m) {
    if (!m || !m->data) return;
    if (m->is_mmap)
        munmap(m->data, m->size);
    else
        free(m->data);
    memset(m, 0, sizeof *m);
}

/* mq_read_file_watch: the watched file's identity (device, inode; both 0: none) and the count of
 * whole reads of it. */
static _Atomic unsigned long long g_watch_dev, g_watch_ino;
static atomic_llong g_watch_reads;

void mq_read_file_watch(const char *path) {
    struct stat sb;
    const bool ok = path && stat(path, &sb) == 0;
    atomic_store(&g_watch_dev, ok ? (unsigned long long)sb.st_dev : 0);
    atomic_store(&g_watch_ino, ok ? (unsigned long long)sb.st_ino : 0);
}

int64_t mq_read_file_watched(void) { return (int64_t)atomic_load(&g_watch_reads); }

static void count_watched(FILE *f) {
    struct stat sb;
    const unsigned long long ino = atomic_load(&g_watch_ino);
    if (ino && fstat(fileno(f), &sb) == 0 && (unsigned long long)sb.st_ino == ino &&
        (unsigned long long)sb.st_dev == atomic_load(&g_watch_dev))
        atomic_fetch_add(&g_watch_reads, 1);
}

moeq_status mq_read_file(const char *path, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return mq_err(MOEQ_E_IO, "%s: cannot open: %s", path, strerror(errno));
    count_watched(f);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return mq_err(MOEQ_E_NOMEM, "%s: out of memory", path);
    }
    for (;;) {
        if (n + 1 >= cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                fclose(f);
                return mq_err(MOEQ_E_NOMEM, "%s: out of memory", path);
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - 1 - n, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return mq_err(MOEQ_E_IO, "%s: read error", path);
    }
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return MOEQ_OK;
}

bool mq_file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

bool mq_dir_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

char *mq_path_join(const char *dir, const char *name) {
    size_t n = strlen(dir);
    if (n > 0 && dir[n - 1] == '/') return mq_asprintf("%s%s", dir, name);
    return mq_asprintf("%s/%s", dir, name);
}

moeq_status mq_atomic_open(mq_atomic_file *af, const char *path) {
    memset(af, 0, sizeof *af);
    af->path = mq_strdup(path);
    af->tmp_path = mq_asprintf("%s.tmp.%ld", path, (long)getpid());
    if (!af->path || !af->tmp_path) {
        mq_atomic_abort(af);
        return MOEQ_E_NOMEM;
    }
    af->f = fopen(af->tmp_path, "wb");
    if (!af->f) {
        moeq_status st = mq_err(MOEQ_E_IO, "%s: cannot create: %s", af->path, strerror(errno));
        mq_atomic_abort(af);
        return st;
    }
    return MOEQ_OK;
}

moeq_status mq_atomic_write(mq_atomic_file *af, const void *data, size_t n) {
    if (n && fwrite(data, 1, n, af->f) != n)
        return mq_err(MOEQ_E_IO, "%s: write failed: %s", af->tmp_path, strerror(errno));
    return MOEQ_OK;
}

moeq_status mq_atomic_pwrite(mq_atomic_file *af, const void *data, size_t n, int64_t off) {
    const int fd = fileno(af->f);
    for (size_t done = 0; done < n;) {
        ssize_t w = pwrite(fd, (const char *)data + done, n - done, (off_t)(off + (int64_t)done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return mq_err(MOEQ_E_IO, "%s: write failed: %s", af->tmp_path, w < 0 ? strerror(errno) : "no progress");
        done += (size_t)w;
    }
    return MOEQ_OK;
}

moeq_status mq_atomic_commit(mq_atomic_file *af) { return mq_atomic_commit_ex(af, true); }

moeq_status mq_atomic_commit_ex(mq_atomic_file *af, bool durable) {
    moeq_status st = MOEQ_OK;
    if (fflush(af->f) != 0 || (durable && fsync(fileno(af->f)) != 0))
        st = mq_err(MOEQ_E_IO, "%s: write failed: %s", af->tmp_path, strerror(errno));
    if (fclose(af->f) != 0 && st == MOEQ_OK)
        st = mq_err(MOEQ_E_IO, "%s: close failed: %s", af->tmp_path, strerror(errno));
    af->f = NULL;
    if (st == MOEQ_OK && rename(af->tmp_path, af->path) != 0)
        st = mq_err(MOEQ_E_IO, "%s: cannot rename into place: %s", af->path, strerror(errno));
    if (st != MOEQ_OK) {
        mq_atomic_abort(af);
        return st;
    }
    free(af->path);
    free(af->tmp_path);
    memset(af, 0, sizeof *af);
    return MOEQ_OK;
}

void mq_atomic_abort(mq_atomic_file *af) {
    if (af->f) fclose(af->f);
    if (af->tmp_path) unlink(af->tmp_path);
    free(af->path);
    free(af->tmp_path);
    memset(af, 0, sizeof *af);
}

moeq_status mq_write_file_atomic(const char *path, const void *data, size_t n) {
    mq_atomic_file af;
    moeq_status st = mq_atomic_open(&af, path);
    if (st) return st;
    if ((st = mq_atomic_write(&af, data, n)) != MOEQ_OK) {
        mq_atomic_abort(&af);
        return st;
    }
    return mq_atomic_commit(&af);
}

void mq_remove_tree(const char *path) {
    DIR *d = opendir(path);
    if (!d) {
        unlink(path);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char *p = mq_path_join(path, e->d_name);
        if (!p) continue;
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode))
            mq_remove_tree(p);
        else
            unlink(p);
        free(p);
    }
    closedir(d);
    rmdir(path);
}

static moeq_status pwrite_all(int fd, const void *buf, size_t n, int64_t off, const char *path) {
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = pwrite(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            return mq_err(MOEQ_E_IO, "%s: write failed at offset %lld: %s", path, (long long)off,
                          k < 0 ? strerror(errno) : "no progress");
        p += k;
        n -= (size_t)k;
        off += k;
    }
    return MOEQ_OK;
}

/* Wall nanoseconds spent in pwrite, summed over threads (MOEQ_DEBUG_PROFILE's write split). */
static atomic_uint_fast64_t g_write_ns;

uint64_t mq_pwrite_ns(void) { return atomic_load(&g_write_ns); }

moeq_status mq_pwrite_all(int fd, const void *buf, size_t n, int64_t off, const char *path) {
    const double t0 = mq_now();
    moeq_status st = pwrite_all(fd, buf, n, off, path);
    atomic_fetch_add(&g_write_ns, (uint_fast64_t)((mq_now() - t0) * 1e9));
    return st;
}

moeq_status mq_pread_all(int fd, void *buf, size_t n, int64_t off, const char *path) {
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = pread(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
            return mq_err(MOEQ_E_IO, "%s: read failed at offset %lld: %s", path, (long long)off,
                          strerror(errno));
        if (k == 0)
            return mq_err(MOEQ_E_FORMAT, "%s: truncated (ends before offset %lld)", path,
                          (long long)(off + (int64_t)n));
        p += k;
        n -= (size_t)k;
        off += k;
    }
    return MOEQ_OK;
}

moeq_status mq_fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return mq_err(MOEQ_E_IO, "%s: cannot open the directory: %s", dir, strerror(errno));
    int r = fsync(fd);
    int e = errno;
    close(fd);
    /* some file systems refuse fsync on directories; the rename is then as durable as it gets */
    if (r != 0 && e != EINVAL && e != EBADF)
        return mq_err(MOEQ_E_IO, "%s: fsync failed: %s", dir, strerror(e));
    return MOEQ_OK;
}

uint32_t mq_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return (uint32_t)crc32_combine(crc_a, crc_b, (z_off_t)len_b);
}

uint32_t mq_crc32(uint32_t crc, const void *data, size_t n) {
    const Bytef *p = data;
    uLong c = crc;
    while (n > 0) {   /* zlib takes uInt lengths */
        uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, p, k);
        p += k;
        n -= k;
    }
    return (uint32_t)c;
}
