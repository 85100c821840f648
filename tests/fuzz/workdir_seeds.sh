#!/usr/bin/env bash
# Seeds of fuzz_workdir (called by corpus.py): a three-layer model generated small, quantized with
# GPTQ and killed (MOEQ_FAULT) after its second layer, its snapshots written in place; each seed
# is the work manifest and the activation snapshot it names, cut by FUZZ_SEP (fuzz_common.h).
#   workdir_seeds.sh MOEQ REPO WORK OUT
set -eu
cli=$1 repo=$2 work=$3 out=$4
sep=$'\n--moeq-fuzz-next-file--\n'
mkdir -p "$out"
"$cli" bench gen-model --like olmoe-1b-7b --out "$work/wd-src" --layers 3 --experts 2 --hidden 32 --ffn 16 \
    --vocab 4096 --quiet
head -c 120 "$repo/data/demo-calib.txt" > "$work/wd-calib.txt"   # W4A4 takes every token of it
for mode in gptq rtn-act; do
    if [ $mode = gptq ]; then
        args=(--scheme int4 --group-size 16 --method gptq --nsamples 2 --seqlen 8)
    else
        args=(--scheme nvfp4 --nsamples 2 --seqlen 8)   # W4A4: activation scales, calibrated
    fi
    # (killed: the shell's report of it goes too)
    { MOEQ_FAULT=layer:1 MOEQ_SNAPSHOT_IN_PLACE=1 "$cli" quantize "$work/wd-src" --out "$work/wd-$mode" \
        --calib "$work/wd-calib.txt" "${args[@]}" --quiet; } 2>/dev/null && exit 1
    w=$work/wd-$mode.moeq-work
    acts=$(ls "$w"/acts-*.bin 2>/dev/null | head -1)
    { cat "$w/manifest.json"; printf '%s' "$sep"; [ -n "$acts" ] && cat "$acts"; } > "$out/$mode"
    # the manifest alone, and a copy whose snapshot is cut short
    cp "$w/manifest.json" "$out/$mode-manifest"
    [ -n "$acts" ] && head -c -7 "$out/$mode" > "$out/$mode-torn"
    rm -rf "$w"
done
exit 0
