/*
 * The attention of generation on the GPU (backend/gpu.h, mq_gpu_kvattn_*): src/model/forward.c's
 * attention_block for n new tokens at positions p0 .. p0 + n - 1 over a KV cache kept on the
 * device, every layer of a model resident in one object (its weights and caches; one scratch for
 * whichever layer runs).
 *
 * What a layer runs, in the CPU forward's order, is kvattn_kernels.cuh's kv_layer_steps (its
 * kernels and their launches), which the SIMT emulator also runs on the host (kvattn_emu.cu, the
 * tests of machines without a GPU); here its products are mq_cu_product's (the precision mode's:
 * fp32 fmaf chains by default) and its kernels go on stream 0.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <new>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/kvattn_kernels.cuh"

namespace {

typedef KvLayer Layer;

/* kv_layer_steps on the device: kernels queued on stream 0, the products mq_cu_product's. */
struct CudaDev {
    mq_gpu *g;
    template <class... P, class... A>
    moeq_status launch(const char *name, void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
        kernel<<<grid, block, 0, g->stream[0]>>>(args...);
        return CU_LAUNCHED(name);
    }
    moeq_status product(int64_t M, int64_t N, int64_t K, const float *A, const float *B, float *C, int64_t ldc) {
        return mq_cu_product(g, 0, M, N, K, A, B, C, ldc);
    }
};

}  // namespace

struct mq_gpu_kvattn {
    mq_gpu *g;
    mq_gpu_attn_shape sh;
    int n_layers;
    Layer *layers;
    int64_t QD, KVD, rows;
    float *cos_t, *sin_t;             /* [max_T, hd / 2] */
    float *xn, *q, *att, *y, *S;      /* [rows, D], [rows, QD] x2, [rows, D], [rows * H, max_T] */
    int32_t *pos;                     /* [rows] */
    float *logits, *rw;               /* [rows, E], [rows, top_k] (with routing) */
    int32_t *rsel;                    /* [rows, top_k] */
};

static void layer_free(Layer *L) {
    float *bufs[] = {L->norm, L->wq, L->wk, L->wv, L->wo, L->bq, L->bk, L->bv, L->bo, L->qn, L->kn, L->fnorm,
                     L->router, L->kc, L->vc};
    for (float *p : bufs) mq_cu_free(p);
}

extern "C" void mq_gpu_kvattn_free(mq_gpu_kvattn *a) {
    if (!a) return;
    cudaSetDevice(a->g->device);
    cudaStreamSynchronize(a->g->stream[0]);
    if (a->layers)
        for (int l = 0; l < a->n_layers; l++) layer_free(&a->layers[l]);
    delete[] a->layers;
    float *bufs[] = {a->cos_t, a->sin_t, a->xn, a->q, a->att, a->y, a->S, a->logits, a->rw};
    for (float *p : bufs) mq_cu_free(p);
    mq_cu_free(a->pos);
    mq_cu_free(a->rsel);
    delete a;
}

extern "C" int64_t mq_gpu_kvattn_rows(const mq_gpu_kvattn *a) { return a->rows; }

extern "C" moeq_status mq_gpu_kvattn_new(mq_gpu *g, const mq_gpu_attn_shape *sh, int n_layers, int64_t rows,
                                         mq_gpu_kvattn **out) {
    *out = NULL;
    if (sh->D <= 0 || sh->H <= 0 || sh->KV <= 0 || sh->hd <= 0 || sh->hd % 2 || sh->H % sh->KV || sh->max_T <= 0 ||
        n_layers <= 0 || !sh->rope_cos || !sh->rope_sin)
        return mq_err(MOEQ_E_SHAPE, "GPU KV attention: D %lld, %lld heads, %lld KV heads, head dim %lld, %lld positions, "
                      "%d layers", (long long)sh->D, (long long)sh->H, (long long)sh->KV, (long long)sh->hd,
                      (long long)sh->max_T, n_layers);
    moeq_status st = CU(cudaSetDevice(g->device));
    if (st) return st;
    mq_gpu_kvattn *a = new (std::nothrow) mq_gpu_kvattn;
    if (!a) return mq_err(MOEQ_E_NOMEM, "out of memory");
    memset((void *)a, 0, sizeof *a);
    a->g = g;
    a->sh = *sh;
    a->sh.rope_cos = a->sh.rope_sin = NULL;
    a->n_layers = n_layers;
    a->QD = sh->H * sh->hd;
    a->KVD = sh->KV * sh->hd;
    a->rows = mq_gpu_kvattn_rows_for(sh, rows);
    a->layers = new (std::nothrow) Layer[n_layers];
    if (!a->layers) {
        delete a;
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    memset((void *)a->layers, 0, sizeof(Layer) * (size_t)n_layers);
    const int64_t D = sh->D, R = a->rows, T = sh->max_T, QD = a->QD, KVD = a->KVD;
    const size_t half_tab = (size_t)(T * (sh->hd / 2));
    if (!st) st = cu_alloc(&a->cos_t, half_tab, "RoPE table");
    if (!st) st = cu_alloc(&a->sin_t, half_tab, "RoPE table");
    if (!st) st = cu_alloc(&a->xn, (size_t)(R * D), "attention input");
    if (!st) st = cu_alloc(&a->q, (size_t)(R * QD), "queries");
    if (!st) st = cu_alloc(&a->att, (size_t)(R * QD), "attention output");
    if (!st) st = cu_alloc(&a->y, (size_t)(R * D), "o_proj output");
    if (!st) st = cu_alloc(&a->S, (size_t)(R * sh->H * T), "attention scores");
    if (!st) st = cu_alloc(&a->pos, (size_t)R, "token positions");
    if (!st && sh->E > 0 && sh->top_k > 0) {
        st = cu_alloc(&a->logits, (size_t)(R * sh->E), "router logits");
        if (!st) st = cu_alloc(&a->rw, (size_t)(R * sh->top_k), "routing weights");
        if (!st) st = cu_alloc(&a->rsel, (size_t)(R * sh->top_k), "routing");
    }
    for (int l = 0; l < n_layers && !st; l++) {
        Layer *L = &a->layers[l];
        char what[64];
        snprintf(what, sizeof what, "layer %d attention weights", l);
        st = cu_alloc(&L->norm, (size_t)D, what);
        if (!st) st = cu_alloc(&L->wq, (size_t)(QD * D), what);
        if (!st) st = cu_alloc(&L->wk, (size_t)(KVD * D), what);
        if (!st) st = cu_alloc(&L->wv, (size_t)(KVD * D), what);
        if (!st) st = cu_alloc(&L->wo, (size_t)(D * QD), what);
        if (!st) st = cu_alloc(&L->bq, (size_t)QD, what);
        if (!st) st = cu_alloc(&L->bk, (size_t)KVD, what);
        if (!st) st = cu_alloc(&L->bv, (size_t)KVD, what);
        if (!st) st = cu_alloc(&L->bo, (size_t)D, what);
        if (!st) st = cu_alloc(&L->qn, (size_t)QD, what);
        if (!st) st = cu_alloc(&L->kn, (size_t)KVD, what);
        if (!st) st = cu_alloc(&L->fnorm, (size_t)D, what);
        snprintf(what, sizeof what, "layer %d KV cache", l);
        if (!st) st = cu_alloc(&L->kc, (size_t)(T * KVD), what);
        if (!st) st = cu_alloc(&L->vc, (size_t)(T * KVD), what);
    }
    cudaStream_t s = g->stream[0];
    if (!st) st = CU(cudaMemcpyAsync(a->cos_t, sh->rope_cos, half_tab * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaMemcpyAsync(a->sin_t, sh->rope_sin, half_tab * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaStreamSynchronize(s));
    if (st) {
        mq_gpu_kvattn_free(a);
        return st;
    }
    *out = a;
    return MOEQ_OK;
}

extern "C" moeq_status mq_gpu_kvattn_set(mq_gpu_kvattn *a, int l, const mq_gpu_attn_weights *w) {
    if (l < 0 || l >= a->n_layers) return mq_err(MOEQ_E_ARG, "GPU KV attention: layer %d of %d", l, a->n_layers);
    const mq_gpu_attn_shape *sh = &a->sh;
    const int64_t D = sh->D, QD = a->QD, KVD = a->KVD, hd = sh->hd;
    const int64_t qn = sh->qk_norm == 1 ? QD : hd, kn = sh->qk_norm == 1 ? KVD : hd;
    if (!w->norm || !w->ffn_norm || (sh->qk_norm && (!w->q_norm || !w->k_norm)))
        return mq_err(MOEQ_E_ARG, "GPU KV attention: layer %d: a weight is missing", l);
    if (w->router && !(sh->E > 0 && sh->top_k > 0))
        return mq_err(MOEQ_E_ARG, "GPU KV attention: layer %d has a router, but the shape no experts", l);
    Layer *L = &a->layers[l];
    moeq_status st = CU(cudaSetDevice(a->g->device));
    if (!st && w->router && !L->router) {
        char what[64];
        snprintf(what, sizeof what, "layer %d router", l);
        st = cu_alloc(&L->router, (size_t)(sh->E * D), what);
    }
    struct {
        float *dst;
        const float *src;
        int64_t n;
    } up[] = {{L->norm, w->norm, D},     {L->wq, w->q, QD * D},   {L->wk, w->k, KVD * D},      {L->wv, w->v, KVD * D},
              {L->wo, w->o, D * QD},     {L->bq, w->q_bias, QD},  {L->bk, w->k_bias, KVD},     {L->bv, w->v_bias, KVD},
              {L->bo, w->o_bias, D},     {L->qn, w->q_norm, qn},  {L->kn, w->k_norm, kn},      {L->fnorm, w->ffn_norm, D},
              {L->router, w->router, sh->E * D}};
    cudaStream_t s = a->g->stream[0];
    for (size_t i = 0; i < sizeof up / sizeof up[0] && !st; i++)
        if (up[i].src)
            st = CU(cudaMemcpyAsync(up[i].dst, up[i].src, (size_t)up[i].n * sizeof(float), cudaMemcpyHostToDevice, s));
    if (!st) st = CU(cudaStreamSynchronize(s));   /* the host's buffers may change once this returns */
    if (st) return st;
    const float *const lin[4] = {w->q, w->k, w->v, w->o};
    for (int i = 0; i < 4; i++) L->have |= lin[i] ? 1u << i : 0u;
    L->has_bq = w->q_bias != NULL;
    L->has_bk = w->k_bias != NULL;
    L->has_bv = w->v_bias != NULL;
    L->has_bo = w->o_bias != NULL;
    L->window = w->window;
    L->set = true;
    return MOEQ_OK;
}

extern "C" moeq_status mq_gpu_kvattn_set_quantized(mq_gpu_kvattn *a, int l, int which, const mq_qtensor *q) {
    if (l < 0 || l >= a->n_layers || which < 0 || which > 3)
        return mq_err(MOEQ_E_ARG, "GPU KV attention: layer %d of %d, Linear %d", l, a->n_layers, which);
    Layer *L = &a->layers[l];
    const int64_t D = a->sh.D;
    const int64_t rows[4] = {a->QD, a->KVD, a->KVD, D}, cols[4] = {D, D, D, a->QD};
    float *const dst[4] = {L->wq, L->wk, L->wv, L->wo};
    static const char *const names[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    char what[64];
    snprintf(what, sizeof what, "layer %d %s", l, names[which]);
    if (q->rows != rows[which] || q->cols != cols[which])
        return mq_err(MOEQ_E_SHAPE, "GPU KV attention: %s is [%lld, %lld], expected [%lld, %lld]", what,
                      (long long)q->rows, (long long)q->cols, (long long)rows[which], (long long)cols[which]);
    moeq_status st = mq_cu_dequantize(a->g, q, dst[which], what);
    if (!st) L->have |= 1u << which;
    return st;
}

extern "C" moeq_status mq_gpu_kvattn_run(mq_gpu_kvattn *a, int l, mq_gpu_buf *xb, int64_t n, int64_t p0,
                                         mq_gpu_buf *ffn, int32_t *sel, float *w) {
    const mq_gpu_attn_shape *sh = &a->sh;
    const int64_t D = sh->D, K = sh->top_k;
    if (l < 0 || l >= a->n_layers || !a->layers[l].set || a->layers[l].have != 15u)
        return mq_err(MOEQ_E_ARG, "GPU KV attention: layer %d of %d has not all its weights", l, a->n_layers);
    Layer *L = &a->layers[l];
    if (n <= 0 || n > a->rows || p0 < 0 || p0 + n > sh->max_T)
        return mq_err(MOEQ_E_ARG, "GPU KV attention: %lld tokens at position %lld (at most %lld a call, %lld positions)",
                      (long long)n, (long long)p0, (long long)a->rows, (long long)sh->max_T);
    int64_t nx = 0, nf = 0;
    float *x = mq_gpu_buf_device(xb, &nx);
    float *xf = ffn ? mq_gpu_buf_device(ffn, &nf) : NULL;
    if (nx < n * D || (ffn && nf < n * D))
        return mq_err(MOEQ_E_ARG, "GPU KV attention: a buffer of %lld values for %lld rows of %lld",
                      (long long)(nx < n * D ? nx : nf), (long long)n, (long long)D);
    const bool route = sel || w;
    if (route && (!sel || !w || !L->router || !xf))
        return mq_err(MOEQ_E_ARG, "GPU KV attention: layer %d: routing needs a router, the FFN input and both outputs", l);
    moeq_status st = CU(cudaSetDevice(a->g->device));
    if (!st) {
        CudaDev dev = {a->g};
        const KvStep k = {sh, L, n, p0, x, xf, a->xn, a->q, a->att, a->y, a->S, a->pos, a->cos_t, a->sin_t, route,
                          a->logits, a->rw, a->rsel};
        st = kv_layer_steps(dev, k);
    }
    if (route) {
        cudaStream_t s = a->g->stream[0];
        if (!st) st = CU(cudaMemcpyAsync(sel, a->rsel, (size_t)(n * K) * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
        if (!st) st = CU(cudaMemcpyAsync(w, a->rw, (size_t)(n * K) * sizeof(float), cudaMemcpyDeviceToHost, s));
        moeq_status ws = CU(cudaStreamSynchronize(s));
        if (!st) st = ws;
    }
    return st;
}
