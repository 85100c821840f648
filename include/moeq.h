/*
 * moeq: post-training quantization (GPTQ, RTN -> NVFP4, INT4) of Mixture-of-Experts and dense LLMs,
 * lm-evaluation-harness-exact evaluation, serving-engine checkpoints, and quantized MoE kernels.
 *
 * This is the only public header. Conventions:
 *  - Every fallible call returns moeq_status (MOEQ_OK = 0, errors < 0). The text of the last
 *    failure on the calling thread is moeq_last_error(); it names the file, tensor or flag.
 *  - Objects are opaque handles: *_open / *_create make them, *_free releases them, *_free(NULL)
 *    is a no-op. Pointers returned by getters are borrowed and live as long as their owner.
 *  - The library never exits, aborts or writes to stdout on bad input.
 */
#ifndef MOEQ_H
#define MOEQ_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOEQ_VERSION_STRING "0.1.0"
const char *moeq_version(void);

/* ------------------------------------------------------------------------------------------ */
/* Status codes. The list only grows; values never change.                                     */
/* ------------------------------------------------------------------------------------------ */
#define MOEQ_STATUS_LIST(X)                                                                        \
    X(MOEQ_OK, 0, "ok")                                                                            \
    X(MOEQ_E_IO, -1, "input/output error")                                                         \
    X(MOEQ_E_FORMAT, -2, "malformed input")                                                        \
    X(MOEQ_E_SHAPE, -3, "shape mismatch")                                                          \
    X(MOEQ_E_NOMEM, -4, "out of memory")                                                           \
    X(MOEQ_E_ARG, -5, "invalid argument")                                                          \
    X(MOEQ_E_UNSUPPORTED, -6, "unsupported")                                                       \
    X(MOEQ_E_NUMERIC, -7, "non-finite value")                                                      \
    X(MOEQ_E_INTERRUPTED, -8, "interrupted")                                                       \
    X(MOEQ_E_NOTFOUND, -9, "not found")                                                            \
    X(MOEQ_E_EXISTS, -10, "already exists")                                                       \
    X(MOEQ_E_DEVICE, -11, "device error")

typedef enum {
#define MOEQ__STATUS_ENUM(name, value, text) name = value,
    MOEQ_STATUS_LIST(MOEQ__STATUS_ENUM)
#undef MOEQ__STATUS_ENUM
} moeq_status;

/* "MOEQ_E_IO" for MOEQ_E_IO; "unknown" for values outside the list. */
const char *moeq_status_name(moeq_status st);
/* A short fixed description ("input/output error"). */
const char *moeq_status_text(moeq_status st);
/* The message of the last failure on this thread ("" when none). Borrowed, valid until the next
 * failing call on this thread. */
const char *moeq_last_error(void);

/* ------------------------------------------------------------------------------------------ */
/* Process-wide runtime settings                                                              */
/* ------------------------------------------------------------------------------------------ */
/* Number of worker threads of the one thread pool (n <= 0: MOEQ_THREADS if set, else the CPUs the
 * process may run on, as nproc counts them). MOEQ_PIN_THREADS=1 pins each worker to a CPU of its
 * own. Results never depend on this number. */
void moeq_set_threads(int n);
int moeq_threads(void);

/* Cooperative cancellation: long jobs poll this flag and return MOEQ_E_INTERRUPTED with their
 * partial result. Safe to call from a signal handler. */
void moeq_interrupt(void);
void moeq_clear_interrupt(void);
int moeq_interrupted(void);

/* Progress reporting for long jobs (eval, calibration, GPTQ, writing). The callback gets a label,
 * the units done so far and the total; it is called from the thread that runs the job. */
typedef void (*moeq_progress_fn)(void *user, const char *label, int64_t done, int64_t total);
void moeq_set_progress(moeq_progress_fn fn, void *user);

/* Log messages (warnings, retries such as a raised GPTQ damping). Default: stderr. level 0 = info,
 * 1 = warning. */
typedef void (*moeq_log_fn)(void *user, int level, const char *msg);
void moeq_set_log(moeq_log_fn fn, void *user);

/* A model as users name it: a Hugging Face hub id "org/name" that is not a local directory is
 * resolved to its snapshot in the local cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
 * ~/.cache/huggingface/hub) at revision (NULL: "main"; a branch or tag under refs/, or a 40-hex
 * commit); anything else comes back unchanged, for the caller to open. *out: free() it. Never
 * downloads: a hub id not in the cache is MOEQ_E_NOTFOUND saying where it looked. */
moeq_status moeq_resolve_model(const char *name, const char *revision, char **out);

/* The memory a job may use when no budget is given (quantize's and eval's max_memory 0): 85% of
 * the memory available now, at most the total less 2 GiB, at least 1 GiB. */
int64_t moeq_default_memory_budget(void);

/* Force the scalar reference kernels (also: environment MOEQ_FORCE_REF=1). */
void moeq_set_force_ref(int on);
/* The CPU kernel set in use, chosen from CPUID at the first call: "avx2+fma", "scalar" (the CPU
 * lacks AVX2 or FMA: the scalar twins, no instruction it lacks is executed) or "scalar (forced)";
 * on 64-bit Arm "neon+dotprod" (SDOT reported by the kernel's HWCAP_ASIMDDP) or "neon". */
const char *moeq_cpu_kernels(void);
/* The kernel set OpenBLAS runs (its openblas_get_corename: "Haswell", "SkylakeX", ...). */
const char *moeq_blas_kernels(void);
/* The OPENBLAS_CORETYPE that suits this CPU when OpenBLAS runs kernels without AVX2 on a CPU with
 * AVX2 and FMA ("SkylakeX" with AVX-512, else "Haswell"), else NULL. OpenBLAS before 0.3.25 (Debian
 * 12 has 0.3.21) falls back to its Prescott kernels on Intel models it does not know, about 4x
 * slower for sgemm. It reads the variable only when it loads: a program acts on this by running
 * again with it set (the moeq CLI re-executes itself once; a set OPENBLAS_CORETYPE is kept). */
const char *moeq_blas_coretype_advice(void);
/* 1 when this build has the CUDA backend (GPTQ with device "cuda"), else 0. */
int moeq_gpu_backend_built(void);

/* Distributed runs (mpirun -np N moeq quantize ...): moeq_dist_start joins the job when the
 * process was started by mpirun and is a no-op otherwise (rank 0 of 1); call it before
 * moeq_quantize and moeq_dist_stop before exiting. moeq_quantize then splits the work over the
 * ranks (see src/pipeline/pipeline.h) and rank 0 writes the checkpoint and the report, byte for
 * byte what one process writes. mpirun with several ranks on a build without MPI is
 * MOEQ_E_UNSUPPORTED. */
int moeq_dist_built(void);
moeq_status moeq_dist_start(void);
void moeq_dist_stop(void);
int moeq_dist_rank(void);
int moeq_dist_size(void);

/* ------------------------------------------------------------------------------------------ */
/* Tensor element types (safetensors dtype names).                                            */
/* ------------------------------------------------------------------------------------------ */
typedef enum {
    MOEQ_DT_BOOL = 0,
    MOEQ_DT_U8,
    MOEQ_DT_I8,
    MOEQ_DT_F8_E5M2,
    MOEQ_DT_F8_E4M3,
    MOEQ_DT_I16,
    MOEQ_DT_U16,
    MOEQ_DT_F16,
    MOEQ_DT_BF16,
    MOEQ_DT_I32,
    MOEQ_DT_U32,
    MOEQ_DT_F32,
    MOEQ_DT_F64,
    MOEQ_DT_I64,
    MOEQ_DT_U64,
    MOEQ_DT_COUNT
} moeq_dtype;

const char *moeq_dtype_name(moeq_dtype dt);     /* "BF16" */
size_t moeq_dtype_size(moeq_dtype dt);          /* bytes per element */

/* ------------------------------------------------------------------------------------------ */
/* Tokenizer (tokenizer.json byte-level BPE, tiktoken.model)                                 */
/* ------------------------------------------------------------------------------------------ */
typedef struct moeq_tokenizer moeq_tokenizer;

/* Loads tokenizer.json (byte-level BPE as GPT-2/OLMo/Llama-3 use it), Kimi K2's tiktoken.model
 * (with its tokenizer_config.json beside it), or a directory holding one of them (tokenizer.json
 * first), or a GGUF file's tokenizer.ggml.* (rebuilt as moeq_model_open rebuilds it);
 * src/io/tokenizer.h lists what is supported. Other model, normalizer, pre-tokenizer or
 * decoder types give MOEQ_E_UNSUPPORTED naming the file and the field. A loaded tokenizer is
 * immutable: encode and decode may be called from several threads at once. */
moeq_status moeq_tokenizer_load(const char *path, moeq_tokenizer **out);
void moeq_tokenizer_free(moeq_tokenizer *tok);
int32_t moeq_tokenizer_vocab_size(const moeq_tokenizer *tok);
/* Special ids from tokenizer_config.json (bos_token/eos_token, a string or {"content": ...})
 * next to tokenizer.json, else config.json's bos_token_id/eos_token_id (the first of a list);
 * -1 when absent. */
int32_t moeq_tokenizer_bos(const moeq_tokenizer *tok);
int32_t moeq_tokenizer_eos(const moeq_tokenizer *tok);
/* Encode UTF-8 text (no special tokens added; special tokens inside the text are matched), id for
 * id as HF tokenizers' encode(text, add_special_tokens=False). *ids is malloc'ed, owned by the
 * caller (non-NULL even when *n_ids is 0). Text that is not valid UTF-8 gives MOEQ_E_FORMAT with
 * a message "... at byte offset N ..." (N: the first bad byte). */
moeq_status moeq_tokenizer_encode(const moeq_tokenizer *tok, const char *text, size_t len,
                                  int32_t **ids, size_t *n_ids);
/* Decode ids to UTF-8 (malloc'ed, NUL-terminated, owned by the caller), keeping special tokens.
 * Bytes that do not form valid UTF-8 (a character cut between ids) become U+FFFD, as HF's decode
 * does. An id outside the vocabulary gives MOEQ_E_ARG. */
moeq_status moeq_tokenizer_decode(const moeq_tokenizer *tok, const int32_t *ids, size_t n_ids,
                                  char **text, size_t *len);
/* The token's string as stored in the vocabulary (byte-level alphabet); NULL if out of range. */
const char *moeq_tokenizer_token(const moeq_tokenizer *tok, int32_t id);

/* ------------------------------------------------------------------------------------------ */
/* Models                                                                                     */
/* ------------------------------------------------------------------------------------------ */
typedef struct moeq_model moeq_model;

/* Activation quantization emulated on the inputs of the quantized decoder Linears (W4A4). */
typedef enum {
    MOEQ_ACT_QUANT_NONE = 0,
    /* NVFP4 quantize-dequantize as torchao's dynamic W4A4: one global scale amax/2688 over the
     * whole 2D input of the call (all tokens of the forward call; a routed expert: its routed
     * rows, i.e. one scale per expert), E4M3 scales per 16 inputs. Applied to the inputs of
     * q/k/v (once per layer), o_proj, dense gate/up and down, every routed expert's gate/up and
     * down and the shared expert's; never to routers, shared_expert_gate or lm_head. On a
     * quantized checkpoint only Linears stored quantized get it; on an unquantized one all of
     * those Linears (a W4A4 emulation with bf16 weights). */
    MOEQ_ACT_QUANT_NVFP4 = 1,
    /* llama.cpp's CPU activation rounding (docs/gguf.md, "Emulating llama.cpp's activations"):
     * the inputs of the Linears llama.cpp computes with Q8_0 activations (those its GGUF holds
     * as Q4_0, Q4_1, NVFP4 or Q8_0) are rounded per row in blocks of 32 as its x86 AVX/AVX2
     * quantize_row_q8_0 does: d = amax/127 stored as fp16, q = round_half_even(x * 127/amax),
     * input fp16(d) * q. Row-local (no dependence on batching or threads). Which Linears: on a
     * .gguf file opened directly, or a checkpoint imported from one (moeq_import_gguf), exactly those
     * whose tensor is Q4_0, Q4_1, Q5_0, Q5_1, NVFP4 or Q8_0 there, lm_head included (`--gguf-rest
     * q8_0`), and those whose tensor is a K-quant (Q3_K..Q6_K) get llama.cpp's Q8_K instead
     * (quantize_row_q8_K_ref per block of 256: with max the block's first value of largest
     * magnitude, s = -127 / max, q = min(127, round_half_even(s * x)), input (1 / s) * q in
     * fp32; lm_head too);
     * otherwise the same as NVFP4 above: on a quantized checkpoint those stored quantized, on an
     * unquantized one every decoder Linear; never routers or shared_expert_gate. Not emulated:
     * the order of llama.cpp's sums (integer block sums times fp16(d_w) * fp16(d_a)), Q8_1's
     * fp16 block sum in Q4_1's offset term, the F16/BF16 rounding
     * llama.cpp gives the activations of F16/BF16 weights (a BF16 lm_head), its F16 KV cache
     * and flash attention. moeq_model_open fails with MOEQ_E_UNSUPPORTED naming the Linear if
     * one to be rounded has an input width that is not a multiple of 32 (llama.cpp has no such
     * quantized tensor). */
    MOEQ_ACT_QUANT_Q8_0 = 2,
} moeq_act_quant;

typedef struct {
    /* Quantized checkpoints: keep every quantized Linear packed (no fp32 copy) and run it on the
     * quantized kernels (src/kernels/moe_ffn.h): MoE layers through the fused MoE op, other
     * Linears as packed GEMMs. The kernels are weight-only: activations enter them as int16
     * blocks (~86 dB), so results are within a small tolerance of the dequantized path, not
     * bit-identical. Tensors or MoE layers the kernels do not support (asymmetric INT4,
     * act-order g_idx, other schemes or group sizes) keep the dequantized fp32 path; an info log
     * names each. Embeddings, norms, routers and lm_head stay fp32 (a quantized lm_head is
     * dequantized). A .gguf is run in place instead (see moeq_set_pack_cache_dir). No effect on
     * unquantized checkpoints or with act_quant (which needs the fp32 path). Calibration hooks (src/model) refuse a model with packed weights. */
    int keep_packed;
    int no_tokenizer;  /* do not load tokenizer.json */
    int act_quant;     /* moeq_act_quant */
    /* Open without loading weights: the checkpoint is checked as a whole load checks it, and
     * moeq_eval then reads each layer's weights when every window reaches that layer and frees
     * them after it (keep_packed packs them a layer at a time), so memory holds one layer, not
     * the model: see moeq_eval. Only moeq_eval runs such a model (moeq_session_create refuses
     * it); info.weight_bytes is then what the stream holds at most (the largest layer and the
     * output layer). */
    int stream;
} moeq_model_options;

typedef struct {
    const char *model_type;   /* "llama", "olmoe", "qwen2_moe", "qwen3_moe", "mixtral" */
    int32_t vocab_size, hidden_size, n_layers, n_heads, n_kv_heads, head_dim;
    int32_t intermediate_size;        /* dense MLP width (0 if none) */
    int32_t n_experts, n_experts_per_tok, moe_intermediate_size;
    int32_t shared_expert_intermediate_size;
    int32_t max_position_embeddings;
    int32_t bos_token_id, eos_token_id;
    int64_t n_params;
    const char *quant_scheme;  /* NULL for an unquantized checkpoint, else e.g. "nvfp4" */
    /* Resident weights: bytes held in memory as loaded (packed codes and scales plus fp32
     * tensors; embeddings, norms, routers and biases included), and what the same model takes
     * with every weight in fp32. */
    int64_t weight_bytes, weight_bytes_fp32;
    /* What the weights take loaded whole (packed where keep_packed packs, else fp32): for a model
     * opened whole weight_bytes, for one opened with stream an estimate from the tensors. */
    int64_t weight_bytes_whole;
    int32_t packed_linears;    /* quantized Linears running packed (each routed expert counts 3) */
    int32_t fallback_linears;  /* quantized Linears kept dequantized because the kernels lack them */
    int32_t act_quant;         /* moeq_act_quant in effect */
} moeq_model_info;

/* dir: a checkpoint directory (config.json, safetensors, tokenizer), or a GGUF file (a .gguf name
 * or the GGUF magic; llama, olmoe, qwen2moe, qwen3moe, Mixtral as llama with experts, deepseek2)
 * read in place: the file is mapped, each tensor appears under its Hugging Face name and is
 * decoded to fp32 only when loaded (a stream's layer at a time), config and tokenizer are made
 * from its KVs in memory: the same model, bit for bit, as moeq_import_gguf's checkpoint of it. A
 * corrupt or truncated file is MOEQ_E_FORMAT naming the file and the field or tensor. */
moeq_status moeq_model_open(const char *dir, const moeq_model_options *opt, moeq_model **out);
void moeq_model_free(moeq_model *m);
const moeq_model_info *moeq_model_get_info(const moeq_model *m);
/* Borrowed; NULL when the model was opened without a tokenizer. */
const moeq_tokenizer *moeq_model_tokenizer(const moeq_model *m);

/* A session: KV cache and scratch for one sequence of up to max_tokens positions. */
typedef struct moeq_session moeq_session;
moeq_status moeq_session_create(const moeq_model *m, int32_t max_tokens, moeq_session **out);
void moeq_session_free(moeq_session *s);
void moeq_session_reset(moeq_session *s);
int32_t moeq_session_pos(const moeq_session *s);
/* Appends n tokens at the current position. logits: [n, vocab] (all rows) or NULL. */
moeq_status moeq_session_forward(moeq_session *s, const int32_t *ids, int32_t n, float *logits);

/* Where a session runs (`moeq generate --device`). device -1: the CPU (the default of
 * moeq_session_options_init); N >= 0: CUDA device N (a build with -DMOEQ_CUDA=ON). On a GPU every
 * layer stays resident on the device with its KV cache: the attention Linears in fp32 (a quantized
 * checkpoint's go up as codes and are decoded there, bit for bit the loader's values), the routed
 * experts of a quantized checkpoint as stored, codes and scales (NVFP4; INT4 symmetric or
 * asymmetric, groups of 32 or more), on the GPU MoE op, other routed experts, shared experts and
 * dense MLPs in fp32 (bf16 with MOEQ_GPU_BF16), the final norm and lm_head on the device; the
 * embeddings are looked up on the host and the logits come back to it. New tokens go through in
 * one batch (prefill in pieces of as many tokens as the attention's scratch holds).
 * gpu_precision (moeq_gpu_precision): MOEQ_GPU_FP32 (the default) computes what the CPU session
 * computes, the sums in another order (fp32; the quantized experts as the CPU's packed kernels do,
 * bit for bit for the same routing); MOEQ_GPU_BF16 runs the routed experts on the bf16 tensor
 * cores and the rest as MOEQ_GPU_TF32 (docs/gpu.md states both tolerances). Before any work the
 * model is checked (deepseek_v3 / kimi_k2, sigmoid or group-limited routing, act_quant, MLP
 * biases: MOEQ_E_UNSUPPORTED) and its bytes on the device are planned: more than the device has
 * free, or than max_gpu_memory (> 0) allows, is MOEQ_E_NOMEM naming both figures. No device, or
 * a build without CUDA: MOEQ_E_UNSUPPORTED. */
typedef struct {
    int device;
    int gpu_precision;
    int64_t max_gpu_memory;   /* bytes of GPU memory the session may hold; 0: the card's free memory */
} moeq_session_options;
void moeq_session_options_init(moeq_session_options *o);
/* Sets one option by the name of `moeq generate`'s flag without the dashes: "device" ("cpu",
 * "cuda", "cuda:N"), "gpu-precision" ("fp32", "tf32x3", "tf32", "bf16"), "max-gpu-memory" (a
 * size: 20GB, 512MiB, bytes). Unknown keys and bad values: MOEQ_E_ARG "KEY=VALUE: expected ...". */
moeq_status moeq_session_options_set(moeq_session_options *o, const char *key, const char *value);
/* moeq_session_create on the device o names (NULL: the CPU, as moeq_session_create). */
moeq_status moeq_session_create_ex(const moeq_model *m, int32_t max_tokens, const moeq_session_options *o,
                                   moeq_session **out);
/* "cpu", or "cuda:N NAME (PRECISION)": where s runs. Borrowed, valid while s lives. */
const char *moeq_session_device(const moeq_session *s);

/* ------------------------------------------------------------------------------------------ */
/* Sampling (src/runtime): choosing each next token, as `moeq generate` does                  */
/* ------------------------------------------------------------------------------------------ */
/*
 * A sampler maps one row of logits l[0..V) (a moeq_session_forward row) to a token id. Every step
 * is computed in double from the float logits, in this fixed order (llama.cpp's default chain:
 * penalties, top-k, top-p, min-p, temperature):
 *
 *  1. Penalties, over the window W: the last repeat_last_n ids of the history (ids given to
 *     moeq_sampler_accept, e.g. the prompt, then every sampled id; -1: all of them; 0: none).
 *     Each id occurring c > 0 times in W (ids outside [0, V) are ignored) gets
 *        l = l > 0 ? l / repeat_penalty : l * repeat_penalty       (CTRL / llama.cpp)
 *        l = l - c * frequency_penalty - presence_penalty          (OpenAI)
 *  2. temperature == 0 (greedy): the id of the largest l, ties to the lower id; no random draw
 *     is taken and steps 3-6 are skipped (none of them can remove the largest logit).
 *  3. The candidates are every id sorted by l, largest first, ties to the lower id. top_k > 0
 *     keeps the first top_k.
 *  4. top_p < 1: with w_i = exp(l_i - l_max) and Z their sum over the candidates (in candidate
 *     order), keeps the shortest prefix whose running sum of w reaches top_p * Z (at least one).
 *  5. min_p > 0: keeps the candidates with exp(l_i - l_max) >= min_p, i.e. p_i >= min_p * p_max
 *     (the most likely one always stays).
 *  6. Temperature: q_i = exp((l_i - l_max) / temperature) over what is left; one uniform u in
 *     [0, 1) from the generator, scaled by the sum of q (in candidate order); the pick is the
 *     first candidate whose running sum of q exceeds u * sum (the last one if rounding leaves
 *     none).
 *
 * The generator is splitmix64 seeded with seed; each sampled token takes exactly one 53-bit
 * uniform, whatever the filters kept, so the n-th token always uses the n-th draw. The same
 * seed, options, history and logits give the same id, independent of the thread count (logits
 * themselves do not depend on it either). Filters run on the untempered distribution (as in
 * llama.cpp; transformers applies temperature before top-k/top-p): temperature only reshapes
 * the draw among the survivors. A NaN or +inf logit, or every logit -inf, is MOEQ_E_NUMERIC
 * naming the id.
 */
typedef struct {
    double temperature;        /* 0: greedy; else finite > 0. Default 1 */
    int32_t top_k;             /* >= 0; 0: off (default) */
    double top_p;              /* (0, 1]; 1: off (default) */
    double min_p;              /* [0, 1]; 0: off (default) */
    double repeat_penalty;     /* finite > 0; 1: off (default) */
    int32_t repeat_last_n;     /* the penalties' window: >= -1 (-1: the whole history). Default 64 */
    double presence_penalty;   /* finite; 0: off (default) */
    double frequency_penalty;  /* finite; 0: off (default) */
    uint64_t seed;             /* default 0 */
} moeq_sampler_options;

/* The defaults above: plain sampling from softmax(l) at temperature 1, no filter, no penalty. */
void moeq_sampler_options_init(moeq_sampler_options *o);

typedef struct moeq_sampler moeq_sampler;
/* Checks every option (MOEQ_E_ARG naming the field and the value) and makes a sampler with an
 * empty history and the generator at seed. The options are copied. */
moeq_status moeq_sampler_create(const moeq_sampler_options *o, moeq_sampler **out);
void moeq_sampler_free(moeq_sampler *s);
/* Empties the history and seeds the generator again: the next draws repeat the first ones. */
void moeq_sampler_reset(moeq_sampler *s);
/* Appends ids to the history the penalties look at (the prompt, or tokens chosen elsewhere). */
moeq_status moeq_sampler_accept(moeq_sampler *s, const int32_t *ids, size_t n);
/* Chooses the next id from logits[0..n_vocab) (not modified) and appends it to the history. */
moeq_status moeq_sampler_sample(moeq_sampler *s, const float *logits, int32_t n_vocab, int32_t *id);

/* Generation helpers. A model's embedding rows may outnumber its tokenizer's ids (OLMoE: 50,304
 * rows for 50,280 tokens) and such an id can be sampled. moeq_tokenizer_decode_ex is
 * moeq_tokenizer_decode with flags: MOEQ_DECODE_SKIP_UNKNOWN decodes ids the tokenizer lacks
 * (outside its vocabulary, or holes in its id range) to nothing instead of failing. Other flag
 * bits are MOEQ_E_ARG. */
#define MOEQ_DECODE_SKIP_UNKNOWN 1u
moeq_status moeq_tokenizer_decode_ex(const moeq_tokenizer *tok, const int32_t *ids, size_t n_ids,
                                     unsigned flags, char **text, size_t *len);
/* The ids that end generation: every id of config.json's eos_token_id (an integer or a list),
 * else moeq_model_info.eos_token_id (the tokenizer's EOS) when it is >= 0. Stores the first cap
 * of them in ids (ids may be NULL when cap is 0) and returns how many there are. */
int32_t moeq_model_eos_ids(const moeq_model *m, int32_t *ids, int32_t cap);

/* A .gguf in place. moeq_model_open with keep_packed (and no act_quant) on a .gguf keeps the file
 * mapped and uses its blocks: Q4_0 and NVFP4 Linears and experts are repacked once for the
 * packed kernels (MoE layers through the fused MoE op); Q8_0, Q4_1, F16, BF16 and F32 Linears, the
 * embeddings and lm_head are read from the mapping (Q8_0 and BF16 rows by dot-product kernels,
 * the others decoded a few rows at a time); only what is neither (K-quants, deepseek2's merged
 * kv_b) is decoded to fp32. Results are within a small tolerance of the fp32-decoded path (the
 * order of the sums; the packed kernels' int16 activation blocks). The repacked layout is
 * cached in a file that the next open maps instead of repacking: "<file>.moeqpack" beside the
 * .gguf ("<dir>.moeqpack" beside a quantized checkpoint folder, whose repacking is cached the same
 * way) when there is one or the folder is writable, else $XDG_CACHE_HOME/moeq (~/.cache/moeq);
 * it is keyed by the .gguf's size, modification time and a hash of its header and of samples of
 * its data, every byte of it is checked against the hashes it carries when it is opened, and a
 * stale or damaged one is ignored and written again (temporary name, then renamed).
 * moeq_set_pack_cache_dir: NULL the default above, "" no cache, else the folder for every cache
 * (process-wide; set it before opening models). */
moeq_status moeq_set_pack_cache_dir(const char *dir);

/* ------------------------------------------------------------------------------------------ */
/* Chat templates, chat and serving (src/runtime/template*.c, chat.c, serve.c)                */
/* ------------------------------------------------------------------------------------------ */
/*
 * A chat template is the model's Jinja2 text that turns a list of messages into the prompt.
 * moeq renders it as transformers' apply_chat_template does (jinja2's ImmutableSandboxedEnvironment
 * with trim_blocks, lstrip_blocks and loopcontrols; raise_exception, strftime_now and a tojson
 * that is json.dumps(ensure_ascii=False)), with the subset of Jinja2 real templates use:
 * if/elif/else, for (loop.*, `if` filters, else), set (also ns.attr and the block form),
 * break/continue, namespace(), range(), the usual operators, Python's str and dict methods
 * (startswith, split, strip, get, items, ...), filters (trim, length, tojson, string, default,
 * items, join, map, select, ...) and tests (defined, none, string, mapping, ...). A construct
 * outside it is MOEQ_E_UNSUPPORTED and a syntax error MOEQ_E_FORMAT, each naming the template
 * line; raise_exception and errors of evaluation (an undefined value used, a type error) are
 * MOEQ_E_ARG with the template's message. Rendering never reads files or the network.
 */
typedef struct moeq_chat_template moeq_chat_template;
/* Parses template text (len bytes, UTF-8); name is used in messages ("chat template NAME line
 * L: ..."). The template has no special tokens: pass bos_token etc. when rendering. */
moeq_status moeq_chat_template_parse(const char *name, const char *text, size_t len,
                                     moeq_chat_template **out);
/* A model's template: path is a checkpoint directory (chat_template.jinja, else
 * tokenizer_config.json's "chat_template": a string, or a list of {"name", "template"}) or a GGUF
 * file (tokenizer.chat_template, or tokenizer.chat_template.NAME). which: a named template
 * ("tool_use", ...), NULL for "default" (or the only one). The special tokens bos_token,
 * eos_token, unk_token and pad_token (tokenizer_config.json, a string or {"content": ...}; a GGUF's
 * token ids) become variables of every render. MOEQ_E_NOTFOUND when the model has no template. */
moeq_status moeq_chat_template_load(const char *path, const char *which, moeq_chat_template **out);
void moeq_chat_template_free(moeq_chat_template *t);
/* The special token the model's configuration names ("bos_token", "eos_token", ...): borrowed,
 * NULL when absent. */
const char *moeq_chat_template_special(const moeq_chat_template *t, const char *name);
/* Renders with the variables of vars_json, a JSON object ("messages", "add_generation_prompt",
 * "tools", "enable_thinking", "bos_token", ...; read as Python's json.loads reads it), over the
 * loaded special tokens and the defaults transformers passes (tools = documents = None,
 * add_generation_prompt = false). *out is malloc'ed, NUL-terminated, owned by the caller.
 * Safe to call from several threads at once on one template. */
moeq_status moeq_chat_template_render(const moeq_chat_template *t, const char *vars_json, size_t len,
                                      char **out, size_t *out_len);
/* The same for a messages list: messages_json is a JSON array of {"role", "content", ...};
 * extra_json (NULL or a JSON object) adds variables (tools, enable_thinking, ...). */
moeq_status moeq_chat_apply(const moeq_chat_template *t, const char *messages_json, size_t len,
                            int add_generation_prompt, const char *extra_json, char **out,
                            size_t *out_len);

/* Generation over a held context (a chat's turns, a server's slot): a session with the ids it
 * holds. moeq_gen_run feeds only what extends them: when the ids held are a prefix of the new
 * prompt (a chat's next turn, rendered in full, begins with the previous prompt and reply), the
 * session's KV cache is kept and the rest fed; otherwise it starts over. Each token is chosen by
 * a sampler made from o->sampling and the prompt (the history the penalties see), so a run gives
 * the same ids as `moeq generate` with the same options. Forward passes of different moeq_gen
 * objects (one per thread) run one at a time, a step each in turn. */
typedef struct {
    int32_t max_tokens;            /* new tokens at most; <= 0: up to the end of the context */
    const char *const *stop;       /* n_stop strings: the text ends before the first one found */
    int32_t n_stop;
    int ignore_eos;                /* 1: the end-of-sequence ids do not stop */
    moeq_sampler_options sampling;
} moeq_gen_options;
void moeq_gen_options_init(moeq_gen_options *o);   /* greedy, no limit, no stop strings */
/* Sets one option by the name of `moeq generate`'s flag without the dashes ("temp", "top-k",
 * "top-p", "min-p", "seed", "repeat-penalty", "repeat-last-n", "presence-penalty",
 * "frequency-penalty", "ignore-eos"; switches "true"/"false"); moeq_gen_option_info lists them.
 * An unknown name or a value out of the option's range: MOEQ_E_ARG "KEY=VALUE: expected ...".
 * max_tokens and the stop strings are set as fields. */
moeq_status moeq_gen_options_set(moeq_gen_options *o, const char *key, const char *value);
size_t moeq_gen_options_size(void);

/* Gets each piece of the text as soon as it is certain: a piece never ends inside a UTF-8
 * character (a trailing U+FFFD waits for the next token) nor inside what may still become a stop
 * string. Returning nonzero stops the run (finish_reason "cancelled"). */
typedef int (*moeq_gen_piece_fn)(void *user, const char *text, size_t len);

typedef struct {
    char *text;                    /* the generated text, cut before a stop string (malloc'ed) */
    size_t text_len;
    int32_t prompt_tokens, reused_tokens, completion_tokens;
    const char *finish_reason;     /* "eos", "stop" (a stop string), "length", "cancelled",
                                      "interrupted" (moeq_interrupt) */
    int32_t stop_index;            /* the stop string found, else -1 */
    double prefill_seconds, decode_seconds;
} moeq_gen_result;
void moeq_gen_result_free(moeq_gen_result *r);   /* frees text; r itself is the caller's */

/* The stop strings' scan, moeq_gen_run's for a caller with its own loop (`moeq generate`):
 * moeq_gen_find_stop: the earliest occurrence at or after from of any stop[k] in t[0..n) (its
 * offset, and k in *which when which is not NULL), else n + 1. moeq_gen_certain: how much of
 * t[0..n) is certain, all of it less a trailing U+FFFD (a character cut between tokens) and less
 * the longest tail that may still become a stop string. */
size_t moeq_gen_find_stop(const char *t, size_t n, size_t from, const char *const *stop, int32_t n_stop,
                          int32_t *which);
size_t moeq_gen_certain(const char *t, size_t n, const char *const *stop, int32_t n_stop);

typedef struct moeq_gen moeq_gen;
/* n_ctx: the positions the session holds (prompt and output), at most the model's context. */
moeq_status moeq_gen_create(const moeq_model *m, int32_t n_ctx, moeq_gen **out);
/* The same with its session on the device so names (moeq_session_create_ex; NULL: the CPU). */
moeq_status moeq_gen_create_ex(const moeq_model *m, int32_t n_ctx, const moeq_session_options *so, moeq_gen **out);
void moeq_gen_free(moeq_gen *g);
void moeq_gen_reset(moeq_gen *g);          /* forget the held ids (the next run starts over) */
int32_t moeq_gen_n_ctx(const moeq_gen *g);
/* Generates after prompt[0..n_prompt) (n_prompt >= 1). A prompt that leaves no room for one new
 * token is MOEQ_E_ARG ("prompt of N tokens ... context of M"); max_tokens is cut to the room
 * left. piece may be NULL. On success *r holds the result (moeq_gen_result_free it). */
moeq_status moeq_gen_run(moeq_gen *g, const int32_t *prompt, size_t n_prompt,
                         const moeq_gen_options *o, moeq_gen_piece_fn piece, void *user,
                         moeq_gen_result *r);

/* OpenAI-compatible requests and responses (src/runtime/serve.c; `moeq serve` puts HTTP around
 * them). A request body of /v1/completions (chat = 0: "prompt", a string or a list of one) or
 * /v1/chat/completions (chat = 1: "messages", rendered with the chat template t and
 * add_generation_prompt; "tools" and "chat_template_kwargs" become template variables) becomes
 * the prompt text and generation options: max_tokens (or max_completion_tokens; default 16 for
 * completions, the context's end for chat), temperature (default 1; 0: greedy), top_p, top_k,
 * min_p, seed (default: from the clock), presence_penalty, frequency_penalty, repeat_penalty (or
 * repetition_penalty), repeat_last_n, stop (a string or up to 16 strings), ignore_eos, stream and
 * stream_options.include_usage. n must be 1; other fields (logprobs, user, ...) are ignored. A
 * malformed body or a bad value is MOEQ_E_FORMAT / MOEQ_E_ARG naming the field (HTTP 400). */
typedef struct {
    int chat, stream, include_usage;
    int add_bos;                 /* completions: the model's BOS goes first, as `moeq generate` */
    char *prompt;                /* the text the model continues (malloc'ed) */
    size_t prompt_len;
    char *model;                 /* the "model" field, or NULL */
    moeq_gen_options gen;        /* gen.stop points into stop_buf */
    char **stop_buf;
} moeq_openai_request;
moeq_status moeq_openai_parse(const char *body, size_t len, int chat, const moeq_chat_template *t,
                              moeq_openai_request *r);
void moeq_openai_request_free(moeq_openai_request *r);
/* The response JSON (malloc'ed) of a finished run: a text_completion or chat.completion object
 * with usage; finish_reason "stop" (EOS or a stop string) or "length". */
char *moeq_openai_response(const moeq_openai_request *r, const char *id, const char *model,
                           int64_t created, const moeq_gen_result *g);
/* One server-sent event's JSON (malloc'ed) of a streamed run: text[0..len) as the next piece
 * (chat: the first event also carries role "assistant"); finish_reason NULL while running; with
 * usage (non-NULL) the closing usage event of stream_options.include_usage. */
char *moeq_openai_chunk(const moeq_openai_request *r, const char *id, const char *model,
                        int64_t created, const char *text, size_t len, int first,
                        const char *finish_reason, const moeq_gen_result *usage);
/* {"error": {"message", "type", "param", "code"}} (malloc'ed); param and code may be NULL. */
char *moeq_openai_error(const char *message, const char *type, const char *param, const char *code);

/* ------------------------------------------------------------------------------------------ */
/* Evaluation (src/eval)                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* Documents to evaluate. Layouts:
 *  - MOEQ_DOCS_WIKITEXT: a document starts at each " = Title = " line (one '=' on each side, as the
 *    pages of EleutherAI/wikitext_document_level); each keeps its text byte for byte, so the pages
 *    partition the file (text before the first title is a document of its own);
 *  - MOEQ_DOCS_JSONL: one JSON object a line with the document in its "page" field, else "text"
 *    (blank lines are skipped);
 *  - MOEQ_DOCS_WHOLE: the whole file is one document.
 * The input must be valid UTF-8 (error: the file and byte offset) and hold at least one document
 * (an empty file is an error). */
typedef struct moeq_docs moeq_docs;
typedef enum { MOEQ_DOCS_WIKITEXT = 0, MOEQ_DOCS_JSONL = 1, MOEQ_DOCS_WHOLE = 2 } moeq_docs_layout;

moeq_status moeq_docs_load(const char *path, moeq_docs_layout layout, moeq_docs **out);
/* The same from memory; name is used in error messages. */
moeq_status moeq_docs_parse(const char *name, const char *data, size_t len, moeq_docs_layout layout,
                            moeq_docs **out);
void moeq_docs_free(moeq_docs *d);
int64_t moeq_docs_count(const moeq_docs *d);
/* Document i's UTF-8 text (borrowed, NUL-terminated) and its length in bytes; NULL if out of
 * range. */
const char *moeq_docs_text(const moeq_docs *d, int64_t i, size_t *len);

/* lm-eval's wikitext detokenizer (preprocess_wikitext.wikitext_detokenizer), byte-exact.
 * *out is malloc'ed and NUL-terminated, owned by the caller. */
moeq_status moeq_wikitext_detokenize(const char *text, size_t len, char **out, size_t *out_len);
/* len(re.split(r"\s+", text)) with Python's Unicode whitespace: 1 + the number of maximal
 * whitespace runs (leading and trailing whitespace each count an empty word). */
int64_t moeq_count_words(const char *text, size_t len);

/* Perplexity the way lm-evaluation-harness computes loglikelihood_rolling (docs formats.md s3):
 * each document (detokenized for MOEQ_TASK_WIKITEXT) is tokenized without special tokens, split
 * into disjoint windows of max_length tokens, each conditioned on one token of context (the prefix
 * token before the first), and its log-likelihood summed over every token. Words and bytes are
 * counted on the original text. The windows run in parallel on the thread pool; the result
 * does not depend on the thread count. A document that tokenizes to nothing counts with 0
 * tokens and log-likelihood 0 (its words and bytes still count, as in lm-eval) and a warning is
 * logged. */
typedef enum {
    MOEQ_TASK_WIKITEXT = 0,   /* lm-eval "wikitext": wikitext detokenizer, word perplexity */
    MOEQ_TASK_TEXT = 1,       /* any text as is */
} moeq_eval_task;

#define MOEQ_EVAL_DEFAULT_TOP_K 64

typedef struct {
    moeq_eval_task task;
    int32_t max_length;          /* tokens per window; 0: config max_position_embeddings */
    int64_t limit;               /* only the first N documents; 0: all */
    int add_bos;                 /* prepend BOS to each document's tokens (lm-eval >= 0.4.10 with
                                  * a tokenizer that adds BOS) */
    int32_t prefix_token;        /* -1: the tokenizer's BOS, else its EOS (lm-eval's
                                  * prefix_token_id); >= 0: this id */
    /* KL(p_base || p_model) per scored token: against a base model run on the same windows
     * (exact), or against top-k logits saved earlier with save_logits (at most one of the two).
     * Saved logits give the KL between the distributions coarsened to the base's top-k tokens
     * plus one bucket for the rest: a lower bound of the exact KL (the rest of the vocabulary
     * counts as one token); top1_changed is exact either way. */
    const moeq_model *kl_base;
    const char *kl_logits;
    /* Write this model's top-k logits and row log-sum-exp per scored token (atomically). */
    const char *save_logits;
    int32_t save_top_k;          /* 0: MOEQ_EVAL_DEFAULT_TOP_K */
    /* Optional outputs, moeq_docs_count() entries each (documents not evaluated: NaN / -1). */
    double *doc_loglikelihood;
    int64_t *doc_tokens;
    /* With KL: each document's mean KL per scored token and share of tokens whose argmax
     * changed; with kl_base: the base model's log-likelihood of each document. */
    double *doc_kl;
    double *doc_top1_changed;
    double *doc_base_loglikelihood;
    /* Diagnostics of confidence (lm-eval has neither): this model's logits are divided by
     * temperature before the softmax (0 or 1: unchanged; the base's and saved logits are not),
     * and entropy adds the mean entropy of its predictive distribution per scored token. */
    double temperature;
    int entropy;
    /* Models opened with moeq_model_options.stream run layer by layer: every window goes through
     * layer l before layer l + 1, the model and its kl_base in lockstep, each layer's weights
     * read when it starts and freed when it ends. The activations at the layer boundary (every
     * window's rows, per model) stay in memory where max_memory allows, else in files of
     * work_dir; the final norm, lm_head and scores run a window at a time at the end. The
     * results are those of the whole-model forward, bit for bit (the same products on the same
     * rows), at any budget and thread count. */
    int64_t max_memory;          /* bytes the run may hold; 0: 85% of the memory available */
    const char *work_dir;        /* boundary files and the resume record; NULL: a directory
                                    named by the run's inputs under $TMPDIR (else /tmp), removed
                                    when the run ends, kept after an interrupt or failure once a
                                    layer's boundary is durable */
    int resume;                  /* continue an interrupted streamed run from work_dir's record
                                    (the same models, data and options), else start afresh */
    int dry_run;                 /* plan only: res->plan, nothing run */
    /* Where the forward and the scores run (`moeq eval --device`): -1 the CPU (the default of
     * moeq_eval_options_init); N >= 0 CUDA device N (a build with -DMOEQ_CUDA=ON). On a GPU the
     * models run layer by layer as a streamed eval does (opened with stream, or whole): each
     * layer's weights go up once, every window goes through attention, routing, the routed
     * experts, the shared expert or dense MLP and the residual on the device, then the final
     * norm, lm_head and each token's scores; the host sums them in the CPU's order. fp32 products
     * in another order than the CPU's: results within the tolerance docs/eval.md derives, not
     * bit for bit. Weights must be fp32 on the host (a quantized checkpoint opened with
     * keep_packed off is dequantized); deepseek_v3 / kimi_k2, sigmoid routing and act_quant are
     * refused (MOEQ_E_UNSUPPORTED) before any work; no device, or a build without CUDA, is
     * MOEQ_E_UNSUPPORTED too. save_logits / kl_logits copy each row's logits back (slower). */
    int device;
    int gpu_precision;           /* moeq_gpu_precision (`--gpu-precision`), with a device: fp32
                                    (0, the default), tf32x3 (1) or tf32 (2): products on TF32
                                    tensor cores, faster and less exact; bf16 (3): the routed
                                    experts in bf16 too, the fastest (docs/eval.md) */
    int64_t max_gpu_memory;      /* `--max-gpu-memory`, with a device: bytes of GPU memory the
                                    run may hold (0, the default: the card's); what would go
                                    over it fails as out of memory, naming the bound */
} moeq_eval_options;

void moeq_eval_options_init(moeq_eval_options *o);

typedef struct {
    double loglikelihood;        /* natural log, summed over every scored token */
    int64_t tokens, words, bytes, documents;
    int64_t empty_documents;     /* of documents: those that tokenized to nothing */
    double word_perplexity;      /* exp(-loglikelihood / words) */
    double byte_perplexity;      /* exp(-loglikelihood / bytes) */
    double bits_per_byte;        /* -loglikelihood / bytes / ln 2 */
    double token_perplexity;     /* exp(-loglikelihood / tokens) */
    int32_t max_length, prefix_token;
    double seconds, tokens_per_second;
    int interrupted;             /* 1: only the documents finished before the interrupt count */
    /* KL, when requested */
    int has_kl;
    int64_t kl_tokens;
    double kl_mean;              /* mean KL(p_base || p_model) per scored token, nats */
    double kl_p99;               /* its 99th percentile (numpy linear interpolation) */
    double top1_changed;         /* share of tokens whose argmax differs from the base's */
    int32_t kl_top_k;            /* 0: exact over the vocabulary; else from saved top-k logits */
    double kl_gap_bound;         /* top-k: mean per-token upper bound of (exact - reported) KL */
    /* entropy, when requested: mean over scored tokens of -sum p log p, nats */
    int has_entropy;
    double entropy_mean;
    /* KL: how many scored tokens fall in each bin of per-token KL: bin 0 below 1e-7, bin i
     * (1 .. 16) in [10^(-7 + (i-1)/2), 10^(-7 + i/2)), bin 17 from 10 up */
#define MOEQ_KL_HIST_BINS 18
    int64_t kl_hist[MOEQ_KL_HIST_BINS];
    /* with kl_base: the base model on the same windows */
    int has_base;
    double base_loglikelihood, base_word_perplexity;
    /* The memory plan of the run (streamed or not) and what it measured. */
    struct {
        int streamed;            /* 1: layer by layer (a model opened with stream) */
        int threads;             /* windows in flight at once (the plan may use fewer than the
                                    pool's threads to fit max_memory; results do not change) */
        int64_t budget;          /* max_memory, or the default */
        int64_t peak_bytes;      /* planned peak of the run */
        int64_t resident_bytes;  /* models loaded whole (weights) */
        int64_t layer_bytes;     /* the largest layer a stream holds (weights, packed or fp32) */
        int64_t read_ahead_bytes; /* the next layer, read while this one runs (0: not read ahead;
                                    on the CPU only where the budget holds it beside the rest) */
        int64_t head_bytes;      /* streamed final norms and lm_heads, held while scoring */
        int64_t window_bytes;    /* per window in flight: states (KV cache, scratch) */
        int64_t score_bytes;     /* per window being scored: logits and records */
        int64_t boundary_bytes;  /* one model's activations at a layer boundary, every window */
        int boundary_in_memory[2];   /* [model, kl_base]: 1 in memory, 0 in work_dir files */
        int64_t disk_bytes;      /* work_dir files at most */
        int64_t windows, rows;   /* windows, and the rows they feed the model */
        double flops;            /* the forward's FLOPs, every model */
        double core_gflops;      /* the cores' measured sgemm rate (a single-threaded product on
                                    each), what windows run at */
        double eta_seconds;      /* flops over that rate, from the start (resumed layers not
                                    counted) */
        int32_t layers_resumed;  /* layers an interrupted run had finished */
        int64_t peak_anon_bytes; /* measured peak anonymous memory during the run */
        double forward_gflops;   /* measured: the forward's FLOPs over its seconds */
    } plan;
    /* with moeq_eval_options.device: "cuda:N NAME (PRECISION)"; "" on the CPU */
    char device[128];
} moeq_eval_result;

/* An evaluation drawn as one self-contained page (`moeq eval --html`): XHTML with inline SVG,
 * no scripts: the summary (perplexities against the base, KL, top-1 changes), KL and top-1
 * changes per document, the distribution of per-token KL (kl_hist), and each document's token
 * perplexity against the base's. Every plotted value is also in a data-* attribute. Arrays as
 * moeq_eval_options' (NULL: that plot is left out). */
typedef struct {
    const char *model, *base, *data;   /* names shown */
    const moeq_docs *docs;
    const moeq_eval_result *result;
    const double *doc_loglikelihood, *doc_base_loglikelihood, *doc_kl, *doc_top1_changed;
    const int64_t *doc_tokens;
} moeq_eval_page;
moeq_status moeq_eval_html(const char *path, const moeq_eval_page *page);

/* Evaluates m on docs. On MOEQ_E_INTERRUPTED (moeq_interrupt) *res holds the documents finished
 * so far (res->interrupted = 1) and no logits file is written. */
moeq_status moeq_eval(const moeq_model *m, const moeq_docs *docs, const moeq_eval_options *opt,
                      moeq_eval_result *res);

/* ------------------------------------------------------------------------------------------ */
/* Quantization (src/quant, src/formats, src/export)                                          */
/* ------------------------------------------------------------------------------------------ */

/* Quantizes every decoder Linear of an unquantized Hugging Face checkpoint (attention, dense MLP,
 * shared and routed experts) by round to nearest or GPTQ and writes a checkpoint vLLM and
 * transformers load. Routers, shared_expert_gate, embeddings, norms and lm_head stay in the source
 * dtype and are listed in the config's ignore list. NVFP4 global scales are shared by q/k/v, by
 * gate/up and by each expert's gate/up (vLLM requires it) unless no_fuse. This is what
 * `moeq quantize` runs; each field below names its flag. */
typedef enum {
    MOEQ_QUANT_SCHEME_UNSET = 0,   /* moeq_quantize rejects it: the scheme must be chosen */
    MOEQ_QUANT_NVFP4 = 1,          /* W4A4: NVFP4 weights and calibrated NVFP4 activation scales
                                      (needs calib) */
    MOEQ_QUANT_NVFP4A16 = 2,       /* weight-only NVFP4 */
    MOEQ_QUANT_INT4 = 3,           /* weight-only INT4 */
    /* llama.cpp's K-quants (format MOEQ_FORMAT_GGUF only; docs/gguf.md, "K-quants"): every
     * decoder Linear one type (token_embd and output as gguf_rest says) ... */
    MOEQ_QUANT_Q3_K = 4,
    MOEQ_QUANT_Q4_K = 5,
    MOEQ_QUANT_Q5_K = 6,
    MOEQ_QUANT_Q6_K = 7,           /* ... (Q6_K: llama.cpp's Q6_K file type, output Q6_K) */
    /* ... or llama.cpp's mixtures of its Q3_K_M, Q4_K_M and Q5_K_M file types (more bits for
     * attn_v, ffn_down in some layers, output Q6_K, ...) */
    MOEQ_QUANT_Q3_K_M = 8,
    MOEQ_QUANT_Q4_K_M = 9,
    MOEQ_QUANT_Q5_K_M = 10,
    /* ... or llama.cpp's IQ4_NL and IQ4_XS file types (4-bit indices into a fixed non-uniform
     * table; IQ4_NL blocks of 32 under an fp16 scale, IQ4_XS super-blocks of 256 with 6-bit
     * sub-block scales; attn_v Q5_K where 4 or more query heads share a KV head, output Q6_K) */
    MOEQ_QUANT_IQ4_NL = 11,
    MOEQ_QUANT_IQ4_XS = 12,
} moeq_quant_scheme;

typedef enum { MOEQ_QUANT_RTN = 0, MOEQ_QUANT_GPTQ = 1 } moeq_quant_method;

/* Checkpoint layouts (docs formats.md section 2). */
typedef enum {
    MOEQ_FORMAT_COMPRESSED_TENSORS = 0,   /* NVFP4 or INT4 */
    MOEQ_FORMAT_MODELOPT = 1,             /* NVFP4 only */
    MOEQ_FORMAT_GPTQ = 2,                 /* GPTQ v1, INT4 only */
    MOEQ_FORMAT_GGUF = 3,                 /* one GGUF v3 file for llama.cpp (docs/gguf.md) */
} moeq_ckpt_format;

/* How GPTQ cuts calibration samples from the calibration file. */
typedef enum {
    MOEQ_CALIB_CHUNKS = 0,   /* consecutive chunks of seqlen tokens of the whole text */
    MOEQ_CALIB_RANDOM = 1,   /* random windows (seed) */
    MOEQ_CALIB_DOCS = 2,     /* one document (JSONL record or line) per sample */
} moeq_calib_sampling;

/* Which of the candidate samples GPTQ calibrates on (--calib-balance). */
typedef enum {
    MOEQ_CALIB_BALANCE_NONE = 0,      /* the first nsamples the sampling gives */
    MOEQ_CALIB_BALANCE_EXPERTS = 1,   /* nsamples of calib_pool candidates, chosen so that the
                                         routed experts get tokens evenly: the candidates go
                                         through the unquantized model once (a streamed forward
                                         of calib_pool samples), then a greedy choice maximises
                                         the sum over MoE layers and experts of log(1 + tokens)
                                         (MoEQuant's expert-balanced calibration, from the
                                         user's text instead of generated text) */
} moeq_calib_balance;

/* The GPU's arithmetic for the calibration's products (attention projections, the experts) and
 * the Hessian sums (--gpu-precision). The TF32 modes are deterministic from run to run on one
 * GPU, not the fp32 mode's bits. */
typedef enum {
    MOEQ_GPU_FP32 = 0,     /* fp32 fmaf chains, the CPU's bits (default) */
    MOEQ_GPU_TF32X3 = 1,   /* each product as three on TF32 tensor cores, its inputs split in
                              two TF32 halves (hi*hi + hi*lo + lo*hi): about fp32's accuracy */
    MOEQ_GPU_TF32 = 2,     /* one TF32 product (10-bit mantissas, fp32 sums), the attention's
                              scores and GPTQ's updates too: fastest, least accurate */
    MOEQ_GPU_BF16 = 3,     /* evaluation only: the routed experts on the bf16 tensor cores (the
                              GPU MoE op; fp32 sums), the rest as MOEQ_GPU_TF32 */
} moeq_gpu_precision;

/* When GPTQ takes a group's scale. */
typedef enum {
    MOEQ_GPTQ_GROUPS_DYNAMIC = 0,   /* from the updated weights when the group is reached */
    MOEQ_GPTQ_GROUPS_STATIC = 1,    /* from the original weights (--static-groups) */
    MOEQ_GPTQ_GROUPS_GIDX = 2,      /* act-order groups stored with g_idx (INT4, needs act_order) */
} moeq_gptq_groups;

/* How GPTQ's MSE scale search scores a candidate scale for a group. */
typedef enum {
    MOEQ_GPTQ_MSE_AUTO = -1,     /* the default: GPTQ, except plain for INT4 with one group per
                                    row (scoring a candidate would run GPTQ over the whole row) */
    MOEQ_GPTQ_MSE_PLAIN = 0,     /* plain squared error */
    MOEQ_GPTQ_MSE_HESSIAN = 1,   /* squared error weighted by diag(H) */
    MOEQ_GPTQ_MSE_OBQ = 2,       /* weighted by GPTQ's remaining loss 1/[H_F^-1]_jj */
    MOEQ_GPTQ_MSE_GPTQ = 3,      /* by running GPTQ over the group's columns */
} moeq_gptq_mse_weight;

typedef enum {
    MOEQ_GPTQ_SEQUENTIAL = 0,      /* each block calibrated on the outputs of the quantized blocks
                                      before it */
    MOEQ_GPTQ_NONSEQUENTIAL = 1,   /* every Hessian from the unquantized model */
} moeq_gptq_mode;

/* What GPTQ does for a routed expert that received fewer than min_expert_tokens tokens. */
typedef enum {
    MOEQ_EXPERT_FALLBACK_BLOCK = 0,   /* Hessians of all tokens of the MoE block */
    MOEQ_EXPERT_FALLBACK_RTN = 1,     /* round to nearest */
} moeq_expert_fallback;

/* How a routed token's update to its expert's Hessians is weighted (MoEQuant's affinity-guided
 * GPTQ, arXiv 2505.03804): the expert's output reaches the layer's times the token's gate
 * score, so its error does too. */
typedef enum {
    MOEQ_EXPERT_WEIGHT_NONE = 0,         /* every routed token alike (textbook GPTQ) */
    MOEQ_EXPERT_WEIGHT_GATE = 1,         /* by its gate score g (MoEQuant) */
    MOEQ_EXPERT_WEIGHT_GATE_SQUARED = 2, /* by g^2: the squared output error's own weight */
} moeq_expert_weighting;

/* An orthogonal rotation of the residual stream folded into the weights before calibration and
 * quantization (moeq quantize --rotate); the checkpoint computes the same function in exact
 * arithmetic, so an engine needs nothing: no online transform, the config unchanged (but
 * tie_word_embeddings, which a tied model's rotation unties). */
typedef enum {
    MOEQ_ROTATE_NONE = 0,       /* the weights as the source has them */
    /* R = diag(s) H: block-diagonal Hadamard blocks of rotate_block channels (1/sqrt(b)), s a
     * random sign per channel from a fixed seed. Every RMSNorm weight that feeds the stream's
     * readers is folded into them (then ones); readers (q/k/v, routers, expert and shared-expert
     * gate/up, shared_expert_gate, dense gate/up, lm_head) get W diag(norm) R, writers (o_proj,
     * down projections and their biases) R^T W, the embeddings E R. llama, olmoe, qwen2_moe,
     * qwen3_moe and mixtral; others, and quantized sources, are refused */
    MOEQ_ROTATE_RESIDUAL = 1,
} moeq_rotation_kind;

/* Where the calibration activations at the layer boundary live during a run. */
typedef enum {
    MOEQ_ACT_STORAGE_AUTO = 0,     /* memory while the budget allows, else disk */
    MOEQ_ACT_STORAGE_RAM = 1,      /* fp32 in memory */
    MOEQ_ACT_STORAGE_DISK = 2,     /* fp32 in files of the work directory (same result) */
    MOEQ_ACT_STORAGE_BF16 = 3,     /* bf16 in memory: half the memory, slightly other results */
} moeq_act_storage;

/* The sign of symmetric INT4 group scales. Codes -8 .. 7 times the scale: one side of the grid
 * is a step longer than the other. */
typedef enum {
    MOEQ_INT4_SCALE_AUTO = 0,      /* signed, or positive with reference */
    MOEQ_INT4_SCALE_SIGNED = 1,    /* amax / 8, negative where the group's largest magnitude is
                                      positive, so that it takes the code -8 either way (as
                                      llama.cpp's Q4_0): the longer side where the group needs it;
                                      lowered INT4-g128 GPTQ's KL by 7.5-10.5% on the fixtures
                                      (docs/gptq.md). Engines multiply code and scale:
                                      nothing to do */
    MOEQ_INT4_SCALE_POSITIVE = 2,  /* amax / 7.5 (amax / 7 with reference), always positive */
} moeq_int4_scale_sign;

typedef struct {
    moeq_quant_scheme scheme;      /* --scheme; required */
    moeq_quant_method method;      /* --method (default RTN) */
    moeq_ckpt_format format;       /* --format (default compressed-tensors) */
    int32_t group_size;            /* --group-size. 0: the scheme's (INT4 128, NVFP4 16). INT4: a
                                      positive size dividing every Linear's in-features (32, 64,
                                      128) or -1 = one group per row; NVFP4: 16 only */
    int asym;                      /* --asym: INT4 asymmetric, scale (max-min)/15 with a zero
                                      point (default 0: symmetric, see int4_scale_sign) */
    moeq_int4_scale_sign int4_scale_sign;   /* --int4-scale-sign (symmetric INT4) */
    int mse;                       /* --mse: RTN searches each group's scale (17 points, 0.70-1.10
                                      x max) for the least squared error (GPTQ: gptq.mse) */
    int no_fuse;                   /* --no-fuse: one NVFP4 global scale per tensor */
    /* --scale-search LO:HI[:N]: the range the MSE scale search tries, as multiples of the
     * max-based scale (NVFP4: every E4M3 code in it when the grid is finer than E4M3's steps);
     * 0 = the default: 0.90:1.50:25 for NVFP4 GPTQ, else 0.70:1.10:17. Scales above 1 give no clipped value a smaller step; with
     * GPTQ's own score, 0.9:1.5 lowered the KL of every fixture's NVFP4 checkpoint by 9-11%
     * (docs/gptq.md) at about the same cost */
    double scale_lo, scale_hi;
    int32_t scale_steps;
    /* --global-scale-headroom H: NVFP4's global scale maps the tensor's amax to a block scale of
     * 448/H instead of 448, so that a scale search above the max-based scale (up to H times it)
     * is not clamped by E4M3's largest value for the largest blocks; 0 or 1: none. The checkpoint
     * stores the global scale as usual (nothing changes for the engine) */
    double global_scale_headroom;
    int reference;                 /* --reference: the conventions of
                                      shared/fixtures/reference.json (INT4 amax/7 with F32 scales
                                      in compressed-tensors; NVFP4 per-tensor global scales, block
                                      scales >= 2^-9) */
    const char *const *ignore;     /* --ignore: PCRE2 patterns (unanchored); Linears whose module
                                      name matches one stay unquantized (GPTQ skips them too) */
    int32_t n_ignore;
    const char *calib;             /* --calib: calibration text or JSONL; required by
                                      MOEQ_QUANT_NVFP4 (activation scales) and GPTQ (Hessians),
                                      refused otherwise */
    const char *calib_field;       /* --calib-field: the JSONL records' field (NULL: "text", else
                                      "messages"); a string, or a chat "messages" list joined as
                                      "role: content" lines (plain role names, no chat template).
                                      calib may be plain text, JSONL or either gzip-compressed */
    int64_t calib_tokens;          /* --calib-tokens: W4A4 activation scales from the first N
                                      tokens (default 65536) */
    int64_t max_shard_bytes;       /* --max-shard-size: largest shard; 0 = 5 GB */
    int force;                     /* --force: replace out_dir if it exists (default: fail with
                                      MOEQ_E_EXISTS and leave it untouched) */
    int64_t max_memory;            /* --max-memory: bytes of (anonymous) memory the run may use;
                                      0 = 85% of the memory available when it starts. The plan
                                      must fit before any compute (else MOEQ_E_NOMEM saying what
                                      does not fit and what is needed) */
    const char *work_dir;          /* --work-dir: where an unfinished run keeps its work (the
                                      checkpoint being assembled, activations, its manifest);
                                      NULL = "<out_dir>.moeq-work"; on out_dir's file system */
    int resume;                    /* --resume: continue the run the work directory holds (the
                                      same model, options and calibration, else MOEQ_E_ARG saying
                                      what differs); without it such a directory is
                                      MOEQ_E_EXISTS */
    int dry_run;                   /* --dry-run: plan only (result.plan), write nothing */
    int32_t expert_chunk;          /* --expert-chunk: routed experts loaded at once; 0 = as many
                                      as max_memory allows. Never changes the result */
    moeq_act_storage activations;  /* --activations (default auto) */
    double mpi_timeout;            /* --mpi-timeout: seconds a rank waits for the others at a
                                      step before it gives up (0 = 3600) */
    const char *device;            /* --device: "cpu" (NULL, the default), "cuda" or "cuda:N":
                                      GPTQ's factorisations and column loops on that GPU (a
                                      build with -DMOEQ_CUDA=ON); the codes agree with the
                                      CPU's but for weights within rounding of a threshold */
    moeq_gpu_precision gpu_precision;   /* --gpu-precision (--gpu-tf32: TF32): with a device,
                                      the arithmetic of its calibration products and Hessian
                                      sums; default fp32 throughout */
    struct {                       /* GPTQ only (method MOEQ_QUANT_GPTQ) */
        int64_t nsamples;          /* --nsamples: calibration samples (default 128) */
        int64_t seqlen;            /* --seqlen: tokens per sample, >= 2 (default 512) */
        moeq_calib_sampling sampling;   /* --calib-sampling (default chunks) */
        uint64_t seed;             /* --seed: of MOEQ_CALIB_RANDOM (default 0) */
        int calib_bos;             /* --calib-bos: start every sample with BOS */
        moeq_calib_balance calib_balance;   /* --calib-balance (default none) */
        int64_t calib_pool;        /* --calib-pool: candidate samples calib_balance chooses
                                      from (0, the default: 4 x nsamples); >= nsamples */
        double percdamp;           /* --percdamp: damping, a fraction of mean(diag H), finite and
                                      >= 0 (default 0.01; raised while Cholesky fails) */
        int32_t block_size;        /* --block-size: lazy-update block (default 128) */
        int act_order;             /* --act-order / --no-act-order: -1 (default) = on for INT4,
                                      off for NVFP4 (it hurts NVFP4's 16-column groups); 0 off;
                                      1 on */
        moeq_gptq_groups groups;   /* --groups (default dynamic) */
        int mse;                   /* --no-mse clears it: MSE scale search (default 1) */
        moeq_gptq_mse_weight mse_weight;   /* --mse-weight (default MOEQ_GPTQ_MSE_AUTO) */
        moeq_gptq_mode mode;       /* --gptq-mode (default sequential) */
        int true_sequential;       /* --true-sequential: within a block, attention first and the
                                      MLP/experts on its quantized output (sequential mode only) */
        int64_t min_expert_tokens; /* --min-expert-tokens (default 32) */
        moeq_expert_fallback expert_fallback;   /* --expert-fallback (default block) */
        moeq_expert_weighting expert_weighting; /* --expert-weighting (default none); CPU only */
        int clip_search;           /* --clip-search: INT4 asymmetric (asym): the MSE scale
                                      search clips the two ends of each group's range apart
                                      (three rounds of the grid, about 3x the search's cost) */
        /* --damp-sweep F,F,...: up to 8 percdamp candidates; each Linear input's damping is the
         * candidate whose GPTQ on the first 7/8 of the samples has the least loss on the last
         * 1/8 (held out), then GPTQ runs on all of them with it. n_damp_sweep 0: percdamp alone.
         * CPU only, one process */
        double damp_sweep[8];
        int32_t n_damp_sweep;
        int32_t refine_passes;     /* --refine N: after GPTQ's column loop, N passes of coordinate
                                      descent over the codes on GPTQ's own layer objective, the
                                      group scales kept (never raises it); -1 (default): 2 on
                                      the CPU, 0 with a device; 0: none. CPU only */
        /* --target quantized|unquantized[:A] (asymmetric calibration, GPTAQ's target): GPTQ of
         * a Linear aims at the unquantized model's outputs (A of the way; its inputs from the
         * unquantized model run beside the quantized one) instead of the same weights' outputs
         * on the quantized stream: W becomes W + A W ((2/n) G - H)(H + damping)^-1, G = sum
         * x_f x_q^T (docs/results/gptq_results.md). -1 (default): 0.5 where it runs, else
         * off; 0: off (--target quantized); (0, 1]: A (--target unquantized: 0.5). Sequential
         * mode, not true-sequential, on the CPU (also under mpirun; a resume then needs one
         * process); not with expert_weighting or damp_sweep */
        double target_unquantized;
        int refine_scales;         /* --refine-scales: with refine_passes, after each pass every
                                      group's scale moves to the stored value nearest to its
                                      least-squares optimum for the codes (when that helps) */
        const char *report;        /* --report: JSON report path; NULL (default) =
                                      "<out_dir>/gptq_report.json", or beside a GGUF file
                                      "<out_dir>.gptq_report.json" (moeq_quant_report_path) */
        const char *report_html;   /* --report-html: also this self-contained HTML page (inline
                                      SVG plots of the report: losses per layer and expert,
                                      tokens per expert, time and memory); NULL: none */
    } gptq;
    const char *gguf_rest;         /* --gguf-rest: MOEQ_FORMAT_GGUF's unquantized 2-D tensors:
                                      "auto" (NULL, the default: their source dtype), "f32",
                                      "f16", "bf16" or "q8_0" (norms, biases, routers: F32) */
    int drop_mtp;                  /* --drop-mtp: leave out the multi-token-prediction layers
                                      (DeepSeek-V3's num_nextn_predict_layers, past
                                      num_hidden_layers; the output's config then says 0);
                                      default: they pass through unchanged */
    moeq_rotation_kind rotate;     /* --rotate none|residual (default none) */
    int32_t rotate_block;          /* --rotate-block B: channels per Hadamard block, a power of
                                      two >= 2 dividing the hidden size; 0 (default) = the
                                      scheme's group size (NVFP4 16, INT4 group_size, 64 per
                                      channel), halved until it divides the hidden size */
    double target_bpw;             /* --target-bpw B: K-quant schemes: each tensor's type chosen
                                      from its measured sensitivity so that the file holds at
                                      most B bits per parameter (docs/gguf.md); 0: the scheme's
                                      rules */
    int64_t max_gpu_memory;        /* --max-gpu-memory: with device, bytes of GPU memory the run
                                      may hold (0, the default: the card's free memory); planned
                                      before any compute, a card short of one layer refused */
} moeq_quant_options;

/* Fills o with the defaults of `moeq quantize` (scheme left unset). */
void moeq_quant_options_init(moeq_quant_options *o);

/* The plan of a run (filled before any compute; a dry run returns only this). Bytes of
 * anonymous memory. */
typedef struct {
    int64_t budget, peak;          /* the limit and the largest planned working set */
    int64_t activations;           /* calibration activations at the layer boundary */
    int64_t routing, state;        /* every token's experts; attention state and KV cache */
    int64_t attention;             /* one layer's attention weights, Hessians and factors */
    int64_t expert_chunk;          /* one chunk of routed experts, with Hessians and factors */
    int64_t ffn_other;             /* shared expert or dense MLP, the block Hessian */
    int64_t snapshot_copy;         /* the activation snapshot's copy, written to disk behind the
                                      next layer (0: the layers wait for it) */
    int64_t read_ahead;            /* what is read ahead at most: the next expert chunk's weights
                                      (beside the attention and the chunk before) or the next
                                      layer's attention (beside the last chunk); 0: each part read
                                      in turn (the default; MOEQ_READ_AHEAD=1 asks for it);
                                      counted in attention and expert_chunk */
    int32_t chunk, n_chunks;       /* experts per chunk, chunks per MoE layer */
    int32_t sample_batch;          /* samples whose expert rows run together, at most */
    int32_t attention_passes;      /* per layer: every sample through the attention (2 when
                                      sequential GPTQ runs it unquantized, then quantized; 3 with
                                      the unquantized target's own stream) */
    int32_t ffn_passes;            /* per expert chunk (or MLP): calibration, then the quantized
                                      output (sequential); 3 with the unquantized target */
    moeq_act_storage activations_storage;
    int32_t layers;
    double flops_forward, flops_hessian, flops_gptq;
    double sgemm_gflops;           /* this machine's, measured for the estimate */
    double seconds;                /* estimated wall time */
    int64_t disk_output, disk_work;   /* bytes: the checkpoint; the work files beside it */
    /* with a device (GPTQ on a GPU, one process): GPU memory. gpu_budget: max_gpu_memory, else
     * the card's free memory (0 in a dry run without a GPU and no bound); gpu_least: what one
     * layer needs at the least (the persistent attention object plus the larger of its two
     * stages), its parts: gpu_attention (the attention object with one sample's rows per
     * group), gpu_attention_stage (the attention's Hessian sums and GPTQ of its largest weight),
     * gpu_expert (one routed expert, or the shared/dense MLP: weights, Hessian sums, a lane's
     * rows, GPTQ of its largest weight); gpu_chunk: experts per chunk on the device. Larger
     * batches and waves take what the budget leaves */
    int64_t gpu_budget, gpu_least, gpu_attention, gpu_attention_stage, gpu_expert;
    int32_t gpu_chunk;
} moeq_quant_plan;

/* What a run did (the summary `moeq quantize` prints). */
typedef struct {
    int64_t linears_quantized, linears_kept;   /* Linear modules */
    int64_t weights_quantized;                 /* parameters quantized */
    int64_t tensors_written;
    int64_t bytes_written;                     /* tensor data */
    double seconds;                            /* the whole call */
    /* GPTQ only (zero otherwise) */
    int64_t gptq_samples, gptq_tokens;         /* calibration samples and their tokens */
    int64_t gptq_linears;                      /* Linears in the report */
    int64_t gptq_fallback_linears;             /* of those: experts below min_expert_tokens */
    int64_t gptq_worse_than_rtn;               /* Linears whose GPTQ layer loss exceeds RTN's */
    double gptq_loss, gptq_rtn_loss;           /* layer losses summed over the Linears not RTN */
    double gptq_seconds, gptq_seconds_forward, gptq_seconds_hessian, gptq_seconds_solve;
    moeq_quant_plan plan;
    int64_t peak_anon_bytes;       /* measured peak anonymous memory of the run */
    int32_t layers_resumed;        /* layers an interrupted run had finished */
    int32_t ranks;                 /* processes of the run (1 without mpirun) */
    int64_t rank_peak_anon_bytes[64];   /* measured peak of each of the first 64 ranks */
    /* calib_balance experts, when it chose (more candidates than samples): the candidates, and
     * over every MoE layer's experts those with fewer than min_expert_tokens tokens and the
     * fewest tokens any got, [0] from the first nsamples candidates, [1] from the chosen ones */
    int64_t balance_candidates, balance_under[2], balance_fewest[2];
    double balance_seconds;
    int64_t gpu_peak_bytes;        /* with a device: the peak of GPU memory moeq held (measured by
                                      its allocations), at most max_gpu_memory */
} moeq_quant_result;

/* Quantizes the checkpoint in model_dir into out_dir, streaming: one pass over the source, layer
 * by layer (routed experts a chunk at a time), within max_memory; see src/pipeline/pipeline.h.
 * opts is checked first (MOEQ_E_ARG naming the field: unknown enum values, a scheme/format/
 * group-size combination the format cannot hold, a missing or unused calib, bad GPTQ settings,
 * a bad ignore pattern), then out_dir (MOEQ_E_EXISTS unless force; never model_dir), the source
 * and the memory plan. The checkpoint is assembled in the work directory and renamed to out_dir
 * when complete; a failure or moeq_interrupt() (MOEQ_E_INTERRUPTED) leaves no output, and once a
 * layer is finished the work directory stays so that the same call with resume continues it
 * (killed processes too); the result is byte-identical to an uninterrupted run's and does not
 * depend on the thread count, expert_chunk or max_memory. Progress goes to the
 * moeq_set_progress callback ("quantize"), a line per layer to the log. result may be NULL; on
 * failure it is zeroed except for a dry run's plan. A GGUF file as model_dir is
 * MOEQ_E_UNSUPPORTED (import it first: moeq_import_gguf). */
moeq_status moeq_quantize(const char *model_dir, const char *out_dir,
                          const moeq_quant_options *opts, moeq_quant_result *result);
/* The GPTQ report a moeq_quantize(model_dir, out_dir, opts) call writes: opts->gptq.report, else
 * out_dir/gptq_report.json, or out_dir.gptq_report.json for MOEQ_FORMAT_GGUF (out_dir is then
 * the .gguf file). NULL when the call writes none (not GPTQ, or a dry run) or out of memory;
 * release with moeq_string_free. */
char *moeq_quant_report_path(const char *out_dir, const moeq_quant_options *opts);

/* GGUF (docs/gguf.md). moeq_export_gguf converts a checkpoint directory (compressed-tensors,
 * ModelOpt, GPTQ v1 or unquantized; llama, mixtral, olmoe, qwen2_moe, qwen3_moe) into one GGUF
 * v3 file llama.cpp loads, without requantizing: INT4 symmetric -> Q4_0 (exact with f16 scales,
 * as MOEQ_FORMAT_GGUF quantizes them), asymmetric -> Q4_1, NVFP4 -> NVFP4 + its global scale.
 * rest: as moeq_quant_options.gguf_rest. Combinations llama.cpp would compute differently are
 * MOEQ_E_UNSUPPORTED saying why; out_path is written under a temporary name and renamed when
 * complete. */
moeq_status moeq_export_gguf(const char *ckpt_dir, const char *out_path, const char *rest);
/* A readable description of a GGUF file (header, KVs, tensors when list_tensors) into *text
 * (owned by the caller: free()). A corrupt file is MOEQ_E_FORMAT naming the field. */
moeq_status moeq_gguf_describe(const char *path, int list_tensors, char **text);
/* As moeq_export_gguf with every quantized Linear written dequantized (fp32 as moeq's loader
 * computes it, stored as rest says; NULL/"auto": F32): the same model through llama.cpp's float
 * kernels, the reference a quantized file's llama.cpp logits are measured against. */
moeq_status moeq_export_gguf_dequantized(const char *ckpt_dir, const char *out_path, const char *rest);
/* A GGUF file (llama, olmoe, qwen2moe, qwen3moe, deepseek2; types F32, F16, BF16, Q8_0, Q4_0,
 * Q4_1, Q4_K, Q5_K, Q6_K, NVFP4) as a checkpoint directory: config.json from the KVs (routing as
 * llama.cpp computes it), tokenizer.json from tokenizer.ggml.*, model.safetensors with every
 * tensor decoded to F32 (the whole model in memory while it is written), gguf_types.json with
 * each matrix's ggml type by its HF name (for MOEQ_ACT_QUANT_Q8_0). moeq_model_open reads a .gguf
 * in place with the same result, bit for bit, and none of that memory; the import is for tools
 * that need a directory (the CLI imports a .gguf MODEL given to quantize). */
moeq_status moeq_import_gguf(const char *gguf_path, const char *out_dir);

/* ------------------------------------------------------------------------------------------ */
/* Quantized MoE feed-forward op (src/kernels)                                                */
/* ------------------------------------------------------------------------------------------ */

/*
 * out[t] = sum_{j<k} w[t,j] * FFN(e[t,j], x[t])  +  g[t] * FFN_shared(x[t])        t = 0..T-1
 *
 * FFN(e, x) = down_e( silu(gate_e x) * (up_e x) ), silu(v) = v / (1 + exp(-v)), with the expert's
 * quantized weights (gate_up_e = [gate_proj; up_proj], [2F, D]; down_e [D, F]).
 *
 * Routing (fp32, the model runtime's semantics):
 *   logits[t,e] = x[t] . router[e]                                  (router [E, D], no bias)
 *   softmax scoring: p[t,e] = exp(logits - max) / sum_e' exp(...)  (over ALL E experts, as
 *                    transformers' Mixtral / Qwen2-MoE / OLMoE / Qwen3-MoE)
 *   sigmoid scoring: p[t,e] = 1 / (1 + exp(-logits[t,e]))           (DeepSeek-V3, ExecuTorch)
 *   selection: the k experts with the largest p[t,e] + bias[e] (bias optional, DeepSeek-V3's
 *              e_score_correction_bias: it only chooses, it never weights); ties go to the lower
 *              expert index, NaN scores rank below every number; slot j holds the j-th largest.
 *   groups:    with n_group > 1 the E experts form n_group groups of E / n_group consecutive
 *              ones; a group scores the sum of its two largest p + bias, only the topk_group
 *              groups with the largest scores (ties to the lower group) are eligible for the
 *              selection above (DeepSeek-V3's n_group / topk_group, transformers 5.17 masking the
 *              others with -inf).
 *   weights:   w[t,j] = p[t,e[t,j]]; if renormalize: w[t,j] /= sum_j' w[t,j'] (skipped when the
 *              sum is 0); then w[t,j] *= route_scale.
 *   softmax + renormalize is Mixtral / Qwen3-MoE / Qwen2-MoE(norm_topk_prob) and equals
 *   ExecuTorch's post-top-k softmax; softmax without it is OLMoE / Qwen2-MoE default; sigmoid +
 *   bias + renormalize + route_scale is DeepSeek-V3 and ExecuTorch's sigmoid path.
 * Shared expert (Qwen2-MoE): g[t] = sigmoid(x[t] . shared_gate) when shared_gate is given, else 1.
 * The shared expert is quantized with the same scheme and group size as the routed experts (every
 * Linear of a quantized checkpoint is; the router and the shared gate stay fp32).
 *
 * Weight schemes (canonical unpacked form, what moeq_moe_experts_pack reads):
 *   INT4:  codes u in 0..15 (= q + 8, q in -8..7), fp32 scale per (row, group of group_size
 *          inputs); w = (u - 8) * scale. group_size: a multiple of 32 dividing D and F.
 *   NVFP4: codes are 4-bit E2M1 (sign<<3 | idx, idx -> 0, .5, 1, 1.5, 2, 3, 4, 6), one E4M3 byte
 *          per (row, 16 inputs), one FP32 global scale per expert tensor, used as a divisor
 *          (compressed-tensors): w = e2m1(code) * e4m3(scale) / global_scale. group_size 16.
 *
 * Numerics: the kernels quantize activations (x, and silu(gate)*up) per block of 32 (INT4) or 16
 * (NVFP4) inputs to 16-bit integers (scale = max|v| / 32512, round to nearest even) and take exact
 * integer dot products with the 4-bit weights; block results are scaled and summed in fp32.
 * Results agree with the fp32 computation on the dequantized weights to about 85 dB SQNR (a
 * relative error near 6e-5) and do not depend on the thread count; the scalar reference kernels
 * (moeq_set_force_ref) give bit-identical results to the AVX2 ones.
 * Non-finite inputs propagate (NaN out), they are not errors.
 */

/* A borrowed, dense, row-major tensor. data == NULL marks an absent optional input. */
typedef struct {
    const void *data;
    moeq_dtype dtype;
    int32_t ndim;          /* 1..4 */
    int64_t shape[4];
    size_t nbytes;         /* size of the buffer at data: must hold prod(shape) elements */
} moeq_tensor_ref;

typedef enum { MOEQ_MOE_INT4 = 1, MOEQ_MOE_NVFP4 = 2 } moeq_moe_scheme;
typedef enum { MOEQ_MOE_SOFTMAX = 0, MOEQ_MOE_SIGMOID = 1 } moeq_moe_scoring;

/* One quantized weight (rows x cols per expert; leading dimension E for routed experts). */
typedef struct {
    moeq_tensor_ref codes;         /* U8 [E, rows, cols] (shared expert: [rows, cols]) */
    moeq_tensor_ref scales;        /* INT4: F32 [E, rows, cols/group]; NVFP4: F8_E4M3 [.., cols/16] */
    moeq_tensor_ref global_scale;  /* NVFP4 only, F32: [E] (shared: [1]); for gate_up also [E, 2]
                                      (shared: [2]) = separate (gate, up) scales. INT4: absent. */
} moeq_moe_qweight;

typedef struct {
    moeq_moe_scheme scheme;
    int32_t group_size;          /* INT4: 32, 64, 128, ... (multiple of 32); NVFP4: 16 */
    int32_t nvfp4_global_multiplier;   /* NVFP4: 0 = global_scale is the divisor above
                                          (compressed-tensors weight_global_scale); 1 = it is a
                                          multiplier, w = e2m1 * e4m3 * global_scale (ModelOpt
                                          weight_scale_2) */
    int32_t n_experts;           /* E */
    int32_t hidden;              /* D (hidden_size) */
    int32_t ffn;                 /* F (moe_intermediate_size) */
    moeq_moe_qweight gate_up;    /* [E, 2F, D]: rows 0..F-1 gate_proj, F..2F-1 up_proj */
    moeq_moe_qweight down;       /* [E, D, F] */
    int32_t shared_ffn;          /* Fs (shared_expert_intermediate_size); 0: no shared expert */
    moeq_moe_qweight shared_gate_up;   /* [2Fs, D] */
    moeq_moe_qweight shared_down;      /* [D, Fs] */
} moeq_moe_experts_desc;

/* Packed experts (the kernels' layout), built once per MoE layer. */
typedef struct moeq_moe_experts moeq_moe_experts;

/* Checks every field of d (scheme, group size, shapes, dtypes, buffer sizes, NULL pointers)
 * without reading weight values. MOEQ_E_ARG / MOEQ_E_SHAPE / MOEQ_E_UNSUPPORTED name the field. */
moeq_status moeq_moe_experts_check(const moeq_moe_experts_desc *d);
/* Checks d, validates every code (0..15) and scale (finite; E4M3 not NaN; global scale finite and
 * > 0: MOEQ_E_FORMAT / MOEQ_E_NUMERIC naming tensor, expert, row and column) and packs. The
 * caller's buffers are not referenced afterwards. */
moeq_status moeq_moe_experts_pack(const moeq_moe_experts_desc *d, moeq_moe_experts **out);
void moeq_moe_experts_free(moeq_moe_experts *w);
/* Resident bytes of the packed weights (codes and scales). */
size_t moeq_moe_experts_bytes(const moeq_moe_experts *w);

typedef struct {
    moeq_tensor_ref x;             /* F32 [T, D] (flatten leading dims); T may be 0 */
    moeq_tensor_ref router;        /* F32 [E, D] */
    moeq_tensor_ref router_bias;   /* F32 [E], selection bias; optional */
    moeq_tensor_ref shared_gate;   /* F32 [D] or [1, D]; optional, needs a shared expert */
    const moeq_moe_experts *experts;
    int32_t top_k;                 /* 1..E */
    moeq_moe_scoring scoring;
    int32_t renormalize;           /* 0 or 1 */
    float route_scale;             /* finite; 1 for most models */
    int32_t n_group;               /* 0 or 1: no groups; else it divides E into groups of >= 2 */
    int32_t topk_group;            /* with n_group > 1: eligible groups, 1..n_group, and
                                      top_k <= topk_group * E / n_group */
} moeq_moe_ffn_args;

/* The op's shape function: checks every argument without computing and sets out_shape = {T, D}.
 * Errors (MOEQ_E_ARG / MOEQ_E_SHAPE / MOEQ_E_UNSUPPORTED) name the argument. */
moeq_status moeq_moe_ffn_check(const moeq_moe_ffn_args *a, int64_t out_shape[2]);
/* Runs the op on the process pool: out [T, D] fp32, out_capacity = number of floats at out. */
moeq_status moeq_moe_ffn(const moeq_moe_ffn_args *a, float *out, size_t out_capacity);

/* ------------------------------------------------------------------------------------------ */
/* The MoE feed-forward op on an NVIDIA GPU (src/backend/cuda; docs/gpu.md)                    */
/* ------------------------------------------------------------------------------------------ */

/*
 * moeq_moe_ffn's semantics with a layer's experts resident on a CUDA device (a build with
 * -DMOEQ_CUDA=ON; elsewhere moeq_moe_cuda_create fails with MOEQ_E_UNSUPPORTED saying so). The
 * experts come in the canonical form of moeq_moe_experts_desc and are packed on upload; the
 * routing tensors (router, bias, shared gate) and options are fixed at creation.
 *   MOEQ_MOE_CUDA_BF16: x and the SwiGLU output rounded to bf16, the weights decoded to bf16
 *       (NVFP4 exactly; INT4 as bf16(bf16(scale) * (u - z))), products on the tensor cores with
 *       fp32 sums; routing, the epilogues and the weighted sums in fp32. Relative error against
 *       the exact result (norm of the difference over the norm of the result) below 1.6e-2
 *       (4 bf16 roundings of 2^-8 each; typically 3e-3 to 5e-3).
 *   MOEQ_MOE_CUDA_FP32: the CPU op's arithmetic, operation for operation (16-bit activation
 *       blocks, exact integer dots, fp32 sums): for the same routing the result is the CPU op's
 *       bit for bit; the router's logits are summed in another order than the CPU's, so the
 *       routing weights may differ in the last bits (results then within about 1e-6).
 * Asymmetric INT4 (the GPU op only): zero_points gives a code z (0..15) per (row, group),
 * w = (u - z) * scale; NULL: symmetric (z = 8).
 */
typedef struct {
    moeq_tensor_ref gate_up;          /* U8 [E, 2F, D / group] */
    moeq_tensor_ref down;             /* U8 [E, D, F / group] */
    moeq_tensor_ref shared_gate_up;   /* U8 [2Fs, D / group] (with a shared expert) */
    moeq_tensor_ref shared_down;      /* U8 [D, Fs / group] */
} moeq_moe_zero_points;

typedef enum { MOEQ_MOE_CUDA_BF16 = 0, MOEQ_MOE_CUDA_FP32 = 1 } moeq_moe_cuda_math;
typedef struct moeq_moe_cuda moeq_moe_cuda;

/* Uploads the experts of d to GPU `device` (0-based) with the routing of `routing` (its x and
 * experts are not read); checks as moeq_moe_experts_pack and moeq_moe_ffn_check do, with the same
 * messages ("moe_experts: ...", "moe_ffn_cuda: ..."). The caller's buffers are not referenced
 * afterwards. */
moeq_status moeq_moe_cuda_create(int device, const moeq_moe_experts_desc *d,
                                 const moeq_moe_zero_points *zero_points,
                                 const moeq_moe_ffn_args *routing, moeq_moe_cuda **out);
/* out [T, D] = the layer on x (F32 [T, D], T >= 0); out_capacity: floats at out. x.data and out
 * may be host memory (the call returns with the result there) or device memory of the same GPU
 * (the work is queued; moeq_moe_cuda_sync waits for it). */
moeq_status moeq_moe_cuda_ffn(moeq_moe_cuda *m, const moeq_tensor_ref *x, moeq_moe_cuda_math math,
                              float *out, size_t out_capacity);
moeq_status moeq_moe_cuda_sync(moeq_moe_cuda *m);
/* Device bytes of the packed experts (codes, scales, zero points). */
size_t moeq_moe_cuda_bytes(const moeq_moe_cuda *m);
void moeq_moe_cuda_free(moeq_moe_cuda *m);

/* ------------------------------------------------------------------------------------------ */
/* For bindings (python/ uses ctypes): options by the CLI's flag names, results as JSON        */
/* ------------------------------------------------------------------------------------------ */

/* Sizes of the structs above, so a binding can allocate them without mirroring their layout. */
size_t moeq_quant_options_size(void);
size_t moeq_quant_result_size(void);
size_t moeq_eval_options_size(void);
size_t moeq_eval_result_size(void);
/* Sets one option by the name of `moeq quantize`'s flag without the dashes ("scheme",
 * "method", "calib", "nsamples", "act-order", "max-memory", "report-html", ...; booleans
 * "true"/"false"); moeq_quant_option_info lists them all. String values are kept by pointer:
 * they must outlive the call of moeq_quantize. Unknown names and bad values: MOEQ_E_ARG naming
 * both ("KEY=VALUE: expected ..."). */
moeq_status moeq_quant_options_set(moeq_quant_options *o, const char *key, const char *value);
/* --ignore: n patterns (the array and strings outlive the call of moeq_quantize). */
void moeq_quant_options_set_ignore(moeq_quant_options *o, const char *const *patterns, int32_t n);
/* The same for the options of moeq_eval_options that `moeq eval` has flags for, by their names
 * (moeq_eval_option_info lists them: task, max-length, limit, device, ...); kl_base is a model
 * (moeq_eval_options_set_base), the per-document outputs are arrays (moeq_eval_options_set_docs). */
moeq_status moeq_eval_options_set(moeq_eval_options *o, const char *key, const char *value);
void moeq_eval_options_set_base(moeq_eval_options *o, const moeq_model *base);
/* The per-document outputs of moeq_eval_options (each NULL or moeq_docs_count() entries), and
 * moeq_eval_html with its page's fields as arguments. */
void moeq_eval_options_set_docs(moeq_eval_options *o, double *loglikelihood, int64_t *tokens, double *kl,
                                double *top1_changed, double *base_loglikelihood);
moeq_status moeq_eval_html_flat(const char *path, const char *model, const char *base, const char *data,
                                const moeq_docs *docs, const moeq_eval_result *r, const double *loglikelihood,
                                const double *base_loglikelihood, const double *kl, const double *top1_changed,
                                const int64_t *tokens);
/* Results as one JSON object (malloc'd; release with moeq_string_free). */
char *moeq_quant_result_json(const moeq_quant_result *r);
char *moeq_eval_result_json(const moeq_eval_result *r);
/* A checkpoint's facts from config.json and the safetensors headers (no weights read):
 * model_type, layers, hidden_size, experts, experts_per_token, vocab_size, parameters (total and
 * active per token), tensors and their bytes, quantization method. */
moeq_status moeq_inspect_json(const char *model_dir, char **out);
void moeq_string_free(char *s);
/* libmoeq.so's interface version (bindings check it): 1. */
int moeq_abi_version(void);

/* ------------------------------------------------------------------------------------------ */
/* Options described (issue 57): what the setters by name take, for a CLI or a binding         */
/* ------------------------------------------------------------------------------------------ */
typedef enum {
    MOEQ_OPTION_SWITCH = 0,   /* "true" / "false"; a CLI flag without a value */
    MOEQ_OPTION_INT = 1,      /* an integer in min .. max (min > max: any) */
    MOEQ_OPTION_NUMBER = 2,   /* a finite number */
    MOEQ_OPTION_TEXT = 3,     /* a string (a path, a size such as 6GB, a range such as 0.9:1.5) */
    MOEQ_OPTION_CHOICE = 4,   /* one of choices */
    MOEQ_OPTION_LIST = 5,     /* patterns: moeq_quant_options_set_ignore */
} moeq_option_kind;

typedef struct {
    const char *key;          /* the setter's key (moeq_quant_options_set, moeq_eval_options_set),
                                 the command's flag --KEY (`moeq quantize`, `moeq eval`) */
    moeq_option_kind kind;
    const char *choices;      /* MOEQ_OPTION_CHOICE: the names, "a|b|c"; else NULL */
    int64_t min, max;         /* MOEQ_OPTION_INT: the range the setter accepts */
    const char *metavar;      /* the value's name in help ("N", "FILE"); NULL for switches and
                                 choices */
    const char *help;         /* one line of the command's --help */
    int identity;             /* quantize: 1 when the value changes the checkpoint's bytes, and a
                                 resumed run must be given the same (0: memory, threads, paths,
                                 reports); eval: 0; generation: 1 when giving it asks for
                                 sampling (moeq_gen_option_info) */
} moeq_option_info;

/* The i-th option of moeq_quant_options (i = 0, 1, ...; NULL past the last), in the order of
 * `moeq quantize --help`. moeq_quant_options_set fails with the message "KEY=VALUE: expected
 * ..." (MOEQ_E_ARG) for a value the option does not take. */
const moeq_option_info *moeq_quant_option_info(int i);
/* The same for moeq_eval_options_set's options, in the order of `moeq eval --help`. */
const moeq_option_info *moeq_eval_option_info(int i);
/* The same for moeq_gen_options_set's options, in the order of `moeq generate --help`; identity
 * is 1 for those that ask for sampling (temp, top-k, top-p, min-p, seed): `moeq generate` and
 * `moeq chat` are greedy until one of them is given, then start from temperature 1. */
const moeq_option_info *moeq_gen_option_info(int i);
/* The options o gives, as one JSON object (malloc'd; release with moeq_string_free): a key per
 * option of moeq_eval_option_info, its name with '_' for '-' (`moeq eval --json`'s "settings"). */
char *moeq_eval_settings_json(const moeq_eval_options *o);

/* Tokens as bytes (for `moeq tokenize`): the bytes id stands for (the byte-level alphabet of
 * moeq_tokenizer_token decoded; a token may hold part of a UTF-8 character), *len of them; NULL
 * for an id outside the vocabulary. Borrowed from tok. */
const char *moeq_tokenizer_token_bytes(const moeq_tokenizer *tok, int32_t id, size_t *len);
/* How many bytes at the start of s[0..n) form valid UTF-8 (n when all of it does). */
size_t moeq_utf8_valid_prefix(const char *s, size_t n);

/* moeq_inspect_json with more: flags MOEQ_INSPECT_TENSORS adds "tensor_list" (every tensor's
 * name, dtype, shape and bytes, in natural name order), MOEQ_INSPECT_WEIGHTS "weight_list"
 * (every 2-D weight's storage, group and bits per weight). Without flags: moeq_inspect_json. */
#define MOEQ_INSPECT_TENSORS 1u
#define MOEQ_INSPECT_WEIGHTS 2u
moeq_status moeq_inspect_json_ex(const char *model_dir, unsigned flags, char **out);

#ifdef __cplusplus
}
#endif
#endif /* MOEQ_H */
