/*
 * An evaluation as one page to look at (moeq.h moeq_eval_html; `moeq eval --html`): the
 * summary, KL and top-1 changes per document, the distribution of per-token KL, and each
 * document's token perplexity against the base model's. Inline SVG, no scripts; every plotted
 * value also sits in a data-* attribute so tests can read the page back.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/page.h"
#include "eval/eval.h"

enum { W = 960, PADL = 70, PADR = 20, PADT = 20, PADB = 40, H = 240 };

/* One bar per document: v[d] (NaN: left out), linear axis from 0. */
static void doc_bars(mq_page *b, const char *id, const char *attr, const char *what, const double *v, int64_t n,
                     const char *color) {
    double mx = 0;
    for (int64_t d = 0; d < n; d++)
        if (isfinite(v[d])) mx = fmax(mx, v[d]);
    if (!(mx > 0)) mx = 1;
    const double pw = W - PADL - PADR, ph = H - PADT - PADB, slot = pw / (double)(n > 0 ? n : 1);
    mq_page_printf(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"%s\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n",
                   id, W, H, W, H);
    char t[96];
    snprintf(t, sizeof t, "%.4g", mx);
    mq_page_label(b, PADL - 6, PADT + 4, "end", t);
    mq_page_label(b, PADL - 6, PADT + ph + 4, "end", "0");
    for (int64_t d = 0; d < n; d++) {
        if (!isfinite(v[d])) continue;
        const double h = ph * v[d] / mx;
        mq_page_printf(b, "<rect class=\"doc\" data-doc=\"%lld\" %s=\"%.9g\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" "
                       "height=\"%.2f\" fill=\"%s\"><title>document %lld: %s %.6g</title></rect>\n",
                       (long long)d, attr, v[d], PADL + d * slot + slot * 0.1, PADT + ph - h, slot * 0.8, h, color,
                       (long long)d + 1, what, v[d]);
    }
    snprintf(t, sizeof t, "document (1 .. %lld); %s", (long long)n, what);
    mq_page_label(b, PADL + pw / 2, H - 8, "middle", t);
    mq_page_printf(b, "</svg>\n");
}

static void kl_histogram(mq_page *b, const moeq_eval_result *r) {
    int64_t mx = 1;
    for (int i = 0; i < MOEQ_KL_HIST_BINS; i++) mx = r->kl_hist[i] > mx ? r->kl_hist[i] : mx;
    const double pw = W - PADL - PADR, ph = H - PADT - PADB, slot = pw / MOEQ_KL_HIST_BINS;
    mq_page_printf(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"kl-hist\" width=\"%d\" height=\"%d\" "
                   "viewBox=\"0 0 %d %d\">\n", W, H, W, H);
    char t[64];
    snprintf(t, sizeof t, "%lld", (long long)mx);
    mq_page_label(b, PADL - 6, PADT + 4, "end", t);
    for (int i = 0; i < MOEQ_KL_HIST_BINS; i++) {
        const double h = ph * (double)r->kl_hist[i] / (double)mx;
        char lo[24], hi[24];
        if (i == 0) snprintf(lo, sizeof lo, "0");
        else snprintf(lo, sizeof lo, "%.3g", pow(10, -7 + (i - 1) / 2.0));
        if (i == MOEQ_KL_HIST_BINS - 1) snprintf(hi, sizeof hi, "inf");
        else snprintf(hi, sizeof hi, "%.3g", i == 0 ? 1e-7 : pow(10, -7 + i / 2.0));
        mq_page_printf(b, "<rect class=\"bin\" data-bin=\"%d\" data-count=\"%lld\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" "
                       "height=\"%.2f\" fill=\"#2a6f97\"><title>KL in [%s, %s): %lld tokens</title></rect>\n",
                       i, (long long)r->kl_hist[i], PADL + i * slot + slot * 0.1, PADT + ph - h, slot * 0.8, h, lo, hi,
                       (long long)r->kl_hist[i]);
        if (i % 2 == 1) mq_page_label(b, PADL + i * slot, PADT + ph + 14, "middle", lo);
    }
    mq_page_label(b, PADL + pw / 2, H - 8, "middle", "per-token KL(base || model), nats, log bins (tokens per bin)");
    mq_page_printf(b, "</svg>\n");
}

/* Token perplexity per document, the model's against the base's: paired bars, log axis. */
static void doc_ppl(mq_page *b, const double *ll, const double *llb, const int64_t *nt, int64_t n) {
    double lo = INFINITY, hi = -INFINITY;
    for (int64_t d = 0; d < n; d++)
        for (int k = 0; k < 2; k++) {
            const double *x = k ? llb : ll;
            if (!x || !(nt[d] > 0) || !isfinite(x[d])) continue;
            double v = -x[d] / (double)nt[d] / log(10.0);   /* log10 of the perplexity */
            lo = fmin(lo, v);
            hi = fmax(hi, v);
        }
    if (!isfinite(lo)) return;
    lo = floor(lo);
    hi = ceil(hi) > lo ? ceil(hi) : lo + 1;
    const double pw = W - PADL - PADR, ph = H - PADT - PADB, slot = pw / (double)n;
    mq_page_printf(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"doc-ppl\" width=\"%d\" height=\"%d\" "
                   "viewBox=\"0 0 %d %d\">\n", W, H, W, H);
    char t[64];
    snprintf(t, sizeof t, "1e%+d", (int)hi);
    mq_page_label(b, PADL - 6, PADT + 4, "end", t);
    snprintf(t, sizeof t, "1e%+d", (int)lo);
    mq_page_label(b, PADL - 6, PADT + ph + 4, "end", t);
    for (int64_t d = 0; d < n; d++)
        for (int k = 0; k < 2; k++) {
            const double *x = k ? llb : ll;
            if (!x || !(nt[d] > 0) || !isfinite(x[d])) continue;
            const double ppl = exp(-x[d] / (double)nt[d]), hgt = ph * (log10(ppl) - lo) / (hi - lo), bw = slot * 0.38;
            mq_page_printf(b, "<rect class=\"ppl %s\" data-doc=\"%lld\" data-ppl=\"%.9g\" x=\"%.2f\" y=\"%.2f\" "
                           "width=\"%.2f\" height=\"%.2f\" fill=\"%s\"><title>document %lld: %s token perplexity %.6g</title></rect>\n",
                           k ? "base" : "model", (long long)d, ppl, PADL + d * slot + slot * 0.1 + k * bw,
                           PADT + ph - hgt, bw, hgt, k ? "#8d99ae" : "#2a6f97", (long long)d + 1, k ? "base" : "model", ppl);
        }
    mq_page_label(b, PADL + pw / 2, H - 8, "middle", "document: token perplexity of the model (blue) and the base (grey), log scale");
    mq_page_printf(b, "</svg>\n");
}

moeq_status moeq_eval_html(const char *path, const moeq_eval_page *pg) {
    if (!path || !pg || !pg->result || !pg->docs) return mq_err(MOEQ_E_ARG, "moeq_eval_html: no result to draw");
    const moeq_eval_result *r = pg->result;
    const int64_t n = moeq_docs_count(pg->docs);
    mq_page b = {0};
    mq_page_begin(&b, "moeq evaluation report");
    mq_page_printf(&b, "<table id=\"summary\" data-word-perplexity=\"%.12g\" data-kl-mean=\"%.9g\" "
                   "data-top1-changed=\"%.9g\">\n<tr><th>model</th><td>", r->word_perplexity,
                   r->has_kl ? r->kl_mean : NAN, r->has_kl ? r->top1_changed : NAN);
    mq_page_text(&b, pg->model ? pg->model : "");
    mq_page_printf(&b, "</td></tr>\n<tr><th>data</th><td>");
    mq_page_text(&b, pg->data ? pg->data : "");
    mq_page_printf(&b, ": %lld documents, %lld tokens, %lld words</td></tr>\n", (long long)r->documents,
                   (long long)r->tokens, (long long)r->words);
    mq_page_printf(&b, "<tr><th>word perplexity</th><td>%.6f", r->word_perplexity);
    if (r->has_base) mq_page_printf(&b, " (base %.6f, %+.3f%%)", r->base_word_perplexity,
                                    100 * (r->word_perplexity / r->base_word_perplexity - 1));
    mq_page_printf(&b, "</td></tr>\n<tr><th>bits per byte</th><td>%.6f</td></tr>\n", r->bits_per_byte);
    if (r->has_kl) {
        mq_page_printf(&b, "<tr><th>KL to the base</th><td>mean %.6g nats per token, 99th percentile %.6g%s</td></tr>\n"
                       "<tr><th>top-1 changed</th><td>%.4f of %lld tokens</td></tr>\n",
                       r->kl_mean, r->kl_p99, r->kl_top_k ? " (from saved top-k logits: a lower bound)" : "",
                       r->top1_changed, (long long)r->kl_tokens);
        if (pg->base) {
            mq_page_printf(&b, "<tr><th>base</th><td>");
            mq_page_text(&b, pg->base);
            mq_page_printf(&b, "</td></tr>\n");
        }
    }
    mq_page_printf(&b, "</table>\n");
    if (r->has_kl && pg->doc_kl) {
        mq_page_printf(&b, "<h2>KL per document</h2>\n<p class=\"note\">Mean KL(base || model) per scored token of each "
                       "document.</p>\n");
        doc_bars(&b, "doc-kl", "data-kl", "mean KL, nats per token", pg->doc_kl, n, "#2a6f97");
        mq_page_printf(&b, "<h2>Distribution of per-token KL</h2>\n");
        kl_histogram(&b, r);
    }
    if (r->has_kl && pg->doc_top1_changed) {
        mq_page_printf(&b, "<h2>Top-1 changes per document</h2>\n<p class=\"note\">The share of the document's tokens "
                       "whose most likely next token differs from the base's.</p>\n");
        doc_bars(&b, "doc-top1", "data-top1", "share of top-1 changes", pg->doc_top1_changed, n, "#f4a261");
    }
    if (pg->doc_loglikelihood && pg->doc_tokens) {
        mq_page_printf(&b, "<h2>Perplexity per document</h2>\n");
        doc_ppl(&b, pg->doc_loglikelihood, r->has_base ? pg->doc_base_loglikelihood : NULL, pg->doc_tokens, n);
    }
    mq_page_end(&b);
    return mq_page_save(&b, path);
}
