/* The GPU backend of a build without CUDA: nothing opens, so nothing else is reached. */
#include "backend/gpu.h"

#include <string.h>

#ifndef MOEQ_HAVE_CUDA

bool mq_gpu_built(void) { return false; }

moeq_status mq_gpu_probe(int device) {
    return mq_err(MOEQ_E_UNSUPPORTED,
                  "cuda:%d: this moeq was built without CUDA (configure with -DMOEQ_CUDA=ON, "
                  "which needs nvcc, cuBLAS and cuSOLVER)", device);
}

moeq_status mq_gpu_open(int device, mq_gpu **out) {
    *out = NULL;
    return mq_gpu_probe(device);
}

void mq_gpu_close(mq_gpu *g) { (void)g; }

void mq_gpu_get_info(mq_gpu *g, mq_gpu_info *info) {
    (void)g;
    memset(info, 0, sizeof *info);
}

void mq_gpu_force_det_tile(mq_gpu *g, int tile) { (void)g, (void)tile; }

void mq_gpu_set_memory_limit(mq_gpu *g, int64_t bytes) { (void)g, (void)bytes; }
void mq_gpu_set_sizing_reserve(mq_gpu *g, int64_t bytes) { (void)g, (void)bytes; }

void mq_gpu_memory(mq_gpu *g, int64_t *used, int64_t *peak, int64_t *limit) {
    (void)g;
    if (used) *used = 0;
    if (peak) *peak = 0;
    if (limit) *limit = 0;
}

void mq_gpu_memory_reset_peak(mq_gpu *g) { (void)g; }

moeq_status mq_gpu_set_precision(mq_gpu *g, moeq_gpu_precision p) {
    (void)g, (void)p;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_sync(mq_gpu *g) {
    (void)g;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

void *mq_gpu_host_alloc(mq_gpu *g, size_t bytes) {
    (void)g, (void)bytes;
    return NULL;
}

void mq_gpu_host_free(void *p) { (void)p; }

bool mq_gpu_host_register(mq_gpu *g, void *p, size_t bytes) {
    (void)g, (void)p, (void)bytes;
    return false;
}

void mq_gpu_host_unregister(void *p) { (void)p; }

moeq_status mq_gpu_measure(mq_gpu *g, double *sgemm_gflops, double *bandwidth_gbs) {
    (void)g;
    *sgemm_gflops = *bandwidth_gbs = 0;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_gptq(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o,
                        const float *const *H, const int64_t *K, const char *const *hnames,
                        int64_t n_h, mq_gptq_job *jobs, const int32_t *job_h, int64_t n_jobs) {
    (void)g, (void)s, (void)o, (void)H, (void)K, (void)hnames, (void)n_h, (void)jobs, (void)job_h,
        (void)n_jobs;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_gptq_ex(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o, const float *const *H,
                           const mq_gpu_hsrc *dH, const int64_t *K, const char *const *hnames, int64_t n_h,
                           mq_gptq_job *jobs, const mq_gpu_wsrc *dW, const int32_t *job_h, int64_t n_jobs) {
    (void)g, (void)s, (void)o, (void)H, (void)dH, (void)K, (void)hnames, (void)n_h, (void)jobs, (void)dW,
        (void)job_h, (void)n_jobs;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_rtn(mq_gpu *g, const mq_qspec *s, const float *w, int64_t rows, int64_t cols,
                       float global_scale, const char *tensor, mq_qtensor *out) {
    (void)g, (void)s, (void)w, (void)rows, (void)cols, (void)global_scale, (void)tensor;
    memset(out, 0, sizeof *out);
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_codecs(mq_gpu *g, const float *x, int64_t n, uint8_t *e2m1, uint8_t *e4m3,
                          uint8_t *e8m0, float *bf16, float *f16) {
    (void)g, (void)x, (void)n, (void)e2m1, (void)e4m3, (void)e8m0, (void)bf16, (void)f16;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_new(mq_gpu *g, int64_t E, int64_t D, int64_t F, const float *const *gate,
                           const float *const *up, const float *const *down, int64_t max_rows,
                           mq_gpu_mlp **out) {
    (void)g, (void)E, (void)D, (void)F, (void)gate, (void)up, (void)down, (void)max_rows;
    *out = NULL;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

void mq_gpu_mlp_free(mq_gpu_mlp *m) { (void)m; }

moeq_status mq_gpu_mlp_run(mq_gpu_mlp *m, int64_t e, const float *x, int64_t n, float *hg, float *hu,
                           float *y, mq_gpu_hessians *h_in, mq_gpu_hessians *h_down) {
    (void)m, (void)e, (void)x, (void)n, (void)hg, (void)hu, (void)y, (void)h_in, (void)h_down;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_inputs(mq_gpu_mlp *m, const float *const *x, const int64_t *rows, int64_t n_x) {
    (void)m, (void)x, (void)rows, (void)n_x;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_run_rows(mq_gpu_mlp *m, int64_t e, const int32_t *src, int64_t n, float *hg,
                                float *hu, float *y, mq_gpu_hessians *h_in, mq_gpu_hessians *h_down) {
    (void)m, (void)e, (void)src, (void)n, (void)hg, (void)hu, (void)y, (void)h_in, (void)h_down;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_read(mq_gpu_mlp *m, int64_t e, int k, float *out) {
    (void)m, (void)e, (void)k, (void)out;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_set(mq_gpu_mlp *m, int64_t e, int k, const float *w) {
    (void)m, (void)e, (void)k, (void)w;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_rows_index(mq_gpu_mlp *m, const int32_t *src, int64_t n) {
    (void)m, (void)src, (void)n;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_run_indexed(mq_gpu_mlp *m, int64_t e, int64_t r0, int64_t n, bool keep,
                                   mq_gpu_hessians *h_in, mq_gpu_hessians *h_down) {
    (void)m, (void)e, (void)r0, (void)n, (void)keep, (void)h_in, (void)h_down;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_join(mq_gpu_mlp *m) {
    (void)m;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_reserve_kept(mq_gpu_mlp *m, int64_t rows) {
    (void)m, (void)rows;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_inputs_reserve(mq_gpu_mlp *m, int64_t rows) {
    (void)m, (void)rows;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_inputs_put(mq_gpu_mlp *m, int64_t row0, const float *x, int64_t n) {
    (void)m, (void)row0, (void)x, (void)n;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_inputs_from(mq_gpu_mlp *m, mq_gpu_buf *b, int64_t rows) {
    (void)m, (void)b, (void)rows;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_buf_new(mq_gpu *g, int64_t n, mq_gpu_buf **out) {
    (void)g, (void)n;
    *out = NULL;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

void mq_gpu_buf_free(mq_gpu_buf *b) { (void)b; }

moeq_status mq_gpu_buf_read(mq_gpu_buf *b, int64_t off, int64_t n, float *host) {
    (void)b, (void)off, (void)n, (void)host;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_buf_read_async(mq_gpu_buf *b, int64_t off, int64_t n, float *host) {
    return mq_gpu_buf_read(b, off, n, host);
}

moeq_status mq_gpu_buf_write(mq_gpu_buf *b, int64_t off, int64_t n, const float *host) {
    (void)b, (void)off, (void)n, (void)host;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_buf_add(mq_gpu_buf *dst, const mq_gpu_buf *src, int64_t n) {
    (void)dst, (void)src, (void)n;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_combine(mq_gpu_mlp *m, mq_gpu_buf *out, const int64_t *tok, const int32_t *first,
                               const int32_t *row, const float *w, int64_t n_tok) {
    (void)m, (void)out, (void)tok, (void)first, (void)row, (void)w, (void)n_tok;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_gemm_det(mq_gpu *g, int64_t M, int64_t N, int64_t K, const float *A, const float *B,
                            float *C) {
    (void)g, (void)M, (void)N, (void)K, (void)A, (void)B, (void)C;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_hessians_new(mq_gpu *g, int64_t n, const int64_t *K, mq_gpu_hessians **out) {
    (void)g, (void)n, (void)K;
    *out = NULL;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

void mq_gpu_hessians_free(mq_gpu_hessians *hs) { (void)hs; }

moeq_status mq_gpu_hessians_add(mq_gpu_hessians *hs, int64_t i, const float *x, int64_t rows) {
    (void)hs, (void)i, (void)x, (void)rows;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_hessians_set(mq_gpu_hessians *hs, int64_t i, const float *sum, int64_t n) {
    (void)hs, (void)i, (void)sum, (void)n;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_hessians_get(mq_gpu_hessians *hs, int64_t i, float *H, int64_t *n) {
    (void)hs, (void)i, (void)H, (void)n;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_attn_new(mq_gpu *g, const mq_gpu_attn_shape *shape, mq_gpu_attn **out) {
    (void)g, (void)shape;
    *out = NULL;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

void mq_gpu_attn_free(mq_gpu_attn *a) { (void)a; }

moeq_status mq_gpu_attn_set(mq_gpu_attn *a, const mq_gpu_attn_weights *w) {
    (void)a, (void)w;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_attn_run_samples(mq_gpu_attn *a, const mq_gpu_attn_sample *s, int64_t n,
                                    const mq_gpu_attn_io *io) {
    (void)a, (void)s, (void)n, (void)io;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

int64_t mq_gpu_attn_rows(const mq_gpu_attn *a) {
    (void)a;
    return 0;
}

/* generation's KV-cached attention */
moeq_status mq_gpu_kvattn_new(mq_gpu *g, const mq_gpu_attn_shape *shape, int n_layers, int64_t rows,
                              mq_gpu_kvattn **out) {
    (void)g, (void)shape, (void)n_layers, (void)rows;
    *out = NULL;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

void mq_gpu_kvattn_free(mq_gpu_kvattn *a) { (void)a; }

int64_t mq_gpu_kvattn_rows(const mq_gpu_kvattn *a) {
    (void)a;
    return 0;
}

moeq_status mq_gpu_kvattn_set(mq_gpu_kvattn *a, int l, const mq_gpu_attn_weights *w) {
    (void)a, (void)l, (void)w;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_kvattn_set_quantized(mq_gpu_kvattn *a, int l, int which, const mq_qtensor *q) {
    (void)a, (void)l, (void)which, (void)q;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_kvattn_run(mq_gpu_kvattn *a, int l, mq_gpu_buf *x, int64_t n, int64_t p0, mq_gpu_buf *ffn,
                              int32_t *sel, float *w) {
    (void)a, (void)l, (void)x, (void)n, (void)p0, (void)ffn, (void)sel, (void)w;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

/* the evaluation's pieces */
moeq_status mq_gpu_buf_zero(mq_gpu_buf *b, int64_t off, int64_t n) {
    (void)b, (void)off, (void)n;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_mlp_add_kept(mq_gpu_mlp *m, mq_gpu_buf *out, const mq_gpu_buf *xn, const mq_gpu_buf *gate,
                                int64_t n) {
    (void)m, (void)out, (void)xn, (void)gate, (void)n;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_head_new(mq_gpu *g, int64_t D, int64_t V, const float *norm, float eps, const float *lm_head,
                            int64_t max_rows, mq_gpu_head **out) {
    (void)g, (void)D, (void)V, (void)norm, (void)eps, (void)lm_head, (void)max_rows;
    *out = NULL;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

void mq_gpu_head_free(mq_gpu_head *h) { (void)h; }

int64_t mq_gpu_head_rows(const mq_gpu_head *h) {
    (void)h;
    return 0;
}

moeq_status mq_gpu_head_score(mq_gpu_head *h, mq_gpu_head *base, const float *x, const float *xb, int64_t n,
                              const int32_t *target, float temperature, bool entropy, mq_gpu_row_stats *stats,
                              float *logits) {
    (void)h, (void)base, (void)x, (void)xb, (void)n, (void)target, (void)temperature, (void)entropy, (void)stats,
        (void)logits;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_rmsnorm_rows(mq_gpu *g, const float *x, int64_t n, int64_t D, const float *w, float eps,
                                float *out) {
    (void)g, (void)x, (void)n, (void)D, (void)w, (void)eps, (void)out;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_row_stats_of(mq_gpu *g, const float *l, const float *lb, int64_t n, int64_t V,
                                const int32_t *target, bool entropy, mq_gpu_row_stats *stats) {
    (void)g, (void)l, (void)lb, (void)n, (void)V, (void)target, (void)entropy, (void)stats;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_moe_upload(mq_gpu *g, const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                              const moeq_moe_ffn_args *routing, mq_gpu_moe **out) {
    (void)g, (void)d, (void)zp, (void)routing;
    if (out) *out = NULL;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

void mq_gpu_moe_free(mq_gpu_moe *m) { (void)m; }

void mq_gpu_moe_force_tiles(mq_gpu_moe *m, int shape) { (void)m, (void)shape; }

size_t mq_gpu_moe_bytes(const mq_gpu_moe *m) {
    (void)m;
    return 0;
}

moeq_status mq_gpu_moe_ffn(mq_gpu_moe *m, const float *x, int64_t T, int math, float *out) {
    (void)m, (void)x, (void)T, (void)math, (void)out;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_moe_last_routing(mq_gpu_moe *m, int32_t *sel, float *wt, float *gshared) {
    (void)m, (void)sel, (void)wt, (void)gshared;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_moe_dequant(mq_gpu_moe *m, int64_t expert, int which, float *out) {
    (void)m, (void)expert, (void)which, (void)out;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_moe_emulate(const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                               const moeq_moe_ffn_args *routing, const float *x, int64_t T, int math, int tiles,
                               float *out, int32_t *sel, float *wt, float *gsh) {
    (void)d, (void)zp, (void)routing, (void)x, (void)T, (void)math, (void)tiles, (void)out, (void)sel, (void)wt,
        (void)gsh;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA (the emulator compiles the CUDA kernels)");
}

moeq_status mq_gpu_moe_emulate_dequant(const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                                       const moeq_moe_ffn_args *routing, int64_t expert, int which, float *out) {
    (void)d, (void)zp, (void)routing, (void)expert, (void)which, (void)out;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA (the emulator compiles the CUDA kernels)");
}

moeq_status mq_gpu_kvattn_emulate(const mq_gpu_attn_shape *sh, const mq_gpu_attn_weights *w, const int64_t *n,
                                  int calls, float *x, float *ffn, int32_t *sel, float *wt) {
    (void)sh, (void)w, (void)n, (void)calls, (void)x, (void)ffn, (void)sel, (void)wt;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA (the emulator compiles the CUDA kernels)");
}

moeq_status mq_gpu_dequantize_emulate(const mq_qtensor *q, float *out) {
    (void)q, (void)out;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA (the emulator compiles the CUDA kernels)");
}

moeq_status mq_gpu_moe_ffn_baseline(mq_gpu_moe *m, const float *x, int64_t T, float *out) {
    (void)m, (void)x, (void)T, (void)out;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_moe_time(mq_gpu_moe *const *layers, int n_layers, mq_gpu_buf *x, int n_x, int64_t T,
                            mq_gpu_buf *out, int mode, int calls, int rounds, double *ms) {
    (void)layers, (void)n_layers, (void)x, (void)n_x, (void)T, (void)out, (void)mode, (void)calls, (void)rounds;
    *ms = 0;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_gemm_bf16_time(mq_gpu *g, int n, const int64_t *M, const int64_t *N, const int64_t *K,
                                  double *ms) {
    (void)g, (void)n, (void)M, (void)N, (void)K;
    *ms = 0;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_moe_upload_dense(mq_gpu *g, int64_t E, int64_t D, int64_t F, int bf16_src,
                                    const void *const *gate, const void *const *up, const void *const *down,
                                    const moeq_moe_ffn_args *routing, mq_gpu_moe **out) {
    (void)g, (void)E, (void)D, (void)F, (void)bf16_src, (void)gate, (void)up, (void)down, (void)routing;
    if (out) *out = NULL;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_buf_copy(mq_gpu_buf *dst, int64_t dst_off, const mq_gpu_buf *src, int64_t src_off, int64_t n) {
    (void)dst, (void)dst_off, (void)src, (void)src_off, (void)n;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

moeq_status mq_gpu_moe_ffn_buf(mq_gpu_moe *m, mq_gpu_buf *x, int64_t T, int math, mq_gpu_buf *out) {
    (void)m, (void)x, (void)T, (void)math, (void)out;
    return mq_err(MOEQ_E_UNSUPPORTED, "this moeq was built without CUDA");
}

#endif
