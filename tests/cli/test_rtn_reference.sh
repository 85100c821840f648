#!/usr/bin/env bash
# Issue 4's check: RTN checkpoints written by `moeq quantize --reference` (the reference's fake
# quantization: NVFP4 per-tensor global scale amax/2688 not fused, block scale E4M3(amax/6/global);
# INT4 symmetric amax/7) have wikitext word perplexity within 1% of reference.json for every
# fixture model and scheme, and, for one checkpoint, mean KL / top-1 agreement close to the
# reference's. The quantized models agree with the reference to 0.1-0.6% in perplexity, not
# bit-for-bit (docs/results/reference-checks.md says why), so the bounds are the issue's 1% and
# 3% on KL. Each evaluation reads the whole wikitext file (~404K tokens), so CI runs two
# representative checkpoints (olmoe-tiny NVFP4, llama-tiny INT4 g128 with KL); MOEQ_TEST_FULL=1
# runs all nine (about ten minutes of CPU); an emulated cross build (MOEQ_CROSS) compares its
# checkpoint with the native build's instead (below).
set -u
cli=${MOEQ_CLI:?MOEQ_CLI is not set}
shared=${MOEQ_SHARED:-${MOEQ_REPO:?MOEQ_REPO is not set}/../shared}
data=$shared/fixtures/text/wikitext2_test.txt
ref=$shared/fixtures/reference.json
if [ ! -f "$data" ] || [ ! -f "$ref" ]; then
    echo "SKIP: shared fixtures not found under $shared (set MOEQ_SHARED)"
    exit 77
fi
command -v python3 >/dev/null || { echo "SKIP: python3 is needed to read reference.json"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
if [ -n "${MOEQ_CROSS:-}" ]; then
    # Under an emulator (~100-170x slower) one whole-file evaluation takes two hours or more, so
    # the chain is cut in two checks that hold together: the emulated build's --reference
    # checkpoint is byte-identical to the native build's (MOEQ_NATIVE_CLI), whose evaluation this
    # test checks natively, and the emulated evaluation equals reference.json per document
    # (test_eval_reference under MOEQ_CROSS).
    native=${MOEQ_NATIVE_CLI:-${MOEQ_REPO}/build/moeq}
    [ -x "$native" ] || { echo "SKIP: an emulated build and no native one at $native (set MOEQ_NATIVE_CLI)"; exit 77; }
    for side in emulated native; do
        b=$cli
        [ $side = native ] && b=$native
        "$b" quantize "$shared/fixtures/models/olmoe-tiny" --out "$tmp/$side" --scheme nvfp4a16 --method rtn \
            --reference --quiet || { echo "FAIL: $side quantize exited $?"; fail=1; }
    done
    cmp -s "$tmp/emulated/model.safetensors" "$tmp/native/model.safetensors" ||
        { echo "FAIL: the emulated --reference checkpoint differs from the native build's"; fail=1; }
    [ $fail = 0 ] && echo ok
    exit $fail
elif [ "${MOEQ_TEST_FULL:-0}" = 1 ]; then
    runs="olmoe-tiny:nvfp4 olmoe-tiny:int4_g128 olmoe-tiny:int4_g32 qwen2moe-tiny:nvfp4
          qwen2moe-tiny:int4_g128 qwen2moe-tiny:int4_g32 llama-tiny:nvfp4 llama-tiny:int4_g128
          llama-tiny:int4_g32"
else
    runs="olmoe-tiny:nvfp4 llama-tiny:int4_g128"
fi
for run in $runs; do
    model=${run%%:*}
    scheme=${run##*:}
    case $scheme in
        nvfp4) args="--scheme nvfp4a16" ;;
        int4_g128) args="--scheme int4 --group-size 128" ;;
        int4_g32) args="--scheme int4 --group-size 32" ;;
    esac
    q=$tmp/$model-$scheme
    "$cli" quantize "$shared/fixtures/models/$model" --out "$q" $args --method rtn --reference --quiet ||
        { echo "FAIL: quantize $model $scheme exited $?"; fail=1; continue; }
    extra=""
    [ "$model-$scheme" = "llama-tiny-int4_g128" ] && extra="--kl-base $shared/fixtures/models/$model"
    "$cli" eval "$q" --dequantize --data "$data" --max-length 512 --json --quiet $extra > "$q.json" ||
        { echo "FAIL: eval $model $scheme exited $?"; fail=1; continue; }
    python3 - "$q.json" "$ref" "$model" "wikitext_${scheme}_rtn" <<'PY' || fail=1
import json, sys
r = json.load(open(sys.argv[1]))
ref = json.load(open(sys.argv[2]))[sys.argv[3]][sys.argv[4]]
rel = (r["word_perplexity"] - ref["word_perplexity"]) / ref["word_perplexity"]
print("%-14s %-22s word_perplexity %.3f reference %.3f (%+.3f%%)" % (sys.argv[3], sys.argv[4], r["word_perplexity"], ref["word_perplexity"], 100 * rel))
ok = abs(rel) <= 0.01
if "kl_mean" in r:
    krel = (r["kl_mean"] - ref["kl_mean"]) / ref["kl_mean"]
    agree = 1 - r["top1_changed"]
    print("    kl_mean %.6f reference %.6f (%+.2f%%); top-1 agree %.5f reference %.5f" % (r["kl_mean"], ref["kl_mean"], 100 * krel, agree, ref["top1_agree"]))
    ok = ok and abs(krel) <= 0.03 and abs(agree - ref["top1_agree"]) <= 0.005 and r["kl_tokens"] == ref["tokens"]
if not ok:
    print("FAIL")
sys.exit(0 if ok else 1)
PY
    rm -rf "$q"
done
exit $fail
