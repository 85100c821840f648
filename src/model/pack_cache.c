/*
 * The packed-layout cache (issue 56): what a keep_packed open repacks (each MoE layer's experts,
 * moeq_moe_experts; each packed Linear, mq_packed_weight) from a .gguf (load_gguf.c) or a
 * quantized safetensors checkpoint (load.c), in load order, with their layouts, in one file that
 * the next open maps instead of reading and repacking the source.
 *
 * Where: "<file>.moeqpack" beside a .gguf ("<dir>.moeqpack" beside a checkpoint folder, never in
 * it) when one is there or the folder is writable, else $XDG_CACHE_HOME/moeq (~/.cache/moeq) as
 * "<name>-<hash of the absolute path>.moeqpack"; moeq_set_pack_cache_dir names another folder,
 * or turns the cache off.
 *
 * Key: of each source file (the .gguf; a folder's config.json and *.safetensors, by name) its
 * name, size and modification time (ns), and a hash of its first MiB (the GGUF or safetensors
 * header: tensor names, shapes, types and offsets, for most models all of it) plus 64 samples of
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
 * The hash: eight 64-bit lanes, word w into lane l as h = (h ^ w) * K, h ^= h >> 31 (an odd
 * multiplier and a right xorshift are bijections of the state), the lanes folded by further
 * bijections: a change of one word always changes the result, so a flipped byte is always
 * detected; the eight lanes let the CPU run eight chains at once. The file's pages are faulted in
 * by one call (MADV_POPULATE_READ): they are all read for the check anyway, and one call costs far
 * less than a fault per page.
 *
 * Pages: decode streams the blobs once a token, and a core streams memory mapped in 4 KiB pages
 * about a quarter slower than in 2 MiB ones (TLB misses; the hardware prefetcher stops at each
 * 4 KiB boundary: docs/results/runtime.md). The mapping is marked MADV_HUGEPAGE before it is
 * populated, so pages read from disk come in 2 MiB folios and map as huge pages; the pages the
 * writer leaves in the page cache are small, so the writer drops them once they are on disk, and
 * the next open reads the file back in huge folios. (Copying the file into anonymous huge pages
 * instead would cost every open the faults of that much fresh memory.)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/moe_ffn.h"
#include "model/model_internal.h"

#define PC_MAGIC "MOEQPK01"
#define PC_VERSION 3u
#define PC_ENDIAN 0x01020304u
#define PC_CHUNK ((size_t)8 << 20)
#define PC_ALIGN ((size_t)2 << 20)   /* blobs start on 2 MiB (huge page) boundaries */

/* ---- hash ---------------------------------------------------------------------------------- */
static uint64_t rotl(uint64_t x, int r) { return x << r | x >> (64 - r); }

static uint64_t hash_bytes(const void *p, size_t n, uint64_t seed) {
    const uint64_t K = 0x9E3779B97F4A7C15ull;
    uint64_t h[8];
    for (int l = 0; l < 8; l++) h[l] = seed ^ (uint64_t)(l + 1);
    const uint8_t *b = p;
    size_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int l = 0; l < 8; l++) {
            uint64_t w;
            memcpy(&w, b + i + 8 * l, 8);
            h[l] = (h[l] ^ w) * K;
            h[l] ^= h[l] >> 31;   /* x ^ (x >> 31): a bijection */
        }
    uint64_t t = n;
    for (; i < n; i++) t = (t ^ b[i]) * K;
    uint64_t r = t;
    for (int l = 0; l < 8; l++) r = rotl(r ^ h[l], 27) * K;
    return r ^ (r >> 33);
}

/* ---- the file ------------------------------------------------------------------------------ */
typedef struct {
    char magic[8];
    uint32_t version, endian;
    uint64_t src_size, src_mtime_ns, src_hash;   /* a folder: sums of its files' sizes, times */
    uint64_t n_entries, meta_bytes, data_off, data_bytes, n_chunks;
    uint64_t head_hash;   /* of this header (head_hash 0), the entries, the layouts and the chunk
                             hashes */
} pc_header;

enum { PC_EXPERTS = 1, PC_WEIGHT = 2 };

typedef struct {
    uint64_t kind, name_hash;
    uint64_t meta_off, meta_bytes;   /* its layout record, in the layouts area */
    uint64_t off, bytes;             /* its blob, from data_off */
} pc_entry;

/* A packed matrix's layout as stored (data: its offset in the blob). */
typedef struct {
    uint64_t data_off, rb_bytes;
    int32_t rows, cols, group, nvfp4, stype, neg_scales;
    float mul[2], div[2];
} pc_pmat;

struct mq_pack_cache {
    char *path;           /* the cache file */
    pc_header key;        /* the source's key (src_* fields) */
    /* a valid cache, mapped */
    uint8_t *map;
    size_t map_bytes;
    const pc_entry *entries;
    const uint8_t *layouts;
    uint64_t data_off, n_entries, next;
    /* what this open packed or mapped, in order (to write the cache when it was not used whole) */
    struct pc_item {
        int kind;
        uint64_t name_hash;
        const void *obj;   /* moeq_moe_experts / struct mq_packed_weight, borrowed */
    } *items;
    uint32_t n, cap;
    bool dirty;           /* something was packed here: write the cache */
    bool shun;            /* a stored layout failed its checks: take nothing more from the file */
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
    /* beside the source: "FILE.moeqpack", or "DIR.moeqpack" next to a checkpoint folder (never
     * inside it: a checkpoint's files stay the writer's) */
    char *src_c = mq_strdup(src);
    if (!src_c) return NULL;
    for (size_t l = strlen(src_c); l > 1 && src_c[l - 1] == '/'; l--) src_c[l - 1] = '\0';
    char *beside = mq_asprintf("%s.moeqpack", src_c);
    free(src_c);
    if (!beside) return NULL;
    if (g_mode == 0) {
        char *dir = mq_strdup(beside), *slash = dir ? strrchr(dir, '/') : NULL;
        if (slash) *slash = '\0';
        bool ok = dir && (mq_file_exists(beside) || access(slash ? (dir[0] ? dir : "/") : ".", W_OK) == 0);
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

/* One file's part of the key: name, size, mtime, hash of its first MiB and of samples. */
static moeq_status file_key(const char *path, const char *name, uint8_t *buf, pc_header *k) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mq_err(MOEQ_E_IO, "%s: %s", path, strerror(errno));
    struct stat st;
    moeq_status s = MOEQ_OK;
    if (fstat(fd, &st) != 0) {
        s = mq_err(MOEQ_E_IO, "%s: %s", path, strerror(errno));
        goto done;
    }
    const uint64_t size = (uint64_t)st.st_size;
    k->src_size += size;
    k->src_mtime_ns += (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
    uint64_t h = hash_bytes(name, strlen(name), k->src_hash ^ size);
    ssize_t n = pread(fd, buf, (size_t)1 << 20, 0);
    for (int i = 0; i <= 65 && n >= 0; i++) {
        h = hash_bytes(buf, (size_t)n, h);
        if (i == 65) break;
        const uint64_t off = i == 64 ? (size > 4096 ? size - 4096 : 0) : size / 64 * (uint64_t)i;
        n = pread(fd, buf, 4096, (off_t)off);
    }
    if (n < 0) s = mq_err(MOEQ_E_IO, "%s: %s", path, strerror(errno));
    k->src_hash = h;
done:
    close(fd);
    return s;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static bool key_file(const char *n) {
    size_t l = strlen(n);
    return !strcmp(n, "config.json") || (l > 12 && !strcmp(n + l - 12, ".safetensors"));
}

/* The source's key: its file, or its folder's config.json and *.safetensors in name order. */
static moeq_status source_key(const char *src, pc_header *k) {
    uint8_t *buf = malloc((size_t)1 << 20);
    if (!buf) return mq_err(MOEQ_E_NOMEM, "out of memory");
    k->src_size = k->src_mtime_ns = k->src_hash = 0;
    moeq_status s = MOEQ_OK;
    if (!mq_dir_exists(src)) {
        const char *base = strrchr(src, '/');
        s = file_key(src, base ? base + 1 : src, buf, k);
        free(buf);
        return s;
    }
    DIR *d = opendir(src);
    char **names = NULL;
    size_t n = 0, cap = 0;
    if (!d) s = mq_err(MOEQ_E_IO, "%s: %s", src, strerror(errno));
    for (struct dirent *e; !s && (e = readdir(d));) {
        if (!key_file(e->d_name)) continue;
        if (n == cap) {
            char **nn = realloc(names, (cap = cap ? 2 * cap : 16) * sizeof *nn);
            if (!nn) {
                s = mq_err(MOEQ_E_NOMEM, "out of memory");
                break;
            }
            names = nn;
        }
        if (!(names[n] = mq_strdup(e->d_name))) s = mq_err(MOEQ_E_NOMEM, "out of memory");
        else n++;
    }
    if (d) closedir(d);
    if (!s) qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n && !s; i++) {
        char *p = mq_path_join(src, names[i]);
        s = p ? file_key(p, names[i], buf, k) : mq_err(MOEQ_E_NOMEM, "out of memory");
        free(p);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    free(buf);
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
    const uint64_t fsz = ok ? (uint64_t)st.st_size : 0;
    ok = ok && !memcmp(h.magic, PC_MAGIC, 8) && h.version == PC_VERSION && h.endian == PC_ENDIAN &&
         h.src_size == c->key.src_size && h.src_mtime_ns == c->key.src_mtime_ns &&
         h.src_hash == c->key.src_hash && h.n_entries < (1u << 24) && h.meta_bytes < fsz &&
         h.data_bytes <= fsz && h.data_off <= fsz && h.data_off + h.data_bytes == fsz &&
         h.n_chunks == (h.data_bytes + PC_CHUNK - 1) / PC_CHUNK &&
         h.data_off >= sizeof h + h.n_entries * sizeof(pc_entry) + h.meta_bytes + h.n_chunks * 8 &&
         h.data_off % 4096 == 0;
    uint8_t *map = NULL;
    if (ok) {
#ifdef MADV_POPULATE_READ
        map = mmap(NULL, (size_t)fsz, PROT_READ, MAP_SHARED, fd, 0);
#else
        map = mmap(NULL, (size_t)fsz, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
#endif
        ok = map != MAP_FAILED;
        if (!ok) map = NULL;
    }
    close(fd);
    if (!ok) return false;
#ifdef MADV_HUGEPAGE
    /* before the pages are read in: a hint (the page cache may hold them in small folios) */
    madvise(map, (size_t)fsz, MADV_HUGEPAGE);
#endif
#ifdef MADV_POPULATE_READ
    madvise(map, (size_t)fsz, MADV_POPULATE_READ);   /* a failure only leaves faults for later */
#endif
    const size_t meta = sizeof h + h.n_entries * sizeof(pc_entry) + h.meta_bytes + h.n_chunks * 8;
    pc_header z = h;
    z.head_hash = 0;
    uint64_t hh = hash_bytes(&z, sizeof z, 1);
    hh = hash_bytes(map + sizeof h, meta - sizeof h, hh);
    const pc_entry *e = (const pc_entry *)(const void *)(map + sizeof h);
    ok = hh == h.head_hash;
    for (uint64_t i = 0; ok && i < h.n_entries; i++)
        ok = e[i].off <= h.data_bytes && e[i].bytes <= h.data_bytes - e[i].off &&
             e[i].meta_off <= h.meta_bytes && e[i].meta_bytes <= h.meta_bytes - e[i].meta_off;
    if (ok) {
        int32_t bad = 0;
        chunk_job j = {map + h.data_off, h.data_bytes,
                       (const uint64_t *)(const void *)(map + sizeof h +
                                                        h.n_entries * sizeof(pc_entry) + h.meta_bytes),
                       &bad};
        mq_parallel_for((int64_t)h.n_chunks, chunk_task, &j);
        ok = !bad;
    }
    if (!ok) {
        munmap(map, (size_t)fsz);
        return false;
    }
    c->map = map;
    c->map_bytes = (size_t)fsz;
    c->entries = e;
    c->layouts = map + sizeof h + h.n_entries * sizeof(pc_entry);
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

static uint64_t name_hash(const char *name) { return hash_bytes(name, strlen(name), 11); }

/* ---- layouts ------------------------------------------------------------------------------- */
static pc_pmat pmat_out(const mq_pmat *m, const uint8_t *blob) {
    return (pc_pmat){(uint64_t)(m->data - blob), m->rb_bytes, m->rows, m->cols, m->group,
                     m->nvfp4, m->stype, m->neg_scales, {m->mul[0], m->mul[1]},
                     {m->div[0], m->div[1]}};
}

/* A stored layout back, checked to lie inside its blob and to be one the kernels take. */
static bool pmat_in(const pc_pmat *p, const uint8_t *blob, uint64_t bytes, mq_pmat *m) {
    if (p->rows <= 0 || p->rows % 16 || p->cols <= 0 || p->group <= 0 || p->cols % p->group ||
        (p->nvfp4 != 0 && p->nvfp4 != 1) || p->stype < MQ_MOE_S_F32 || p->stype > MQ_MOE_S_E4M3 ||
        (p->nvfp4 ? p->group != 16 || p->stype != MQ_MOE_S_E4M3 : p->group % 32 != 0) ||
        p->rb_bytes != mq_moe_rb_bytes(p->cols, p->group, (mq_moe_stype)p->stype) ||
        p->data_off % 64 || p->data_off > bytes ||
        (uint64_t)(p->rows / MQ_MOE_RB) * p->rb_bytes > bytes - p->data_off)
        return false;
    *m = (mq_pmat){blob + p->data_off, (size_t)p->rb_bytes, p->rows, p->cols, p->group, p->nvfp4,
                   p->stype, {p->mul[0], p->mul[1]}, {p->div[0], p->div[1]}, p->neg_scales};
    return true;
}

/* The entry of `kind` for `name`: looked for from the one after the last taken (the load order
 * the file was written in), wrapping around; NULL when the cache has none (a Linear the kernels
 * refused when the cache was written, or another load). */
static const pc_entry *find_entry(mq_pack_cache *c, int kind, const char *name) {
    if (!c || !c->map || c->shun || c->n_entries == 0) return NULL;
    const uint64_t h = name_hash(name);
    for (uint64_t k = 0; k < c->n_entries; k++) {
        const uint64_t i = (c->next + k) % c->n_entries;
        if (c->entries[i].kind == (uint64_t)kind && c->entries[i].name_hash == h) {
            c->next = i;
            return &c->entries[i];
        }
    }
    return NULL;
}

/* A layout that fails its checks (only a hash collision gets one past them): the cache is not
 * used for the rest of this open, and written again. */
static void left(mq_pack_cache *c) {
    if (!c || !c->map) return;
    c->shun = true;   /* the blobs already taken stay mapped */
    c->dirty = true;
    if (c->state == MQ_PACK_CACHE_MAPPED) c->state = MQ_PACK_CACHE_REBUILT;
}

static moeq_status remember(mq_pack_cache *c, int kind, const char *name, const void *obj,
                            bool packed_here) {
    if (c->n == c->cap) {
        uint32_t cap = c->cap ? 2 * c->cap : 64;
        struct pc_item *it = realloc(c->items, cap * sizeof *it);
        if (!it) return mq_err(MOEQ_E_NOMEM, "out of memory");
        c->items = it;
        c->cap = cap;
    }
    c->items[c->n++] = (struct pc_item){kind, name_hash(name), obj};
    if (packed_here) c->dirty = true;
    return MOEQ_OK;
}

/* The end of a get: obj (read from the map, its checks ok) remembered and counted, true; else
 * obj dropped and the cache left, false. */
static bool taken(mq_pack_cache *c, bool ok, int kind, const char *name, void *obj, void (*drop)(void *)) {
    if (ok && !remember(c, kind, name, obj, false)) {
        c->next++;
        return true;
    }
    drop(obj);
    left(c);
    return false;
}

/* A got object freed, or NULL; its blob is the map's, not its own. */
static void drop_experts(void *obj) {
    moeq_moe_experts *w = obj;
    if (w) w->blob = NULL;
    moeq_moe_experts_free(w);
}

static void drop_weight(void *obj) {
    struct mq_packed_weight *w = obj;
    if (w) w->blob = NULL;
    mq_packed_weight_free(w);
}

typedef struct {
    int32_t scheme, group, E, D, F, Fs, n_mats, pad;
} pc_experts_head;

bool mq_pack_cache_get_experts(mq_pack_cache *c, const char *name, moeq_moe_experts **out) {
    *out = NULL;
    const pc_entry *e = find_entry(c, PC_EXPERTS, name);
    if (!e) return false;
    const uint8_t *rec = c->layouts + e->meta_off, *blob = c->map + c->data_off + e->off;
    pc_experts_head h;
    bool ok = e->meta_bytes >= sizeof h;
    if (ok) memcpy(&h, rec, sizeof h);
    ok = ok && h.n_mats > 0 && h.n_mats < (1 << 20) &&
         e->meta_bytes == sizeof h + (uint64_t)h.n_mats * (8 + 2 * sizeof(pc_pmat));
    moeq_moe_experts *w = ok ? mq_alloc_zero(sizeof *w, "moe experts") : NULL;
    if (w) w->ex = mq_alloc_zero(sizeof(mq_pexpert) * (size_t)h.n_mats, "moe experts");
    ok = w && w->ex;
    for (int32_t i = 0; ok && i < h.n_mats; i++) {
        const uint8_t *r = rec + sizeof h + (size_t)i * (8 + 2 * sizeof(pc_pmat));
        int64_t ffn;
        pc_pmat gu, dn;
        memcpy(&ffn, r, 8);
        memcpy(&gu, r + 8, sizeof gu);
        memcpy(&dn, r + 8 + sizeof gu, sizeof dn);
        w->ex[i].ffn = (int32_t)ffn;
        ok = pmat_in(&gu, blob, e->bytes, &w->ex[i].gate_up) &&
             pmat_in(&dn, blob, e->bytes, &w->ex[i].down) && gu.rows == 2 * ffn &&
             gu.cols == h.D && dn.rows == h.D && dn.cols == ffn;
    }
    if (ok) {
        w->scheme = (moeq_moe_scheme)h.scheme;
        w->group = h.group, w->E = h.E, w->D = h.D, w->F = h.F, w->Fs = h.Fs, w->n_mats = h.n_mats;
        w->blob = (uint8_t *)(uintptr_t)blob;   /* read only: the kernels only read */
        w->blob_bytes = (size_t)e->bytes;
    }
    if (!taken(c, ok, PC_EXPERTS, name, w, drop_experts)) return false;
    *out = w;
    return true;
}

bool mq_pack_cache_get_weight(mq_pack_cache *c, const char *name, struct mq_packed_weight **out) {
    *out = NULL;
    const pc_entry *e = find_entry(c, PC_WEIGHT, name);
    if (!e) return false;
    const uint8_t *rec = c->layouts + e->meta_off, *blob = c->map + c->data_off + e->off;
    int32_t oi[2];
    pc_pmat p;
    struct mq_packed_weight *w = NULL;
    uint64_t off_at = 0;   /* asymmetric blocks: where the offsets are (0: none) */
    bool ok = e->meta_bytes == sizeof oi + sizeof p || e->meta_bytes == sizeof oi + sizeof p + 8;
    if (ok) {
        memcpy(oi, rec, sizeof oi);
        memcpy(&p, rec + sizeof oi, sizeof p);
        if (e->meta_bytes > sizeof oi + sizeof p) memcpy(&off_at, rec + sizeof oi + sizeof p, 8);
        ok = (w = mq_alloc_zero(sizeof *w, "packed weight")) != NULL &&
             pmat_in(&p, blob, e->bytes, &w->W) && oi[0] > 0 && oi[0] <= p.rows && oi[1] == p.cols &&
             p.data_off == 0;
    }
    if (ok && e->meta_bytes > sizeof oi + sizeof p)   /* after the rows, within the blob */
        ok = !p.nvfp4 && p.cols % 32 == 0 && off_at % 64 == 0 &&
             off_at >= (uint64_t)(p.rows / MQ_MOE_RB) * p.rb_bytes && off_at <= e->bytes &&
             (uint64_t)oi[0] * (uint64_t)(p.cols / 32) * 4 <= e->bytes - off_at;
    if (ok) {
        w->out = oi[0], w->in = oi[1];
        if (e->meta_bytes > sizeof oi + sizeof p) {
            w->off_at = (size_t)off_at;
            w->off = (const float *)(const void *)(blob + off_at);
        }
        w->blob = (uint8_t *)(uintptr_t)blob;
        w->bytes = (size_t)e->bytes;
    }
    if (!taken(c, ok, PC_WEIGHT, name, w, drop_weight)) return false;
    *out = w;
    return true;
}

moeq_status mq_pack_cache_put_experts(mq_pack_cache *c, const char *name, const moeq_moe_experts *w) {
    return c ? remember(c, PC_EXPERTS, name, w, true) : MOEQ_OK;
}

moeq_status mq_pack_cache_put_weight(mq_pack_cache *c, const char *name,
                                     const struct mq_packed_weight *w) {
    return c ? remember(c, PC_WEIGHT, name, w, true) : MOEQ_OK;
}

bool mq_pack_cache_owns(const mq_pack_cache *c, const void *p) {
    return c && c->map && (const uint8_t *)p >= c->map && (const uint8_t *)p < c->map + c->map_bytes;
}

/* ---- writing ------------------------------------------------------------------------------- */
static const uint8_t *item_blob(const struct pc_item *it, size_t *bytes) {
    if (it->kind == PC_EXPERTS) {
        const moeq_moe_experts *w = it->obj;
        *bytes = w->blob_bytes;
        return w->blob;
    }
    const struct mq_packed_weight *w = it->obj;
    *bytes = w->bytes;
    return w->blob;
}

/* The item's layout record into rec (NULL: its size only). */
static size_t item_layout(const struct pc_item *it, uint8_t *rec) {
    if (it->kind == PC_WEIGHT) {
        const struct mq_packed_weight *w = it->obj;
        int32_t oi[2] = {w->out, w->in};
        pc_pmat p = pmat_out(&w->W, w->blob);
        const uint64_t off_at = w->off ? (uint64_t)w->off_at : 0;
        if (rec) memcpy(rec, oi, sizeof oi), memcpy(rec + sizeof oi, &p, sizeof p);
        if (rec && w->off) memcpy(rec + sizeof oi + sizeof p, &off_at, 8);
        return sizeof oi + sizeof p + (w->off ? 8 : 0);
    }
    const moeq_moe_experts *w = it->obj;
    pc_experts_head h = {(int32_t)w->scheme, w->group, w->E, w->D, w->F, w->Fs, w->n_mats, 0};
    const size_t per = 8 + 2 * sizeof(pc_pmat);
    if (rec) {
        memcpy(rec, &h, sizeof h);
        for (int32_t i = 0; i < w->n_mats; i++) {
            uint8_t *r = rec + sizeof h + (size_t)i * per;
            int64_t ffn = w->ex[i].ffn;
            pc_pmat gu = pmat_out(&w->ex[i].gate_up, w->blob), dn = pmat_out(&w->ex[i].down, w->blob);
            memcpy(r, &ffn, 8);
            memcpy(r + 8, &gu, sizeof gu);
            memcpy(r + 8 + sizeof gu, &dn, sizeof dn);
        }
    }
    return sizeof h + (size_t)w->n_mats * per;
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
        size_t bytes;
        const uint8_t *blob = item_blob(&j->c->items[k], &bytes);
        uint64_t a = j->e[k].off, b = a + bytes;
        uint64_t lo = a > off ? a : off, hi = b < off + n ? b : off + n;
        if (lo < hi) memcpy(buf + (lo - off), blob + (lo - a), (size_t)(hi - lo));
    }
    j->out[i] = hash_bytes(buf, n, (uint64_t)i);
    free(buf);
}

/* Blob alignment in the file: 2 MiB (a huge page) for large blobs, 4 KiB for the others. */
static uint64_t align_of(size_t bytes) { return bytes >= PC_ALIGN ? PC_ALIGN : 4096; }

moeq_status mq_pack_cache_commit(mq_pack_cache *c) {
    if (!c || !c->dirty || c->n == 0) return MOEQ_OK;
    pc_header h = c->key;
    memcpy(h.magic, PC_MAGIC, 8);
    h.version = PC_VERSION;
    h.endian = PC_ENDIAN;
    h.n_entries = c->n;
    pc_entry *e = calloc(c->n, sizeof *e);
    if (!e) return mq_err(MOEQ_E_NOMEM, "out of memory");
    uint64_t off = 0, moff = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        size_t bytes;
        (void)item_blob(&c->items[i], &bytes);
        const uint64_t al = align_of(bytes);
        off = (off + al - 1) / al * al;
        e[i] = (pc_entry){(uint64_t)c->items[i].kind, c->items[i].name_hash, moff,
                          item_layout(&c->items[i], NULL), off, bytes};
        moff += e[i].meta_bytes;
        off += bytes;
    }
    h.meta_bytes = moff;
    h.data_bytes = off;
    h.n_chunks = (h.data_bytes + PC_CHUNK - 1) / PC_CHUNK;
    const size_t meta = sizeof h + c->n * sizeof *e + h.meta_bytes + h.n_chunks * 8;
    h.data_off = (meta + PC_ALIGN - 1) / PC_ALIGN * PC_ALIGN;
    uint8_t *metab = malloc(meta - sizeof h);
    uint64_t *ch = calloc(h.n_chunks ? h.n_chunks : 1, 8);
    int32_t oom = 0;
    moeq_status s = ch && metab ? MOEQ_OK : mq_err(MOEQ_E_NOMEM, "out of memory");
    if (!s) {
        hash_job j = {c, e, h.data_bytes, ch, &oom};
        mq_parallel_for((int64_t)h.n_chunks, hash_task, &j);
        if (oom) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    if (!s) {
        memcpy(metab, e, c->n * sizeof *e);
        for (uint32_t i = 0; i < c->n; i++)
            (void)item_layout(&c->items[i], metab + c->n * sizeof *e + e[i].meta_off);
        memcpy(metab + c->n * sizeof *e + h.meta_bytes, ch, h.n_chunks * 8);
        h.head_hash = 0;
        h.head_hash = hash_bytes(metab, meta - sizeof h, hash_bytes(&h, sizeof h, 1));
    }
    char *tmp = s ? NULL : mq_asprintf("%s.tmp.%d", c->path, (int)getpid());
    int fd = tmp ? open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
    if (!s && fd < 0) s = mq_err(MOEQ_E_IO, "%s: %s", tmp ? tmp : c->path, strerror(errno));
    if (!s) s = write_at(fd, &h, sizeof h, 0, tmp);
    if (!s) s = write_at(fd, metab, meta - sizeof h, sizeof h, tmp);
    for (uint32_t i = 0; i < c->n && !s; i++) {
        size_t bytes;
        const uint8_t *blob = item_blob(&c->items[i], &bytes);
        s = write_at(fd, blob, bytes, h.data_off + e[i].off, tmp);
    }
    if (!s && ftruncate(fd, (off_t)(h.data_off + h.data_bytes)) != 0)
        s = mq_err(MOEQ_E_IO, "%s: %s", tmp, strerror(errno));
    /* on disk, then out of the page cache: written pages sit there as small folios, read back
     * they come as huge ones (the header comment says why); failures only cost speed */
    if (!s && fdatasync(fd) == 0) (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
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
    free(c->items);
    free(c->path);
    free(c);
}
