/* moeq eval (not implemented yet). */
#include <stdio.h>

#include "cli.h"
#include "commands.h"

int cmd_eval(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq eval: not implemented yet\n");
    return CLI_FAIL;
}
