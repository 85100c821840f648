/*
 * Internal core services shared by every module: error messages, memory, files, the one thread
 * pool, progress/log/interrupt plumbing, timers, checked arithmetic, the deterministic GEMM.
 * Internal symbols are prefixed mq_ (the public API is moeq_).
 */
#ifndef MOEQ_CORE_H
#define MOEQ_CORE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "moeq.h"

#if defined(__GNUC__)
#define MQ_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define MQ_UNUSED __attribute__((unused))
#else
#define MQ_PRINTF(a, b)
#define MQ_UNUSED
#endif

/* ---- errors ---------------------------------------------------------------------------- */
/* Sets this thread's last-error message and returns st, so callers write
 *   return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': offsets past end of file", path, name); */
moeq_status mq_err(moeq_status st, const char *fmt, ...) MQ_PRINTF(2, 3);
/* Prepends "prefix: " to the current last-error message (adds context on the way up). */
moeq_status mq_err_prefix(moeq_status st, const char *fmt, ...) MQ_PRINTF(2, 3);

/* Invariant check for programming errors (never for bad input): prints file:line and aborts. */
#define MQ_ASSERT(x)                                                                               \
    do {                                                                                           \
        if (!(x)) mq_assert_fail(#x, __FILE__, __LINE__);                                          \
    } while (0)
void mq_assert_fail(const char *expr, const char *file, int line);

/* ---- memory ---------------------------------------------------------------------------- */
/* All return NULL and set the last error (MOEQ_E_NOMEM, naming what) on failure. Sizes are
 * checked for overflow. mq_alloc memory is 64-byte aligned and released with mq_free. */
void *mq_alloc(size_t n, const char *what);
void *mq_alloc_zero(size_t n, const char *what);
void *mq_alloc_array(size_t count, size_t elem, const char *what);
void mq_free(void *p);
/* Releases each of n pointers (NULLs skipped): with free() (malloc'd) or mq_free (mq_alloc'd).
 * For a struct's owned arrays, listed once: MQ_FREE_EACH(t->a, t->b), MQ_RELEASE_EACH(...). */
void mq_free_each(void *const *p, size_t n);
void mq_release_each(void *const *p, size_t n);
#define MQ_PTRS_(...) ((void *const[]){__VA_ARGS__}), sizeof((void *const[]){__VA_ARGS__}) / sizeof(void *)
#define MQ_FREE_EACH(...) mq_free_each(MQ_PTRS_(__VA_ARGS__))
#define MQ_RELEASE_EACH(...) mq_release_each(MQ_PTRS_(__VA_ARGS__))
/* Room for need elements of `elem` bytes in the malloc'd array whose pointer is at arrp: its
 * capacity *cap doubled (from `first` when 0) until it holds them; false, the array unchanged,
 * when memory runs out. */
bool mq_reserve(void *arrp, size_t *cap, size_t need, size_t elem, size_t first);
/* mq_reserve's room for one more of n elements, MOEQ_E_NOMEM naming `what` when memory runs out. */
moeq_status mq_grow(void *arrp, size_t n, size_t *cap, size_t elem, size_t first, const char *what);
/* Unmaps the freed blocks of 1 MB or more kept for reuse (core/memory.c: recycling), e.g. when a
 * job is done and its memory should go back to the system. */
void mq_mem_release(void);
size_t mq_mem_kept_bytes(void);   /* the bytes kept for reuse now */
/* Faults in the pages of n regions of fresh memory, [base[i], base[i] + bytes[i]), on the pool
 * with one write a page (0, before anything is stored there): the kernel's page faults and zeroing
 * spread over the threads instead of falling on whatever touches the memory first (a driver
 * pinning it single-threaded, an unpacking on a critical path). */
void mq_touch_pages(void *const *base, const size_t *bytes, int64_t n);
char *mq_strdup(const char *s);
char *mq_strndup(const char *s, size_t n);
/* printf into a new malloc'ed string (free with free()). */
char *mq_asprintf(const char *fmt, ...) MQ_PRINTF(1, 2);
/* The index i in [0, n) whose name_at(ctx, i) is key, the names ascending in strcmp order; -1
 * when none is. */
int64_t mq_find_name(const char *key, size_t n, const char *(*name_at)(const void *ctx, size_t i), const void *ctx);

/* Memory figures (bytes; 0 where /proc is missing). anon: the process's anonymous resident
 * memory (RssAnon), which excludes file-backed pages such as mmapped checkpoints. */
int64_t mq_mem_anon_bytes(void);
int64_t mq_mem_total_bytes(void);
int64_t mq_mem_available_bytes(void);
/* A thread that samples mq_mem_anon_bytes every 10 ms while started (calls nest). take_peak:
 * the peak since the previous take (or the start), then a new interval begins; peak: the peak
 * since the start. */
void mq_mem_watch_start(void);
void mq_mem_watch_stop(void);
int64_t mq_mem_watch_take_peak(void);
int64_t mq_mem_watch_peak(void);

/* Checked arithmetic: return false on overflow. */
bool mq_mul_size(size_t a, size_t b, size_t *out);
bool mq_add_size(size_t a, size_t b, size_t *out);
/* A number read from a file (a JSON number is a double) as an integer: *out = v when v is an
 * integer in [lo, hi], else false. Casting a double outside the integer's range is undefined
 * behaviour, so no value from input is cast unchecked. */
static inline bool mq_int_of(double v, int64_t lo, int64_t hi, int64_t *out) {
    /* (double)hi + 1 is at most 2^63, so every v below it converts */
    if (!(v >= (double)lo && v < (double)hi + 1.0) || v != (double)(int64_t)v) return false;
    *out = (int64_t)v;
    return *out >= lo && *out <= hi;
}
/* v truncated to an integer and clamped to [INT64_MIN, INT64_MAX] (NaN: 0): where a value from
 * input only feeds range checks, so that a huge one stays huge. */
static inline int64_t mq_clamp_i64(double v) {
    if (!(v == v)) return 0;
    if (v >= 9223372036854775807.0) return INT64_MAX;
    if (v <= -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}
bool mq_mul_i64(int64_t a, int64_t b, int64_t *out);

/* ---- files ----------------------------------------------------------------------------- */
typedef struct {
    void *data;     /* read-only mapping (or heap buffer for empty files) */
    size_t size;
    int is_mmap;
} mq_map;

moeq_status mq_map_file(const char *path, mq_map *out);
void mq_unmap(mq_map *m);
/* Asks the kernel to read n bytes of a mapped file at p ahead, in the background (the pages then
 * wait in the page cache); a hint, so nothing fails. */
void mq_prefetch(const void *p, size_t n);
/* Reads a whole file into a NUL-terminated heap buffer (free with free()). */
moeq_status mq_read_file(const char *path, char **out, size_t *len);
/* Tests: count the reads mq_read_file makes of one file (the same device and inode as path when
 * this is called; NULL: none) from now on; mq_read_file_watched is the count so far (it only
 * grows). Every reader of a checkpoint's config.json goes through mq_read_file. */
void mq_read_file_watch(const char *path);
int64_t mq_read_file_watched(void);
bool mq_file_exists(const char *path);
bool mq_dir_exists(const char *path);
char *mq_path_join(const char *dir, const char *name);   /* malloc'ed */

/* Atomic file output: data goes to "<path>.tmp.<pid>" and is renamed over path on commit.
 * abort (or a failed commit) removes the temporary file. */
typedef struct {
    FILE *f;
    char *path;
    char *tmp_path;
} mq_atomic_file;
moeq_status mq_atomic_open(mq_atomic_file *af, const char *path);
moeq_status mq_atomic_write(mq_atomic_file *af, const void *data, size_t n);
/* n bytes at byte `off` of the file (pwrite: several threads may write apart at once; not mixed
 * with mq_atomic_write's buffered bytes unless those are before `off` and flushed). */
moeq_status mq_atomic_pwrite(mq_atomic_file *af, const void *data, size_t n, int64_t off);
moeq_status mq_atomic_commit(mq_atomic_file *af);
/* durable false: renamed into place without fsync (a cache whose loss or tearing by a crash of the
 * machine is detected when it is read, and only costs recomputing it). */
moeq_status mq_atomic_commit_ex(mq_atomic_file *af, bool durable);
void mq_atomic_abort(mq_atomic_file *af);
/* Convenience: write a whole buffer atomically. */
moeq_status mq_write_file_atomic(const char *path, const void *data, size_t n);

/* Positional I/O of whole buffers (retried on short transfers); MOEQ_E_IO naming path. A short
 * read (end of file) is MOEQ_E_FORMAT: the file is truncated. */
moeq_status mq_pwrite_all(int fd, const void *buf, size_t n, int64_t off, const char *path);
/* Wall nanoseconds mq_pwrite_all has spent in the kernel so far, summed over threads. */
uint64_t mq_pwrite_ns(void);
moeq_status mq_pread_all(int fd, void *buf, size_t n, int64_t off, const char *path);
/* fsync of a directory, so renames and new names in it are durable. */
moeq_status mq_fsync_dir(const char *dir);
/* CRC-32 (zlib's polynomial) of n bytes, continuing crc (start with 0). */
uint32_t mq_crc32(uint32_t crc, const void *data, size_t n);
/* The CRC-32 of A followed by B from crc_a, crc_b and B's length (zlib's crc32_combine): CRCs of
 * parts computed apart give the CRC of the whole. */
uint32_t mq_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

/* Recursively removes a directory tree (used to clean temporary output directories). */
void mq_remove_tree(const char *path);

/* ---- thread pool ----------------------------------------------------------------------- */
/* Runs fn(ctx, task, thread) for task in [0, n_tasks) on the process pool; the calling thread
 * takes part. Tasks are handed out dynamically, so fn must not depend on which thread runs a task
 * except for choosing per-thread scratch (thread in [0, mq_pool_size())). Nested calls run
 * serially on the calling thread. */
typedef void (*mq_task_fn)(void *ctx, int64_t task, int thread);
void mq_parallel_for(int64_t n_tasks, mq_task_fn fn, void *ctx);
int mq_pool_size(void);
/* fn(ctx, lo, hi) over [0, n) cut into pieces of `step` (the last one shorter): as tasks of
 * mq_parallel_for when pool, else in order on the calling thread. For elementwise or row-wise
 * work, whose values do not depend on the cut. */
typedef void (*mq_range_fn)(void *ctx, int64_t lo, int64_t hi);
void mq_parallel_ranges(int64_t n, int64_t step, bool pool, mq_range_fn fn, void *ctx);
/* Wall seconds spent so far in top-level mq_parallel_for calls of two or more tasks (the work that
 * can spread over the threads); a stage's wall time less this is what ran on one thread. */
double mq_pool_seconds(void);
/* The schedule of a machine with more cores than this one (bench quantize --simulate-threads):
 * with P > 0, mq_pool_size() answers P and every top-level loop runs its tasks in turn on the
 * calling thread, each timed; the seconds P threads would take are added up as the pool hands the
 * tasks out (in index order, each to the first free thread), ignoring what sharing the cores'
 * clock and memory costs. P = 0 stops. The results are those of P threads (per-thread scratch,
 * chunk plans and waves follow mq_pool_size), as only the timing is simulated. */
void mq_pool_simulate(int P);
/* Since mq_pool_simulate: the loops' task seconds (on one thread) and their simulated seconds; the
 * difference is what mq_now skipped. */
void mq_pool_simulated(double *tasks_seconds, double *simulated_seconds);
/* The makespan of tasks of dur[0..n) handed in order to the first free of P workers. */
double mq_schedule_makespan(const double *dur, int64_t n, int P);

/* ---- deterministic dense linear algebra (OpenBLAS underneath, single-threaded per call) ---- */
/* C[M,N] = alpha * A[M,K] @ B[N,K]^T + beta * C. Row-major, leading dims = row lengths given.
 * Split over the pool in a fixed grid of MQ_GEMM_TILE_M x MQ_GEMM_TILE_N tiles, so the result is
 * independent of the thread count (OpenBLAS's last bits do depend on a product's shape: whoever
 * wants the same values tiles the same way). Tiles of 256 x 128 run at the rate of 256 x 256 ones
 * and make twice the tasks: a 512-token sample's 2048 x 2048 projection is 32 of them, two rounds
 * of 16 threads, where 16 left every thread waiting for the slowest. */
enum { MQ_GEMM_TILE_M = 256, MQ_GEMM_TILE_N = 128 };
void mq_gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
/* C[M,N] = alpha * A[M,K] @ B[K,N] + beta * C. */
void mq_gemm_nn(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
/* Measures this machine's sgemm rate (GFLOP/s) on n x n x n with the pool, for about
 * min_seconds (smaller products on a host too slow for that, as under an emulator). */
double mq_measure_sgemm_gflops(int n, double min_seconds);
/* The cores' own rate: every pool thread runs single-threaded 256^3 sgemms on its own buffers (in
 * its cache) for about `seconds`, all at once; the sum of their GFLOP/s. Per thread and against
 * fewer threads it shows what the machine gives each core when all work (clock, shared cores),
 * the ceiling of any compute-bound scaling. */
double mq_measure_core_gflops(double seconds);

/* ---- runtime plumbing ------------------------------------------------------------------ */
void mq_progress(const char *label, int64_t done, int64_t total);
void mq_log(int level, const char *fmt, ...) MQ_PRINTF(2, 3);
#define mq_info(...) mq_log(0, __VA_ARGS__)
#define mq_warn(...) mq_log(1, __VA_ARGS__)
bool mq_force_ref(void);
bool mq_cpu_has_avx2_fma(void);
/* x86-64 with AVX-512F, BW and VL (and AVX2+FMA), the OS saving the zmm state, unless
 * MOEQ_NO_AVX512 is set (non-empty, not "0") or mq_set_avx512_off(1) was called: then the AVX2
 * kernels run, so both sets can be compared on one host. _vnni: also AVX512-VNNI. */
bool mq_cpu_has_avx512(void);
bool mq_cpu_has_avx512_vnni(void);
/* The OPENBLAS_CORETYPE for a CPU with these features when OpenBLAS runs kernel set `core` and
 * that set lacks AVX2 ("SkylakeX", "Haswell"), else NULL (blas_info.c). */
const char *mq_blas_advice_for(const char *core, bool avx2_fma, bool avx512);
void mq_set_avx512_off(int off);   /* for tests and benchmarks; -1 reads MOEQ_NO_AVX512 again */
/* AArch64 with the dot-product extension (Linux: HWCAP_ASIMDDP); false elsewhere. */
bool mq_cpu_has_neon_dot(void);
/* The kernel sets, one per instruction set a kernel family may have a twin for. Every family
 * (src/kernels/kernels.c) has a table of its implementations indexed by this, a set it lacks
 * filled with the next lower one it has (at least the scalar reference). */
typedef enum {
    MQ_ISA_REF = 0,        /* the scalar references (src/kernels/cpu/ref/), any CPU */
    MQ_ISA_AVX2,           /* x86-64 AVX2+FMA */
    MQ_ISA_AVX512,         /* x86-64 AVX-512 F/BW/VL */
    MQ_ISA_AVX512_VNNI,    /* and AVX512-VNNI */
    MQ_ISA_NEON,           /* AArch64 */
    MQ_ISA_NEON_DOT,       /* with the dot-product extension */
    MQ_ISA_COUNT
} mq_isa;
/* The set the kernels use now: the best the CPU has (its features are detected once), the
 * reference under mq_force_ref(), AVX2 on an AVX-512 host under MOEQ_NO_AVX512. */
mq_isa mq_cpu_isa(void);

/* ---- time ------------------------------------------------------------------------------ */
/* Monotonic seconds; while mq_pool_simulate runs, the simulated clock: each simulated loop moves it
 * on by the seconds P threads would take (its tasks' CPU seconds scheduled on P; mq_clock_skip),
 * not by its wall time, so every duration taken around loops (a stage, a layer, an ETA) is P
 * threads'. Inside a loop's task it runs as the real clock. */
double mq_now(void);
/* CPU seconds of the whole process (every thread); while mq_pool_simulate runs, of the calling
 * thread only, which runs every task of its loops: one thread's work, without what background
 * threads (snapshots, records) did meanwhile. */
double mq_cpu_now(void);
/* Takes seconds off mq_now from here on (the simulated loops' saving). */
void mq_clock_skip(double seconds);
/* mq_pool_simulate's switch of mq_cpu_now to the calling thread's CPU seconds. */
void mq_clock_simulating(bool on);

/* ---- small numeric helpers --------------------------------------------------------------- */
static inline float mq_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
/* Round-to-nearest-even fp32 -> bf16 (NaN stays NaN). */
static inline uint16_t mq_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}
float mq_f16_to_f32(uint16_t h);
uint16_t mq_f32_to_f16(float f);   /* round to nearest even, overflow to inf */

#endif /* MOEQ_CORE_H */
