#!/usr/bin/env bash
# moeq bench moe-ffn on a small shape: the JSON object has the documented keys and one result per
# (token count, routing) with positive rates; the text report prints the ratios; bad options are
# usage errors (exit 2).
. "$(dirname "$0")/common.sh"
small=(--experts 8 --topk 2 --hidden 256 --ffn 128 --seconds 0.02 --quick)

for scheme in int4 nvfp4; do
    out=$("$cli" bench moe-ffn "${small[@]}" --tokens 1,5 --scheme "$scheme" --threads 2 --json) ||
        fail "$scheme: exited $?"
    [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] || fail "$scheme: JSON is not one line: $out"
    for key in '"sgemm_gflops": ' '"dram_gbps": ' '"dram_gbps_near": ' '"results": \[' "\"scheme\": \"$scheme\""; do
        printf '%s' "$out" | grep -q "$key" || fail "$scheme: no $key in $out"
    done
    n=$(printf '%s' "$out" | grep -o '"tokens": [0-9]*, "routing": "[a-z]*"' | sort -u | wc -l)
    [ "$n" -eq 4 ] || fail "$scheme: expected 4 (tokens, routing) results, got $n: $out"
    printf '%s' "$out" | grep -q '"gflops": 0\.000' && fail "$scheme: a zero rate: $out"
done
out=$("$cli" bench moe-ffn "${small[@]}" --tokens 3 --routing fixed --group 64) || fail "text exited $?"
printf '%s' "$out" | grep -q "tokens    3 fixed .* GFLOP/s (.* x sgemm) .* GB/s (.* x bw [0-9.]*)" ||
    fail "text report: $out"
printf '%s' "$out" | grep -q "varied" && fail "--routing fixed still ran varied: $out"
"$cli" bench moe-ffn --tokens 0 >/dev/null 2>&1; [ $? -eq 2 ] || fail "--tokens 0 is not a usage error"
"$cli" bench moe-ffn --topk 9 --experts 8 >/dev/null 2>&1; [ $? -eq 2 ] || fail "topk > experts is not a usage error"
"$cli" bench moe-ffn --scheme int3 >/dev/null 2>&1; [ $? -eq 2 ] || fail "--scheme int3 is not a usage error"
exit $((fails > 0))
