/* The safetensors dtypes' names and sizes (moeq.h's moeq_dtype): every floor that describes a
 * tensor names its dtype, so they are core's (io reads the names from files). */
#include "core/core.h"

static const struct {
    const char *name;
    size_t size;
} k_dtypes[MOEQ_DT_COUNT] = {
    [MOEQ_DT_BOOL] = {"BOOL", 1},    [MOEQ_DT_U8] = {"U8", 1},
    [MOEQ_DT_I8] = {"I8", 1},        [MOEQ_DT_F8_E5M2] = {"F8_E5M2", 1},
    [MOEQ_DT_F8_E4M3] = {"F8_E4M3", 1}, [MOEQ_DT_I16] = {"I16", 2},
    [MOEQ_DT_U16] = {"U16", 2},      [MOEQ_DT_F16] = {"F16", 2},
    [MOEQ_DT_BF16] = {"BF16", 2},    [MOEQ_DT_I32] = {"I32", 4},
    [MOEQ_DT_U32] = {"U32", 4},      [MOEQ_DT_F32] = {"F32", 4},
    [MOEQ_DT_F64] = {"F64", 8},      [MOEQ_DT_I64] = {"I64", 8},
    [MOEQ_DT_U64] = {"U64", 8},
};

static bool valid(moeq_dtype dt) { return (int)dt >= 0 && dt < MOEQ_DT_COUNT; }

const char *moeq_dtype_name(moeq_dtype dt) { return valid(dt) ? k_dtypes[dt].name : "?"; }

size_t moeq_dtype_size(moeq_dtype dt) { return valid(dt) ? k_dtypes[dt].size : 0; }

