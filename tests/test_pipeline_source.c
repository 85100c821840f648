/*
 * The walk of moeq_quantize's model directory reads config.json once (issue 57): RTN, GPTQ,
 * --rotate and GGUF output each parse it once and pass it on (core's mq_read_file counts the reads
 * of one file, whoever reads it).
 * And the option table (src/pipeline/quant_options.def) is what moeq_quant_options_set takes:
 * every key moeq_quant_option_info lists is accepted with a value of its kind.
 */
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "core/core.h"

static char g_calib[1100];

static const char *calib_file(void) {
    snprintf(g_calib, sizeof g_calib, "%s/calib.txt", mq_test_tmpdir());
    FILE *f = fopen(g_calib, "w");
    if (!f) FAIL("cannot write %s", g_calib);
    for (int i = 0; i < 20; i++)
        fprintf(f, "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, "
                   "and the clocks were striking thirteen.\n");
    fclose(f);
    return g_calib;
}

/* Quantizes olmoe-tiny with o into a fresh directory; returns the reads of the source's
 * config.json it took, by any reader (mq_read_file counts them; GGUF output reads the written
 * checkpoint's config too, to convert it, which is another file). */
static int64_t reads_of(const moeq_quant_options *o, const char *name) {
    char out[1200], cfg[1200];
    snprintf(out, sizeof out, "%s/%s", mq_test_tmpdir(), name);
    const char *model = mq_test_model("olmoe-tiny");
    snprintf(cfg, sizeof cfg, "%s/config.json", model);
    mq_read_file_watch(cfg);
    const int64_t before = mq_read_file_watched();
    ASSERT_OK(moeq_quantize(model, out, o, NULL));
    const int64_t n = mq_read_file_watched() - before;
    mq_read_file_watch(NULL);
    return n;
}

static void test_config_read_once(void) {
    moeq_quant_options o;
    moeq_quant_options_init(&o);
    o.scheme = MOEQ_QUANT_INT4;
    ASSERT_EQ_INT(1, reads_of(&o, "rtn"));
    o.rotate = MOEQ_ROTATE_RESIDUAL;
    ASSERT_EQ_INT(1, reads_of(&o, "rotated"));
    o.rotate = MOEQ_ROTATE_NONE;
    o.format = MOEQ_FORMAT_GGUF;
    ASSERT_EQ_INT(1, reads_of(&o, "q.gguf"));
    o = mq_test_gptq_options(MOEQ_QUANT_NVFP4A16, calib_file(), 2, 16);
    ASSERT_EQ_INT(1, reads_of(&o, "gptq"));
    o.rotate = MOEQ_ROTATE_RESIDUAL;
    ASSERT_EQ_INT(1, reads_of(&o, "gptq-rotated"));
    o.scheme = MOEQ_QUANT_INT4;   /* GPTQ, --rotate and GGUF output at once (llama.cpp's olmoe: INT4) */
    o.format = MOEQ_FORMAT_GGUF;
    ASSERT_EQ_INT(1, reads_of(&o, "gptq-rotated.gguf"));
}

/* A value each kind of option takes. */
static const char *value_of(const moeq_option_info *x, char *buf, size_t cap) {
    switch (x->kind) {
    case MOEQ_OPTION_SWITCH: return "true";
    case MOEQ_OPTION_INT: snprintf(buf, cap, "%lld", (long long)(x->min <= x->max ? x->max : 7)); return buf;
    case MOEQ_OPTION_NUMBER: return "1";
    case MOEQ_OPTION_CHOICE: {   /* the last of the names */
        const char *bar = strrchr(x->choices, '|');
        snprintf(buf, cap, "%s", bar ? bar + 1 : x->choices);
        return buf;
    }
    default: return NULL;
    }
}

static void test_option_table(void) {
    moeq_quant_options o;
    int n = 0;
    char buf[64];
    for (const moeq_option_info *x; (x = moeq_quant_option_info(n)); n++) {
        ASSERT_TRUE(x->key && x->help && *x->help);
        ASSERT_TRUE((x->kind == MOEQ_OPTION_CHOICE) == (x->choices != NULL));
        const char *v = value_of(x, buf, sizeof buf);
        moeq_quant_options_init(&o);
        if (v && moeq_quant_options_set(&o, x->key, v)) FAIL("%s=%s: %s", x->key, v, moeq_last_error());
        /* a value no option takes names the key and the value */
        if (x->kind != MOEQ_OPTION_TEXT && x->kind != MOEQ_OPTION_SWITCH && x->kind != MOEQ_OPTION_LIST) {
            ASSERT_STATUS(MOEQ_E_ARG, moeq_quant_options_set(&o, x->key, "-x-"));
            char want[96];
            snprintf(want, sizeof want, "%s=-x-: expected ", x->key);
            if (!strstr(moeq_last_error(), want)) FAIL("%s: message '%s'", x->key, moeq_last_error());
        }
    }
    ASSERT_TRUE(n > 50);
    ASSERT_TRUE(moeq_quant_option_info(-1) == NULL && moeq_quant_option_info(n) == NULL);
    ASSERT_STATUS(MOEQ_E_ARG, moeq_quant_options_set(&o, "bogus", "1"));
    /* the defaults are the table's */
    moeq_quant_options_init(&o);
    ASSERT_TRUE(o.gptq.percdamp == 0.01 && o.gptq.mse == 1 && o.gptq.act_order == -1);
    ASSERT_TRUE(o.gptq.target_unquantized == -1 && o.gptq.refine_passes == -1 && o.calib_tokens == 65536);
}

TEST_MAIN(T(test_option_table), T(test_config_read_once))
