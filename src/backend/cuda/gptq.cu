/*
 * GPTQ on the GPU: quant/gptq.c's algorithm (its file comment has the mathematics), laid out for
 * the device.
 *
 * A call runs in waves of Hessians (with their weights) that fit the device's free memory; a
 * wave's device arrays are one stream-ordered allocation, cut into four regions (carver): what
 * goes up from the host in one copy (the factors' diagonals and permutations, the groups' tables,
 * the sets' descriptors), what comes back after the checks (non-finite entries, H's diagonal,
 * amax), the working arrays, and the results that come back in one copy. H comes from host
 * memory or is formed on the device from a sum there; the weights from host memory or an
 * mq_gpu_mlp's experts (mq_gpu_gptq_ex), which may get the dequantized results back in place.
 *
 * Factor, per Hessian, on MQ_GPU_STREAMS streams at once: dead columns, mean diagonal and the
 * act-order permutation on the host exactly as the CPU computes them (from H's diagonal); A =
 * H' reversed and damped (a kernel), A = L L^T (cusolverDnSpotrf; the damping is raised and the
 * factorisation retried as on the CPU), R = L rotated by 180 degrees, U = R^-1 (cublasStrsm on
 * the identity).
 *
 * Column loop: the rows of every job that uses one factor form a "set", held transposed in
 * processing order (Wt[p][i]: column p contiguous over the rows, as the CPU's row blocks). A block
 * of 32 columns at a time: k_warp gives each row a warp, lane j holding column b0 + j (k_block,
 * a thread per row, is kept for groups larger than MAX_SMEM_GROUP): group parameters when a
 * group's first column is reached (the errors of the block not yet applied to a later column are
 * subtracted on the fly, as on the CPU), quantize, error, rank-1 update of the rest of the block.
 * The trailing columns then get the block's errors in one fp32 GEMM per set (a set's results
 * never depend on the other sets of the call).
 *
 * Results go back packed (codes two to a byte; NVFP4's group params as their E4M3 codes, the
 * scale being that code's value) through pinned memory, unpacked on the host pool.
 *
 * This file is the host side; the kernels are in gptq_kernels.cuh.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/gptq_kernels.cuh"   /* the device half: the sets' views and the kernels */
#include "backend/cuda/quant_dev.cuh"

namespace {

enum { MAX_RETRIES = 16 };

/* MOEQ_DEBUG_GPU_PROFILE=1: the time of each phase on stderr (the device synchronised at each mark). */
struct profiler {
    bool on = mq_env(MQ_ENV_GPU_PROFILE) != NULL;
    double t = mq_now();
    void mark(const char *what) {
        if (!on) return;
        cudaDeviceSynchronize();
        double n = mq_now();
        fprintf(stderr, "gpu gptq: %-10s %8.2f ms\n", what, (n - t) * 1e3);
        t = n;
    }
};

/* ---- host side ----------------------------------------------------------------------------- */

/* Device memory of a call comes from one stream-ordered allocation per wave, cut into pieces by
 * the same calls run twice: first to size it (base NULL), then to place. Four regions: what
 * goes up from the host in one copy (meta), what comes back after the checks (small), the
 * working arrays (big) and the results that come back in one copy (out). */
struct carver {
    char *base = nullptr;
    size_t used = 0;
    template <typename T> T *take(size_t n) {
        const size_t b = (n * sizeof(T) + 255) & ~(size_t)255;
        T *p = base ? (T *)(base + used) : nullptr;
        used += b;
        return p;
    }
};

struct regions {
    carver meta, small, big, out;
    size_t total() const { return meta.used + small.used + big.used + out.used; }
};

struct diag_ref {
    float d;
    int32_t i;
};

int cmp_diag_desc(const void *a, const void *b) {
    const diag_ref *x = (const diag_ref *)a, *y = (const diag_ref *)b;
    if (x->d != y->d) return x->d > y->d ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

/* One Hessian's factor: where H comes from, its device arrays, what the host keeps of it. */
struct factor {
    int64_t K = 0;
    int stream = 0;
    const float *H_host = NULL;                 /* host H, or */
    const float *sum = NULL;                    /* a device sum and its scale 2/n */
    float scale = 0;
    const char *name = NULL;
    bool act_order = false;
    /* device */
    float *dH = NULL, *dA = NULL, *dU = NULL;   /* dH becomes R, dA holds L */
    float *ddiag = NULL, *dhdiag = NULL, *draw = NULL;
    uint8_t *ddead = NULL;
    int32_t *dperm = NULL, *dinv = NULL;
    unsigned long long *dbad = NULL;            /* first non-finite entry */
    int *dinfo = NULL, *dsing = NULL;
    /* host */
    std::vector<int32_t> perm, inv;
    std::vector<uint8_t> dead;
    std::vector<float> diag;
    double mean = 0, percdamp = 0, damp = 0;
    int64_t n_dead = 0;
    int attempt = 0;
    bool done = false;
};

/* A set: a factor and the stacked rows of its jobs, with their device arrays. */
struct hset {
    int f;                       /* index into the wave's factors */
    std::vector<int64_t> jobs;   /* job indices, stacked in this order */
    std::vector<int64_t> row0;   /* first row of each job */
    int64_t ld = 0, G = 0, ng = 0;
    dset d = dset();
    unsigned long long *dbad = NULL;   /* first non-finite weight */
    uint8_t *pc = NULL, *pb = NULL;    /* packed results (out region) */
    mq_gparams *pp = NULL;
};

dim3 grid2(int64_t nx, int64_t ny, dim3 blk, int64_t nz = 1) {
    return dim3((unsigned)((nx + blk.x - 1) / blk.x), (unsigned)((ny + blk.y - 1) / blk.y), (unsigned)nz);
}

void lay_factor(regions &r, factor &f) {
    const size_t K = (size_t)f.K;
    f.ddiag = r.meta.take<float>(K);
    f.dhdiag = r.meta.take<float>(K);
    f.ddead = r.meta.take<uint8_t>(K);
    f.dperm = f.act_order ? r.meta.take<int32_t>(K) : NULL;
    f.dinv = f.act_order ? r.meta.take<int32_t>(K) : NULL;
    f.dbad = r.small.take<unsigned long long>(1);
    f.draw = r.small.take<float>(K);
    f.dH = r.big.take<float>(K * K);
    f.dA = r.big.take<float>(K * K);
    f.dU = r.big.take<float>(K * K);
}

void lay_set(regions &r, hset &h, int64_t K, bool loop, bool nvfp4) {
    const size_t kl = (size_t)K * (size_t)h.ld, ld = (size_t)h.ld, ng = (size_t)h.ng, G = (size_t)h.G;
    const size_t B = (size_t)(GPU_BLOCK < K ? GPU_BLOCK : K);
    dset &d = h.d;
    d.gpos = r.meta.take<int32_t>(ng * G);
    d.gord = r.meta.take<int32_t>(ng * G);
    d.gfirst = r.meta.take<int32_t>(ng);
    d.pgroup = r.meta.take<int32_t>((size_t)K);
    d.gs = r.meta.take<float>(ld);
    h.dbad = r.small.take<unsigned long long>(1);
    d.wrow = r.big.take<float>(kl);
    d.wt = r.big.take<float>(kl);
    d.w0t = r.big.take<float>(kl);
    d.ct = r.big.take<uint8_t>(kl);
    d.et = r.big.take<float>(B * ld);
    d.step = r.big.take<float>(ng * ld);
    d.zero = r.big.take<float>(ng * ld);
    d.gp = r.big.take<mq_gparams>(ng * ld);
    d.gv = r.big.take<float>(G * ld);
    d.ge = loop ? r.big.take<float>(G * ld) : NULL;
    d.ucol = loop ? r.big.take<float>(ng * G * G) : NULL;
    h.pc = r.out.take<uint8_t>(kl / 2);
    h.pb = nvfp4 ? r.out.take<uint8_t>(ng * ld) : NULL;
    h.pp = nvfp4 ? NULL : r.out.take<mq_gparams>(ng * ld);
    d.e2 = r.out.take<double>(4 * ld);
    d.dsq = d.e2 ? d.e2 + ld : NULL;
    d.rtn_e2 = d.e2 ? d.e2 + 2 * ld : NULL;
    d.rtn_dsq = d.e2 ? d.e2 + 3 * ld : NULL;
}

/* Bytes of device memory a factor and its set take (both placed once more in the wave). */
size_t item_bytes(factor f, hset h, bool loop, bool nvfp4) {
    regions r;
    lay_factor(r, f);
    lay_set(r, h, f.K, loop, nvfp4);
    return r.total() + 8 * 256;
}

/* Group metadata of a set (gptq.c group_pos, the order the in-loop search needs). */
void group_meta(const factor &f, int64_t K, int64_t G, bool gidx, int32_t *gpos, int32_t *gord,
                int32_t *gfirst, int32_t *pgroup) {
    const int64_t ng = K / G;
    const bool perm = !f.perm.empty();
    for (int64_t g = 0; g < ng; g++) {
        int32_t first = INT32_MAX;
        for (int64_t t = 0; t < G; t++) {
            int32_t q = gidx ? (int32_t)(g * G + t) : perm ? f.inv[g * G + t] : (int32_t)(g * G + t);
            gpos[g * G + t] = q;
            first = q < first ? q : first;
        }
        gfirst[g] = first;
        int32_t *ord = &gord[g * G];
        for (int64_t t = 0; t < G; t++) {   /* insertion sort by position */
            int64_t j = t;
            for (; j > 0 && gpos[g * G + ord[j - 1]] > gpos[g * G + t]; j--) ord[j] = ord[j - 1];
            ord[j] = (int32_t)t;
        }
    }
    for (int64_t p = 0; p < K; p++) {
        int64_t c = perm ? f.perm[p] : p;
        pgroup[p] = (int32_t)(gidx ? p / G : c / G);
    }
}

/* Dead columns, mean diagonal and act-order permutation from H's diagonal, as gptq.c. */
void factor_host(const mq_gptq_opts *o, factor &f, const float *raw) {
    const int64_t K = f.K;
    f.dead.assign((size_t)K, 0);
    f.diag.resize((size_t)K);
    f.mean = 0;
    f.n_dead = 0;
    for (int64_t i = 0; i < K; i++) {
        float d = raw[i];
        if (d == 0.0f) {
            f.dead[i] = 1;
            f.n_dead++;
            d = 1.0f;
        }
        f.diag[i] = d;
        f.mean += d;
    }
    f.mean /= (double)K;
    f.perm.clear();
    f.inv.clear();
    if (o->act_order) {
        std::vector<diag_ref> refs((size_t)K);
        for (int64_t i = 0; i < K; i++) refs[i] = diag_ref{f.diag[i], (int32_t)i};
        qsort(refs.data(), (size_t)K, sizeof(diag_ref), cmp_diag_desc);
        f.perm.resize((size_t)K);
        f.inv.resize((size_t)K);
        for (int64_t p = 0; p < K; p++) {
            f.perm[p] = refs[p].i;
            f.inv[refs[p].i] = (int32_t)p;
        }
    }
}

/* The host copy of a device pointer of the meta region. */
struct meta_blob {
    const char *dev = NULL;
    std::vector<char> host;
    template <typename T> T *at(T *d) { return (T *)(host.data() + ((const char *)d - dev)); }
};

moeq_status ensure_workspace(mq_gpu *g, int stream, size_t bytes) {
    if (bytes <= g->ws_cap[stream]) return MOEQ_OK;
    if (g->ws[stream]) {
        cudaStreamSynchronize(g->stream[stream]);
        mq_cu_free(g->ws[stream]);
    }
    g->ws[stream] = NULL;
    g->ws_cap[stream] = 0;
    moeq_status st = mq_cu_alloc(&g->ws[stream], bytes, "cuSOLVER workspace");
    if (!st) g->ws_cap[stream] = bytes;
    return st;
}

/* Factors every Hessian of the wave (their arrays placed, H in dH, diag/dead/perm uploaded),
 * with the CPU's damping retry; R in dH, U in dU. Messages as gptq.c's. */
moeq_status factor_all(mq_gpu *g, const mq_gptq_opts *o, std::vector<factor> &fs, int *infos) {
    moeq_status st = MOEQ_OK;
    const size_t nf = fs.size();
    /* workspaces: the largest of each stream's factors (a stream runs its factors in turn) */
    std::vector<size_t> need(MQ_GPU_STREAMS, 0);
    for (auto &f : fs) {
        int lw = 0;
        if ((st = CUSOLVER(cusolverDnSpotrf_bufferSize(g->solver[f.stream], CUBLAS_FILL_MODE_UPPER, (int)f.K, f.dA,
                                                       (int)f.K, &lw))))
            return st;
        const size_t b = (size_t)(lw > 0 ? lw : 1) * sizeof(float);
        need[f.stream] = b > need[f.stream] ? b : need[f.stream];
    }
    profiler prof;   /* MOEQ_DEBUG_GPU_PROFILE: the Cholesky factorisations apart from the inverses */
    for (int s = 0; s < MQ_GPU_STREAMS && !st; s++)
        if (need[s]) st = ensure_workspace(g, s, need[s]);
    if (st) return st;
    for (auto &f : fs) {
        f.percdamp = o->percdamp;
        f.attempt = 0;
        f.done = false;
    }
    std::vector<int> info(nf);
    for (;;) {
        bool pending = false;
        for (auto &f : fs) {
            if (f.done) continue;
            pending = true;
            const int64_t K = f.K;
            cudaStream_t s = g->stream[f.stream];
            f.damp = (double)(float)(f.percdamp * f.mean);
            dim3 blk(32, 8);
            k_build_a<<<grid2(K, K, blk), blk, 0, s>>>(f.dA, f.dH, f.dperm, f.ddiag, K, (float)(f.percdamp * f.mean));
            if ((st = CU_LAUNCHED("k_build_a"))) return st;
            if ((st = CUSOLVER(cusolverDnSpotrf(g->solver[f.stream], CUBLAS_FILL_MODE_UPPER, (int)K, f.dA, (int)K,
                                                (float *)g->ws[f.stream], (int)(g->ws_cap[f.stream] / sizeof(float)),
                                                f.dinfo))))
                return st;
        }
        if (!pending) break;
        if ((st = CU(cudaDeviceSynchronize()))) return st;
        if ((st = CU(cudaMemcpy(info.data(), infos, nf * sizeof(int), cudaMemcpyDeviceToHost)))) return st;
        for (size_t k = 0; k < nf; k++) {
            factor &f = fs[k];
            if (f.done) continue;
            if (info[k] < 0) return mq_err(MOEQ_E_DEVICE, "%s: cusolverDnSpotrf: argument %d", f.name, -info[k]);
            if (info[k] == 0) {
                f.done = true;
                if (f.attempt > 0)
                    mq_warn("%s: Hessian not positive definite with percdamp %g; raised to %g", f.name, o->percdamp,
                            f.percdamp);
                continue;
            }
            if (f.attempt + 1 >= MAX_RETRIES || f.percdamp * 2 > MQ_GPTQ_MAX_PERCDAMP)
                return mq_err(MOEQ_E_NUMERIC, "%s: Hessian not positive definite even with percdamp raised to %g",
                              f.name, f.percdamp);
            f.attempt++;
            f.percdamp = f.percdamp == 0 ? 1e-4 : f.percdamp * 2;
        }
    }
    prof.mark("potrf");
    /* R (into dH, no longer needed) and U = R^-1 (cuSOLVER's trtri took 1.4 ms more than this
     * solve for K = 2048 on an H200) */
    const float one = 1.0f;
    for (auto &f : fs) {
        const int64_t K = f.K;
        cudaStream_t s = g->stream[f.stream];
        dim3 blk(32, 8);
        k_rotate<<<grid2(K, K, blk), blk, 0, s>>>(f.dH, f.dA, f.dU, K);
        if ((st = CU_LAUNCHED("k_rotate"))) return st;
        if ((st = CUBLAS(cublasStrsm(g->blas[f.stream], CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N,
                                     CUBLAS_DIAG_NON_UNIT, (int)K, (int)K, &one, f.dH, (int)K, f.dU, (int)K))))
            return st;
        k_diag_finite<<<(unsigned)((K + 255) / 256), 256, 0, s>>>(f.dU, K, f.dsing);
        if ((st = CU_LAUNCHED("k_diag_finite"))) return st;
    }
    if ((st = CU(cudaDeviceSynchronize()))) return st;
    if ((st = CU(cudaMemcpy(info.data(), infos + nf, nf * sizeof(int), cudaMemcpyDeviceToHost)))) return st;
    for (size_t k = 0; k < nf; k++)
        if (info[k]) return mq_err(MOEQ_E_NUMERIC, "%s: Cholesky factor of the Hessian is singular", fs[k].name);
    return MOEQ_OK;
}

/* Device results to the host through the pinned buffer, a piece at a time; each piece is
 * handed to take(offset, bytes, host) while the next one is on its way. */
template <typename F> moeq_status download(mq_gpu *g, const char *src, size_t n, F take) {
    size_t piece = 0;
    moeq_status st = mq_cu_pinned(g, &piece);
    if (st) return st;
    cudaStream_t s = g->stream[0];
    char *buf[2] = {(char *)g->pin, (char *)g->pin + piece};
    size_t prev_off = 0, prev_len = 0;
    for (size_t off = 0, k = 0; off < n || prev_len; off += piece, k++) {
        const size_t len = off < n ? (n - off < piece ? n - off : piece) : 0;
        if (len && (st = CU(cudaMemcpyAsync(buf[k % 2], src + off, len, cudaMemcpyDeviceToHost, s)))) return st;
        if (prev_len) {
            /* the previous piece: its copy was queued before this one */
            if ((st = CU(cudaEventSynchronize(g->ev[(k + 1) % 2])))) return st;
            take(prev_off, prev_len, buf[(k + 1) % 2]);
        }
        if (len && (st = CU(cudaEventRecord(g->ev[k % 2], s)))) return st;
        prev_off = off;
        prev_len = len;
        if (!len) break;
    }
    return st;
}

/* Unpacking results on the host pool: codes to bytes, NVFP4 params from their codes. A task is
 * a block of rows of one job; a piece of the out region is handed over at a time. */
enum { UNPACK_ROWS = 64 };

struct unpack_task_t {
    int64_t set, jk, r0, r1;   /* set, job within it, rows [r0, r1) of the job */
};

struct unpack_ctx {
    const std::vector<hset> *sets;
    const char *out_dev;       /* the out region's device base */
    size_t off, len;           /* the piece of the out region at host */
    const char *host;
    mq_gptq_job *jobs;
    std::vector<unpack_task_t> tasks;
};

/* The part of the device range [dev, dev + n) inside the piece, into dst: nibbles (two codes a
 * byte), E4M3 codes (NVFP4 params) or bytes. */
void copy_piece(const unpack_ctx &c, const void *dev, size_t n, void *dst_v, int kind) {
    const size_t a = (size_t)((const char *)dev - c.out_dev), b = a + n;
    const size_t lo = a > c.off ? a : c.off, hi = b < c.off + c.len ? b : c.off + c.len;
    if (lo >= hi) return;
    const uint8_t *src = (const uint8_t *)(c.host + (lo - c.off));
    const size_t at = lo - a, m = hi - lo;
    if (kind == 0) {
        uint8_t *dst = (uint8_t *)dst_v + 2 * at;
        for (size_t k = 0; k < m; k++) {
            dst[2 * k] = mq_u4_first(src[k]);
            dst[2 * k + 1] = mq_u4_second(src[k]);
        }
    } else if (kind == 1) {
        mq_gparams *dst = (mq_gparams *)dst_v + at;
        for (size_t k = 0; k < m; k++) {
            mq_gparams p;
            memset(&p, 0, sizeof p);
            p.scale = mq_e4m3_decode(src[k]);
            p.zero = 0.0f;
            p.scale_code = src[k];
            dst[k] = p;
        }
    } else {
        memcpy((char *)dst_v + at, src, m);
    }
}

void unpack_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    const unpack_ctx &c = *(const unpack_ctx *)vctx;
    const unpack_task_t &u = c.tasks[(size_t)t];
    const hset &h = (*c.sets)[(size_t)u.set];
    const mq_gptq_job &j = c.jobs[h.jobs[(size_t)u.jk]];
    const int64_t r0 = h.row0[(size_t)u.jk] + u.r0, n = u.r1 - u.r0, K = h.d.K, ng = h.ng;
    mq_qtensor *q = j.out;
    copy_piece(c, h.pc + r0 * (K / 2), (size_t)(n * K / 2), q->codes + u.r0 * K, 0);
    if (h.pb) copy_piece(c, h.pb + r0 * ng, (size_t)(n * ng), q->params + u.r0 * ng, 1);
    else copy_piece(c, h.pp + r0 * ng, (size_t)(n * ng) * sizeof(mq_gparams), q->params + u.r0 * ng, 2);
}

/* Fresh results' pages, faulted in on the pool while the device still runs the column loop: the
 * unpacking after the download otherwise takes its first-touch faults (and the kernel's page
 * zeroing) on the critical path, 14 MB for a 4096 x 2048 weight. */
void touch_results(const std::vector<hset> &sets, const mq_gptq_job *jobs) {
    std::vector<void *> base;
    std::vector<size_t> bytes;
    for (const hset &h : sets)
        for (int64_t ji : h.jobs) {
            const mq_qtensor *q = jobs[ji].out;
            base.push_back(q->codes);
            bytes.push_back((size_t)(q->rows * q->cols));
            base.push_back(q->params);
            bytes.push_back((size_t)(q->rows * q->n_groups) * sizeof(mq_gparams));
        }
    mq_touch_pages(base.data(), bytes.data(), (int64_t)base.size());
}

/* The loop of a wave: RTN loss, load, groups, the column blocks with their trailing GEMMs. */
moeq_status run_loop(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o, std::vector<factor> &fs,
                     std::vector<hset> &sets, dset *dsets, float *const *dD, float *const *dDR) {
    moeq_status st = MOEQ_OK;
    const bool loop = s->mse && o->mse_weight == MQ_GPTQ_MSE_LOOP;
    cudaStream_t s0 = g->stream[0];
    const loop_cfg c = {*s, s->mse ? o->mse_weight : MQ_GPTQ_MSE_PLAIN, o->groups != MQ_GPTQ_GROUPS_STATIC};
    const size_t ns = sets.size();
    int64_t maxK = 0, maxld = 0, maxng = 0, maxG = 0;
    for (auto &h : sets) {
        maxK = h.d.K > maxK ? h.d.K : maxK;
        maxld = h.ld > maxld ? h.ld : maxld;
        maxng = h.ng > maxng ? h.ng : maxng;
        maxG = h.G > maxG ? h.G : maxG;
    }
    dim3 blk2(32, 8);
    /* RTN loss first: D into wt, D R into w0t, before both are loaded */
    if (o->rtn_loss) {
        k_rtn_residual<<<dim3((unsigned)((maxld + 63) / 64), (unsigned)ns), 64, 0, s0>>>(dsets, c, dD);
        if ((st = CU_LAUNCHED("k_rtn_residual")) || (st = CUBLAS(cublasSetStream(g->blas[0], s0)))) return st;
        const float one = 1.0f, zero = 0.0f;
        for (size_t k = 0; k < ns && !st; k++) {
            const dset &d = sets[k].d;
            st = CUBLAS(cublasSgemm(g->blas[0], CUBLAS_OP_N, CUBLAS_OP_T, (int)d.ld, (int)d.K, (int)d.K, &one, d.wt,
                                    (int)d.ld, fs[sets[k].f].dH, (int)d.K, &zero, d.w0t, (int)d.ld));
        }
        if (st) return st;
        k_row_sumsq<<<dim3((unsigned)((maxld + 63) / 64), (unsigned)ns), 64, 0, s0>>>(dsets, dDR);
        if ((st = CU_LAUNCHED("k_row_sumsq"))) return st;
    }
    k_load<<<grid2(maxK, maxld, blk2, (int64_t)ns), blk2, 0, s0>>>(dsets);
    if ((st = CU_LAUNCHED("k_load"))) return st;
    if (loop) {
        k_ucol<<<dim3((unsigned)((maxG * maxG + 255) / 256), (unsigned)maxng, (unsigned)ns), 256, 0, s0>>>(dsets);
        if ((st = CU_LAUNCHED("k_ucol"))) return st;
    }
    if (!c.dynamic) {
        k_static_groups<<<dim3((unsigned)((maxld + 63) / 64), (unsigned)ns), 64, 0, s0>>>(dsets, c);
        if ((st = CU_LAUNCHED("k_static_groups"))) return st;
    }
    /* The loop: blocks of B columns; one trailing GEMM per set. A warp per row (k_warp) when
     * the call has few rows: a thread per row (k_block) then leaves most of the GPU idle, each
     * thread walking its block alone; with many rows the threads fill the GPU and k_block does
     * a 32nd of k_warp's lane work (H200: 4,096 rows 4.4 against 6.2 ms a call, 262,144 rows
     * 223 against 130 ms). Groups beyond MAX_SMEM_GROUP take k_block; MOEQ_DEBUG_GPU_LOOP=thread|warp
     * chooses (the two give the same values). */
    const int64_t B = GPU_BLOCK < maxK ? GPU_BLOCK : maxK;
    int64_t rows = 0;
    for (auto &h : sets) rows += h.ld;
    const char *lm = mq_env(MQ_ENV_GPU_LOOP);
    const bool warp = maxG <= MAX_SMEM_GROUP && (lm && !strcmp(lm, "warp")   ? true
                                                 : lm && !strcmp(lm, "thread") ? false
                                                                               : rows < WARP_MAX_ROWS);
    const bool smem_group = loop && c.dynamic && maxG <= MAX_SMEM_GROUP;
    /* k_warp: ub, tile, wv, eb, gvb (and uc when the in-loop search's group fits beside them) */
    const size_t wsmem0 = (size_t)(GPU_BLOCK * GPU_BLOCK + GPU_BLOCK * (WARP_ROWS + 1) + 2 * WARP_ROWS * 32 +
                                   WARP_ROWS * maxG) * sizeof(float);
    const bool smem_uc = loop && c.dynamic && wsmem0 + (size_t)(maxG * maxG) * sizeof(float) <= 160 * 1024;
    const size_t smem = warp ? wsmem0 + (smem_uc ? (size_t)(maxG * maxG) * sizeof(float) : 0)
                             : (size_t)(B * ROWS_PER_CTA + B * B + (smem_group ? maxG * maxG + maxG * ROWS_PER_CTA : 0)) *
                                   sizeof(float);
    if (smem > 48 * 1024 &&
        (st = warp ? CU(cudaFuncSetAttribute(k_warp, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))
                   : CU(cudaFuncSetAttribute(k_block, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))))
        return st;
    if ((st = CUBLAS(cublasSetStream(g->blas[0], s0)))) return st;
    for (int64_t b0 = 0; b0 < maxK && !st; b0 += B) {
        if (moeq_interrupted()) return mq_err(MOEQ_E_INTERRUPTED, "GPTQ interrupted");
        if (warp) {
            k_warp<<<dim3((unsigned)((maxld + WARP_ROWS - 1) / WARP_ROWS), (unsigned)ns), WARP_ROWS * 32, smem, s0>>>(
                dsets, c, b0, smem_uc);
            if ((st = CU_LAUNCHED("k_warp"))) return st;
        } else {
            k_block<<<dim3((unsigned)((maxld + ROWS_PER_CTA - 1) / ROWS_PER_CTA), (unsigned)ns), ROWS_PER_CTA, smem,
                      s0>>>(dsets, c, b0, B, smem_group);
            if ((st = CU_LAUNCHED("k_block"))) return st;
        }
        /* trailing update, one GEMM per set: W[:, b1:] -= E U[b0:b1, b1:]. Not batched: a set's
         * result must not depend on which other sets share the call (cuBLAS may pick another
         * kernel for another batch count), so that chunking experts changes nothing */
        const float minus = -1.0f, one = 1.0f;
        for (size_t k = 0; k < ns && !st; k++) {
            const dset &d = sets[k].d;
            const int64_t b1 = b0 + B < d.K ? b0 + B : d.K;
            if (b1 >= d.K) continue;
            st = CUBLAS(cublasSgemm(g->blas[0], CUBLAS_OP_N, CUBLAS_OP_T, (int)d.ld, (int)(d.K - b1), (int)(b1 - b0),
                                    &minus, d.et, (int)d.ld, d.U + b0 * d.K + b1, (int)d.K, &one, d.wt + b1 * d.ld,
                                    (int)d.ld));
        }
    }
    return st;
}

/* One wave: the Hessians fs with their sets, every buffer in one allocation. */
moeq_status run_wave(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o, std::vector<factor> &fs,
                     std::vector<hset> &sets, mq_gptq_job *jobs, const mq_gpu_wsrc *dW) {
    moeq_status st = MOEQ_OK;
    const bool gidx = o->act_order && o->groups == MQ_GPTQ_GROUPS_GIDX;
    const bool loop = s->mse && o->mse_weight == MQ_GPTQ_MSE_LOOP;
    const bool nvfp4 = s->scheme == MQ_QS_NVFP4;
    const size_t nf = fs.size(), ns = sets.size();
    cudaStream_t s0 = g->stream[0];
    profiler prof;
    /* jobs whose NVFP4 global scale comes from their weights' amax, found on the device */
    std::vector<int64_t> need_gs;
    for (auto &h : sets)
        for (int64_t j : h.jobs)
            if (nvfp4 && !(jobs[j].global_scale > 0 && isfinite(jobs[j].global_scale))) need_gs.push_back(j);
    /* place everything: sizes first, then one allocation */
    regions r;
    dset *dsets = NULL;
    float **dD = NULL, **dDR = NULL;
    uint8_t **dpc = NULL, **dpb = NULL;
    mq_gparams **dpp = NULL;
    int *dinfo = NULL;
    unsigned *damax = NULL;
    char *base = NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            const size_t meta = r.meta.used, small = r.small.used, big = r.big.used;
            if ((st = mq_cu_alloc_async((void **)&base, r.total() + 256, s0, "GPTQ")))
                return mq_err(MOEQ_E_NOMEM, "%s: GPTQ needs %.2f GB of GPU memory (%s)", fs[0].name,
                              (double)r.total() / 1e9, moeq_last_error());
            r = regions();
            r.meta.base = base;
            r.small.base = base + meta;
            r.big.base = base + meta + small;
            r.out.base = base + meta + small + big;
        }
        dsets = r.meta.take<dset>(ns);
        dD = r.meta.take<float *>(ns);
        dDR = r.meta.take<float *>(ns);
        dpc = r.meta.take<uint8_t *>(ns);
        dpb = r.meta.take<uint8_t *>(ns);
        dpp = r.meta.take<mq_gparams *>(ns);
        dinfo = r.small.take<int>(2 * nf);
        damax = r.small.take<unsigned>(need_gs.size() + 1);
        for (size_t k = 0; k < nf; k++) {
            lay_factor(r, fs[k]);
            fs[k].dinfo = dinfo + k;
            fs[k].dsing = dinfo + nf + k;
        }
        for (auto &h : sets) {
            lay_set(r, h, fs[h.f].K, loop, nvfp4);
            h.d.K = fs[h.f].K;
        }
    }
    char *const small_base = r.small.base;
    const size_t small_len = r.small.used;
    /* sources: H (uploaded, or formed from the device sums) and the weights */
    if (!st) st = CU(cudaMemsetAsync(small_base, 0xFF, small_len, s0));
    if (!st) st = CU(cudaMemsetAsync(dinfo, 0, 2 * nf * sizeof(int), s0));
    if (!st) st = CU(cudaMemsetAsync(damax, 0, (need_gs.size() + 1) * sizeof(unsigned), s0));
    if (!st) st = CU(cudaMemsetAsync(r.out.base, 0, r.out.used, s0));
    for (size_t k = 0; k < nf && !st; k++) {
        factor &f = fs[k];
        const size_t kk = (size_t)(f.K * f.K);
        if (f.H_host) {
            st = mq_cu_upload(g, f.dH, f.H_host, kk * sizeof(float));
        } else {
            dim3 blk(32, 8);
            k_form<<<grid2(f.K, f.K, blk), blk, 0, s0>>>(f.dH, f.sum, f.K, f.scale);
            st = CU_LAUNCHED("k_form");
        }
        if (!st) {
            k_diag<<<(unsigned)((f.K + 255) / 256), 256, 0, s0>>>(f.dH, f.K, f.draw);
            k_first_nonfinite<<<1024, 256, 0, s0>>>(f.dH, (int64_t)kk, f.dbad);
            st = CU_LAUNCHED("k_first_nonfinite");
        }
    }
    for (auto &h : sets) {
        const int64_t K = h.d.K;
        for (size_t k = 0; k < h.jobs.size() && !st; k++) {
            const int64_t ji = h.jobs[k];
            const mq_gptq_job &j = jobs[ji];
            const size_t n = (size_t)(j.rows * K);
            float *dst = (float *)h.d.wrow + h.row0[k] * K;
            if (dW && dW[ji].mlp)
                st = CU(cudaMemcpyAsync(dst, mq_gpu_mlp_weight(dW[ji].mlp, dW[ji].expert, dW[ji].k), n * sizeof(float),
                                        cudaMemcpyDeviceToDevice, s0));
            else
                st = mq_cu_upload(g, dst, j.w, n * sizeof(float));
        }
        if (!st) {
            k_first_nonfinite<<<1024, 256, 0, s0>>>(h.d.wrow, K * h.ld, h.dbad);
            st = CU_LAUNCHED("k_first_nonfinite");
        }
    }
    for (size_t a = 0; a < need_gs.size() && !st; a++) {
        /* the job's rows within its set */
        for (auto &h : sets)
            for (size_t k = 0; k < h.jobs.size(); k++)
                if (h.jobs[k] == need_gs[a]) {
                    k_absmax_bits<<<256, 256, 0, s0>>>(h.d.wrow + h.row0[k] * h.d.K, jobs[need_gs[a]].rows * h.d.K,
                                                      damax + a);
                    st = CU_LAUNCHED("k_absmax_bits");
                }
    }
    std::vector<char> small((size_t)small_len);
    if (!st) st = CU(cudaMemcpyAsync(small.data(), small_base, small_len, cudaMemcpyDeviceToHost, s0));
    if (!st) st = CU(cudaStreamSynchronize(s0));
    prof.mark("sources");
    auto host_small = [&](const void *d) { return small.data() + ((const char *)d - small_base); };
    /* finiteness (gptq.c check_hessian, mq_check_finite), messages naming the tensor */
    for (size_t k = 0; k < nf && !st; k++) {
        const factor &f = fs[k];
        const unsigned long long at = *(const unsigned long long *)host_small(f.dbad);
        if (at == ~0ull) continue;
        float v = NAN;
        cudaMemcpy(&v, f.dH + at, sizeof v, cudaMemcpyDeviceToHost);
        st = mq_err(MOEQ_E_NUMERIC, "%s: non-finite Hessian entry %g at (%lld, %lld)", f.name, (double)v,
                    (long long)(at / f.K), (long long)(at % f.K));
    }
    for (size_t k = 0; k < ns && !st; k++) {
        const hset &h = sets[k];
        const unsigned long long at = *(const unsigned long long *)host_small(h.dbad);
        if (at == ~0ull) continue;
        const int64_t K = h.d.K, row = (int64_t)at / K, col = (int64_t)at % K;
        size_t jk = 0;
        while (jk + 1 < h.jobs.size() && h.row0[jk + 1] <= row) jk++;
        const mq_gptq_job &j = jobs[h.jobs[jk]];
        float v = NAN;
        cudaMemcpy(&v, h.d.wrow + at, sizeof v, cudaMemcpyDeviceToHost);
        st = mq_err(MOEQ_E_NUMERIC, "%s: non-finite weight %g at (%lld, %lld)", j.name ? j.name : "(unnamed)",
                    (double)v, (long long)(row - h.row0[jk]), (long long)col);
    }
    /* the finiteness checks saw H as given; from here only its lower triangle counts */
    for (size_t k = 0; k < nf && !st; k++)
        if (fs[k].H_host) {
            dim3 blk(32, 8);
            k_mirror_lower<<<grid2(fs[k].K, fs[k].K, blk), blk, 0, s0>>>(fs[k].dH, fs[k].K);
            st = CU_LAUNCHED("k_mirror_lower");
        }
    for (size_t a = 0; a < need_gs.size() && !st; a++) {
        unsigned bits = *(const unsigned *)host_small(damax + a);
        float amax;
        memcpy(&amax, &bits, sizeof amax);
        jobs[need_gs[a]].out->global_scale = mq_nvfp4_global_scale(s, amax);
    }
    /* the host's part of the factors and the sets' metadata, up in one copy */
    meta_blob mb;
    if (!st) {
        mb.dev = r.meta.base;
        mb.host.assign(r.meta.used, 0);
        for (auto &f : fs) {
            factor_host(o, f, (const float *)host_small(f.draw));
            memcpy(mb.at(f.ddiag), f.diag.data(), (size_t)f.K * sizeof(float));
            memcpy(mb.at(f.ddead), f.dead.data(), (size_t)f.K);
            float *hd = mb.at(f.dhdiag);
            for (int64_t p = 0; p < f.K; p++) hd[p] = f.diag[(size_t)(o->act_order ? f.perm[p] : p)];
            if (f.act_order) {
                memcpy(mb.at(f.dperm), f.perm.data(), (size_t)f.K * 4);
                memcpy(mb.at(f.dinv), f.inv.data(), (size_t)f.K * 4);
            }
        }
        for (size_t k = 0; k < ns; k++) {
            hset &h = sets[k];
            const factor &f = fs[h.f];
            dset &d = h.d;
            d.ld = h.ld;
            d.G = h.G;
            d.ng = h.ng;
            d.U = f.dU;
            d.inv = f.dinv;
            d.dead = f.ddead;
            d.hdiag = f.dhdiag;
            group_meta(f, d.K, h.G, gidx, mb.at((int32_t *)d.gpos), mb.at((int32_t *)d.gord),
                       mb.at((int32_t *)d.gfirst), mb.at((int32_t *)d.pgroup));
            float *gs = mb.at((float *)d.gs);
            for (size_t jk = 0; jk < h.jobs.size(); jk++)
                for (int64_t rr = 0; rr < jobs[h.jobs[jk]].rows; rr++) gs[h.row0[jk] + rr] = jobs[h.jobs[jk]].out->global_scale;
            mb.at(dsets)[k] = d;
            mb.at(dD)[k] = d.wt;
            mb.at(dDR)[k] = d.w0t;
            mb.at(dpc)[k] = h.pc;
            mb.at(dpb)[k] = h.pb;
            mb.at(dpp)[k] = h.pp;
        }
        st = CU(cudaMemcpyAsync(r.meta.base, mb.host.data(), mb.host.size(), cudaMemcpyHostToDevice, s0));
    }
    /* the other streams start after everything so far on stream 0 */
    if (!st) st = CU(cudaStreamSynchronize(s0));
    prof.mark("host prep");
    if (!st) st = factor_all(g, o, fs, dinfo);
    prof.mark("factor");
    if (!st && gidx)
        for (auto &h : sets)
            for (int64_t j : h.jobs) {
                mq_qtensor *q = jobs[j].out;
                q->g_idx = (int32_t *)mq_alloc_array((size_t)q->cols, sizeof(int32_t), "GPTQ g_idx");
                if (!q->g_idx) {
                    st = MOEQ_E_NOMEM;
                    break;
                }
                const factor &f = fs[h.f];
                for (int64_t p = 0; p < q->cols; p++) q->g_idx[f.perm.empty() ? p : f.perm[p]] = (int32_t)(p / q->group_size);
            }
    if (!st) st = run_loop(g, s, o, fs, sets, dsets, dD, dDR);
    prof.mark("loop");
    /* results: packed, dequantized where asked (to the host or in place of the device weights) */
    bool want_deq = false;
    for (auto &h : sets)
        for (int64_t j : h.jobs) want_deq |= jobs[j].deq != NULL || (dW && dW[j].mlp && dW[j].write_back);
    int64_t maxK = 0, maxld = 0;
    for (auto &h : sets) {
        maxK = h.d.K > maxK ? h.d.K : maxK;
        maxld = h.ld > maxld ? h.ld : maxld;
    }
    if (!st) {
        dim3 blk2(32, 8);
        k_pack_codes<<<grid2(maxK / 2, maxld, blk2, (int64_t)ns), blk2, 0, s0>>>(dsets, dpc, want_deq);
        st = CU_LAUNCHED("k_pack_codes");
    }
    if (!st) {
        k_pack_params<<<dim3((unsigned)((maxld + 63) / 64), (unsigned)ns), 64, 0, s0>>>(dsets, dpb, dpp);
        st = CU_LAUNCHED("k_pack_params");
    }
    const char *pretouch = mq_env(MQ_ENV_GPU_PRETOUCH);   /* =0 turns it off (to measure it) */
    if (!st && !(pretouch && strcmp(pretouch, "0") == 0)) touch_results(sets, jobs);   /* before any copy that waits */
    for (auto &h : sets)
        for (size_t k = 0; k < h.jobs.size() && !st; k++) {
            const int64_t ji = h.jobs[k];
            const mq_gptq_job &j = jobs[ji];
            const float *deq = h.d.wt + h.row0[k] * h.d.K;
            const size_t n = (size_t)(j.rows * h.d.K) * sizeof(float);
            if (dW && dW[ji].mlp && dW[ji].write_back)
                st = CU(cudaMemcpyAsync(mq_gpu_mlp_weight(dW[ji].mlp, dW[ji].expert, dW[ji].k), deq, n,
                                        cudaMemcpyDeviceToDevice, s0));
            if (!st && j.deq) st = CU(cudaMemcpyAsync(j.deq, deq, n, cudaMemcpyDeviceToHost, s0));
        }
    /* the out region comes back in pieces, unpacked on the pool while the next one travels */
    std::vector<std::vector<double>> sums(ns);
    if (!st) {
        unpack_ctx c;
        c.sets = &sets;
        c.out_dev = r.out.base;
        c.jobs = jobs;
        for (size_t k = 0; k < ns; k++)
            for (size_t jk = 0; jk < sets[k].jobs.size(); jk++)
                for (int64_t r0 = 0; r0 < jobs[sets[k].jobs[jk]].rows; r0 += UNPACK_ROWS) {
                    const int64_t r1 = r0 + UNPACK_ROWS < jobs[sets[k].jobs[jk]].rows ? r0 + UNPACK_ROWS
                                                                                       : jobs[sets[k].jobs[jk]].rows;
                    c.tasks.push_back({(int64_t)k, (int64_t)jk, r0, r1});
                }
        for (size_t k = 0; k < ns; k++) sums[k].assign((size_t)(4 * sets[k].ld), 0.0);
        st = download(g, r.out.base, r.out.used, [&](size_t off, size_t len, const char *host) {
            c.off = off;
            c.len = len;
            c.host = host;
            mq_parallel_for((int64_t)c.tasks.size(), unpack_task, &c);
            for (size_t k = 0; k < ns; k++) {   /* the loss sums, read below */
                const size_t a = (size_t)((const char *)sets[k].d.e2 - r.out.base), b = a + sums[k].size() * sizeof(double);
                const size_t lo = a > off ? a : off, hi = b < off + len ? b : off + len;
                if (lo < hi) memcpy((char *)sums[k].data() + (lo - a), host + (lo - off), hi - lo);
            }
        });
    }
    prof.mark("download");
    if (!st)
        for (size_t hk = 0; hk < ns; hk++) {
            const hset &h = sets[hk];
            const dset &d = h.d;
            const double *e = sums[hk].data();
            const factor &f = fs[h.f];
            for (size_t k = 0; k < h.jobs.size(); k++) {
                mq_gptq_job &j = jobs[h.jobs[k]];
                double e2 = 0, dsq = 0, re2 = 0, rdsq = 0;
                for (int64_t rr = h.row0[k]; rr < h.row0[k] + j.rows; rr++) {
                    e2 += e[rr];
                    dsq += e[d.ld + rr];
                    re2 += e[2 * d.ld + rr];
                    rdsq += e[3 * d.ld + rr];
                }
                j.stats.loss = e2 - f.damp * dsq;
                j.stats.rtn_loss = o->rtn_loss ? re2 - f.damp * rdsq : NAN;
                j.stats.percdamp = f.percdamp;
                j.stats.n_dead = f.n_dead;
            }
        }
    cudaDeviceSynchronize();   /* an error may leave work of the factor streams queued */
    mq_cu_free_async(base, s0);
    return st;
}

}  // namespace

extern "C" moeq_status mq_gpu_gptq_ex(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o, const float *const *H,
                                      const mq_gpu_hsrc *dH, const int64_t *K, const char *const *hnames, int64_t n_h,
                                      mq_gptq_job *jobs, const mq_gpu_wsrc *dW, const int32_t *job_h, int64_t n_jobs) {
    moeq_status st = MOEQ_OK;
    for (int64_t i = 0; i < n_jobs; i++) memset(jobs[i].out, 0, sizeof *jobs[i].out);
    if (o->block_size < 1) return mq_err(MOEQ_E_ARG, "GPTQ block size %d (must be >= 1)", (int)o->block_size);
    if (!(o->percdamp >= 0)) return mq_err(MOEQ_E_ARG, "GPTQ percdamp %g (must be >= 0)", o->percdamp);
    const bool gidx = o->act_order && o->groups == MQ_GPTQ_GROUPS_GIDX;
    const bool loop = s->mse && o->mse_weight == MQ_GPTQ_MSE_LOOP;
    const bool nvfp4 = s->scheme == MQ_QS_NVFP4;
    const double t_start = mq_now();
    profiler prof;
    if ((st = CU(cudaSetDevice(g->device)))) return st;
    auto has_h = [&](int64_t h) { return H[h] || (dH && dH[h].sums); };
    for (int64_t i = 0; i < n_jobs && !st; i++) {
        mq_gptq_job *j = &jobs[i];
        const char *name = j->name ? j->name : "(unnamed)";
        if (job_h[i] < 0 || job_h[i] >= n_h || !has_h(job_h[i])) {
            st = mq_err(MOEQ_E_ARG, "%s: no Hessian", name);
            break;
        }
        const int64_t Kj = K[job_h[i]];
        if (dW && dW[i].mlp) {
            int64_t rows = 0, cols = 0;
            if (!mq_gpu_mlp_shape(dW[i].mlp, dW[i].expert, dW[i].k, &rows, &cols) || rows != j->rows || cols != Kj) {
                st = mq_err(MOEQ_E_SHAPE, "%s: the device weights are not [%lld, %lld]", name, (long long)j->rows,
                            (long long)Kj);
                break;
            }
        }
        if ((st = mq_qtensor_init_unset(j->out, s, j->rows, Kj, name))) break;
        if (gidx && s->scheme != MQ_QS_INT4) {
            st = mq_err(MOEQ_E_UNSUPPORTED, "%s: act-order with g_idx groups needs INT4 (use static or dynamic "
                        "groups with %s)", name, mq_qscheme_name(s->scheme));
            break;
        }
        if (nvfp4 && j->global_scale > 0 && isfinite(j->global_scale)) j->out->global_scale = j->global_scale;
    }
    for (int64_t h = 0; h < n_h && !st; h++)
        if (!H[h] && dH && dH[h].sums) {
            int64_t Kd = 0;
            if (!mq_gpu_hessians_sum(dH[h].sums, dH[h].index, &Kd, NULL) || Kd != K[h])
                st = mq_err(MOEQ_E_SHAPE, "%s: the device Hessian is not %lld x %lld", hnames[h], (long long)K[h],
                            (long long)K[h]);
        }
    prof.mark("host prep");
    /* Waves: Hessians in order with their jobs, as many as fit 85% of the free device memory. */
    /* free memory, with what the stream-ordered pool keeps from earlier calls, under the bound */
    const size_t free_b = st ? 0 : mq_cu_mem_free(g);
    const size_t budget = (size_t)(0.85 * (double)free_b);
    std::vector<std::vector<int64_t>> jobs_of((size_t)n_h);
    for (int64_t i = 0; i < n_jobs; i++) jobs_of[(size_t)job_h[i]].push_back(i);
    int64_t h0 = 0;
    while (!st && h0 < n_h) {
        std::vector<factor> fs;
        std::vector<hset> sets;
        size_t used = 0;
        int64_t h1 = h0;
        for (; h1 < n_h; h1++) {
            if (!has_h(h1) || jobs_of[h1].empty()) continue;
            factor f;
            f.K = K[h1];
            f.stream = (int)(fs.size() % MQ_GPU_STREAMS);
            f.name = hnames[h1];
            f.act_order = o->act_order;
            if (H[h1]) {
                f.H_host = H[h1];
            } else {
                int64_t n = 0;
                f.sum = mq_gpu_hessians_sum(dH[h1].sums, dH[h1].index, NULL, &n);
                f.scale = n > 0 ? 2.0f / (float)n : 0.0f;
            }
            hset h;
            h.f = (int)fs.size();
            h.G = jobs[jobs_of[h1][0]].out->group_size;
            h.ng = K[h1] / h.G;
            for (int64_t j : jobs_of[h1]) {
                h.jobs.push_back(j);
                h.row0.push_back(h.ld);
                h.ld += jobs[j].rows;
            }
            const size_t b = item_bytes(f, h, loop, nvfp4);
            if (!fs.empty() && used + b > budget) break;
            /* the 15% kept back is slack for more items a wave; one item alone may take all that is
             * free (the planner's least counts exactly one) */
            if (fs.empty() && b > free_b) {
                st = mq_err(MOEQ_E_NOMEM, "%s: GPTQ needs %.1f MB of GPU memory; %.1f MB are free", hnames[h1],
                            (double)b / 1e6, (double)free_b / 1e6);
                break;
            }
            used += b;
            fs.push_back(f);
            sets.push_back(h);
        }
        if (!st && !fs.empty()) st = run_wave(g, s, o, fs, sets, jobs, dW);
        if (o->progress_label && !st)
            mq_progress(o->progress_label, o->progress_base + o->progress_span * (h1 < n_h ? h1 : n_h) / (n_h ? n_h : 1),
                        o->progress_total);
        h0 = h1 > h0 ? h1 : h0 + 1;
    }
    const double sec = mq_now() - t_start;
    double work = 0;
    for (int64_t i = 0; i < n_jobs; i++) work += (double)jobs[i].rows * (double)K[job_h[i] >= 0 ? job_h[i] : 0];
    for (int64_t i = 0; i < n_jobs && !st; i++)
        jobs[i].stats.seconds = work > 0 ? sec * (double)jobs[i].rows * (double)K[job_h[i]] / work : 0;
    if (st)
        for (int64_t i = 0; i < n_jobs; i++) mq_qtensor_free(jobs[i].out);
    return st;
}

extern "C" moeq_status mq_gpu_gptq(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o, const float *const *H,
                                   const int64_t *K, const char *const *hnames, int64_t n_h, mq_gptq_job *jobs,
                                   const int32_t *job_h, int64_t n_jobs) {
    return mq_gpu_gptq_ex(g, s, o, H, NULL, K, hnames, n_h, jobs, NULL, job_h, n_jobs);
}
