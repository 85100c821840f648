/*
 * GGUF -> a Hugging Face checkpoint directory moeq's loader opens (config.json, tokenizer.json,
 * model.safetensors in F32, gguf_types.json), for tools that need a directory (the quantizer).
 * Everything it writes comes from io/gguf_hf.h, the same views and documents moeq_model_open
 * reads a .gguf through directly: each view converted to F32 (NVFP4 times its NAME.scale,
 * stacked experts split, llama's q/k rows permuted back, deepseek2's kv_b_proj merged), the
 * config routing as llama.cpp computes it, the tokenizer rebuilt from tokenizer.ggml.*, each
 * matrix's ggml type under its HF name ({"model.layers.0.mlp.experts.3.up_proj.weight": "q4_0",
 * ...; a tied lm_head.weight gets token_embd's}) for act_quant q8_0. The whole model is held in
 * fp32 while the file is written; reading a .gguf directly holds none of it.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "io/gguf_hf.h"
#include "io/gguf_import.h"
#include "io/safetensors.h"

moeq_status mq_gguf_import(const char *gguf_path, const char *out_dir) {
    mq_st *st = NULL;
    mq_gguf_docs d;
    moeq_status s = mq_st_open_gguf(gguf_path, true, &st, &d);
    if (s) return s;
    mq_st_writer *w = mq_stw_new();
    char *p = NULL;
    if (!w) s = mq_err(MOEQ_E_NOMEM, "out of memory");
    for (size_t i = 0; !s && i < mq_st_count(st); i++) {
        const mq_tensor_view *v = mq_st_at(st, i);
        float *f = mq_alloc_array((size_t)v->numel, sizeof(float), v->name);
        if (!f) {
            s = MOEQ_E_NOMEM;
            break;
        }
        if ((s = mq_tensor_to_f32(v, f))) {
            mq_free(f);
            break;
        }
        s = mq_stw_add_owned(w, v->name, MOEQ_DT_F32, v->ndim, v->shape, f, (size_t)v->numel * sizeof(float));
    }
    if (s) goto done;
    if (mkdir(out_dir, 0755) != 0 && !mq_dir_exists(out_dir)) {
        s = mq_err(MOEQ_E_IO, "%s: cannot create the directory", out_dir);
        goto done;
    }
    if (!(p = mq_path_join(out_dir, "model.safetensors"))) {
        s = mq_err(MOEQ_E_NOMEM, "out of memory");
        goto done;
    }
    if ((s = mq_stw_write(w, p))) goto done;
    const char *names[3] = {"config.json", "tokenizer.json", "gguf_types.json"};
    cJSON *docs[3] = {d.config, d.tokenizer, d.types};
    for (int i = 0; !s && i < 3; i++) {
        char *text = cJSON_Print(docs[i]);
        char *fp = mq_path_join(out_dir, names[i]);
        s = text && fp ? mq_write_file_atomic(fp, text, strlen(text)) : mq_err(MOEQ_E_NOMEM, "out of memory");
        free(text);
        free(fp);
    }
done:
    free(p);
    mq_stw_free(w);
    mq_gguf_docs_free(&d);
    mq_st_close(st);
    return s;
}
