#!/usr/bin/env bash
# The library's floors (issue 57): every `#include "FLOOR/..."` in src/, and every call between
# floors in the library's objects, is one that docs/ARCHITECTURE.md allows. The page is the one list: its floors table gives, per row
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

# The same arrows as calls: every function an object of src/FLOOR/ calls that another floor defines
# is defined in a floor it may include. An include-clean file can still call upward through a
# declaration a lower floor's header makes (the GPTQ twins once called quant's references). Read with
# nm from the library's objects beside the binary under test; skipped where there are none.
objdir=$(dirname "$cli")/CMakeFiles/moeq.dir/src
calls=0
if command -v nm >/dev/null && [ -d "$objdir" ]; then
    # "FLOOR FILE" for each object, then nm's lines of it
    objects() { (cd "$objdir" && find . -name '*.o' | sort | sed 's|^\./||'); }
    declare -A defined_in
    while read -r sym floor; do
        defined_in[$sym]=$floor
    done < <(objects | while read -r o; do
        nm -g --defined-only "$objdir/$o" | awk -v f="${o%%/*}" 'NF == 3 && $2 != "U" {print $3, f}'
    done)
    [ ${#defined_in[@]} -gt 500 ] || fail "read ${#defined_in[@]} definitions from $objdir"
    while read -r sym floor obj; do
        to=${defined_in[$sym]:-}
        { [ -z "$to" ] || [ "$to" = "$floor" ]; } && continue
        calls=$((calls + 1))
        case "${allowed[$floor]:-}" in *" $to "*) continue ;; esac
        fail "src/${obj%.o} calls $sym, defined in src/$to/: src/$floor/ may include ${allowed[$floor]:-nothing} (docs/ARCHITECTURE.md)"
    done < <(objects | while read -r o; do
        nm -u "$objdir/$o" | awk -v f="${o%%/*}" -v o="$o" '{print $NF, f, o}'
    done)
    [ $calls -gt 500 ] || fail "found $calls calls between floors in $objdir"
fi

# an exception the code no longer needs is a stale line of the page
for key in "${!excepted[@]}"; do
    [ "${excepted[$key]}" = 1 ] || fail "docs/ARCHITECTURE.md lists '$key' as an exception, which no longer happens"
done

[ $fails -eq 0 ] && echo "src floors: $n files, ${#order[@]} floors, ${#excepted[@]} exceptions, $calls calls between floors, every arrow allowed"
exit $((fails > 0))
