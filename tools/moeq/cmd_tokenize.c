/* moeq tokenize (not implemented yet). */
#include <stdio.h>

#include "cli.h"
#include "commands.h"

int cmd_tokenize(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeq tokenize: not implemented yet\n");
    return CLI_FAIL;
}
