/*
 * The checkpoint writer: a quantized Hugging Face checkpoint assembled in a directory while the
 * model is being quantized. Every output tensor is declared first (mq_out_plan), so the shard
 * files are laid out up front (io's planned shards) and each tensor goes to its place as soon as
 * it exists: memory never holds more than the tensors at hand, and a resumed run continues the
 * same files. finish() writes config.json with the format's quantization_config (and the side
 * files ModelOpt and GPTQ loaders read) and copies the tokenizer files; publishing renames the
 * directory over OUT_DIR. Formats: formats.md section 2 (compressed-tensors, ModelOpt NVFP4, GPTQ
 * v1), layouts in export/layout.h. The writer knows tensors, never how they were quantized.
 */
#ifndef MOEQ_EXPORT_WRITER_H
#define MOEQ_EXPORT_WRITER_H

#include <cjson/cJSON.h>

#include "export/layout.h"

typedef struct {
    mq_ckpt_format format;
    mq_qspec spec;            /* the scheme the config block describes */
    bool act_quant;           /* NVFP4 W4A4: input_activations in the config */
    bool act_order;           /* the INT4 layouts carry g_idx (actorder "group") */
    size_t max_shard_bytes;   /* 0: 5 GB */
} mq_ckpt_opts;

typedef struct mq_ckpt_writer mq_ckpt_writer;

/* decls: every tensor the checkpoint will hold, in output order. resume: reopen the partial
 * shards an earlier writer made in dir for the same decls (MOEQ_E_NOTFOUND / MOEQ_E_FORMAT when
 * they are missing or differ), else create them. */
moeq_status mq_ckpt_writer_open(const char *dir, const mq_tensor_decl *decls, size_t n,
                                const mq_ckpt_opts *o, bool resume, mq_ckpt_writer **out);
void mq_ckpt_writer_close(mq_ckpt_writer *w);
/* The tensors of quantized Linear `module` in the format's layout (input_amax > 0: W4A4 scale). */
moeq_status mq_ckpt_writer_put_linear(mq_ckpt_writer *w, const char *module, const mq_qtensor *q,
                                      float input_amax);
/* (Re)writes the W4A4 activation scale of quantized Linear `module` from input_amax. */
moeq_status mq_ckpt_writer_put_input_scale(mq_ckpt_writer *w, const char *module, float input_amax);
/* A tensor stored as given (unquantized Linears, norms, embeddings, ...). */
moeq_status mq_ckpt_writer_put(mq_ckpt_writer *w, const char *name, moeq_dtype dtype,
                               const void *data, size_t nbytes);
/* Write-behind: from here on the Linears' tensors (put_linear, put_input_scale) are queued and
 * written by a thread of the writer while the caller goes on, at most cap bytes queued (the
 * caller waits for room; one larger tensor goes alone). put, sync and finish write what is
 * queued first; crc and the layer's records need a flush. */
moeq_status mq_ckpt_writer_behind(mq_ckpt_writer *w, size_t cap);
/* Waits until everything queued is written; the first write that failed (naming its file),
 * which every put after it returned too. */
moeq_status mq_ckpt_writer_flush(mq_ckpt_writer *w);
/* CRC-32 of the data written for `name` by this writer; false when it has written none (or it
 * is still queued: flush first). */
bool mq_ckpt_writer_crc(const mq_ckpt_writer *w, const char *name, uint32_t *crc);
/* A resumed run: the data an earlier run wrote for `name` must have CRC crc (MOEQ_E_FORMAT when
 * it has not: torn or corrupt); then it counts as written. */
moeq_status mq_ckpt_writer_verify(mq_ckpt_writer *w, const char *name, uint32_t crc);
/* The quantized Linear `module` [rows, cols] as written so far (a resumed run that recomputes
 * activations through layers an earlier run finished). */
moeq_status mq_ckpt_writer_read_linear(mq_ckpt_writer *w, const char *module, int64_t rows,
                                       int64_t cols, mq_qtensor *out);
/* Makes everything written so far durable (fdatasync). */
moeq_status mq_ckpt_writer_sync(mq_ckpt_writer *w);
/* mq_ckpt_writer_sync from another thread while tensors are still being written (what was
 * written before the call is on the disk when it returns). */
moeq_status mq_ckpt_writer_sync_all(const mq_ckpt_writer *w);
/* Tensor data bytes and tensor count of the checkpoint. */
uint64_t mq_ckpt_writer_bytes(const mq_ckpt_writer *w);
/* Every declared tensor must be written: the shards take their final names, then the index,
 * config.json (src_config + quantization_config; src_config is not modified), the format's
 * side file and the tokenizer files of src_dir. kept: the unquantized decoder Linears (the
 * config's ignore list, with lm_head). */
moeq_status mq_ckpt_writer_finish(mq_ckpt_writer *w, const cJSON *src_config, const char *src_dir,
                                  const char *const *kept, size_t n_kept);

/* OUT_DIR checks before any work: never model_dir, existing only with force (and then a
 * directory). MOEQ_E_EXISTS / MOEQ_E_ARG naming out_dir; *exists (may be NULL) tells whether it
 * exists. */
moeq_status mq_ckpt_check_out(const char *model_dir, const char *out_dir, bool force, bool *exists);
/* Renames the finished directory tmp to out; an existing out (force) is moved aside first and
 * removed once the rename succeeded. */
moeq_status mq_ckpt_publish(const char *tmp, const char *out);

#endif
