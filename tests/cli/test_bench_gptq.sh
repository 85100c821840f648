#!/usr/bin/env bash
# moeq bench gptq: its JSON, the thread-scaling mode (every thread count gives the same codes:
# results never depend on it), and its errors. Small shapes: figures are the benchmark's
# business, not the test's.
. "$(dirname "$0")/common.sh"

"$cli" bench gptq --rows 64 --cols 64 --reps 1 --json > "$tmp/one.json" 2> "$tmp/one.err" || fail "bench gptq exited $?"
for k in seconds factor_seconds gflops sgemm_gflops fraction_of_sgemm cores_used; do
    grep -q "\"$k\": [0-9.]" "$tmp/one.json" || fail "bench gptq --json lacks $k: $(cat "$tmp/one.json")"
done
grep -qE "^moeq bench gptq: CPU kernels (avx512\+vnni|avx512|avx2\+fma|neon\+dotprod|neon|scalar)" "$tmp/one.err" || fail "no kernel set named: $(cat "$tmp/one.err")"

"$cli" bench gptq --rows 96 --cols 128 --reps 1 --mse --act-order --threads 1,2,3 --json > "$tmp/s.json" 2>/dev/null ||
    fail "bench gptq --threads 1,2,3 exited $?"
grep -q '"same_codes": true' "$tmp/s.json" || fail "thread counts gave different codes: $(cat "$tmp/s.json")"
[ "$(grep -o '"threads": [0-9]*' "$tmp/s.json" | tr -d '\n')" = '"threads": 1"threads": 2"threads": 3' ] ||
    fail "scaling rows: $(cat "$tmp/s.json")"
grep -q '"efficiency": 1.000' "$tmp/s.json" || fail "the first count's efficiency is not 1"
python3 - "$tmp/s.json" <<'PY' || fail "bench gptq --threads: of_ceiling is not efficiency over core rate: $(cat "$tmp/s.json")"
import json, sys
for r in json.load(open(sys.argv[1]))["scaling"]:
    assert abs(r["of_ceiling"] - r["efficiency"] / r["core_rate"]) <= 0.002 + 0.0005 * r["efficiency"] / r["core_rate"] ** 2, r
    # the factor's parts: each positive, together within the factor's seconds
    assert 0 < r["cholesky_seconds"] and 0 < r["inverse_seconds"] and 0 < r["copies_seconds"], r
    assert r["cholesky_seconds"] + r["inverse_seconds"] + r["copies_seconds"] <= r["factor_seconds"] + 1e-6, r
PY
# the single weight's codes (CRC in the JSON) do not depend on the thread count
c1=$("$cli" bench gptq --rows 96 --cols 128 --reps 1 --mse --threads 1 --json 2>/dev/null | grep -o '"codes_crc32": "[0-9a-f]\{8\}"')
c3=$("$cli" bench gptq --rows 96 --cols 128 --reps 1 --mse --threads 3 --json 2>/dev/null | grep -o '"codes_crc32": "[0-9a-f]\{8\}"')
[ -n "$c1" ] && [ "$c1" = "$c3" ] || fail "codes_crc32 at 1 and 3 threads: '$c1' '$c3'"
c4=$("$cli" bench gptq --rows 96 --cols 128 --reps 1 --threads 1 --json 2>/dev/null | grep -o '"codes_crc32": "[0-9a-f]\{8\}"')
[ -n "$c4" ] && [ "$c4" != "$c1" ] || fail "codes_crc32 without --mse equals the MSE search's: '$c4' '$c1'"
[ "$(grep -oE '"loop_task_seconds": 0\.0*[1-9][0-9]*' "$tmp/s.json" | wc -l)" = 3 ] ||
    fail "a thread count without its loop tasks' seconds: $(cat "$tmp/s.json")"

# --rounds: the list timed in turn twice, every round's codes compared with the first's
"$cli" bench gptq --rows 96 --cols 128 --reps 1 --threads 1,2 --rounds 2 --json > "$tmp/r.json" 2> "$tmp/r.err" ||
    fail "bench gptq --rounds 2 exited $?"
grep -q '"same_codes": true' "$tmp/r.json" || fail "--rounds: codes differ: $(cat "$tmp/r.json")"
grep -q "round 2 of 2" "$tmp/r.err" || fail "--rounds: no second round: $(cat "$tmp/r.err")"
"$cli" bench gptq --rows 64 --cols 64 --rounds 2 >/dev/null 2>"$tmp/r.err"
[ $? -eq 2 ] && grep -q -- "--rounds" "$tmp/r.err" || fail "--rounds without a list: $(cat "$tmp/r.err")"

# --simulate-threads P: the weight's tasks on one thread, the simulated seconds between their sum over P
# and their sum, the efficiency their ratio
"$cli" bench gptq --rows 600 --cols 256 --reps 1 --simulate-threads 4 --json > "$tmp/s.json" 2> "$tmp/s.err" ||
    fail "bench gptq --simulate-threads exited $?: $(cat "$tmp/s.err")"
python3 - "$tmp/s.json" <<'PY' || fail "bench gptq --simulate-threads JSON: $(cat "$tmp/s.json")"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["simulated_threads"] == 4 and j["rows"] == 600, j
for part in ("factor", "loop"):
    t, s = j[part + "_task_seconds"], j[part + "_seconds"]
    assert 0 < t and t / 4 - 1e-6 <= s <= t + 1e-6, (part, j)
tasks, span = j["factor_task_seconds"] + j["loop_task_seconds"], j["factor_seconds"] + j["loop_seconds"]
assert abs(j["efficiency"] - tasks / (4 * span)) <= 1e-3, j
PY
# with --moe the MoE layer too: its loops' task seconds within its one-thread seconds, the simulated
# seconds what runs outside the loops plus between the tasks' sum over P and their sum
"$cli" bench gptq --rows 256 --cols 256 --reps 1 --moe --experts 2 --moe-chunk 2 --simulate-threads 4 --json \
    > "$tmp/sm.json" 2> "$tmp/sm.err" || fail "bench gptq --moe --simulate-threads exited $?: $(cat "$tmp/sm.err")"
python3 - "$tmp/sm.json" <<'PY' || fail "bench gptq --moe --simulate-threads JSON: $(cat "$tmp/sm.json")"
import json, sys
j = json.load(open(sys.argv[1]))
one, tasks, sim = j["moe_layer_one_thread_seconds"], j["moe_layer_task_seconds"], j["moe_layer_seconds"]
assert j["moe_layer_experts"] == 2 and j["moe_layer_chunk"] == 2, j
assert 0 < tasks <= one + 1e-3, j
outside = one - tasks
assert outside + tasks / 4 - 1e-4 <= sim <= one + 1e-4, j
assert abs(j["moe_layer_efficiency"] - one / (4 * sim)) <= 1e-3, j
PY
"$cli" bench gptq --simulate-threads 4 --threads 2 >/dev/null 2>"$tmp/s.err"
[ $? -eq 2 ] && grep -q -- "--simulate-threads" "$tmp/s.err" || fail "--simulate-threads with --threads: $(cat "$tmp/s.err")"

"$cli" bench gptq --threads 2,x >/dev/null 2>&1
[ $? -eq 2 ] || fail "bad --threads list: expected exit 2"
"$cli" bench gptq --device cuda:999 --rows 64 --cols 64 2> "$tmp/d.err"
[ $? -eq 1 ] || fail "--device cuda:999: expected exit 1"
grep -q "cuda:999" "$tmp/d.err" || fail "--device cuda:999: message $(cat "$tmp/d.err")"

[ $fails -eq 0 ] && echo "all bench gptq checks passed"
exit $((fails > 0))
