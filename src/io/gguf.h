/*
 * GGUF v3 (llama.cpp's single-file model format): a reader that checks every field against the
 * file's bounds, a streaming writer, and the block codecs of the ggml types moeq reads or writes.
 *
 * Layout (little endian): "GGUF", u32 version (2 or 3 read, 3 written), u64 tensor count, u64 KV
 * count; KVs (string key, u32 value type, value; strings are u64 length + bytes, arrays u32 element
 * type + u64 count + elements); tensor infos (name, u32 n_dims, u64 ne[n_dims] with ne[0] the
 * contiguous dimension, u32 ggml type, u64 offset from the data section); padding to
 * general.alignment (u32, default 32); the data section, each tensor at an aligned offset.
 *
 * Block types (ggml-common.h's structs, written here field by field):
 *   Q4_0  32 values, 18 B: f16 d, 16 B nibbles; value j = (nib(j) - 8) * d, nibble j in the low
 *         half of byte j (j < 16), nibble j + 16 in its high half
 *   Q4_1  32 values, 20 B: f16 d, f16 m, 16 B nibbles; value = nib * d + m
 *   Q5_0  32 values, 22 B: f16 d, u32 fifth bits, 16 B nibbles; value = (q - 16) * d
 *   Q5_1  32 values, 24 B: f16 d, f16 m, u32 fifth bits, 16 B nibbles; value = q * d + m
 *   Q8_0  32 values, 34 B: f16 d, 32 x int8; value = q * d
 *   Q3_K  256 values, 110 B: 32 B high bits, 64 B 2-bit pairs, 12 B of 6-bit scales, f16 d
 *   (the K-quants' and Q5_x's layouts in detail, and their encoders: formats/kquant.h)
 *   Q4_K  256 values, 144 B: f16 d, f16 dmin, 12 B of 6-bit scales/mins, 128 B nibbles
 *   Q5_K  256 values, 176 B: as Q4_K plus 32 B of fifth bits
 *   Q6_K  256 values, 210 B: 128 B low nibbles, 64 B high 2-bit pairs, 16 x int8 scales, f16 d
 *   NVFP4 64 values, 36 B: 4 UE4M3 scales (one per 16), 32 B E2M1 nibbles; in sub-block s,
 *         byte s*8 + j holds value j (low nibble) and value j + 8 (high nibble); value =
 *         e2m1(code) * e4m3(scale) (0x7F and 0 decode to 0); llama.cpp multiplies the matmul
 *         output by the tensor's NAME.scale (F32 [1] or [E]) where its graph has one.
 */
#ifndef MOEQ_IO_GGUF_H
#define MOEQ_IO_GGUF_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "core/core.h"

#define MQ_GGUF_MAX_DIMS 4

typedef enum {
    MQ_GGUF_U8 = 0, MQ_GGUF_I8 = 1, MQ_GGUF_U16 = 2, MQ_GGUF_I16 = 3, MQ_GGUF_U32 = 4,
    MQ_GGUF_I32 = 5, MQ_GGUF_F32 = 6, MQ_GGUF_BOOL = 7, MQ_GGUF_STRING = 8, MQ_GGUF_ARRAY = 9,
    MQ_GGUF_U64 = 10, MQ_GGUF_I64 = 11, MQ_GGUF_F64 = 12,
} mq_gguf_vtype;

/* ggml tensor types (ggml.h's numbers). */
typedef enum {
    MQ_GGML_F32 = 0, MQ_GGML_F16 = 1, MQ_GGML_Q4_0 = 2, MQ_GGML_Q4_1 = 3, MQ_GGML_Q5_0 = 6,
    MQ_GGML_Q5_1 = 7, MQ_GGML_Q8_0 = 8, MQ_GGML_Q3_K = 11, MQ_GGML_Q4_K = 12, MQ_GGML_Q5_K = 13,
    MQ_GGML_Q6_K = 14, MQ_GGML_IQ4_NL = 20, MQ_GGML_IQ4_XS = 23, MQ_GGML_BF16 = 30,
    MQ_GGML_NVFP4 = 40,
} mq_ggml_type;

const char *mq_gguf_vtype_name(uint32_t t);
/* Name ("q4_0"), values per block and bytes per block of a ggml type; false when moeq does not
 * know it (the name is then "type N" where N fits, and sizes 0). */
bool mq_ggml_type_info(uint32_t type, const char **name, int64_t *block, size_t *block_bytes);

typedef struct {
    const char *key;          /* NUL-terminated copy */
    uint32_t type;            /* mq_gguf_vtype */
    uint32_t arr_type;        /* arrays: element type */
    uint64_t n;               /* arrays: element count; strings: byte length */
    const uint8_t *data;      /* borrowed: the value bytes (string: its bytes; array: elements) */
    const uint8_t **str_at;   /* arrays of strings: n + 1 pointers to each element's length
                                 prefix, the last one past the end (owned by the mq_gguf) */
} mq_gguf_kv;

typedef struct {
    const char *name;
    uint32_t n_dims;
    int64_t ne[MQ_GGUF_MAX_DIMS];   /* ne[0] contiguous; unused dims 1 */
    uint32_t type;
    uint64_t offset;                /* from the data section */
    int64_t numel;
    size_t nbytes;
    const uint8_t *data;            /* borrowed, into the file */
} mq_gguf_tensor;

typedef struct mq_gguf mq_gguf;

/* Parses a whole GGUF image (buf is borrowed and must outlive the result). Every count, length,
 * offset and type is checked against len: a bad or truncated file is MOEQ_E_FORMAT naming label
 * and the field, never a crash. */
moeq_status mq_gguf_parse(const void *buf, size_t len, const char *label, mq_gguf **out);
/* Maps and parses a file. */
moeq_status mq_gguf_open(const char *path, mq_gguf **out);
void mq_gguf_close(mq_gguf *g);

uint32_t mq_gguf_version(const mq_gguf *g);
uint32_t mq_gguf_alignment(const mq_gguf *g);
uint64_t mq_gguf_data_offset(const mq_gguf *g);
size_t mq_gguf_kv_count(const mq_gguf *g);
const mq_gguf_kv *mq_gguf_kv_at(const mq_gguf *g, size_t i);
const mq_gguf_kv *mq_gguf_find_kv(const mq_gguf *g, const char *key);
size_t mq_gguf_tensor_count(const mq_gguf *g);
const mq_gguf_tensor *mq_gguf_tensor_at(const mq_gguf *g, size_t i);
const mq_gguf_tensor *mq_gguf_find_tensor(const mq_gguf *g, const char *name);

/* Typed getters: MOEQ_E_NOTFOUND when absent, MOEQ_E_FORMAT naming the key when the stored type
 * is not the one asked for (llama.cpp is as strict). */
moeq_status mq_gguf_get_u32(const mq_gguf *g, const char *key, uint32_t *v);
moeq_status mq_gguf_get_f32(const mq_gguf *g, const char *key, float *v);
moeq_status mq_gguf_get_bool(const mq_gguf *g, const char *key, bool *v);
/* A string KV (not NUL-terminated in the file): *s points into the file, *len its bytes. */
moeq_status mq_gguf_get_str(const mq_gguf *g, const char *key, const char **s, size_t *len);
/* Element i of an array of strings. */
bool mq_gguf_kv_str_at(const mq_gguf_kv *kv, uint64_t i, const char **s, size_t *len);
/* Element i of a numeric array as a double (false when out of range or not numeric). */
bool mq_gguf_kv_num_at(const mq_gguf_kv *kv, uint64_t i, double *v);

/* Decodes n values (a multiple of the type's block) of a tensor of type `type` from src. */
moeq_status mq_ggml_dequantize(uint32_t type, const void *src, int64_t n, float *dst);
/* The tensor's values as fp32 (dst holds t->numel). */
moeq_status mq_gguf_tensor_to_f32(const mq_gguf_tensor *t, float *dst);

/* ---- block encoders (exact: the caller gives the codes and the scales) ---------------------- */
/* One Q4_0 block from 32 unsigned codes 0..15 (value = (code - 8) * d) and d's f16 bits. */
void mq_ggml_put_q4_0(uint8_t *blk, const uint8_t *codes, uint16_t d_f16);
/* One Q4_1 block: value = code * d + m. */
void mq_ggml_put_q4_1(uint8_t *blk, const uint8_t *codes, uint16_t d_f16, uint16_t m_f16);
/* One NVFP4 block from 64 E2M1 codes (in order) and 4 E4M3 scale codes (sign bit cleared). */
void mq_ggml_put_nvfp4(uint8_t *blk, const uint8_t *codes, const uint8_t *scales);
/* Q8_0 of 32 floats as ggml's reference quantizer does it: d = amax/127, q = round(x/d). */
void mq_ggml_put_q8_0(uint8_t *blk, const float *x);

/* ---- writer ------------------------------------------------------------------------------- */
typedef struct mq_gguf_writer mq_gguf_writer;

mq_gguf_writer *mq_gguf_writer_new(void);
void mq_gguf_writer_free(mq_gguf_writer *w);
/* KVs, in call order. An allocation failure is remembered and returned by mq_gguf_writer_begin. */
void mq_gguf_kv_u32(mq_gguf_writer *w, const char *key, uint32_t v);
void mq_gguf_kv_i32(mq_gguf_writer *w, const char *key, int32_t v);
void mq_gguf_kv_f32(mq_gguf_writer *w, const char *key, float v);
void mq_gguf_kv_bool(mq_gguf_writer *w, const char *key, bool v);
void mq_gguf_kv_str(mq_gguf_writer *w, const char *key, const char *s);
/* Arrays: strings (n pointers, each with its length), INT32 or FLOAT32 elements. */
void mq_gguf_kv_arr_str(mq_gguf_writer *w, const char *key, const char *const *s,
                        const size_t *lens, uint64_t n);
void mq_gguf_kv_arr_i32(mq_gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
/* Declares the next tensor (data written later, in declaration order); ne[0] contiguous. */
moeq_status mq_gguf_writer_tensor(mq_gguf_writer *w, const char *name, uint32_t n_dims,
                                  const int64_t *ne, uint32_t type);
/* Writes the header, the KVs, the tensor infos and the padding to f (opened by the caller). */
moeq_status mq_gguf_writer_begin(mq_gguf_writer *w, FILE *f, const char *path);
/* Appends bytes of the current tensor; a tensor is complete once its nbytes have come, then
 * the padding to the next one follows. MOEQ_E_FORMAT when more bytes come than declared. */
moeq_status mq_gguf_writer_data(mq_gguf_writer *w, const void *data, size_t n);
/* Every tensor must be complete. */
moeq_status mq_gguf_writer_end(mq_gguf_writer *w);
/* Bytes of the declared tensor i. */
size_t mq_gguf_writer_tensor_bytes(const mq_gguf_writer *w, size_t i);

#endif
