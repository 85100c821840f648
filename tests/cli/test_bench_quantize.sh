#!/usr/bin/env bash
# moeq bench quantize on the bundled olmoe-tiny (one layer, a few samples): the JSON has the
# figures the README's table quotes, and nothing is left behind.
. "$(dirname "$0")/common.sh"

out=$(TMPDIR=$tmp "$cli" bench quantize "$model" --layers 1 --full-layers 4 --nsamples 4 --seqlen 64 \
      --calib "$repo/data/demo-calib.txt" --json 2>"$tmp/err") || fail "bench quantize exited $?: $(cat "$tmp/err")"
printf '%s\n' "$out" > "$tmp/b.json"
python3 - "$tmp/b.json" <<'PY' || fail "bench quantize JSON: $out"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["layers_run"] == 1 and j["layers"] == 4, j
assert j["samples"] == 4 and j["tokens"] == 256, j
L = j["per_layer"][0]
assert L["total"] >= L["forward"] >= L["attention"] > 0, L
assert 0 < j["forward_fraction_of_sgemm"] < 5, j
assert 0 < j["peak_anon_bytes"] <= j["budget_bytes"], j
assert abs(j["extrapolated_seconds"] - 4 * L["total"]) <= 0.01, j   # both printed to 1 ms
PY
ls "$tmp" | grep -q moeq-bench && fail "bench quantize left its temporary checkpoint"
exit $((fails > 0))
