#!/usr/bin/env bash
# The library's floors (issue 57): every `#include "FLOOR/..."` in src/ is one that
# docs/ARCHITECTURE.md allows. The page is the one list: its floors table gives, per row
# `src/FLOOR/`, the floors it may include (its last column, comma-separated), and its exceptions
# table gives single `src/FILE` includes `HEADER` lines that are let through. A floor may include
# itself, `moeq.h` and its own folder's headers by bare name; a "may include" entry must be a floor
# of an earlier row (so the arrows cannot form a cycle), and every src/ folder must have a row.
. "$(dirname "$0")/common.sh"

page=$repo/docs/ARCHITECTURE.md
[ -f "$page" ] || { fail "no $page"; exit 1; }

declare -A allowed seen
order=()
# | `src/FLOOR/` | what it holds | a, b, c |
while IFS= read -r line; do
    floor=$(printf '%s\n' "$line" | sed -n 's/^| `src\/\([a-z_]*\)\/` |.*/\1/p')
    [ -n "$floor" ] || continue
    may=${line%|}
    may=${may##*|}
    may=$(printf '%s' "$may" | tr -d '` ')
    list=" $floor "
    IFS=',' read -r -a names <<<"$may"
    for n in "${names[@]}"; do
        [ "$n" = include/moeq.h ] && continue
        [ -n "${seen[$n]:-}" ] || fail "ARCHITECTURE.md: src/$floor/ may include '$n', not a floor of an earlier row"
        list="$list$n "
    done
    allowed[$floor]=$list
    seen[$floor]=1
    order+=("$floor")
done <"$page"
[ ${#order[@]} -ge 10 ] || fail "read ${#order[@]} floors from $page"

# | `src/FILE` includes `HEADER` | why |
declare -A excepted
while IFS= read -r line; do
    key=$(printf '%s\n' "$line" | sed -n 's/^| `\(src\/[^`]*\.[a-z]*\)` includes `\([^`]*\)` |.*/\1 \2/p')
    [ -n "$key" ] && excepted[$key]=0
done <"$page"

for d in "$repo"/src/*/; do
    d=${d%/}
    d=${d##*/}
    [ -n "${allowed[$d]:-}" ] || fail "src/$d/ has no row in the floors table of docs/ARCHITECTURE.md"
done

n=0
while IFS= read -r f; do
    rel=${f#"$repo"/}
    floor=${rel#src/}
    floor=${floor%%/*}
    dir=$(dirname "$f")
    n=$((n + 1))
    while IFS= read -r name; do
        case "$name" in
            */*)
                to=${name%%/*}
                case "${allowed[$floor]:-}" in *" $to "*) continue ;; esac
                if [ -n "${excepted[$rel $name]+x}" ]; then
                    excepted[$rel $name]=1
                    continue
                fi
                fail "$rel includes \"$name\": src/$floor/ may include ${allowed[$floor]:-nothing} (docs/ARCHITECTURE.md)"
                ;;
            moeq.h) ;;
            *) [ -f "$dir/$name" ] || fail "$rel includes \"$name\", not a header of its own folder" ;;
        esac
    done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f")
done < <(find "$repo/src" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.def' \) | sort)
[ $n -gt 100 ] || fail "found $n source files under $repo/src"

# an exception the code no longer needs is a stale line of the page
for key in "${!excepted[@]}"; do
    [ "${excepted[$key]}" = 1 ] || fail "docs/ARCHITECTURE.md lists '$key' as an exception, which no longer happens"
done

[ $fails -eq 0 ] && echo "src floors: $n files, ${#order[@]} floors, ${#excepted[@]} exceptions, every arrow allowed"
exit $((fails > 0))
