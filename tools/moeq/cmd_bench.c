/* moeq bench (not implemented yet). */
#include <stdio.h>

#include "cli.h"
#include "commands.h"

int cmd_bench(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq bench: not implemented yet\n");
    return CLI_FAIL;
}
