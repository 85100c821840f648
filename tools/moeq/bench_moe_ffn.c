/* moeq bench moe_ffn (not implemented yet). */
#include <stdio.h>

#include "bench.h"
#include "cli.h"

int bench_moe_ffn(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq bench: moe_ffn: not implemented yet\n");
    return CLI_FAIL;
}
