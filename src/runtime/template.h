/*
 * The chat-template interpreter's internals (template*.c): a subset of Jinja2 as transformers'
 * apply_chat_template runs it (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
 * loopcontrols, its tojson, raise_exception and strftime_now). Values live in an arena that one
 * parse or one render owns, so nothing is freed piecemeal; errors unwind to the entry point with
 * longjmp (mq_tt_fail), taking the arena with them.
 */
#ifndef MOEQ_RUNTIME_TEMPLATE_H
#define MOEQ_RUNTIME_TEMPLATE_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moeq.h"

/* ---- arena ---------------------------------------------------------------------------- */
typedef struct mq_tt_block mq_tt_block;
typedef struct {
    mq_tt_block *head;
    size_t used_total, limit;   /* bytes handed out; a render past limit fails */
} mq_tt_arena;

/* ---- values (Python's, as Jinja2 sees them) ---------------------------------------------- */
typedef enum {
    TV_UNDEF,   /* jinja2.Undefined: a missing name, key or attribute */
    TV_NONE,
    TV_BOOL,
    TV_INT,
    TV_FLOAT,
    TV_STR,     /* UTF-8 bytes; lengths and indexes count code points, as Python's str */
    TV_LIST,    /* list and tuple alike */
    TV_DICT,    /* insertion-ordered */
    TV_NS,      /* namespace(): a dict whose attributes `set ns.x = ...` may change */
    TV_FUNC,    /* a global function or a bound method (self set) */
} mq_tv_kind;

typedef struct tv tv;
struct tv {
    mq_tv_kind k;
    union {
        int b;
        int64_t i;
        double f;
        struct {
            const char *s;
            size_t n;
        } s;
        struct {
            tv **v;
            size_t n, cap;
        } l;
        struct {
            tv **key, **val;
            size_t n, cap;
        } d;
        struct {
            int id;        /* mq_tt_func_id */
            const tv *self;
            const char *name;
        } fn;
    } u;
};

/* ---- the error context ------------------------------------------------------------------ */
typedef struct {
    jmp_buf jb;
    moeq_status st;
    char msg[512];
    const char *name;   /* the template's name for messages */
    mq_tt_arena *a;
} mq_tt_ctx;

/* Stops the parse or render: st and "template NAME line L: ..." (line 0: no line). */
_Noreturn void mq_tt_fail(mq_tt_ctx *c, moeq_status st, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

void mq_tt_arena_init(mq_tt_arena *a, size_t limit);
void mq_tt_arena_free(mq_tt_arena *a);
void *mq_tt_alloc(mq_tt_ctx *c, size_t n);   /* zeroed; fails the context when memory runs out */
char *mq_tt_strdup(mq_tt_ctx *c, const char *s, size_t n);

extern tv mq_tt_undef, mq_tt_none, mq_tt_true, mq_tt_false;
tv *mq_tv_int(mq_tt_ctx *c, int64_t i);
tv *mq_tv_float(mq_tt_ctx *c, double f);
tv *mq_tv_bool(bool b);
tv *mq_tv_str(mq_tt_ctx *c, const char *s, size_t n);   /* copies */
tv *mq_tv_str_ref(mq_tt_ctx *c, const char *s, size_t n);   /* s lives as long as the arena */
tv *mq_tv_list(mq_tt_ctx *c, size_t cap);
void mq_tv_list_push(mq_tt_ctx *c, tv *l, tv *x);
tv *mq_tv_dict(mq_tt_ctx *c, mq_tv_kind k);   /* TV_DICT or TV_NS */
void mq_tv_dict_set(mq_tt_ctx *c, tv *d, tv *key, tv *val);
tv *mq_tv_dict_get(const tv *d, const tv *key);   /* NULL when absent */
tv *mq_tv_dict_gets(const tv *d, const char *key);

bool mq_tv_truthy(const tv *x);
bool mq_tv_eq(const tv *a, const tv *b);
/* <0, 0, >0; fails the context for types Python cannot order. */
int mq_tv_cmp(mq_tt_ctx *c, int line, const tv *a, const tv *b);
const char *mq_tv_type_name(const tv *x);
size_t mq_tt_utf8_len(const char *s, size_t n);

/* A growing byte buffer in the arena. */
typedef struct {
    char *p;
    size_t n, cap;
} mq_tt_buf;
void mq_tt_put(mq_tt_ctx *c, mq_tt_buf *b, const char *s, size_t n);
void mq_tt_puts(mq_tt_ctx *c, mq_tt_buf *b, const char *s);
/* The byte that the escape backslash-e stands for in both a template's string literal and JSON
 * (\" \\ \b \f \n \r \t), 0 for another e. */
char mq_tt_unescape(char e);
/* The code point cp (at most 0x10FFFF) as UTF-8. */
void mq_tt_put_utf8(mq_tt_ctx *c, mq_tt_buf *b, uint32_t cp);
/* str(x) as Python prints it (Jinja2's {{ x }}: None -> "None", True, 1.5, ['a', 1]). */
void mq_tv_to_str(mq_tt_ctx *c, mq_tt_buf *b, const tv *x);
/* repr(x). */
void mq_tv_repr(mq_tt_ctx *c, mq_tt_buf *b, const tv *x);
/* json.dumps(x, ensure_ascii=False, indent=indent (<0: None), sort_keys=sort_keys), transformers'
 * tojson filter. */
void mq_tv_to_json(mq_tt_ctx *c, int line, mq_tt_buf *b, const tv *x, int indent, bool sort_keys);
/* JSON text as Python's json.loads gives it (ints stay ints, objects keep their order, a
 * repeated key keeps its first place and its last value). Fails the context naming what. */
tv *mq_tv_from_json(mq_tt_ctx *c, const char *what, const char *s, size_t n);

/* ---- the parsed template ------------------------------------------------------------------ */
typedef enum {
    E_LIT, E_NAME, E_LIST, E_DICT, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NOT,
    E_NEG, E_POS, E_BIN, E_AND, E_OR, E_COND
} mq_tt_expr_op;

typedef struct mq_tt_expr mq_tt_expr;
struct mq_tt_expr {
    mq_tt_expr_op op;
    int line;
    tv *lit;                 /* E_LIT */
    const char *name;        /* E_NAME, E_ATTR, E_FILTER, E_TEST; E_BIN: the operator */
    mq_tt_expr *a, *b, *c;      /* operands; E_SLICE: object a, [b:c:args[0]] */
    mq_tt_expr **args;          /* E_LIST items, E_DICT keys, call/filter/test arguments */
    mq_tt_expr **vals;          /* E_DICT values */
    int nargs;
    const char **kwn;        /* keyword arguments */
    mq_tt_expr **kwv;
    int nkw;
    int negate;              /* E_TEST: `is not` */
};

typedef enum { N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_BREAK, N_CONTINUE, N_BLOCK } mq_tt_node_kind;

typedef struct mq_tt_node mq_tt_node;
struct mq_tt_node {
    mq_tt_node_kind kind;
    int line;
    mq_tt_node *next;
    const char *text;        /* N_TEXT */
    size_t len;
    mq_tt_expr *e;              /* N_OUT, N_IF condition, N_FOR iterable, N_SET value */
    mq_tt_expr *cond;           /* N_FOR: its `if` filter */
    mq_tt_node *body, *els;     /* N_IF: then / else (an elif is an N_IF there); N_FOR: body / else */
    const char **names;      /* N_FOR, N_SET, N_SETBLOCK targets */
    int nnames;
    const char *attr;        /* N_SET: `set ns.attr = ...` (names[0] is ns) */
    int is_elif;             /* N_IF: an elif of the N_IF whose els it is */
};

typedef struct {
    mq_tt_arena arena;
    mq_tt_node *body;
    char name[128];
} mq_tt_template;

/* ---- the evaluator (template_eval.c: expressions; template_exec.c: statements) --------------- */
/* the globals' function ids (TV_FUNC) */
enum { MQ_TT_F_RANGE = 1, MQ_TT_F_NAMESPACE, MQ_TT_F_RAISE, MQ_TT_F_STRFTIME, MQ_TT_F_DICT, MQ_TT_F_METHOD };

/* A scope: its variables and the enclosing one. */
typedef struct mq_tt_frame mq_tt_frame;
struct mq_tt_frame {
    tv *vars;
    mq_tt_frame *up;
};

/* One render's state. */
typedef struct {
    mq_tt_ctx *c;
    int depth;
    size_t out_limit;
} mq_tt_ev;

/* Fails the render with MOEQ_E_ARG at line (the message cut at 300 bytes). */
_Noreturn void mq_tt_ev_fail(mq_tt_ev *E, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The value of an expression in scope f. */
tv *mq_tt_eval(mq_tt_ev *E, mq_tt_frame *f, const mq_tt_expr *e);
/* The variable name in f or a scope around it; NULL when none has it. */
tv *mq_tt_lookup(mq_tt_frame *f, const char *name);
/* x as a list to iterate (a dict's keys, a str's code points, Undefined empty), else fails naming
 * what. */
tv *mq_tt_as_list(mq_tt_ev *E, int line, const tv *x, const char *what);

/* Parses text (not NUL-terminated) into t (t->name set by the caller). */
moeq_status mq_tt_parse(mq_tt_template *t, const char *text, size_t len);
/* Renders with the variables of ctx (a TV_DICT built in c's arena) into *out (malloc'ed). */
moeq_status mq_tt_render(const mq_tt_template *t, mq_tt_ctx *c, const tv *vars, char **out, size_t *out_len);

#endif
