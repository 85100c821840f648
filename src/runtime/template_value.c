/*
 * The chat-template interpreter's values (template.h): the arena, Python's str() and repr() of
 * each kind, transformers' tojson (json.dumps with ensure_ascii=False) and a JSON reader that
 * keeps what Python's json.loads keeps (ints apart from floats, key order), so that a message
 * printed back through tojson has the bytes transformers prints.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/json.h"
#include "runtime/template.h"

struct mq_tt_block {
    mq_tt_block *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

tv mq_tt_undef = {.k = TV_UNDEF}, mq_tt_none = {.k = TV_NONE}, mq_tt_true = {.k = TV_BOOL, .u.b = 1},
   mq_tt_false = {.k = TV_BOOL, .u.b = 0};

_Noreturn void mq_tt_fail(mq_tt_ctx *c, moeq_status st, int line, const char *fmt, ...) {
    char m[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    if (line > 0)
        snprintf(c->msg, sizeof c->msg, "chat template %s line %d: %s", c->name, line, m);
    else
        snprintf(c->msg, sizeof c->msg, "chat template %s: %s", c->name, m);
    c->st = st;
    longjmp(c->jb, 1);
}

void mq_tt_arena_init(mq_tt_arena *a, size_t limit) {
    a->head = NULL;
    a->used_total = 0;
    a->limit = limit;
}

void mq_tt_arena_free(mq_tt_arena *a) {
    while (a->head) {
        mq_tt_block *n = a->head->next;
        free(a->head);
        a->head = n;
    }
    a->used_total = 0;
}

void *mq_tt_alloc(mq_tt_ctx *c, size_t n) {
    mq_tt_arena *a = c->a;
    n = (n + 15) & ~(size_t)15;
    if (n > a->limit || a->used_total > a->limit - n)
        mq_tt_fail(c, MOEQ_E_NOMEM, 0, "more than %zu bytes of values (a loop without end?)", a->limit);
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        mq_tt_block *b = malloc(sizeof *b + cap);
        if (!b) mq_tt_fail(c, MOEQ_E_NOMEM, 0, "out of memory");
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    a->used_total += n;
    memset(p, 0, n);
    return p;
}

char *mq_tt_strdup(mq_tt_ctx *c, const char *s, size_t n) {
    char *p = mq_tt_alloc(c, n + 1);
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

tv *mq_tv_int(mq_tt_ctx *c, int64_t i) {
    tv *x = mq_tt_alloc(c, sizeof *x);
    x->k = TV_INT;
    x->u.i = i;
    return x;
}

tv *mq_tv_float(mq_tt_ctx *c, double f) {
    tv *x = mq_tt_alloc(c, sizeof *x);
    x->k = TV_FLOAT;
    x->u.f = f;
    return x;
}

tv *mq_tv_bool(bool b) { return b ? &mq_tt_true : &mq_tt_false; }

tv *mq_tv_str_ref(mq_tt_ctx *c, const char *s, size_t n) {
    tv *x = mq_tt_alloc(c, sizeof *x);
    x->k = TV_STR;
    x->u.s.s = s;
    x->u.s.n = n;
    return x;
}

tv *mq_tv_str(mq_tt_ctx *c, const char *s, size_t n) { return mq_tv_str_ref(c, mq_tt_strdup(c, s, n), n); }

tv *mq_tv_list(mq_tt_ctx *c, size_t cap) {
    tv *x = mq_tt_alloc(c, sizeof *x);
    x->k = TV_LIST;
    x->u.l.cap = cap ? cap : 4;
    x->u.l.v = mq_tt_alloc(c, sizeof(tv *) * x->u.l.cap);
    return x;
}

void mq_tv_list_push(mq_tt_ctx *c, tv *l, tv *x) {
    if (l->u.l.n == l->u.l.cap) {
        tv **v = mq_tt_alloc(c, sizeof(tv *) * l->u.l.cap * 2);
        memcpy(v, l->u.l.v, sizeof(tv *) * l->u.l.n);
        l->u.l.v = v;
        l->u.l.cap *= 2;
    }
    l->u.l.v[l->u.l.n++] = x;
}

tv *mq_tv_dict(mq_tt_ctx *c, mq_tv_kind k) {
    tv *x = mq_tt_alloc(c, sizeof *x);
    x->k = k;
    x->u.d.cap = 4;
    x->u.d.key = mq_tt_alloc(c, sizeof(tv *) * 4);
    x->u.d.val = mq_tt_alloc(c, sizeof(tv *) * 4);
    return x;
}

static bool key_eq(const tv *a, const tv *b) {
    if (a->k == TV_STR && b->k == TV_STR)
        return a->u.s.n == b->u.s.n && !memcmp(a->u.s.s, b->u.s.s, a->u.s.n);
    return mq_tv_eq(a, b);
}

void mq_tv_dict_set(mq_tt_ctx *c, tv *d, tv *key, tv *val) {
    for (size_t i = 0; i < d->u.d.n; i++)
        if (key_eq(d->u.d.key[i], key)) {
            d->u.d.val[i] = val;
            return;
        }
    if (d->u.d.n == d->u.d.cap) {
        size_t cap = d->u.d.cap * 2;
        tv **k = mq_tt_alloc(c, sizeof(tv *) * cap), **v = mq_tt_alloc(c, sizeof(tv *) * cap);
        memcpy(k, d->u.d.key, sizeof(tv *) * d->u.d.n);
        memcpy(v, d->u.d.val, sizeof(tv *) * d->u.d.n);
        d->u.d.key = k;
        d->u.d.val = v;
        d->u.d.cap = cap;
    }
    d->u.d.key[d->u.d.n] = key;
    d->u.d.val[d->u.d.n++] = val;
}

tv *mq_tv_dict_get(const tv *d, const tv *key) {
    for (size_t i = 0; i < d->u.d.n; i++)
        if (key_eq(d->u.d.key[i], key)) return d->u.d.val[i];
    return NULL;
}

tv *mq_tv_dict_gets(const tv *d, const char *key) {
    size_t n = strlen(key);
    for (size_t i = 0; i < d->u.d.n; i++) {
        const tv *k = d->u.d.key[i];
        if (k->k == TV_STR && k->u.s.n == n && !memcmp(k->u.s.s, key, n)) return d->u.d.val[i];
    }
    return NULL;
}

bool mq_tv_truthy(const tv *x) {
    switch (x->k) {
    case TV_UNDEF:
    case TV_NONE: return false;
    case TV_BOOL: return x->u.b;
    case TV_INT: return x->u.i != 0;
    case TV_FLOAT: return x->u.f != 0;
    case TV_STR: return x->u.s.n > 0;
    case TV_LIST: return x->u.l.n > 0;
    case TV_DICT: return x->u.d.n > 0;
    default: return true;
    }
}

static bool is_num(const tv *x) { return x->k == TV_BOOL || x->k == TV_INT || x->k == TV_FLOAT; }
static double num(const tv *x) {
    return x->k == TV_FLOAT ? x->u.f : x->k == TV_INT ? (double)x->u.i : (double)x->u.b;
}
static int64_t inum(const tv *x) { return x->k == TV_INT ? x->u.i : x->u.b; }

bool mq_tv_eq(const tv *a, const tv *b) {
    if (is_num(a) && is_num(b)) {
        if (a->k != TV_FLOAT && b->k != TV_FLOAT) return inum(a) == inum(b);
        return num(a) == num(b);
    }
    if (a->k != b->k) return false;
    switch (a->k) {
    case TV_UNDEF:
    case TV_NONE: return true;
    case TV_STR: return a->u.s.n == b->u.s.n && !memcmp(a->u.s.s, b->u.s.s, a->u.s.n);
    case TV_LIST:
        if (a->u.l.n != b->u.l.n) return false;
        for (size_t i = 0; i < a->u.l.n; i++)
            if (!mq_tv_eq(a->u.l.v[i], b->u.l.v[i])) return false;
        return true;
    case TV_DICT:
        if (a->u.d.n != b->u.d.n) return false;
        for (size_t i = 0; i < a->u.d.n; i++) {
            const tv *o = mq_tv_dict_get(b, a->u.d.key[i]);
            if (!o || !mq_tv_eq(a->u.d.val[i], o)) return false;
        }
        return true;
    default: return a == b;
    }
}

int mq_tv_cmp(mq_tt_ctx *c, int line, const tv *a, const tv *b) {
    if (is_num(a) && is_num(b)) {
        if (a->k != TV_FLOAT && b->k != TV_FLOAT) return (inum(a) > inum(b)) - (inum(a) < inum(b));
        return (num(a) > num(b)) - (num(a) < num(b));
    }
    if (a->k == TV_STR && b->k == TV_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int r = memcmp(a->u.s.s, b->u.s.s, n);   /* UTF-8 byte order is code point order */
        if (r) return r < 0 ? -1 : 1;
        return (a->u.s.n > b->u.s.n) - (a->u.s.n < b->u.s.n);
    }
    if (a->k == TV_LIST && b->k == TV_LIST) {
        for (size_t i = 0; i < a->u.l.n && i < b->u.l.n; i++)
            if (!mq_tv_eq(a->u.l.v[i], b->u.l.v[i])) return mq_tv_cmp(c, line, a->u.l.v[i], b->u.l.v[i]);
        return (a->u.l.n > b->u.l.n) - (a->u.l.n < b->u.l.n);
    }
    mq_tt_fail(c, MOEQ_E_ARG, line, "cannot order %s and %s", mq_tv_type_name(a), mq_tv_type_name(b));
}

const char *mq_tv_type_name(const tv *x) {
    static const char *n[] = {"undefined", "NoneType", "bool", "int", "float", "str", "list",
                              "dict", "Namespace", "function"};
    return n[x->k];
}

size_t mq_tt_utf8_len(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

void mq_tt_put(mq_tt_ctx *c, mq_tt_buf *b, const char *s, size_t n) {
    if (b->cap - b->n < n + 1) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->n < n + 1) cap *= 2;
        char *p = mq_tt_alloc(c, cap);
        if (b->n) memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void mq_tt_puts(mq_tt_ctx *c, mq_tt_buf *b, const char *s) { mq_tt_put(c, b, s, strlen(s)); }

/* Python's float repr: the shortest digits that read back the same, in exponent form when the
 * exponent is < -4 or >= 16, and ".0" on integral values. */
static void put_float(mq_tt_ctx *c, mq_tt_buf *b, double f) {
    if (isnan(f)) return mq_tt_puts(c, b, "nan");
    if (isinf(f)) return mq_tt_puts(c, b, f < 0 ? "-inf" : "inf");
    char t[40];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(t, sizeof t, "%.*e", p - 1, f);
        if (strtod(t, NULL) == f) break;
    }
    /* t = "d.ddde+XX": digits and exponent */
    char dig[24];
    int nd = 0, neg = t[0] == '-';
    const char *q = t + neg;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') dig[nd++] = *q;
    int e = atoi(q + 1);
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    char o[64];
    int k = 0;
    if (neg) o[k++] = '-';
    if (e < -4 || e >= 16) {
        o[k++] = dig[0];
        if (nd > 1) {
            o[k++] = '.';
            for (int i = 1; i < nd; i++) o[k++] = dig[i];
        }
        k += snprintf(o + k, sizeof o - (size_t)k, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    } else if (e < 0) {
        o[k++] = '0';
        o[k++] = '.';
        for (int i = -1; i > e; i--) o[k++] = '0';
        for (int i = 0; i < nd; i++) o[k++] = dig[i];
    } else {
        for (int i = 0; i <= e; i++) o[k++] = i < nd ? dig[i] : '0';
        o[k++] = '.';
        if (nd > e + 1)
            for (int i = e + 1; i < nd; i++) o[k++] = dig[i];
        else
            o[k++] = '0';
    }
    mq_tt_put(c, b, o, (size_t)k);
}

void mq_tt_put_utf8(mq_tt_ctx *c, mq_tt_buf *b, uint32_t cp) {
    char t[4];
    size_t n;
    if (cp < 0x80) t[0] = (char)cp, n = 1;
    else if (cp < 0x800) t[0] = (char)(0xC0 | cp >> 6), t[1] = (char)(0x80 | (cp & 63)), n = 2;
    else if (cp < 0x10000)
        t[0] = (char)(0xE0 | cp >> 12), t[1] = (char)(0x80 | ((cp >> 6) & 63)), t[2] = (char)(0x80 | (cp & 63)), n = 3;
    else
        t[0] = (char)(0xF0 | cp >> 18), t[1] = (char)(0x80 | ((cp >> 12) & 63)),
        t[2] = (char)(0x80 | ((cp >> 6) & 63)), t[3] = (char)(0x80 | (cp & 63)), n = 4;
    mq_tt_put(c, b, t, n);
}

static void put_int(mq_tt_ctx *c, mq_tt_buf *b, int64_t i) {
    char t[24];
    mq_tt_put(c, b, t, (size_t)snprintf(t, sizeof t, "%lld", (long long)i));
}

/* Python's str repr: single quotes unless the text holds ' and no ". Non-printable ASCII is
 * escaped; other characters are kept (Python keeps printable non-ASCII). */
static void put_str_repr(mq_tt_ctx *c, mq_tt_buf *b, const char *s, size_t n) {
    bool sq = memchr(s, '\'', n) != NULL, dq = memchr(s, '"', n) != NULL;
    char qc = sq && !dq ? '"' : '\'';
    mq_tt_put(c, b, &qc, 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char t[8];
        if (ch == (unsigned char)qc || ch == '\\') {
            t[0] = '\\';
            t[1] = (char)ch;
            mq_tt_put(c, b, t, 2);
        } else if (ch == '\n') mq_tt_puts(c, b, "\\n");
        else if (ch == '\r') mq_tt_puts(c, b, "\\r");
        else if (ch == '\t') mq_tt_puts(c, b, "\\t");
        else if (ch < 0x20 || ch == 0x7f) mq_tt_put(c, b, t, (size_t)snprintf(t, sizeof t, "\\x%02x", ch));
        else mq_tt_put(c, b, (const char *)&s[i], 1);
    }
    mq_tt_put(c, b, &qc, 1);
}

void mq_tv_repr(mq_tt_ctx *c, mq_tt_buf *b, const tv *x) {
    switch (x->k) {
    case TV_STR: put_str_repr(c, b, x->u.s.s, x->u.s.n); return;
    case TV_LIST:
        mq_tt_puts(c, b, "[");
        for (size_t i = 0; i < x->u.l.n; i++) {
            if (i) mq_tt_puts(c, b, ", ");
            mq_tv_repr(c, b, x->u.l.v[i]);
        }
        mq_tt_puts(c, b, "]");
        return;
    case TV_DICT:
        mq_tt_puts(c, b, "{");
        for (size_t i = 0; i < x->u.d.n; i++) {
            if (i) mq_tt_puts(c, b, ", ");
            mq_tv_repr(c, b, x->u.d.key[i]);
            mq_tt_puts(c, b, ": ");
            mq_tv_repr(c, b, x->u.d.val[i]);
        }
        mq_tt_puts(c, b, "}");
        return;
    default: mq_tv_to_str(c, b, x);
    }
}

void mq_tv_to_str(mq_tt_ctx *c, mq_tt_buf *b, const tv *x) {
    switch (x->k) {
    case TV_UNDEF: return;
    case TV_NONE: mq_tt_puts(c, b, "None"); return;
    case TV_BOOL: mq_tt_puts(c, b, x->u.b ? "True" : "False"); return;
    case TV_INT: put_int(c, b, x->u.i); return;
    case TV_FLOAT: put_float(c, b, x->u.f); return;
    case TV_STR: mq_tt_put(c, b, x->u.s.s, x->u.s.n); return;
    case TV_NS: mq_tt_puts(c, b, "<Namespace>"); return;
    case TV_FUNC: mq_tt_puts(c, b, "<function>"); return;
    default: mq_tv_repr(c, b, x);
    }
}

char mq_tt_unescape(char e) {
    switch (e) {
    case '"': return '"';
    case '\\': return '\\';
    case 'b': return '\b';
    case 'f': return '\f';
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    default: return 0;
    }
}

static void json_str(mq_tt_ctx *c, mq_tt_buf *b, const char *s, size_t n) {
    mq_tt_puts(c, b, "\"");
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        char t[8];
        const char *e = mq_json_escape((unsigned char)s[i], t);
        if (e) {
            mq_tt_put(c, b, s + run, i - run);
            mq_tt_puts(c, b, e);
            run = i + 1;
        }
    }
    mq_tt_put(c, b, s + run, n - run);
    mq_tt_puts(c, b, "\"");
}

static void json_nl(mq_tt_ctx *c, mq_tt_buf *b, int indent, int depth) {
    mq_tt_puts(c, b, "\n");
    for (int i = 0; i < indent * depth; i++) mq_tt_puts(c, b, " ");
}

static void to_json(mq_tt_ctx *c, int line, mq_tt_buf *b, const tv *x, int indent, bool sort, int depth) {
    if (depth > 100) mq_tt_fail(c, MOEQ_E_ARG, line, "tojson: nesting deeper than 100");
    switch (x->k) {
    case TV_NONE: mq_tt_puts(c, b, "null"); return;
    case TV_BOOL: mq_tt_puts(c, b, x->u.b ? "true" : "false"); return;
    case TV_INT: put_int(c, b, x->u.i); return;
    case TV_FLOAT:
        if (isnan(x->u.f)) mq_tt_puts(c, b, "NaN");
        else if (isinf(x->u.f)) mq_tt_puts(c, b, x->u.f < 0 ? "-Infinity" : "Infinity");
        else put_float(c, b, x->u.f);
        return;
    case TV_STR: json_str(c, b, x->u.s.s, x->u.s.n); return;
    case TV_LIST:
        if (!x->u.l.n) return mq_tt_puts(c, b, "[]");
        mq_tt_puts(c, b, "[");
        for (size_t i = 0; i < x->u.l.n; i++) {
            if (i) mq_tt_puts(c, b, indent >= 0 ? "," : ", ");
            if (indent >= 0) json_nl(c, b, indent, depth + 1);
            to_json(c, line, b, x->u.l.v[i], indent, sort, depth + 1);
        }
        if (indent >= 0) json_nl(c, b, indent, depth);
        mq_tt_puts(c, b, "]");
        return;
    case TV_DICT: {
        if (!x->u.d.n) return mq_tt_puts(c, b, "{}");
        size_t n = x->u.d.n, *ord = mq_tt_alloc(c, sizeof(size_t) * n);
        for (size_t i = 0; i < n; i++) ord[i] = i;
        if (sort)   /* insertion sort: dicts in templates are small */
            for (size_t i = 1; i < n; i++)
                for (size_t j = i; j > 0 && mq_tv_cmp(c, line, x->u.d.key[ord[j - 1]], x->u.d.key[ord[j]]) > 0; j--) {
                    size_t t = ord[j];
                    ord[j] = ord[j - 1];
                    ord[j - 1] = t;
                }
        mq_tt_puts(c, b, "{");
        for (size_t k = 0; k < n; k++) {
            size_t i = ord[k];
            if (k) mq_tt_puts(c, b, indent >= 0 ? "," : ", ");
            if (indent >= 0) json_nl(c, b, indent, depth + 1);
            const tv *key = x->u.d.key[i];
            if (key->k == TV_STR) json_str(c, b, key->u.s.s, key->u.s.n);
            else {   /* json.dumps turns int, float, bool and None keys into strings */
                mq_tt_buf kb = {0};
                to_json(c, line, &kb, key, -1, false, depth + 1);
                json_str(c, b, kb.p, kb.n);
            }
            mq_tt_puts(c, b, ": ");
            to_json(c, line, b, x->u.d.val[i], indent, sort, depth + 1);
        }
        if (indent >= 0) json_nl(c, b, indent, depth);
        mq_tt_puts(c, b, "}");
        return;
    }
    default:
        mq_tt_fail(c, MOEQ_E_ARG, line, "tojson: Object of type %s is not JSON serializable",
                mq_tv_type_name(x));
    }
}

void mq_tv_to_json(mq_tt_ctx *c, int line, mq_tt_buf *b, const tv *x, int indent, bool sort_keys) {
    to_json(c, line, b, x, indent, sort_keys, 0);
}

/* ---- JSON reader ------------------------------------------------------------------------ */
typedef struct {
    mq_tt_ctx *c;
    const char *what, *s;
    size_t n, i;
    int depth;
} jr;

_Noreturn static void jr_fail(jr *r, const char *m) {
    mq_tt_fail(r->c, MOEQ_E_FORMAT, 0, "%s: %s at byte offset %zu", r->what, m, r->i);
}

static void jr_ws(jr *r) {
    while (r->i < r->n && (r->s[r->i] == ' ' || r->s[r->i] == '\t' || r->s[r->i] == '\n' || r->s[r->i] == '\r'))
        r->i++;
}


static uint32_t jr_hex4(jr *r) {
    if (r->n - r->i < 4) jr_fail(r, "short \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        char h = r->s[r->i++];
        v <<= 4;
        if (h >= '0' && h <= '9') v |= (uint32_t)(h - '0');
        else if (h >= 'a' && h <= 'f') v |= (uint32_t)(h - 'a' + 10);
        else if (h >= 'A' && h <= 'F') v |= (uint32_t)(h - 'A' + 10);
        else jr_fail(r, "bad \\u escape");
    }
    return v;
}

static tv *jr_string(jr *r) {
    mq_tt_buf b = {0};
    r->i++;   /* the quote */
    size_t run = r->i;
    for (;;) {
        if (r->i >= r->n) jr_fail(r, "unterminated string");
        unsigned char ch = (unsigned char)r->s[r->i];
        if (ch == '"') break;
        if (ch < 0x20) jr_fail(r, "control character in a string");
        if (ch != '\\') {
            r->i++;
            continue;
        }
        mq_tt_put(r->c, &b, r->s + run, r->i - run);
        r->i++;
        if (r->i >= r->n) jr_fail(r, "unterminated string");
        char e = r->s[r->i++], byte = e == '/' ? '/' : mq_tt_unescape(e);
        if (byte) {
            mq_tt_put(r->c, &b, &byte, 1);
            run = r->i;
            continue;
        }
        switch (e) {
        case 'u': {
            uint32_t cp = jr_hex4(r);
            if (cp >= 0xD800 && cp < 0xDC00 && r->n - r->i >= 6 && r->s[r->i] == '\\' && r->s[r->i + 1] == 'u') {
                size_t save = r->i;
                r->i += 2;
                uint32_t lo = jr_hex4(r);
                if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                else r->i = save;
            }
            if (cp >= 0xD800 && cp < 0xE000) jr_fail(r, "lone surrogate in a \\u escape");
            mq_tt_put_utf8(r->c, &b, cp);
            break;
        }
        default: jr_fail(r, "bad escape");
        }
        run = r->i;
    }
    mq_tt_put(r->c, &b, r->s + run, r->i - run);
    r->i++;
    if (moeq_utf8_valid_prefix(b.p ? b.p : "", b.n) != b.n) jr_fail(r, "string is not valid UTF-8");
    return mq_tv_str_ref(r->c, b.p ? b.p : "", b.n);
}

/* Whether the next byte is ch, taken when it is. */
static bool jr_eat(jr *r, char ch) {
    if (r->i >= r->n || r->s[r->i] != ch) return false;
    r->i++;
    return true;
}

/* After an object's or an array's item: true at ',' (another follows), false at its close. */
static bool jr_more(jr *r, char close) {
    jr_ws(r);
    if (jr_eat(r, ',')) return true;
    if (jr_eat(r, close)) return false;
    jr_fail(r, close == '}' ? "expected ',' or '}'" : "expected ',' or ']'");
}

static tv *jr_value(jr *r) {
    jr_ws(r);
    if (r->i >= r->n) jr_fail(r, "unexpected end");
    if (++r->depth > 200) jr_fail(r, "nesting deeper than 200");
    char ch = r->s[r->i];
    tv *x;
    if (ch == '{') {
        x = mq_tv_dict(r->c, TV_DICT);
        r->i++;
        jr_ws(r);
        if (!jr_eat(r, '}')) {
            do {
                jr_ws(r);
                if (r->i >= r->n || r->s[r->i] != '"') jr_fail(r, "expected a key");
                tv *k = jr_string(r);
                jr_ws(r);
                if (!jr_eat(r, ':')) jr_fail(r, "expected ':'");
                mq_tv_dict_set(r->c, x, k, jr_value(r));
            } while (jr_more(r, '}'));
        }
    } else if (ch == '[') {
        x = mq_tv_list(r->c, 4);
        r->i++;
        jr_ws(r);
        if (!jr_eat(r, ']')) {
            do mq_tv_list_push(r->c, x, jr_value(r));
            while (jr_more(r, ']'));
        }
    } else if (ch == '"') {
        x = jr_string(r);
    } else if (r->n - r->i >= 4 && !memcmp(r->s + r->i, "true", 4)) {
        r->i += 4;
        x = &mq_tt_true;
    } else if (r->n - r->i >= 5 && !memcmp(r->s + r->i, "false", 5)) {
        r->i += 5;
        x = &mq_tt_false;
    } else if (r->n - r->i >= 4 && !memcmp(r->s + r->i, "null", 4)) {
        r->i += 4;
        x = &mq_tt_none;
    } else if (ch == '-' || (ch >= '0' && ch <= '9')) {
        size_t st = r->i;
        bool isf = false;
        if (r->s[r->i] == '-') r->i++;
        while (r->i < r->n && ((r->s[r->i] >= '0' && r->s[r->i] <= '9') || r->s[r->i] == '.' ||
                               r->s[r->i] == 'e' || r->s[r->i] == 'E' || r->s[r->i] == '+' || r->s[r->i] == '-')) {
            if (r->s[r->i] == '.' || r->s[r->i] == 'e' || r->s[r->i] == 'E') isf = true;
            r->i++;
        }
        char t[64];
        size_t len = r->i - st;
        if (len == 0 || len >= sizeof t) jr_fail(r, "bad number");
        memcpy(t, r->s + st, len);
        t[len] = 0;
        char *end;
        errno = 0;
        if (!isf) {
            long long v = strtoll(t, &end, 10);
            if (*end || errno) isf = true;   /* past int64: read as a float */
            else x = mq_tv_int(r->c, v);
        }
        if (isf) {
            double d = strtod(t, &end);
            if (*end) jr_fail(r, "bad number");
            x = mq_tv_float(r->c, d);
        }
    } else {
        jr_fail(r, "unexpected character");
    }
    r->depth--;
    return x;
}

tv *mq_tv_from_json(mq_tt_ctx *c, const char *what, const char *s, size_t n) {
    jr r = {c, what, s, n, 0, 0};
    tv *x = jr_value(&r);
    jr_ws(&r);
    if (r.i != n) jr_fail(&r, "trailing characters");
    return x;
}
