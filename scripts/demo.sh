#!/usr/bin/env bash
# The quick-start job: quantize the bundled MoE model (models/olmoe-tiny) to NVFP4 with GPTQ and
# with round-to-nearest, write compressed-tensors checkpoints, and report their quality against the
# unquantized model (perplexity and KL divergence on held-out text), then run the GPTQ checkpoint
# on the packed NVFP4 kernels. All inputs are in the repository (data/ is text the bundled model
# generated); outputs go to build/demo/.
set -euo pipefail
moeq=${1:-build/moeq}
here=$(cd "$(dirname "$0")/.." && pwd)
model=$here/models/olmoe-tiny
out=$here/build/demo
mkdir -p "$out"

step() { printf '\n== %s\n' "$*"; }

step "moeq inspect models/olmoe-tiny"
"$moeq" inspect "$model"

step "moeq quantize: GPTQ NVFP4 (calibration: data/demo-calib.txt, 32 x 256 tokens)"
"$moeq" quantize "$model" --out "$out/olmoe-tiny-nvfp4-gptq" --scheme nvfp4a16 --method gptq \
    --calib "$here/data/demo-calib.txt" --nsamples 32 --seqlen 256 --force

step "moeq quantize: RTN NVFP4 (for comparison)"
"$moeq" quantize "$model" --out "$out/olmoe-tiny-nvfp4-rtn" --scheme nvfp4a16 --method rtn --force

step "moeq inspect (the GPTQ checkpoint)"
"$moeq" inspect "$out/olmoe-tiny-nvfp4-gptq"

step "quality report on data/demo-eval.txt (held-out text)"
report() {   # name dir [--kl-base base]
    local name=$1 dir=$2
    shift 2
    "$moeq" eval "$dir" --task text --data "$here/data/demo-eval.txt" --json --quiet "$@" \
        > "$out/$name.json"
}
report base "$model"
report rtn "$out/olmoe-tiny-nvfp4-rtn" --kl-base "$model"
report gptq "$out/olmoe-tiny-nvfp4-gptq" --kl-base "$model"
field() { sed -n "s/.*\"$2\": *\([-0-9.eE+]*\).*/\1/p" "$out/$1.json" | head -n 1; }
printf '%-16s %18s %12s %14s\n' model token_perplexity kl_mean top1_changed
printf '%-16s %18.3f %12s %14s\n' fp32 "$(field base token_perplexity)" - -
for m in rtn gptq; do
    printf '%-16s %18.3f %12.5f %14.4f\n' "nvfp4-$m" "$(field $m token_perplexity)" \
        "$(field $m kl_mean)" "$(field $m top1_changed)"
done

step "moeq generate with the GPTQ NVFP4 checkpoint (packed NVFP4 kernels)"
"$moeq" generate "$out/olmoe-tiny-nvfp4-gptq" --prompt "The history of the" -n 32 --greedy
