/*
 * The chat-template interpreter's internals (template*.c): a subset of Jinja2 as transformers'
 * apply_chat_template runs it (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
 * loopcontrols, its tojson, raise_exception and strftime_now). Values live in an arena that one
 * parse or one render owns, so nothing is freed piecemeal; errors unwind to the entry point with
 * longjmp (tt_fail), taking the arena with them.
 */
#ifndef MOEQ_RUNTIME_TEMPLATE_H
#define MOEQ_RUNTIME_TEMPLATE_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moeq.h"

/* ---- arena ---------------------------------------------------------------------------- */
typedef struct tt_block tt_block;
typedef struct {
    tt_block *head;
    size_t used_total, limit;   /* bytes handed out; a render past limit fails */
} tt_arena;

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
} tv_kind;

typedef struct tv tv;
struct tv {
    tv_kind k;
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
            int id;        /* tt_func_id */
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
    tt_arena *a;
} tt_ctx;

/* Stops the parse or render: st and "template NAME line L: ..." (line 0: no line). */
_Noreturn void tt_fail(tt_ctx *c, moeq_status st, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

void tt_arena_init(tt_arena *a, size_t limit);
void tt_arena_free(tt_arena *a);
void *tt_alloc(tt_ctx *c, size_t n);   /* zeroed; fails the context when memory runs out */
char *tt_strdup(tt_ctx *c, const char *s, size_t n);

extern tv tt_undef, tt_none, tt_true, tt_false;
tv *tv_int(tt_ctx *c, int64_t i);
tv *tv_float(tt_ctx *c, double f);
tv *tv_bool(bool b);
tv *tv_str(tt_ctx *c, const char *s, size_t n);   /* copies */
tv *tv_str_ref(tt_ctx *c, const char *s, size_t n);   /* s lives as long as the arena */
tv *tv_list(tt_ctx *c, size_t cap);
void tv_list_push(tt_ctx *c, tv *l, tv *x);
tv *tv_dict(tt_ctx *c, tv_kind k);   /* TV_DICT or TV_NS */
void tv_dict_set(tt_ctx *c, tv *d, tv *key, tv *val);
tv *tv_dict_get(const tv *d, const tv *key);   /* NULL when absent */
tv *tv_dict_gets(const tv *d, const char *key);

bool tv_truthy(const tv *x);
bool tv_eq(const tv *a, const tv *b);
/* <0, 0, >0; fails the context for types Python cannot order. */
int tv_cmp(tt_ctx *c, int line, const tv *a, const tv *b);
const char *tv_type_name(const tv *x);
size_t tt_utf8_len(const char *s, size_t n);

/* A growing byte buffer in the arena. */
typedef struct {
    char *p;
    size_t n, cap;
} tt_buf;
void tt_put(tt_ctx *c, tt_buf *b, const char *s, size_t n);
void tt_puts(tt_ctx *c, tt_buf *b, const char *s);
/* str(x) as Python prints it (Jinja2's {{ x }}: None -> "None", True, 1.5, ['a', 1]). */
void tv_to_str(tt_ctx *c, tt_buf *b, const tv *x);
/* repr(x). */
void tv_repr(tt_ctx *c, tt_buf *b, const tv *x);
/* json.dumps(x, ensure_ascii=False, indent=indent (<0: None), sort_keys=sort_keys), transformers'
 * tojson filter. */
void tv_to_json(tt_ctx *c, int line, tt_buf *b, const tv *x, int indent, bool sort_keys);
/* JSON text as Python's json.loads gives it (ints stay ints, objects keep their order, a
 * repeated key keeps its first place and its last value). Fails the context naming what. */
tv *tv_from_json(tt_ctx *c, const char *what, const char *s, size_t n);

/* ---- the parsed template ------------------------------------------------------------------ */
typedef enum {
    E_LIT, E_NAME, E_LIST, E_DICT, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NOT,
    E_NEG, E_POS, E_BIN, E_AND, E_OR, E_COND
} tt_expr_op;

typedef struct tt_expr tt_expr;
struct tt_expr {
    tt_expr_op op;
    int line;
    tv *lit;                 /* E_LIT */
    const char *name;        /* E_NAME, E_ATTR, E_FILTER, E_TEST; E_BIN: the operator */
    tt_expr *a, *b, *c;      /* operands; E_SLICE: object a, [b:c:args[0]] */
    tt_expr **args;          /* E_LIST items, E_DICT keys, call/filter/test arguments */
    tt_expr **vals;          /* E_DICT values */
    int nargs;
    const char **kwn;        /* keyword arguments */
    tt_expr **kwv;
    int nkw;
    int negate;              /* E_TEST: `is not` */
};

typedef enum { N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_BREAK, N_CONTINUE, N_BLOCK } tt_node_kind;

typedef struct tt_node tt_node;
struct tt_node {
    tt_node_kind kind;
    int line;
    tt_node *next;
    const char *text;        /* N_TEXT */
    size_t len;
    tt_expr *e;              /* N_OUT, N_IF condition, N_FOR iterable, N_SET value */
    tt_expr *cond;           /* N_FOR: its `if` filter */
    tt_node *body, *els;     /* N_IF: then / else (an elif is an N_IF there); N_FOR: body / else */
    const char **names;      /* N_FOR, N_SET, N_SETBLOCK targets */
    int nnames;
    const char *attr;        /* N_SET: `set ns.attr = ...` (names[0] is ns) */
    int is_elif;             /* N_IF: an elif of the N_IF whose els it is */
};

typedef struct {
    tt_arena arena;
    tt_node *body;
    char name[128];
} tt_template;

/* Parses text (not NUL-terminated) into t (t->name set by the caller). */
moeq_status tt_parse(tt_template *t, const char *text, size_t len);
/* Renders with the variables of ctx (a TV_DICT built in c's arena) into *out (malloc'ed). */
moeq_status tt_render(const tt_template *t, tt_ctx *c, const tv *vars, char **out, size_t *out_len);

#endif
