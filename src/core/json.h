/*
 * JSON for the bindings' results (moeq_*_result_json, moeq_inspect_json): numbers written so that
 * a reader gets the same double back.
 */
#ifndef MOEQ_CORE_JSON_H
#define MOEQ_CORE_JSON_H

#include <cjson/cJSON.h>

/* k: v as %.17g (cJSON's own printing may drop the last bit); a non-finite v as null. */
void mq_json_add_num(cJSON *j, const char *k, double v);
/* j printed without spaces (malloc'd, release with moeq_string_free), and j deleted; NULL when
 * j is NULL or memory runs out. */
char *mq_json_take_text(cJSON *j);

#endif
