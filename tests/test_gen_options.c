/*
 * The generation option table (src/runtime/gen_options.def) as moeq_gen_options_set and
 * moeq_gen_option_info give it: every row takes a value of its kind and stores it where the
 * sampler and moeq_gen_run read it, refuses values outside its range with a message naming the
 * key, accepts exactly what the sampler accepts at the edges, and the defaults are the header's.
 * The request fields of /v1/completions go through the same setter.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "moeq.h"

/* A value of the row's kind that differs from every default. */
static const char *other_value(const moeq_option_info *x) {
    switch (x->kind) {
    case MOEQ_OPTION_SWITCH: return "true";
    case MOEQ_OPTION_INT: return "7";
    default: return "0.5";
    }
}

static void test_every_row_sets_its_field(void) {
    moeq_gen_options base, o;
    moeq_gen_options_init(&base);
    int n = 0;
    for (const moeq_option_info *x; (x = moeq_gen_option_info(n)); n++) {
        ASSERT_TRUE(x->key && x->help && *x->help);
        ASSERT_TRUE(x->kind == MOEQ_OPTION_SWITCH || x->kind == MOEQ_OPTION_INT || x->kind == MOEQ_OPTION_NUMBER);
        ASSERT_TRUE((x->kind == MOEQ_OPTION_SWITCH) == (x->metavar == NULL));
        for (int k = 0; k < n; k++)
            if (!strcmp(moeq_gen_option_info(k)->key, x->key)) FAIL("key %s twice", x->key);
        moeq_gen_options_init(&o);
        const char *v = other_value(x);
        if (moeq_gen_options_set(&o, x->key, v)) FAIL("%s=%s: %s", x->key, v, moeq_last_error());
        /* the value landed somewhere: the struct is no longer the defaults */
        if (!memcmp(&o, &base, sizeof o)) FAIL("%s=%s changed nothing", x->key, v);
        /* and the sampler takes every value the setter takes */
        moeq_sampler *s = NULL;
        if (moeq_sampler_create(&o.sampling, &s)) FAIL("%s=%s: sampler: %s", x->key, v, moeq_last_error());
        moeq_sampler_free(s);
        char want[64];   /* text of no kind is refused, naming the key */
        ASSERT_STATUS(MOEQ_E_ARG, moeq_gen_options_set(&o, x->key, "-x-"));
        snprintf(want, sizeof want, "%s=-x-: expected ", x->key);
        if (!strstr(moeq_last_error(), want)) FAIL("%s: message '%s'", x->key, moeq_last_error());
    }
    ASSERT_EQ_INT(10, n);
    ASSERT_TRUE(moeq_gen_option_info(-1) == NULL && moeq_gen_option_info(n) == NULL);
    ASSERT_STATUS(MOEQ_E_ARG, moeq_gen_options_set(&o, "temperature", "1"));   /* the flag's name only */
    ASSERT_ERROR_MENTIONS("'temperature'");
    ASSERT_STATUS(MOEQ_E_ARG, moeq_gen_options_set(NULL, "temp", "1"));
    ASSERT_STATUS(MOEQ_E_ARG, moeq_gen_options_set(&o, "temp", NULL));
    ASSERT_TRUE(moeq_gen_options_size() == sizeof(moeq_gen_options));
}

/* Each field by its key, and the ones that ask for sampling. */
static void test_fields_and_sampling_rows(void) {
    moeq_gen_options o;
    moeq_gen_options_init(&o);
    ASSERT_OK(moeq_gen_options_set(&o, "temp", "0.7"));
    ASSERT_OK(moeq_gen_options_set(&o, "top-k", "40"));
    ASSERT_OK(moeq_gen_options_set(&o, "top-p", "0.9"));
    ASSERT_OK(moeq_gen_options_set(&o, "min-p", "0.05"));
    ASSERT_OK(moeq_gen_options_set(&o, "seed", "-1"));
    ASSERT_OK(moeq_gen_options_set(&o, "repeat-penalty", "1.1"));
    ASSERT_OK(moeq_gen_options_set(&o, "repeat-last-n", "-1"));
    ASSERT_OK(moeq_gen_options_set(&o, "presence-penalty", "-0.5"));
    ASSERT_OK(moeq_gen_options_set(&o, "frequency-penalty", "0.25"));
    ASSERT_OK(moeq_gen_options_set(&o, "ignore-eos", "true"));
    ASSERT_NEAR(0.7, o.sampling.temperature, 0);
    ASSERT_EQ_INT(40, o.sampling.top_k);
    ASSERT_NEAR(0.9, o.sampling.top_p, 0);
    ASSERT_NEAR(0.05, o.sampling.min_p, 0);
    ASSERT_TRUE(o.sampling.seed == UINT64_MAX);   /* -1 as the CLI has always stored it */
    ASSERT_NEAR(1.1, o.sampling.repeat_penalty, 0);
    ASSERT_EQ_INT(-1, o.sampling.repeat_last_n);
    ASSERT_NEAR(-0.5, o.sampling.presence_penalty, 0);
    ASSERT_NEAR(0.25, o.sampling.frequency_penalty, 0);
    ASSERT_EQ_INT(1, o.ignore_eos);
    ASSERT_OK(moeq_gen_options_set(&o, "ignore-eos", "false"));
    ASSERT_EQ_INT(0, o.ignore_eos);
    const char *sampling[] = {"temp", "top-k", "top-p", "min-p", "seed"};
    for (int i = 0; moeq_gen_option_info(i); i++) {
        const moeq_option_info *x = moeq_gen_option_info(i);
        int want = 0;
        for (size_t k = 0; k < sizeof sampling / sizeof sampling[0]; k++) want |= !strcmp(x->key, sampling[k]);
        if (x->identity != want) FAIL("%s: identity %d, want %d (asks for sampling)", x->key, x->identity, want);
    }
}

/* Values outside a row's range are refused naming key and value; the edges inside are taken, and
 * each refused value is one the sampler refuses too. */
static void test_ranges(void) {
    static const struct {
        const char *key, *value, *says;
    } bad[] = {
        {"temp", "-1", "a number >= 0"},
        {"temp", "inf", "a number"},
        {"top-k", "-1", "an integer from 0 to 2147483647"},
        {"top-k", "2147483648", "an integer from 0"},
        {"top-k", "1.5", "an integer"},
        {"top-p", "0", "(0, 1]"},
        {"top-p", "1.5", "a number in (0, 1]"},
        {"min-p", "1.01", "a number from 0 to 1"},
        {"min-p", "-0.1", "a number from 0 to 1"},
        {"repeat-penalty", "0", "a number > 0"},
        {"repeat-penalty", "-2", "a number > 0"},
        {"repeat-last-n", "-2", "an integer from -1"},
        {"presence-penalty", "inf", "a number"},
        {"frequency-penalty", "nan", "a number"},
        {"seed", "x", "an integer"},
        {"ignore-eos", "yes", "true or false"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        moeq_gen_options o;
        moeq_gen_options_init(&o);
        moeq_gen_options before = o;
        char want[96];
        if (moeq_gen_options_set(&o, bad[i].key, bad[i].value) != MOEQ_E_ARG)
            FAIL("%s=%s accepted", bad[i].key, bad[i].value);
        snprintf(want, sizeof want, "%s=%s: expected ", bad[i].key, bad[i].value);
        if (!strstr(moeq_last_error(), want) || !strstr(moeq_last_error(), bad[i].says))
            FAIL("%s=%s: message '%s'", bad[i].key, bad[i].value, moeq_last_error());
        if (memcmp(&o, &before, sizeof o)) FAIL("%s=%s: refused but stored", bad[i].key, bad[i].value);
    }
    static const struct {
        const char *key, *value;
    } edge[] = {{"temp", "0"}, {"top-k", "0"}, {"top-k", "2147483647"}, {"top-p", "1"}, {"top-p", "1e-300"},
                {"min-p", "0"}, {"min-p", "1"}, {"repeat-penalty", "1e-300"}, {"repeat-last-n", "-1"},
                {"repeat-last-n", "0"}, {"seed", "9223372036854775807"}, {"presence-penalty", "-1e300"}};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) {
        moeq_gen_options o;
        moeq_gen_options_init(&o);
        if (moeq_gen_options_set(&o, edge[i].key, edge[i].value))
            FAIL("%s=%s: %s", edge[i].key, edge[i].value, moeq_last_error());
        moeq_sampler *s = NULL;
        if (moeq_sampler_create(&o.sampling, &s)) FAIL("%s=%s: sampler refused it", edge[i].key, edge[i].value);
        moeq_sampler_free(s);
    }
    /* just past an edge, set on the struct: the sampler refuses what the setter refuses */
    moeq_sampler_options so;
    moeq_sampler *s = NULL;
    moeq_sampler_options_init(&so);
    so.top_p = 0;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_sampler_create(&so, &s));
    moeq_sampler_options_init(&so);
    so.repeat_last_n = -2;
    ASSERT_STATUS(MOEQ_E_ARG, moeq_sampler_create(&so, &s));
}

static void test_defaults(void) {
    moeq_sampler_options s;
    moeq_sampler_options_init(&s);
    ASSERT_NEAR(1.0, s.temperature, 0);
    ASSERT_EQ_INT(0, s.top_k);
    ASSERT_NEAR(1.0, s.top_p, 0);
    ASSERT_NEAR(0.0, s.min_p, 0);
    ASSERT_NEAR(1.0, s.repeat_penalty, 0);
    ASSERT_EQ_INT(64, s.repeat_last_n);
    ASSERT_NEAR(0.0, s.presence_penalty, 0);
    ASSERT_NEAR(0.0, s.frequency_penalty, 0);
    ASSERT_TRUE(s.seed == 0);
    moeq_gen_options g;
    moeq_gen_options_init(&g);
    ASSERT_NEAR(0.0, g.sampling.temperature, 0);   /* greedy */
    g.sampling.temperature = s.temperature;
    ASSERT_TRUE(!memcmp(&g.sampling, &s, sizeof s));
    ASSERT_EQ_INT(0, g.max_tokens);
    ASSERT_EQ_INT(0, g.n_stop);
    ASSERT_EQ_INT(0, g.ignore_eos);
}

/* The request fields are the table's rows: a field takes what the flag takes and a refused value
 * names the field (its OpenAI name, and the alias of repeat_penalty). */
static void test_request_fields(void) {
    static const struct {
        const char *body, *mention;
    } bad[] = {
        {"{\"prompt\": \"a\", \"top_k\": -1}", "'top_k' -1: expected an integer from 0"},
        {"{\"prompt\": \"a\", \"top_k\": 2.5}", "'top_k' must be an integer"},
        {"{\"prompt\": \"a\", \"repeat_last_n\": -2}", "'repeat_last_n'"},
        {"{\"prompt\": \"a\", \"repeat_penalty\": 0}", "'repeat_penalty' 0: expected a number > 0"},
        {"{\"prompt\": \"a\", \"min_p\": 2}", "'min_p'"},
        {"{\"prompt\": \"a\", \"ignore_eos\": 1}", "'ignore_eos' must be true or false"},
        {"{\"prompt\": \"a\", \"frequency_penalty\": \"x\"}", "'frequency_penalty' must be a number"},
    };
    moeq_openai_request r;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (moeq_openai_parse(bad[i].body, strlen(bad[i].body), 0, NULL, &r) != MOEQ_E_ARG)
            FAIL("%s accepted", bad[i].body);
        if (!strstr(moeq_last_error(), bad[i].mention)) FAIL("%s: message '%s'", bad[i].body, moeq_last_error());
    }
    /* both names of the repeat penalty; the later in the table's list wins */
    const char *both = "{\"prompt\": \"a\", \"repetition_penalty\": 1.5, \"repeat_penalty\": 1.25, \"seed\": 3}";
    ASSERT_OK(moeq_openai_parse(both, strlen(both), 0, NULL, &r));
    ASSERT_NEAR(1.25, r.gen.sampling.repeat_penalty, 0);
    ASSERT_TRUE(r.gen.sampling.seed == 3);
    ASSERT_NEAR(1.0, r.gen.sampling.temperature, 0);   /* OpenAI's default, not greedy */
    moeq_openai_request_free(&r);
}

/* The stop-string scan that moeq_gen_run and `moeq generate` share. */
static void test_stop_scan(void) {
    const char *stop[] = {"END", "\n\n"};
    const char *t = "abc\nEN";
    int32_t which = -1;
    ASSERT_EQ_INT(strlen(t) + 1, moeq_gen_find_stop(t, strlen(t), 0, stop, 2, &which));
    ASSERT_EQ_INT(-1, which);
    /* "EN" may become "END", and a final "\n" "\n\n": neither is certain yet */
    ASSERT_EQ_INT(4, moeq_gen_certain(t, strlen(t), stop, 2));
    ASSERT_EQ_INT(3, moeq_gen_certain(t, 4, stop, 2));
    ASSERT_EQ_INT(4, moeq_gen_certain(t, 4, stop, 1));
    const char *u = "xy ENDz\n\n";
    ASSERT_EQ_INT(3, moeq_gen_find_stop(u, strlen(u), 0, stop, 2, &which));
    ASSERT_EQ_INT(0, which);
    ASSERT_EQ_INT(7, moeq_gen_find_stop(u, strlen(u), 4, stop, 2, &which));   /* from 4: past END */
    ASSERT_EQ_INT(1, which);
    /* a trailing U+FFFD waits for the next token; one inside the text does not */
    const char *f = "a\xef\xbf\xbd" "b\xef\xbf\xbd";
    ASSERT_EQ_INT(5, moeq_gen_certain(f, strlen(f), NULL, 0));
    ASSERT_EQ_INT(strlen(f) - 1, moeq_gen_certain(f, strlen(f) - 1, NULL, 0));
}

TEST_MAIN(T(test_stop_scan), T(test_every_row_sets_its_field), T(test_fields_and_sampling_rows), T(test_ranges), T(test_defaults),
          T(test_request_fields))
