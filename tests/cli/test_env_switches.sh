#!/usr/bin/env bash
# The library's environment switches live in one table (src/core/env.def), are read in one place
# (src/core/env.c) and documented in one table (docs/DEVELOPING.md, "Environment switches"):
# every name and earlier name of the table is in the documentation's, and no other file of src/
# (the CUDA backend's included) reads a MOEQ_* variable.
. "$(dirname "$0")/common.sh"

def=$repo/src/core/env.def
doc=$repo/docs/DEVELOPING.md
n=0
for name in $(grep -o '^MQ_ENV([A-Z0-9_]*, "MOEQ_[A-Z0-9_]*", \(NULL\|"MOEQ_[A-Z0-9_]*"\)' "$def" | grep -o 'MOEQ_[A-Z0-9_]*'); do
    n=$((n + 1))
    grep -q "\`$name\`" "$doc" || fail "$name (src/core/env.def) is not in docs/DEVELOPING.md's table"
done
[ $n -gt 20 ] || fail "read $n names from $def"
others=$(grep -rln 'getenv("MOEQ_' "$repo/src" | grep -v -e '/src/core/env\.c$')
[ -z "$others" ] || fail "read outside src/core/env.c: $others"

[ $fails -eq 0 ] && echo "environment switches: $n names in one table, read in one place"
exit $((fails > 0))
