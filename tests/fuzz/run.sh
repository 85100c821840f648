#!/usr/bin/env bash
# Runs every libFuzzer target of a fuzz build for a bounded time on a seed corpus made from the
# fixtures (tests/fuzz/corpus.py), as many at a time as there are CPUs ($MOEQ_FUZZ_JOBS), and says
# per target how many inputs ran in how long. CI's fuzz
# job (.ci/run fuzz) runs it; locally:
#   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DMOEQ_BUILD_FUZZ=ON -DMOEQ_BUILD_TESTS=OFF
#   cmake --build build-fuzz -j2 && tests/fuzz/run.sh build-fuzz 25 [TARGET ...]
# A crash, a leak, undefined behaviour or a hang (an input running over 10 s) fails the run; the
# input is kept as ARTIFACTS/<target>/crash-* (ARTIFACTS: $MOEQ_FUZZ_ARTIFACTS, default
# build-fuzz/fuzz-artifacts) and becomes a regression file: tests/fuzz/regressions/<target>/, which
# ctest's fuzz_<target> replays in every build.
set -u
build=${1:?usage: run.sh BUILD_DIR SECONDS [TARGET ...]}
secs=${2:?usage: run.sh BUILD_DIR SECONDS [TARGET ...]}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    for f in "$here"/fuzz_*.c; do t=${f##*/fuzz_}; targets+=("${t%.c}"); done
fi
art=${MOEQ_FUZZ_ARTIFACTS:-$build/fuzz-artifacts}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export TMPDIR=$work
python3 "$here/corpus.py" --cli "$build/moeq" --out "$work/seeds" "${targets[@]}" ||
    { echo "FAIL: the seed corpus could not be made"; exit 1; }
# the longest input each target mutates towards (its seeds are smaller)
max_len() {
    case $1 in
        tokenizer | tiktoken | layout | workdir) echo 16384 ;;
        model) echo 32768 ;;
        *) echo 8192 ;;
    esac
}
# one target: its log, and its line of the table in $work/<target>.row
fuzz_one() {
    local t=$1 bin=$build/fuzz_$1 dict=() seeds=() start end rc runs dur rate
    [ -x "$bin" ] || { printf '%-12s %10s %8s %7s  %s\n' "$t" - - - "FAILED (not built)" > "$work/$t.row"; return; }
    mkdir -p "$art/$t" "$work/corpus/$t"
    [ -f "$here/$t.dict" ] && dict=(-dict="$here/$t.dict")
    [ -d "$work/seeds/$t" ] && seeds=("$work/seeds/$t")
    [ -d "$here/regressions/$t" ] && seeds+=("$here/regressions/$t")
    start=$(date +%s.%N)
    # the new corpus in $work/corpus/$t; the seeds and regression files are only read
    "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len="$(max_len "$t")" \
        -print_final_stats=1 -artifact_prefix="$art/$t/" "${dict[@]}" "$work/corpus/$t" "${seeds[@]}" \
        > "$work/$t.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t.log" | tail -1)
    dur=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
    rate=$(awk -v n="${runs:-0}" -v d="$dur" 'BEGIN { printf "%d", (d > 0 ? n / d : 0) }')
    if [ $rc -eq 0 ]; then
        printf '%-12s %10s %8s %7s  %s\n' "$t" "${runs:-?}" "$dur" "$rate" ok > "$work/$t.row"
    else
        { printf '%-12s %10s %8s %7s  %s\n' "$t" "${runs:-?}" "$dur" "$rate" "FAILED (exit $rc)"
          grep -E "^==[0-9]+==ERROR|SUMMARY|runtime error|ALARM|Test unit written|deadly signal" "$work/$t.log" | head -8
        } > "$work/$t.row"
    fi
}
# as many targets at a time as there are CPUs (each fuzzer runs on one)
par=${MOEQ_FUZZ_JOBS:-$(nproc)}
for t in "${targets[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$par" ]; do wait -n || true; done
    fuzz_one "$t" &
done
wait
failed=()
printf '%-12s %10s %8s %7s  %s\n' target executions seconds exec/s result
for t in "${targets[@]}"; do
    cat "$work/$t.row"
    grep -q "^$t .*ok$" "$work/$t.row" || failed+=("$t")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAIL: fuzz targets failed: ${failed[*]} (inputs in $art/<target>/)"
    exit 1
fi
echo "fuzz: ${#targets[@]} targets, $par at a time, no crash, leak, undefined behaviour or hang"
