/*
 * The routed experts' MLPs on the GPU for the pipeline's calibration passes, bit-identical to
 * the CPU's: every product is kernels/gemm_det.h's chain (acc = +0, then acc = fmaf(a_k, b_k,
 * acc) for k = 0 .. K-1 in order) and the SwiGLU is kernels/vec.h's (g / (1 + expf(-g)) * u with
 * moeq's own polynomial expf), so the Hessians and the next layer's inputs do not change.
 *
 * The products are tile_det.cuh's k_det.
 */
#include <string.h>

#include <vector>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/tile_det.cuh"
#include "backend/cuda/vec_dev.cuh"

namespace {

__global__ void k_swiglu(float *g, const float *u, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float x = g[i];
        g[i] = x / (1.0f + mqd::vec_expf(-x)) * u[i];
    }
}

/* x [n, D] = rows src[i] of the inputs [*, D]. */
__global__ void k_gather(float *x, const float *in, const int32_t *src, int64_t n, int64_t D) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * D; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = in[(int64_t)src[i / D] * D + i % D];
}

}  // namespace

/* Experts of a batch run on up to MLP_LANES streams at once (expert e on lane e % lanes), each
 * lane with its own scratch: an expert with few rows fills few SMs even with tile_det.cuh's
 * smaller tiles (its chains over k cannot be split), and each expert's work is independent of the
 * others' (its own Hessian sums, its own rows of the kept outputs), so the lanes change no bit.
 * Lane 0 is stream 0, where everything else of the backend runs; the others start after what
 * stream 0 holds when they are given work, and stream 0 waits for them (mlp_join) before
 * anything that reads their results or reuses their inputs. */
enum { MLP_LANES = 8 };

struct mq_gpu_buf {
    mq_gpu *g;
    float *d;
    int64_t n;
};

float *mq_gpu_buf_device(mq_gpu_buf *b, int64_t *n) {
    if (n) *n = b ? b->n : 0;
    return b ? b->d : NULL;
}

struct mlp_lane {
    float *x, *hg, *hu, *y;   /* [max_rows] rows of scratch */
    int32_t *src;             /* [max_rows] a chunk's row indices into `in` */
    cudaEvent_t done;         /* recorded after the lane's last work (lanes 1..) */
    bool pending;             /* work since the last join */
};

struct mq_gpu_mlp {
    mq_gpu *g;
    int64_t E, D, F, max_rows;
    std::vector<float *> w;   /* [3E]: gate, up, down of each expert (down may be NULL) */
    mlp_lane lane[MLP_LANES];
    int n_lanes;
    cudaEvent_t fork;         /* stream 0's work a lane must follow */
    float *yk;                /* [yk_cap, D] the batch's outputs kept for the combine, or NULL */
    int64_t yk_cap;
    float *in;                /* mq_gpu_mlp_inputs' rows, or a buffer's (in_ext: not ours) */
    int64_t in_rows, in_cap;
    bool in_ext;
    int32_t *idx;             /* [idx_n] a batch's row indices into `in` (mq_gpu_mlp_rows_index) */
    int64_t idx_n, idx_cap;
    char *pairs;              /* [pairs_cap] the combine's index arrays */
    size_t pairs_cap;
    mq_cu_stage idx_up, pairs_up;   /* their uploads, which do not wait for the experts' work */
};

namespace {

/* Stream 0 after every lane's work so far. */
moeq_status mlp_join(mq_gpu_mlp *m) {
    moeq_status st = MOEQ_OK;
    for (int j = 1; j < m->n_lanes && !st; j++)
        if (m->lane[j].pending) {
            st = CU(cudaStreamWaitEvent(m->g->stream[0], m->lane[j].done, 0));
            m->lane[j].pending = false;
        }
    return st;
}

moeq_status lane_alloc(mlp_lane *l, size_t r, int64_t D, int64_t F) {
    moeq_status st = cu_alloc(&l->x, r * (size_t)D, "expert rows");
    if (!st) st = cu_alloc(&l->hg, r * (size_t)F, "expert activations");
    if (!st) st = cu_alloc(&l->hu, r * (size_t)F, "expert activations");
    if (!st) st = cu_alloc(&l->y, r * (size_t)D, "expert outputs");
    if (!st) st = cu_alloc(&l->src, r, "expert row indices");
    return st;
}

void lane_free(mlp_lane *l) {
    mq_cu_free(l->x);
    mq_cu_free(l->hg);
    mq_cu_free(l->hu);
    mq_cu_free(l->y);
    mq_cu_free(l->src);
    if (l->done) cudaEventDestroy(l->done);
    memset(l, 0, sizeof *l);
}

}  // namespace

extern "C" moeq_status mq_gpu_mlp_join(mq_gpu_mlp *m) {
    moeq_status st = CU(cudaSetDevice(m->g->device));
    return st ? st : mlp_join(m);
}

extern "C" void mq_gpu_mlp_free(mq_gpu_mlp *m) {
    if (!m) return;
    cudaSetDevice(m->g->device);
    mlp_join(m);
    cudaStreamSynchronize(m->g->stream[0]);
    for (float *p : m->w) mq_cu_free(p);
    for (int j = 0; j < MLP_LANES; j++) lane_free(&m->lane[j]);
    if (m->fork) cudaEventDestroy(m->fork);
    mq_cu_free(m->yk);
    if (!m->in_ext) mq_cu_free(m->in);
    mq_cu_free(m->idx);
    mq_cu_free(m->pairs);
    mq_cu_stage_free(&m->idx_up);
    mq_cu_stage_free(&m->pairs_up);
    delete m;
}

extern "C" moeq_status mq_gpu_mlp_new(mq_gpu *g, int64_t E, int64_t D, int64_t F, const float *const *gate,
                                      const float *const *up, const float *const *down, int64_t max_rows,
                                      mq_gpu_mlp **out) {
    *out = NULL;
    moeq_status st = CU(cudaSetDevice(g->device));
    if (st) return st;
    mq_gpu_mlp *m = new (std::nothrow) mq_gpu_mlp;
    if (!m) return mq_err(MOEQ_E_NOMEM, "out of memory");
    m->g = g;
    m->E = E;
    m->D = D;
    m->F = F;
    m->max_rows = max_rows > 0 ? max_rows : 1;
    m->w.assign((size_t)(3 * E), NULL);
    memset(m->lane, 0, sizeof m->lane);
    m->n_lanes = 0;
    m->fork = NULL;
    m->yk = m->in = NULL;
    m->yk_cap = 0;
    m->in_rows = m->in_cap = 0;
    m->in_ext = false;
    m->idx = NULL;
    m->idx_n = m->idx_cap = 0;
    m->pairs = NULL;
    m->pairs_cap = 0;
    memset(&m->idx_up, 0, sizeof m->idx_up);
    memset(&m->pairs_up, 0, sizeof m->pairs_up);
    const size_t wsz = (size_t)(D * F);
    std::vector<void *> dst;
    std::vector<const void *> src;
    std::vector<size_t> bytes;
    try {
        for (int64_t e = 0; e < E && !st; e++) {
            const float *w[3] = {gate[e], up[e], down ? down[e] : NULL};
            for (int k = 0; k < 3 && !st; k++) {
                if (!w[k]) continue;
                st = cu_alloc(&m->w[(size_t)(3 * e + k)], wsz, "expert weights");
                dst.push_back(m->w[(size_t)(3 * e + k)]);
                src.push_back(w[k]);
                bytes.push_back(wsz * sizeof(float));
            }
        }
    } catch (const std::bad_alloc &) {
        st = mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    /* all of them at once: one 8 MB weight at a time left the bus idle while the next was copied
     * into pinned memory (0.18 s for OLMoE-1B-7B's 64 experts on the H200) */
    if (!st) st = mq_cu_upload_many(g, (int64_t)dst.size(), dst.data(), src.data(), bytes.data());
    const size_t r = (size_t)m->max_rows;
    if (!st) st = lane_alloc(&m->lane[0], r, D, F);
    if (!st) st = CU(cudaEventCreateWithFlags(&m->fork, cudaEventDisableTiming));
    if (!st) m->n_lanes = 1;
    /* more lanes where they take at most a quarter of the free memory (with several experts) */
    const size_t lane_bytes = r * (size_t)(2 * D + 2 * F) * sizeof(float) + r * sizeof(int32_t);
    size_t free_b = 0, total_b = 0;
    if (!st && E > 1 && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
        while (m->n_lanes < MLP_LANES && m->n_lanes < E && lane_bytes * (size_t)(MLP_LANES - 1) * 4 <= free_b) {
            mlp_lane *l = &m->lane[m->n_lanes];
            if ((st = lane_alloc(l, r, D, F))) break;
            if ((st = CU(cudaEventCreateWithFlags(&l->done, cudaEventDisableTiming)))) break;
            m->n_lanes++;
        }
    if (st) {
        mq_gpu_mlp_free(m);
        return st;
    }
    *out = m;
    return MOEQ_OK;
}

namespace {

/* Expert e on n rows, max_rows at a time: each chunk's rows into the lane.s x (from the host's x, or
 * gathered from m->in by src), then the products, the Hessian sums and the copies asked for. */
moeq_status mlp_rows(mq_gpu_mlp *m, int64_t e, const float *x, const int32_t *src, int64_t n, float *hg, float *hu,
                     float *y, mq_gpu_hessians *h_in, mq_gpu_hessians *h_down, int64_t y0 = -1,
                     const int32_t *dsrc = NULL) {
    if (e < 0 || e >= m->E) return mq_err(MOEQ_E_ARG, "GPU experts: expert %lld of %lld", (long long)e, (long long)m->E);
    if (n <= 0) return MOEQ_OK;
    const bool kept = y0 >= 0;
    if ((y || kept) && !m->w[(size_t)(3 * e + 2)])
        return mq_err(MOEQ_E_ARG, "GPU experts: expert %lld has no down weights", (long long)e);
    if (kept && !m->yk) {
        moeq_status a = mq_gpu_mlp_reserve_kept(m, m->max_rows);
        if (a) return a;
    }
    if (kept && y0 + n > m->yk_cap)
        return mq_err(MOEQ_E_ARG, "GPU experts: rows %lld..%lld past the batch's %lld", (long long)y0,
                      (long long)(y0 + n), (long long)m->yk_cap);
    /* rows gathered on the device run on the expert's lane; host rows on lane 0 */
    const int j = src || dsrc ? (int)(e % m->n_lanes) : 0;
    mlp_lane *L = &m->lane[j];
    cudaStream_t s = m->g->stream[j];
    const int64_t D = m->D, F = m->F;
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st && j > 0) {   /* after stream 0's work so far (the inputs, the sums' zeroing) */
        st = CU(cudaEventRecord(m->fork, m->g->stream[0]));
        if (!st) st = CU(cudaStreamWaitEvent(s, m->fork, 0));
    }
    for (int64_t r0 = 0; r0 < n && !st; r0 += m->max_rows) {
        const int64_t k = n - r0 < m->max_rows ? n - r0 : m->max_rows;
        if (dsrc) {   /* indices already on the device, checked when they went up */
            const int64_t b = (k * D + 255) / 256;
            k_gather<<<(unsigned)(b < 8192 ? b : 8192), 256, 0, s>>>(L->x, m->in, dsrc + r0, k, D);
            st = CU_LAUNCHED("k_gather");
        } else if (src) {
            for (int64_t i = 0; i < k && !st; i++)
                if (src[r0 + i] < 0 || src[r0 + i] >= m->in_rows)
                    st = mq_err(MOEQ_E_ARG, "GPU experts: row %lld of %lld inputs", (long long)src[r0 + i],
                                (long long)m->in_rows);
            if (!st) st = CU(cudaMemcpyAsync(L->src, src + r0, (size_t)k * sizeof(int32_t), cudaMemcpyHostToDevice, s));
            if (!st) {
                const int64_t b = (k * D + 255) / 256;
                k_gather<<<(unsigned)(b < 8192 ? b : 8192), 256, 0, s>>>(L->x, m->in, L->src, k, D);
                st = CU_LAUNCHED("k_gather");
            }
        } else {
            st = CU(cudaMemcpyAsync(L->x, x + r0 * D, (size_t)(k * D) * sizeof(float), cudaMemcpyHostToDevice, s));
        }
        if (!st && h_in) st = mq_gpu_hessians_add_device(h_in, 0, L->x, k, s);
        if (!st) st = mq_cu_product(m->g, j, k, F, D, L->x, m->w[(size_t)(3 * e)], L->hg, F);
        if (!st) st = mq_cu_product(m->g, j, k, F, D, L->x, m->w[(size_t)(3 * e + 1)], L->hu, F);
        if (!st) {
            k_swiglu<<<1024, 256, 0, s>>>(L->hg, L->hu, k * F);
            st = CU_LAUNCHED("k_swiglu");
        }
        if (!st && h_down) st = mq_gpu_hessians_add_device(h_down, 0, L->hg, k, s);
        if (!st && (y || kept))
            st = mq_cu_product(m->g, j, k, D, F, L->hg, m->w[(size_t)(3 * e + 2)], kept ? m->yk + (y0 + r0) * D : L->y, D);
        if (!st && hg) st = CU(cudaMemcpyAsync(hg + r0 * F, L->hg, (size_t)(k * F) * sizeof(float), cudaMemcpyDeviceToHost, s));
        if (!st && hu) st = CU(cudaMemcpyAsync(hu + r0 * F, L->hu, (size_t)(k * F) * sizeof(float), cudaMemcpyDeviceToHost, s));
        if (!st && y && !kept) st = CU(cudaMemcpyAsync(y + r0 * D, L->y, (size_t)(k * D) * sizeof(float), cudaMemcpyDeviceToHost, s));
    }
    /* the stream runs the chunks in order (a chunk's L->src and L->x are overwritten after the
     * last kernel that reads them); only copies into host memory are waited for. Pageable copies
     * from the host return once they have taken the host's data, but only when the stream has
     * done its work so far: the host waits there, so the lanes overlap only with dsrc. */
    if (!st && (hg || hu || (y && !kept))) st = CU(cudaStreamSynchronize(s));
    if (!st && j > 0) {
        st = CU(cudaEventRecord(L->done, s));
        L->pending = true;
    }
    return st;
}

}  // namespace

extern "C" moeq_status mq_gpu_mlp_run(mq_gpu_mlp *m, int64_t e, const float *x, int64_t n, float *hg, float *hu,
                                      float *y, mq_gpu_hessians *h_in, mq_gpu_hessians *h_down) {
    return mlp_rows(m, e, x, NULL, n, hg, hu, y, h_in, h_down);
}

extern "C" moeq_status mq_gpu_mlp_reserve_kept(mq_gpu_mlp *m, int64_t rows) {
    if (rows <= m->yk_cap && m->yk) return MOEQ_OK;
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st) st = mlp_join(m);
    if (!st) st = CU(cudaStreamSynchronize(m->g->stream[0]));   /* a combine may still read it */
    if (st) return st;
    mq_cu_free(m->yk);
    m->yk = NULL;
    m->yk_cap = 0;
    st = cu_alloc(&m->yk, (size_t)((rows > 0 ? rows : 1) * m->D), "expert outputs");
    if (!st) m->yk_cap = rows > 0 ? rows : 1;
    return st;
}

extern "C" moeq_status mq_gpu_mlp_rows_index(mq_gpu_mlp *m, const int32_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= m->in_rows)
            return mq_err(MOEQ_E_ARG, "GPU experts: row %lld of %lld inputs", (long long)src[i], (long long)m->in_rows);
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st) st = mlp_join(m);   /* the lanes may still read the last batch's */
    if (!st && n > m->idx_cap) {
        mq_cu_free(m->idx);   /* synchronises the device */
        m->idx = NULL;
        m->idx_cap = 0;
        if ((st = cu_alloc(&m->idx, (size_t)n, "expert row indices"))) return st;
        m->idx_cap = n;
    }
    /* in stream order behind the lanes' work (joined above), without waiting for it */
    if (!st && n > 0) st = mq_cu_stage_upload(&m->idx_up, m->g->stream[0], m->idx, src, (size_t)n * sizeof(int32_t));
    m->idx_n = st ? 0 : n;
    return st;
}

extern "C" moeq_status mq_gpu_mlp_run_indexed(mq_gpu_mlp *m, int64_t e, int64_t r0, int64_t n, bool keep,
                                              mq_gpu_hessians *h_in, mq_gpu_hessians *h_down) {
    if (r0 < 0 || n < 0 || r0 + n > m->idx_n)
        return mq_err(MOEQ_E_ARG, "GPU experts: indexed rows %lld..%lld of %lld", (long long)r0, (long long)(r0 + n),
                      (long long)m->idx_n);
    return mlp_rows(m, e, NULL, NULL, n, NULL, NULL, NULL, h_in, h_down, keep ? r0 : -1, m->idx + r0);
}

extern "C" moeq_status mq_gpu_mlp_inputs_reserve(mq_gpu_mlp *m, int64_t rows) {
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st) st = mlp_join(m);
    if (!st) st = CU(cudaStreamSynchronize(m->g->stream[0]));   /* a previous batch may still read `in` */
    if (!st && m->in_ext) {   /* a buffer's rows: not ours to free */
        m->in = NULL;
        m->in_ext = false;
        m->in_cap = 0;
    }
    if (!st && rows > m->in_cap) {
        mq_cu_free(m->in);
        m->in = NULL;
        m->in_cap = 0;
        if ((st = cu_alloc(&m->in, (size_t)(rows * m->D), "expert inputs"))) return st;
        m->in_cap = rows;
    }
    m->in_rows = st ? 0 : rows;
    return st;
}

extern "C" moeq_status mq_gpu_mlp_inputs_from(mq_gpu_mlp *m, mq_gpu_buf *b, int64_t rows) {
    int64_t n = 0;
    float *d = mq_gpu_buf_device(b, &n);
    if (rows < 0 || rows * m->D > n)
        return mq_err(MOEQ_E_ARG, "GPU experts: %lld input rows of %lld values in a buffer of %lld", (long long)rows,
                      (long long)m->D, (long long)n);
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st && m->in_ext && m->in == d) {   /* the same buffer again: nothing to wait for */
        m->in_cap = m->in_rows = rows;
        return MOEQ_OK;
    }
    if (!st) st = mlp_join(m);
    if (!st) st = CU(cudaStreamSynchronize(m->g->stream[0]));   /* a previous batch may still read `in` */
    if (st) return st;
    if (!m->in_ext) mq_cu_free(m->in);
    m->in = d;
    m->in_ext = true;
    m->in_cap = m->in_rows = rows;
    return MOEQ_OK;
}

extern "C" moeq_status mq_gpu_mlp_inputs_put(mq_gpu_mlp *m, int64_t row0, const float *x, int64_t n) {
    if (m->in_ext) return mq_err(MOEQ_E_ARG, "GPU experts: inputs put into a buffer's rows");
    if (row0 < 0 || n < 0 || row0 + n > m->in_rows)
        return mq_err(MOEQ_E_ARG, "GPU experts: input rows %lld..%lld of %lld", (long long)row0, (long long)(row0 + n),
                      (long long)m->in_rows);
    if (n == 0) return MOEQ_OK;
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st) st = mlp_join(m);
    if (!st) st = mq_cu_upload(m->g, m->in + row0 * m->D, x, (size_t)(n * m->D) * sizeof(float));
    return st;
}

extern "C" moeq_status mq_gpu_mlp_inputs(mq_gpu_mlp *m, const float *const *x, const int64_t *rows, int64_t n_x) {
    int64_t total = 0;
    for (int64_t i = 0; i < n_x; i++) total += rows[i];
    moeq_status st = mq_gpu_mlp_inputs_reserve(m, total);
    int64_t at = 0;
    for (int64_t i = 0; i < n_x && !st; i++) {
        st = mq_gpu_mlp_inputs_put(m, at, x[i], rows[i]);
        at += rows[i];
    }
    if (st) m->in_rows = 0;
    return st;
}

extern "C" moeq_status mq_gpu_mlp_run_rows(mq_gpu_mlp *m, int64_t e, const int32_t *src, int64_t n, float *hg,
                                           float *hu, float *y, mq_gpu_hessians *h_in, mq_gpu_hessians *h_down) {
    return mlp_rows(m, e, NULL, src, n, hg, hu, y, h_in, h_down);
}

extern "C" moeq_status mq_gpu_gemm_det(mq_gpu *g, int64_t M, int64_t N, int64_t K, const float *A, const float *B,
                                       float *C) {
    float *a = NULL, *b = NULL, *c = NULL;
    cudaStream_t s = g->stream[0];
    moeq_status st = CU(cudaSetDevice(g->device));
    if (!st) st = cu_alloc(&a, (size_t)(M * K), "GEMM input");
    if (!st) st = cu_alloc(&b, (size_t)(N * K), "GEMM input");
    if (!st) st = cu_alloc(&c, (size_t)(M * N), "GEMM output");
    if (!st) st = CU(cudaMemcpyAsync(a, A, (size_t)(M * K) * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaMemcpyAsync(b, B, (size_t)(N * K) * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = mq_cu_product_det(g, s, M, N, K, a, b, c, N);
    if (!st) st = CU(cudaMemcpyAsync(C, c, (size_t)(M * N) * sizeof(float), cudaMemcpyDeviceToHost, s));
    if (!st) st = CU(cudaStreamSynchronize(s));
    mq_cu_free(a);
    mq_cu_free(b);
    mq_cu_free(c);
    return st;
}

float *mq_gpu_mlp_weight(mq_gpu_mlp *m, int64_t e, int k) {
    if (!m || e < 0 || e >= m->E || k < 0 || k > 2) return NULL;
    return m->w[(size_t)(3 * e + k)];
}

mq_gpu *mq_gpu_mlp_gpu(const mq_gpu_mlp *m) { return m ? m->g : NULL; }

mq_gpu *mq_gpu_buf_gpu(const mq_gpu_buf *b) { return b ? b->g : NULL; }

float *mq_gpu_mlp_kept(mq_gpu_mlp *m, int64_t *rows, int64_t *D) {
    if (rows) *rows = m && m->yk ? m->yk_cap : 0;
    if (D) *D = m ? m->D : 0;
    return m ? m->yk : NULL;
}

bool mq_gpu_mlp_shape(const mq_gpu_mlp *m, int64_t e, int k, int64_t *rows, int64_t *cols) {
    if (!m || e < 0 || e >= m->E || k < 0 || k > 2 || !m->w[(size_t)(3 * e + k)]) return false;
    *rows = k == 2 ? m->D : m->F;
    *cols = k == 2 ? m->F : m->D;
    return true;
}

extern "C" moeq_status mq_gpu_mlp_read(mq_gpu_mlp *m, int64_t e, int k, float *out) {
    const float *w = mq_gpu_mlp_weight(m, e, k);
    if (!w) return mq_err(MOEQ_E_ARG, "GPU experts: no weights %d of expert %lld", k, (long long)e);
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st) st = mlp_join(m);
    if (!st) st = CU(cudaStreamSynchronize(m->g->stream[0]));
    if (!st) st = CU(cudaMemcpy(out, w, (size_t)(m->D * m->F) * sizeof(float), cudaMemcpyDeviceToHost));
    return st;
}

extern "C" moeq_status mq_gpu_mlp_set(mq_gpu_mlp *m, int64_t e, int k, const float *w) {
    float *d = mq_gpu_mlp_weight(m, e, k);
    if (!d) return mq_err(MOEQ_E_ARG, "GPU experts: no weights %d of expert %lld", k, (long long)e);
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st) st = mlp_join(m);
    if (!st) st = CU(cudaStreamSynchronize(m->g->stream[0]));   /* no pass still reads them */
    if (!st) st = mq_cu_upload(m->g, d, w, (size_t)(m->D * m->F) * sizeof(float));
    return st;
}

extern "C" moeq_status mq_gpu_buf_new(mq_gpu *g, int64_t n, mq_gpu_buf **out) {
    *out = NULL;
    mq_gpu_buf *b = new (std::nothrow) mq_gpu_buf;
    if (!b) return mq_err(MOEQ_E_NOMEM, "out of memory");
    b->g = g;
    b->n = n;
    b->d = NULL;
    moeq_status st = CU(cudaSetDevice(g->device));
    if (!st) st = cu_alloc(&b->d, (size_t)(n > 0 ? n : 1), "FFN outputs");
    if (!st) st = CU(cudaMemsetAsync(b->d, 0, (size_t)n * sizeof(float), g->stream[0]));
    if (st) {
        mq_gpu_buf_free(b);
        return st;
    }
    *out = b;
    return MOEQ_OK;
}

extern "C" void mq_gpu_buf_free(mq_gpu_buf *b) {
    if (!b) return;
    cudaSetDevice(b->g->device);
    cudaStreamSynchronize(b->g->stream[0]);
    mq_cu_free(b->d);
    delete b;
}

extern "C" moeq_status mq_gpu_buf_read_async(mq_gpu_buf *b, int64_t off, int64_t n, float *host) {
    if (off < 0 || n < 0 || off + n > b->n)
        return mq_err(MOEQ_E_ARG, "GPU buffer: values %lld..%lld of %lld", (long long)off, (long long)(off + n),
                      (long long)b->n);
    moeq_status st = CU(cudaSetDevice(b->g->device));
    if (!st) st = CU(cudaMemcpyAsync(host, b->d + off, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost, b->g->stream[0]));
    return st;
}

extern "C" moeq_status mq_gpu_buf_read(mq_gpu_buf *b, int64_t off, int64_t n, float *host) {
    moeq_status st = mq_gpu_buf_read_async(b, off, n, host);
    if (!st) st = CU(cudaStreamSynchronize(b->g->stream[0]));
    return st;
}

extern "C" moeq_status mq_gpu_buf_write(mq_gpu_buf *b, int64_t off, int64_t n, const float *host) {
    if (off < 0 || n < 0 || off + n > b->n)
        return mq_err(MOEQ_E_ARG, "GPU buffer: values %lld..%lld of %lld", (long long)off, (long long)(off + n),
                      (long long)b->n);
    moeq_status st = CU(cudaSetDevice(b->g->device));
    if (!st) st = mq_cu_upload(b->g, b->d + off, host, (size_t)n * sizeof(float));
    if (!st) st = CU(cudaStreamSynchronize(b->g->stream[0]));   /* the host's data has gone */
    return st;
}

namespace {
__global__ void k_buf_add(float *d, const float *s, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        d[i] = s[i] + d[i];
}
}  // namespace

extern "C" moeq_status mq_gpu_buf_add(mq_gpu_buf *dst, const mq_gpu_buf *src, int64_t n) {
    if (n < 0 || n > dst->n || n > src->n)
        return mq_err(MOEQ_E_ARG, "GPU buffers: adding %lld values of buffers of %lld and %lld", (long long)n,
                      (long long)dst->n, (long long)src->n);
    moeq_status st = CU(cudaSetDevice(dst->g->device));
    if (st || n == 0) return st;
    const int64_t blocks = (n + 255) / 256 < 65536 ? (n + 255) / 256 : 65536;
    k_buf_add<<<(unsigned)blocks, 256, 0, dst->g->stream[0]>>>(dst->d, src->d, n);
    return CU_LAUNCHED("k_buf_add");
}

namespace {

/* Thread per (token, value): the token's pairs in order, one fmaf each (vec.h's axpy). */
__global__ void k_combine(float *out, const float *y, const int64_t *tok, const int32_t *first, const int32_t *row,
                          const float *w, int64_t n_tok, int64_t D) {
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n_tok * D;
         k += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = k / D, d = k % D;
        float *o = out + tok[i] * D + d;
        float acc = *o;
        for (int32_t p = first[i]; p < first[i + 1]; p++) acc = fmaf(w[p], y[(int64_t)row[p] * D + d], acc);
        *o = acc;
    }
}

}  // namespace

extern "C" moeq_status mq_gpu_mlp_combine(mq_gpu_mlp *m, mq_gpu_buf *out, const int64_t *tok, const int32_t *first,
                                          const int32_t *row, const float *w, int64_t n_tok) {
    if (n_tok <= 0) return MOEQ_OK;
    if (!m->yk) return mq_err(MOEQ_E_ARG, "GPU experts: no kept outputs to combine");
    const int64_t D = m->D, np = first[n_tok];
    for (int64_t i = 0; i < n_tok; i++)
        if (tok[i] < 0 || (tok[i] + 1) * D > out->n)
            return mq_err(MOEQ_E_ARG, "GPU combine: output row %lld past the buffer", (long long)tok[i]);
    for (int64_t p = 0; p < np; p++)
        if (row[p] < 0 || row[p] >= m->yk_cap)
            return mq_err(MOEQ_E_ARG, "GPU combine: row %d past the batch's %lld", row[p], (long long)m->yk_cap);
    cudaStream_t s = m->g->stream[0];
    /* the index arrays travel in one piece: tok, first, row, w */
    const size_t bt = (size_t)n_tok * 8, bf = (size_t)(n_tok + 1) * 4, br = (size_t)np * 4, bw = (size_t)np * 4;
    const size_t at_f = (bt + 15) & ~(size_t)15, at_r = (at_f + bf + 15) & ~(size_t)15, at_w = (at_r + br + 15) & ~(size_t)15;
    const size_t total = at_w + bw;
    std::vector<char> h(total);
    memcpy(h.data(), tok, bt);
    memcpy(h.data() + at_f, first, bf);
    memcpy(h.data() + at_r, row, br);
    memcpy(h.data() + at_w, w, bw);
    moeq_status st = CU(cudaSetDevice(m->g->device));
    if (!st) st = mlp_join(m);   /* the lanes' outputs */
    if (!st && total > m->pairs_cap) {   /* kept from batch to batch (stream order) */
        mq_cu_free(m->pairs);   /* synchronises the device */
        m->pairs = NULL;
        m->pairs_cap = 0;
        const size_t cap = total + total / 4;
        if (!(st = cu_alloc(&m->pairs, cap, "combine indices"))) m->pairs_cap = cap;
    }
    char *d = m->pairs;
    if (!st) st = mq_cu_stage_upload(&m->pairs_up, s, d, h.data(), total);
    if (!st) {
        const int64_t blocks = (n_tok * D + 255) / 256;
        k_combine<<<(unsigned)(blocks < 65535 ? blocks : 65535), 256, 0, s>>>(
            out->d, m->yk, (const int64_t *)d, (const int32_t *)(d + at_f), (const int32_t *)(d + at_r),
            (const float *)(d + at_w), n_tok, D);
        st = CU_LAUNCHED("k_combine");
    }
    return st;
}

extern "C" moeq_status mq_gpu_buf_copy(mq_gpu_buf *dst, int64_t dst_off, const mq_gpu_buf *src, int64_t src_off,
                                       int64_t n) {
    if (!dst || !src || n < 0 || dst_off < 0 || src_off < 0 || dst_off + n > dst->n || src_off + n > src->n)
        return mq_err(MOEQ_E_ARG, "GPU buffer copy: %lld values from %lld of %lld into %lld of %lld", (long long)n,
                      (long long)src_off, (long long)(src ? src->n : 0), (long long)dst_off,
                      (long long)(dst ? dst->n : 0));
    if (n == 0) return MOEQ_OK;
    moeq_status st = CU(cudaSetDevice(dst->g->device));
    if (!st)
        st = CU(cudaMemcpyAsync(dst->d + dst_off, src->d + src_off, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice,
                                dst->g->stream[0]));
    return st;
}
