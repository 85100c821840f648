/* moeq generate (not implemented yet). */
#include <stdio.h>

#include "cli.h"
#include "commands.h"

int cmd_generate(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq generate: not implemented yet\n");
    return CLI_FAIL;
}
