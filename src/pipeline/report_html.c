/*
 * The quantization report as one self-contained page to look at (`--report-html`): inline SVG
 * drawn here, no scripts, fonts or anything from the network. It is drawn from the JSON report
 * object itself (report.c), so every number on the page is one the JSON holds:
 *   - GPTQ against RTN layer loss per layer (log scale);
 *   - calibration tokens per expert, a layer x expert heat map, the experts that used the
 *     fallback marked;
 *   - GPTQ / RTN loss per expert, the same map;
 *   - seconds per layer by stage and the peak anonymous memory;
 *   - the modules with the largest loss.
 * Every drawn value is also in a data-* attribute (and a <title> tooltip), so tests can read the
 * page back and compare it with the JSON. The markup is XHTML: an XML parser reads it.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/page.h"
#include "pipeline/internal.h"

enum { W = 960, PADL = 70, PADR = 20, PADT = 20, PADB = 40 };

static double num(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}
static const char *str(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* GPTQ and RTN loss per layer, bars on a log10 axis. */
static void plot_layer_loss(mq_page *b, int L, const double *gq, const double *rt) {
    double lo = INFINITY, hi = -INFINITY;
    for (int l = 0; l < L; l++)
        for (int k = 0; k < 2; k++) {
            double v = k ? rt[l] : gq[l];
            if (v > 0 && isfinite(v)) {
                lo = fmin(lo, log10(v));
                hi = fmax(hi, log10(v));
            }
        }
    if (!isfinite(lo)) {
        mq_page_printf(b, "<p>No layer losses to draw.</p>\n");
        return;
    }
    lo = floor(lo);
    hi = ceil(hi) > lo ? ceil(hi) : lo + 1;
    const int H = 260;
    const double pw = W - PADL - PADR, ph = H - PADT - PADB, slot = pw / L;
    mq_page_printf(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"layer-loss\" width=\"%d\" height=\"%d\" "
              "viewBox=\"0 0 %d %d\">\n", W, H, W, H);
    for (double e = lo; e <= hi; e += 1) {
        double y = PADT + ph * (1 - (e - lo) / (hi - lo));
        mq_page_printf(b, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>", PADL, y, W - PADR, y);
        char t[32];
        snprintf(t, sizeof t, "1e%+d", (int)e);
        mq_page_label(b, PADL - 6, y + 4, "end", t);
    }
    for (int l = 0; l < L; l++) {
        for (int k = 0; k < 2; k++) {
            double v = k ? rt[l] : gq[l];
            if (!(v > 0) || !isfinite(v)) continue;
            double hgt = ph * (log10(v) - lo) / (hi - lo), bw = slot * 0.38;
            double x = PADL + l * slot + slot * 0.1 + k * bw;
            mq_page_printf(b, "<rect class=\"bar %s\" data-layer=\"%d\" data-value=\"%.9g\" x=\"%.2f\" y=\"%.2f\" "
                      "width=\"%.2f\" height=\"%.2f\" fill=\"%s\"><title>layer %d: %s loss %.6g</title></rect>\n",
                      k ? "rtn" : "gptq", l, v, x, PADT + ph - hgt, bw, hgt, k ? "#f4a261" : "#2a6f97", l,
                      k ? "RTN" : "GPTQ", v);
        }
        if (L <= 64 && (L <= 16 || l % 4 == 0)) {
            char t[16];
            snprintf(t, sizeof t, "%d", l);
            mq_page_label(b, PADL + (l + 0.5) * slot, H - PADB + 14, "middle", t);
        }
    }
    mq_page_label(b, PADL + pw / 2, H - 6, "middle", "layer (blue: GPTQ, orange: RTN; layer loss summed over its Linears)");
    mq_page_printf(b, "</svg>\n");
}

/* A layer x expert map: value[l * E + e] (NaN: no such expert), fallback marks. */
static void plot_expert_map(mq_page *b, const char *id, const char *what, int L, int E, const double *v,
                            const unsigned char *fallback, bool log_scale, const char *attr) {
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < L * E; i++) {
        double x = v[i];
        if (!isfinite(x) || (log_scale && !(x > 0))) continue;
        x = log_scale ? log10(x) : x;
        lo = fmin(lo, x);
        hi = fmax(hi, x);
    }
    const double cw = fmax(3.0, fmin(60.0, (double)(W - PADL - PADR) / E)), ch = fmax(3.0, fmin(28.0, 900.0 / L));
    const int H = (int)(PADT + ch * L + PADB + 16), Wd = W;
    mq_page_printf(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"%s\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n",
              id, Wd, H, Wd, H);
    for (int l = 0; l < L; l++) {
        for (int e = 0; e < E; e++) {
            double x = v[l * E + e];
            if (!isfinite(x)) continue;
            double t = hi > lo ? ((log_scale ? log10(fmax(x, 1e-300)) : x) - lo) / (hi - lo) : 0.5;
            if (log_scale && !(x > 0)) t = 0;
            char col[8];
            mq_page_shade(t, col);
            const double cx = PADL + e * cw, cy = PADT + l * ch;
            const bool fb = fallback && fallback[l * E + e];
            mq_page_printf(b, "<rect class=\"cell%s\" data-layer=\"%d\" data-expert=\"%d\" %s=\"%.9g\" x=\"%.2f\" "
                      "y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"><title>layer %d expert %d: %s %.6g%s</title></rect>",
                      fb ? " fallback" : "", l, e, attr, x, cx, cy, cw, ch, col, l, e, what, x,
                      fb ? " (fallback)" : "");
            if (fb)
                mq_page_printf(b, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#d62828\" stroke-width=\"1.5\"/>",
                          cx, cy + ch, cx + cw, cy);
        }
        mq_page_printf(b, "\n");
        if (L <= 16 || l % 4 == 0) {
            char t[16];
            snprintf(t, sizeof t, "%d", l);
            mq_page_label(b, PADL - 6, PADT + (l + 0.7) * ch, "end", t);
        }
    }
    char t[200];
    snprintf(t, sizeof t, "expert (0 .. %d) across, layer down; %s%s", E - 1, what,
             fallback ? "; red stroke: fallback (too few tokens)" : "");
    mq_page_label(b, PADL, H - 24, "start", t);
    if (isfinite(lo)) {
        snprintf(t, sizeof t, "colour: white %.4g .. deep blue %.4g%s", log_scale ? pow(10, lo) : lo,
                 log_scale ? pow(10, hi) : hi, log_scale ? " (log scale)" : "");
        mq_page_label(b, PADL, H - 8, "start", t);
    }
    mq_page_printf(b, "</svg>\n");
}

/* Seconds per layer by stage (stacked) and the peak anonymous memory (dots, right axis). */
static void plot_time_memory(mq_page *b, const cJSON *layers, int L) {
    static const char *stage[] = {"forward", "hessians", "gptq", "write"};
    static const char *color[] = {"#2a6f97", "#61a5c2", "#f4a261", "#8d99ae"};
    double tmax = 0, mmax = 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, layers) {
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(x, "seconds");
        double t = 0;
        for (int k = 0; k < 4; k++) t += fmax(0, num(s, stage[k]));
        tmax = fmax(tmax, t);
        mmax = fmax(mmax, num(x, "peak_anon_bytes"));
    }
    if (!(tmax > 0)) tmax = 1;
    if (!(mmax > 0)) mmax = 1;
    const int H = 260;
    const double pw = W - PADL - 60, ph = H - PADT - PADB, slot = pw / L;
    mq_page_printf(b, "<svg xmlns=\"http://www.w3.org/2000/svg\" id=\"time-memory\" width=\"%d\" height=\"%d\" "
              "viewBox=\"0 0 %d %d\">\n", W, H, W, H);
    char t[64];
    snprintf(t, sizeof t, "%.3g s", tmax);
    mq_page_label(b, PADL - 6, PADT + 4, "end", t);
    snprintf(t, sizeof t, "%.3g GB", mmax / 1e9);
    mq_page_label(b, W - 4, PADT + 4, "end", t);
    int l = 0;
    cJSON_ArrayForEach(x, layers) {
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(x, "seconds");
        double y = PADT + ph;
        for (int k = 0; k < 4; k++) {
            double v = fmax(0, num(s, stage[k])), h = ph * v / tmax;
            y -= h;
            mq_page_printf(b, "<rect class=\"stage %s\" data-layer=\"%d\" data-seconds=\"%.9g\" x=\"%.2f\" y=\"%.2f\" "
                      "width=\"%.2f\" height=\"%.2f\" fill=\"%s\"><title>layer %d: %s %.4g s</title></rect>", stage[k], l,
                      v, PADL + l * slot + slot * 0.15, y, slot * 0.7, h, color[k], l, stage[k], v);
        }
        if (L <= 16 || l % 4 == 0) {
            snprintf(t, sizeof t, "%d", l);
            mq_page_label(b, PADL + (l + 0.5) * slot, H - PADB + 14, "middle", t);
        }
        double m = num(x, "peak_anon_bytes");
        mq_page_printf(b, "<circle class=\"peak\" data-layer=\"%d\" data-bytes=\"%.0f\" cx=\"%.2f\" cy=\"%.2f\" r=\"3\" "
                  "fill=\"#d62828\"><title>layer %d: peak %.3f GB</title></circle>\n", l, m, PADL + (l + 0.5) * slot,
                  PADT + ph * (1 - m / mmax), l, m / 1e9);
        l++;
    }
    for (int k = 0; k < 4; k++) {   /* legend */
        mq_page_printf(b, "<rect x=\"%d\" y=\"%d\" width=\"10\" height=\"10\" fill=\"%s\"/>", PADL + 120 * k, H - 16, color[k]);
        mq_page_label(b, PADL + 120 * k + 14, H - 7, "start", k == 1 ? "Hessians" : k == 2 ? "GPTQ" : stage[k]);
    }
    mq_page_printf(b, "<circle cx=\"%d\" cy=\"%d\" r=\"3\" fill=\"#d62828\"/>", PADL + 485, H - 11);
    mq_page_label(b, PADL + 492, H - 7, "start", "peak memory (right axis); layer across");
    mq_page_printf(b, "</svg>\n");
}

static int cmp_desc(const void *a, const void *b) {
    const double x = ((const double *)a)[0], y = ((const double *)b)[0];
    return x < y ? 1 : x > y ? -1 : 0;
}

moeq_status mq_report_html_write(const cJSON *j, const char *path) {
    const cJSON *mods = cJSON_GetObjectItemCaseSensitive(j, "modules");
    const cJSON *layers = cJSON_GetObjectItemCaseSensitive(j, "layers");
    const int L = cJSON_GetArraySize(layers) > 0 ? cJSON_GetArraySize(layers) : 1;
    int E = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, mods) {
        double e = num(m, "expert");
        if (isfinite(e) && e + 1 > E) E = (int)e + 1;
    }
    double *gq = calloc((size_t)L, sizeof *gq), *rt = calloc((size_t)L, sizeof *rt);
    double *tok = NULL, *ratio = NULL, *eg = NULL, *er = NULL;
    unsigned char *fb = NULL;
    if (E > 0) {
        const size_t n = (size_t)L * (size_t)E;
        tok = malloc(n * sizeof *tok);
        ratio = malloc(n * sizeof *ratio);
        eg = calloc(n, sizeof *eg);
        er = calloc(n, sizeof *er);
        fb = calloc(n, 1);
        for (size_t i = 0; tok && ratio && i < n; i++) tok[i] = ratio[i] = NAN;
    }
    const int nm = cJSON_GetArraySize(mods);
    double *top = malloc((size_t)(nm > 0 ? nm : 1) * 2 * sizeof *top);   /* (loss, index) */
    mq_page b = {0};
    if (!gq || !rt || !top || (E > 0 && (!tok || !ratio || !eg || !er || !fb))) b.oom = true;
    int ntop = 0, idx = 0;
    cJSON_ArrayForEach(m, mods) {
        if (b.oom) break;
        const int l = (int)num(m, "layer");
        const double loss = num(m, "loss"), rl = num(m, "rtn_loss"), e = num(m, "expert");
        const bool gptq = strncmp(str(m, "method"), "gptq", 4) == 0;
        if (l >= 0 && l < L && isfinite(loss) && isfinite(rl) && gptq) {
            gq[l] += loss;
            rt[l] += rl;
        }
        if (isfinite(loss)) {
            top[2 * ntop] = loss;
            top[2 * ntop++ + 1] = idx;
        }
        if (E > 0 && isfinite(e) && l >= 0 && l < L) {
            const size_t c = (size_t)l * (size_t)E + (size_t)e;
            if (!isfinite(tok[c])) tok[c] = num(m, "tokens");   /* its Hessian's tokens (gate/up) */
            if (strcmp(str(m, "method"), "gptq") != 0) fb[c] = 1;
            if (isfinite(loss) && isfinite(rl)) {
                eg[c] += loss;
                er[c] += rl;
                ratio[c] = er[c] > 0 ? eg[c] / er[c] : NAN;
            }
        }
        idx++;
    }
    const cJSON *set = cJSON_GetObjectItemCaseSensitive(j, "settings");
    const cJSON *cal = cJSON_GetObjectItemCaseSensitive(j, "calibration");
    const cJSON *sum = cJSON_GetObjectItemCaseSensitive(j, "summary");
    const cJSON *sec = cJSON_GetObjectItemCaseSensitive(j, "seconds");
    mq_page_begin(&b, "moeq quantization report");
    mq_page_printf(&b, "<table id=\"settings\">\n");
    const cJSON *it;
    cJSON_ArrayForEach(it, set) {
        mq_page_printf(&b, "<tr><th>");
        mq_page_text(&b, it->string);
        mq_page_printf(&b, "</th><td>");
        if (cJSON_IsString(it)) mq_page_text(&b, it->valuestring);
        else if (cJSON_IsNumber(it)) mq_page_printf(&b, "%.6g", it->valuedouble);
        else mq_page_printf(&b, "%s", cJSON_IsTrue(it) ? "true" : "false");
        mq_page_printf(&b, "</td></tr>\n");
    }
    mq_page_printf(&b, "<tr><th>calibration</th><td>");
    mq_page_text(&b, str(cal, "file"));
    mq_page_printf(&b, ": %.0f samples, %.0f tokens</td></tr>\n", num(cal, "samples"), num(cal, "tokens"));
    mq_page_printf(&b, "<tr><th>result</th><td id=\"summary\" data-gptq=\"%.9g\" data-rtn=\"%.9g\">%.0f Linears; layer loss "
              "%.6g against RTN's %.6g; %.0f experts' Linears on the fallback; %.0f worse than RTN</td></tr>\n",
              num(sum, "gptq_loss_total"), num(sum, "rtn_loss_total"), num(sum, "modules"),
              num(sum, "gptq_loss_total"), num(sum, "rtn_loss_total"), num(sum, "expert_fallbacks"),
              num(sum, "modules_worse_than_rtn"));
    mq_page_printf(&b, "<tr><th>time, memory</th><td>%.1f s (forward %.1f, Hessians %.1f, GPTQ %.1f, write %.1f); "
              "peak %.2f GB of anonymous memory</td></tr>\n</table>\n", num(sec, "total"), num(sec, "forward"),
              num(sec, "hessians"), num(sec, "gptq"), num(sec, "write"), num(j, "peak_anon_bytes") / 1e9);
    mq_page_printf(&b, "<h2>Layer loss: GPTQ against round to nearest</h2>\n<p class=\"note\">tr((W-Q) H (W-Q)^T) "
              "with each Linear's calibration Hessian, summed over the layer's Linears quantized by GPTQ.</p>\n");
    if (!b.oom) plot_layer_loss(&b, L, gq, rt);
    if (E > 0 && !b.oom) {
        mq_page_printf(&b, "<h2>Calibration tokens per expert</h2>\n<p class=\"note\">Tokens routed to each expert (its "
                  "gate/up Hessian), log scale. Marked: experts below the token minimum, quantized by the "
                  "fallback.</p>\n");
        plot_expert_map(&b, "expert-tokens", "tokens", L, E, tok, fb, true, "data-tokens");
        mq_page_printf(&b, "<h2>GPTQ loss against RTN per expert</h2>\n<p class=\"note\">The expert's GPTQ layer loss over "
                  "its RTN loss (gate, up and down together): darker is closer to RTN, i.e. less gained.</p>\n");
        plot_expert_map(&b, "expert-ratio", "GPTQ / RTN loss", L, E, ratio, fb, false, "data-ratio");
    } else {
        mq_page_printf(&b, "<p class=\"note\">No routed experts in this model.</p>\n");
    }
    mq_page_printf(&b, "<h2>Time and memory per layer</h2>\n");
    if (!b.oom) plot_time_memory(&b, layers, L);
    if (!b.oom && ntop > 0) {
        qsort(top, (size_t)ntop, 2 * sizeof *top, cmp_desc);
        mq_page_printf(&b, "<h2>Largest layer losses</h2>\n<table id=\"top-modules\">\n<tr><th>module</th><th>method</th>"
                  "<th>tokens</th><th>loss</th><th>RTN loss</th><th>GPTQ / RTN</th></tr>\n");
        for (int k = 0; k < ntop && k < 15; k++) {
            const cJSON *x = cJSON_GetArrayItem(mods, (int)top[2 * k + 1]);
            const double loss = num(x, "loss"), rl = num(x, "rtn_loss");
            mq_page_printf(&b, "<tr><td>");
            mq_page_text(&b, str(x, "module"));
            mq_page_printf(&b, "</td><td>");
            mq_page_text(&b, str(x, "method"));
            mq_page_printf(&b, "</td><td>%.0f</td><td>%.6g</td><td>%.6g</td><td>%.3f</td></tr>\n", num(x, "tokens"), loss, rl,
                      rl > 0 ? loss / rl : NAN);
        }
        mq_page_printf(&b, "</table>\n");
    }
    mq_page_end(&b);
    free(gq), free(rt), free(tok), free(ratio), free(eg), free(er), free(fb), free(top);
    moeq_status st = mq_page_save(&b, path);
    return st;
}
