#!/usr/bin/env bash
# moeq bench quantize on the bundled olmoe-tiny (one layer, a few samples): the JSON has the
# figures docs/results/benchmarks.md quotes, and nothing is left behind.
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
assert L["read"] > 0, L   # the layer's bf16 weights converted to fp32
parts = L["read"] + L["forward"] + L["hessians"] + L["gptq"] + L["write"]
assert parts <= L["total"] + 0.005, L   # the stages do not overlap; 1 ms printed rounding per figure
assert 0 <= L["serial"] < L["total"], L   # the time outside the pool's loops was measured
assert 0 < j["forward_fraction_of_sgemm"] < 5, j
assert 0 < j["peak_anon_bytes"] <= j["budget_bytes"], j
assert abs(j["extrapolated_seconds"] - 4 * L["total"]) <= 0.01, j   # both printed to 1 ms
PY
ls "$tmp" | grep -q moeq-bench && fail "bench quantize left its temporary checkpoint"

# --threads LIST: one run per count, each stage's seconds, cores busy and efficiency, and the
# tensors of every run compared (the checkpoint never depends on the thread count)
out=$(TMPDIR=$tmp "$cli" bench quantize "$model" --layers 1 --nsamples 4 --seqlen 64 --threads 1,3 \
      --calib "$repo/data/demo-calib.txt" --json 2>"$tmp/err") || fail "bench quantize --threads 1,3 exited $?: $(cat "$tmp/err")"
printf '%s\n' "$out" > "$tmp/t.json"
python3 - "$tmp/t.json" <<'PY' || fail "bench quantize --threads JSON: $out"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["same_tensors"] is True and j["tensors_compared"] >= 30, j   # the layer's tensors compared
rows = j["thread_scaling"]
assert [r["threads"] for r in rows] == [1, 3], rows
for r in rows:
    assert r["core_rate"] > 0 and r["bandwidth_rate"] > 0, r   # both ceilings measured
    # the core rate again right after the run, over the one before it: measured (its size is the
    # host's load: a neighbour's build can halve one half-second sgemm and not the other)
    assert 0 < r["core_rate_after_run"] < float("inf"), r
    for st in ("read", "forward", "attention", "hessians", "gptq", "write", "total"):
        assert st in r, (st, r)
    t = r["total"]
    assert t["seconds_per_layer"] > 0 and 0 < t["cores_busy"] <= r["threads"] + 0.5, r
    assert r["forward"]["seconds_per_layer"] >= r["attention"]["seconds_per_layer"] > 0, r
    for st in ("forward", "gptq", "total"):   # the share of the ceiling: efficiency over the core rate
        e, c = r[st]["efficiency"], r[st]["of_ceiling"]
        assert abs(c - e / r["core_rate"]) <= 0.002 + 0.0005 * e / r["core_rate"] ** 2, (st, r)
    for st in ("read", "forward", "attention", "hessians", "gptq", "write", "total"):
        # no efficiency (null) only for a stage under a thousandth of the layer (printed rounded)
        if r[st]["efficiency"] is None:
            assert r[st]["seconds_per_layer"] <= 1e-3 * t["seconds_per_layer"] + 5e-4 and st != "total", (st, r)
        else:
            assert r[st]["efficiency"] >= 0, (st, r)
assert rows[0]["total"]["efficiency"] == 1.0 and rows[0]["core_rate"] == 1.0, rows[0]
assert rows[0]["bandwidth_rate"] == 1.0, rows[0]
assert rows[0]["total"]["of_ceiling"] == 1.0, rows[0]
PY
ls "$tmp" | grep -q moeq-bench && fail "bench quantize --threads left its temporary checkpoints"
# --rounds N: the list N times in turn; each count's figures are the medians of its rounds, and
# each round's own efficiency is that round's pair of runs
out=$(TMPDIR=$tmp "$cli" bench quantize "$model" --layers 1 --nsamples 2 --seqlen 32 --threads 1,2 --rounds 3 \
      --block-size 64 --calib "$repo/data/demo-calib.txt" --json 2>"$tmp/err") || fail "bench quantize --rounds 3 exited $?: $(cat "$tmp/err")"
printf '%s\n' "$out" > "$tmp/r.json"
python3 - "$tmp/r.json" <<'PY' || fail "bench quantize --rounds JSON: $out"
import json, sys, statistics
j = json.load(open(sys.argv[1]))
assert j["rounds"] == 3 and j["same_tensors"] is True, j
assert j["block_size"] == 64, j["block_size"]
a, b = j["thread_scaling"]
for r in (a, b):
    secs = r["total_seconds_by_round"]
    assert len(secs) == 3 and min(secs) > 0, r
    assert abs(r["total"]["seconds_per_layer"] - statistics.median(secs)) <= 0.0015, r   # 1 ms printed rounding each
assert a["total_efficiency_by_round"] == [1.0, 1.0, 1.0], a
for k in range(3):
    want = a["total_seconds_by_round"][k] / (2 * b["total_seconds_by_round"][k])
    assert abs(b["total_efficiency_by_round"][k] - want) <= 0.01 * want + 0.002, (k, want, b)
want = statistics.median(a["total_seconds_by_round"]) / (2 * statistics.median(b["total_seconds_by_round"]))
assert abs(b["total"]["efficiency"] - want) <= 0.01 * want + 0.002, (want, b)
PY
grep -q "round 3 of 3" "$tmp/err" || fail "bench quantize --rounds: no round progress: $(cat "$tmp/err")"
# flag errors leave no temporary directory behind (each such run gets an empty TMPDIR of its own)
mkdir -p "$tmp/u"
TMPDIR=$tmp/u "$cli" bench quantize "$model" --rounds 2 >/dev/null 2>"$tmp/err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--rounds" "$tmp/err" || fail "bench quantize --rounds without a list: exit $rc, $(cat "$tmp/err")"
TMPDIR=$tmp/u "$cli" bench quantize "$model" --block-size 0 >/dev/null 2>"$tmp/err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--block-size" "$tmp/err" || fail "bench quantize --block-size 0: exit $rc, $(cat "$tmp/err")"
TMPDIR=$tmp/u "$cli" bench quantize "$model" --threads 2,,4 >/dev/null 2>"$tmp/err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--threads 2,,4" "$tmp/err" || fail "bench quantize --threads 2,,4: exit $rc, $(cat "$tmp/err")"
# --simulate-threads P: one thread does the work of P; the layer's loops' simulated seconds lie
# between their tasks' sum over P and the sum, and the prediction adds what ran outside them; the
# layer's and stages' seconds are the simulated clock's (P threads'), each stage's efficiency its
# one-thread CPU seconds over P times them
out=$(TMPDIR=$tmp "$cli" bench quantize "$model" --layers 1 --nsamples 4 --seqlen 64 --simulate-threads 4 \
      --calib "$repo/data/demo-calib.txt" --json 2>"$tmp/err") || fail "bench quantize --simulate-threads exited $?: $(cat "$tmp/err")"
printf '%s\n' "$out" > "$tmp/s.json"
python3 - "$tmp/s.json" <<'PY' || fail "bench quantize --simulate-threads JSON: $out"
import json, sys
j = json.load(open(sys.argv[1]))
s = j["simulated"]
assert j["threads"] == 1 and s["threads"] == 4, j
assert 0 < s["loop_task_seconds"] <= s["one_thread_seconds"] + 0.002, s
assert s["loop_task_seconds"] / 4 - 0.002 <= s["loop_seconds"] <= s["loop_task_seconds"] + 0.002, s
want = s["predicted_seconds"] - s["loop_seconds"] + s["loop_task_seconds"]
assert abs(s["one_thread_seconds"] - want) <= 0.003, s
assert abs(s["efficiency"] - s["one_thread_seconds"] / (4 * s["predicted_seconds"])) <= 0.002 + 0.01 * s["efficiency"], s
assert abs(j["per_layer"][0]["total"] - s["predicted_seconds"]) <= 0.002, j
st = s["stages"]
assert sum(st[k]["seconds"] for k in ("read", "forward", "hessians", "gptq", "write")) <= s["predicted_seconds"] + 0.003, s
for k, v in st.items():
    assert 0 <= v["efficiency"] <= 1.05, (k, v)
    sec, cpu, u = v["seconds"], v["cpu_seconds"], 5e-5   # printed to 4 decimals
    if sec > u: assert (cpu - u) / (4 * (sec + u)) - 0.001 <= v["efficiency"] <= (cpu + u) / (4 * (sec - u)) + 0.001, (k, v)
# GPTQ's loops ran as 4 threads would: its seconds well below its one thread's
assert st["gptq"]["efficiency"] > 0.4, st
PY
TMPDIR=$tmp/u "$cli" bench quantize "$model" --simulate-threads 4 --threads 2 >/dev/null 2>"$tmp/err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--simulate-threads" "$tmp/err" || fail "--simulate-threads with --threads: exit $rc, $(cat "$tmp/err")"
[ -z "$(ls "$tmp/u")" ] || fail "flag errors left temporary directories: $(ls "$tmp/u")"
exit $((fails > 0))
