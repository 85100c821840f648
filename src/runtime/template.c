/*
 * The chat-template parser: Jinja2's lexer rules as transformers configures them (trim_blocks:
 * the first newline after a block or comment tag is dropped; lstrip_blocks: spaces and tabs
 * from the start of a line up to a block or comment tag are dropped; `{%-`/`-%}` strip all
 * whitespace on their side, `{%+`/`+%}` keep it; one trailing newline of the template is
 * dropped, and \r\n and \r read as \n), then a recursive-descent parser of the statements and
 * the expression grammar of jinja2/parser.py (conditional, or, and, not, comparisons and `in`,
 * + -, ~, * / // %, **, unary - +, filters and tests, attribute, subscript, slice and call).
 * Statements: if/elif/else, for (with `if` filter and else), set (name, ns.attr, a, b; and the
 * block form), break/continue, generation (transformers' marker, rendered as its body).
 * Anything else (macro, call, include, raw, ...) is MOEQ_E_UNSUPPORTED naming its line.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "runtime/template.h"

typedef enum { T_TEXT, T_VBEG, T_VEND, T_BBEG, T_BEND, T_NAME, T_STR, T_INT, T_FLOAT, T_OP, T_EOF } tk_kind;

typedef struct {
    tk_kind k;
    int line;
    const char *s;   /* T_TEXT, T_NAME, T_STR (unescaped), T_OP */
    size_t n;
    int64_t i;
    double f;
} tk;

typedef struct {
    mq_tt_ctx *c;
    tk *t;
    size_t n, cap, p;
    int depth;   /* nesting of expressions and blocks, bounded so that no input runs the stack out */
} ps;

#define MAX_NESTING 100
static void enter(ps *P, int line) {
    if (++P->depth > MAX_NESTING)
        mq_tt_fail(P->c, MOEQ_E_UNSUPPORTED, line, "nested deeper than %d levels", MAX_NESTING);
}

static void push(ps *P, tk t) {
    if (P->n == P->cap) {
        size_t cap = P->cap ? P->cap * 2 : 256;
        tk *nt = mq_tt_alloc(P->c, sizeof(tk) * cap);
        if (P->n) memcpy(nt, P->t, sizeof(tk) * P->n);
        P->t = nt;
        P->cap = cap;
    }
    P->t[P->n++] = t;
}

static bool is_ws(char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\v' || ch == '\f'; }
static bool is_id0(char ch) { return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_'; }
static bool is_id(char ch) { return is_id0(ch) || (ch >= '0' && ch <= '9'); }

/* A string literal's body, unescaped as Python's unicode-escape codec does (what Jinja2 applies):
 * \n \t \r \\ \' \" \a \b \f \v \xhh \uXXXX \UXXXXXXXX \ooo; an unknown escape keeps the
 * backslash. */
static void unescape(ps *P, int line, const char *s, size_t n, tk *out) {
    mq_tt_buf b = {0};
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 >= n) {
            mq_tt_put(P->c, &b, s + i, 1);
            continue;
        }
        char e = s[++i], byte = e == 'a' ? '\a' : e == 'v' ? '\v' : e == '\'' ? '\'' : mq_tt_unescape(e);
        int nd = 0;
        if (byte) {
            mq_tt_put(P->c, &b, &byte, 1);
            continue;
        }
        switch (e) {
        case '\n': break;
        case 'x': nd = 2; break;
        case 'u': nd = 4; break;
        case 'U': nd = 8; break;
        default:
            if (e >= '0' && e <= '7') {
                uint32_t v = 0;
                int k = 0;
                while (k < 3 && i < n && s[i] >= '0' && s[i] <= '7') v = v * 8 + (uint32_t)(s[i++] - '0'), k++;
                i--;
                mq_tt_put_utf8(P->c, &b, v);
            } else {
                mq_tt_put(P->c, &b, s + i - 1, 2);
            }
        }
        if (nd) {
            uint32_t v = 0;
            for (int k = 0; k < nd; k++) {
                char h = i + 1 + (size_t)k < n ? s[i + 1 + (size_t)k] : 0;
                int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                if (d < 0) mq_tt_fail(P->c, MOEQ_E_FORMAT, line, "truncated \\%c escape in a string", e);
                v = v * 16 + (uint32_t)d;
            }
            if (v > 0x10FFFF || (v >= 0xD800 && v < 0xE000))
                mq_tt_fail(P->c, MOEQ_E_FORMAT, line, "escape \\%c is not a character", e);
            i += (size_t)nd;
            mq_tt_put_utf8(P->c, &b, v);
        }
    }
    out->s = b.p ? b.p : "";
    out->n = b.n;
}

/* Tokens inside a tag from src[*pos], up to its closer ("}}" or "%}") at bracket depth 0, whose
 * strip sign is returned in *strip ('-', '+' or 0); *pos ends just past the closer. */
static void lex_tag(ps *P, const char *src, size_t n, size_t *pos, int *line, bool var, int *strip) {
    size_t i = *pos;
    int depth = 0, open_line = *line;
    for (;;) {
        while (i < n && is_ws(src[i])) {
            if (src[i] == '\n') (*line)++;
            i++;
        }
        if (i >= n) mq_tt_fail(P->c, MOEQ_E_FORMAT, open_line, "tag not closed (missing '%s')", var ? "}}" : "%}");
        char ch = src[i];
        char close = var ? '}' : '%';
        if (depth == 0) {
            size_t j = i;
            int s = 0;
            if ((src[j] == '-' || src[j] == '+') && j + 2 < n && src[j + 1] == close && src[j + 2] == '}')
                s = src[j], j++;
            if (src[j] == close && j + 1 < n && src[j + 1] == '}') {
                *strip = s;
                *pos = j + 2;
                push(P, (tk){var ? T_VEND : T_BEND, *line, NULL, 0, 0, 0});
                return;
            }
        }
        tk t = {T_OP, *line, src + i, 1, 0, 0};
        if (is_id0(ch)) {
            size_t j = i;
            while (j < n && is_id(src[j])) j++;
            t.k = T_NAME;
            t.n = j - i;
            i = j;
        } else if (ch >= '0' && ch <= '9') {
            size_t j = i;
            bool fl = false;
            char buf[64];
            size_t k = 0;
            while (j < n && ((src[j] >= '0' && src[j] <= '9') || src[j] == '_' ||
                             (src[j] == '.' && !fl && j + 1 < n && src[j + 1] >= '0' && src[j + 1] <= '9') ||
                             ((src[j] == 'e' || src[j] == 'E') && j + 1 < n &&
                              ((src[j + 1] >= '0' && src[j + 1] <= '9') || src[j + 1] == '-' || src[j + 1] == '+')))) {
                if (src[j] == '.' || src[j] == 'e' || src[j] == 'E') {
                    fl = true;
                    if (src[j] != '.' && (src[j + 1] == '-' || src[j + 1] == '+')) {
                        if (k < sizeof buf - 2) buf[k++] = src[j];
                        j++;
                    }
                }
                if (src[j] != '_' && k < sizeof buf - 1) buf[k++] = src[j];
                j++;
            }
            buf[k] = 0;
            if (fl) t.k = T_FLOAT, t.f = strtod(buf, NULL);
            else {
                t.k = T_INT;
                errno = 0;
                t.i = strtoll(buf, NULL, 10);
                if (errno) mq_tt_fail(P->c, MOEQ_E_UNSUPPORTED, *line, "integer literal %s does not fit 64 bits", buf);
            }
            i = j;
        } else if (ch == '\'' || ch == '"') {
            size_t j = i + 1;
            while (j < n && src[j] != ch) {
                if (src[j] == '\\') j++;
                if (j < n && src[j] == '\n') (*line)++;
                j++;
            }
            if (j >= n) mq_tt_fail(P->c, MOEQ_E_FORMAT, t.line, "string literal not closed");
            t.k = T_STR;
            unescape(P, t.line, src + i + 1, j - i - 1, &t);
            i = j + 1;
        } else {
            static const char *two[] = {"//", "**", "==", "!=", "<=", ">="};
            for (size_t k = 0; k < sizeof two / sizeof two[0]; k++)
                if (i + 1 < n && src[i] == two[k][0] && src[i + 1] == two[k][1]) t.n = 2;
            if (t.n == 1 && !strchr("+-*/%~()[]{}.,:|=<>", ch))
                mq_tt_fail(P->c, MOEQ_E_FORMAT, *line, "unexpected character '%c'", ch);
            if (ch == '(' || ch == '[' || ch == '{') depth++;
            if (ch == ')' || ch == ']' || ch == '}') {
                if (depth == 0) mq_tt_fail(P->c, MOEQ_E_FORMAT, *line, "unexpected '%c'", ch);
                depth--;
            }
            i += t.n;
        }
        push(P, t);
    }
}

static void lex(ps *P, const char *src, size_t n) {
    size_t i = 0;
    int line = 1;
    bool line_starting = true;
    while (i < n) {
        /* the next tag opener */
        size_t j = i;
        while (j + 1 < n && !(src[j] == '{' && (src[j + 1] == '{' || src[j + 1] == '%' || src[j + 1] == '#'))) j++;
        if (j + 1 >= n) j = n;
        size_t tlen = j - i;
        int tline = line;
        for (size_t k = i; k < j; k++) line += src[k] == '\n';
        if (j == n) {
            if (tlen) push(P, (tk){T_TEXT, tline, src + i, tlen, 0, 0});
            break;
        }
        char kind = src[j + 1];
        char sign = j + 2 < n && (src[j + 2] == '-' || src[j + 2] == '+') ? src[j + 2] : 0;
        if (sign == '-') {
            while (tlen > 0 && is_ws(src[i + tlen - 1])) tlen--;
        } else if (sign != '+' && kind != '{') {
            size_t l_pos = tlen;
            while (l_pos > 0 && src[i + l_pos - 1] != '\n') l_pos--;
            if (l_pos > 0 || line_starting) {
                bool all = l_pos < tlen;
                for (size_t k = l_pos; k < tlen; k++) all &= is_ws(src[i + k]);
                if (all) tlen = l_pos;
            }
        }
        if (tlen) push(P, (tk){T_TEXT, tline, src + i, tlen, 0, 0});
        size_t p = j + 2 + (sign != 0);
        int strip = 0;
        if (kind == '#') {
            size_t q = p;
            while (q + 1 < n && !(src[q] == '#' && src[q + 1] == '}')) q++;
            if (q + 1 >= n) mq_tt_fail(P->c, MOEQ_E_FORMAT, line, "comment not closed (missing '#}')");
            for (size_t k = p; k < q; k++) line += src[k] == '\n';
            strip = q > p && (src[q - 1] == '-' || src[q - 1] == '+') ? src[q - 1] : 0;
            p = q + 2;
        } else {
            push(P, (tk){kind == '{' ? T_VBEG : T_BBEG, line, NULL, 0, 0, 0});
            lex_tag(P, src, n, &p, &line, kind == '{', &strip);
        }
        line_starting = false;
        if (strip == '-') {
            while (p < n && is_ws(src[p])) {
                line += src[p] == '\n';
                line_starting = src[p] == '\n';
                p++;
            }
        } else if (strip != '+' && kind != '{' && p < n && src[p] == '\n') {
            p++;
            line++;
            line_starting = true;
        }
        i = p;
    }
    push(P, (tk){T_EOF, line, NULL, 0, 0, 0});
}

/* ---- parser ------------------------------------------------------------------------------- */
static tk *cur(ps *P) { return &P->t[P->p]; }
static bool is_op(const tk *t, const char *op) { return t->k == T_OP && t->n == strlen(op) && !memcmp(t->s, op, t->n); }
static bool is_name(const tk *t, const char *nm) { return t->k == T_NAME && t->n == strlen(nm) && !memcmp(t->s, nm, t->n); }
static bool accept_op(ps *P, const char *op) {
    if (!is_op(cur(P), op)) return false;
    P->p++;
    return true;
}
static bool accept_name(ps *P, const char *nm) {
    if (!is_name(cur(P), nm)) return false;
    P->p++;
    return true;
}

static const char *tk_desc(ps *P, const tk *t) {
    switch (t->k) {
    case T_NAME:
    case T_OP: return mq_tt_strdup(P->c, t->s, t->n);
    case T_STR: return "a string";
    case T_INT:
    case T_FLOAT: return "a number";
    case T_VEND: return "'}}'";
    case T_BEND: return "'%}'";
    case T_EOF: return "the end of the template";
    default: return "text";
    }
}

_Noreturn static void expected(ps *P, const char *what) {
    mq_tt_fail(P->c, MOEQ_E_FORMAT, cur(P)->line, "expected %s, got %s", what, tk_desc(P, cur(P)));
}
static void expect_op(ps *P, const char *op) {
    if (!accept_op(P, op)) {
        char m[16];
        snprintf(m, sizeof m, "'%s'", op);
        expected(P, m);
    }
}
static const char *expect_ident(ps *P) {
    tk *t = cur(P);
    if (t->k != T_NAME) expected(P, "a name");
    P->p++;
    return mq_tt_strdup(P->c, t->s, t->n);
}

static mq_tt_expr *ex(ps *P, mq_tt_expr_op op, int line) {
    mq_tt_expr *e = mq_tt_alloc(P->c, sizeof *e);
    e->op = op;
    e->line = line;
    return e;
}

static mq_tt_expr *parse_expr(ps *P);
static mq_tt_expr *parse_or(ps *P);
static mq_tt_expr *parse_unary(ps *P, bool filters);

/* (args, kw=args) after '(' */
static void parse_args(ps *P, mq_tt_expr *e) {
    mq_tt_expr *a[64], *kv[64];
    const char *kn[64];
    int na = 0, nk = 0;
    while (!accept_op(P, ")")) {
        if (na + nk) expect_op(P, ",");
        if (accept_op(P, ")")) break;
        if (na + nk >= 64) mq_tt_fail(P->c, MOEQ_E_UNSUPPORTED, cur(P)->line, "more than 64 arguments");
        if (cur(P)->k == T_NAME && is_op(&P->t[P->p + 1], "=")) {
            kn[nk] = expect_ident(P);
            P->p++;
            kv[nk++] = parse_expr(P);
        } else {
            if (nk) mq_tt_fail(P->c, MOEQ_E_FORMAT, cur(P)->line, "positional argument after a keyword argument");
            a[na++] = parse_expr(P);
        }
    }
    e->nargs = na;
    e->args = mq_tt_alloc(P->c, sizeof(mq_tt_expr *) * (size_t)(na + 1));
    memcpy(e->args, a, sizeof(mq_tt_expr *) * (size_t)na);
    e->nkw = nk;
    e->kwn = mq_tt_alloc(P->c, sizeof(char *) * (size_t)(nk + 1));
    e->kwv = mq_tt_alloc(P->c, sizeof(mq_tt_expr *) * (size_t)(nk + 1));
    memcpy(e->kwn, kn, sizeof(char *) * (size_t)nk);
    memcpy(e->kwv, kv, sizeof(mq_tt_expr *) * (size_t)nk);
}

static mq_tt_expr *lit(ps *P, tv *v, int line) {
    mq_tt_expr *e = ex(P, E_LIT, line);
    e->lit = v;
    return e;
}

/* a list of expressions up to the closer, as E_LIST */
static mq_tt_expr *parse_seq(ps *P, const char *close, int line) {
    mq_tt_expr *e = ex(P, E_LIST, line);
    size_t cap = 8;
    e->args = mq_tt_alloc(P->c, sizeof(mq_tt_expr *) * cap);
    while (!accept_op(P, close)) {
        if (e->nargs) expect_op(P, ",");
        if (accept_op(P, close)) break;
        if ((size_t)e->nargs == cap) {
            mq_tt_expr **n = mq_tt_alloc(P->c, sizeof(mq_tt_expr *) * cap * 2);
            memcpy(n, e->args, sizeof(mq_tt_expr *) * cap);
            e->args = n;
            cap *= 2;
        }
        e->args[e->nargs++] = parse_expr(P);
    }
    return e;
}

static mq_tt_expr *parse_primary(ps *P) {
    tk *t = cur(P);
    int line = t->line;
    if (t->k == T_NAME) {
        P->p++;
        if ((t->n == 4 && (!memcmp(t->s, "true", 4) || !memcmp(t->s, "True", 4)))) return lit(P, &mq_tt_true, line);
        if ((t->n == 5 && (!memcmp(t->s, "false", 5) || !memcmp(t->s, "False", 5)))) return lit(P, &mq_tt_false, line);
        if ((t->n == 4 && (!memcmp(t->s, "none", 4) || !memcmp(t->s, "None", 4)))) return lit(P, &mq_tt_none, line);
        mq_tt_expr *e = ex(P, E_NAME, line);
        e->name = mq_tt_strdup(P->c, t->s, t->n);
        return e;
    }
    if (t->k == T_STR) {   /* adjacent literals join */
        mq_tt_buf b = {0};
        while (cur(P)->k == T_STR) {
            mq_tt_put(P->c, &b, cur(P)->s, cur(P)->n);
            P->p++;
        }
        return lit(P, mq_tv_str_ref(P->c, b.p ? b.p : "", b.n), line);
    }
    if (t->k == T_INT) {
        P->p++;
        return lit(P, mq_tv_int(P->c, t->i), line);
    }
    if (t->k == T_FLOAT) {
        P->p++;
        return lit(P, mq_tv_float(P->c, t->f), line);
    }
    if (accept_op(P, "(")) {
        if (accept_op(P, ")")) return ex(P, E_LIST, line);   /* () */
        mq_tt_expr *e = parse_expr(P);
        if (accept_op(P, ")")) return e;
        expect_op(P, ",");   /* a tuple */
        mq_tt_expr *l = parse_seq(P, ")", line);
        mq_tt_expr **a = mq_tt_alloc(P->c, sizeof(mq_tt_expr *) * (size_t)(l->nargs + 1));
        a[0] = e;
        memcpy(a + 1, l->args, sizeof(mq_tt_expr *) * (size_t)l->nargs);
        l->args = a;
        l->nargs++;
        return l;
    }
    if (accept_op(P, "[")) return parse_seq(P, "]", line);
    if (accept_op(P, "{")) {
        mq_tt_expr *e = ex(P, E_DICT, line);
        mq_tt_expr *k[256], *v[256];
        while (!accept_op(P, "}")) {
            if (e->nargs) expect_op(P, ",");
            if (accept_op(P, "}")) break;
            if (e->nargs >= 256) mq_tt_fail(P->c, MOEQ_E_UNSUPPORTED, line, "a dict literal of more than 256 items");
            k[e->nargs] = parse_expr(P);
            expect_op(P, ":");
            v[e->nargs++] = parse_expr(P);
        }
        e->args = mq_tt_alloc(P->c, sizeof(mq_tt_expr *) * (size_t)(e->nargs + 1));
        e->vals = mq_tt_alloc(P->c, sizeof(mq_tt_expr *) * (size_t)(e->nargs + 1));
        memcpy(e->args, k, sizeof(mq_tt_expr *) * (size_t)e->nargs);
        memcpy(e->vals, v, sizeof(mq_tt_expr *) * (size_t)e->nargs);
        return e;
    }
    expected(P, "an expression");
}

static mq_tt_expr *parse_postfix(ps *P, mq_tt_expr *e) {
    for (;;) {
        int line = cur(P)->line;
        if (accept_op(P, ".")) {
            mq_tt_expr *a = ex(P, E_ATTR, line);
            a->a = e;
            if (cur(P)->k == T_INT) {   /* foo.0 is foo[0] */
                a->op = E_ITEM;
                a->b = lit(P, mq_tv_int(P->c, cur(P)->i), line);
                P->p++;
            } else {
                a->name = expect_ident(P);
            }
            e = a;
        } else if (accept_op(P, "[")) {
            mq_tt_expr *parts[3] = {NULL, NULL, NULL};
            int np = 0;
            bool slice = false;
            for (;;) {
                if (is_op(cur(P), ":")) {
                    P->p++;
                    slice = true;
                    if (++np > 2) mq_tt_fail(P->c, MOEQ_E_FORMAT, line, "too many ':' in a slice");
                    continue;
                }
                if (accept_op(P, "]")) break;
                if (parts[np]) expected(P, "':' or ']'");
                parts[np] = parse_expr(P);
            }
            mq_tt_expr *s = ex(P, slice ? E_SLICE : E_ITEM, line);
            s->a = e;
            if (slice) {
                s->b = parts[0];
                s->c = parts[1];
                s->args = mq_tt_alloc(P->c, sizeof(mq_tt_expr *));
                s->args[0] = parts[2];
            } else {
                if (!parts[0]) expected(P, "an index");
                s->b = parts[0];
            }
            e = s;
        } else if (accept_op(P, "(")) {
            mq_tt_expr *c = ex(P, E_CALL, line);
            c->a = e;
            parse_args(P, c);
            e = c;
        } else {
            return e;
        }
    }
}

static mq_tt_expr *parse_filters(ps *P, mq_tt_expr *e) {
    for (;;) {
        int line = cur(P)->line;
        if (accept_op(P, "|")) {
            mq_tt_expr *f = ex(P, E_FILTER, line);
            f->a = e;
            f->name = expect_ident(P);
            if (accept_op(P, "(")) parse_args(P, f);
            else f->args = NULL;
            e = f;
        } else if (accept_name(P, "is")) {
            mq_tt_expr *t = ex(P, E_TEST, line);
            t->a = e;
            t->negate = accept_name(P, "not");
            t->name = expect_ident(P);
            if (accept_op(P, "(")) {
                parse_args(P, t);
            } else {
                tk *n = cur(P);
                /* a test takes one argument without parentheses: `is divisibleby 3`, `is sameas x` */
                if (n->k == T_STR || n->k == T_INT || n->k == T_FLOAT ||
                    (n->k == T_NAME && !is_name(n, "and") && !is_name(n, "or") && !is_name(n, "else") &&
                     !is_name(n, "if") && !is_name(n, "in") && !is_name(n, "is") && !is_name(n, "not")) ||
                    is_op(n, "(") || is_op(n, "[") || is_op(n, "{")) {
                    t->args = mq_tt_alloc(P->c, sizeof(mq_tt_expr *));
                    t->args[0] = parse_primary(P);
                    t->args[0] = parse_postfix(P, t->args[0]);
                    t->nargs = 1;
                }
            }
            e = t;
        } else {
            return e;
        }
    }
}

static mq_tt_expr *parse_unary(ps *P, bool filters) {
    int line = cur(P)->line;
    mq_tt_expr *e;
    if (accept_op(P, "-")) {
        e = ex(P, E_NEG, line);
        enter(P, line);
        e->a = parse_unary(P, false);
        P->depth--;
    } else if (accept_op(P, "+")) {
        e = ex(P, E_POS, line);
        enter(P, line);
        e->a = parse_unary(P, false);
        P->depth--;
    } else {
        e = parse_postfix(P, parse_primary(P));
    }
    return filters ? parse_filters(P, e) : e;
}

static mq_tt_expr *bin(ps *P, const char *op, mq_tt_expr *a, mq_tt_expr *b, int line) {
    mq_tt_expr *e = ex(P, E_BIN, line);
    e->name = op;
    e->a = a;
    e->b = b;
    return e;
}

/* A left-associative level: operands from next, joined by any of ops (NULL-ended). */
static mq_tt_expr *parse_left(ps *P, mq_tt_expr *(*next)(ps *), const char *const *ops) {
    mq_tt_expr *e = next(P);
    for (;;) {
        const int line = cur(P)->line;
        const char *op = NULL;
        for (const char *const *o = ops; *o && !op; o++)
            if (is_op(cur(P), *o)) op = *o;
        if (!op) return e;
        P->p++;
        e = bin(P, op, e, next(P), line);
    }
}

static mq_tt_expr *parse_filtered(ps *P) { return parse_unary(P, true); }

static mq_tt_expr *parse_pow(ps *P) {
    static const char *const ops[] = {"**", NULL};
    return parse_left(P, parse_filtered, ops);
}

static mq_tt_expr *parse_math2(ps *P) {
    static const char *const ops[] = {"*", "/", "//", "%", NULL};
    return parse_left(P, parse_pow, ops);
}

static mq_tt_expr *parse_concat(ps *P) {
    static const char *const ops[] = {"~", NULL};
    return parse_left(P, parse_math2, ops);
}

static mq_tt_expr *parse_math1(ps *P) {
    static const char *const ops[] = {"+", "-", NULL};
    return parse_left(P, parse_concat, ops);
}

static mq_tt_expr *parse_compare(ps *P) {
    mq_tt_expr *e = parse_math1(P), *chain = NULL, *prev = e;
    for (;;) {
        tk *t = cur(P);
        int line = t->line;
        const char *op = NULL;
        static const char *ops[] = {"==", "!=", "<=", ">=", "<", ">"};
        for (size_t k = 0; k < 6 && !op; k++)
            if (is_op(t, ops[k])) op = ops[k];
        if (op) P->p++;
        else if (accept_name(P, "in")) op = "in";
        else if (is_name(t, "not") && is_name(&P->t[P->p + 1], "in")) {
            P->p += 2;
            op = "not in";
        } else
            break;
        mq_tt_expr *rhs = parse_math1(P), *c = bin(P, op, prev, rhs, line);
        if (!chain) chain = c;
        else {   /* a < b < c is a < b and b < c */
            mq_tt_expr *a = ex(P, E_AND, line);
            a->a = chain;
            a->b = c;
            chain = a;
        }
        prev = rhs;
    }
    return chain ? chain : e;
}

static mq_tt_expr *parse_not(ps *P) {
    int line = cur(P)->line;
    if (accept_name(P, "not")) {
        mq_tt_expr *e = ex(P, E_NOT, line);
        enter(P, line);
        e->a = parse_not(P);
        P->depth--;
        return e;
    }
    return parse_compare(P);
}

/* `and` or `or` (left-associative): operands from next. */
static mq_tt_expr *parse_logic(ps *P, const char *word, mq_tt_expr_op op, mq_tt_expr *(*next)(ps *)) {
    mq_tt_expr *e = next(P);
    while (is_name(cur(P), word)) {
        mq_tt_expr *a = ex(P, op, cur(P)->line);
        P->p++;
        a->a = e;
        a->b = next(P);
        e = a;
    }
    return e;
}

static mq_tt_expr *parse_and(ps *P) { return parse_logic(P, "and", E_AND, parse_not); }
static mq_tt_expr *parse_or(ps *P) { return parse_logic(P, "or", E_OR, parse_and); }

static mq_tt_expr *parse_expr(ps *P) {
    enter(P, cur(P)->line);
    mq_tt_expr *e = parse_or(P);
    while (is_name(cur(P), "if")) {
        mq_tt_expr *c = ex(P, E_COND, cur(P)->line);
        P->p++;
        c->b = e;
        c->a = parse_or(P);
        c->c = accept_name(P, "else") ? parse_expr(P) : NULL;
        e = c;
    }
    P->depth--;
    return e;
}

/* ---- statements ------------------------------------------------------------------------- */
static mq_tt_node *nd(ps *P, mq_tt_node_kind k, int line) {
    mq_tt_node *n = mq_tt_alloc(P->c, sizeof *n);
    n->kind = k;
    n->line = line;
    return n;
}

static void expect_bend(ps *P) {
    if (cur(P)->k != T_BEND) expected(P, "'%}'");
    P->p++;
}

/* Statements up to a block tag whose name is one of ends ("endif|elif|else"); that tag's name is
 * consumed and returned (NULL at the end of the template, allowed only when ends is NULL). */
static mq_tt_node *parse_body(ps *P, const char *ends, const char **end_found, int open_line, const char *what);

static const char **names_list(ps *P, int *n) {
    const char *nm[16];
    int k = 0;
    do {
        if (k == 16) mq_tt_fail(P->c, MOEQ_E_UNSUPPORTED, cur(P)->line, "more than 16 targets");
        nm[k++] = expect_ident(P);
    } while (accept_op(P, ","));
    const char **r = mq_tt_alloc(P->c, sizeof(char *) * (size_t)k);
    memcpy(r, nm, sizeof(char *) * (size_t)k);
    *n = k;
    return r;
}

static mq_tt_node *parse_stmt(ps *P) {
    tk *t = cur(P);
    int line = t->line;
    if (t->k != T_NAME) expected(P, "a statement name");
    const char *kw = mq_tt_strdup(P->c, t->s, t->n);
    P->p++;
    if (!strcmp(kw, "if")) {
        mq_tt_node *n = nd(P, N_IF, line), *top = n;
        n->e = parse_expr(P);
        expect_bend(P);
        for (;;) {
            const char *end;
            n->body = parse_body(P, "elif|else|endif", &end, line, "if");
            if (!strcmp(end, "endif")) {
                expect_bend(P);
                break;
            }
            if (!strcmp(end, "else")) {
                expect_bend(P);
                n->els = parse_body(P, "endif", &end, line, "if");
                expect_bend(P);
                break;
            }
            mq_tt_node *e = nd(P, N_IF, P->t[P->p - 1].line);   /* elif */
            e->e = parse_expr(P);
            e->is_elif = 1;
            expect_bend(P);
            n->els = e;
            n = e;
        }
        return top;
    }
    if (!strcmp(kw, "for")) {
        mq_tt_node *n = nd(P, N_FOR, line);
        n->names = names_list(P, &n->nnames);
        if (!accept_name(P, "in")) expected(P, "'in'");
        n->e = parse_or(P);   /* `if` here filters the loop */
        if (accept_name(P, "if")) n->cond = parse_expr(P);
        if (accept_name(P, "recursive")) mq_tt_fail(P->c, MOEQ_E_UNSUPPORTED, line, "recursive loops are not supported");
        expect_bend(P);
        const char *end;
        n->body = parse_body(P, "else|endfor", &end, line, "for");
        expect_bend(P);
        if (!strcmp(end, "else")) {
            n->els = parse_body(P, "endfor", &end, line, "for");
            expect_bend(P);
        }
        return n;
    }
    if (!strcmp(kw, "set")) {
        mq_tt_node *n = nd(P, N_SET, line);
        const char *first = expect_ident(P);
        if (accept_op(P, ".")) {
            n->names = mq_tt_alloc(P->c, sizeof(char *));
            n->names[0] = first;
            n->nnames = 1;
            n->attr = expect_ident(P);
        } else {
            P->p--;
            n->names = names_list(P, &n->nnames);
        }
        if (accept_op(P, "=")) {
            n->e = parse_expr(P);
            if (is_op(cur(P), ",")) {   /* set a, b = x, y */
                mq_tt_expr *l = ex(P, E_LIST, line);
                mq_tt_expr *items[16];
                items[0] = n->e;
                int k = 1;
                while (accept_op(P, ",") && k < 16) items[k++] = parse_expr(P);
                l->args = mq_tt_alloc(P->c, sizeof(mq_tt_expr *) * (size_t)k);
                memcpy(l->args, items, sizeof(mq_tt_expr *) * (size_t)k);
                l->nargs = k;
                n->e = l;
            }
            expect_bend(P);
            return n;
        }
        if (n->attr || n->nnames != 1) expected(P, "'='");
        if (is_op(cur(P), "|")) mq_tt_fail(P->c, MOEQ_E_UNSUPPORTED, line, "filtered block set is not supported");
        expect_bend(P);
        n->kind = N_SETBLOCK;
        const char *end;
        n->body = parse_body(P, "endset", &end, line, "set");
        expect_bend(P);
        return n;
    }
    if (!strcmp(kw, "break") || !strcmp(kw, "continue")) {
        expect_bend(P);
        return nd(P, kw[0] == 'b' ? N_BREAK : N_CONTINUE, line);
    }
    if (!strcmp(kw, "generation")) {   /* transformers' AssistantTracker: marks assistant text */
        expect_bend(P);
        mq_tt_node *n = nd(P, N_BLOCK, line);
        const char *end;
        n->body = parse_body(P, "endgeneration", &end, line, "generation");
        expect_bend(P);
        return n;
    }
    static const char *known[] = {"macro", "call", "filter", "include", "import", "from", "extends",
                                  "block", "with", "raw", "autoescape", "do"};
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++)
        if (!strcmp(kw, known[k]))
            mq_tt_fail(P->c, MOEQ_E_UNSUPPORTED, line, "the '%s' statement is not supported", kw);
    mq_tt_fail(P->c, MOEQ_E_FORMAT, line, "unknown statement '%s'", kw);
}

static bool in_list(const char *list, const char *s, size_t n) {
    while (list && *list) {
        const char *bar = strchr(list, '|');
        size_t m = bar ? (size_t)(bar - list) : strlen(list);
        if (m == n && !memcmp(list, s, n)) return true;
        list = bar ? bar + 1 : NULL;
    }
    return false;
}

static mq_tt_node *parse_body(ps *P, const char *ends, const char **end_found, int open_line, const char *what) {
    mq_tt_node *head = NULL, **tail = &head;
    for (;;) {
        tk *t = cur(P);
        mq_tt_node *n = NULL;
        if (t->k == T_EOF) {
            if (ends) mq_tt_fail(P->c, MOEQ_E_FORMAT, open_line, "'%s' is never closed", what);
            *end_found = NULL;
            return head;
        }
        if (t->k == T_TEXT) {
            n = nd(P, N_TEXT, t->line);
            n->text = t->s;
            n->len = t->n;
            P->p++;
        } else if (t->k == T_VBEG) {
            P->p++;
            n = nd(P, N_OUT, t->line);
            n->e = parse_expr(P);
            if (cur(P)->k != T_VEND) expected(P, "'}}'");
            P->p++;
        } else if (t->k == T_BBEG) {
            tk *k = &P->t[P->p + 1];
            if (k->k == T_NAME && in_list(ends, k->s, k->n)) {
                P->p += 2;
                *end_found = mq_tt_strdup(P->c, k->s, k->n);
                return head;
            }
            if (k->k == T_NAME && (in_list("endif|endfor|elif|else|endset|endgeneration|endmacro", k->s, k->n)))
                mq_tt_fail(P->c, MOEQ_E_FORMAT, k->line, "unexpected '%.*s'%s%s%s", (int)k->n, k->s,
                        ends ? " (the innermost open block is '" : "", ends ? what : "", ends ? "')" : "");
            P->p++;
            enter(P, t->line);
            n = parse_stmt(P);
            P->depth--;
        } else {
            expected(P, "text or a tag");
        }
        *tail = n;
        tail = &n->next;
    }
}

moeq_status mq_tt_parse(mq_tt_template *t, const char *text, size_t len) {
    mq_tt_ctx c = {.name = t->name, .a = &t->arena};
    mq_tt_arena_init(&t->arena, (size_t)1 << 30);
    if (setjmp(c.jb)) {
        mq_tt_arena_free(&t->arena);
        return mq_err(c.st, "%s", c.msg);
    }
    /* newlines as Jinja2 reads them: \r\n and \r are \n; one trailing newline dropped */
    char *src = mq_tt_alloc(&c, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (text[i] == '\r') {
            src[n++] = '\n';
            if (i + 1 < len && text[i + 1] == '\n') i++;
        } else {
            src[n++] = text[i];
        }
    }
    if (n > 0 && src[n - 1] == '\n') n--;
    ps P = {.c = &c};
    lex(&P, src, n);
    const char *end;
    t->body = parse_body(&P, NULL, &end, 0, "");
    return MOEQ_OK;
}
