/* moeq quantize (not implemented yet). */
#include <stdio.h>

#include "cli.h"
#include "commands.h"

int cmd_quantize(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq quantize: not implemented yet\n");
    return CLI_FAIL;
}
