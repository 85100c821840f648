#!/usr/bin/env bash
# The option tables (issue 57) agree with what the commands show: every row of
# src/eval/eval_options.def is a flag of `moeq eval --help` and a key of its --json "settings"
# (KEY with '_' for '-'), the settings hold no other key and record the values given; every flag
# of `moeq eval --help` is a row or one of cmd_eval.c's own flags; and every row of
# src/pipeline/quant_options.def is a flag of `moeq quantize --help`; every row of
# src/runtime/gen_options.def is a flag of `moeq generate --help` and `moeq chat --help`, whose
# other flags are each command's own, and moeq generate takes each row's flag with a value of its
# kind (the setter knows the key) and refuses a value out of range naming the flag.
. "$(dirname "$0")/common.sh"

# the keys of a table: the first string of each row, MQ_xOPT("key", ...
table_keys() { sed -n "s/^$1(\"\\([a-z0-9-]*\\)\".*/\\1/p" "$2"; }
help_flags() { "$cli" "$1" --help 2>&1 | sed -n 's/^ *\(--[a-z0-9-]*\).*/\1/p' | sort -u; }

eval_keys=$(table_keys MQ_EOPT "$repo/src/eval/eval_options.def")
quant_keys=$(table_keys MQ_QOPT "$repo/src/pipeline/quant_options.def")
[ "$(printf '%s\n' "$eval_keys" | wc -l)" -ge 15 ] || fail "read too few rows of eval_options.def: $eval_keys"
[ "$(printf '%s\n' "$quant_keys" | wc -l)" -ge 50 ] || fail "read too few rows of quant_options.def"

eval_help=$(help_flags eval)
quant_help=$(help_flags quantize)
for k in $eval_keys; do
    printf '%s\n' "$eval_help" | grep -qx -- "--$k" || fail "eval_options.def row $k: no --$k in moeq eval --help"
done
for k in $quant_keys; do
    printf '%s\n' "$quant_help" | grep -qx -- "--$k" || fail "quant_options.def row $k: no --$k in moeq quantize --help"
done
# the command's own flags, as cmd_eval.c spells them ({"--name", ...} and the --revision macro)
own=$(sed -n 's/.*{"\(--[a-z0-9-]*\)", OPT_.*/\1/p' "$repo/tools/moeq/cmd_eval.c"; echo --revision)
for f in $eval_help; do
    [ "$f" = --help ] && continue
    printf '%s\n' $eval_keys | sed 's/^/--/' | grep -qx -- "$f" && continue
    printf '%s\n' "$own" | grep -qx -- "$f" || fail "moeq eval --help shows $f, neither a row of eval_options.def nor a flag of cmd_eval.c"
done

# the settings of a run: a key per row, the given values
printf ' = T = \n A short page of text . \n' > "$tmp/wiki.txt"
"$cli" eval "$model" --data "$tmp/wiki.txt" --json --max-length 8 --limit 1 --entropy --temperature 2 \
    --max-memory 6GB > "$tmp/e.json" 2> "$tmp/err" || fail "eval --json: $(cat "$tmp/err")"
if command -v python3 >/dev/null; then
    python3 - "$tmp/e.json" $eval_keys <<'EOF' || fail "eval --json settings (above)"
import json, sys
s = json.load(open(sys.argv[1]))["settings"]
want = {k.replace("-", "_") for k in sys.argv[2:]}
assert set(s) == want, f"settings keys {sorted(s)} != table {sorted(want)}"
assert s["max_length"] == 8 and s["limit"] == 1 and s["entropy"] is True and s["temperature"] == 2, s
assert s["max_memory"] == 6e9 and s["task"] == "wikitext" and s["device"] == "cpu", s
assert s["top_k"] == 64 and s["add_bos"] is False and s["kl_logits"] is None, s
assert s["gpu_precision"] == "fp32" and s["resume"] is False and s["dry_run"] is False, s
EOF
else
    for k in $eval_keys; do
        grep -q "\"${k//-/_}\":" "$tmp/e.json" || fail "eval --json settings: no ${k//-/_}"
    done
fi

# the generation table: flags, help, the setter by key
gen_keys=$(table_keys MQ_GOPT "$repo/src/runtime/gen_options.def")
[ "$(printf '%s\n' "$gen_keys" | wc -l)" -ge 10 ] || fail "read too few rows of gen_options.def: $gen_keys"
for c in generate chat; do
    c_help=$(help_flags $c)
    for k in $gen_keys; do
        printf '%s\n' "$c_help" | grep -qx -- "--$k" || fail "gen_options.def row $k: no --$k in moeq $c --help"
    done
    # the command's own flags: {"--name", OPT_...} and the CLI_*_OPT macros of cli.h it uses
    own=$(sed -n 's/.*{"\(-[-a-z0-9]*\)", OPT_.*/\1/p' "$repo/tools/moeq/cmd_$c.c"
          for m in $(grep -o 'CLI_[A-Z]*_OPT' "$repo/tools/moeq/cmd_$c.c" | sort -u); do
              sed -n "/^#define $m(/,/OPT_/s/.*{\"\(--[a-z0-9-]*\)\".*/\1/p" "$repo/tools/moeq/cli.h"
          done)
    for f in $c_help; do
        [ "$f" = --help ] && continue
        printf '%s\n' $gen_keys | sed 's/^/--/' | grep -qx -- "$f" && continue
        printf '%s\n' "$own" | grep -qx -- "$f" || fail "moeq $c --help shows $f, neither a row of gen_options.def nor a flag of cmd_$c.c"
    done
done
# each row's kind, from the table: a value it takes and one out of its range
kinds=$(sed -n 's/^MQ_GOPT("\([a-z0-9-]*\)", \([A-Z_]*\),.*/\1 \2/p' "$repo/src/runtime/gen_options.def")
[ "$(printf '%s\n' "$kinds" | wc -l)" -eq "$(printf '%s\n' "$gen_keys" | wc -l)" ] || fail "read the kinds of gen_options.def: $kinds"
while read -r k kind; do
    case $kind in
        SWITCH) good=(); bad=() ;;
        INT) good=(3); bad=(x) ;;
        *) good=(0.5); bad=(inf) ;;
    esac
    "$cli" generate "$model" --prompt "The" -n 1 "--$k" "${good[@]}" > /dev/null 2> "$tmp/err" ||
        fail "generate --$k ${good[*]}: refused: $(cat "$tmp/err")"
    [ ${#bad[@]} -eq 0 ] && continue
    "$cli" generate "$model" --prompt "The" -n 1 "--$k" "${bad[@]}" > /dev/null 2> "$tmp/err"
    [ $? -eq 2 ] && grep -q -- "--$k" "$tmp/err" || fail "generate --$k ${bad[*]}: expected exit 2 naming --$k: $(cat "$tmp/err")"
done <<< "$kinds"

[ $fails -eq 0 ] && echo "option tables: $(printf '%s\n' $eval_keys | wc -l) eval, $(printf '%s\n' $quant_keys | wc -l) quantize and $(printf '%s\n' $gen_keys | wc -l) generation rows, help and JSON agree"
exit $((fails > 0))
