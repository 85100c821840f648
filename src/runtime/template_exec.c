/*
 * The chat-template evaluator's statements (template_eval.c has the expressions): text and
 * output, if/elif/else, for-loops with their `loop` variable, `else` and `if` filter, set and
 * set-blocks, break and continue; and mq_tt_render, which sets up the globals and runs them.
 */
#include <setjmp.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "runtime/template.h"

typedef mq_tt_frame frame;
typedef mq_tt_ev ev;

static tv *S(ev *E, const char *s) { return mq_tv_str_ref(E->c, s, strlen(s)); }

enum { GO_ON = 0, GO_BREAK, GO_CONTINUE };

static void out(ev *E, mq_tt_buf *b, const char *s, size_t n, int line) {
    if (b->n + n > E->out_limit) mq_tt_ev_fail(E, line, "output longer than %zu bytes", E->out_limit);
    mq_tt_put(E->c, b, s, n);
}

static void assign(ev *E, frame *f, const mq_tt_node *n, tv *v) {
    if (n->nnames == 1) {
        mq_tv_dict_set(E->c, f->vars, S(E, n->names[0]), v);
        return;
    }
    tv *l = mq_tt_as_list(E, n->line, v, "unpacking");
    if ((int)l->u.l.n != n->nnames)
        mq_tt_ev_fail(E, n->line, "cannot unpack %zu values into %d names", l->u.l.n, n->nnames);
    for (int i = 0; i < n->nnames; i++) mq_tv_dict_set(E->c, f->vars, S(E, n->names[i]), l->u.l.v[i]);
}

static int exec(ev *E, frame *f, const mq_tt_node *n, mq_tt_buf *b) {
    for (; n; n = n->next) {
        switch (n->kind) {
        case N_TEXT: out(E, b, n->text, n->len, n->line); break;
        case N_OUT: {
            tv *v = mq_tt_eval(E, f, n->e);
            mq_tt_buf t = {0};
            mq_tv_to_str(E->c, &t, v);
            out(E, b, t.p ? t.p : "", t.n, n->line);
            break;
        }
        case N_IF: {
            const mq_tt_node *c = n;
            for (;;) {
                if (mq_tv_truthy(mq_tt_eval(E, f, c->e))) {
                    int r = exec(E, f, c->body, b);
                    if (r) return r;
                    break;
                }
                if (c->els && c->els->kind == N_IF && c->els->is_elif) {
                    c = c->els;
                    continue;
                }
                if (c->els) {
                    int r = exec(E, f, c->els, b);
                    if (r) return r;
                }
                break;
            }
            break;
        }
        case N_FOR: {
            tv *it = mq_tt_eval(E, f, n->e);
            if (it->k == TV_NONE) mq_tt_ev_fail(E, n->line, "'NoneType' object is not iterable");
            tv *l = mq_tt_as_list(E, n->line, it, "for");
            tv *items = l;
            if (n->cond) {   /* the loop's `if` filters before loop.* is counted */
                items = mq_tv_list(E->c, l->u.l.n + 1);
                for (size_t i = 0; i < l->u.l.n; i++) {
                    frame g = {mq_tv_dict(E->c, TV_DICT), f};
                    assign(E, &g, n, l->u.l.v[i]);
                    if (mq_tv_truthy(mq_tt_eval(E, &g, n->cond))) mq_tv_list_push(E->c, items, l->u.l.v[i]);
                }
            }
            size_t cnt = items->u.l.n;
            for (size_t i = 0; i < cnt; i++) {
                frame g = {mq_tv_dict(E->c, TV_DICT), f};
                tv *loop = mq_tv_dict(E->c, TV_DICT);
                mq_tv_dict_set(E->c, loop, S(E, "index"), mq_tv_int(E->c, (int64_t)i + 1));
                mq_tv_dict_set(E->c, loop, S(E, "index0"), mq_tv_int(E->c, (int64_t)i));
                mq_tv_dict_set(E->c, loop, S(E, "revindex"), mq_tv_int(E->c, (int64_t)(cnt - i)));
                mq_tv_dict_set(E->c, loop, S(E, "revindex0"), mq_tv_int(E->c, (int64_t)(cnt - i - 1)));
                mq_tv_dict_set(E->c, loop, S(E, "first"), mq_tv_bool(i == 0));
                mq_tv_dict_set(E->c, loop, S(E, "last"), mq_tv_bool(i + 1 == cnt));
                mq_tv_dict_set(E->c, loop, S(E, "length"), mq_tv_int(E->c, (int64_t)cnt));
                mq_tv_dict_set(E->c, loop, S(E, "depth"), mq_tv_int(E->c, 1));
                mq_tv_dict_set(E->c, loop, S(E, "depth0"), mq_tv_int(E->c, 0));
                mq_tv_dict_set(E->c, loop, S(E, "previtem"), i ? items->u.l.v[i - 1] : &mq_tt_undef);
                mq_tv_dict_set(E->c, loop, S(E, "nextitem"), i + 1 < cnt ? items->u.l.v[i + 1] : &mq_tt_undef);
                mq_tv_dict_set(E->c, g.vars, S(E, "loop"), loop);
                assign(E, &g, n, items->u.l.v[i]);
                int r = exec(E, &g, n->body, b);
                if (r == GO_BREAK) break;
            }
            if (!cnt && n->els) {
                int r = exec(E, f, n->els, b);
                if (r) return r;
            }
            break;
        }
        case N_SET: {
            tv *v = mq_tt_eval(E, f, n->e);
            if (n->attr) {
                tv *ns = mq_tt_lookup(f, n->names[0]);
                if (!ns || ns->k != TV_NS)
                    mq_tt_ev_fail(E, n->line, "cannot assign attribute on non-namespace object '%s'", n->names[0]);
                mq_tv_dict_set(E->c, ns, S(E, n->attr), v);
            } else
                assign(E, f, n, v);
            break;
        }
        case N_SETBLOCK: {
            mq_tt_buf t = {0};
            exec(E, f, n->body, &t);
            mq_tv_dict_set(E->c, f->vars, S(E, n->names[0]), mq_tv_str_ref(E->c, t.p ? t.p : "", t.n));
            break;
        }
        case N_BREAK: return GO_BREAK;
        case N_CONTINUE: return GO_CONTINUE;
        case N_BLOCK: {
            int r = exec(E, f, n->body, b);
            if (r) return r;
            break;
        }
        }
    }
    return GO_ON;
}

static tv *gfn(mq_tt_ctx *c, int id) {
    tv *x = mq_tt_alloc(c, sizeof *x);
    x->k = TV_FUNC;
    x->u.fn.id = id;
    return x;
}

moeq_status mq_tt_render(const mq_tt_template *t, mq_tt_ctx *c, const tv *vars, char **out_text, size_t *out_len) {
    *out_text = NULL;
    *out_len = 0;
    if (setjmp(c->jb)) return mq_err(c->st, "%s", c->msg);
    frame glob = {mq_tv_dict(c, TV_DICT), NULL};
    mq_tv_dict_set(c, glob.vars, mq_tv_str_ref(c, "range", 5), gfn(c, MQ_TT_F_RANGE));
    mq_tv_dict_set(c, glob.vars, mq_tv_str_ref(c, "namespace", 9), gfn(c, MQ_TT_F_NAMESPACE));
    mq_tv_dict_set(c, glob.vars, mq_tv_str_ref(c, "dict", 4), gfn(c, MQ_TT_F_DICT));
    mq_tv_dict_set(c, glob.vars, mq_tv_str_ref(c, "raise_exception", 15), gfn(c, MQ_TT_F_RAISE));
    mq_tv_dict_set(c, glob.vars, mq_tv_str_ref(c, "strftime_now", 12), gfn(c, MQ_TT_F_STRFTIME));
    frame top = {mq_tv_dict(c, TV_DICT), &glob};
    for (size_t i = 0; i < vars->u.d.n; i++) mq_tv_dict_set(c, top.vars, vars->u.d.key[i], vars->u.d.val[i]);
    ev E = {c, 0, (size_t)256 << 20};
    mq_tt_buf b = {0};
    exec(&E, &top, t->body, &b);
    char *r = malloc(b.n + 1);
    if (!r) return mq_err(MOEQ_E_NOMEM, "chat template %s: out of memory", c->name);
    if (b.n) memcpy(r, b.p, b.n);
    r[b.n] = 0;
    *out_text = r;
    *out_len = b.n;
    return MOEQ_OK;
}
