/*
 * libFuzzer target for what `quantize --resume` reads from a work directory (pipeline/workdir.c):
 * the input is manifest.json and an activation snapshot (acts-<layer>.bin), cut at a FUZZ_SEP line
 * (fuzz_common.h). The manifest is parsed (an error names it), compared with a run's identity,
 * its finished layers checked against a plan of 3 layers whose tensors all check out (so the
 * records' own form decides), and the snapshot it names is read at the calibration's shape the
 * manifest records: rows only of that shape reach the activations, none past their buffer (ASan),
 * and a layer is taken only from a whole file whose CRC is the manifest's. Seeds: a GPTQ run
 * killed after its second layer (tests/fuzz/workdir_seeds.sh).
 */
#include "fuzz_common.h"
#include "pipeline/internal.h"

enum { PLAN_LAYERS = 3, MAX_S = 16, MAX_LEN = 64, MAX_D = 256 };

static const char k_path[] = "fuzz-work/manifest.json";

static moeq_status verify(void *user, const char *tensor, uint32_t crc) {
    (void)user, (void)crc;
    /* a tensor the plan does not hold is the writer's error, naming it */
    if (strncmp(tensor, "model.", 6) && strcmp(tensor, "lm_head.weight"))
        return mq_err(MOEQ_E_FORMAT, "fuzz-work: tensor '%s' is not in the plan", tensor);
    return MOEQ_OK;
}

static int count(void *user, int layer) {
    /* the plan: as many tensors as the record holds, but none past the last layer */
    const cJSON *m = user;
    if (layer < 0) return cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(m, "globals"));
    const cJSON *rec = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(m, "layers"), layer);
    return layer < PLAN_LAYERS ? cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(rec, "tensors")) : 0;
}

typedef struct {
    float *rows;                  /* [streams * S][MAX_LEN * MAX_D] */
    const mq_acts_shape *a;
} sink;

static void put(void *user, int64_t r, const float *v, size_t n) {
    sink *k = user;
    if (r < 0 || r >= k->a->samples * k->a->streams || n != (size_t)(k->a->len[r % k->a->samples] * k->a->D))
        abort();
    memcpy(k->rows + r * (MAX_LEN * MAX_D), v, n * sizeof *v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[2];
    size_t len[2];
    fuzz_split(data, size, 2, part, len);
    cJSON *m = NULL;
    moeq_status s = mq_work_manifest_parse(k_path, (const char *)part[0], len[0], &m);
    if (s) {
        fuzz_check_error(s, k_path, "manifest");
        return 0;
    }
    /* another run's identity: a difference is found, or none where they are the same */
    cJSON *now = cJSON_Parse("{\"source\": {\"files\": []}, \"options\": {\"scheme\": \"nvfp4\"},"
                             " \"calibration\": {\"samples\": 2}, \"plan\": {\"layers\": 3}}");
    free(mq_work_identity_diff(m, now));
    cJSON_Delete(now);
    const mq_work_check chk = {verify, count, m};
    const int done = mq_work_layers_check(m, k_path, PLAN_LAYERS, &chk);
    if (done < 0 || done > PLAN_LAYERS || cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(m, "layers")) != done)
        abort();
    /* the snapshot, at the calibration the manifest records (samples of equal length) */
    int layer;
    uint32_t crc;
    const cJSON *cal = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m, "identity"), "calibration");
    const cJSON *ns = cJSON_GetObjectItemCaseSensitive(cal, "samples"), *nt = cJSON_GetObjectItemCaseSensitive(cal, "tokens");
    int64_t S, T;
    if (mq_work_boundary(m, &layer, &crc) && cJSON_IsNumber(ns) && cJSON_IsNumber(nt) &&
        mq_int_of(ns->valuedouble, 1, MAX_S, &S) && mq_int_of(nt->valuedouble, S, S * MAX_LEN, &T) && T % S == 0) {
        int64_t lens[MAX_S];
        for (int64_t i = 0; i < S; i++) lens[i] = T / S;
        /* D as the file's header says, where it is one the buffers take (the pipeline knows it) */
        int64_t D = 0;
        if (len[1] >= 40) memcpy(&D, part[1] + 32, sizeof D);
        /* the unquantized target's run keeps its own stream beside the quantized one */
        const cJSON *opt = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(m, "identity"), "options");
        const int streams = cJSON_GetObjectItemCaseSensitive(opt, "target_unquantized") ? 2 : 1;
        if (D >= 1 && D <= MAX_D) {
            const mq_acts_shape a = {layer, S, D, lens, streams, crc};
            float *rows = calloc((size_t)(2 * MAX_S * MAX_LEN * MAX_D), sizeof *rows);
            float *tmp = malloc((size_t)(MAX_LEN * MAX_D) * sizeof *tmp);
            if (!rows || !tmp) abort();
            sink k = {rows, &a};
            char name[32];
            snprintf(name, sizeof name, "acts-%d.bin", layer);
            const char *path = fuzz_file(1, name, part[1], len[1]);
            (void)mq_work_acts_read(path, &a, tmp, put, &k);
            fuzz_unlink(name);
            free(rows);
            free(tmp);
        }
    }
    cJSON_Delete(m);
    return 0;
}
