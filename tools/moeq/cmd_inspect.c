/* moeq inspect (not implemented yet). */
#include <stdio.h>

#include "cli.h"
#include "commands.h"

int cmd_inspect(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq inspect: not implemented yet\n");
    return CLI_FAIL;
}
