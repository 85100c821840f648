/* bench moe-ffn's inputs, the same for its CPU and GPU halves (bench.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "core/core.h"

uint64_t bench_rnd64(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

float bench_rnd_normal(uint64_t *s) {
    float u1 = ((float)(bench_rnd64(s) >> 40) + 0.5f) * 0x1p-24f, u2 = (float)(bench_rnd64(s) >> 40) * 0x1p-24f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

void bench_experts_free(bench_experts *h) {
    free(h->guc), free(h->dnc), free(h->gus), free(h->dns), free(h->gg), free(h->dg);
    memset(h, 0, sizeof *h);
}

moeq_tensor_ref bench_ref(const void *p, moeq_dtype dt, int nd, int64_t a, int64_t b, int64_t c, size_t es) {
    moeq_tensor_ref r = {p, dt, nd, {a, b, c, 0}, 0};
    r.nbytes = (size_t)a * (size_t)(nd > 1 ? b : 1) * (size_t)(nd > 2 ? c : 1) * es;
    return r;
}

moeq_status bench_random_experts(int64_t E, int64_t D, int64_t F, int64_t G, bool nv, uint64_t *rng,
                                 bench_experts *h, moeq_moe_experts_desc *d) {
    memset(h, 0, sizeof *h);
    const size_t ngu = (size_t)(E * 2 * F * D), ndn = (size_t)(E * D * F), es = nv ? 1 : 4;
    h->guc = malloc(ngu);
    h->dnc = malloc(ndn);
    h->gus = malloc(ngu / (size_t)G * es);
    h->dns = malloc(ndn / (size_t)G * es);
    h->gg = malloc((size_t)E * 4);
    h->dg = malloc((size_t)E * 4);
    if (!h->guc || !h->dnc || !h->gus || !h->dns || !h->gg || !h->dg) {
        bench_experts_free(h);
        return mq_err(MOEQ_E_NOMEM, "bench moe-ffn: out of memory for the random experts");
    }
    uint8_t *cs[2] = {h->guc, h->dnc};
    const size_t nc[2] = {ngu, ndn};
    for (int m = 0; m < 2; m++)   /* sixteen 4-bit codes a draw */
        for (size_t i = 0; i < nc[m]; i += 16) {
            const uint64_t r = bench_rnd64(rng);
            for (size_t j = 0; j < 16 && i + j < nc[m]; j++) cs[m][i + j] = (uint8_t)((r >> (4 * j)) & 15);
        }
    void *ss[2] = {h->gus, h->dns};
    for (int m = 0; m < 2; m++)
        for (size_t i = 0; i < nc[m] / (size_t)G; i++) {
            if (nv) ((uint8_t *)ss[m])[i] = (uint8_t)(40 + bench_rnd64(rng) % 40);   /* ~1..8 */
            else   /* rounded to bf16, as checkpoints store them (so they pack as 16-bit scales) */
                ((float *)ss[m])[i] =
                    mq_bf16_to_f32(mq_f32_to_bf16(0.01f + 0.01f * (float)(bench_rnd64(rng) >> 40) * 0x1p-24f));
        }
    for (int64_t e = 0; e < E; e++) h->gg[e] = h->dg[e] = 100.0f;
    memset(d, 0, sizeof *d);
    const moeq_dtype sdt = nv ? MOEQ_DT_F8_E4M3 : MOEQ_DT_F32;
    d->scheme = nv ? MOEQ_MOE_NVFP4 : MOEQ_MOE_INT4;
    d->group_size = (int32_t)G;
    d->n_experts = (int32_t)E;
    d->hidden = (int32_t)D;
    d->ffn = (int32_t)F;
    d->gate_up.codes = bench_ref(h->guc, MOEQ_DT_U8, 3, E, 2 * F, D, 1);
    d->gate_up.scales = bench_ref(h->gus, sdt, 3, E, 2 * F, D / G, es);
    d->down.codes = bench_ref(h->dnc, MOEQ_DT_U8, 3, E, D, F, 1);
    d->down.scales = bench_ref(h->dns, sdt, 3, E, D, F / G, es);
    if (nv) {
        d->gate_up.global_scale = bench_ref(h->gg, MOEQ_DT_F32, 1, E, 0, 0, 4);
        d->down.global_scale = bench_ref(h->dg, MOEQ_DT_F32, 1, E, 0, 0, 4);
    }
    return MOEQ_OK;
}

int64_t bench_distinct_experts(int64_t E, int64_t k, int64_t D, const float *router, const float *x, int64_t T,
                               uint8_t *used, float *logits) {
    memset(used, 0, (size_t)E);
    mq_gemm_nt(T, E, D, 1.0f, x, D, router, D, 0.0f, logits, E);
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++) {
        float *l = logits + t * E;
        for (int64_t j = 0; j < k; j++) {
            int64_t b = 0;
            for (int64_t e = 1; e < E; e++)
                if (l[e] > l[b]) b = e;
            n += !used[b];
            used[b] = 1;
            l[b] = -INFINITY;
        }
    }
    return n;
}

int bench_parse_tokens(const char *s, int64_t *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long long v = strtoll(s, &end, 10);
        if (end == s || v < 1 || v > 1 << 20) return -1;
        out[n++] = v;
        s = end;
        if (*s == ',') s++;
        else if (*s) return -1;
    }
    return n;
}
