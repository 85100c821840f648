/*
 * Checkpoint directory -> one GGUF v3 file for llama.cpp (see gguf_export.h and docs/gguf.md).
 *
 * Names and shapes follow llama.cpp's loaders (src/models/{llama,olmoe,qwen2moe,qwen3moe}.cpp):
 * token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm,
 * ffn_norm, ffn_gate_inp, ffn_{gate,up,down}_exps (ne = {in, out, E}), ffn_gate_inp_shexp,
 * ffn_{gate,up,down}_shexp, ffn_{gate,up,down}}, output_norm, output; ne[0] is the input
 * dimension, so a Linear [out, in] keeps its row-major bytes. llama (dense and Mixtral) uses
 * interleaved RoPE, so the rows of q and k are permuted within each head as llama.cpp's converter
 * does: GGUF row h*hd + 2i + j = HF row h*hd + j*hd/2 + i. A quantized Linear is re-blocked from
 * its codes: INT4 symmetric (groups of 32, 64, 128 or whole rows) -> Q4_0 blocks of 32 with the
 * group's scale as f16 (exact when the scales are f16, as --format gguf quantizes them); INT4
 * asymmetric -> Q4_1 (d = scale, m = -zero * scale rounded to f16); NVFP4 -> ggml NVFP4 blocks of
 * 64 (the E4M3 block scales and E2M1 codes as they are) plus NAME.scale, the global multiplier
 * (1/global for compressed-tensors' divisor), which llama.cpp multiplies into the matmul output.
 *
 * deepseek_v3 / kimi_k2 -> llama.cpp's deepseek2 (src/models/deepseek2.cpp, and its
 * convert_hf_to_gguf.py for the names): latent attention as llama.cpp's absorbed MLA runs it,
 * kv_b_proj split per head into attn_k_b (the k_nope rows transposed, ne {nope, kv_lora, H}) and
 * attn_v_b (the v rows, ne {kv_lora, v, H}); head_count_kv 1, key/value_length the latent widths,
 * *_mla the per-head ones. attn_v_b keeps kv_b's codes (its rows are kv_b's rows); attn_k_b is
 * kv_b transposed, so quantization groups would run along the wrong axis: it is written in float
 * (the dequantized values, F32 by default: exact). llama.cpp's RoPE pairs adjacent values, as
 * rope_interleave does; without it the rotary rows of q and of kv_a's k_rot are permuted like
 * llama's q/k. YaRN: llama.cpp's graph assumes mscale == mscale_all_dim (true of DeepSeek-V3 and
 * Kimi K2); otherwise rope.scaling.attn_factor and yarn_log_multiplier are chosen so that its
 * cos/sin factor and softmax scale are transformers' (see yarn_kvs). MTP layers are left out, as
 * llama.cpp's converter does.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "export/gguf_export_internal.h"
#include "formats/kquant.h"
#include "export/layout.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "io/tokenizer.h"
#include "ckpt/source.h"   /* mq_st_open_dir: an FP8 checkpoint's scales linked */

bool mq_gguf_rest_parse(const char *s, mq_gguf_rest *out) {
    static const char *const names[] = {"auto", "f32", "f16", "bf16", "q8_0"};
    for (int i = 0; i < 5; i++)
        if (!strcmp(s, names[i])) {
            *out = (mq_gguf_rest)i;
            return true;
        }
    return false;
}
/* ---- the tensor plan ---------------------------------------------------------------------------- */

typedef enum { SRC_PLAIN, SRC_LINEAR, SRC_EXPERTS, SRC_SCALE, SRC_KB } src_kind;

/* GGUF row r -> source row: out blocks of ob rows taken at sel within each ib source rows
 * (attn_v_b's rows of kv_b), and in each out block the plen rows from poff permuted for
 * llama.cpp's adjacent-pair RoPE (row poff + 2i + j = source row poff + j * plen / 2 + i).
 * ob == 0: the identity. */
typedef struct {
    int64_t ob, ib, sel, poff, plen;
} row_map;

static int64_t src_row(int64_t r, const row_map *m) {
    if (!m->ob) return r;
    int64_t b = r / m->ob, w = r % m->ob;
    if (m->plen && w >= m->poff && w < m->poff + m->plen) {
        int64_t k = w - m->poff;
        w = m->poff + (k % 2) * (m->plen / 2) + k / 2;
    }
    return b * m->ib + m->sel + w;
}

typedef struct {
    char gname[128];
    src_kind kind;
    char src[256];        /* PLAIN: tensor name; LINEAR, KB: module; EXPERTS/SCALE of experts: a
                             module with "%d" for the expert; SCALE of one Linear: the module */
    int64_t E;            /* EXPERTS, SCALE: experts (0: one Linear) */
    int64_t rows, cols;   /* LINEAR/EXPERTS/KB: of one source matrix */
    int64_t out_rows;     /* LINEAR/EXPERTS: GGUF rows of one matrix (rows unless map selects) */
    row_map map;          /* LINEAR, PLAIN: GGUF row -> source row */
    uint32_t n_dims, type;
    int64_t ne[3];
    bool f32;             /* PLAIN: always F32 (1-D, routers) */
} out_tensor;

typedef struct {
    const char *dir;
    mq_st *st;
    arch_cfg a;
    mq_gguf_rest rest;
    bool dequant;         /* quantized Linears written dequantized (as rest; auto: F32) */
    out_tensor *t;
    size_t n, cap;
    bool warned_f16;
    uint32_t ftype;       /* general.file_type */
    const mq_gguf_recipe *recipe;   /* K-quants: token_embd's and output's types; NULL: none */
} exporter;

static const mq_tensor_view *lookup(void *user, const char *name) { return mq_st_find(user, name); }

static moeq_status add(exporter *x, out_tensor *t) {
    moeq_status s = mq_grow(&x->t, x->n, &x->cap, sizeof *x->t, 64, "the GGUF's tensor list");
    if (s) return s;
    x->t[x->n++] = *t;
    return MOEQ_OK;
}

static uint32_t rest_type(const exporter *x, moeq_dtype src, int64_t cols) {
    switch (x->rest) {
    case MQ_GGUF_REST_F32: return MQ_GGML_F32;
    case MQ_GGUF_REST_F16: return MQ_GGML_F16;
    case MQ_GGUF_REST_BF16: return MQ_GGML_BF16;
    case MQ_GGUF_REST_Q8_0: return cols % 32 == 0 ? MQ_GGML_Q8_0 : MQ_GGML_F16;
    case MQ_GGUF_REST_AUTO: break;
    }
    return src == MOEQ_DT_F16 ? MQ_GGML_F16 : src == MOEQ_DT_BF16 ? MQ_GGML_BF16 : MQ_GGML_F32;
}

/* A float tensor kept as it is (or as --gguf-rest says); 1-D ones and routers in F32.
 * flat: written as one dimension (qwen2moe's shared-expert gate [1, D] -> {D}). */
static moeq_status add_plain(exporter *x, const char *gname, const char *src, bool required, bool f32, bool flat) {
    const mq_tensor_view *v = mq_st_find(x->st, src);
    if (!v) return required ? mq_err(MOEQ_E_NOTFOUND, "%s: no tensor '%s' (for GGUF '%s')", x->dir, src, gname) : MOEQ_OK;
    if (v->ndim < 1 || v->ndim > 2) return mq_err(MOEQ_E_SHAPE, "%s: tensor '%s' has %d dimensions", x->dir, src, v->ndim);
    out_tensor t;
    memset(&t, 0, sizeof t);
    snprintf(t.gname, sizeof t.gname, "%s", gname);
    snprintf(t.src, sizeof t.src, "%s", src);
    t.kind = SRC_PLAIN;
    t.f32 = f32 || v->ndim == 1 || flat;
    if (v->ndim == 1 || flat) {
        t.n_dims = 1;
        t.ne[0] = v->numel;
    } else {
        t.n_dims = 2;
        t.ne[0] = v->shape[1];
        t.ne[1] = v->shape[0];
    }
    t.rows = v->ndim == 1 || flat ? 1 : v->shape[0];
    t.cols = t.ne[0];
    t.type = t.f32 ? MQ_GGML_F32 : rest_type(x, v->dtype, t.cols);
    return add(x, &t);
}

/* The GGUF type a Linear's storage becomes, and whether it has a global scale. */
static moeq_status linear_type(exporter *x, const char *module, int64_t rows, int64_t cols, uint32_t *type,
                               bool *nvfp4) {
    *nvfp4 = false;
    mq_linear_kind k = mq_layout_detect(module, lookup, x->st);
    if (k == MQ_LIN_ABSENT) return mq_err(MOEQ_E_NOTFOUND, "%s: no tensors of Linear '%s'", x->dir, module);
    /* FP8 block-quantized: no ggml type holds E4M3 times a block scale; F32 holds it exactly */
    if (k == MQ_LIN_FP8_BLOCK || (k != MQ_LIN_DENSE && x->dequant)) {
        *type = rest_type(x, MOEQ_DT_F32, cols);
        return MOEQ_OK;
    }
    if (k == MQ_LIN_DENSE) {
        char name[300];
        snprintf(name, sizeof name, "%s.weight", module);
        const mq_tensor_view *v = mq_st_find(x->st, name);
        *type = rest_type(x, v ? v->dtype : MOEQ_DT_F32, cols);
        return MOEQ_OK;
    }
    mq_linear_qinfo qi;
    moeq_status s = mq_linear_qinfo_get(x->st, module, &qi);
    if (s) return s;
    if (qi.rows != rows || qi.cols != cols)
        return mq_err(MOEQ_E_SHAPE, "%s: Linear '%s' is [%lld, %lld], the config implies [%lld, %lld]", x->dir, module,
                      (long long)qi.rows, (long long)qi.cols, (long long)rows, (long long)cols);
    if (qi.has_input_scale)
        return mq_err(MOEQ_E_UNSUPPORTED, "%s: Linear '%s' has W4A4 activation scales: llama.cpp quantizes "
                      "activations its own way", x->dir, module);
    if (qi.scheme == MQ_QS_KQUANT) {   /* GGUF rows already */
        *type = mq_kq_info_of(qi.kq)->ggml_type;
        return MOEQ_OK;
    }
    if (qi.scheme == MQ_QS_NVFP4) {
        if (cols % 64)
            return mq_err(MOEQ_E_SHAPE, "%s: Linear '%s': %lld input features are not whole 64-value NVFP4 blocks",
                          x->dir, module, (long long)cols);
        *type = MQ_GGML_NVFP4;
        *nvfp4 = true;
        return MOEQ_OK;
    }
    if (qi.scheme != MQ_QS_INT4) return mq_err(MOEQ_E_UNSUPPORTED, "%s: Linear '%s': no GGUF type for its scheme", x->dir, module);
    int64_t g = qi.group_size > 0 ? qi.group_size : cols;
    if (cols % 32 || g % 32)
        return mq_err(MOEQ_E_SHAPE, "%s: Linear '%s': INT4 groups of %lld over %lld columns do not split into the "
                      "32-value blocks of Q4_0/Q4_1", x->dir, module, (long long)g, (long long)cols);
    *type = qi.asym ? MQ_GGML_Q4_1 : MQ_GGML_Q4_0;
    return MOEQ_OK;
}

/* A Linear [rows, cols] as GGUF gname.weight: 2-D, or with ne3 (non-NULL) the 3-D shape
 * {cols, ne3[0], ne3[1]} of the rows map selects (attn_v_b). */
static moeq_status add_linear_map(exporter *x, const char *gname, const char *module, int64_t rows, int64_t cols,
                                  const row_map *map, const int64_t *ne3, bool required) {
    out_tensor t;
    memset(&t, 0, sizeof t);
    if (mq_layout_detect(module, lookup, x->st) == MQ_LIN_ABSENT) {
        if (!required) return MOEQ_OK;
        return mq_err(MOEQ_E_NOTFOUND, "%s: no tensors of Linear '%s' (for GGUF '%s')", x->dir, module, gname);
    }
    bool nv;
    moeq_status s = linear_type(x, module, rows, cols, &t.type, &nv);
    if (s) return s;
    snprintf(t.gname, sizeof t.gname, "%s.weight", gname);
    snprintf(t.src, sizeof t.src, "%s", module);
    t.kind = SRC_LINEAR;
    t.rows = rows;
    t.cols = cols;
    t.out_rows = ne3 ? ne3[0] * ne3[1] : rows;
    if (map) t.map = *map;
    t.n_dims = ne3 ? 3 : 2;
    t.ne[0] = cols;
    t.ne[1] = ne3 ? ne3[0] : rows;
    t.ne[2] = ne3 ? ne3[1] : 0;
    if ((s = add(x, &t))) return s;
    if (!nv) return MOEQ_OK;
    out_tensor sc = t;
    snprintf(sc.gname, sizeof sc.gname, "%s.scale", gname);
    sc.kind = SRC_SCALE;
    sc.type = MQ_GGML_F32;
    sc.n_dims = 1;
    sc.ne[0] = 1;
    return add(x, &sc);
}

/* heads > 0: llama's q/k, rows permuted within each of `heads` heads */
static moeq_status add_linear(exporter *x, const char *gname, const char *module, int64_t rows, int64_t cols,
                              int64_t heads, bool required) {
    row_map m = {0, 0, 0, 0, 0};
    if (heads > 0) m = (row_map){rows / heads, rows / heads, 0, 0, rows / heads};
    return add_linear_map(x, gname, module, rows, cols, &m, NULL, required);
}

/* Stacked experts: pattern has "%d" for the expert. Every expert must have the same type. */
static moeq_status add_experts(exporter *x, const char *gname, const char *pattern, int64_t rows, int64_t cols) {
    out_tensor t;
    memset(&t, 0, sizeof t);
    bool nv = false;
    for (int64_t e = 0; e < x->a.E; e++) {
        char m[256];
        snprintf(m, sizeof m, pattern, (int)e);
        uint32_t ty;
        bool nve;
        moeq_status s = linear_type(x, m, rows, cols, &ty, &nve);
        if (s) return s;
        if (e > 0 && ty != t.type)
            return mq_err(MOEQ_E_UNSUPPORTED, "%s: experts of '%s' are stored in different ways (expert %lld): one "
                          "stacked GGUF tensor holds one type", x->dir, gname, (long long)e);
        t.type = ty;
        nv = nve;
    }
    snprintf(t.gname, sizeof t.gname, "%s.weight", gname);
    snprintf(t.src, sizeof t.src, "%s", pattern);
    t.kind = SRC_EXPERTS;
    t.E = x->a.E;
    t.rows = rows;
    t.cols = cols;
    t.out_rows = rows;
    t.n_dims = 3;
    t.ne[0] = cols;
    t.ne[1] = rows;
    t.ne[2] = x->a.E;
    moeq_status s = add(x, &t);
    if (s || !nv) return s;
    out_tensor sc = t;
    snprintf(sc.gname, sizeof sc.gname, "%s.scale", gname);
    sc.kind = SRC_SCALE;
    sc.type = MQ_GGML_F32;
    sc.n_dims = 1;
    sc.ne[0] = x->a.E;
    return add(x, &sc);
}

/* attn_k_b of kv_b_proj [H * (nope + v), kv_lora]: per head the nope rows transposed, ne
 * {nope, kv_lora, H}; float (rest type; a quantized kv_b dequantized, F32 under auto). */
static moeq_status add_k_b(exporter *x, const char *gname, const char *module) {
    const arch_cfg *a = &x->a;
    int64_t rows = a->H * (a->nope + a->vhd);
    uint32_t type;
    bool nv;
    moeq_status s = linear_type(x, module, rows, a->kv_lora, &type, &nv);
    if (s) return s;
    out_tensor t;
    memset(&t, 0, sizeof t);
    snprintf(t.gname, sizeof t.gname, "%s.weight", gname);
    snprintf(t.src, sizeof t.src, "%s", module);
    t.kind = SRC_KB;
    t.rows = rows;
    t.cols = a->kv_lora;
    t.n_dims = 3;
    t.ne[0] = a->nope;
    t.ne[1] = a->kv_lora;
    t.ne[2] = a->H;
    mq_linear_kind k = mq_layout_detect(module, lookup, x->st);
    if (k == MQ_LIN_DENSE) {
        char name[300];
        snprintf(name, sizeof name, "%s.weight", module);
        const mq_tensor_view *v = mq_st_find(x->st, name);
        t.type = rest_type(x, v && !v->scale_inv ? v->dtype : MOEQ_DT_F32, a->nope);
    } else {
        t.type = rest_type(x, MOEQ_DT_F32, a->nope);
    }
    return add(x, &t);
}

/* llama.cpp's deepseek2 tensors (models/deepseek2.cpp load_arch_tensors). */
static moeq_status plan_deepseek(exporter *x) {
    const arch_cfg *a = &x->a;
    moeq_status s = add_plain(x, "token_embd.weight", "model.embed_tokens.weight", true, false, false);
    char g[96], m[256];
    int64_t hq = a->nope + a->rope, qrows = a->H * hq;
    /* the rotary rows of each q head and kv_a's k_rot: pairs adjacent, as llama.cpp rotates */
    row_map qmap = {0, 0, 0, 0, 0}, kvmap = {0, 0, 0, 0, 0};
    if (!a->interleave) {
        qmap = (row_map){hq, hq, 0, a->nope, a->rope};
        kvmap = (row_map){a->kv_lora + a->rope, a->kv_lora + a->rope, 0, a->kv_lora, a->rope};
    }
    row_map vmap = {a->vhd, a->nope + a->vhd, a->nope, 0, 0};
    int64_t vne[2] = {a->vhd, a->H};
    char sfx[64];
#define L_(suffix) (snprintf(g, sizeof g, "blk.%lld.%s", (long long)l, suffix), g)
#define M_(suffix) (snprintf(m, sizeof m, "model.layers.%lld.%s", (long long)l, suffix), m)
#define SFX(fmt, v) (snprintf(sfx, sizeof sfx, fmt, v), sfx)
    for (int64_t l = 0; !s && l < a->L; l++) {
        s = add_plain(x, L_("attn_norm.weight"), M_("input_layernorm.weight"), true, true, false);
        if (!s && a->q_lora > 0) {
            s = add_linear(x, L_("attn_q_a"), M_("self_attn.q_a_proj"), a->q_lora, a->D, 0, true);
            if (!s) s = add_plain(x, L_("attn_q_a_norm.weight"), M_("self_attn.q_a_layernorm.weight"), true, true, false);
            if (!s) s = add_linear_map(x, L_("attn_q_b"), M_("self_attn.q_b_proj"), qrows, a->q_lora, &qmap, NULL, true);
        } else if (!s) {
            s = add_linear_map(x, L_("attn_q"), M_("self_attn.q_proj"), qrows, a->D, &qmap, NULL, true);
        }
        if (!s) s = add_linear_map(x, L_("attn_kv_a_mqa"), M_("self_attn.kv_a_proj_with_mqa"), a->kv_lora + a->rope,
                                   a->D, &kvmap, NULL, true);
        if (!s) s = add_plain(x, L_("attn_kv_a_norm.weight"), M_("self_attn.kv_a_layernorm.weight"), true, true, false);
        if (!s) s = add_k_b(x, L_("attn_k_b"), M_("self_attn.kv_b_proj"));
        if (!s) s = add_linear_map(x, L_("attn_v_b"), m, a->H * (a->nope + a->vhd), a->kv_lora, &vmap, vne, true);
        if (!s) s = add_linear(x, L_("attn_output"), M_("self_attn.o_proj"), a->D, a->H * a->vhd, 0, true);
        if (!s) s = add_plain(x, L_("ffn_norm.weight"), M_("post_attention_layernorm.weight"), true, true, false);
        if (s) break;
        const char *hub[3] = {"gate_proj", "up_proj", "down_proj"};
        if (l < a->first_dense) {
            const char *dst[3] = {"ffn_gate", "ffn_up", "ffn_down"};
            for (int i = 0; !s && i < 3; i++)
                s = add_linear(x, L_(dst[i]), M_(SFX("mlp.%s", hub[i])), i == 2 ? a->D : a->FF, i == 2 ? a->FF : a->D,
                               0, true);
            continue;
        }
        s = add_plain(x, L_("ffn_gate_inp.weight"), M_("mlp.gate.weight"), true, true, false);
        if (!s) s = add_plain(x, L_("exp_probs_b.bias"), M_("mlp.gate.e_score_correction_bias"), true, true, false);
        const char *ex[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
        for (int i = 0; !s && i < 3; i++)
            s = add_experts(x, L_(ex[i]), M_(SFX("mlp.experts.%%d.%s", hub[i])), i == 2 ? a->D : a->FF_EXP,
                            i == 2 ? a->FF_EXP : a->D);
        const char *sh[3] = {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
        int64_t sf = a->FF_EXP * a->n_shared;
        for (int i = 0; !s && sf > 0 && i < 3; i++)
            s = add_linear(x, L_(sh[i]), M_(SFX("mlp.shared_experts.%s", hub[i])), i == 2 ? a->D : sf,
                           i == 2 ? sf : a->D, 0, true);
    }
#undef L_
#undef M_
#undef SFX
    if (!s) s = add_plain(x, "output_norm.weight", "model.norm.weight", true, true, false);
    if (s) return s;
    char mtp0[96];
    snprintf(mtp0, sizeof mtp0, "model.layers.%lld.input_layernorm.weight", (long long)a->L);
    /* llama.cpp's converter skips them too (skip_mtp); said when the checkpoint has them */
    if (a->mtp > 0 && mq_st_find(x->st, mtp0))
        mq_warn("%s: the %lld multi-token-prediction layer%s (model.layers.%lld%s, num_nextn_predict_layers) "
                "%s not written: llama.cpp's deepseek2 converter leaves them out", x->dir, (long long)a->mtp,
                a->mtp > 1 ? "s" : "", (long long)a->L, a->mtp > 1 ? "..." : "", a->mtp > 1 ? "are" : "is");
    if (mq_layout_detect("lm_head", lookup, x->st) != MQ_LIN_ABSENT)
        return add_linear(x, "output", "lm_head", a->vocab, a->D, 0, true);
    return MOEQ_OK;   /* tied: llama.cpp's deepseek2 falls back to token_embd */
}

static moeq_status plan(exporter *x) {
    const arch_cfg *a = &x->a;
    if (a->mla) return plan_deepseek(x);
    moeq_status s = add_plain(x, "token_embd.weight", "model.embed_tokens.weight", true, false, false);
    char g[96], m[256], m2[300];
    int64_t q_rows = a->H * a->HD, kv_rows = a->KV * a->HD;
    for (int64_t l = 0; !s && l < a->L; l++) {
        const char *attn_src[4] = {"q_proj", "k_proj", "v_proj", "o_proj"};
        const char *attn_dst[4] = {"attn_q", "attn_k", "attn_v", "attn_output"};
        int64_t ar[4] = {q_rows, kv_rows, kv_rows, a->D}, ac[4] = {a->D, a->D, a->D, q_rows};
        int64_t heads[4] = {a->permute_qk ? a->H : 0, a->permute_qk ? a->KV : 0, 0, 0};
        snprintf(g, sizeof g, "blk.%lld.attn_norm.weight", (long long)l);
        snprintf(m, sizeof m, "model.layers.%lld.input_layernorm.weight", (long long)l);
        s = add_plain(x, g, m, true, true, false);
        for (int i = 0; !s && i < 4; i++) {
            snprintf(g, sizeof g, "blk.%lld.%s", (long long)l, attn_dst[i]);
            snprintf(m, sizeof m, "model.layers.%lld.self_attn.%s", (long long)l, attn_src[i]);
            s = add_linear(x, g, m, ar[i], ac[i], heads[i], true);
            if (!s && i < 3) {
                snprintf(m2, sizeof m2, "%s.bias", m);
                const mq_tensor_view *b = mq_st_find(x->st, m2);
                if (b && heads[i]) s = mq_err(MOEQ_E_UNSUPPORTED, "%s: '%s': q/k biases of llama are not written", x->dir, m2);
                snprintf(g, sizeof g, "blk.%lld.%s.bias", (long long)l, attn_dst[i]);
                if (!s) s = add_plain(x, g, m2, false, true, false);
            }
        }
        if (!s && (!strcmp(a->arch, "olmoe") || !strcmp(a->arch, "qwen3moe"))) {
            snprintf(g, sizeof g, "blk.%lld.attn_q_norm.weight", (long long)l);
            snprintf(m, sizeof m, "model.layers.%lld.self_attn.q_norm.weight", (long long)l);
            s = add_plain(x, g, m, true, true, false);
            snprintf(g, sizeof g, "blk.%lld.attn_k_norm.weight", (long long)l);
            snprintf(m, sizeof m, "model.layers.%lld.self_attn.k_norm.weight", (long long)l);
            if (!s) s = add_plain(x, g, m, true, true, false);
        }
        snprintf(g, sizeof g, "blk.%lld.ffn_norm.weight", (long long)l);
        snprintf(m, sizeof m, "model.layers.%lld.post_attention_layernorm.weight", (long long)l);
        if (!s) s = add_plain(x, g, m, true, true, false);
        if (s) break;
        if (a->E <= 0) {   /* dense llama */
            const char *src[3] = {"gate_proj", "up_proj", "down_proj"}, *dst[3] = {"ffn_gate", "ffn_up", "ffn_down"};
            for (int i = 0; !s && i < 3; i++) {
                snprintf(g, sizeof g, "blk.%lld.%s", (long long)l, dst[i]);
                snprintf(m, sizeof m, "model.layers.%lld.mlp.%s", (long long)l, src[i]);
                s = add_linear(x, g, m, i == 2 ? a->D : a->FF, i == 2 ? a->FF : a->D, 0, true);
            }
            continue;
        }
        int64_t ff = a->FF_EXP > 0 ? a->FF_EXP : a->FF;
        const char *blk = a->mixtral ? "block_sparse_moe" : "mlp";
        snprintf(g, sizeof g, "blk.%lld.ffn_gate_inp.weight", (long long)l);
        snprintf(m, sizeof m, "model.layers.%lld.%s.gate.weight", (long long)l, blk);
        s = add_plain(x, g, m, true, true, false);
        const char *src_hub[3] = {"gate_proj", "up_proj", "down_proj"}, *src_mx[3] = {"w1", "w3", "w2"};
        const char *dst[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
        for (int i = 0; !s && i < 3; i++) {
            snprintf(g, sizeof g, "blk.%lld.%s", (long long)l, dst[i]);
            snprintf(m, sizeof m, "model.layers.%lld.%s.experts.%%d.%s", (long long)l, blk,
                     a->mixtral ? src_mx[i] : src_hub[i]);
            s = add_experts(x, g, m, i == 2 ? a->D : ff, i == 2 ? ff : a->D);
        }
        if (!s && !strcmp(a->arch, "qwen2moe")) {
            int64_t sf = a->FF_SH > 0 ? a->FF_SH : a->FF;
            snprintf(g, sizeof g, "blk.%lld.ffn_gate_inp_shexp.weight", (long long)l);
            snprintf(m, sizeof m, "model.layers.%lld.mlp.shared_expert_gate.weight", (long long)l);
            s = add_plain(x, g, m, true, true, true);
            const char *sdst[3] = {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
            for (int i = 0; !s && i < 3; i++) {
                snprintf(g, sizeof g, "blk.%lld.%s", (long long)l, sdst[i]);
                snprintf(m, sizeof m, "model.layers.%lld.mlp.shared_expert.%s", (long long)l, src_hub[i]);
                s = add_linear(x, g, m, i == 2 ? a->D : sf, i == 2 ? sf : a->D, 0, true);
            }
        }
    }
    if (!s) s = add_plain(x, "output_norm.weight", "model.norm.weight", true, true, false);
    if (s) return s;
    if (mq_layout_detect("lm_head", lookup, x->st) != MQ_LIN_ABSENT)
        return add_linear(x, "output", "lm_head", a->vocab, a->D, 0, true);
    /* tied: llama.cpp's llama falls back to token_embd; the MoE graphs need output itself */
    if (!strcmp(a->arch, "llama")) return MOEQ_OK;
    return add_plain(x, "output.weight", "model.embed_tokens.weight", true, false, false);
}

/* ---- writing the tensors -------------------------------------------------------------------------- */

/* Rows of float data as one of llama.cpp's block types, rounded to nearest with moeq's block
 * search (the spec's MSE grid on the exact values, plain squared error), rows on the pool (an
 * embedding is the largest tensor; each row is its own). */
typedef struct {
    const mq_kq_info *t;
    mq_qspec spec;
    const float *x;
    int64_t n, cols;
    uint8_t *out;
    uint8_t *bad;   /* per task: a row whose scales do not fit fp16 */
} kq_rows;

enum { KQ_ROWS_TASK = 16 };

static void kq_rows_task(void *vctx, int64_t task, int thread) {
    (void)thread;
    const kq_rows *c = vctx;
    const mq_kq_info *t = c->t;
    const int64_t nb = c->cols / t->block, per = t->block / t->sub;
    mq_gparams *g = mq_alloc_array((size_t)(c->cols / t->sub), sizeof *g, "GGUF block scales");
    uint8_t *codes = mq_alloc((size_t)c->cols, "GGUF codes");
    c->bad[task] = !g || !codes;
    for (int64_t r = task * KQ_ROWS_TASK; r < c->n && r < (task + 1) * KQ_ROWS_TASK && !c->bad[task]; r++) {
        mq_kq_quantize_row(t, &c->spec, c->x + r * c->cols, c->cols, NULL, g, codes);
        for (int64_t b = 0; b < nb; b++)   /* only scales past fp16 fail */
            if (!mq_kq_pack_block(t, g + b * per, codes + b * t->block, c->out + (r * nb + b) * t->bytes))
                c->bad[task] = 2;
    }
    mq_free(g);
    mq_free(codes);
}

static moeq_status encode_kq_rows(mq_kq_type kt, const float *x, int64_t n, int64_t cols, uint8_t *out) {
    const int64_t tasks = (n + KQ_ROWS_TASK - 1) / KQ_ROWS_TASK;
    kq_rows c = {mq_kq_info_of(kt), mq_kq_spec(kt), x, n, cols, out, calloc((size_t)tasks + 1, 1)};
    if (!c.bad) return mq_err(MOEQ_E_NOMEM, "out of memory");
    c.spec.mse = true;
    mq_parallel_for(tasks, kq_rows_task, &c);
    int bad = 0;
    for (int64_t i = 0; i < tasks; i++) bad = c.bad[i] > bad ? c.bad[i] : bad;
    free(c.bad);
    if (bad == 1) return MOEQ_E_NOMEM;
    if (bad) return mq_err(MOEQ_E_NUMERIC, "values too large for %s's fp16 scales", c.t->name);
    return MOEQ_OK;
}

/* n values as 16-bit halves (to_half: fp16 or bf16), little-endian. */
static void put_halves(uint16_t (*to_half)(float), const float *x, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint16_t h = to_half(x[i]);
        out[2 * i] = (uint8_t)h;
        out[2 * i + 1] = (uint8_t)(h >> 8);
    }
}

/* Encodes rows [0, n) of float data (row-major, cols each) as type into out. */
static moeq_status encode_float_rows(uint32_t type, const float *x, int64_t n, int64_t cols, uint8_t *out) {
    int64_t total = n * cols;
    mq_kq_type kt;
    if (type != MQ_GGML_Q8_0 && mq_kq_of_ggml(type, &kt)) return encode_kq_rows(kt, x, n, cols, out);
    switch (type) {
    case MQ_GGML_F32: memcpy(out, x, (size_t)total * 4); break;
    case MQ_GGML_F16: put_halves(mq_f32_to_f16, x, total, out); break;
    case MQ_GGML_BF16: put_halves(mq_f32_to_bf16, x, total, out); break;
    case MQ_GGML_Q8_0:
        for (int64_t i = 0; i < total / 32; i++) mq_ggml_put_q8_0(out + 34 * i, x + 32 * i);
        break;
    }
    return MOEQ_OK;
}

static size_t row_bytes(uint32_t type, int64_t cols) {
    int64_t blk;
    size_t bb;
    mq_ggml_type_info(type, NULL, &blk, &bb);
    return (size_t)(cols / blk) * bb;
}

/* A float tensor (or a dense Linear: rows GGUF rows of a source of src_rows), rows through
 * t->map, a chunk of rows at a time. */
static moeq_status write_float(exporter *x, mq_gguf_writer *w, const out_tensor *t, const char *name, int64_t rows,
                               int64_t src_rows) {
    const mq_tensor_view *v = mq_st_find(x->st, name);
    if (!v) return mq_err(MOEQ_E_NOTFOUND, "%s: no tensor '%s'", x->dir, name);
    int64_t cols = t->ne[0];
    if (v->numel != src_rows * cols)
        return mq_err(MOEQ_E_SHAPE, "%s: tensor '%s' has %lld values, GGUF '%s' needs %lld", x->dir, name,
                      (long long)v->numel, t->gname, (long long)(src_rows * cols));
    size_t es = moeq_dtype_size(v->dtype), rb = row_bytes(t->type, cols);
    int64_t chunk = t->map.ob > 0 ? 1 : (int64_t)(((size_t)1 << 22) / ((size_t)cols * 4) + 1);
    if (chunk > rows) chunk = rows;
    /* an FP8 block-quantized weight dequantizes only whole (io/fp8.h) */
    float *full = v->scale_inv ? mq_alloc_array((size_t)(rows * cols), sizeof(float), "FP8 weight") : NULL;
    float *f = mq_alloc_array((size_t)(chunk * cols), sizeof(float), "GGUF rows");
    uint8_t *o = mq_alloc_array((size_t)chunk, rb, "GGUF rows");
    moeq_status s = f && o && (full || !v->scale_inv) ? MOEQ_OK : MOEQ_E_NOMEM;
    if (!s && full) s = mq_tensor_to_f32(v, full);
    for (int64_t r = 0; !s && r < rows; r += chunk) {
        int64_t n = rows - r < chunk ? rows - r : chunk;
        if (full) {
            s = encode_float_rows(t->type, full + src_row(r, &t->map) * cols, n, cols, o);
            if (!s) s = mq_gguf_writer_data(w, o, (size_t)n * rb);
            continue;
        }
        mq_tensor_view sub = *v;
        sub.ndim = 2;
        sub.shape[0] = n;
        sub.shape[1] = cols;
        sub.numel = n * cols;
        sub.data = v->data + (size_t)src_row(r, &t->map) * (size_t)cols * es;
        sub.nbytes = (size_t)(n * cols) * es;
        if ((s = mq_tensor_to_f32(&sub, f))) break;
        s = encode_float_rows(t->type, f, n, cols, o);
        if (!s) s = mq_gguf_writer_data(w, o, (size_t)n * rb);
    }
    mq_free(full);
    mq_free(f);
    mq_free(o);
    return s;
}

static moeq_status f16_exact(exporter *x, const char *module, float v, uint16_t *h) {
    *h = mq_f32_to_f16(v);
    if (mq_f16_to_f32(*h) != v && isfinite(v) && !x->warned_f16) {
        mq_warn("%s: '%s': INT4 scales are not f16 (quantize with --format gguf for exact Q4_0 blocks); "
                "rounded to f16", x->dir, module);
        x->warned_f16 = true;
    }
    if (!isfinite(mq_f16_to_f32(*h)))
        return mq_err(MOEQ_E_NUMERIC, "%s: '%s': scale %g overflows f16", x->dir, module, (double)v);
    return MOEQ_OK;
}

/* One quantized Linear re-blocked into type (its rows through t->map); rows of llama.cpp's block
 * types copied as they are. */
static moeq_status write_qlinear(exporter *x, mq_gguf_writer *w, const out_tensor *t, const char *module) {
    const mq_tensor_view *kv = mq_layout_ggml_find(module, lookup, x->st, NULL);
    if (kv) {
        const size_t rb = row_bytes(t->type, t->cols);
        if (kv->dtype != MOEQ_DT_U8 || kv->ndim != 2 || kv->shape[0] != t->rows || (size_t)kv->shape[1] != rb)
            return mq_err(MOEQ_E_FORMAT, "%s: tensor '%s': not %lld GGUF rows of %zu bytes", kv->file, kv->name,
                          (long long)t->rows, rb);
        moeq_status s = MOEQ_OK;
        for (int64_t r = 0; !s && r < t->out_rows; r++)
            s = mq_gguf_writer_data(w, kv->data + (size_t)src_row(r, &t->map) * rb, rb);
        return s;
    }
    mq_qtensor q;
    moeq_status s = mq_layout_read(module, t->rows, t->cols, lookup, x->st, &q);
    if (s) {
        mq_qtensor_free(&q);
        return s;
    }
    if (q.g_idx)
        for (int64_t c = 0; c < q.cols; c++)
            if (q.g_idx[c] != c / q.group_size) {
                mq_qtensor_free(&q);
                return mq_err(MOEQ_E_UNSUPPORTED, "%s: '%s': act-order g_idx groups are not contiguous: GGUF blocks "
                              "cannot hold them (quantize without --groups gidx)", x->dir, module);
            }
    size_t rb = row_bytes(t->type, t->cols);
    uint8_t *o = mq_alloc(rb, "GGUF row");
    if (!o) {
        mq_qtensor_free(&q);
        return MOEQ_E_NOMEM;
    }
    int64_t K = q.cols;
    for (int64_t r = 0; !s && r < t->out_rows; r++) {
        int64_t sr = src_row(r, &t->map);
        const uint8_t *codes = q.codes + sr * K;
        const mq_gparams *gp = q.params + sr * q.n_groups;
        if (t->type == MQ_GGML_NVFP4) {
            for (int64_t b = 0; b < K / 64; b++) {
                uint8_t sc[4];
                for (int k = 0; k < 4; k++) sc[k] = gp[(b * 64 + 16 * k) / q.group_size].scale_code;
                mq_ggml_put_nvfp4(o + 36 * b, codes + 64 * b, sc);
            }
        } else {
            for (int64_t b = 0; !s && b < K / 32; b++) {
                const mq_gparams *g = &gp[(b * 32) / q.group_size];
                uint16_t d, m;
                if ((s = f16_exact(x, module, g->scale, &d))) break;
                if (t->type == MQ_GGML_Q4_0) {
                    mq_ggml_put_q4_0(o + 18 * b, codes + 32 * b, d);
                } else {
                    m = mq_f32_to_f16(-g->zero * mq_f16_to_f32(d));
                    mq_ggml_put_q4_1(o + 20 * b, codes + 32 * b, d, m);
                }
            }
        }
        if (!s) s = mq_gguf_writer_data(w, o, rb);
    }
    mq_free(o);
    mq_qtensor_free(&q);
    return s;
}

/* A quantized Linear dequantized exactly as moeq's loader does (fp32), then stored as t->type. */
static moeq_status write_dequantized(exporter *x, mq_gguf_writer *w, const out_tensor *t, const char *module) {
    size_t rb = row_bytes(t->type, t->cols);
    float *f = mq_alloc_array((size_t)(t->rows * t->cols), sizeof(float), "dequantized Linear");
    uint8_t *o = mq_alloc(rb, "GGUF row");
    moeq_status s = f && o ? mq_load_linear_weight(x->st, module, t->rows, t->cols, f, NULL) : MOEQ_E_NOMEM;
    for (int64_t r = 0; !s && r < t->out_rows; r++) {
        s = encode_float_rows(t->type, f + src_row(r, &t->map) * t->cols, 1, t->cols, o);
        if (!s) s = mq_gguf_writer_data(w, o, rb);
    }
    mq_free(f);
    mq_free(o);
    return s;
}

static moeq_status write_linear(exporter *x, mq_gguf_writer *w, const out_tensor *t, const char *module) {
    mq_linear_kind k = mq_layout_detect(module, lookup, x->st);
    if (k == MQ_LIN_FP8_BLOCK || (k != MQ_LIN_DENSE && x->dequant)) return write_dequantized(x, w, t, module);
    if (k == MQ_LIN_DENSE) {
        char name[300];
        snprintf(name, sizeof name, "%s.weight", module);
        return write_float(x, w, t, name, t->out_rows, t->map.ob > 0 ? t->rows : t->out_rows);
    }
    return write_qlinear(x, w, t, module);
}

/* NAME.scale: the global multiplier of each NVFP4 Linear (llama.cpp: output *= scale). */
static moeq_status write_scale(exporter *x, mq_gguf_writer *w, const out_tensor *t) {
    int64_t n = t->E > 0 ? t->E : 1;
    moeq_status s = MOEQ_OK;
    for (int64_t e = 0; !s && e < n; e++) {
        char m[256];
        if (t->E > 0) snprintf(m, sizeof m, t->src, (int)e);
        else snprintf(m, sizeof m, "%s", t->src);
        mq_qtensor q;
        if ((s = mq_layout_read(m, t->rows, t->cols, lookup, x->st, &q))) {
            mq_qtensor_free(&q);
            break;
        }
        float g = q.spec.nvfp4_conv == MQ_NVFP4_CT ? 1.0f / q.global_scale : q.global_scale;
        mq_qtensor_free(&q);
        s = mq_gguf_writer_data(w, &g, 4);
    }
    return s;
}

/* attn_k_b: kv_b_proj in fp32 (dequantized as moeq's loader does), then per head h and latent
 * channel c the row kv_b[h * (nope + v) + i][c], i < nope. */
static moeq_status write_k_b(exporter *x, mq_gguf_writer *w, const out_tensor *t) {
    const arch_cfg *a = &x->a;
    int64_t nope = a->nope, r = a->kv_lora, hb = a->nope + a->vhd;
    size_t rb = row_bytes(t->type, nope);
    float *f = mq_alloc_array((size_t)(t->rows * t->cols), sizeof(float), "kv_b_proj");
    float *row = mq_alloc_array((size_t)nope, sizeof(float), "attn_k_b row");
    uint8_t *o = mq_alloc(rb, "GGUF row");
    moeq_status s = f && row && o ? mq_load_linear_weight(x->st, t->src, t->rows, t->cols, f, NULL) : MOEQ_E_NOMEM;
    for (int64_t h = 0; !s && h < a->H; h++)
        for (int64_t c = 0; !s && c < r; c++) {
            for (int64_t i = 0; i < nope; i++) row[i] = f[(h * hb + i) * r + c];
            s = encode_float_rows(t->type, row, 1, nope, o);
            if (!s) s = mq_gguf_writer_data(w, o, rb);
        }
    mq_free(f);
    mq_free(row);
    mq_free(o);
    return s;
}

static moeq_status write_tensor(exporter *x, mq_gguf_writer *w, const out_tensor *t) {
    switch (t->kind) {
    case SRC_PLAIN: {
        int64_t rows = t->n_dims == 1 ? 1 : t->ne[1];
        return write_float(x, w, t, t->src, rows, rows);
    }
    case SRC_KB: return write_k_b(x, w, t);
    case SRC_LINEAR: return write_linear(x, w, t, t->src);
    case SRC_SCALE: return write_scale(x, w, t);
    case SRC_EXPERTS:
        for (int64_t e = 0; e < t->E; e++) {
            char m[256];
            snprintf(m, sizeof m, t->src, (int)e);
            moeq_status s = write_linear(x, w, t, m);
            if (s) return s;
            if (moeq_interrupted()) return mq_err(MOEQ_E_INTERRUPTED, "interrupted");
        }
        return MOEQ_OK;
    }
    return MOEQ_OK;
}

/* ---- KVs ------------------------------------------------------------------------------------------ */

static void put_kvs(exporter *x, mq_gguf_writer *w, const vocab *v, const char *name) {
    const arch_cfg *a = &x->a;
    char k[128];
#define AK(suffix) (snprintf(k, sizeof k, "%s.%s", a->arch, suffix), k)
    mq_gguf_kv_str(w, "general.architecture", a->arch);
    mq_gguf_kv_str(w, "general.name", name);
    mq_gguf_kv_u32(w, "general.alignment", 32);
    mq_gguf_kv_u32(w, "general.file_type", x->ftype);
    mq_gguf_kv_u32(w, "general.quantization_version", 2);
    mq_gguf_kv_u32(w, AK("vocab_size"), (uint32_t)a->vocab);
    mq_gguf_kv_u32(w, AK("context_length"), (uint32_t)a->ctx);
    mq_gguf_kv_u32(w, AK("embedding_length"), (uint32_t)a->D);
    mq_gguf_kv_u32(w, AK("block_count"), (uint32_t)a->L);
    mq_gguf_kv_u32(w, AK("feed_forward_length"), (uint32_t)a->FF);
    mq_gguf_kv_u32(w, AK("attention.head_count"), (uint32_t)a->H);
    /* absorbed MLA: one shared latent "head" of kv_lora (+ rope for keys); *_mla per head */
    mq_gguf_kv_u32(w, AK("attention.head_count_kv"), (uint32_t)(a->mla ? 1 : a->KV));
    mq_gguf_kv_u32(w, AK("attention.key_length"), (uint32_t)(a->mla ? a->kv_lora + a->rope : a->HD));
    mq_gguf_kv_u32(w, AK("attention.value_length"), (uint32_t)(a->mla ? a->kv_lora : a->HD));
    if (a->mla) {
        mq_gguf_kv_u32(w, AK("attention.key_length_mla"), (uint32_t)(a->nope + a->rope));
        mq_gguf_kv_u32(w, AK("attention.value_length_mla"), (uint32_t)a->vhd);
    }
    mq_gguf_kv_u32(w, AK("rope.dimension_count"), (uint32_t)(a->mla ? a->rope : a->HD));
    if (a->mla) {
        /* 0 = a plain q_proj: this llama.cpp reads the key for every model but DeepSeek-V2-Lite's
         * layer counts and then takes attn_q when it is 0 */
        mq_gguf_kv_u32(w, AK("attention.q_lora_rank"), (uint32_t)a->q_lora);
        mq_gguf_kv_u32(w, AK("attention.kv_lora_rank"), (uint32_t)a->kv_lora);
    }
    mq_gguf_kv_f32(w, AK("rope.freq_base"), (float)a->theta);
    mq_gguf_kv_f32(w, AK("attention.layer_norm_rms_epsilon"), (float)a->eps);
    if (a->mla) {
        mq_gguf_kv_u32(w, AK("leading_dense_block_count"), (uint32_t)a->first_dense);
        mq_gguf_kv_u32(w, AK("expert_shared_count"), (uint32_t)a->n_shared);
        mq_gguf_kv_f32(w, AK("expert_weights_scale"), (float)a->routed_scale);
        mq_gguf_kv_bool(w, AK("expert_weights_norm"), a->norm_topk);
        mq_gguf_kv_u32(w, AK("expert_gating_func"), 2);   /* LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID */
        /* all groups eligible is no grouping; llama.cpp asserts group_used < group_count */
        if (a->n_group > 1 && a->topk_group < a->n_group) {
            mq_gguf_kv_u32(w, AK("expert_group_count"), (uint32_t)a->n_group);
            mq_gguf_kv_u32(w, AK("expert_group_used_count"), (uint32_t)a->topk_group);
        }
        if (a->yarn) {
            mq_gguf_kv_str(w, AK("rope.scaling.type"), "yarn");
            mq_gguf_kv_f32(w, AK("rope.scaling.factor"), (float)a->yarn_factor);
            mq_gguf_kv_u32(w, AK("rope.scaling.original_context_length"), (uint32_t)a->yarn_orig);
            if (a->yarn_lm != 0) mq_gguf_kv_f32(w, AK("rope.scaling.yarn_log_multiplier"), (float)(0.1 * a->yarn_lm));
            if (a->yarn_a != 1) mq_gguf_kv_f32(w, AK("rope.scaling.attn_factor"), (float)a->yarn_a);
        }
    }
    if (a->E > 0) {
        mq_gguf_kv_u32(w, AK("expert_count"), (uint32_t)a->E);
        mq_gguf_kv_u32(w, AK("expert_used_count"), (uint32_t)a->K);
    }
    if (a->FF_EXP > 0) mq_gguf_kv_u32(w, AK("expert_feed_forward_length"), (uint32_t)a->FF_EXP);
    if (a->FF_SH > 0) mq_gguf_kv_u32(w, AK("expert_shared_feed_forward_length"), (uint32_t)a->FF_SH);
#undef AK
    mq_gguf_kv_str(w, "tokenizer.ggml.model", "gpt2");
    mq_gguf_kv_str(w, "tokenizer.ggml.pre", v->pre);
    mq_gguf_kv_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)v->tok, v->len, (uint64_t)v->n);
    mq_gguf_kv_arr_i32(w, "tokenizer.ggml.token_type", v->type, (uint64_t)v->n);
    mq_gguf_kv_arr_str(w, "tokenizer.ggml.merges", (const char *const *)v->merges, v->mlen, (uint64_t)v->n_merges);
    if (v->bos >= 0) mq_gguf_kv_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)v->bos);
    if (v->eos >= 0) mq_gguf_kv_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)v->eos);
    if (v->pad >= 0) mq_gguf_kv_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)v->pad);
    mq_gguf_kv_bool(w, "tokenizer.ggml.add_bos_token", v->add_bos);
}

/* general.file_type from the quantized tensors' type (llama.cpp's LLAMA_FTYPE numbers). */
static uint32_t file_type(const exporter *x) {
    if (x->recipe) return mq_gguf_recipe_ftype(x->recipe);
    for (size_t i = 0; i < x->n; i++) {
        switch (x->t[i].type) {
        case MQ_GGML_Q4_0: return 2;
        case MQ_GGML_Q4_1: return 3;
        case MQ_GGML_NVFP4: return 39;
        }
    }
    for (size_t i = 0; i < x->n; i++)
        if (x->t[i].n_dims >= 2) {
            switch (x->t[i].type) {
            case MQ_GGML_F16: return 1;
            case MQ_GGML_BF16: return 32;
            case MQ_GGML_Q8_0: return 7;
            }
        }
    return 0;
}

/* token_embd and output as the recipe says (their rows rounded by encode_kq_rows), where it gives
 * them a block type and they are not quantized already */
static void recipe_types(exporter *x) {
    for (size_t i = 0; x->recipe && i < x->n; i++) {
        out_tensor *t = &x->t[i];
        const bool embd = !strcmp(t->gname, "token_embd.weight"), out = !strcmp(t->gname, "output.weight");
        if ((!embd && !out) || t->n_dims != 2) continue;
        if (t->kind == SRC_LINEAR && mq_layout_detect(t->src, lookup, x->st) != MQ_LIN_DENSE) continue;
        /* a tied model's token_embd doubles as the output (llama.cpp's rule) */
        const int k = mq_gguf_recipe_type(x->recipe, out ? MQ_GCAT_OUTPUT : MQ_GCAT_TOKEN_EMBD, -1, t->ne[0]);
        if (k >= 0) t->type = mq_kq_info_of((mq_kq_type)k)->ggml_type;
    }
}

static moeq_status export_file(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest, bool dequant,
                               const mq_gguf_recipe *recipe) {
    exporter x;
    memset(&x, 0, sizeof x);
    x.dir = ckpt_dir;
    x.rest = rest;
    x.dequant = dequant;
    x.recipe = recipe;
    cJSON *cfg = NULL;
    vocab v;
    memset(&v, 0, sizeof v);
    mq_gguf_writer *w = NULL;
    mq_atomic_file af;
    bool open = false;
    moeq_status s = mq_gguf_read_json(ckpt_dir, "config.json", true, &cfg);
    if (!s) s = mq_gguf_check_config(cfg, ckpt_dir, MQ_QS_NONE, false);
    if (!s) s = mq_gguf_read_arch(cfg, ckpt_dir, &x.a);
    if (!s) s = mq_gguf_read_vocab(ckpt_dir, cfg, x.a.vocab, &v);
    if (!s) s = mq_st_open_dir(ckpt_dir, &x.st);
    if (!s) s = plan(&x);
    /* NVFP4 where llama.cpp's graph drops the global scale */
    for (size_t i = 0; !s && i < x.n; i++)
        if (x.t[i].type == MQ_GGML_NVFP4) s = mq_gguf_check_config(cfg, ckpt_dir, MQ_QS_NVFP4, false);
    if (s) goto done;
    recipe_types(&x);
    x.ftype = file_type(&x);
    if (!(w = mq_gguf_writer_new())) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    const char *base = strrchr(out_path, '/');
    base = base ? base + 1 : out_path;
    size_t bl = strlen(base);
    char *name = mq_strndup(base, bl > 5 && !strcmp(base + bl - 5, ".gguf") ? bl - 5 : bl);
    if (!name) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    put_kvs(&x, w, &v, name);
    free(name);
    for (size_t i = 0; !s && i < x.n; i++) s = mq_gguf_writer_tensor(w, x.t[i].gname, x.t[i].n_dims, x.t[i].ne, x.t[i].type);
    if (s) goto done;
    if ((s = mq_atomic_open(&af, out_path))) goto done;
    open = true;
    s = mq_gguf_writer_begin(w, af.f, af.tmp_path);
    for (size_t i = 0; !s && i < x.n; i++) {
        s = write_tensor(&x, w, &x.t[i]);
        if (s) s = mq_err_prefix(s, "GGUF tensor '%s': ", x.t[i].gname);
        mq_progress("gguf", (int64_t)i + 1, (int64_t)x.n);
    }
    if (!s) s = mq_gguf_writer_end(w);
    if (!s) {
        open = false;
        s = mq_atomic_commit(&af);
    }
done:
    if (open) mq_atomic_abort(&af);
    mq_gguf_writer_free(w);
    mq_st_close(x.st);
    free(x.t);
    mq_gguf_vocab_free(&v);
    cJSON_Delete(cfg);
    return s;
}

moeq_status mq_gguf_export(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest) {
    return export_file(ckpt_dir, out_path, rest, false, NULL);
}

moeq_status mq_gguf_export_recipe(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest,
                                  const mq_gguf_recipe *recipe) {
    return export_file(ckpt_dir, out_path, rest, false, recipe);
}

moeq_status mq_gguf_export_dequantized(const char *ckpt_dir, const char *out_path, mq_gguf_rest rest) {
    return export_file(ckpt_dir, out_path, rest, true, NULL);
}

