/*
 * moeq_model_eos_ids (moeq.h, "Sampling"): the ids that end generation, so that a program
 * (`moeq generate`) needs no view of the model's internals. config.json's eos_token_id may be a
 * list (Llama-3 instruct models end on several ids); it is kept whole in mq_config, while
 * moeq_model_info has room for one.
 */
#include "model/model.h"

int32_t moeq_model_eos_ids(const moeq_model *m, int32_t *ids, int32_t cap) {
    if (!m) return 0;
    if (m->cfg.n_eos > 0) {
        for (int32_t i = 0; i < m->cfg.n_eos && i < cap && ids; i++) ids[i] = m->cfg.eos_ids[i];
        return m->cfg.n_eos;
    }
    /* No eos_token_id in config.json: the tokenizer's EOS, as moeq_model_info reports it. */
    if (m->info.eos_token_id < 0) return 0;
    if (ids && cap > 0) ids[0] = m->info.eos_token_id;
    return 1;
}
