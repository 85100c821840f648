/*
 * The GPU backend's C interface. Nothing of CUDA shows here: the pipeline, the benchmarks and
 * the tests hold an opaque mq_gpu and call plain C functions. Built with -DMOEQ_CUDA=ON the
 * functions run on an NVIDIA GPU (src/backend/cuda/); otherwise (src/backend/gpu_none.c)
 * mq_gpu_open fails with a message saying how to build with CUDA, and nothing else is reachable.
 *
 * The GPU computes what the CPU computes (quant/gptq.h, quant/hessian.h, kernels/gemm_det.h):
 *  - mq_gpu_hessian_*: the Hessian sums as the same fmaf chains as mq_syrk_det_acc, so the
 *    sums are bit-identical to the CPU's;
 *  - mq_gpu_gptq: factor and column loop with the CPU's group parameters, rounding and search
 *    (bit-identical functions), the lazy updates as fp32 cuBLAS GEMMs (never TF32) whose
 *    summation order differs from OpenBLAS's: codes agree with the CPU's but for weights whose
 *    value lands within rounding of a decision threshold. Deterministic from run to run.
 */
#ifndef MOEQ_BACKEND_GPU_H
#define MOEQ_BACKEND_GPU_H

#include "core/core.h"
#include "formats/formats.h"
#include "quant/gptq.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mq_gpu mq_gpu;
typedef struct mq_gpu_hessians mq_gpu_hessians;   /* below */

typedef struct {
    int device;
    char name[96];
    int cc_major, cc_minor;
    int sm_count;
    int64_t mem_total, mem_free;   /* bytes */
} mq_gpu_info;

/* True when this build has the CUDA backend. */
bool mq_gpu_built(void);
/* Opens GPU `device` (0-based): MOEQ_E_UNSUPPORTED without a CUDA build or without that device,
 * MOEQ_E_DEVICE when the driver fails; the message says which. */
moeq_status mq_gpu_open(int device, mq_gpu **out);
/* The checks mq_gpu_open starts with (a CUDA build, the driver, the device's number), without
 * making the device's context: cheap, so a caller may open the device on a thread of its own and
 * still fail at once where there is none. */
moeq_status mq_gpu_probe(int device);
void mq_gpu_close(mq_gpu *g);
void mq_gpu_get_info(mq_gpu *g, mq_gpu_info *info);
/* The device memory moeq holds on g's device (`--max-gpu-memory`): every buffer, GPTQ's arenas
 * and the cuSOLVER workspaces are counted (the CUDA context and cuBLAS's own workspaces are not).
 * With a bound (bytes > 0), an allocation that would take them over it fails (MOEQ_E_NOMEM naming
 * the bound) and mq_gpu_get_info says what is left under it (mem_free) and the bound (mem_total),
 * so the sizes chosen from them stay within; 0: none (the card's). _memory: in use now (with what
 * the stream-ordered pool keeps of freed blocks), the peak since the device was opened or the
 * last _reset_peak, and the bound. Without CUDA: no-ops, zeros. */
void mq_gpu_set_memory_limit(mq_gpu *g, int64_t bytes);
/* Bytes that the sizes chosen from the free memory (mq_gpu_get_info's mem_free, GPTQ's waves, the
 * experts' extra lanes) leave for an allocation another thread makes meanwhile: the pipeline's
 * expert read-ahead uploads a chunk while the attention's GPTQ sizes its waves. 0: none. */
void mq_gpu_set_sizing_reserve(mq_gpu *g, int64_t bytes);
void mq_gpu_memory(mq_gpu *g, int64_t *used, int64_t *peak, int64_t *limit);
void mq_gpu_memory_reset_peak(mq_gpu *g);
/* Tests: the tile of the deterministic GEMMs and Hessian sums (128, 64 or 32; 0, the default:
 * the largest that fills the SMs). Every tile gives the same bits. */
void mq_gpu_force_det_tile(mq_gpu *g, int tile);
/* The arithmetic of the calibration's products (attention projections, the experts) and the
 * Hessian sums (`--gpu-precision`): MOEQ_GPU_FP32 (the default), the CPU's fmaf chains;
 * MOEQ_GPU_TF32X3, each product as three on TF32 tensor cores from its inputs' hi and lo TF32
 * halves, about fp32's accuracy; MOEQ_GPU_TF32, one TF32 product (10-bit mantissas, fp32 sums),
 * the attention's scores and GPTQ's updates too. The TF32 modes are deterministic from run to
 * run on one GPU, not the fp32 mode's bits (nor the CPU's). */
moeq_status mq_gpu_set_precision(mq_gpu *g, moeq_gpu_precision p);
/* The device's fp32 GEMM rate (8192^3, current math mode) and copy bandwidth (read + write),
 * medians of 5: the figures the benchmarks set their times against. */
moeq_status mq_gpu_measure(mq_gpu *g, double *sgemm_gflops, double *bandwidth_gbs);
/* Waits until the device has done everything queued so far (profiling). */
moeq_status mq_gpu_sync(mq_gpu *g);
/* Page-locked host memory of `bytes` (NULL where the driver refuses it, or without a GPU): host
 * buffers the device copies to and from at the bus's speed (pageable ones go through the
 * driver's staging copies); freed with mq_gpu_host_free. */
void *mq_gpu_host_alloc(mq_gpu *g, size_t bytes);
void mq_gpu_host_free(void *p);
/* Page-locks `bytes` of host memory the caller allocated (the calibration activations), so that
 * copies to and from it go at the bus's speed; false where the driver refuses (the memory stays
 * as it was, pageable). Undone by mq_gpu_host_unregister before the memory is freed. */
bool mq_gpu_host_register(mq_gpu *g, void *p, size_t bytes);
void mq_gpu_host_unregister(void *p);
/* "fp32", "tf32x3", "tf32": the report's and the work directory's names of a mode. */
const char *mq_gpu_precision_name(moeq_gpu_precision p);
/* "cuda" -> 0, "cuda:N" -> N; "cpu" -> -1; anything else MOEQ_E_ARG naming the flag value. */
moeq_status mq_gpu_parse_device(const char *s, int *device);

/* GPTQ for n_jobs weights on the GPU: factors the n_h Hessians H[h] ([K[h], K[h]], host memory,
 * names hnames[h]; every entry is checked finite, then only the lower triangle is read, as of a
 * device sum: mq_hessian_get's H is symmetric, an sgemm's X X^T may not be bit for bit) with the
 * CPU's damping, retry and act-order rules (mq_gptq_factor_init), then
 * runs the column loop of every job (job i uses Hessian job_h[i]; jobs[i].f is not read) and
 * fills jobs[i].out, .deq (if non-NULL) and .stats as mq_gptq_run does. Errors name the tensor
 * or the CUDA call; on error every out is freed. */
moeq_status mq_gpu_gptq(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o,
                        const float *const *H, const int64_t *K, const char *const *hnames,
                        int64_t n_h, mq_gptq_job *jobs, const int32_t *job_h, int64_t n_jobs);

/* Inputs already on the GPU (the pipeline's flow, and the benchmarks'): a Hessian as a device sum
 * (H = (2/n) sum, mq_gpu_hessians_get's values, formed on the device), a job's weights as an
 * expert's Linear of an mq_gpu_mlp (k: 0 gate, 1 up, 2 down), with write_back replaced there by
 * the dequantized result, so the quantized calibration pass needs no upload. */
typedef struct {
    mq_gpu_hessians *sums;
    int64_t index;
} mq_gpu_hsrc;

typedef struct mq_gpu_mlp mq_gpu_mlp;   /* below */
typedef struct {
    mq_gpu_mlp *mlp;   /* NULL: the job's weights are jobs[i].w in host memory */
    int64_t expert;
    int k;
    bool write_back;
} mq_gpu_wsrc;

/* mq_gpu_gptq with inputs on the device: Hessian h from dH[h] where H[h] is NULL (dH may be
 * NULL), job i's weights from dW[i] where dW is non-NULL and dW[i].mlp set (jobs[i].w unread).
 * The results are the same bits as from the same values in host memory. */
moeq_status mq_gpu_gptq_ex(mq_gpu *g, const mq_qspec *s, const mq_gptq_opts *o, const float *const *H,
                           const mq_gpu_hsrc *dH, const int64_t *K, const char *const *hnames, int64_t n_h,
                           mq_gptq_job *jobs, const mq_gpu_wsrc *dW, const int32_t *job_h, int64_t n_jobs);

/* Round-to-nearest of w [rows, cols] on the GPU: mq_quantize_rtn's contract and its results,
 * bit for bit. */
moeq_status mq_gpu_rtn(mq_gpu *g, const mq_qspec *s, const float *w, int64_t rows, int64_t cols,
                       float global_scale, const char *tensor, mq_qtensor *out);
/* The device codecs applied to n values (the tests' twin check): mq_e2m1_encode,
 * mq_e4m3_encode, mq_e8m0_encode_ceil and mq_round_to_dtype (BF16, F16) of each x. */
moeq_status mq_gpu_codecs(mq_gpu *g, const float *x, int64_t n, uint8_t *e2m1, uint8_t *e4m3,
                          uint8_t *e8m0, float *bf16, float *f16);

/* The routed experts' MLPs for the calibration passes, bit-identical to the CPU's
 * mq_mlp_forward on deterministic Linears: gate and up products as kernels/gemm_det.h's fmaf
 * chains, the SwiGLU as kernels/vec.h's, down the same. _new uploads E experts' fp32 weights
 * (gate[e], up[e]: [F, D]; down[e]: [D, F], or down NULL for passes without it); _run takes n rows
 * x [n, D] of expert e through them into hg (after the SwiGLU), hu (the up product) and y [n, D]
 * (each may be NULL: not copied back; y NULL: no down product), max_rows at a time, and adds the
 * rows x to the Hessian sum h_in and the SwiGLU products to h_down (sum 0 of each; NULL: none),
 * as mq_gpu_hessians_add would from the host: the CPU's bits. */
moeq_status mq_gpu_mlp_new(mq_gpu *g, int64_t E, int64_t D, int64_t F, const float *const *gate,
                           const float *const *up, const float *const *down, int64_t max_rows,
                           mq_gpu_mlp **out);
void mq_gpu_mlp_free(mq_gpu_mlp *m);
moeq_status mq_gpu_mlp_run(mq_gpu_mlp *m, int64_t e, const float *x, int64_t n, float *hg, float *hu,
                           float *y, mq_gpu_hessians *h_in, mq_gpu_hessians *h_down);
/* The rows the next _run_rows calls gather from: n_x blocks x[i] of rows[i] rows of D values
 * (host), uploaded once one after the other (a batch's FFN inputs, sample by sample). */
moeq_status mq_gpu_mlp_inputs(mq_gpu_mlp *m, const float *const *x, const int64_t *rows, int64_t n_x);
/* The same inputs put up piece by piece: room for `rows` rows (what was there is dropped), then
 * rows [row0, row0 + n) from x (host). */
moeq_status mq_gpu_mlp_inputs_reserve(mq_gpu_mlp *m, int64_t rows);
moeq_status mq_gpu_mlp_inputs_put(mq_gpu_mlp *m, int64_t row0, const float *x, int64_t n);
/* The inputs are the first `rows` rows of D values of buffer b, where they are (nothing is
 * copied; b must outlive the calls that gather from them; _reserve drops them). */
typedef struct mq_gpu_buf mq_gpu_buf;
moeq_status mq_gpu_mlp_inputs_from(mq_gpu_mlp *m, mq_gpu_buf *b, int64_t rows);
/* _run on the n rows src[i] of those inputs (gathered on the device: only the indices cross). */
moeq_status mq_gpu_mlp_run_rows(mq_gpu_mlp *m, int64_t e, const int32_t *src, int64_t n, float *hg,
                                float *hu, float *y, mq_gpu_hessians *h_in, mq_gpu_hessians *h_down);
/* Room for `rows` outputs kept on the device by _run_indexed (what was kept is dropped). */
moeq_status mq_gpu_mlp_reserve_kept(mq_gpu_mlp *m, int64_t rows);
/* The rows of a whole batch at once: _rows_index puts up the batch's n row indices into the
 * inputs (each checked), then _run_indexed runs expert e on rows [r0, r0 + n) of them as
 * _run_rows would, its outputs kept at rows [r0, r0 + n) of the expert set's batch outputs when
 * `keep` (else not computed; _reserve_kept makes room, else max_rows; nothing is copied back:
 * they are for _combine), with nothing crossing the bus per expert, so the experts overlap on
 * the device. */
moeq_status mq_gpu_mlp_rows_index(mq_gpu_mlp *m, const int32_t *src, int64_t n);
moeq_status mq_gpu_mlp_run_indexed(mq_gpu_mlp *m, int64_t e, int64_t r0, int64_t n, bool keep,
                                   mq_gpu_hessians *h_in, mq_gpu_hessians *h_down);
/* The _run_rows calls of different experts may run at once on the device; after the last of a
 * batch, _join orders whatever the GPU does next (the Hessians' reads, GPTQ, the combine) after
 * them. The expert set's own calls join by themselves. */
moeq_status mq_gpu_mlp_join(mq_gpu_mlp *m);

/* Device memory of n floats (zeroed), read back into host memory: the FFN outputs of a layer's
 * samples while the routed experts add into them, or their inputs (mq_gpu_mlp_inputs_from). */
moeq_status mq_gpu_buf_new(mq_gpu *g, int64_t n, mq_gpu_buf **out);
void mq_gpu_buf_free(mq_gpu_buf *b);
moeq_status mq_gpu_buf_read(mq_gpu_buf *b, int64_t off, int64_t n, float *host);
/* mq_gpu_buf_read that returns once the copy is queued: host is filled at the next mq_gpu_sync
 * (many samples' pieces, one wait). */
moeq_status mq_gpu_buf_read_async(mq_gpu_buf *b, int64_t off, int64_t n, float *host);
moeq_status mq_gpu_buf_write(mq_gpu_buf *b, int64_t off, int64_t n, const float *host);
/* n values of src from src_off into dst at dst_off (the same GPU), queued on stream 0. */
moeq_status mq_gpu_buf_copy(mq_gpu_buf *dst, int64_t dst_off, const mq_gpu_buf *src, int64_t src_off, int64_t n);
/* dst += src over the first n values of both, queued (stream order): one fp32 add each, the
 * host's axpy by 1 bit for bit (the FFN's output onto the boundary where both are there). */
moeq_status mq_gpu_buf_add(mq_gpu_buf *dst, const mq_gpu_buf *src, int64_t n);

/* out[tok[i]] (rows of D values of `out`) += w * y over token i's pairs [first[i], first[i + 1])
 * of (row of the kept batch outputs, weight), in their order: each value the fmaf chain of
 * kernels/vec.h's axpy applied pair after pair, the CPU's combine bit for bit. */
moeq_status mq_gpu_mlp_combine(mq_gpu_mlp *m, mq_gpu_buf *out, const int64_t *tok, const int32_t *first,
                               const int32_t *row, const float *w, int64_t n_tok);

/* Expert e's Linear k (0 gate, 1 up, 2 down) back into host memory ([F, D] or [D, F]), or
 * replaced from host memory. */
moeq_status mq_gpu_mlp_read(mq_gpu_mlp *m, int64_t e, int k, float *out);
moeq_status mq_gpu_mlp_set(mq_gpu_mlp *m, int64_t e, int k, const float *w);
/* C [M, N] = A [M, K] B [N, K]^T as mq_gemm_det_nt (host memory; the tests' twin check). */
moeq_status mq_gpu_gemm_det(mq_gpu *g, int64_t M, int64_t N, int64_t K, const float *A, const float *B,
                            float *C);

/* Hessian sums on the GPU: n accumulators of sizes K[i], kept on the device. */
moeq_status mq_gpu_hessians_new(mq_gpu *g, int64_t n, const int64_t *K, mq_gpu_hessians **out);
void mq_gpu_hessians_free(mq_gpu_hessians *hs);
/* Adds the rows x [rows, K[i]] (host memory) to sum i: the lower triangle, each element one
 * fmaf per row in row order, bit-identical to mq_hessian_add on the CPU. */
moeq_status mq_gpu_hessians_add(mq_gpu_hessians *hs, int64_t i, const float *x, int64_t rows);
/* Sets sum i to sum [K[i], K[i]] (host; its lower triangle is what is read) over n rows. */
moeq_status mq_gpu_hessians_set(mq_gpu_hessians *hs, int64_t i, const float *sum, int64_t n);
/* H [K, K] = (2/n) sum, both triangles, into host memory (mq_hessian_get's values); n rows so
 * far of sum i into *n (may be NULL). */
moeq_status mq_gpu_hessians_get(mq_gpu_hessians *hs, int64_t i, float *H, int64_t *n);

/* A decoder layer's self-attention for the calibration passes: model.h's mq_attention_forward
 * of a whole sample from position 0 (no KV cache), x += o(attention(rmsnorm(x))), with q/k/v
 * biases, the q/k norms over all heads or per head, clip_qkv, rotate-half RoPE from the host's
 * tables, grouped KV heads and a sliding window; then, as the pipeline asks, the FFN input
 * (mq_ffn_norm) and its softmax top-k routing (mq_moe_route: ties to the lower expert,
 * norm_topk_prob). The norms and RoPE are the CPU's operations in the CPU's order (the norm's sum
 * of squares in double); the products are fp32 cuBLAS GEMMs and the softmax sums in another
 * order than the CPU's, so values agree to a few ulps, not bits (and a routing choice between
 * two experts within such a difference of each other can differ). */
typedef struct {
    int64_t D, H, KV, hd;           /* hidden size, heads, KV heads, head dim */
    int64_t max_T;                  /* the longest sample */
    float eps;                      /* the RMSNorms' epsilon */
    int qk_norm;                    /* 0: none; 1: over all heads ([H*hd], [KV*hd]); 2: per head ([hd]) */
    float clip_qkv;                 /* > 0: q, k, v clamped to [-c, c] after the norms */
    const float *rope_cos, *rope_sin;   /* [max_T, hd / 2] (host; copied) */
    int64_t E, top_k;               /* routed experts and experts per token (0: no MoE layer) */
    bool norm_topk;                 /* the top-k weights renormalised to sum 1 */
} mq_gpu_attn_shape;

typedef struct {
    const float *norm;              /* [D] */
    const float *q, *k, *v, *o;     /* [H*hd, D], [KV*hd, D], [KV*hd, D], [D, H*hd] */
    const float *q_bias, *k_bias, *v_bias, *o_bias;   /* or NULL */
    const float *q_norm, *k_norm;   /* as qk_norm says, or NULL */
    int64_t window;                 /* the layer's sliding window (0: full causal attention) */
    const float *ffn_norm;          /* [D] */
    const float *router;            /* [E, D], or NULL (a dense layer: no routing) */
} mq_gpu_attn_weights;

typedef struct mq_gpu_attn mq_gpu_attn;
moeq_status mq_gpu_attn_new(mq_gpu *g, const mq_gpu_attn_shape *shape, mq_gpu_attn **out);
void mq_gpu_attn_free(mq_gpu_attn *a);
/* Uploads a layer's weights (host memory; copied before the call returns) and takes its window. */
moeq_status mq_gpu_attn_set(mq_gpu_attn *a, const mq_gpu_attn_weights *w);
/* Samples through the layer, in groups of up to mq_gpu_attn_rows tokens (one upload, the
 * row-wise work over the whole group, one synchronisation): the same bits for each sample
 * whatever group it goes in. What a sample gives besides the result: each host pointer may be
 * NULL (not copied); page-locked host memory makes the copies asynchronous. */
typedef struct {
    const float *x;                 /* host [T, D]: the sample */
    float *y;                       /* host [T, D]: x + attention (may be x), or NULL (not copied) */
    int64_t T;
    float *xn, *att;                /* host copies of the Hessian inputs: the q/k/v input after
                                       the norm [T, D], o's input [T, H*hd] */
    float *ffn_in;                  /* host [T, D]: the FFN norm of the result */
    int32_t *sel;                   /* host [T, top_k]: the experts the FFN input routes to */
    float *w;                       /* host [T, top_k]: their weights (with sel) */
    int64_t ffn_dev_off;            /* where its FFN input goes in the io's ffn_dev */
} mq_gpu_attn_sample;
/* What all the samples share; every member may be NULL. */
typedef struct {
    mq_gpu_hessians *hq, *ho;       /* the q/k/v and o inputs are added to sum 0 of these, the
                                       samples' rows in their order (mq_gpu_hessians_add's bits) */
    mq_gpu_buf *ffn_dev;            /* every sample's FFN input also into this buffer (for
                                       mq_gpu_mlp_inputs_from) */
    mq_gpu_buf *h_dev;              /* every sample's result (x + attention) also into this
                                       buffer, at the same place (for mq_gpu_buf_add) */
    mq_gpu_buf *x_from;             /* the samples' x from this buffer (at ffn_dev_off) instead
                                       of the host's (x may then be NULL) */
    mq_gpu_buf *x_keep;             /* the samples' x also into this buffer, at the same place */
    /* host work to do while the first group runs on the device: called once, after that group
     * is queued and before the wait for it (the pipeline reads and uploads the first experts
     * then); its error is the call's, once the device has finished the group */
    moeq_status (*meanwhile)(void *user);
    void *meanwhile_user;
} mq_gpu_attn_io;
moeq_status mq_gpu_attn_run_samples(mq_gpu_attn *a, const mq_gpu_attn_sample *s, int64_t n,
                                    const mq_gpu_attn_io *io);
int64_t mq_gpu_attn_rows(const mq_gpu_attn *a);

/* ---- generation (decode.cu): the attention of new tokens over a KV cache on the device --------
 * What model/forward.c's attention_block does for n new tokens at positions p0 .. p0 + n - 1 of
 * a sequence whose earlier keys and values are cached: x += o(attention(rmsnorm(x))), with the
 * q/k/v biases, the q/k norms and clip_qkv as mq_gpu_attn_shape says, rotate-half RoPE at each
 * token's position from the host's tables, the new keys and values appended to the layer's
 * cache at rows p0.., each new query attending causally over cache rows [0 .. its position]
 * (its layer's sliding window, grouped KV heads); then, as asked, the FFN input (the FFN norm of
 * the result) and its softmax top-k routing. The element-wise kernels are mq_gpu_attn's
 * (attn_kernels.cuh); the projections are mq_cu_product's (the precision mode's); the scores,
 * the softmax (moeq's expf) and P V are one block per (new token, head) in fp32, each score one
 * fmaf chain over the head's dimensions and each output one over the visible keys in key
 * order. All layers of a model live in one object: their weights and caches, one scratch.
 * Work is queued on stream 0 (the mq_gpu_buf calls' order); only the routing's copy to the host
 * waits. shape: max_T the cache's positions (and the RoPE tables' rows), E/top_k/norm_topk the
 * routing of layers given a router; rows: the most new tokens a call takes (fewer where their
 * scores would pass 2^26 floats: mq_gpu_kvattn_rows says how many). */
typedef struct mq_gpu_kvattn mq_gpu_kvattn;
moeq_status mq_gpu_kvattn_new(mq_gpu *g, const mq_gpu_attn_shape *shape, int n_layers, int64_t rows,
                              mq_gpu_kvattn **out);
void mq_gpu_kvattn_free(mq_gpu_kvattn *a);
int64_t mq_gpu_kvattn_rows(const mq_gpu_kvattn *a);
/* Layer l's weights (host; copied before the call returns) and window; w->router NULL: that
 * layer is not routed here (ffn_norm is needed for the FFN input). A NULL q, k, v or o is left
 * for _set_quantized, which must give it before the layer runs. */
moeq_status mq_gpu_kvattn_set(mq_gpu_kvattn *a, int l, const mq_gpu_attn_weights *w);
/* Layer l's Linear `which` (0 q, 1 k, 2 v, 3 o) from its quantized tensor (host; [out, in] as the
 * shape says), decoded on the device: only the codes and group parameters cross the bus, and the
 * fp32 weight made there is mq_dequantize's, bit for bit (dequant.cu). NVFP4, INT4 and MXFP4;
 * MOEQ_E_UNSUPPORTED for other schemes (the caller decodes those on the host). */
moeq_status mq_gpu_kvattn_set_quantized(mq_gpu_kvattn *a, int l, int which, const mq_qtensor *q);
/* Layer l on the n rows of D values at the start of x (device), tokens at positions p0..p0+n-1;
 * the cache of layer l must hold positions [0, p0) (the caller's order: p0 is not checked
 * against what was written). ffn (or NULL): the FFN input of each row, at its start; sel, w
 * (host [n, top_k], or NULL: no routing; only for a layer given a router): the routing of the
 * FFN input, the call waiting for it. */
moeq_status mq_gpu_kvattn_run(mq_gpu_kvattn *a, int l, mq_gpu_buf *x, int64_t n, int64_t p0, mq_gpu_buf *ffn,
                              int32_t *sel, float *w);

/* ---- planning (gpu.c: the same arithmetic in every build, no GPU needed) -----------------------
 * The bytes the backend's objects take on the device, as their allocations count them
 * (mq_gpu_memory; test_gpu_memory compares on a GPU): the planner's figures for --max-gpu-memory.
 *  - mq_gpu_attn_bytes: mq_gpu_attn_new of sh with groups of `rows` tokens (0: the default,
 *    MQ_GPU_ATTN_GROUP_ROWS or the longest sample; attention.cu falls back to the longest sample
 *    where that does not fit);
 *  - mq_gpu_mlp_bytes: mq_gpu_mlp_new of E experts [F, D] (down too where asked), `lanes` lanes
 *    of max_rows rows;
 *  - mq_gpu_hessians_bytes: one device sum of K inputs;
 *  - mq_gpu_gptq_bytes: one wave of mq_gpu_gptq_ex holding one Hessian of K inputs and `rows`
 *    rows of weights that share it (a wave never holds less), with cuSOLVER's workspace. */
enum { MQ_GPU_ATTN_GROUP_ROWS = 16384 };                  /* attention.cu's GROUP_ROWS */
#define MQ_GPU_ATTN_SCORES_FLOATS ((int64_t)1 << 28)       /* attention.cu's SCORES_FLOATS */
#define MQ_GPU_KVATTN_SCORES_FLOATS ((int64_t)1 << 26)     /* decode.cu: a call's scores at most */
int64_t mq_gpu_attn_bytes(const mq_gpu_attn_shape *sh, int64_t rows);
int64_t mq_gpu_mlp_bytes(int64_t E, int64_t D, int64_t F, bool down, int64_t max_rows, int lanes);
int64_t mq_gpu_hessians_bytes(int64_t K);
/* mq_gpu_kvattn_new of sh for n_layers layers, `routed` of them given a router, with rows
 * (mq_gpu_kvattn_rows of it) new tokens a call. */
int64_t mq_gpu_kvattn_bytes(const mq_gpu_attn_shape *sh, int n_layers, int routed, int64_t rows);
/* The rows mq_gpu_kvattn_new of sh keeps of `rows` asked for (its scores' bound). */
int64_t mq_gpu_kvattn_rows_for(const mq_gpu_attn_shape *sh, int64_t rows);
int64_t mq_gpu_gptq_bytes(const mq_qspec *s, const mq_gptq_opts *o, int64_t K, int64_t rows);

/* ---- the evaluation's pieces (src/backend/cuda/score.cu; src/eval/eval_gpu.c drives them) ------
 * What moeq_eval adds to the calibration's layer pieces above: the FFN's remaining sums on the
 * device and the scoring of a window's rows. Twins on the CPU (tests/test_gpu_eval.c):
 *  - mq_gpu_buf_zero, mq_gpu_mlp_add_kept: the forward's axpy chains (kernels/vec.h) and the
 *    shared expert's gate (model.h's mq_shared_expert_add): the gate's dot in vec.h's lane
 *    layout (the CPU's GEMV bits), its sigmoid with the device's expf (within 2 ulp of libm's);
 *  - the final norm: vec.h's rmsnorm in its lane layout, the CPU's bits;
 *  - the row statistics: vec.h's logsumexp (maximum, first argmax, the double exp terms summed
 *    in its 8 lanes and reduced in its order; the log taken on the host, as the CPU takes it),
 *    its KL and the entropy's KL to the uniform row: given the same logits, the CPU's bits;
 *  - lm_head: cuBLAS GEMMs in chunks of rows (fp32: the default math, never TF32; the TF32 modes
 *    as mq_gpu_set_precision says), whose sums run in another order than OpenBLAS's: a logit
 *    differs from the CPU's by at most 2 gamma_D sum_k |x_k W_ik| (gamma_D = D u / (1 - D u),
 *    u = 2^-24), which is what makes the scores differ. */

/* n zeros into b from value off. */
moeq_status mq_gpu_buf_zero(mq_gpu_buf *b, int64_t off, int64_t n);
/* out[t] = fmaf(s_t, y[t], out[t]) over the D values of rows t < n (out: rows of D values of the
 * buffer), y the expert set's kept outputs [0, n) (expert 0 run with keep on rows [0, n)): s_t = 1
 * without a gate, else the shared expert's gate sigmoid(gate . xn[t]) (gate: D values of a
 * buffer; xn: rows of D values of a buffer, the FFN inputs): the CPU's axpy of a dense MLP onto
 * the residual (out = the hidden rows) or of mq_shared_expert_add (out = the routed sum). */
moeq_status mq_gpu_mlp_add_kept(mq_gpu_mlp *m, mq_gpu_buf *out, const mq_gpu_buf *xn, const mq_gpu_buf *gate,
                                int64_t n);

/* A model's output layer on the device: its final RMSNorm weight norm [D] (epsilon eps) and
 * lm_head [V, D] (host; copied before the call returns); each product takes at most max_rows
 * rows (0: 2048, fewer only where the device cannot hold their logits). */
typedef struct mq_gpu_head mq_gpu_head;
moeq_status mq_gpu_head_new(mq_gpu *g, int64_t D, int64_t V, const float *norm, float eps, const float *lm_head,
                            int64_t max_rows, mq_gpu_head **out);
void mq_gpu_head_free(mq_gpu_head *h);
int64_t mq_gpu_head_rows(const mq_gpu_head *h);

/* What scoring gives per row (mq_eval_score_window's per-token values): the model's log-sum-exp
 * (mq_logsumexp: max + log(sum), not finite where the row is not), first argmax and target
 * logit; with entropy, kl(row, lse, zeros, log V) (mq_entropy_row is log V minus it); with a
 * base, the base row's three and KL(p_base || p_model) (mq_kl_rows). */
typedef struct {
    double lse, ent_kl, lse_b, kl;
    float target, target_b;
    int32_t argmax, argmax_b;
} mq_gpu_row_stats;

/* n rows x [n, D] (host; the hidden states before the final norm) through the final norm and
 * lm_head of h, the logits divided by temperature (1: unchanged), and with base (may be NULL) its
 * rows xb [n, D_base] through base's (undivided): stats[i] for row i predicting target[i]; logits
 * (may be NULL) gets the model's logits [n, V] (host). Rows go in chunks of the smaller head's
 * rows, so a row's results depend only on the rows of its call. */
moeq_status mq_gpu_head_score(mq_gpu_head *h, mq_gpu_head *base, const float *x, const float *xb, int64_t n,
                              const int32_t *target, float temperature, bool entropy, mq_gpu_row_stats *stats,
                              float *logits);

/* Tests: the twins one by one. The final norm of n rows x [n, D] (host) by w [D] into out; the
 * row statistics of given logits rows l [n, V] (and lb, or NULL) as mq_gpu_head_score computes
 * them. */
moeq_status mq_gpu_rmsnorm_rows(mq_gpu *g, const float *x, int64_t n, int64_t D, const float *w, float eps,
                                float *out);
moeq_status mq_gpu_row_stats_of(mq_gpu *g, const float *l, const float *lb, int64_t n, int64_t V,
                                const int32_t *target, bool entropy, mq_gpu_row_stats *stats);
/* The quantized MoE feed-forward op on the GPU (moe.cu; moeq_moe_cuda_* in include/moeq.h is the
 * public face): the experts of a layer packed once into the device layout (moe_dev.cuh), routing
 * fixed at upload, then calls on x [T, D] (host or device memory; with host memory the call
 * waits for its result, with device memory it is only queued on stream 0). math: MQ_GPU_MOE_BF16
 * (tensor cores) or MQ_GPU_MOE_FP32 (the CPU op's arithmetic; include/moeq.h says what each
 * guarantees). zp: asymmetric INT4 zero points, or NULL. */
typedef struct mq_gpu_moe mq_gpu_moe;
enum { MQ_GPU_MOE_BF16 = 0, MQ_GPU_MOE_FP32 = 1, MQ_GPU_MOE_BASELINE = 2 };
moeq_status mq_gpu_moe_upload(mq_gpu *g, const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                              const moeq_moe_ffn_args *routing, mq_gpu_moe **out);
void mq_gpu_moe_free(mq_gpu_moe *m);
size_t mq_gpu_moe_bytes(const mq_gpu_moe *m);
moeq_status mq_gpu_moe_ffn(mq_gpu_moe *m, const float *x, int64_t T, int math, float *out);
/* The bf16 path's tile shape for every later call (tests, bench): 0: 64 outputs x 8 rows,
 * 1: 128 x 32, 2: 128 x 64, 3: 128 x 128; -1: by the rows per expert (the default). */
void mq_gpu_moe_force_tiles(mq_gpu_moe *m, int shape);
/* Tests: the routing of the last call (sel, wt [T, k]; gshared [T] when the layer has a shared
 * gate; each may be NULL), and expert e's (E: the shared one) matrix which (0 gate_up, 1 down)
 * as the bf16 path decodes it, before the NVFP4 global scale, into out [rows, cols] (canonical
 * order). */
moeq_status mq_gpu_moe_last_routing(mq_gpu_moe *m, int32_t *sel, float *wt, float *gshared);
moeq_status mq_gpu_moe_dequant(mq_gpu_moe *m, int64_t expert, int which, float *out);
/* The same kernels run by a host emulator (moe_emu.cu, simt_emu.cuh: each CUDA thread a
 * coroutine, the warp collectives as the PTX manual defines them; no GPU needed, small shapes
 * only): the result of
 * mq_gpu_moe_upload + mq_gpu_moe_ffn with tile shape `tiles` (-1: by the rows), with its routing
 * (sel, wt [T, k], gsh [T]; each may be NULL), and one matrix as mq_gpu_moe_dequant decodes it.
 * The fp32 mode's values are the card's; the bf16 mode's differ from the card's only in how the
 * tensor cores round their sums (the emulator sums each step's 16 products in double). */
moeq_status mq_gpu_moe_emulate(const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                               const moeq_moe_ffn_args *routing, const float *x, int64_t T, int math, int tiles,
                               float *out, int32_t *sel, float *wt, float *gsh);
moeq_status mq_gpu_moe_emulate_dequant(const moeq_moe_experts_desc *d, const moeq_moe_zero_points *zp,
                                       const moeq_moe_ffn_args *routing, int64_t expert, int which, float *out);
/* Generation's device code run by the same emulator (kvattn_emu.cu; no GPU needed, small shapes
 * only; MOEQ_E_UNSUPPORTED without a CUDA build). mq_gpu_kvattn_emulate: one layer of shape sh
 * and fp32 weights w (q, k, v and o all given) through decode.cu's steps on a KV cache of
 * sh->max_T positions, empty at first: `calls` calls of n[c] new tokens each, in turn from
 * position 0, as mq_gpu_kvattn_run does them (its kernels, launch shapes and order; the products
 * by a host GEMM of the operands mq_cu_product gives cuBLAS, each output one fmaf chain in k
 * order as the fp32 mode's). x [sum n, D]: the rows in order, in place; ffn [sum n, D] (or NULL):
 * their FFN inputs; sel, wt [sum n, top_k] (or NULL; with w->router and ffn): their routing. The
 * emulated device memory is NaN until written, and a kernel writing outside a buffer of the size
 * decode.cu allocates fails the call (MOEQ_E_DEVICE, naming it). mq_gpu_dequantize_emulate: q's
 * values as mq_gpu_kvattn_set_quantized decodes them on the device (dequant.cu) into out
 * [rows, cols]. */
moeq_status mq_gpu_kvattn_emulate(const mq_gpu_attn_shape *sh, const mq_gpu_attn_weights *w, const int64_t *n,
                                  int calls, float *x, float *ffn, int32_t *sel, float *wt);
moeq_status mq_gpu_dequantize_emulate(const mq_qtensor *q, float *out);
/* The comparison of the benchmark: every expert dequantized to bf16 (the global scale folded in),
 * then cuBLAS bf16 GEMMs (grouped, fp32 outputs), SwiGLU, the weighted sums. Waits. */
moeq_status mq_gpu_moe_ffn_baseline(mq_gpu_moe *m, const float *x, int64_t T, float *out);
/* A layer of unquantized experts (an fp32 or bf16 checkpoint's, the evaluation's fast mode):
 * expert e's gate [F, D], up [F, D] and down [D, F] (host memory: bf16 as stored when bf16_src,
 * else fp32, rounded to bf16 on the device),
 * routing as mq_gpu_moe_upload's (no shared expert). mq_gpu_moe_ffn runs it in MQ_GPU_MOE_BF16
 * only: routing as the quantized layers', then cuBLAS bf16 GEMMs with fp32 sums, the SwiGLU
 * output rounded to bf16, the weighted sums in fp32. */
moeq_status mq_gpu_moe_upload_dense(mq_gpu *g, int64_t E, int64_t D, int64_t F, int bf16_src,
                                    const void *const *gate, const void *const *up, const void *const *down,
                                    const moeq_moe_ffn_args *routing, mq_gpu_moe **out);
/* mq_gpu_moe_ffn on device buffers of the layer's GPU: out [T, D] = the layer on x [T, D], queued
 * on stream 0 after what it holds (the evaluation's other work runs there too). */
moeq_status mq_gpu_moe_ffn_buf(mq_gpu_moe *m, mq_gpu_buf *x, int64_t T, int math, mq_gpu_buf *out);
/* Bench: device milliseconds per call, the median of `rounds` replays of a graph of `calls`
 * calls that cycle over layers[i % n_layers] and inputs i % n_x of x (n_x blocks of [T, D],
 * device memory) into out; mode MQ_GPU_MOE_BF16 / _FP32, or MQ_GPU_MOE_BASELINE (no graph: it
 * waits for the routing's counts each call). */
moeq_status mq_gpu_moe_time(mq_gpu_moe *const *layers, int n_layers, mq_gpu_buf *x, int n_x, int64_t T,
                            mq_gpu_buf *out, int mode, int calls, int rounds, double *ms);
/* cuBLAS bf16 GEMMs (fp32 accumulation, bf16 outputs, random data) C_i [M_i, N_i] = A [M_i, K_i]
 * B [N_i, K_i]^T, run back to back: the median milliseconds of the sequence over 7 runs. */
moeq_status mq_gpu_gemm_bf16_time(mq_gpu *g, int n, const int64_t *M, const int64_t *N, const int64_t *K,
                                  double *ms);

#ifdef __cplusplus
}
#endif

#endif
