/*
 * JSON for the bindings' results (moeq_*_result_json, moeq_inspect_json): numbers written so that
 * a reader gets the same double back.
 */
#ifndef MOEQ_CORE_JSON_H
#define MOEQ_CORE_JSON_H

#include <stddef.h>

#include <cjson/cJSON.h>

/* k: v as %.17g (cJSON's own printing may drop the last bit); a non-finite v as null. */
void mq_json_add_num(cJSON *j, const char *k, double v);
/* A key and its number: a row of a table written with mq_json_add_nums. */
typedef struct {
    const char *key;
    double v;
} mq_json_num;
/* Each of t[0..n) as mq_json_add_num, in order. */
void mq_json_add_nums(cJSON *j, const mq_json_num *t, size_t n);
/* The escape of byte c inside a JSON string as serde_json and Python's json write it: the short
 * forms (\" \\ \b \f \n \r \t), \u00xx for another control byte (spelled in t), NULL for a
 * byte that stands as itself. */
const char *mq_json_escape(unsigned char c, char t[8]);
/* j printed without spaces (malloc'd, release with moeq_string_free), and j deleted; NULL when
 * j is NULL or memory runs out. */
char *mq_json_take_text(cJSON *j);

#endif
