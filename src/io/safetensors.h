/*
 * safetensors reading (mmap, single file or sharded with model.safetensors.index.json) and writing
 * (8-aligned header, __metadata__ {"format":"pt"}, tensors sorted by dtype alignment then name,
 * atomic temp+rename). Spec: ../shared/docs/formats.md section 1.
 *
 * Every header field is validated before any tensor byte is touched; a corrupt, truncated or
 * hostile file gives MOEQ_E_FORMAT (or MOEQ_E_IO) with a message naming the file and the problem.
 */
#ifndef MOEQ_SAFETENSORS_H
#define MOEQ_SAFETENSORS_H

#include "core/core.h"

#define MQ_MAX_DIMS 8

struct mq_ggml_view;   /* io/gguf_hf.h */
struct mq_tensor_view;
/* The decoder of a block-quantized weight's rows [r0, r0 + nr) into out[nr * cols], linked to its
 * view by the layer that knows what the codes mean (ckpt/fp8.c for FP8); io only calls it. */
typedef moeq_status (*mq_block_dequant_fn)(const struct mq_tensor_view *w, int64_t r0, int64_t nr,
                                           float *out);

typedef struct mq_tensor_view {
    const char *name;
    moeq_dtype dtype;
    int ndim;
    int64_t shape[MQ_MAX_DIMS];
    int64_t numel;
    const uint8_t *data;   /* borrowed: points into the file mapping. Not necessarily aligned to
                              the element size (files from other writers): load with memcpy */
    size_t nbytes;
    const char *file;      /* path of the file that holds it */
    /* An F8_E4M3 2-D weight of an FP8 block-quantized checkpoint (io/fp8.h; linked by
     * mq_st_open_dir or mq_st_link_fp8): its NAME_scale_inv and the block size; mq_tensor_to_f32
     * then gives the dequantized weight. NULL / 0 for every other tensor. */
    const struct mq_tensor_view *scale_inv;
    int32_t block_rows, block_cols;
    mq_block_dequant_fn dequant;   /* its decoder (mq_st_link_fp8's) */
    bool is_block_scale;   /* this is the scale_inv of such a weight (consumed by it) */
    /* A tensor of a GGUF file read in place (io/gguf_hf.h): data holds ggml blocks, decoded (rows
     * un-permuted, scaled, deepseek2's kv_b merged) as this says when converted; dtype is then
     * F32, F16 or BF16 for those ggml types and U8 for block types, and only mq_tensor_to_f32 /
     * mq_tensor_range_to_f32 read it (a view sliced by its dtype would be wrong). NULL for every
     * safetensors tensor. */
    const struct mq_ggml_view *ggml;
} mq_tensor_view;

typedef struct mq_st mq_st;   /* one file, or all shards of a checkpoint */

/* Errors: MOEQ_E_FORMAT for anything wrong in a file's content (the message names the file and,
 * where there is one, the tensor), MOEQ_E_IO when the OS cannot open/map/read it. */

/* One .safetensors file. */
moeq_status mq_st_open_file(const char *path, mq_st **out);
/* A buffer that stays owned by the caller and must outlive the handle (tests, fuzzing). label
 * names it in error messages. */
moeq_status mq_st_open_buffer(const void *buf, size_t len, const char *label, mq_st **out);
/* A checkpoint directory: model.safetensors.index.json if present (every shard named in the
 * weight_map must exist and every mapped tensor must be in its shard, else MOEQ_E_FORMAT naming
 * the shard and tensor; tensors a shard holds beyond the map are exposed too; a name stored in two
 * shards is an error), else model.safetensors, else the single *.safetensors file in the
 * directory. No such file: MOEQ_E_NOTFOUND; several without an index: MOEQ_E_FORMAT. */
moeq_status mq_st_open_dir_files(const char *dir, mq_st **out);
/* (mq_st_open_dir in ckpt/source.h does this and links an FP8 checkpoint's scales, which takes
 * its config.json: io reads tensors, the checkpoint readers (ckpt/) read configs.) */

/* Links every F8_E4M3 2-D tensor NAME.weight to NAME.weight_scale_inv (blocks of br x bc) and to
 * the decoder `dequant` (ckpt/source.h's mq_fp8_block_dequant): the scale must exist, be F32, BF16
 * or F16 and have shape [ceil(rows / br), ceil(cols / bc)]; a scale_inv without an F8_E4M3 2-D
 * weight beside it is an error too (a 3-D fused FP8 weight: MOEQ_E_UNSUPPORTED). Errors are
 * MOEQ_E_FORMAT naming the file, the tensors and the block size. */
moeq_status mq_st_link_fp8(mq_st *st, int32_t br, int32_t bc, mq_block_dequant_fn dequant);
void mq_st_close(mq_st *st);

size_t mq_st_count(const mq_st *st);
/* Tensors in a stable order (sorted by name). */
const mq_tensor_view *mq_st_at(const mq_st *st, size_t i);
/* NULL if absent (no error set). */
const mq_tensor_view *mq_st_find(const mq_st *st, const char *name);
/* A __metadata__ value of the (first) file, or NULL. For an index, the first shard in name
 * order. */
const char *mq_st_metadata(const mq_st *st, const char *key);

/* moeq_dtype from its safetensors name ("BF16"); returns false if unknown. */
bool mq_dtype_from_name(const char *name, moeq_dtype *out);

/* Converts a floating tensor (F32, F16, BF16, F64, F8_E4M3) to fp32, n = numel values; integer
 * dtypes give MOEQ_E_UNSUPPORTED. An FP8 block-quantized weight (scale_inv set) is dequantized:
 * the view must then be the whole 2-D tensor (a slice or reshape of it is MOEQ_E_ARG), and a NaN
 * code or a non-finite scale is MOEQ_E_FORMAT (mq_fp8_dequant_rows). */
moeq_status mq_tensor_to_f32(const mq_tensor_view *t, float *out);
/* Values [k0, k1) of the tensor in row-major order into out[0, k1 - k0): a slice of a floating
 * tensor as mq_tensor_to_f32 converts it, or of a GGUF tensor (decoded block by block, exactly as
 * the whole tensor decodes). A tensor that converts only whole (mq_tensor_whole_only) needs
 * k0 = 0, k1 = numel, else MOEQ_E_ARG; a bad range is MOEQ_E_ARG. */
moeq_status mq_tensor_range_to_f32(const mq_tensor_view *t, int64_t k0, int64_t k1, float *out);
/* Whether a tensor converts to fp32 only whole: an FP8 block-quantized weight (its scales go by
 * blocks of rows and columns), or deepseek2's kv_b_proj merged from a GGUF's attn_k_b/attn_v_b. */
bool mq_tensor_whole_only(const mq_tensor_view *t);

/* An mq_st over views made elsewhere (a GGUF file read as a checkpoint, io/gguf_hf.h): takes the
 * views (n of them, names malloc'ed) and owner, which the handle frees with free_owner (also on
 * error) after the views; path names it in messages and in each view's file. The views are
 * sorted by name; two of one name are MOEQ_E_FORMAT naming path and the tensor. */
moeq_status mq_st_from_views(const char *path, mq_tensor_view *t, size_t n, void *owner,
                             void (*free_owner)(void *), mq_st **out);

/* ---- writing ---------------------------------------------------------------------------- */
typedef struct mq_st_writer mq_st_writer;

mq_st_writer *mq_stw_new(void);
void mq_stw_free(mq_st_writer *w);
/* Adds a tensor; the data is copied. A duplicate name is MOEQ_E_EXISTS, nbytes != numel * dtype
 * size (or a negative/overflowing shape) MOEQ_E_SHAPE, other bad arguments MOEQ_E_ARG. */
moeq_status mq_stw_add(mq_st_writer *w, const char *name, moeq_dtype dtype, int ndim,
                       const int64_t *shape, const void *data, size_t nbytes);
/* Same, taking ownership of a buffer from mq_alloc (freed by the writer, also on error). */
moeq_status mq_stw_add_owned(mq_st_writer *w, const char *name, moeq_dtype dtype, int ndim,
                             const int64_t *shape, void *data, size_t nbytes);
moeq_status mq_stw_set_metadata(mq_st_writer *w, const char *key, const char *value);
size_t mq_stw_data_bytes(const mq_st_writer *w);
size_t mq_stw_count(const mq_st_writer *w);
/* Writes the file atomically (temporary name, renamed when complete), in the reference writer's
 * layout: {"__metadata__":{"format":"pt",...}, tensors...} padded with spaces to a multiple of 8,
 * tensors ordered by dtype descending in the safetensors enum order (8-byte types first, then 4,
 * 2, 1) and then by name, so each is naturally aligned. Set "format" to replace "pt". The writer
 * keeps its tensors and may be written again. */
moeq_status mq_stw_write(mq_st_writer *w, const char *path);

/* ---- sharded checkpoint writing ------------------------------------------------------------ */
/* Streams tensors into shards of at most max_shard_bytes of tensor data (a tensor larger than
 * that gets a shard of its own; 0 = no limit, one file). Shards keep the order tensors are added
 * in: a new one starts when the next tensor would push the current one past the limit. finish() names them model-0000i-of-0000K.safetensors and writes
 * model.safetensors.index.json ({"metadata":{"total_size":N},"weight_map":{...}}); with a single
 * shard it writes model.safetensors and no index. Shards are flushed to temporary names as they
 * fill, so memory stays bounded by one shard. Directory must exist. */
typedef struct mq_shard_writer mq_shard_writer;
moeq_status mq_shards_open(const char *dir, size_t max_shard_bytes, mq_shard_writer **out);
moeq_status mq_shards_add(mq_shard_writer *sw, const char *name, moeq_dtype dtype, int ndim,
                          const int64_t *shape, const void *data, size_t nbytes);
moeq_status mq_shards_add_owned(mq_shard_writer *sw, const char *name, moeq_dtype dtype, int ndim,
                                const int64_t *shape, void *data, size_t nbytes);
moeq_status mq_shards_finish(mq_shard_writer *sw);
/* A single-shard finish also deletes a stale model.safetensors.index.json, which would otherwise
 * shadow the new model.safetensors. */
/* Frees; if finish() was not reached, removes every shard file written so far. */
void mq_shards_free(mq_shard_writer *sw);

/* ---- planned shards ------------------------------------------------------------------------- */
/* A checkpoint whose tensor list is known before its data (the streaming pipeline's): tensors
 * are assigned to shards in declaration order as mq_shards_add does, each shard is laid out as
 * mq_stw_write lays out a file (so a one-shard plan gives the bytes mq_stw_write gives), files
 * are created at their full size with their headers, and each tensor's data is written to its
 * planned place whenever it is ready, in any order, once or again (a resumed run). */
typedef struct {
    const char *name;
    moeq_dtype dtype;
    int ndim;
    int64_t shape[MQ_MAX_DIMS];
} mq_tensor_decl;

typedef struct mq_shard_plan mq_shard_plan;
/* Shards of at most max_bytes of tensor data (0: one file); duplicate names: MOEQ_E_EXISTS. */
moeq_status mq_shard_plan_new(const mq_tensor_decl *t, size_t n, size_t max_bytes,
                              mq_shard_plan **out);
void mq_shard_plan_free(mq_shard_plan *p);
size_t mq_shard_plan_count(const mq_shard_plan *p);
/* Final file name of a shard: model.safetensors, or model-0000i-of-0000K.safetensors. */
const char *mq_shard_plan_file(const mq_shard_plan *p, size_t shard);
int64_t mq_shard_plan_file_size(const mq_shard_plan *p, size_t shard);
uint64_t mq_shard_plan_total(const mq_shard_plan *p);   /* tensor data bytes */
bool mq_shard_plan_find(const mq_shard_plan *p, const char *name, size_t *shard, int64_t *offset,
                        size_t *nbytes);

/* The shard files of a plan in dir, under hidden temporary names (".<file>.partial"). */
typedef struct mq_shard_files mq_shard_files;
/* Creates (or truncates) them: headers written, data zero. */
moeq_status mq_shard_files_create(mq_shard_plan *p, const char *dir, mq_shard_files **out);
/* Reopens files made by create for the same plan (a resumed run): each must exist with the
 * planned size and header, else MOEQ_E_NOTFOUND / MOEQ_E_FORMAT naming it. A shard that an
 * interrupted finish() already renamed to its final name is taken back. */
moeq_status mq_shard_files_open(mq_shard_plan *p, const char *dir, mq_shard_files **out);
/* Whether the plan holds tensor `name` as dtype of nbytes (MOEQ_E_NOTFOUND / MOEQ_E_SHAPE naming
 * it): what put checks, for a writer that queues the data and writes it later. */
moeq_status mq_shard_files_check(const mq_shard_files *f, const char *name, moeq_dtype dtype, size_t nbytes);
/* Writes a tensor's data to its place (dtype and size checked against the plan); crc (may be
 * NULL): the CRC-32 of the data. */
moeq_status mq_shard_files_put(mq_shard_files *f, const char *name, moeq_dtype dtype,
                               const void *data, size_t nbytes, uint32_t *crc);
/* CRC-32 of what the file holds for a tensor (checking a resumed run's earlier work). */
moeq_status mq_shard_files_crc(mq_shard_files *f, const char *name, uint32_t *crc);
/* Counts a tensor written by an earlier run as written. */
moeq_status mq_shard_files_mark(mq_shard_files *f, const char *name);
/* fdatasync of every file written since the last sync. */
moeq_status mq_shard_files_sync(mq_shard_files *f);
/* fdatasync of every shard, the dirty marks left as they are: safe beside writers on other
 * threads (what they wrote before this call began is on the disk when it returns). */
moeq_status mq_shard_files_sync_all(const mq_shard_files *f);
/* Every tensor must have been written: syncs, renames the files to their final names and writes
 * model.safetensors.index.json (several shards; with one, a stale index is removed). */
moeq_status mq_shard_files_finish(mq_shard_files *f);
/* Closes the files (they stay on disk). */
void mq_shard_files_close(mq_shard_files *f);

#endif
