/*
 * A growing text buffer (the report pages, the safetensors headers and index, the wikitext
 * detokenizer's passes), and for the report pages (the GPTQ report, the evaluation report) XML
 * escaping and the few SVG pieces both draw with. The pages are XHTML with inline SVG and
 * nothing else, so an XML parser reads them back.
 */
#ifndef MOEQ_CORE_PAGE_H
#define MOEQ_CORE_PAGE_H

#include "core/core.h"

typedef struct {
    char *s;
    size_t n, cap;
    bool oom;      /* an allocation failed: later writes are dropped; check before saving */
} mq_page;

/* The buffer stays NUL-terminated after anything was written (s is NULL before). */
void mq_page_put(mq_page *b, const char *t, size_t n);
void mq_page_printf(mq_page *b, const char *fmt, ...) MQ_PRINTF(2, 3);
/* Text for element content and attribute values (& < > " escaped). */
void mq_page_text(mq_page *b, const char *t);
/* An 11 px SVG text at (x, y); anchor "start", "middle" or "end". */
void mq_page_label(mq_page *b, double x, double y, const char *anchor, const char *text);
/* A colour from white (t = 0) to deep blue (t = 1), "#rrggbb". */
void mq_page_shade(double t, char out[8]);
/* The XHTML head (title, the shared style) and the closing lines; save writes the page
 * atomically (MOEQ_E_NOMEM if the buffer ran out) and frees the buffer. */
void mq_page_begin(mq_page *b, const char *title);
void mq_page_end(mq_page *b);
moeq_status mq_page_save(mq_page *b, const char *path);

#endif
