#!/usr/bin/env bash
# moeq quantize --method gptq on the bundled olmoe-tiny with a small calibration set: the
# checkpoint and the JSON report (every module present, GPTQ loss <= RTN loss for every weight,
# experts without calibration tokens handled by the fallback), act-order g_idx in the GPTQ v1
# format, JSONL calibration, the ignore list, and usage errors.
. "$(dirname "$0")/common.sh"
shared=${MOEQ_SHARED:-$MOEQ_REPO/../shared}
# The shared calibration text, or without the shared folder the repository's own (text the
# bundled model generated): the checks below hold for any English-like text.
calib=$shared/fixtures/text/calib.txt
[ -f "$calib" ] || calib=$MOEQ_REPO/data/demo-calib.txt
[ -f "$calib" ] || { echo "SKIP: no $calib"; exit 77; }

header_has() {
    local n
    n=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
    head -c $((8 + n)) "$1" | tail -c "$n" | grep -q "\"$2\":{\"dtype\":\"$3\"" ||
        fail "$1: no tensor $2 of dtype $3"
}

# NVFP4 (weight-only), defaults
out=$("$cli" quantize "$model" --out "$tmp/nv" --scheme nvfp4a16 --method gptq --calib "$calib" \
      --nsamples 8 --seqlen 64) || fail "nvfp4 gptq exited $?"
printf '%s' "$out" | grep -q "report: $tmp/nv/gptq_report.json" || fail "report path not printed: $out"
printf '%s' "$out" | grep -q '112 Linears quantized' || fail "writer summary: $out"
header_has "$tmp/nv/model.safetensors" model.layers.3.mlp.experts.7.down_proj.weight_packed U8
r=$tmp/nv/gptq_report.json
[ "$(grep -c '"module":' "$r")" -eq 112 ] || fail "report: not 112 modules"
grep -q '"modules_worse_than_rtn":[[:space:]]*0' "$r" || fail "report: a module has GPTQ loss > RTN loss"
grep -q '"method":[[:space:]]*"gptq-block-hessian"' "$r" || fail "report: no expert fallback"
grep -q '"tokens":[[:space:]]*512' "$r" || fail "report: calibration tokens"
# the host's kernel sets, as --version names them
grep -q "\"blas_kernels\":[[:space:]]*\"$("$cli" --version | sed -n 's/^BLAS: OpenBLAS \([A-Za-z0-9_]*\).*/\1/p')\"" "$r" ||
    fail "report: no BLAS kernel set, or not --version's"
grep -q "\"cpu_kernels\":[[:space:]]*\"$("$cli" --version | sed -n 's/^CPU kernels: //p')\"" "$r" ||
    fail "report: no CPU kernel set, or not --version's"
"$cli" inspect "$tmp/nv" | grep -q 'nvfp4 (compressed-tensors) *112 weights' || fail "inspect nvfp4"
# the checkpoint does not depend on the number of threads
"$cli" quantize "$model" --out "$tmp/nv1" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --nsamples 8 --seqlen 64 --threads 1 --quiet || fail "--threads 1 exited $?"
cmp -s "$tmp/nv/model.safetensors" "$tmp/nv1/model.safetensors" || fail "--threads 1 changed the checkpoint"

# INT4 act-order with g_idx into GPTQ v1, nonsequential, RTN fallback, JSONL documents
printf '{"text": "The quick brown fox jumps over the lazy dog."}\n{"text": "It was a bright cold day in April, and the clocks were striking thirteen."}\n' > "$tmp/c.jsonl"
"$cli" quantize "$model" --out "$tmp/i4" --scheme int4 --format gptq --method gptq --calib "$tmp/c.jsonl" \
    --calib-sampling docs --act-order --groups gidx --gptq-mode nonsequential \
    --expert-fallback rtn --min-expert-tokens 4 --report "$tmp/i4.json" --quiet || fail "int4 gptq exited $?"
header_has "$tmp/i4/model.safetensors" model.layers.1.mlp.experts.0.up_proj.g_idx I32
grep -q '"desc_act":[[:space:]]*true' "$tmp/i4/config.json" || fail "int4: desc_act not set"
grep -q '"method":[[:space:]]*"rtn"' "$tmp/i4.json" || fail "int4: no RTN fallback"
grep -q '"mode":[[:space:]]*"nonsequential"' "$tmp/i4.json" || fail "int4: mode"
grep -q '"sampling":[[:space:]]*"docs"' "$tmp/i4.json" || fail "int4: sampling"
grep -q '"samples":[[:space:]]*2' "$tmp/i4.json" || fail "int4: two documents"

# --ignore: those modules are neither calibrated-quantized nor reported
"$cli" quantize "$model" --out "$tmp/ig" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --nsamples 2 --seqlen 32 --ignore 'self_attn' --quiet || fail "ignore exited $?"
grep -q 'self_attn' "$tmp/ig/gptq_report.json" && fail "ignored modules in the report"
header_has "$tmp/ig/model.safetensors" model.layers.0.self_attn.q_proj.weight BF16

# --scale-search: the MSE search's range reaches the search (other losses) and the report; the
# NVFP4 GPTQ default is 0.9:1.5:25 (issue 15)
"$cli" quantize "$model" --out "$tmp/ss0" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --nsamples 4 --seqlen 32 --report "$tmp/ss0.json" --quiet || fail "default scale search exited $?"
"$cli" quantize "$model" --out "$tmp/ss1" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --nsamples 4 --seqlen 32 --scale-search 0.7:1.1:17 --report "$tmp/ss1.json" --quiet || fail "--scale-search exited $?"
python3 - "$tmp/ss0.json" "$tmp/ss1.json" <<'PY' || fail "--scale-search: not applied"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
s = a["settings"]["scale_search"]
assert abs(s[0] - 0.9) < 1e-6 and s[1] == 1.5 and s[2] == 25, s
assert a["settings"]["refine_passes"] == 2, a["settings"]
assert b["settings"]["scale_search"] == [0.699999988079071, 1.100000023841858, 17], b["settings"]
assert a["summary"]["gptq_loss_total"] != b["summary"]["gptq_loss_total"]
PY
cmp -s "$tmp/ss0/model.safetensors" "$tmp/ss1/model.safetensors" && fail "--scale-search: the same checkpoint"
"$cli" quantize "$model" --out "$tmp/u" --scheme nvfp4a16 --method gptq --calib "$calib" --scale-search 1.5:0.9 2>"$tmp/err"
[ $? -eq 1 ] || fail "--scale-search 1.5:0.9: expected exit 1"
grep -q "scale search 1.5:0.9" "$tmp/err" || fail "--scale-search 1.5:0.9: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme nvfp4a16 --method gptq --calib "$calib" --scale-search wide >/dev/null 2>&1
[ $? -eq 2 ] || fail "--scale-search wide: expected exit 2"

# issue 15's options: --expert-weighting, --damp-sweep, --refine, --clip-search reach the report
# and change the checkpoint; with all of them the result does not depend on the thread count
# or the expert chunk; each module's GPTQ loss stays <= its RTN loss
q15() {   # out, extra flags...
    local o=$1; shift
    "$cli" quantize "$model" --out "$tmp/$o" --method gptq --calib "$calib" --nsamples 16 --seqlen 32 \
        --report "$tmp/$o.json" --quiet "$@" || fail "$o: exited $?"
}
q15 b0 --scheme nvfp4a16
q15 b1 --scheme nvfp4a16 --expert-weighting gate --damp-sweep 0.003,0.01,0.1 --refine 2
q15 b2 --scheme nvfp4a16 --expert-weighting gate --damp-sweep 0.003,0.01,0.1 --refine 2 --threads 1 --expert-chunk 1
q15 b3 --scheme nvfp4a16 --expert-weighting gate-squared
q15 b4 --scheme nvfp4a16 --damp-sweep 0.01
q15 bq --scheme nvfp4a16 --target quantized
q15 b5 --scheme nvfp4a16 --scale-search 0.9:1.5:25 --global-scale-headroom 1.5 --refine 1 --refine-scales
q15 i0 --scheme int4 --asym
q15 i1 --scheme int4 --asym --clip-search
q15 t1 --scheme nvfp4a16 --target unquantized
q15 t2 --scheme nvfp4a16 --target unquantized:0.5 --threads 1 --expert-chunk 1
q15 t3 --scheme nvfp4a16 --target quantized
cmp -s "$tmp/t1/model.safetensors" "$tmp/t2/model.safetensors" || fail "--target unquantized: --threads 1 --expert-chunk 1 changed the checkpoint"
cmp -s "$tmp/t1/model.safetensors" "$tmp/b0/model.safetensors" || fail "--target unquantized: not the default checkpoint"
cmp -s "$tmp/b1/model.safetensors" "$tmp/b2/model.safetensors" || fail "issue 15 options: --threads 1 --expert-chunk 1 changed the checkpoint"
# a sweep over the default damping alone: the Hessian of every row is the same bits, so the
# same checkpoint as no sweep (a sweep turns the default target off: against --target quantized)
cmp -s "$tmp/b4/model.safetensors" "$tmp/bq/model.safetensors" || fail "--damp-sweep 0.01: not the --target quantized checkpoint"
for x in b1 b3 i1 t3; do
    y=b0; [ $x = i1 ] && y=i0
    cmp -s "$tmp/$x/model.safetensors" "$tmp/$y/model.safetensors" && fail "$x: the same checkpoint as $y"
done
python3 - "$tmp" <<'PY' || fail "issue 15 options: report"
import json, sys
t = sys.argv[1]
r = {k: json.load(open(f"{t}/{k}.json")) for k in ("b0", "b1", "b3", "b5", "i0", "i1", "t1")}
assert r["t1"]["settings"]["target_unquantized"] == 0.5 and r["b0"]["settings"]["target_unquantized"] == 0.5
assert r["b1"]["settings"]["target_unquantized"] == 0 and r["b3"]["settings"]["target_unquantized"] == 0
s5 = r["b5"]["settings"]
assert s5["global_scale_headroom"] == 1.5 and s5["refine_scales"] is True and s5["refine_passes"] == 1, s5
assert r["b0"]["settings"]["global_scale_headroom"] == 1 and r["b0"]["settings"]["refine_scales"] is False
s = r["b1"]["settings"]
assert s["expert_weighting"] == "gate" and s["damp_sweep"] == [0.003, 0.01, 0.1] and s["refine_passes"] == 2, s
assert r["b3"]["settings"]["expert_weighting"] == "gate-squared"
assert r["b0"]["settings"]["damp_sweep"] == [] and r["b0"]["settings"]["refine_passes"] == 2
assert r["i0"]["settings"]["refine_passes"] == 2
assert r["i1"]["settings"]["clip_search"] is True and r["i0"]["settings"]["clip_search"] is False
# every swept module's damping is a candidate (on 14 samples of 32 tokens, often the largest)
d = {m["percdamp"] for m in r["b1"]["modules"] if m["method"] == "gptq"}
assert d <= {0.003, 0.01, 0.1} and 0.1 in d, d
for k, v in r.items():
    assert v["summary"]["modules_worse_than_rtn"] == 0, k
    for m in v["modules"]:
        if m["method"] != "rtn":
            assert m["loss"] <= m["rtn_loss"], (k, m)
PY
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --clip-search \
    --nsamples 2 --seqlen 16 2>"$tmp/err"
[ $? -eq 1 ] || fail "--clip-search without --asym: expected exit 1"
grep -q 'clip_search' "$tmp/err" || fail "--clip-search without --asym: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --global-scale-headroom 1.5 \
    --nsamples 2 --seqlen 16 2>"$tmp/err"
[ $? -eq 1 ] || fail "--global-scale-headroom with int4: expected exit 1"
grep -q 'global_scale_headroom' "$tmp/err" || fail "--global-scale-headroom with int4: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme nvfp4a16 --method gptq --calib "$calib" --damp-sweep 0.01,x >/dev/null 2>&1
[ $? -eq 2 ] || fail "--damp-sweep 0.01,x: expected exit 2"
"$cli" quantize "$model" --out "$tmp/u" --scheme nvfp4a16 --method gptq --calib "$calib" --expert-weighting top >/dev/null 2>&1
[ $? -eq 2 ] || fail "--expert-weighting top: expected exit 2"
"$cli" quantize "$model" --out "$tmp/u" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --nsamples 2 --seqlen 16 --refine 1 --device cuda 2>"$tmp/err"
[ $? -eq 1 ] || fail "--refine with --device cuda: expected exit 1"
grep -q 'CPU only' "$tmp/err" || fail "--refine with --device cuda: message"

# errors: usage (exit 2) and bad settings (exit 1, nothing left behind)
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq >/dev/null 2>&1
[ $? -eq 2 ] || fail "gptq without --calib: expected exit 2"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --gptq-mode fast >/dev/null 2>&1
[ $? -eq 2 ] || fail "bad --gptq-mode: expected exit 2"
"$cli" quantize "$model" --out "$tmp/u" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --act-order --groups gidx --nsamples 2 --seqlen 16 2>"$tmp/err"
[ $? -eq 1 ] || fail "gidx with nvfp4: expected exit 1"
grep -q 'gidx' "$tmp/err" || fail "gidx with nvfp4: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$tmp/none.txt" 2>"$tmp/err"
[ $? -eq 1 ] || fail "missing calibration file: expected exit 1"
grep -q 'none.txt' "$tmp/err" || fail "missing calibration file: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --device gpu >/dev/null 2>&1
[ $? -eq 2 ] || fail "bad --device: expected exit 2"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --gpu-tf32 2>"$tmp/err"
[ $? -eq 2 ] || fail "--gpu-tf32 without --device cuda: expected exit 2"
grep -q 'gpu-tf32 needs --device cuda' "$tmp/err" || fail "--gpu-tf32 without a GPU: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --gpu-precision tf32x3 2>"$tmp/err"
[ $? -eq 2 ] || fail "--gpu-precision tf32x3 without --device cuda: expected exit 2"
grep -q 'gpu-precision needs --device cuda' "$tmp/err" || fail "--gpu-precision without a GPU: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --device cuda --gpu-tf32 \
    --gpu-precision tf32x3 2>"$tmp/err"
[ $? -eq 2 ] || fail "--gpu-tf32 with --gpu-precision tf32x3: expected exit 2"
grep -q 'disagree' "$tmp/err" || fail "--gpu-tf32 against --gpu-precision: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --device cuda \
    --gpu-precision fp16 >/dev/null 2>&1
[ $? -eq 2 ] || fail "--gpu-precision fp16: expected exit 2"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --target unquantized:1.5 \
    2>"$tmp/err"
[ $? -eq 2 ] || fail "--target unquantized:1.5: expected exit 2"
grep -q 'target unquantized:1.5' "$tmp/err" || fail "--target unquantized:1.5: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --target unquantized \
    --gptq-mode nonsequential 2>"$tmp/err"
[ $? -eq 1 ] || fail "--target unquantized nonsequential: expected exit 1"
grep -q 'needs --gptq-mode sequential' "$tmp/err" || fail "--target unquantized nonsequential: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --method gptq --calib "$calib" --target unquantized \
    --device cuda 2>"$tmp/err"
[ $? -eq 1 ] || fail "--target unquantized --device cuda: expected exit 1"
grep -q 'CPU only' "$tmp/err" || fail "--target unquantized --device cuda: message"
[ ! -e "$tmp/u" ] || fail "a refused run left $tmp/u"
# a GPU that is not there (or a build without CUDA): a clear error before any work
"$cli" quantize "$model" --out "$tmp/u" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --nsamples 2 --seqlen 16 --device cuda:999 2>"$tmp/err"
[ $? -eq 1 ] || fail "--device cuda:999: expected exit 1"
grep -q 'cuda:999' "$tmp/err" || fail "--device cuda:999: message"
"$cli" quantize "$model" --out "$tmp/u" --scheme nvfp4a16 --device cuda 2>"$tmp/err"
[ $? -eq 1 ] || fail "--device cuda with rtn: expected exit 1"
grep -q 'only method gptq' "$tmp/err" || fail "--device cuda with rtn: message"
[ ! -e "$tmp/u" ] || fail "a failed job left $tmp/u"

[ $fails -eq 0 ] && echo "all gptq CLI checks passed"
exit $((fails > 0))
