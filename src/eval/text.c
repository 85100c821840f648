/*
 * Text side of lm-evaluation-harness's wikitext task (lm_eval/tasks/wikitext/
 * preprocess_wikitext.py, see docs formats.md section 3): the wikitext detokenizer, the word
 * count len(re.split(r"\s+", page)), Python's Unicode whitespace set and a strict UTF-8 check.
 *
 * Everything works on UTF-8 bytes. The detokenizer's patterns and replacements are ASCII or whole
 * UTF-8 sequences, so byte-level str.replace is the same as Python's code-point-level one; only
 * the \s of the regexes needs decoding, which mq_utf8_space_len does.
 */
#include <stdlib.h>
#include <string.h>

#include "core/page.h"
#include "eval/eval.h"

bool mq_py_isspace(uint32_t c) {
    if (c < 0x80) return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20);
    return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 ||
           c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Decodes one well-formed UTF-8 sequence at s; returns its length, or 0 if malformed. */
static size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp) {
    if (n == 0) return 0;
    unsigned c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len;
    uint32_t v, min;
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2, v = c & 0x1f, min = 0x80;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3, v = c & 0x0f, min = 0x800;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4, v = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3f);
    }
    if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
    *cp = v;
    return len;
}

size_t mq_utf8_space_len(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    if (n == 0) return 0;
    if (u[0] < 0x80) return mq_py_isspace(u[0]) ? 1 : 0;
    /* Only U+0085/U+00A0 (lead 0xC2), U+1680 (0xE1) and U+2000.. /U+3000 (0xE2, 0xE3) qualify. */
    if (u[0] != 0xc2 && u[0] != 0xe1 && u[0] != 0xe2 && u[0] != 0xe3) return 0;
    uint32_t cp;
    size_t len = utf8_decode(u, n, &cp);
    return len && mq_py_isspace(cp) ? len : 0;
}

bool mq_utf8_valid(const char *s, size_t n, size_t *bad_offset) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) { /* fast path for ASCII runs */
            i++;
            continue;
        }
        uint32_t cp;
        size_t len = utf8_decode(u + i, n - i, &cp);
        if (!len) {
            if (bad_offset) *bad_offset = i;
            return false;
        }
        i += len;
    }
    return true;
}

int64_t moeq_count_words(const char *text, size_t len) {
    /* re.split(r"\s+", s) yields one more piece than there are maximal whitespace runs. */
    int64_t runs = 0;
    bool in_run = false;
    size_t i = 0;
    while (i < len) {
        size_t w = mq_utf8_space_len(text + i, len - i);
        if (w) {
            if (!in_run) runs++;
            in_run = true;
            i += w;
        } else {
            in_run = false;
            i++;
        }
    }
    return runs + 1;
}

/* ---- detokenizer ---------------------------------------------------------------------------- */

/* Each pass reads one text buffer and writes another (core/page.h), then they swap. */

/* str.replace(old, new): one left-to-right pass over non-overlapping occurrences. */
static void replace_all(const mq_page *in, mq_page *out, const char *old, const char *rep) {
    size_t on = strlen(old), rn = strlen(rep), i = 0, start = 0;
    out->n = 0;
    while (i + on <= in->n) {
        const char *hit = memchr(in->s + i, old[0], in->n - on + 1 - i);
        if (!hit) break;
        i = (size_t)(hit - in->s);
        if (memcmp(hit, old, on) == 0) {
            mq_page_put(out, in->s + start, i - start);
            mq_page_put(out, rep, rn);
            i += on;
            start = i;
        } else {
            i++;
        }
    }
    mq_page_put(out, in->s + start, in->n - start);
}

static bool is_ascii_digit(char c) { return c >= '0' && c <= '9'; }

/* re.sub(r"/' [0-9]/", r"/'[0-9]/", s): the replacement is the literal text "/'[0-9]/". */
static void replace_slash_quote_digit(const mq_page *in, mq_page *out) {
    size_t i = 0, start = 0;
    out->n = 0;
    while (i + 5 <= in->n) {
        const char *s = in->s + i;
        if (s[0] == '/' && s[1] == '\'' && s[2] == ' ' && is_ascii_digit(s[3]) && s[4] == '/') {
            mq_page_put(out, in->s + start, i - start);
            mq_page_put(out, "/'[0-9]/", 8);
            i += 5;
            start = i;
        } else {
            i++;
        }
    }
    mq_page_put(out, in->s + start, in->n - start);
}

/* re.sub(r"O\s*([^C]*?)\s*C", r"O\1C", s) for an ASCII opener O and closer C. The match from an
 * opener always ends at the next closer (neither \s nor [^C] can cross it), the greedy \s* takes
 * all leading whitespace and the lazy group stops before the trailing whitespace: the inner text
 * is stripped. Without a later closer the opener is left as is and the scan moves one char on. */
static void strip_brackets(const mq_page *in, mq_page *out, char open, char close) {
    size_t i = 0, start = 0;
    const char *s = in->s;
    out->n = 0;
    while (i < in->n) {
        const char *o = memchr(s + i, open, in->n - i);
        if (!o) break;
        size_t a = (size_t)(o - s) + 1;
        const char *c = memchr(s + a, close, in->n - a);
        if (!c) break; /* no closer after this opener, hence none after any later one */
        size_t b = (size_t)(c - s);
        size_t lo = a, w;
        while (lo < b && (w = mq_utf8_space_len(s + lo, b - lo)) != 0) lo += w;
        size_t hi = lo; /* end of the last non-whitespace character in [lo, b) */
        for (size_t k = lo; k < b;) {
            w = mq_utf8_space_len(s + k, b - k);
            if (w) {
                k += w;
            } else {
                k++;
                hi = k;
            }
        }
        mq_page_put(out, s + start, a - start); /* text before and the opener */
        mq_page_put(out, s + lo, hi - lo);
        mq_page_put(out, &close, 1);
        i = start = b + 1;
    }
    mq_page_put(out, s + start, in->n - start);
}

static void page_swap(mq_page *a, mq_page *b) {
    mq_page t = *a;
    *a = *b;
    *b = t;
}

moeq_status moeq_wikitext_detokenize(const char *text, size_t len, char **out, size_t *out_len) {
    /* preprocess_wikitext.wikitext_detokenizer, in its order. */
    static const char *const punct[][2] = {
        {" @-@ ", "-"}, {" @,@ ", ","}, {" @.@ ", "."}, {" : ", ": "}, {" ; ", "; "},
        {" . ", ". "},  {" ! ", "! "},  {" ? ", "? "},  {" , ", ", "},
    };
    static const char brackets[][2] = {
        {'(', ')'}, {'[', ']'}, {'{', '}'}, {'"', '"'}, {'\'', '\''}};
    static const char *const misc[][2] = {
        {"= = = =", "===="}, {"= = =", "==="}, {"= =", "=="},  {" \xc2\xb0 ", "\xc2\xb0"},
        {" \n", "\n"},       {"\n ", "\n"},    {" N ", " 1 "}, {" 's", "'s"},
    };
    *out = NULL;
    if (out_len) *out_len = 0;
    mq_page a = {0}, b = {0}; /* each pass reads a and writes b, then they swap */
    mq_page_put(&a, text, len);
    replace_all(&a, &b, "s '", "s'");
    page_swap(&a, &b);
    replace_slash_quote_digit(&a, &b);
    page_swap(&a, &b);
    for (size_t i = 0; i < sizeof punct / sizeof punct[0]; i++) {
        replace_all(&a, &b, punct[i][0], punct[i][1]);
        page_swap(&a, &b);
    }
    for (size_t i = 0; i < sizeof brackets / sizeof brackets[0]; i++) {
        strip_brackets(&a, &b, brackets[i][0], brackets[i][1]);
        page_swap(&a, &b);
    }
    for (size_t i = 0; i < sizeof misc / sizeof misc[0]; i++) {
        replace_all(&a, &b, misc[i][0], misc[i][1]);
        page_swap(&a, &b);
    }
    free(b.s);
    if (!a.oom && !b.oom && !a.s) a.s = calloc(1, 1); /* empty result */
    if (a.oom || b.oom || !a.s) {
        free(a.s);
        return mq_err(MOEQ_E_NOMEM, "wikitext detokenizer: out of memory (%zu bytes of text)", len);
    }
    *out = a.s;
    if (out_len) *out_len = a.n;
    return MOEQ_OK;
}
