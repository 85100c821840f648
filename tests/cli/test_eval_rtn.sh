#!/usr/bin/env bash
# KL divergence and perplexity of an RTN-quantized checkpoint against reference.json: llama-tiny
# quantized by `moeq quantize --scheme int4 --group-size 128 --reference` (the fake quantization
# the reference used), evaluated on the whole wikitext fixture with --kl-base the fp32 model.
# reference.json's kl_mean is mean KL(p_fp32 || p_quant) over every scored token, top1_agree the
# share of unchanged top-1 predictions. Slow (two models over ~404K tokens, minutes on 2 cores),
# so it runs only with MOEQ_TEST_RTN_REFERENCE=1. Status when written: the evaluation agrees with
# an independent fake quantization to 1e-8, but `quantize --reference` does not yet reproduce the
# reference's quantized model exactly (word perplexity 19470.97 vs 19433.40, kl_mean 0.0510277 vs
# 0.0510711), so this check fails on word_perplexity until the quantizer matches.
set -u
if [ "${MOEQ_TEST_RTN_REFERENCE:-0}" != 1 ]; then
    echo "SKIP: set MOEQ_TEST_RTN_REFERENCE=1 to check an RTN checkpoint's KL against reference.json"
    exit 77
fi
cli=${MOEQ_CLI:?MOEQ_CLI is not set}
shared=${MOEQ_SHARED:-${MOEQ_REPO:?MOEQ_REPO is not set}/../shared}
base=$shared/fixtures/models/llama-tiny
data=$shared/fixtures/text/wikitext2_test.txt
ref=$shared/fixtures/reference.json
if [ ! -d "$base" ] || [ ! -f "$data" ] || [ ! -f "$ref" ]; then
    echo "SKIP: shared fixtures not found under $shared (set MOEQ_SHARED)"
    exit 77
fi
command -v python3 >/dev/null || { echo "SKIP: python3 is needed to read reference.json"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$cli" quantize "$base" --out "$tmp/q" --scheme int4 --group-size 128 --reference --quiet ||
    { echo "FAIL: moeq quantize exited $?"; exit 1; }
"$cli" eval "$tmp/q" --data "$data" --max-length 512 --kl-base "$base" --json --quiet > "$tmp/r.json" ||
    { echo "FAIL: moeq eval exited $?"; exit 1; }
python3 - "$tmp/r.json" "$ref" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
ref = json.load(open(sys.argv[2]))["llama-tiny"]["wikitext_int4_g128_rtn"]
print("word_perplexity %.6f (reference %.6f), kl_mean %.8f (%.8f), top1 agree %.6f (%.6f), kl_p99 %.5f"
      % (r["word_perplexity"], ref["word_perplexity"], r["kl_mean"], ref["kl_mean"],
         1 - r["top1_changed"], ref["top1_agree"], r["kl_p99"]))
ok = True
def close(name, got, want, rtol):
    global ok
    if abs(got - want) > rtol * abs(want):
        print("FAIL: %s %.10g, reference %.10g (relative %.2e > %.0e)" % (name, got, want, abs(got - want) / abs(want), rtol))
        ok = False
close("word_perplexity", r["word_perplexity"], ref["word_perplexity"], 1e-4)
close("kl_mean", r["kl_mean"], ref["kl_mean"], 1e-3)
close("top1_agree", 1 - r["top1_changed"], ref["top1_agree"], 1e-3)
if r["kl_tokens"] != ref["tokens"]:
    print("FAIL: kl_tokens %d, reference %d" % (r["kl_tokens"], ref["tokens"]))
    ok = False
sys.exit(0 if ok else 1)
EOF
