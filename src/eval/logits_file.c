/*
 * The saved top-k logits file of `moeq eval --save-logits` / `--kl-logits` (layout in eval.h).
 * llama.cpp's perplexity tool saves every logit (16-bit quantized); we keep the k largest fp32
 * logits exactly plus the row's log-sum-exp, which is enough for KL over the k tokens and one
 * "rest" bucket (see mq_kl_topk) and for the base's top-1. Everything is little-endian whatever
 * the host.
 */
#include <string.h>

#include "eval/eval.h"

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

uint64_t mq_fnv1a(uint64_t h, const void *data, size_t n) {
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

void mq_logits_header_encode(const mq_logits_header *h, uint8_t out[MQ_LOGITS_HEADER]) {
    memset(out, 0, MQ_LOGITS_HEADER);
    memcpy(out, MQ_LOGITS_MAGIC, 8);
    put_u32(out + 8, MQ_LOGITS_VERSION);
    put_u32(out + 12, h->vocab);
    put_u32(out + 16, h->k);
    put_u32(out + 20, h->max_length);
    put_u32(out + 24, h->flags);
    put_u32(out + 28, (uint32_t)h->prefix);
    put_u64(out + 32, h->tokens);
    put_u64(out + 40, h->documents);
    put_u64(out + 48, h->ids_checksum);
    put_u64(out + 56, mq_fnv1a(MQ_FNV_INIT, out, 56));
}

moeq_status mq_logits_header_decode(const char *path, const uint8_t *data, size_t size,
                                    mq_logits_header *h) {
    memset(h, 0, sizeof *h);
    if (size < MQ_LOGITS_HEADER || memcmp(data, MQ_LOGITS_MAGIC, 8) != 0)
        return mq_err(MOEQ_E_FORMAT, "%s: not a moeq logits file (no %s header)", path,
                      MQ_LOGITS_MAGIC);
    uint32_t version = get_u32(data + 8);
    if (version != MQ_LOGITS_VERSION)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: logits file version %u, this moeq reads version %u",
                      path, version, MQ_LOGITS_VERSION);
    if (get_u64(data + 56) != mq_fnv1a(MQ_FNV_INIT, data, 56))
        return mq_err(MOEQ_E_FORMAT, "%s: corrupt logits file header (checksum mismatch)", path);
    h->vocab = get_u32(data + 12);
    h->k = get_u32(data + 16);
    h->max_length = get_u32(data + 20);
    h->flags = get_u32(data + 24);
    h->prefix = (int32_t)get_u32(data + 28);
    h->tokens = get_u64(data + 32);
    h->documents = get_u64(data + 40);
    h->ids_checksum = get_u64(data + 48);
    if (h->k == 0 || h->k > h->vocab)
        return mq_err(MOEQ_E_FORMAT, "%s: top-k %u with a vocabulary of %u", path, h->k, h->vocab);
    size_t body, want;
    if (!mq_mul_size((size_t)h->tokens, mq_logits_record_size(h->k), &body) ||
        !mq_add_size(body, MQ_LOGITS_HEADER, &want) || want != size)
        return mq_err(MOEQ_E_FORMAT,
                      "%s: %zu bytes, but the header promises %llu tokens of top-%u "
                      "(truncated or corrupt)",
                      path, size, (unsigned long long)h->tokens, h->k);
    return MOEQ_OK;
}

void mq_logits_record_encode(uint8_t *out, double lse, const uint32_t *ids, const float *vals,
                             uint32_t k) {
    uint64_t bits;
    memcpy(&bits, &lse, 8);
    put_u64(out, bits);
    for (uint32_t i = 0; i < k; i++) put_u32(out + 8 + 4 * (size_t)i, ids[i]);
    for (uint32_t i = 0; i < k; i++) {
        uint32_t b;
        memcpy(&b, &vals[i], 4);
        put_u32(out + 8 + 4 * (size_t)k + 4 * (size_t)i, b);
    }
}

void mq_logits_record_decode(const uint8_t *in, uint32_t k, double *lse, uint32_t *ids,
                             float *vals) {
    uint64_t bits = get_u64(in);
    memcpy(lse, &bits, 8);
    for (uint32_t i = 0; i < k; i++) ids[i] = get_u32(in + 8 + 4 * (size_t)i);
    for (uint32_t i = 0; i < k; i++) {
        uint32_t b = get_u32(in + 8 + 4 * (size_t)k + 4 * (size_t)i);
        memcpy(&vals[i], &b, 4);
    }
}
