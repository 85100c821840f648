/*
 * The chat-template evaluator's expressions (its statements: template_exec.c), with Jinja2's
 * semantics as transformers runs them (a sandbox that allows no mutation but namespace
 * attributes). Scopes: every for-loop iteration is a fresh scope over the enclosing one (what
 * `set` does inside stays there, as in Jinja2); if-blocks share their scope. Values follow Python: ints and floats,
 * str indexes and lengths in code points, str(None) == "None", a missing key or attribute is
 * Undefined (empty when printed, false when tested, an error when used further). Filters, tests,
 * methods and globals are the ones real chat templates use; any other is MOEQ_E_UNSUPPORTED
 * naming it and the line.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "runtime/template.h"

typedef mq_tt_frame frame;
typedef mq_tt_ev ev;

_Noreturn void mq_tt_ev_fail(ev *E, int line, const char *fmt, ...) {
    char m[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    mq_tt_fail(E->c, MOEQ_E_ARG, line, "%s", m);
}

tv *mq_tt_lookup(frame *f, const char *name) {
    for (; f; f = f->up) {
        tv *v = mq_tv_dict_gets(f->vars, name);
        if (v) return v;
    }
    return NULL;
}

static tv *S(ev *E, const char *s) { return mq_tv_str_ref(E->c, s, strlen(s)); }

static const char *str_of(ev *E, const tv *x, size_t *n) {
    if (x->k == TV_STR) {
        *n = x->u.s.n;
        return x->u.s.s;
    }
    mq_tt_buf b = {0};
    mq_tv_to_str(E->c, &b, x);
    *n = b.n;
    return b.p ? b.p : "";
}

static tv *need_str(ev *E, int line, const tv *x, const char *what) {
    if (x->k != TV_STR) mq_tt_ev_fail(E, line, "%s: expected a string, got %s", what, mq_tv_type_name(x));
    return (tv *)x;
}

/* ---- UTF-8 and Python's whitespace ------------------------------------------------------- */
static uint32_t dec(const char *s, size_t n, size_t *len) {
    unsigned char c0 = (unsigned char)s[0];
    int k = c0 < 0x80 ? 1 : c0 < 0xE0 ? 2 : c0 < 0xF0 ? 3 : 4;
    if ((size_t)k > n) k = 1;
    *len = (size_t)k;
    if (k == 1) return c0;
    uint32_t v = c0 & (0x3F >> (k - 1));
    for (int i = 1; i < k; i++) v = v << 6 | ((unsigned char)s[i] & 0x3F);
    return v;
}
/* start of the code point that ends at s[n) */
static size_t prev_cp(const char *s, size_t n) {
    size_t i = n - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    return i;
}
static bool py_space(uint32_t c) {
    return c == ' ' || (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}
static bool is_space_ascii(char c) { return c == ' ' || (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x1f); }
static bool in_chars(uint32_t c, const tv *chars) {
    if (!chars) return py_space(c);
    size_t l;
    for (size_t i = 0; i < chars->u.s.n; i += l)
        if (dec(chars->u.s.s + i, chars->u.s.n - i, &l) == c) return true;
    return false;
}
static tv *strip(ev *E, const tv *s, const tv *chars, bool left, bool right) {
    size_t a = 0, b = s->u.s.n, l;
    while (left && a < b && in_chars(dec(s->u.s.s + a, b - a, &l), chars)) a += l;
    while (right && b > a) {
        size_t p = prev_cp(s->u.s.s, b);
        if (!in_chars(dec(s->u.s.s + p, b - p, &l), chars)) break;
        b = p;
    }
    return mq_tv_str_ref(E->c, s->u.s.s + a, b - a);
}

/* code point offsets of s: offs[0..n], n = its length */
static size_t *cp_offsets(ev *E, const tv *s, size_t *n) {
    size_t k = mq_tt_utf8_len(s->u.s.s, s->u.s.n), *o = mq_tt_alloc(E->c, sizeof(size_t) * (k + 1)), j = 0;
    for (size_t i = 0; i < s->u.s.n; i++)
        if (((unsigned char)s->u.s.s[i] & 0xC0) != 0x80) o[j++] = i;
    o[k] = s->u.s.n;
    *n = k;
    return o;
}

tv *mq_tt_as_list(ev *E, int line, const tv *x, const char *what) {
    if (x->k == TV_LIST) return (tv *)x;
    tv *l = mq_tv_list(E->c, 8);
    if (x->k == TV_UNDEF) return l;
    if (x->k == TV_DICT) {
        for (size_t i = 0; i < x->u.d.n; i++) mq_tv_list_push(E->c, l, x->u.d.key[i]);
        return l;
    }
    if (x->k == TV_STR) {
        size_t n, *o = cp_offsets(E, x, &n);
        for (size_t i = 0; i < n; i++) mq_tv_list_push(E->c, l, mq_tv_str_ref(E->c, x->u.s.s + o[i], o[i + 1] - o[i]));
        return l;
    }
    mq_tt_ev_fail(E, line, "%s: '%s' object is not iterable", what, mq_tv_type_name(x));
}

static int64_t need_int(ev *E, int line, const tv *x, const char *what) {
    if (x->k == TV_INT) return x->u.i;
    if (x->k == TV_BOOL) return x->u.b;
    mq_tt_ev_fail(E, line, "%s: expected an integer, got %s", what, mq_tv_type_name(x));
}

/* ---- attribute and item access ----------------------------------------------------------- */
static const char *str_methods = "startswith|endswith|strip|lstrip|rstrip|split|rsplit|upper|lower|title|"
                                 "capitalize|replace|find|rfind|count|join|splitlines|isdigit|isalpha|"
                                 "isspace|isupper|islower|removeprefix|removesuffix|index|format";
static const char *dict_methods = "get|items|keys|values";

static bool in_set(const char *list, const char *s) {
    size_t n = strlen(s);
    while (*list) {
        const char *bar = strchr(list, '|');
        size_t m = bar ? (size_t)(bar - list) : strlen(list);
        if (m == n && !memcmp(list, s, n)) return true;
        if (!bar) break;
        list = bar + 1;
    }
    return false;
}

static tv *method(ev *E, const tv *self, const char *name) {
    tv *x = mq_tt_alloc(E->c, sizeof *x);
    x->k = TV_FUNC;
    x->u.fn.id = MQ_TT_F_METHOD;
    x->u.fn.self = self;
    x->u.fn.name = name;
    return x;
}

static tv *getattr_(ev *E, int line, const tv *o, const char *name) {
    switch (o->k) {
    case TV_UNDEF: mq_tt_ev_fail(E, line, "undefined value has no attribute '%s'", name);
    case TV_DICT:
        if (in_set(dict_methods, name)) return method(E, o, name);
        /* fall through */
    case TV_NS: {
        tv *v = mq_tv_dict_gets(o, name);
        return v ? v : &mq_tt_undef;
    }
    case TV_STR: return in_set(str_methods, name) ? method(E, o, name) : &mq_tt_undef;
    default: return &mq_tt_undef;
    }
}

static tv *getitem(ev *E, int line, const tv *o, const tv *k) {
    switch (o->k) {
    case TV_UNDEF: mq_tt_ev_fail(E, line, "undefined value has no item");
    case TV_DICT: {
        tv *v = mq_tv_dict_get(o, k);
        if (v) return v;
        return k->k == TV_STR ? getattr_(E, line, o, mq_tt_strdup(E->c, k->u.s.s, k->u.s.n)) : &mq_tt_undef;
    }
    case TV_LIST: {
        if (k->k != TV_INT && k->k != TV_BOOL) return &mq_tt_undef;
        int64_t i = need_int(E, line, k, "index"), n = (int64_t)o->u.l.n;
        if (i < 0) i += n;
        return i >= 0 && i < n ? o->u.l.v[i] : &mq_tt_undef;
    }
    case TV_STR: {
        if (k->k != TV_INT && k->k != TV_BOOL) return &mq_tt_undef;
        size_t n, *off = cp_offsets(E, o, &n);
        int64_t i = need_int(E, line, k, "index");
        if (i < 0) i += (int64_t)n;
        if (i < 0 || i >= (int64_t)n) return &mq_tt_undef;
        return mq_tv_str_ref(E->c, o->u.s.s + off[i], off[i + 1] - off[i]);
    }
    case TV_NS:
        if (k->k == TV_STR) {
            tv *v = mq_tv_dict_get(o, k);
            return v ? v : &mq_tt_undef;
        }
        return &mq_tt_undef;
    default: return &mq_tt_undef;
    }
}

/* Python's slice indices for a sequence of n */
static void slice_idx(ev *E, int line, const tv *a, const tv *b, const tv *s, int64_t n, int64_t *start,
                      int64_t *stop, int64_t *step) {
    *step = s && s->k != TV_NONE ? need_int(E, line, s, "slice step") : 1;
    if (*step == 0) mq_tt_ev_fail(E, line, "slice step cannot be zero");
    int64_t lo = *step < 0 ? -1 : 0, hi = *step < 0 ? n - 1 : n;
    if (a && a->k != TV_NONE) {
        *start = need_int(E, line, a, "slice start");
        if (*start < 0) *start = *start + n < lo ? lo : *start + n;
        else if (*start > hi) *start = hi;
    } else
        *start = *step < 0 ? hi : lo;
    if (b && b->k != TV_NONE) {
        *stop = need_int(E, line, b, "slice stop");
        if (*stop < 0) *stop = *stop + n < lo ? lo : *stop + n;
        else if (*stop > hi) *stop = hi;
    } else
        *stop = *step < 0 ? lo : hi;
}

static tv *slice(ev *E, int line, const tv *o, const tv *a, const tv *b, const tv *s) {
    int64_t st, sp, step;
    if (o->k == TV_LIST) {
        slice_idx(E, line, a, b, s, (int64_t)o->u.l.n, &st, &sp, &step);
        tv *l = mq_tv_list(E->c, 8);
        for (int64_t i = st; step > 0 ? i < sp : i > sp; i += step) mq_tv_list_push(E->c, l, o->u.l.v[i]);
        return l;
    }
    if (o->k == TV_STR) {
        size_t n, *off = cp_offsets(E, o, &n);
        slice_idx(E, line, a, b, s, (int64_t)n, &st, &sp, &step);
        mq_tt_buf buf = {0};
        for (int64_t i = st; step > 0 ? i < sp : i > sp; i += step)
            mq_tt_put(E->c, &buf, o->u.s.s + off[i], off[i + 1] - off[i]);
        return mq_tv_str_ref(E->c, buf.p ? buf.p : "", buf.n);
    }
    mq_tt_ev_fail(E, line, "cannot slice %s", mq_tv_type_name(o));
}

/* ---- arithmetic ---------------------------------------------------------------------------- */
static bool isnum(const tv *x) { return x->k == TV_INT || x->k == TV_FLOAT || x->k == TV_BOOL; }
static double fnum(const tv *x) { return x->k == TV_FLOAT ? x->u.f : x->k == TV_INT ? (double)x->u.i : x->u.b; }

static tv *contains(ev *E, int line, const tv *item, const tv *seq) {
    switch (seq->k) {
    case TV_STR:
        if (item->k != TV_STR) mq_tt_ev_fail(E, line, "'in <string>' requires string as left operand, not %s", mq_tv_type_name(item));
        if (!item->u.s.n) return &mq_tt_true;
        for (size_t i = 0; i + item->u.s.n <= seq->u.s.n; i++)
            if (!memcmp(seq->u.s.s + i, item->u.s.s, item->u.s.n)) return &mq_tt_true;
        return &mq_tt_false;
    case TV_LIST:
        for (size_t i = 0; i < seq->u.l.n; i++)
            if (mq_tv_eq(item, seq->u.l.v[i])) return &mq_tt_true;
        return &mq_tt_false;
    case TV_DICT:
    case TV_NS: return mq_tv_bool(mq_tv_dict_get(seq, item) != NULL);
    case TV_UNDEF: return &mq_tt_false;
    default: mq_tt_ev_fail(E, line, "argument of type '%s' is not iterable", mq_tv_type_name(seq));
    }
}

static tv *binop(ev *E, int line, const char *op, tv *a, tv *b) {
    if (!strcmp(op, "==")) return mq_tv_bool(mq_tv_eq(a, b));
    if (!strcmp(op, "!=")) return mq_tv_bool(!mq_tv_eq(a, b));
    if (!strcmp(op, "in")) return contains(E, line, a, b);
    if (!strcmp(op, "not in")) return mq_tv_bool(!mq_tv_truthy(contains(E, line, a, b)));
    if (!strcmp(op, "~")) {
        mq_tt_buf buf = {0};
        mq_tv_to_str(E->c, &buf, a);
        mq_tv_to_str(E->c, &buf, b);
        return mq_tv_str_ref(E->c, buf.p ? buf.p : "", buf.n);
    }
    if (a->k == TV_UNDEF || b->k == TV_UNDEF) mq_tt_ev_fail(E, line, "undefined value in '%s'", op);
    if (op[0] == '<' || op[0] == '>') {
        int r = mq_tv_cmp(E->c, line, a, b);
        return mq_tv_bool(!strcmp(op, "<") ? r < 0 : !strcmp(op, ">") ? r > 0 : !strcmp(op, "<=") ? r <= 0 : r >= 0);
    }
    if (!strcmp(op, "+")) {
        if (a->k == TV_STR && b->k == TV_STR) {
            char *p = mq_tt_alloc(E->c, a->u.s.n + b->u.s.n + 1);
            memcpy(p, a->u.s.s, a->u.s.n);
            memcpy(p + a->u.s.n, b->u.s.s, b->u.s.n);
            return mq_tv_str_ref(E->c, p, a->u.s.n + b->u.s.n);
        }
        if (a->k == TV_LIST && b->k == TV_LIST) {
            tv *l = mq_tv_list(E->c, a->u.l.n + b->u.l.n);
            for (size_t i = 0; i < a->u.l.n; i++) mq_tv_list_push(E->c, l, a->u.l.v[i]);
            for (size_t i = 0; i < b->u.l.n; i++) mq_tv_list_push(E->c, l, b->u.l.v[i]);
            return l;
        }
    }
    if (!strcmp(op, "*") && ((a->k == TV_STR && (b->k == TV_INT || b->k == TV_BOOL)) ||
                             (b->k == TV_STR && (a->k == TV_INT || a->k == TV_BOOL)))) {
        const tv *s = a->k == TV_STR ? a : b;
        int64_t k = need_int(E, line, a->k == TV_STR ? b : a, "*");
        mq_tt_buf buf = {0};
        for (int64_t i = 0; i < k; i++) mq_tt_put(E->c, &buf, s->u.s.s, s->u.s.n);
        return mq_tv_str_ref(E->c, buf.p ? buf.p : "", buf.n);
    }
    if (!isnum(a) || !isnum(b))
        mq_tt_ev_fail(E, line, "unsupported operand type(s) for %s: '%s' and '%s'", op, mq_tv_type_name(a), mq_tv_type_name(b));
    bool ints = a->k != TV_FLOAT && b->k != TV_FLOAT;
    if (ints) {
        int64_t x = a->k == TV_INT ? a->u.i : a->u.b, y = b->k == TV_INT ? b->u.i : b->u.b, r;
        bool ovf = false;
        if (!strcmp(op, "+")) ovf = __builtin_add_overflow(x, y, &r);
        else if (!strcmp(op, "-")) ovf = __builtin_sub_overflow(x, y, &r);
        else if (!strcmp(op, "*")) ovf = __builtin_mul_overflow(x, y, &r);
        else if (!strcmp(op, "/")) {
            if (!y) mq_tt_ev_fail(E, line, "division by zero");
            return mq_tv_float(E->c, (double)x / (double)y);
        } else if (!strcmp(op, "//") || !strcmp(op, "%")) {
            if (!y) mq_tt_ev_fail(E, line, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) mq_tt_ev_fail(E, line, "integer overflow");
            int64_t q = x / y, m = x % y;
            if (m && ((m < 0) != (y < 0))) q--, m += y;
            r = op[0] == '%' ? m : q;
        } else {   /* ** */
            if (y < 0) return mq_tv_float(E->c, pow((double)x, (double)y));
            r = 1;
            for (int64_t i = 0; i < y && !ovf; i++) ovf = __builtin_mul_overflow(r, x, &r);
        }
        if (ovf) mq_tt_ev_fail(E, line, "integer overflow in '%s'", op);
        return mq_tv_int(E->c, r);
    }
    double x = fnum(a), y = fnum(b);
    if (!strcmp(op, "+")) return mq_tv_float(E->c, x + y);
    if (!strcmp(op, "-")) return mq_tv_float(E->c, x - y);
    if (!strcmp(op, "*")) return mq_tv_float(E->c, x * y);
    if (!strcmp(op, "**")) return mq_tv_float(E->c, pow(x, y));
    if (y == 0) mq_tt_ev_fail(E, line, "float division by zero");
    if (!strcmp(op, "/")) return mq_tv_float(E->c, x / y);
    double m = fmod(x, y);
    if (m != 0 && ((m < 0) != (y < 0))) m += y;
    if (op[0] == '%') return mq_tv_float(E->c, m);
    return mq_tv_float(E->c, floor((x - m) / y + 0.5) == (x - m) / y ? (x - m) / y : floor(x / y));
}

/* ---- calls --------------------------------------------------------------------------------- */
typedef struct {
    tv **a;
    int n;
    const char **kn;
    tv **kv;
    int nk;
} args_t;

static args_t eval_args(ev *E, frame *f, const mq_tt_expr *e) {
    args_t r = {mq_tt_alloc(E->c, sizeof(tv *) * (size_t)(e->nargs + 1)), e->nargs, e->kwn,
                mq_tt_alloc(E->c, sizeof(tv *) * (size_t)(e->nkw + 1)), e->nkw};
    for (int i = 0; i < e->nargs; i++) r.a[i] = mq_tt_eval(E, f, e->args[i]);
    for (int i = 0; i < e->nkw; i++) r.kv[i] = mq_tt_eval(E, f, e->kwv[i]);
    return r;
}

/* argument i by position, else by keyword name, else NULL */
static tv *arg(const args_t *a, int i, const char *name) {
    if (i >= 0 && i < a->n) return a->a[i];
    for (int k = 0; k < a->nk; k++)
        if (name && !strcmp(a->kn[k], name)) return a->kv[k];
    return NULL;
}

static void check_args(ev *E, int line, const args_t *a, int max_pos, const char *kws, const char *what) {
    if (a->n > max_pos) mq_tt_ev_fail(E, line, "%s takes at most %d positional arguments (%d given)", what, max_pos, a->n);
    for (int k = 0; k < a->nk; k++)
        if (!kws || !in_set(kws, a->kn[k]))
            mq_tt_fail(E->c, MOEQ_E_UNSUPPORTED, line, "%s: keyword argument '%s' is not supported", what, a->kn[k]);
}

static tv *split_str(ev *E, int line, const tv *s, const tv *sep, int64_t maxsplit, bool right) {
    tv *l = mq_tv_list(E->c, 8);
    const char *p = s->u.s.s;
    size_t n = s->u.s.n;
    if (sep && sep->k != TV_NONE) {
        need_str(E, line, sep, "split");
        size_t m = sep->u.s.n;
        if (!m) mq_tt_ev_fail(E, line, "split: empty separator");
        if (!right) {
            size_t st = 0;
            for (size_t i = 0; i + m <= n;) {
                if ((maxsplit < 0 || (int64_t)l->u.l.n < maxsplit) && !memcmp(p + i, sep->u.s.s, m)) {
                    mq_tv_list_push(E->c, l, mq_tv_str_ref(E->c, p + st, i - st));
                    i += m;
                    st = i;
                } else
                    i++;
            }
            mq_tv_list_push(E->c, l, mq_tv_str_ref(E->c, p + st, n - st));
        } else {
            tv *rev = mq_tv_list(E->c, 8);
            size_t en = n;
            for (size_t i = n; i >= m;) {
                if ((maxsplit < 0 || (int64_t)rev->u.l.n < maxsplit) && !memcmp(p + i - m, sep->u.s.s, m)) {
                    mq_tv_list_push(E->c, rev, mq_tv_str_ref(E->c, p + i, en - i));
                    i -= m;
                    en = i;
                } else
                    i--;
            }
            mq_tv_list_push(E->c, rev, mq_tv_str_ref(E->c, p, en));
            for (size_t i = rev->u.l.n; i-- > 0;) mq_tv_list_push(E->c, l, rev->u.l.v[i]);
        }
        return l;
    }
    if (right && maxsplit >= 0) mq_tt_fail(E->c, MOEQ_E_UNSUPPORTED, line, "rsplit() on whitespace with maxsplit");
    size_t i = 0, cl;
    while (i < n) {
        while (i < n && py_space(dec(p + i, n - i, &cl))) i += cl;
        if (i >= n) break;
        size_t st = i;
        if (maxsplit >= 0 && (int64_t)l->u.l.n == maxsplit) {   /* the rest, right-stripped */
            size_t e = n;
            while (e > st) {
                size_t q = prev_cp(p, e);
                if (!py_space(dec(p + q, e - q, &cl))) break;
                e = q;
            }
            mq_tv_list_push(E->c, l, mq_tv_str_ref(E->c, p + st, e - st));
            break;
        }
        while (i < n && !py_space(dec(p + i, n - i, &cl))) i += cl;
        mq_tv_list_push(E->c, l, mq_tv_str_ref(E->c, p + st, i - st));
    }
    return l;
}

static tv *case_map(ev *E, const tv *s, int mode) {   /* 0 lower, 1 upper, 2 title, 3 capitalize (ASCII letters) */
    char *p = mq_tt_strdup(E->c, s->u.s.s, s->u.s.n);
    bool start = true;
    for (size_t i = 0; i < s->u.s.n; i++) {
        char ch = p[i];
        bool alpha = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
        bool up = mode == 1 || ((mode == 2 || mode == 3) && start && alpha);
        if (mode == 3 && i > 0) up = false;
        if (mode == 3 && i == 0) up = true;
        if (up && ch >= 'a' && ch <= 'z') p[i] = (char)(ch - 32);
        else if (!up && ch >= 'A' && ch <= 'Z') p[i] = (char)(ch + 32);
        start = mode == 2 ? !alpha && !((unsigned char)ch & 0x80) : false;
    }
    return mq_tv_str_ref(E->c, p, s->u.s.n);
}

static tv *replace_str(ev *E, int line, const tv *s, const tv *old, const tv *nw, int64_t count) {
    need_str(E, line, old, "replace");
    need_str(E, line, nw, "replace");
    mq_tt_buf b = {0};
    size_t m = old->u.s.n, i = 0;
    int64_t done = 0;
    if (!m) mq_tt_ev_fail(E, line, "replace of an empty string is not supported");
    while (i < s->u.s.n) {
        if ((count < 0 || done < count) && i + m <= s->u.s.n && !memcmp(s->u.s.s + i, old->u.s.s, m)) {
            mq_tt_put(E->c, &b, nw->u.s.s, nw->u.s.n);
            i += m;
            done++;
        } else
            mq_tt_put(E->c, &b, s->u.s.s + i++, 1);
    }
    return mq_tv_str_ref(E->c, b.p ? b.p : "", b.n);
}

static bool affix(const tv *s, const tv *a, bool end) {
    if (a->k != TV_STR || a->u.s.n > s->u.s.n) return false;
    return !memcmp(s->u.s.s + (end ? s->u.s.n - a->u.s.n : 0), a->u.s.s, a->u.s.n);
}

static int64_t find_str(const tv *s, const tv *sub, bool last) {
    int64_t r = -1;
    for (size_t i = 0; i + sub->u.s.n <= s->u.s.n; i++)
        if (!memcmp(s->u.s.s + i, sub->u.s.s, sub->u.s.n)) {
            r = (int64_t)mq_tt_utf8_len(s->u.s.s, i);
            if (!last) break;
        }
    return r;
}

static tv *call_method(ev *E, int line, const tv *self, const char *m, args_t *a) {
    if (self->k == TV_DICT) {
        if (!strcmp(m, "get")) {
            check_args(E, line, a, 2, NULL, "get");
            if (a->n < 1) mq_tt_ev_fail(E, line, "get() takes a key");
            tv *v = mq_tv_dict_get(self, a->a[0]);
            return v ? v : a->n > 1 ? a->a[1] : &mq_tt_none;
        }
        check_args(E, line, a, 0, NULL, m);
        tv *l = mq_tv_list(E->c, self->u.d.n + 1);
        for (size_t i = 0; i < self->u.d.n; i++) {
            if (!strcmp(m, "keys")) mq_tv_list_push(E->c, l, self->u.d.key[i]);
            else if (!strcmp(m, "values")) mq_tv_list_push(E->c, l, self->u.d.val[i]);
            else {
                tv *p = mq_tv_list(E->c, 2);
                mq_tv_list_push(E->c, p, self->u.d.key[i]);
                mq_tv_list_push(E->c, p, self->u.d.val[i]);
                mq_tv_list_push(E->c, l, p);
            }
        }
        return l;
    }
    /* str methods */
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        check_args(E, line, a, 1, NULL, m);
        if (a->n < 1) mq_tt_ev_fail(E, line, "%s() takes an argument", m);
        bool end = m[0] == 'e';
        if (a->a[0]->k == TV_LIST) {
            for (size_t i = 0; i < a->a[0]->u.l.n; i++)
                if (affix(self, need_str(E, line, a->a[0]->u.l.v[i], m), end)) return &mq_tt_true;
            return &mq_tt_false;
        }
        return mq_tv_bool(affix(self, need_str(E, line, a->a[0], m), end));
    }
    if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
        check_args(E, line, a, 1, NULL, m);
        tv *ch = a->n ? a->a[0] : NULL;
        if (ch && ch->k == TV_NONE) ch = NULL;
        if (ch) need_str(E, line, ch, m);
        return strip(E, self, ch, m[0] != 'r', m[0] != 'l');
    }
    if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
        check_args(E, line, a, 2, "sep|maxsplit", m);
        tv *ms = arg(a, 1, "maxsplit");
        return split_str(E, line, self, arg(a, 0, "sep"), ms ? need_int(E, line, ms, "maxsplit") : -1, m[0] == 'r');
    }
    if (!strcmp(m, "upper") || !strcmp(m, "lower") || !strcmp(m, "title") || !strcmp(m, "capitalize")) {
        check_args(E, line, a, 0, NULL, m);
        return case_map(E, self, m[0] == 'l' ? 0 : m[0] == 'u' ? 1 : m[0] == 't' ? 2 : 3);
    }
    if (!strcmp(m, "replace")) {
        check_args(E, line, a, 3, NULL, m);
        if (a->n < 2) mq_tt_ev_fail(E, line, "replace() takes two arguments");
        return replace_str(E, line, self, a->a[0], a->a[1], a->n > 2 ? need_int(E, line, a->a[2], "count") : -1);
    }
    if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index")) {
        check_args(E, line, a, 1, NULL, m);
        if (a->n < 1) mq_tt_ev_fail(E, line, "%s() takes an argument", m);
        int64_t r = find_str(self, need_str(E, line, a->a[0], m), m[0] == 'r');
        if (r < 0 && m[0] == 'i') mq_tt_ev_fail(E, line, "substring not found");
        return mq_tv_int(E->c, r);
    }
    if (!strcmp(m, "count")) {
        check_args(E, line, a, 1, NULL, m);
        if (a->n < 1) mq_tt_ev_fail(E, line, "count() takes an argument");
        const tv *sub = need_str(E, line, a->a[0], m);
        int64_t k = 0;
        if (!sub->u.s.n) return mq_tv_int(E->c, (int64_t)mq_tt_utf8_len(self->u.s.s, self->u.s.n) + 1);
        for (size_t i = 0; i + sub->u.s.n <= self->u.s.n;)
            if (!memcmp(self->u.s.s + i, sub->u.s.s, sub->u.s.n)) k++, i += sub->u.s.n;
            else i++;
        return mq_tv_int(E->c, k);
    }
    if (!strcmp(m, "join")) {
        check_args(E, line, a, 1, NULL, m);
        if (a->n < 1) mq_tt_ev_fail(E, line, "join() takes an argument");
        tv *l = mq_tt_as_list(E, line, a->a[0], "join");
        mq_tt_buf b = {0};
        for (size_t i = 0; i < l->u.l.n; i++) {
            if (i) mq_tt_put(E->c, &b, self->u.s.s, self->u.s.n);
            tv *x = need_str(E, line, l->u.l.v[i], "join");
            mq_tt_put(E->c, &b, x->u.s.s, x->u.s.n);
        }
        return mq_tv_str_ref(E->c, b.p ? b.p : "", b.n);
    }
    if (!strcmp(m, "splitlines")) {
        check_args(E, line, a, 0, NULL, m);
        tv *l = mq_tv_list(E->c, 8);
        size_t st = 0, i = 0, n = self->u.s.n;
        const char *p = self->u.s.s;
        while (i < n) {
            if (p[i] == '\n' || p[i] == '\r') {
                mq_tv_list_push(E->c, l, mq_tv_str_ref(E->c, p + st, i - st));
                i += p[i] == '\r' && i + 1 < n && p[i + 1] == '\n' ? 2 : 1;
                st = i;
            } else
                i++;
        }
        if (st < n) mq_tv_list_push(E->c, l, mq_tv_str_ref(E->c, p + st, n - st));
        return l;
    }
    if (!strcmp(m, "removeprefix") || !strcmp(m, "removesuffix")) {
        check_args(E, line, a, 1, NULL, m);
        if (a->n < 1) mq_tt_ev_fail(E, line, "%s() takes an argument", m);
        const tv *x = need_str(E, line, a->a[0], m);
        bool end = m[6] == 's';
        if (!affix(self, x, end)) return (tv *)self;
        return mq_tv_str_ref(E->c, self->u.s.s + (end ? 0 : x->u.s.n), self->u.s.n - x->u.s.n);
    }
    if (!strcmp(m, "isdigit") || !strcmp(m, "isalpha") || !strcmp(m, "isspace") || !strcmp(m, "isupper") ||
        !strcmp(m, "islower")) {
        check_args(E, line, a, 0, NULL, m);
        bool r = self->u.s.n > 0, cased = false;
        for (size_t i = 0; i < self->u.s.n; i++) {
            char ch = self->u.s.s[i];
            if (!strcmp(m, "isdigit")) r &= ch >= '0' && ch <= '9';
            else if (!strcmp(m, "isalpha")) r &= (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
            else if (!strcmp(m, "isspace")) r &= is_space_ascii(ch);
            else if (!strcmp(m, "isupper")) r &= !(ch >= 'a' && ch <= 'z'), cased |= ch >= 'A' && ch <= 'Z';
            else r &= !(ch >= 'A' && ch <= 'Z'), cased |= ch >= 'a' && ch <= 'z';
        }
        if (!strcmp(m, "isupper") || !strcmp(m, "islower")) r &= cased;
        return mq_tv_bool(r);
    }
    mq_tt_fail(E->c, MOEQ_E_UNSUPPORTED, line, "the string method '%s' is not supported", m);
}

static tv *call_global(ev *E, int line, const tv *fn, args_t *a) {
    switch (fn->u.fn.id) {
    case MQ_TT_F_METHOD: return call_method(E, line, fn->u.fn.self, fn->u.fn.name, a);
    case MQ_TT_F_RAISE: {
        size_t n;
        const char *m = a->n ? str_of(E, a->a[0], &n) : "";
        if (!a->n) n = 0;
        mq_tt_ev_fail(E, line, "raise_exception: %.*s", (int)n, m);
    }
    case MQ_TT_F_STRFTIME: {
        check_args(E, line, a, 1, NULL, "strftime_now");
        if (a->n < 1) mq_tt_ev_fail(E, line, "strftime_now() takes a format");
        tv *f = need_str(E, line, a->a[0], "strftime_now");
        char fmt[256], out[512];
        if (f->u.s.n >= sizeof fmt) mq_tt_ev_fail(E, line, "strftime_now: format too long");
        memcpy(fmt, f->u.s.s, f->u.s.n);
        fmt[f->u.s.n] = 0;
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        size_t n = strftime(out, sizeof out, fmt, &tmv);
        return mq_tv_str(E->c, out, n);
    }
    case MQ_TT_F_NAMESPACE:
    case MQ_TT_F_DICT: {
        tv *d = mq_tv_dict(E->c, fn->u.fn.id == MQ_TT_F_NAMESPACE ? TV_NS : TV_DICT);
        for (int i = 0; i < a->n; i++) {   /* namespace(mapping) */
            if (a->a[i]->k != TV_DICT) mq_tt_ev_fail(E, line, "namespace() takes a mapping or keywords");
            for (size_t k = 0; k < a->a[i]->u.d.n; k++) mq_tv_dict_set(E->c, d, a->a[i]->u.d.key[k], a->a[i]->u.d.val[k]);
        }
        for (int k = 0; k < a->nk; k++) mq_tv_dict_set(E->c, d, S(E, a->kn[k]), a->kv[k]);
        return d;
    }
    case MQ_TT_F_RANGE: {
        check_args(E, line, a, 3, NULL, "range");
        int64_t lo = 0, hi, st = 1;
        if (a->n == 1) hi = need_int(E, line, a->a[0], "range");
        else if (a->n >= 2) {
            lo = need_int(E, line, a->a[0], "range");
            hi = need_int(E, line, a->a[1], "range");
            if (a->n == 3) st = need_int(E, line, a->a[2], "range");
        } else
            mq_tt_ev_fail(E, line, "range() takes 1 to 3 arguments");
        if (!st) mq_tt_ev_fail(E, line, "range() arg 3 must not be zero");
        tv *l = mq_tv_list(E->c, 8);
        for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) {
            if (l->u.l.n >= 1000000) mq_tt_ev_fail(E, line, "range() of more than 1000000 items");
            mq_tv_list_push(E->c, l, mq_tv_int(E->c, i));
        }
        return l;
    }
    default: mq_tt_ev_fail(E, line, "not callable");
    }
}

/* ---- tests -------------------------------------------------------------------------------- */
static bool run_test(ev *E, int line, const char *t, const tv *x, const args_t *a) {
    const tv *y = a && a->n ? a->a[0] : NULL;
    if (!strcmp(t, "defined")) return x->k != TV_UNDEF;
    if (!strcmp(t, "undefined")) return x->k == TV_UNDEF;
    if (!strcmp(t, "none")) return x->k == TV_NONE;
    if (!strcmp(t, "string")) return x->k == TV_STR;
    if (!strcmp(t, "number")) return x->k == TV_INT || x->k == TV_FLOAT || x->k == TV_BOOL;
    if (!strcmp(t, "integer")) return x->k == TV_INT;
    if (!strcmp(t, "float")) return x->k == TV_FLOAT;
    if (!strcmp(t, "boolean")) return x->k == TV_BOOL;
    if (!strcmp(t, "true")) return x->k == TV_BOOL && x->u.b;
    if (!strcmp(t, "false")) return x->k == TV_BOOL && !x->u.b;
    if (!strcmp(t, "mapping")) return x->k == TV_DICT;
    if (!strcmp(t, "iterable")) return x->k == TV_STR || x->k == TV_LIST || x->k == TV_DICT || x->k == TV_UNDEF;
    if (!strcmp(t, "sequence")) return x->k == TV_STR || x->k == TV_LIST || x->k == TV_DICT;
    if (!strcmp(t, "callable")) return x->k == TV_FUNC;
    if (!strcmp(t, "lower") || !strcmp(t, "upper")) {
        if (x->k != TV_STR) return false;
        const tv *c = case_map(E, x, t[0] == 'l' ? 0 : 1);
        return !memcmp(c->u.s.s, x->u.s.s, x->u.s.n);
    }
    if (!strcmp(t, "odd") || !strcmp(t, "even")) {
        int64_t v = need_int(E, line, x, t);
        return (v % 2 != 0) == (t[0] == 'o');
    }
    if (!y) mq_tt_ev_fail(E, line, "test '%s' needs an argument (or is not supported)", t);
    if (!strcmp(t, "eq") || !strcmp(t, "equalto") || !strcmp(t, "==")) return mq_tv_eq(x, y);
    if (!strcmp(t, "ne") || !strcmp(t, "!=")) return !mq_tv_eq(x, y);
    if (!strcmp(t, "sameas")) return x == y || (x->k == y->k && (x->k == TV_NONE || (x->k == TV_BOOL && x->u.b == y->u.b)));
    if (!strcmp(t, "in")) return mq_tv_truthy(contains(E, line, x, y));
    if (!strcmp(t, "divisibleby")) {
        int64_t d = need_int(E, line, y, t);
        if (!d) mq_tt_ev_fail(E, line, "divisibleby 0");
        return need_int(E, line, x, t) % d == 0;
    }
    if (!strcmp(t, "lt") || !strcmp(t, "gt") || !strcmp(t, "le") || !strcmp(t, "ge")) {
        int r = mq_tv_cmp(E->c, line, x, y);
        return t[0] == 'l' ? (t[1] == 't' ? r < 0 : r <= 0) : (t[1] == 't' ? r > 0 : r >= 0);
    }
    mq_tt_fail(E->c, MOEQ_E_UNSUPPORTED, line, "the test '%s' is not supported", t);
}

/* ---- filters ------------------------------------------------------------------------------ */
static tv *filter(ev *E, int line, const char *f, tv *x, args_t *a);

static tv *attr_path(ev *E, int line, tv *x, const tv *attr) {
    need_str(E, line, attr, "attribute");
    tv *key = (tv *)attr;
    if (x->k == TV_DICT || x->k == TV_NS) {
        tv *v = mq_tv_dict_get(x, key);
        return v ? v : &mq_tt_undef;
    }
    return getitem(E, line, x, key);
}

static tv *filter(ev *E, int line, const char *f, tv *x, args_t *a) {
    args_t none = {0};
    if (!a) a = &none;
    if (!strcmp(f, "length") || !strcmp(f, "count")) {
        check_args(E, line, a, 0, NULL, f);
        switch (x->k) {
        case TV_STR: return mq_tv_int(E->c, (int64_t)mq_tt_utf8_len(x->u.s.s, x->u.s.n));
        case TV_LIST: return mq_tv_int(E->c, (int64_t)x->u.l.n);
        case TV_DICT: return mq_tv_int(E->c, (int64_t)x->u.d.n);
        case TV_UNDEF: return mq_tv_int(E->c, 0);
        default: mq_tt_ev_fail(E, line, "object of type '%s' has no len()", mq_tv_type_name(x));
        }
    }
    if (!strcmp(f, "trim")) {
        check_args(E, line, a, 1, "chars", f);
        size_t n;
        const char *s = str_of(E, x, &n);
        tv *ch = arg(a, 0, "chars");
        if (ch && ch->k == TV_NONE) ch = NULL;
        if (ch) need_str(E, line, ch, "trim");
        return strip(E, mq_tv_str_ref(E->c, s, n), ch, true, true);
    }
    if (!strcmp(f, "tojson")) {
        check_args(E, line, a, 1, "indent|sort_keys|ensure_ascii", f);
        tv *ind = arg(a, 0, "indent"), *sk = arg(a, -1, "sort_keys"), *ea = arg(a, -1, "ensure_ascii");
        if (ea && mq_tv_truthy(ea)) mq_tt_fail(E->c, MOEQ_E_UNSUPPORTED, line, "tojson(ensure_ascii=true) is not supported");
        int indent = ind && ind->k != TV_NONE ? (int)need_int(E, line, ind, "indent") : -1;
        mq_tt_buf b = {0};
        mq_tv_to_json(E->c, line, &b, x, indent, sk && mq_tv_truthy(sk));
        return mq_tv_str_ref(E->c, b.p ? b.p : "", b.n);
    }
    if (!strcmp(f, "string")) {
        check_args(E, line, a, 0, NULL, f);
        if (x->k == TV_STR) return x;
        size_t n;
        const char *s = str_of(E, x, &n);
        return mq_tv_str_ref(E->c, s, n);
    }
    if (!strcmp(f, "default") || !strcmp(f, "d")) {
        check_args(E, line, a, 2, "default_value|boolean", f);
        tv *dv = arg(a, 0, "default_value"), *bo = arg(a, 1, "boolean");
        bool use = x->k == TV_UNDEF || (bo && mq_tv_truthy(bo) && !mq_tv_truthy(x));
        return use ? (dv ? dv : S(E, "")) : x;
    }
    if (!strcmp(f, "items")) {
        check_args(E, line, a, 0, NULL, f);
        if (x->k == TV_UNDEF) return mq_tv_list(E->c, 1);
        if (x->k != TV_DICT) mq_tt_ev_fail(E, line, "items: can only get item pairs from a mapping, not %s", mq_tv_type_name(x));
        args_t z = {0};
        return call_method(E, line, x, "items", &z);
    }
    if (!strcmp(f, "list")) {
        check_args(E, line, a, 0, NULL, f);
        tv *l = mq_tt_as_list(E, line, x, "list");
        if (l != x) return l;
        tv *c = mq_tv_list(E->c, l->u.l.n + 1);
        for (size_t i = 0; i < l->u.l.n; i++) mq_tv_list_push(E->c, c, l->u.l.v[i]);
        return c;
    }
    if (!strcmp(f, "join")) {
        check_args(E, line, a, 1, "d|attribute", f);
        tv *d = arg(a, 0, "d"), *at = arg(a, -1, "attribute");
        tv *l = mq_tt_as_list(E, line, x, "join");
        mq_tt_buf b = {0};
        for (size_t i = 0; i < l->u.l.n; i++) {
            if (i && d) {
                size_t n;
                const char *s = str_of(E, d, &n);
                mq_tt_put(E->c, &b, s, n);
            }
            mq_tv_to_str(E->c, &b, at ? attr_path(E, line, l->u.l.v[i], at) : l->u.l.v[i]);
        }
        return mq_tv_str_ref(E->c, b.p ? b.p : "", b.n);
    }
    if (!strcmp(f, "first") || !strcmp(f, "last")) {
        check_args(E, line, a, 0, NULL, f);
        tv *l = mq_tt_as_list(E, line, x, f);
        if (!l->u.l.n) return &mq_tt_undef;
        return l->u.l.v[f[0] == 'f' ? 0 : l->u.l.n - 1];
    }
    if (!strcmp(f, "upper") || !strcmp(f, "lower") || !strcmp(f, "capitalize") || !strcmp(f, "title")) {
        check_args(E, line, a, 0, NULL, f);
        size_t n;
        const char *s = str_of(E, x, &n);
        int mode = f[0] == 'l' ? 0 : f[0] == 'u' ? 1 : f[0] == 't' ? 2 : 3;
        tv *r = case_map(E, mq_tv_str_ref(E->c, s, n), mode);
        if (mode == 3) {   /* Jinja's capitalize lowers the rest */
            char *p = (char *)r->u.s.s;
            for (size_t i = 1; i < r->u.s.n; i++)
                if (p[i] >= 'A' && p[i] <= 'Z') p[i] = (char)(p[i] + 32);
        }
        return r;
    }
    if (!strcmp(f, "replace")) {
        check_args(E, line, a, 3, NULL, f);
        if (a->n < 2) mq_tt_ev_fail(E, line, "replace takes two arguments");
        size_t n;
        const char *s = str_of(E, x, &n);
        return replace_str(E, line, mq_tv_str_ref(E->c, s, n), a->a[0], a->a[1], a->n > 2 ? need_int(E, line, a->a[2], "count") : -1);
    }
    if (!strcmp(f, "int")) {
        check_args(E, line, a, 1, "default", f);
        tv *dv = arg(a, 0, "default");
        if (x->k == TV_INT) return x;
        if (x->k == TV_BOOL) return mq_tv_int(E->c, x->u.b);
        if (x->k == TV_FLOAT && isfinite(x->u.f) && fabs(x->u.f) < 9.2e18) return mq_tv_int(E->c, (int64_t)x->u.f);
        if (x->k == TV_STR) {
            char buf[64], *end;
            size_t n = x->u.s.n < 63 ? x->u.s.n : 63;
            memcpy(buf, x->u.s.s, n);
            buf[n] = 0;
            long long v = strtoll(buf, &end, 10);
            if (end != buf && !*end) return mq_tv_int(E->c, v);
        }
        return dv ? dv : mq_tv_int(E->c, 0);
    }
    if (!strcmp(f, "float")) {
        check_args(E, line, a, 1, "default", f);
        if (isnum(x)) return mq_tv_float(E->c, fnum(x));
        tv *dv = arg(a, 0, "default");
        if (x->k == TV_STR) {
            char buf[64], *end;
            size_t n = x->u.s.n < 63 ? x->u.s.n : 63;
            memcpy(buf, x->u.s.s, n);
            buf[n] = 0;
            double v = strtod(buf, &end);
            if (end != buf && !*end) return mq_tv_float(E->c, v);
        }
        return dv ? dv : mq_tv_float(E->c, 0.0);
    }
    if (!strcmp(f, "abs")) {
        if (x->k == TV_INT) return mq_tv_int(E->c, x->u.i < 0 ? -x->u.i : x->u.i);
        if (x->k == TV_FLOAT) return mq_tv_float(E->c, fabs(x->u.f));
        mq_tt_ev_fail(E, line, "abs of %s", mq_tv_type_name(x));
    }
    if (!strcmp(f, "reverse")) {
        if (x->k == TV_STR) {
            args_t z = {0};
            (void)z;
            return slice(E, line, x, NULL, NULL, mq_tv_int(E->c, -1));
        }
        tv *l = mq_tt_as_list(E, line, x, f), *r = mq_tv_list(E->c, l->u.l.n + 1);
        for (size_t i = l->u.l.n; i-- > 0;) mq_tv_list_push(E->c, r, l->u.l.v[i]);
        return r;
    }
    if (!strcmp(f, "safe")) return x;
    if (!strcmp(f, "e") || !strcmp(f, "escape")) {
        size_t n;
        const char *s = str_of(E, x, &n);
        mq_tt_buf b = {0};
        for (size_t i = 0; i < n; i++) {
            const char *r = s[i] == '&' ? "&amp;" : s[i] == '<' ? "&lt;" : s[i] == '>' ? "&gt;" : s[i] == '"' ? "&#34;" : s[i] == '\'' ? "&#39;" : NULL;
            if (r) mq_tt_puts(E->c, &b, r);
            else mq_tt_put(E->c, &b, s + i, 1);
        }
        return mq_tv_str_ref(E->c, b.p ? b.p : "", b.n);
    }
    if (!strcmp(f, "unique")) {
        tv *l = mq_tt_as_list(E, line, x, f), *r = mq_tv_list(E->c, l->u.l.n + 1);
        for (size_t i = 0; i < l->u.l.n; i++)
            if (!mq_tv_truthy(contains(E, line, l->u.l.v[i], r))) mq_tv_list_push(E->c, r, l->u.l.v[i]);
        return r;
    }
    if (!strcmp(f, "map")) {
        tv *l = mq_tt_as_list(E, line, x, f), *r = mq_tv_list(E->c, l->u.l.n + 1);
        tv *at = arg(a, -1, "attribute"), *dv = arg(a, -1, "default");
        for (size_t i = 0; i < l->u.l.n; i++) {
            if (at) {
                tv *v = attr_path(E, line, l->u.l.v[i], at);
                mq_tv_list_push(E->c, r, v->k == TV_UNDEF && dv ? dv : v);
            } else {
                if (a->n < 1) mq_tt_ev_fail(E, line, "map needs a filter name or attribute=");
                tv *fn = need_str(E, line, a->a[0], "map");
                args_t rest = {a->a + 1, a->n - 1, NULL, NULL, 0};
                mq_tv_list_push(E->c, r, filter(E, line, mq_tt_strdup(E->c, fn->u.s.s, fn->u.s.n), l->u.l.v[i], &rest));
            }
        }
        return r;
    }
    if (!strcmp(f, "select") || !strcmp(f, "reject") || !strcmp(f, "selectattr") || !strcmp(f, "rejectattr")) {
        bool attr = strstr(f, "attr") != NULL, keep_true = f[0] == 's';
        tv *l = mq_tt_as_list(E, line, x, f), *r = mq_tv_list(E->c, l->u.l.n + 1);
        int k = 0;
        tv *at = attr ? (a->n > 0 ? a->a[k++] : NULL) : NULL;
        if (attr && !at) mq_tt_ev_fail(E, line, "%s needs an attribute", f);
        tv *tn = a->n > k ? need_str(E, line, a->a[k++], f) : NULL;
        args_t rest = {a->a + k, a->n - k, NULL, NULL, 0};
        for (size_t i = 0; i < l->u.l.n; i++) {
            tv *v = attr ? attr_path(E, line, l->u.l.v[i], at) : l->u.l.v[i];
            bool ok = tn ? run_test(E, line, mq_tt_strdup(E->c, tn->u.s.s, tn->u.s.n), v, &rest) : mq_tv_truthy(v);
            if (ok == keep_true) mq_tv_list_push(E->c, r, l->u.l.v[i]);
        }
        return r;
    }
    if (!strcmp(f, "sort")) {
        check_args(E, line, a, 1, "reverse|attribute|case_sensitive", f);
        tv *rv = arg(a, 0, "reverse"), *at = arg(a, -1, "attribute");
        tv *l = mq_tt_as_list(E, line, x, f), *r = mq_tv_list(E->c, l->u.l.n + 1);
        for (size_t i = 0; i < l->u.l.n; i++) mq_tv_list_push(E->c, r, l->u.l.v[i]);
        bool rev = rv && mq_tv_truthy(rv);
        for (size_t i = 1; i < r->u.l.n; i++)   /* stable insertion sort */
            for (size_t j = i; j > 0; j--) {
                tv *p = at ? attr_path(E, line, r->u.l.v[j - 1], at) : r->u.l.v[j - 1];
                tv *q = at ? attr_path(E, line, r->u.l.v[j], at) : r->u.l.v[j];
                int c = mq_tv_cmp(E->c, line, p, q);
                if (rev ? c >= 0 : c <= 0) break;
                tv *t = r->u.l.v[j];
                r->u.l.v[j] = r->u.l.v[j - 1];
                r->u.l.v[j - 1] = t;
            }
        return r;
    }
    if (!strcmp(f, "max") || !strcmp(f, "min")) {
        tv *l = mq_tt_as_list(E, line, x, f);
        if (!l->u.l.n) return &mq_tt_undef;
        tv *best = l->u.l.v[0];
        for (size_t i = 1; i < l->u.l.n; i++) {
            int c = mq_tv_cmp(E->c, line, l->u.l.v[i], best);
            if (f[1] == 'a' ? c > 0 : c < 0) best = l->u.l.v[i];
        }
        return best;
    }
    mq_tt_fail(E->c, MOEQ_E_UNSUPPORTED, line, "the filter '%s' is not supported", f);
}

/* ---- expressions --------------------------------------------------------------------------- */
tv *mq_tt_eval(ev *E, frame *f, const mq_tt_expr *e) {
    if (++E->depth > 200) mq_tt_ev_fail(E, e->line, "expressions nested deeper than 200");
    tv *r;
    switch (e->op) {
    case E_LIT: r = e->lit; break;
    case E_NAME: {
        r = mq_tt_lookup(f, e->name);
        if (!r) r = &mq_tt_undef;
        break;
    }
    case E_LIST: {
        r = mq_tv_list(E->c, (size_t)e->nargs + 1);
        for (int i = 0; i < e->nargs; i++) mq_tv_list_push(E->c, r, mq_tt_eval(E, f, e->args[i]));
        break;
    }
    case E_DICT: {
        r = mq_tv_dict(E->c, TV_DICT);
        for (int i = 0; i < e->nargs; i++) mq_tv_dict_set(E->c, r, mq_tt_eval(E, f, e->args[i]), mq_tt_eval(E, f, e->vals[i]));
        break;
    }
    case E_ATTR: r = getattr_(E, e->line, mq_tt_eval(E, f, e->a), e->name); break;
    case E_ITEM: r = getitem(E, e->line, mq_tt_eval(E, f, e->a), mq_tt_eval(E, f, e->b)); break;
    case E_SLICE: {
        tv *o = mq_tt_eval(E, f, e->a);
        tv *a = e->b ? mq_tt_eval(E, f, e->b) : NULL, *b = e->c ? mq_tt_eval(E, f, e->c) : NULL,
           *s = e->args[0] ? mq_tt_eval(E, f, e->args[0]) : NULL;
        if (o->k == TV_UNDEF) mq_tt_ev_fail(E, e->line, "cannot slice an undefined value");
        r = slice(E, e->line, o, a, b, s);
        break;
    }
    case E_CALL: {
        tv *fn;
        if (e->a->op == E_ATTR) {   /* a method: one the interpreter lacks is named as such */
            tv *o = mq_tt_eval(E, f, e->a->a);
            fn = getattr_(E, e->line, o, e->a->name);
            if (fn->k == TV_UNDEF && (o->k == TV_STR || o->k == TV_DICT || o->k == TV_LIST))
                mq_tt_fail(E->c, MOEQ_E_UNSUPPORTED, e->line, "the %s method '%s' is not supported",
                        mq_tv_type_name(o), e->a->name);
        } else
            fn = mq_tt_eval(E, f, e->a);
        args_t a = eval_args(E, f, e);
        if (fn->k == TV_UNDEF && e->a->op == E_NAME)
            mq_tt_fail(E->c, MOEQ_E_UNSUPPORTED, e->line, "'%s' is undefined (not a supported function)", e->a->name);
        if (fn->k != TV_FUNC) mq_tt_ev_fail(E, e->line, "'%s' object is not callable", mq_tv_type_name(fn));
        r = call_global(E, e->line, fn, &a);
        break;
    }
    case E_FILTER: {
        tv *x = mq_tt_eval(E, f, e->a);
        if (e->args) {
            args_t a = eval_args(E, f, e);
            r = filter(E, e->line, e->name, x, &a);
        } else
            r = filter(E, e->line, e->name, x, NULL);
        break;
    }
    case E_TEST: {
        tv *x = mq_tt_eval(E, f, e->a);
        args_t a = eval_args(E, f, e);
        r = mq_tv_bool(run_test(E, e->line, e->name, x, &a) != (e->negate != 0));
        break;
    }
    case E_NOT: r = mq_tv_bool(!mq_tv_truthy(mq_tt_eval(E, f, e->a))); break;
    case E_NEG:
    case E_POS: {
        tv *x = mq_tt_eval(E, f, e->a);
        if (x->k == TV_INT || x->k == TV_BOOL) {
            int64_t v = need_int(E, e->line, x, "-");
            if (e->op == E_NEG && v == INT64_MIN) mq_tt_ev_fail(E, e->line, "integer overflow");
            r = mq_tv_int(E->c, e->op == E_NEG ? -v : v);
        } else if (x->k == TV_FLOAT)
            r = mq_tv_float(E->c, e->op == E_NEG ? -x->u.f : x->u.f);
        else
            mq_tt_ev_fail(E, e->line, "bad operand type for unary %s: '%s'", e->op == E_NEG ? "-" : "+", mq_tv_type_name(x));
        break;
    }
    case E_BIN: r = binop(E, e->line, e->name, mq_tt_eval(E, f, e->a), mq_tt_eval(E, f, e->b)); break;
    case E_AND: {
        tv *a = mq_tt_eval(E, f, e->a);
        r = mq_tv_truthy(a) ? mq_tt_eval(E, f, e->b) : a;
        break;
    }
    case E_OR: {
        tv *a = mq_tt_eval(E, f, e->a);
        r = mq_tv_truthy(a) ? a : mq_tt_eval(E, f, e->b);
        break;
    }
    case E_COND:
        r = mq_tv_truthy(mq_tt_eval(E, f, e->a)) ? mq_tt_eval(E, f, e->b) : e->c ? mq_tt_eval(E, f, e->c) : &mq_tt_undef;
        break;
    default: mq_tt_ev_fail(E, e->line, "bad expression");
    }
    E->depth--;
    return r;
}
