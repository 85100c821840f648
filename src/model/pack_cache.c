/*
 * The packed-layout cache of a .gguf opened with keep_packed (issue 56): the blobs that
 * load_gguf.c repacks (the MoE layers' experts, the Q4_0 / NVFP4 Linears), in load order, in one
 * file that the next open maps instead of repacking.
 *
 * Where: "<file>.moeqpack" beside the .gguf when one is there or its folder is writable, else
 * $XDG_CACHE_HOME/moeq (default ~/.cache/moeq) as "<basename>-<hash of the absolute path>.moeqpack";
 * moeq_set_pack_cache_dir names another folder, or turns the cache off.
 *
 * Key: the source's size and modification time (ns), and a hash of its first MiB (the GGUF header:
 * KVs, tensor names, shapes, types and offsets, for most models all of it) plus 64 samples of
 * 4 KiB spread over the file and its last 4 KiB. Size and time catch a replaced or rewritten file;
 * the header hash catches another model copied over with its time kept (cp -p); the samples catch
 * a tensor edited in place. Hashing every byte would cost what the cache saves (seconds for 4 GB).
 *
 * Trust: nothing in the file is believed before it is checked. The header (magic, format version,
 * key, sizes, entry table) carries its own hash, and the data is hashed in chunks of 8 MiB whose
 * hashes the header lists; all chunks are checked on the pool when the cache opens (the reading
 * warms the pages the first tokens would touch anyway). A truncated file, any flipped byte, an
 * entry table that does not match the layout planned now (another moeq, other options), or a
 * changed source: the cache is ignored and written again (under a temporary name, then renamed).
 *
 * The hash: four 64-bit lanes, word w into lane l as h = (h ^ w) * K, h ^= h >> 31 (an odd
 * multiplier and a right xorshift are bijections of the state), the lanes folded by further
 * bijections: a change of one word always changes the result, so a flipped byte is always
 * detected; the four lanes let the CPU run four chains at once.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/model_internal.h"

#define PC_MAGIC "MOEQPK01"
#define PC_VERSION 1u
#define PC_CHUNK ((size_t)8 << 20)
#define PC_ALIGN ((size_t)2 << 20)   /* blobs start on 2 MiB (huge page) boundaries */

/* ---- hash ---------------------------------------------------------------------------------- */
static uint64_t rotl(uint64_t x, int r) { return x << r | x >> (64 - r); }

static uint64_t hash_bytes(const void *p, size_t n, uint64_t seed) {
    const uint64_t K = 0x9E3779B97F4A7C15ull;
    uint64_t h[4] = {seed ^ 1, seed ^ 2, seed ^ 3, seed ^ 4};
    const uint8_t *b = p;
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int l = 0; l < 4; l++) {
            uint64_t w;
            memcpy(&w, b + i + 8 * l, 8);
            h[l] = (h[l] ^ w) * K;
            h[l] ^= h[l] >> 31;   /* x ^ (x >> 31): a bijection */
        }
    uint64_t t = n;
    for (; i < n; i++) t = (t ^ b[i]) * K;
    uint64_t r = t;
    for (int l = 0; l < 4; l++) r = rotl(r ^ h[l], 27) * K;
    return r ^ (r >> 33);
}

/* ---- the file ------------------------------------------------------------------------------ */
typedef struct {
    char magic[8];
    uint32_t version, n_entries;
    uint64_t src_size, src_mtime_ns, src_hash;
    uint64_t data_off, data_bytes, n_chunks;
    uint64_t head_hash;   /* of this header (head_hash 0), the entries and the chunk hashes */
} pc_header;

typedef struct {
    uint64_t off, bytes;  /* from data_off */
} pc_entry;

struct mq_pack_cache {
    char *path;           /* the cache file */
    pc_header key;        /* the source's key (src_* fields) */
    /* a valid cache, mapped */
    uint8_t *map;
    size_t map_bytes;
    const pc_entry *entries;
    uint64_t data_off;
    uint32_t n_entries, next;
    /* the blobs of this open, in order (to write the cache when it was not used whole) */
    const uint8_t **blob;
    size_t *bytes;
    uint32_t n, cap;
    bool dirty;           /* something was packed here: write the cache */
    mq_pack_cache_state state;
};

static char g_dir[4096];
static int g_mode;   /* 0 default, 1 a folder (g_dir), 2 off */

moeq_status moeq_set_pack_cache_dir(const char *dir) {
    if (!dir) {
        g_mode = 0;
    } else if (!dir[0]) {
        g_mode = 2;
    } else {
        if (strlen(dir) >= sizeof g_dir)
            return mq_err(MOEQ_E_ARG, "moeq_set_pack_cache_dir: '%s' is too long", dir);
        snprintf(g_dir, sizeof g_dir, "%s", dir);
        g_mode = 1;
    }
    return MOEQ_OK;
}

static bool mkdirs(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return false;
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) return false;
            *p = '/';
        }
    return mkdir(buf, 0755) == 0 || errno == EEXIST;
}

/* The cache's path for src (malloc'd), or NULL when off or nowhere to put it. */
static char *cache_path(const char *src) {
    if (g_mode == 2) return NULL;
    char *beside = mq_asprintf("%s.moeqpack", src);
    if (!beside) return NULL;
    if (g_mode == 0) {
        char *dir = mq_strdup(src), *slash = dir ? strrchr(dir, '/') : NULL;
        if (slash) *slash = '\0';
        bool ok = dir && (mq_file_exists(beside) || access(slash ? dir : ".", W_OK) == 0);
        free(dir);
        if (ok) return beside;
    }
    free(beside);
    char abs[4096], folder[4096];
    if (!realpath(src, abs)) snprintf(abs, sizeof abs, "%s", src);
    if (g_mode == 1) {
        snprintf(folder, sizeof folder, "%s", g_dir);
    } else {
        const char *x = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
        if (x && x[0] == '/') snprintf(folder, sizeof folder, "%s/moeq", x);
        else if (home && home[0]) snprintf(folder, sizeof folder, "%s/.cache/moeq", home);
        else return NULL;
    }
    if (!mkdirs(folder)) return NULL;
    const char *base = strrchr(abs, '/');
    return mq_asprintf("%s/%s-%016llx.moeqpack", folder, base ? base + 1 : abs,
                       (unsigned long long)hash_bytes(abs, strlen(abs), 7));
}

/* The source's key: size, mtime, hash of its head and samples. */
static moeq_status source_key(const char *src, pc_header *k) {
    int fd = open(src, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mq_err(MOEQ_E_IO, "%s: %s", src, strerror(errno));
    struct stat st;
    moeq_status s = MOEQ_OK;
    uint8_t *buf = malloc((size_t)1 << 20);
    if (fstat(fd, &st) != 0 || !buf) {
        s = buf ? mq_err(MOEQ_E_IO, "%s: %s", src, strerror(errno)) : MOEQ_E_NOMEM;
        goto done;
    }
    k->src_size = (uint64_t)st.st_size;
    k->src_mtime_ns = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
    uint64_t h = 0;
    ssize_t n = pread(fd, buf, (size_t)1 << 20, 0);
    if (n < 0) {
        s = mq_err(MOEQ_E_IO, "%s: %s", src, strerror(errno));
        goto done;
    }
    h = hash_bytes(buf, (size_t)n, h);
    for (int i = 0; i <= 64; i++) {
        uint64_t off = i == 64 ? (k->src_size > 4096 ? k->src_size - 4096 : 0)
                               : k->src_size / 64 * (uint64_t)i;
        n = pread(fd, buf, 4096, (off_t)off);
        if (n < 0) {
            s = mq_err(MOEQ_E_IO, "%s: %s", src, strerror(errno));
            goto done;
        }
        h = hash_bytes(buf, (size_t)n, h);
    }
    k->src_hash = h;
done:
    free(buf);
    close(fd);
    return s;
}

typedef struct {
    const uint8_t *data;
    size_t bytes;
    const uint64_t *want;
    int32_t *bad;
} chunk_job;

static void chunk_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    chunk_job *j = ctx;
    size_t off = (size_t)i * PC_CHUNK, n = j->bytes - off < PC_CHUNK ? j->bytes - off : PC_CHUNK;
    if (hash_bytes(j->data + off, n, (uint64_t)i) != j->want[i]) *j->bad = 1;
}

/* Maps c->path and checks everything; false (and nothing mapped) when anything is off. */
static bool try_map(mq_pack_cache *c) {
    int fd = open(c->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    struct stat st;
    pc_header h;
    bool ok = fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof h &&
              pread(fd, &h, sizeof h, 0) == (ssize_t)sizeof h;
    ok = ok && h.data_bytes <= (uint64_t)st.st_size && h.data_off <= (uint64_t)st.st_size &&
         !memcmp(h.magic, PC_MAGIC, 8) && h.version == PC_VERSION &&
         h.src_size == c->key.src_size && h.src_mtime_ns == c->key.src_mtime_ns &&
         h.src_hash == c->key.src_hash && h.n_entries < (1u << 24) &&
         h.n_chunks == (h.data_bytes + PC_CHUNK - 1) / PC_CHUNK &&
         h.data_off >= sizeof h + h.n_entries * sizeof(pc_entry) + h.n_chunks * 8 &&
         h.data_off % PC_ALIGN == 0 && h.data_off + h.data_bytes == (uint64_t)st.st_size;
    uint8_t *map = NULL;
    if (ok) {
        map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        ok = map != MAP_FAILED;
        if (!ok) map = NULL;
    }
    close(fd);
    if (!ok) return false;
    const size_t meta = sizeof h + h.n_entries * sizeof(pc_entry) + h.n_chunks * 8;
    pc_header z = h;
    z.head_hash = 0;
    uint64_t hh = hash_bytes(&z, sizeof z, 1);
    hh = hash_bytes(map + sizeof h, meta - sizeof h, hh);
    const pc_entry *e = (const pc_entry *)(const void *)(map + sizeof h);
    ok = hh == h.head_hash;
    for (uint32_t i = 0; ok && i < h.n_entries; i++)
        ok = e[i].off <= h.data_bytes && e[i].bytes <= h.data_bytes - e[i].off;
    if (ok) {
        int32_t bad = 0;
        chunk_job j = {map + h.data_off, h.data_bytes,
                       (const uint64_t *)(const void *)(e + h.n_entries), &bad};
        mq_parallel_for((int64_t)h.n_chunks, chunk_task, &j);
        ok = !bad;
    }
    if (!ok) {
        munmap(map, (size_t)st.st_size);
        return false;
    }
    c->map = map;
    c->map_bytes = (size_t)st.st_size;
    c->entries = e;
    c->n_entries = h.n_entries;
    c->data_off = h.data_off;
    return true;
}

moeq_status mq_pack_cache_open(const char *src, mq_pack_cache **out) {
    *out = NULL;
    char *path = cache_path(src);
    if (!path) return MOEQ_OK;   /* no cache */
    mq_pack_cache *c = calloc(1, sizeof *c);
    if (!c) {
        free(path);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    c->path = path;
    moeq_status s = source_key(src, &c->key);
    if (s) {
        mq_pack_cache_close(c);
        return s;
    }
    bool present = mq_file_exists(path);
    c->state = try_map(c) ? MQ_PACK_CACHE_MAPPED : present ? MQ_PACK_CACHE_REBUILT
                                                           : MQ_PACK_CACHE_BUILT;
    if (c->state == MQ_PACK_CACHE_REBUILT)
        mq_info("%s: stale or damaged, it is made again", path);
    *out = c;
    return MOEQ_OK;
}

mq_pack_cache_state mq_pack_cache_state_of(const mq_pack_cache *c) {
    return c ? c->state : MQ_PACK_CACHE_NONE;
}

const char *mq_pack_cache_path(const mq_pack_cache *c) { return c ? c->path : NULL; }

const uint8_t *mq_pack_cache_peek(const mq_pack_cache *c, size_t *bytes) {
    if (!c || !c->map || c->next >= c->n_entries) return NULL;
    *bytes = (size_t)c->entries[c->next].bytes;
    return c->map + c->data_off + c->entries[c->next].off;
}

void mq_pack_cache_taken(mq_pack_cache *c, bool ok) {
    if (!c || !c->map) return;
    if (ok) {
        c->next++;
        return;
    }
    /* the layout planned now differs from the file's: use none of the rest, write it again */
    c->next = c->n_entries;
    c->dirty = true;
    if (c->state == MQ_PACK_CACHE_MAPPED) c->state = MQ_PACK_CACHE_REBUILT;
}

moeq_status mq_pack_cache_add(mq_pack_cache *c, const uint8_t *blob, size_t bytes, bool packed_here) {
    if (!c) return MOEQ_OK;
    if (c->n == c->cap) {
        uint32_t cap = c->cap ? 2 * c->cap : 64;
        const uint8_t **b = realloc(c->blob, cap * sizeof *b);
        if (b) c->blob = b;
        size_t *n = realloc(c->bytes, cap * sizeof *n);
        if (n) c->bytes = n;
        if (!b || !n) return mq_err(MOEQ_E_NOMEM, "out of memory");
        c->cap = cap;
    }
    c->blob[c->n] = blob;
    c->bytes[c->n++] = bytes;
    if (packed_here) c->dirty = true;
    return MOEQ_OK;
}

bool mq_pack_cache_owns(const mq_pack_cache *c, const void *p) {
    return c && c->map && (const uint8_t *)p >= c->map && (const uint8_t *)p < c->map + c->map_bytes;
}

static moeq_status write_at(int fd, const void *p, size_t n, uint64_t off, const char *path) {
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = pwrite(fd, b, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n, (off_t)off);
        if (w <= 0) return mq_err(MOEQ_E_IO, "%s: %s", path, strerror(errno));
        b += w, n -= (size_t)w, off += (uint64_t)w;
    }
    return MOEQ_OK;
}

/* The chunk hashes of the data written: the blobs laid out as the entries say, zeros between. */
typedef struct {
    const mq_pack_cache *c;
    const pc_entry *e;
    uint64_t data_bytes;
    uint64_t *out;
    int32_t *oom;
} hash_job;

static void hash_task(void *ctx, int64_t i, int thread) {
    (void)thread;
    hash_job *j = ctx;
    const uint64_t off = (uint64_t)i * PC_CHUNK;
    const size_t n = j->data_bytes - off < PC_CHUNK ? (size_t)(j->data_bytes - off) : PC_CHUNK;
    uint8_t *buf = calloc(1, n);
    if (!buf) {
        *j->oom = 1;
        return;
    }
    for (uint32_t k = 0; k < j->c->n; k++) {   /* the parts of blobs inside [off, off + n) */
        uint64_t a = j->e[k].off, b = a + j->e[k].bytes;
        uint64_t lo = a > off ? a : off, hi = b < off + n ? b : off + n;
        if (lo < hi) memcpy(buf + (lo - off), j->c->blob[k] + (lo - a), (size_t)(hi - lo));
    }
    j->out[i] = hash_bytes(buf, n, (uint64_t)i);
    free(buf);
}

moeq_status mq_pack_cache_commit(mq_pack_cache *c) {
    if (!c || !c->dirty || c->n == 0) return MOEQ_OK;
    pc_header h = c->key;
    memcpy(h.magic, PC_MAGIC, 8);
    h.version = PC_VERSION;
    h.n_entries = c->n;
    pc_entry *e = calloc(c->n, sizeof *e);
    if (!e) return mq_err(MOEQ_E_NOMEM, "out of memory");
    uint64_t off = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        e[i].off = off;
        e[i].bytes = c->bytes[i];
        off = (off + c->bytes[i] + PC_ALIGN - 1) / PC_ALIGN * PC_ALIGN;
    }
    h.data_bytes = c->n ? e[c->n - 1].off + e[c->n - 1].bytes : 0;
    h.n_chunks = (h.data_bytes + PC_CHUNK - 1) / PC_CHUNK;
    const size_t meta = sizeof h + c->n * sizeof *e + h.n_chunks * 8;
    h.data_off = (meta + PC_ALIGN - 1) / PC_ALIGN * PC_ALIGN;
    uint64_t *ch = calloc(h.n_chunks ? h.n_chunks : 1, 8);
    int32_t oom = 0;
    moeq_status s = ch ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s) {
        hash_job j = {c, e, h.data_bytes, ch, &oom};
        mq_parallel_for((int64_t)h.n_chunks, hash_task, &j);
        if (oom) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    h.head_hash = 0;
    uint64_t hh = hash_bytes(&h, sizeof h, 1);
    uint8_t *metab = s ? NULL : malloc(meta - sizeof h);
    if (!s && !metab) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s) {
        memcpy(metab, e, c->n * sizeof *e);
        memcpy(metab + c->n * sizeof *e, ch, h.n_chunks * 8);
        h.head_hash = hash_bytes(metab, meta - sizeof h, hh);
    }
    char *tmp = s ? NULL : mq_asprintf("%s.tmp.%d", c->path, (int)getpid());
    int fd = tmp ? open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
    if (!s && fd < 0) s = mq_err(MOEQ_E_IO, "%s: %s", tmp ? tmp : c->path, strerror(errno));
    if (!s) s = write_at(fd, &h, sizeof h, 0, tmp);
    if (!s) s = write_at(fd, metab, meta - sizeof h, sizeof h, tmp);
    for (uint32_t i = 0; i < c->n && !s; i++)
        s = write_at(fd, c->blob[i], c->bytes[i], h.data_off + e[i].off, tmp);
    if (!s && ftruncate(fd, (off_t)(h.data_off + h.data_bytes)) != 0)
        s = mq_err(MOEQ_E_IO, "%s: %s", tmp, strerror(errno));
    if (fd >= 0 && close(fd) != 0 && !s) s = mq_err(MOEQ_E_IO, "%s: %s", tmp, strerror(errno));
    if (!s && rename(tmp, c->path) != 0) s = mq_err(MOEQ_E_IO, "%s: %s", c->path, strerror(errno));
    if (s && tmp) unlink(tmp);
    free(tmp);
    free(metab);
    free(ch);
    free(e);
    return s;
}

void mq_pack_cache_close(mq_pack_cache *c) {
    if (!c) return;
    if (c->map) munmap(c->map, c->map_bytes);
    free(c->blob);
    free(c->bytes);
    free(c->path);
    free(c);
}
