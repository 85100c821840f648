/* moeq bench gptq (not implemented yet). */
#include <stdio.h>

#include "bench.h"
#include "cli.h"

int bench_gptq(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq bench: gptq: not implemented yet\n");
    return CLI_FAIL;
}
