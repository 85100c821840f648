#!/usr/bin/env bash
# The CLI's commands (tools/moeq/cmd_*.c, and cli.c and main.c around them) use the library
# through include/moeq.h only: each includes nothing but moeq.h, cli.h, commands.h and system
# headers (<...>), so that the library's internals can change under them (issue 57). The
# benchmarks (bench_*.c) measure internals and may include them.
. "$(dirname "$0")/common.sh"

n=0
for f in "$repo"/tools/moeq/*.c; do
    case "${f##*/}" in bench_*) continue ;; esac
    n=$((n + 1))
    # every #include "..." line, with the file it names
    while IFS= read -r line; do
        name=$(printf '%s\n' "$line" | sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p')
        [ -n "$name" ] || continue
        case "$name" in
            moeq.h | cli.h | commands.h) ;;
            *) fail "${f##*/} includes \"$name\" (a command uses include/moeq.h, cli.h and commands.h only)" ;;
        esac
    done < <(grep -E '^[[:space:]]*#[[:space:]]*include' "$f")
done
[ $n -gt 5 ] || fail "found $n commands under $repo/tools/moeq"
[ -f "$repo/tools/moeq/cli.c" ] && [ -f "$repo/tools/moeq/main.c" ] || fail "no cli.c or main.c under $repo/tools/moeq"
# and the headers they may include reach nothing else
for h in cli.h commands.h; do
    grep -E '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$repo/tools/moeq/$h" | grep -vq '"moeq.h"' &&
        fail "$h includes more than moeq.h"
done

[ $fails -eq 0 ] && echo "cli includes: $n files (commands, cli.c, main.c) on the public API only"
exit $((fails > 0))
