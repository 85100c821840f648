#!/usr/bin/env bash
# moeq's GPTQ K-quant GGUF files against llama.cpp's own (llama-quantize --imatrix, the importance
# matrix from llama-imatrix on the same calibration text), at equal size, judged by llama.cpp's
# llama-perplexity --kl-divergence against the F32 model. Runs only with a llama.cpp build:
#
#   scripts/bench-kquant.sh LLAMA_CPP_BIN_DIR [WORK_DIR]
#
# LLAMA_CPP_BIN_DIR holds llama-quantize, llama-imatrix and llama-perplexity (built from a
# llama.cpp snapshot, never part of this repository). Environment:
#   MOEQ       moeq binary (default build/moeq)          SHARED   fixtures (default ../shared)
#   MODELS     fixture models (default "olmoe-tiny qwen2moe-tiny llama-tiny")
#   PRESETS    moeq schemes = llama.cpp file types (default "q4_k_m q3_k_m q5_k_m"; also iq4_xs, iq4_nl)
#   TARGET_BPW moeq --target-bpw runs compared with llama.cpp's Q4_K_M (default "4.5"; "" none)
#   CHUNKS     llama-perplexity chunks of 512 tokens of wikitext (default 200; rounded down to a
#              multiple of 4: its --kl-divergence stops without a result on a last batch of fewer
#              than its 4 sequences)
#   KEEP       1: keep the files of an earlier run in WORK_DIR (the base logits, imatrix and
#              each GGUF) and only judge them again
#   AGREE      1: also moeq's perplexity of each moeq file on llama-perplexity's own chunks
#              (scripts/llama-ppl.py, moeq eval's forward with --act-quant q8_0: Q8_K
#              activations for the K-quants), next to llama.cpp's
#   THREADS    threads for every tool (default: nproc)
#   TRIES      llama-perplexity runs per file until one prints its summary (default 4; judge())
#   MOEQ_ARGS  more flags for every moeq quantize run (e.g. "--nsamples 64")
# Prints a markdown table: file, who made it, bytes, bits per parameter, llama.cpp's mean KL and
# PPL (the F32 file itself first: its KL to its own base logits must be ~0); and the ratio of
# moeq's KL to llama.cpp's at each preset. qwen2moe-tiny runs as a copy
# with norm_topk_prob false (what llama.cpp's qwen2moe graph computes; docs/gguf.md).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -x "$1/llama-perplexity" ]; then
    echo "usage: $0 LLAMA_CPP_BIN_DIR [WORK_DIR]  (a llama.cpp build with llama-quantize, llama-imatrix, llama-perplexity)" >&2
    exit 2
fi
LB=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${2:-$(mktemp -d /tmp/bench-kquant.XXXXXX)}
mkdir -p "$WORK"
MOEQ=${MOEQ:-$REPO/build/moeq}
SHARED=${SHARED:-$REPO/../shared}
MODELS=${MODELS:-olmoe-tiny qwen2moe-tiny llama-tiny}
PRESETS=${PRESETS:-q4_k_m q3_k_m q5_k_m}
TARGET_BPW=${TARGET_BPW-4.5}
CHUNKS=$(( ${CHUNKS:-200} / 4 * 4 ))
[ "$CHUNKS" -ge 4 ] || CHUNKS=4
KEEP=${KEEP:-0}
AGREE=${AGREE:-0}
THREADS=${THREADS:-$(nproc)}
TRIES=${TRIES:-4}
MOEQ_ARGS=${MOEQ_ARGS:-}
CALIB=$SHARED/fixtures/text/calib.txt
TEXT=$SHARED/fixtures/text/wikitext2_test.txt
export LD_LIBRARY_PATH="$LB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log() { echo "bench-kquant: $*" >&2; }
calc() { awk "BEGIN { printf \"%.6f\", $1 }"; }

# the llama.cpp file type of a moeq preset: q4_k_m -> Q4_K_M
ftype() { echo "$1" | tr '[:lower:]' '[:upper:]'; }

# llama.cpp's mean KL and PPL of one file against the base logits: "KL PPL". Up to TRIES runs
# until one prints its summary: llama.cpp's logger writes from a thread of its own and is never
# drained at exit (common/log.cpp leaks it on purpose; ggml-org/llama.cpp issue 22142), so on a
# loaded machine a run that exits 0 can lose its last lines, the summary among them.
judge() {
    local f=$1 out=$1.kld.txt kl="" ppl=""
    for _ in $(seq "$TRIES"); do
        "$LB/llama-perplexity" -m "$f" -f "$TEXT" -c 512 --chunks "$CHUNKS" -t "$THREADS" \
            --kl-divergence-base "$BASE_KLD" --kl-divergence > "$out" 2>&1 || tail -5 "$out" >&2
        kl=$(awk '/^Mean +KLD:/ {print $3}' "$out")
        ppl=$(awk '/^Mean PPL\(Q\) +:/ {print $4}' "$out")
        [ -z "$kl" ] || break
    done
    echo "$kl $ppl"
}

# moeq's PPL of a file on llama-perplexity's chunks ("" unless AGREE=1)
agree() {
    [ "$AGREE" = 1 ] || return 0
    python3 "$REPO/scripts/llama-ppl.py" "$1" "$BASE_KLD" --act-quant q8_0 --threads "$THREADS" |
        awk '{print $2}'
}

row() {   # name maker file
    local bytes kl ppl mp
    bytes=$(stat -c %s "$3")
    read -r kl ppl < <(judge "$3")
    [ -n "$kl" ] || { log "$3: no KL from llama-perplexity (see $3.kld.txt)"; exit 1; }
    mp=$(agree "$3")
    printf '| %s | %s | %s | %d | %.3f | %s | %s | %s |\n' "$MODEL" "$1" "$2" "$bytes" \
        "$(calc "$bytes * 8 / $PARAMS")" "$kl" "$ppl" "${mp:--}" | tee -a "$WORK/table.md"
    echo "$kl" > "$3.kl"
}

# "$@" (its output into the log $2) unless KEEP=1 and the file $1 is there already: a kept
# file keeps the log of the run that made it
make_file() {
    local f=$1 log=$2
    shift 2
    if [ "$KEEP" = 1 ] && [ -s "$f" ]; then return 0; fi
    "$@" > "$log" 2>&1
}

echo "| model | file | made by | bytes | bits/param | KL mean (llama.cpp) | PPL (llama.cpp) | PPL (moeq, q8_0 activations) |" > "$WORK/table.md"
echo "|---|---|---|---|---|---|---|---|" >> "$WORK/table.md"
: > "$WORK/ratios.md"
for MODEL in $MODELS; do
    SRC=$SHARED/fixtures/models/$MODEL
    D=$WORK/$MODEL
    mkdir -p "$D"
    if [ "$MODEL" = qwen2moe-tiny ]; then   # llama.cpp's qwen2moe never renormalises the top-k
        mkdir -p "$D/src"
        cp -f "$SRC"/* "$D/src/"
        chmod -R u+w "$D/src"
        python3 - "$D/src/config.json" <<'EOF'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
c["norm_topk_prob"] = False
json.dump(c, open(p, "w"), indent=2)
EOF
        SRC=$D/src
    fi
    log "$MODEL: F32 base, its logits, the importance matrix"
    make_file "$D/f32.gguf" "$D/f32.txt" "$MOEQ" export-gguf "$SRC" "$D/f32.gguf" --gguf-rest f32
    PARAMS=$(python3 - "$SRC/model.safetensors" <<'EOF'
import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
tot = 0
for k, v in h.items():
    if k == "__metadata__": continue
    p = 1
    for d in v["shape"]: p *= d
    tot += p
print(tot)
EOF
)
    BASE_KLD=$D/base-$CHUNKS.kld
    make_file "$BASE_KLD" "$D/base.txt" "$LB/llama-perplexity" -m "$D/f32.gguf" -f "$TEXT" -c 512 \
        --chunks "$CHUNKS" -t "$THREADS" --kl-divergence-base "$BASE_KLD"
    make_file "$D/imatrix.gguf" "$D/imatrix.txt" "$LB/llama-imatrix" -m "$D/f32.gguf" -f "$CALIB" -c 512 \
        --chunks 128 -t "$THREADS" -o "$D/imatrix.gguf"
    row "f32 (base against itself)" moeq "$D/f32.gguf"
    for P in $PRESETS; do
        log "$MODEL $P: llama-quantize --imatrix, moeq GPTQ"
        make_file "$D/llama-$P.gguf" "$D/llama-$P.txt" "$LB/llama-quantize" --imatrix "$D/imatrix.gguf" \
            "$D/f32.gguf" "$D/llama-$P.gguf" "$(ftype "$P")" "$THREADS"
        # shellcheck disable=SC2086
        make_file "$D/moeq-$P.gguf" "$D/moeq-$P.txt" "$MOEQ" quantize "$SRC" --out "$D/moeq-$P.gguf" \
            --scheme "$P" --method gptq --calib "$CALIB" --format gguf --force $MOEQ_ARGS
        row "$P" llama.cpp "$D/llama-$P.gguf"
        row "$P" moeq "$D/moeq-$P.gguf"
        lb=$(stat -c %s "$D/llama-$P.gguf")
        mb=$(stat -c %s "$D/moeq-$P.gguf")
        printf '| %s | %s | %.3f | %+.2f%% |\n' "$MODEL" "$P" \
            "$(calc "$(cat "$D/moeq-$P.gguf.kl") / $(cat "$D/llama-$P.gguf.kl")")" \
            "$(calc "($mb - $lb) * 100 / $lb")" >> "$WORK/ratios.md"
    done
    for B in $TARGET_BPW; do
        log "$MODEL: moeq --target-bpw $B"
        # shellcheck disable=SC2086
        make_file "$D/moeq-bpw$B.gguf" "$D/moeq-bpw$B.txt" "$MOEQ" quantize "$SRC" \
            --out "$D/moeq-bpw$B.gguf" --scheme q4_k_m --target-bpw "$B" --method gptq --calib "$CALIB" \
            --format gguf --force $MOEQ_ARGS
        row "target-bpw $B" moeq "$D/moeq-bpw$B.gguf"
        if [ -f "$D/llama-q4_k_m.gguf" ]; then
            lb=$(stat -c %s "$D/llama-q4_k_m.gguf")
            mb=$(stat -c %s "$D/moeq-bpw$B.gguf")
            printf '| %s | target-bpw %s vs Q4_K_M | %.3f | %+.2f%% |\n' "$MODEL" "$B" \
                "$(calc "$(cat "$D/moeq-bpw$B.gguf.kl") / $(cat "$D/llama-q4_k_m.gguf.kl")")" \
                "$(calc "($mb - $lb) * 100 / $lb")" >> "$WORK/ratios.md"
        fi
    done
done
echo
cat "$WORK/table.md"
echo
echo "| model | moeq file | KL moeq / KL llama.cpp | size moeq vs llama.cpp |"
echo "|---|---|---|---|"
cat "$WORK/ratios.md"
echo
echo "llama.cpp: $LB; work files in $WORK"
