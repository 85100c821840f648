/* JSON helpers of the bindings' results (see json.h). */
#include "core/json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/core.h"

void moeq_string_free(char *s) { free(s); }

void mq_json_add_num(cJSON *j, const char *k, double v) {
    char t[40];
    if (!isfinite(v)) {
        cJSON_AddNullToObject(j, k);
        return;
    }
    snprintf(t, sizeof t, "%.17g", v);
    cJSON_AddRawToObject(j, k, t);
}

void mq_json_add_nums(cJSON *j, const mq_json_num *t, size_t n) {
    for (size_t i = 0; i < n; i++) mq_json_add_num(j, t[i].key, t[i].v);
}

const char *mq_json_escape(unsigned char c, char t[8]) {
    switch (c) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\b': return "\\b";
    case '\f': return "\\f";
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    default: break;
    }
    if (c >= 0x20) return NULL;
    snprintf(t, 8, "\\u%04x", c);
    return t;
}

char *mq_json_take_text(cJSON *j) {
    char *s = j ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    return s;
}
