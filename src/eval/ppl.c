/*
 * moeq_eval: lm-evaluation-harness's loglikelihood_rolling perplexity (the wikitext task) and KL
 * divergence against a base model or against saved top-k logits.
 *
 * Reference: lm_eval/models/huggingface.py loglikelihood_rolling with lm_eval/utils.py rolling
 * windows (context 1), lm_eval/tasks/wikitext (detokenizer, word/byte counts) and
 * lm_eval/api/metrics.py weighted_perplexity / bits_per_byte; docs formats.md section 3.
 *
 * Work split: documents are tokenized in parallel (one task each), then every rolling window of
 * every document is one pool task that runs the model on its own state and scratch. A window's
 * log-likelihood is summed in token order, a document's over its windows in order and the total
 * over documents in order, so results do not depend on the thread count. Only the scored rows
 * go through the final norm and the lm_head, in chunks of CHUNK rows.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/gpu.h"
#include "dist/dist.h"
#include "eval/eval_gpu.h"
#include "eval/eval_run.h"

/* Records the first failure of a pool task (the message lives in that thread's last error). */
void mq_eval_task_fail(mq_eval_ctx *c, moeq_status st) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&c->failed, &expected, 1)) {
        c->err = st;
        snprintf(c->errmsg, sizeof c->errmsg, "%s", moeq_last_error());
    }
}

/* ---- tokenization ------------------------------------------------------------------------- */
static void tokenize_task(void *vc, int64_t d, int thread) {
    (void)thread;
    mq_eval_ctx *c = vc;
    if (atomic_load(&c->failed)) return;
    size_t len = 0;
    const char *text = moeq_docs_text(c->docs, d, &len);
    char *detok = NULL;
    moeq_status st = MOEQ_OK;
    if (c->task == MOEQ_TASK_WIKITEXT) {
        st = moeq_wikitext_detokenize(text, len, &detok, &len);
        text = detok;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    if (!st) st = moeq_tokenizer_encode(moeq_model_tokenizer(c->m), text, len, &ids, &n);
    free(detok);
    if (st) {
        mq_eval_task_fail(c, mq_err_prefix(st, "document %lld", (long long)d + 1));
        return;
    }
    int64_t total = (int64_t)n + (c->add_bos ? 1 : 0);
    int32_t *t = malloc(sizeof(int32_t) * (size_t)(total > 0 ? total : 1));
    if (!t) {
        free(ids);
        mq_eval_task_fail(c, mq_err(MOEQ_E_NOMEM, "document %lld: out of memory for %lld tokens",
                            (long long)d + 1, (long long)total));
        return;
    }
    int64_t k = 0;
    if (c->add_bos) t[k++] = moeq_tokenizer_bos(moeq_model_tokenizer(c->m));
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= c->V) {
            free(ids);
            free(t);
            mq_eval_task_fail(c, mq_err(MOEQ_E_FORMAT,
                                "document %lld: token id %d outside the model's "
                                "vocabulary of %lld",
                                (long long)d + 1, ids[i], (long long)c->V));
            return;
        }
        t[k++] = ids[i];
    }
    free(ids);
    c->tok[d] = t;
    c->ntok[d] = total;
}

/* ---- scoring ------------------------------------------------------------------------------ */
/* The whole-model forward's part of a thread's scratch. */
static moeq_status scratch_init(mq_eval_ctx *c, mq_eval_scratch *s) {
    const mq_config *cfg = &c->m->cfg;
    int64_t L = c->L;
    moeq_status st = mq_state_new(c->m, c->L, &s->st);
    if (st) return st;
    s->x = mq_alloc_array((size_t)(L * cfg->D), sizeof(float), "eval hidden states");
    s->ids = mq_alloc_array((size_t)L, sizeof(int32_t), "eval window ids");
    if (!s->x || !s->ids) return MOEQ_E_NOMEM;
    if (c->base) {
        if ((st = mq_state_new(c->base, c->L, &s->st_base)) != MOEQ_OK) return st;
        s->xb =
            mq_alloc_array((size_t)(L * c->base->cfg.D), sizeof(float), "eval base hidden states");
        if (!s->xb) return MOEQ_E_NOMEM;
    }
    s->ready = true;
    return mq_eval_scoring_init(c, s);
}

moeq_status mq_eval_scoring_init(mq_eval_ctx *c, mq_eval_scratch *s) {
    if (s->scoring_ready) return MOEQ_OK;
    int64_t L = c->L, V = c->V;
    if (!(s->lg = mq_alloc_array((size_t)(CHUNK * V), sizeof(float), "eval logits")))
        return MOEQ_E_NOMEM;
    if (c->base && !(s->lgb = mq_alloc_array((size_t)(CHUNK * V), sizeof(float), "eval base logits")))
        return MOEQ_E_NOMEM;
    uint32_t k = c->save_k > c->kl_k ? c->save_k : c->kl_k;
    if (k) {
        s->tk_ids = mq_alloc_array(k, sizeof(uint32_t), "top-k ids");
        s->tk_vals = mq_alloc_array(k, sizeof(float), "top-k logits");
        if (!s->tk_ids || !s->tk_vals) return MOEQ_E_NOMEM;
    }
    if (c->kl_data && !(s->mark = mq_alloc_zero((size_t)V, "top-k marks"))) return MOEQ_E_NOMEM;
    if (c->tok_ent && !(s->zeros = mq_alloc_zero((size_t)V * sizeof(float), "entropy zeros")))
        return MOEQ_E_NOMEM;
    if (c->save_k && !(s->rec = mq_alloc_array((size_t)L, mq_logits_record_size(c->save_k),
                                               "saved logits records")))
        return MOEQ_E_NOMEM;
    s->scoring_ready = true;
    return MOEQ_OK;
}

static void scratch_free(mq_eval_scratch *s) {
    mq_state_free(s->st);
    mq_state_free(s->st_base);
    MQ_RELEASE_EACH(s->x, s->xb, s->lg, s->lgb, s->ids, s->mark, s->zeros, s->tk_ids, s->tk_vals, s->rec);
}

/* Runs a model on the window input and leaves the final-normed hidden states of the scored rows
 * at x + (n_input - n_score) * D. */
static moeq_status run_hidden(const moeq_model *m, mq_state *st, const int32_t *ids,
                              const mq_window *w, float *x) {
    int64_t n = w->n_input, r0 = n - w->n_score;
    mq_state_reset(st);
    moeq_status s = mq_embed(m, ids, n, x);
    if (!s) s = mq_forward_layers(m, st, x, n, 0, 0, m->cfg.n_layers, NULL);
    if (!s) mq_final_norm(m, x + r0 * m->cfg.D, w->n_score);
    return s;
}

/* The whole-model forward of window wi, then its scores. */
static moeq_status score_window(mq_eval_ctx *c, mq_eval_scratch *s, int64_t wi) {
    const mq_window *w = &c->win[wi];
    int64_t d = c->win_doc[wi];
    mq_window_input(w, c->tok[d], c->prefix, s->ids);
    int64_t r0 = w->n_input - w->n_score;
    moeq_status st = run_hidden(c->m, s->st, s->ids, w, s->x);
    if (!st && c->base) st = run_hidden(c->base, s->st_base, s->ids, w, s->xb);
    if (st) return mq_err_prefix(st, "document %lld", (long long)d + 1);
    return mq_eval_score_window(c, s, wi, s->x + r0 * c->m->cfg.D,
                                c->base ? s->xb + r0 * c->base->cfg.D : NULL);
}

moeq_status mq_eval_score_window(mq_eval_ctx *c, mq_eval_scratch *s, int64_t wi, const float *xm,
                                 const float *xb) {
    const mq_window *w = &c->win[wi];
    int64_t d = c->win_doc[wi], V = c->V, D = c->m->cfg.D;
    const int32_t *T = c->tok[d];
    size_t rec_size = c->save_k ? mq_logits_record_size(c->save_k) : 0;
    int64_t g0 = c->tok_off[d] + w->first_target; /* global index of the first scored token */
    double ll = 0;
    for (int64_t c0 = 0; c0 < w->n_score; c0 += CHUNK) {
        int64_t rows = w->n_score - c0 < CHUNK ? w->n_score - c0 : CHUNK;
        mq_lm_head(c->m, xm + c0 * D, rows, s->lg);
        if (c->temperature != 1.0f)
            for (int64_t i = 0; i < rows * V; i++) s->lg[i] /= c->temperature;
        if (c->base) mq_lm_head(c->base, xb + c0 * c->base->cfg.D, rows, s->lgb);
        for (int64_t r = 0; r < rows; r++) {
            int64_t t = w->first_target + c0 + r, g = g0 + c0 + r;
            const float *row = s->lg + r * V;
            int32_t am = 0;
            double lse = mq_logsumexp(row, V, &am);
            if (!isfinite(lse))
                return mq_err(MOEQ_E_NUMERIC, "document %lld, token %lld: non-finite logits",
                              (long long)d + 1, (long long)t);
            ll += (double)row[T[t]] - lse;
            if (c->tok_ent) c->tok_ent[g] = mq_entropy_row(row, lse, s->zeros, V);
            if (c->save_k) {
                mq_topk(row, V, (int32_t)c->save_k, s->tk_ids, s->tk_vals);
                mq_logits_record_encode(s->rec + (size_t)(c0 + r) * rec_size, lse, s->tk_ids,
                                        s->tk_vals, c->save_k);
            }
            if (c->base) {
                const float *rb = s->lgb + r * V;
                int32_t amb = 0;
                double lse_b = mq_logsumexp(rb, V, &amb);
                if (!isfinite(lse_b))
                    return mq_err(MOEQ_E_NUMERIC,
                                  "KL base: document %lld, token %lld: non-finite "
                                  "logits",
                                  (long long)d + 1, (long long)t);
                c->tok_kl[g] = mq_kl_rows(rb, lse_b, row, lse, V);
                c->tok_changed[g] = am != amb;
                c->tok_llb[g] = (double)rb[T[t]] - lse_b;
            } else if (c->kl_data) {
                double lse_b;
                const uint8_t *rec =
                    c->kl_data + MQ_LOGITS_HEADER + (size_t)g * mq_logits_record_size(c->kl_k);
                mq_logits_record_decode(rec, c->kl_k, &lse_b, s->tk_ids, s->tk_vals);
                for (uint32_t i = 0; i < c->kl_k; i++)
                    if (s->tk_ids[i] >= (uint32_t)V)
                        return mq_err(MOEQ_E_FORMAT,
                                      "saved logits: token %lld holds id %u outside "
                                      "the vocabulary",
                                      (long long)g, s->tk_ids[i]);
                c->tok_kl[g] = mq_kl_topk(s->tk_ids, s->tk_vals, (int32_t)c->kl_k, lse_b, row, lse,
                                          V, s->mark, &c->tok_bound[g]);
                c->tok_changed[g] = (uint32_t)am != s->tk_ids[0];
            }
        }
    }
    if (c->save_k) {
        size_t n = (size_t)w->n_score * rec_size, done = 0;
        off_t off = (off_t)(MQ_LOGITS_HEADER + (size_t)g0 * rec_size);
        while (done < n) {
            ssize_t k = pwrite(c->save_fd, s->rec + done, n - done, off + (off_t)done);
            if (k <= 0) return mq_err(MOEQ_E_IO, "%s: write failed", c->save_path);
            done += (size_t)k;
        }
    }
    c->win_ll[wi] = ll;
    return MOEQ_OK;
}

static void window_task(void *vc, int64_t i, int thread) {
    mq_eval_ctx *c = vc;
    const int64_t wi = c->w_lo + i;
    if (atomic_load(&c->failed) || moeq_interrupted()) return;
    mq_eval_scratch *s = &c->sc[thread];
    moeq_status st = s->ready ? MOEQ_OK : scratch_init(c, s);
    if (!st) st = score_window(c, s, wi);
    if (st) {
        mq_eval_task_fail(c, st);
        return;
    }
    c->win_done[wi] = 1;
    int64_t done = atomic_fetch_add(&c->tokens_done, c->win[wi].n_score) + c->win[wi].n_score;
    if (thread == 0) mq_progress("eval", done, c->tokens_total); /* the caller's thread only */
}

/* ---- setup and results -------------------------------------------------------------------- */
static bool same_tokenizer(const moeq_tokenizer *a, const moeq_tokenizer *b) {
    if (!a || !b) return true; /* nothing to compare; the vocabulary sizes were checked */
    int32_t n = moeq_tokenizer_vocab_size(a);
    if (n != moeq_tokenizer_vocab_size(b)) return false;
    for (int32_t i = 0; i < n; i++) {
        const char *x = moeq_tokenizer_token(a, i), *y = moeq_tokenizer_token(b, i);
        if ((x == NULL) != (y == NULL) || (x && strcmp(x, y) != 0)) return false;
    }
    return true;
}

static moeq_status check_inputs(const moeq_model *m, const moeq_eval_options *o, int32_t *L,
                                int32_t *prefix) {
    const moeq_model_info *info = moeq_model_get_info(m);
    const moeq_tokenizer *tok = moeq_model_tokenizer(m);
    if (!tok)
        return mq_err(MOEQ_E_ARG, "%s: eval needs the model's tokenizer (tokenizer.json or tiktoken.model)", m->dir);
    if (o->task != MOEQ_TASK_WIKITEXT && o->task != MOEQ_TASK_TEXT)
        return mq_err(MOEQ_E_ARG, "eval: unknown task %d", (int)o->task);
    if (o->max_length < 0)
        return mq_err(MOEQ_E_ARG, "--max-length %d: must be positive", o->max_length);
    *L = o->max_length ? o->max_length : info->max_position_embeddings;
    if (*L <= 0)
        return mq_err(MOEQ_E_ARG, "%s: no max_position_embeddings; give --max-length", m->dir);
    if (*L > info->max_position_embeddings)
        return mq_err(MOEQ_E_ARG,
                      "--max-length %d exceeds the model's max_position_embeddings %d (%s)", *L,
                      info->max_position_embeddings, m->dir);
    float temp = (float)o->temperature; /* applied in float: it must be one */
    if (o->temperature != 0 && !(isfinite(temp) && temp > 0))
        return mq_err(MOEQ_E_ARG, "--temperature %g: must be a positive finite number",
                      o->temperature);
    if (o->kl_base && o->kl_logits)
        return mq_err(MOEQ_E_ARG, "--kl-base and --kl-logits: give only one");
    if (o->save_top_k < 0 || o->save_top_k > info->vocab_size)
        return mq_err(MOEQ_E_ARG, "--top-k %d: must be between 1 and the vocabulary size %d",
                      o->save_top_k, info->vocab_size);
    int32_t bos = moeq_tokenizer_bos(tok), eos = moeq_tokenizer_eos(tok);
    if (bos < 0) bos = info->bos_token_id;
    if (eos < 0) eos = info->eos_token_id;
    if (o->add_bos && bos < 0) return mq_err(MOEQ_E_ARG, "--add-bos: %s has no BOS token", m->dir);
    *prefix = o->prefix_token >= 0 ? o->prefix_token : bos >= 0 ? bos : eos;
    if (*prefix < 0)
        return mq_err(MOEQ_E_ARG, "%s: the tokenizer has neither BOS nor EOS for the prefix token",
                      m->dir);
    if (*prefix >= info->vocab_size)
        return mq_err(MOEQ_E_ARG, "prefix token %d outside the vocabulary of %d", *prefix,
                      info->vocab_size);
    if (o->kl_base) {
        const moeq_model_info *bi = moeq_model_get_info(o->kl_base);
        if (bi->vocab_size != info->vocab_size)
            return mq_err(MOEQ_E_ARG, "--kl-base %s: vocabulary of %d tokens, the model has %d",
                          o->kl_base->dir, bi->vocab_size, info->vocab_size);
        if (!same_tokenizer(tok, moeq_model_tokenizer(o->kl_base)))
            return mq_err(MOEQ_E_ARG, "--kl-base %s: its tokenizer differs from %s's",
                          o->kl_base->dir, m->dir);
        if (*L > bi->max_position_embeddings)
            return mq_err(MOEQ_E_ARG,
                          "--max-length %d exceeds the KL base's max_position_embeddings %d", *L,
                          bi->max_position_embeddings);
    }
    return MOEQ_OK;
}

/* FNV-1a over each document's token count (u64) and ids (u32), little-endian. */
static uint64_t ids_checksum(const mq_eval_ctx *c) {
    uint64_t h = MQ_FNV_INIT;
    for (int64_t d = 0; d < c->n_docs; d++) {
        uint8_t b[8];
        for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)c->ntok[d] >> (8 * i));
        h = mq_fnv1a(h, b, 8);
        for (int64_t t = 0; t < c->ntok[d]; t++) {
            uint32_t v = (uint32_t)c->tok[d][t];
            for (int i = 0; i < 4; i++) b[i] = (uint8_t)(v >> (8 * i));
            h = mq_fnv1a(h, b, 4);
        }
    }
    return h;
}

static moeq_status check_saved_header(const mq_eval_ctx *c, const char *path,
                                      const mq_logits_header *h, uint64_t checksum) {
    if ((int64_t)h->vocab != c->V)
        return mq_err(MOEQ_E_ARG, "%s: saved with a vocabulary of %u tokens, the model has %lld",
                      path, h->vocab, (long long)c->V);
    if ((int32_t)h->max_length != c->L)
        return mq_err(MOEQ_E_ARG, "%s: saved with --max-length %u, this run uses %d", path,
                      h->max_length, c->L);
    if ((h->flags & 1u) != (c->add_bos ? 1u : 0u))
        return mq_err(MOEQ_E_ARG, "%s: saved %s --add-bos, this run %s it", path,
                      (h->flags & 1u) ? "with" : "without", c->add_bos ? "uses" : "does not use");
    if (h->prefix != c->prefix)
        return mq_err(MOEQ_E_ARG, "%s: saved with prefix token %d, this run uses %d", path,
                      h->prefix, c->prefix);
    if ((int64_t)h->documents != c->n_docs || (int64_t)h->tokens != c->tokens_total ||
        h->ids_checksum != checksum)
        return mq_err(
            MOEQ_E_ARG,
            "%s: saved for other token ids (%llu documents, %llu tokens; this run "
            "%lld documents, %lld tokens%s): another data file, --task, --limit or tokenizer?",
            path, (unsigned long long)h->documents, (unsigned long long)h->tokens,
            (long long)c->n_docs, (long long)c->tokens_total,
            (int64_t)h->tokens == c->tokens_total ? ", checksum differs" : "");
    return MOEQ_OK;
}

/* The kl_hist bin of one token's KL (moeq.h). */
static int kl_bin(double kl) {
    if (!(kl >= 1e-7)) return 0;   /* also NaN */
    int b = 1 + (int)floor(2.0 * (log10(kl) + 7.0));
    return b < 1 ? 1 : b > MOEQ_KL_HIST_BINS - 1 ? MOEQ_KL_HIST_BINS - 1 : b;
}

static void fill_result(const mq_eval_ctx *c, const moeq_eval_options *o, moeq_eval_result *r) {
    double ll = 0, kl_sum = 0, bound_sum = 0, ent_sum = 0, llb = 0;
    int64_t changed = 0, kl_n = 0;
    double *kl_vals = c->kl ? malloc(sizeof(double) * (size_t)(c->tokens_total + 1)) : NULL;
    for (int64_t d = 0; d < c->n_docs; d++) {
        bool complete = true;
        for (int64_t w = c->win_first[d]; w < c->win_first[d + 1]; w++)
            complete &= c->win_done[w] != 0;
        if (!complete) continue;
        double ll_d = 0;
        for (int64_t w = c->win_first[d]; w < c->win_first[d + 1]; w++) ll_d += c->win_ll[w];
        size_t len = 0;
        const char *text = moeq_docs_text(c->docs, d, &len);
        ll += ll_d;
        r->documents++;
        r->empty_documents += c->ntok[d] == 0;
        r->tokens += c->ntok[d];
        r->words += moeq_count_words(text, len);
        r->bytes += (int64_t)len;
        if (o->doc_loglikelihood) o->doc_loglikelihood[d] = ll_d;
        if (o->doc_tokens) o->doc_tokens[d] = c->ntok[d];
        if (c->tok_ent)
            for (int64_t g = c->tok_off[d]; g < c->tok_off[d + 1]; g++) ent_sum += c->tok_ent[g];
        if (c->kl) {
            double kd = 0, lb = 0;
            int64_t cd = 0;
            for (int64_t g = c->tok_off[d]; g < c->tok_off[d + 1]; g++) {
                kl_sum += c->tok_kl[g];
                kd += c->tok_kl[g];
                if (c->tok_bound) bound_sum += c->tok_bound[g];
                changed += c->tok_changed[g];
                cd += c->tok_changed[g];
                if (kl_vals) kl_vals[kl_n] = c->tok_kl[g];
                kl_n++;
                r->kl_hist[kl_bin(c->tok_kl[g])]++;
            }
            /* the base's log-likelihood summed as the model's: each window's tokens in order,
             * then the windows (a model against itself prints the same bits) */
            if (c->tok_llb)
                for (int64_t w = c->win_first[d]; w < c->win_first[d + 1]; w++) {
                    const int64_t g0 = c->tok_off[d] + c->win[w].first_target;
                    double lw = 0;
                    for (int64_t i = 0; i < c->win[w].n_score; i++) lw += c->tok_llb[g0 + i];
                    lb += lw;
                }
            const double nt = (double)(c->tok_off[d + 1] - c->tok_off[d]);
            if (o->doc_kl) o->doc_kl[d] = nt > 0 ? kd / nt : NAN;
            if (o->doc_top1_changed) o->doc_top1_changed[d] = nt > 0 ? (double)cd / nt : NAN;
            if (c->tok_llb) {
                llb += lb;
                if (o->doc_base_loglikelihood) o->doc_base_loglikelihood[d] = lb;
            }
        }
    }
    if (c->tok_llb) {
        r->has_base = 1;
        r->base_loglikelihood = llb;
        r->base_word_perplexity = exp(-llb / (double)r->words);
    }
    r->loglikelihood = ll;
    r->word_perplexity = exp(-ll / (double)r->words);
    r->byte_perplexity = exp(-ll / (double)r->bytes);
    r->bits_per_byte = -ll / (double)r->bytes / log(2.0);
    r->token_perplexity = exp(-ll / (double)r->tokens);
    if (c->tok_ent) {
        r->has_entropy = 1;
        r->entropy_mean = ent_sum / (double)r->tokens;
    }
    if (c->kl) {
        r->has_kl = 1;
        r->kl_tokens = kl_n;
        r->kl_mean = kl_sum / (double)kl_n;
        r->kl_p99 = kl_vals ? mq_percentile(kl_vals, kl_n, 99.0) : NAN;
        r->top1_changed = (double)changed / (double)kl_n;
        r->kl_top_k = (int32_t)c->kl_k;
        r->kl_gap_bound = c->tok_bound ? bound_sum / (double)kl_n : 0.0;
    }
    free(kl_vals);
}

static void ctx_free(mq_eval_ctx *c) {
    if (c->tok)
        for (int64_t d = 0; d < c->n_docs; d++) free(c->tok[d]);
    MQ_FREE_EACH(c->tok, c->ntok, c->tok_off, c->win_first, c->win, c->win_doc, c->win_ll, c->win_done, c->tok_kl,
                 c->tok_llb, c->tok_ent, c->tok_bound, c->tok_changed);
    if (c->sc)
        for (int i = 0; i < c->n_sc; i++) scratch_free(&c->sc[i]);
    free(c->sc);
}

/* ---- ranks (mpirun) --------------------------------------------------------------------- */
/* A rank past 0 keeps its windows' saved-logits records in an unlinked temporary file, at the
 * offsets rank 0's file has them (sparse), until they are sent. */
static moeq_status rank_records_open(mq_eval_ctx *c) {
    const char *tmp = getenv("TMPDIR");
    char *path = mq_asprintf("%s/moeq-eval-records-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!path) return mq_err(MOEQ_E_NOMEM, "out of memory");
    c->save_fd = mkstemp(path);
    moeq_status s = c->save_fd < 0 ? mq_err(MOEQ_E_IO, "%s: cannot create", path) : MOEQ_OK;
    if (c->save_fd >= 0) unlink(path);
    free(path);
    return s;
}

/* The scored tokens of windows [w0, w1): a contiguous range of global token indices. */
static void window_tokens(const mq_eval_ctx *c, int64_t w0, int64_t w1, int64_t *t0, int64_t *t1) {
    *t0 = *t1 = 0;
    if (w0 >= w1) return;
    const mq_window *a = &c->win[w0], *b = &c->win[w1 - 1];
    *t0 = c->tok_off[c->win_doc[w0]] + a->first_target;
    *t1 = c->tok_off[c->win_doc[w1 - 1]] + b->first_target + b->n_score;
}

/* Moves n bytes at buf between rank r and rank 0 (r sends, 0 receives), in pieces. */
static moeq_status move(void *buf, size_t n, int r, const char *step) {
    const size_t piece = (size_t)64 << 20;
    for (size_t off = 0; off < n; off += piece) {
        size_t k = n - off < piece ? n - off : piece;
        moeq_status s = mq_dist_rank() == 0 ? mq_dist_recv((char *)buf + off, k, r, step)
                                             : mq_dist_send((char *)buf + off, k, 0, step);
        if (s) return s;
    }
    return MOEQ_OK;
}

/* Every rank's window scores, per-token values and saved-logits records into rank 0's arrays (the
 * same places one process fills), after every rank agreed that none failed; *interrupted becomes
 * whether any rank was. */
static moeq_status gather_ranks(mq_eval_ctx *c, moeq_status mine, bool *interrupted) {
    moeq_status s = mq_dist_agree(mine, "eval: the windows' forward");
    int64_t any = *interrupted;
    if (!s) s = mq_dist_gather_i64(any, &any, NULL, "eval: interrupts");
    if (s) return s;
    *interrupted = any != 0;
    const int R = mq_dist_size(), me = mq_dist_rank();
    int64_t *cost = malloc(sizeof *cost * (size_t)(c->n_win + 1));
    const size_t rec = c->save_k ? mq_logits_record_size(c->save_k) : 0;
    uint8_t *buf = rec ? malloc((size_t)4 << 20) : NULL;
    if (!cost || (rec && !buf)) {
        free(cost);
        free(buf);
        return mq_err(MOEQ_E_NOMEM, "out of memory");
    }
    for (int64_t w = 0; w < c->n_win; w++) cost[w] = c->win[w].n_input;
    for (int r = 1; r < R && !s; r++) {
        if (me != 0 && me != r) continue;
        int64_t w0, w1, t0, t1;
        mq_dist_share_weighted(cost, c->n_win, r, R, &w0, &w1);
        window_tokens(c, w0, w1, &t0, &t1);
        const size_t nw = (size_t)(w1 - w0), nt = (size_t)(t1 - t0);
        s = move(c->win_ll + w0, nw * sizeof(double), r, "eval: window scores");
        if (!s) s = move(c->win_done + w0, nw, r, "eval: windows done");
        double *per_token[] = {c->tok_kl, c->tok_bound, c->tok_llb, c->tok_ent};
        for (int i = 0; i < 4 && !s; i++)
            if (per_token[i]) s = move(per_token[i] + t0, nt * sizeof(double), r, "eval: token values");
        if (!s && c->tok_changed) s = move(c->tok_changed + t0, nt, r, "eval: top-1 changes");
        /* the records, through a bounded buffer */
        const size_t per = rec ? ((size_t)4 << 20) / rec : 0;
        for (size_t k = 0; rec && k < nt && !s; k += per) {
            const size_t m = nt - k < per ? nt - k : per;
            const int64_t off = (int64_t)(MQ_LOGITS_HEADER + (size_t)(t0 + (int64_t)k) * rec);
            if (me != 0) s = mq_pread_all(c->save_fd, buf, m * rec, off, "saved logits records");
            if (!s) s = move(buf, m * rec, r, "eval: saved logits");
            if (!s && me == 0) s = mq_pwrite_all(c->save_fd, buf, m * rec, off, c->save_path);
        }
    }
    free(cost);
    free(buf);
    /* the last word: whether rank 0 took everything */
    moeq_status done = mq_dist_agree(s, "eval: gathering the scores");
    return s ? s : done;
}

moeq_status moeq_eval(const moeq_model *m, const moeq_docs *docs, const moeq_eval_options *opt,
                      moeq_eval_result *res) {
    double t0 = mq_now();
    memset(res, 0, sizeof *res);
    moeq_eval_options defaults;
    if (!opt) moeq_eval_options_init(&defaults), opt = &defaults;
    if (!m || !docs) return mq_err(MOEQ_E_ARG, "moeq_eval: no model or documents");
    mq_eval_ctx c;
    memset(&c, 0, sizeof c);
    c.save_fd = -1;
    moeq_status st = check_inputs(m, opt, &c.L, &c.prefix);
    if (st) return st;
    if (opt->device >= 0) {   /* what the GPU lacks, and the device, before any work */
        st = mq_eval_gpu_check(m, "the model");
        if (!st && opt->kl_base) st = mq_eval_gpu_check(opt->kl_base, "--kl-base");
        if (!st && (opt->gpu_precision < MOEQ_GPU_FP32 || opt->gpu_precision > MOEQ_GPU_BF16))
            st = mq_err(MOEQ_E_ARG, "eval: gpu_precision %d (fp32 0, tf32x3 1, tf32 2, bf16 3)", opt->gpu_precision);
        if (!st && !opt->dry_run) st = mq_gpu_probe(opt->device);
        if (st) return st;
    }
    c.m = m;
    c.base = opt->kl_base;
    c.docs = docs;
    c.task = opt->task;
    c.add_bos = opt->add_bos;
    c.V = moeq_model_get_info(m)->vocab_size;
    c.n_docs = moeq_docs_count(docs);
    if (opt->limit > 0 && opt->limit < c.n_docs) c.n_docs = opt->limit;
    res->max_length = c.L;
    res->prefix_token = c.prefix;
    int64_t nd = c.n_docs;
    if (opt->doc_loglikelihood)
        for (int64_t d = 0; d < moeq_docs_count(docs); d++) opt->doc_loglikelihood[d] = NAN;
    if (opt->doc_tokens)
        for (int64_t d = 0; d < moeq_docs_count(docs); d++) opt->doc_tokens[d] = -1;
    for (int64_t d = 0; d < moeq_docs_count(docs); d++) {
        if (opt->doc_kl) opt->doc_kl[d] = NAN;
        if (opt->doc_top1_changed) opt->doc_top1_changed[d] = NAN;
        if (opt->doc_base_loglikelihood) opt->doc_base_loglikelihood[d] = NAN;
    }

    c.tok = calloc((size_t)nd, sizeof *c.tok);
    c.ntok = calloc((size_t)nd, sizeof *c.ntok);
    c.tok_off = calloc((size_t)nd + 1, sizeof *c.tok_off);
    c.win_first = calloc((size_t)nd + 1, sizeof *c.win_first);
    if (!c.tok || !c.ntok || !c.tok_off || !c.win_first) {
        ctx_free(&c);
        return mq_err(MOEQ_E_NOMEM, "eval: out of memory for %lld documents", (long long)nd);
    }
    mq_parallel_for(nd, tokenize_task, &c);
    if (atomic_load(&c.failed)) {
        ctx_free(&c);
        return mq_err(c.err, "%s", c.errmsg);
    }

    /* Windows of every document, in document order. */
    for (int64_t d = 0; d < nd; d++) {
        c.tok_off[d + 1] = c.tok_off[d] + c.ntok[d];
        c.win_first[d + 1] = c.win_first[d] + mq_rolling_window_count(c.ntok[d], c.L);
        if (c.ntok[d] == 0) {
            size_t len = 0;
            moeq_docs_text(docs, d, &len);
            mq_warn("eval: document %lld (%zu bytes) tokenizes to nothing; it counts with 0 tokens",
                    (long long)d + 1, len);
        }
    }
    c.tokens_total = c.tok_off[nd];
    c.n_win = c.win_first[nd];
    c.win = calloc((size_t)c.n_win + 1, sizeof *c.win);
    c.win_doc = calloc((size_t)c.n_win + 1, sizeof *c.win_doc);
    c.win_ll = calloc((size_t)c.n_win + 1, sizeof *c.win_ll);
    c.win_done = calloc((size_t)c.n_win + 1, 1);
    c.temperature = opt->temperature > 0 ? (float)opt->temperature : 1.0f;
    if (opt->entropy) c.tok_ent = calloc((size_t)c.tokens_total + 1, sizeof *c.tok_ent);
    c.kl = opt->kl_base || opt->kl_logits;
    if (c.kl) {
        c.tok_kl = calloc((size_t)c.tokens_total + 1, sizeof *c.tok_kl);
        c.tok_changed = calloc((size_t)c.tokens_total + 1, 1);
        if (opt->kl_base) c.tok_llb = calloc((size_t)c.tokens_total + 1, sizeof *c.tok_llb);
        if (opt->kl_logits) c.tok_bound = calloc((size_t)c.tokens_total + 1, sizeof *c.tok_bound);
    }
    c.n_sc = mq_pool_size();
    c.sc = calloc((size_t)c.n_sc, sizeof *c.sc);
    if (!c.win || !c.win_doc || !c.win_ll || !c.win_done || !c.sc || (opt->entropy && !c.tok_ent) ||
        (c.kl && (!c.tok_kl || !c.tok_changed || (opt->kl_logits && !c.tok_bound) ||
                  (opt->kl_base && !c.tok_llb)))) {
        ctx_free(&c);
        return mq_err(MOEQ_E_NOMEM, "eval: out of memory for %lld windows", (long long)c.n_win);
    }
    for (int64_t d = 0; d < nd; d++) {
        mq_rolling_windows(c.ntok[d], c.L, c.win + c.win_first[d]);
        for (int64_t w = c.win_first[d]; w < c.win_first[d + 1]; w++) c.win_doc[w] = (int32_t)d;
    }

    /* Ranks: each runs a contiguous share of the windows, weighted by their rows */
    c.w_lo = 0;
    c.w_hi = c.n_win;
    if (mq_dist_size() > 1) {
        int64_t *cost = malloc(sizeof *cost * (size_t)(c.n_win + 1));
        if (!cost) {
            ctx_free(&c);
            return mq_err(MOEQ_E_NOMEM, "out of memory");
        }
        for (int64_t w = 0; w < c.n_win; w++) cost[w] = c.win[w].n_input;
        mq_dist_share_weighted(cost, c.n_win, mq_dist_rank(), mq_dist_size(), &c.w_lo, &c.w_hi);
        free(cost);
    }

    /* Saved logits: check the one to read, open the one to write. */
    /* a GPU runs every model layer by layer, as the streamed forward does */
    const bool streamed = mq_model_lazy(m) || (c.base && mq_model_lazy(c.base)) || opt->device >= 0;
    uint64_t checksum = (opt->kl_logits || opt->save_logits || streamed) ? ids_checksum(&c) : 0;
    c.ids_checksum = checksum;
    if (opt->dry_run) {
        st = mq_eval_stream_plan_only(&c, opt, res);
        ctx_free(&c);
        return st;
    }
    mq_map kl_map = {0};
    mq_atomic_file af = {0};
    mq_logits_header hdr = {0};
    if (opt->kl_logits) {
        st = mq_map_file(opt->kl_logits, &kl_map);
        if (!st) st = mq_logits_header_decode(opt->kl_logits, kl_map.data, kl_map.size, &hdr);
        if (!st) st = check_saved_header(&c, opt->kl_logits, &hdr, checksum);
        c.kl_data = kl_map.data;
        c.kl_k = hdr.k;
    }
    if (!st && opt->save_logits) {
        c.save_k = (uint32_t)(opt->save_top_k ? opt->save_top_k : MOEQ_EVAL_DEFAULT_TOP_K);
        if ((int64_t)c.save_k > c.V) c.save_k = (uint32_t)c.V;
        c.save_path = opt->save_logits;
        if (mq_dist_rank() == 0) {
            st = mq_atomic_open(&af, opt->save_logits);
            if (!st) c.save_fd = fileno(af.f);
        } else {
            st = rank_records_open(&c);   /* sent to rank 0 at the end */
        }
    }
    if (st) {
        mq_unmap(&kl_map);
        ctx_free(&c);
        return st;
    }

    atomic_store(&c.tokens_done, 0);
    if (streamed) {
        st = mq_eval_stream(&c, opt, res);
        if (st && st != MOEQ_E_INTERRUPTED && !atomic_load(&c.failed)) mq_eval_task_fail(&c, st);
        st = MOEQ_OK;
    } else {
        res->plan.threads = mq_pool_size();
        res->plan.resident_bytes = moeq_model_get_info(m)->weight_bytes +
                                   (c.base ? moeq_model_get_info(c.base)->weight_bytes : 0);
        res->plan.windows = c.w_hi - c.w_lo;
        mq_mem_watch_start();
        mq_progress("eval", 0, c.tokens_total);
        mq_parallel_for(c.w_hi - c.w_lo, window_task, &c);
        mq_progress("eval", atomic_load(&c.tokens_done), c.tokens_total);
        res->plan.peak_anon_bytes = mq_mem_watch_peak();
        mq_mem_watch_stop();
    }

    bool interrupted = !atomic_load(&c.failed) && moeq_interrupted();
    if (mq_dist_size() > 1) {
        st = gather_ranks(&c, atomic_load(&c.failed) ? mq_err(c.err, "%s", c.errmsg) : MOEQ_OK,
                          &interrupted);
        if (st) {
            atomic_store(&c.failed, 1);
            c.err = st;
            snprintf(c.errmsg, sizeof c.errmsg, "%s", moeq_last_error());
        }
    }
    if (atomic_load(&c.failed)) {
        st = mq_err(c.err, "%s", c.errmsg);
    } else if (mq_dist_rank() > 0) {
        res->interrupted = interrupted;   /* rank 0 holds the result */
    } else {
        fill_result(&c, opt, res);
        res->interrupted = interrupted;
        res->seconds = mq_now() - t0;
        res->tokens_per_second = res->seconds > 0 ? (double)res->tokens / res->seconds : 0;
    }
    if (c.save_fd >= 0 && mq_dist_rank() > 0) {
        close(c.save_fd);
    } else if (opt->save_logits && c.save_fd >= 0) {
        if (st || interrupted) {
            mq_atomic_abort(&af);
        } else {
            uint8_t h[MQ_LOGITS_HEADER];
            mq_logits_header hw = {.vocab = (uint32_t)c.V,
                                   .k = c.save_k,
                                   .max_length = (uint32_t)c.L,
                                   .flags = c.add_bos ? 1u : 0u,
                                   .prefix = c.prefix,
                                   .tokens = (uint64_t)c.tokens_total,
                                   .documents = (uint64_t)nd,
                                   .ids_checksum = checksum};
            mq_logits_header_encode(&hw, h);
            if (pwrite(c.save_fd, h, sizeof h, 0) != (ssize_t)sizeof h) {
                st = mq_err(MOEQ_E_IO, "%s: write failed", opt->save_logits);
                mq_atomic_abort(&af);
            } else {
                st = mq_atomic_commit(&af);
            }
        }
    }
    mq_unmap(&kl_map);
    ctx_free(&c);
    if (!st && interrupted)
        st = mq_err(MOEQ_E_INTERRUPTED, "eval interrupted after %lld of %lld documents",
                    (long long)res->documents, (long long)nd);
    return st;
}
