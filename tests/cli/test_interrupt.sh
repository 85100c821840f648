#!/usr/bin/env bash
# Ctrl-C in the long stages: SIGINT sent to a running command on a generated model (the real
# OLMoE layout, made smaller: `bench gen-model --like olmoe-1b-7b --layers 2`), at a few moments so
# that it lands in different stages (loading, the calibration passes and GPTQ; a streamed eval with
# --kl-base, its layer loads, passes and scores). Each must exit 130 with its message: quantize
# leaves no checkpoint, eval prints the partial result. How long each took to answer is printed,
# not asserted (the machine's load decides it); only a run still going 60 s after the signal fails.
# /work/big's full-size checkpoints are for the same check by hand (docs/real-size.md).
. "$(dirname "$0")/common.sh"
native_only "timing of signals under an emulator"
gm=$tmp/gm
"$cli" bench gen-model --like olmoe-1b-7b --layers 2 --experts 16 --hidden 1024 --ffn 1024 --vocab 4096 \
    --out "$gm" --quiet >/dev/null 2>&1 || { echo "FAIL: bench gen-model"; exit 1; }
text=$repo/data/demo-eval.txt

# interrupt WHAT DELAY OUT ERR -- COMMAND...: runs COMMAND, sends SIGINT after DELAY seconds, waits
# up to 60 s; sets rc and answered (seconds from the signal to the exit; "" when it ended first)
interrupt() {
    local what=$1 delay=$2 out=$3 err=$4
    shift 5
    "$@" >"$out" 2>"$err" &
    local pid=$! t0 t1 i
    # a background job of a script starts with SIGINT ignored until moeq installs its handler: on
    # a loaded machine 0.3 s can come before that, and the signal would be lost (a terminal's
    # Ctrl-C then kills the process outright). The delay counts from the handler being in place.
    for ((i = 0; i < 300; i++)); do
        caught=$(awk '/^SigCgt:/ { print $2 }' "/proc/$pid/status" 2>/dev/null) || break
        [ -n "$caught" ] && (( (16#$caught >> 1) & 1 )) && break
        sleep 0.1
    done
    sleep "$delay"
    answered=
    if kill -0 "$pid" 2>/dev/null; then
        t0=$(date +%s.%N)
        kill -INT "$pid"
        for ((i = 0; i < 600; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        t1=$(date +%s.%N)
        if kill -0 "$pid" 2>/dev/null; then
            fail "$what: still running 60 s after SIGINT"
            kill -KILL "$pid"
        fi
        answered=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
    fi
    wait "$pid"
    rc=$?
}

# quantize: the signal at 0.3 s (loading the model, the calibration text) and at 3 s (the layers)
for delay in 0.3 3; do
    out=$tmp/q-$delay
    interrupt "quantize, SIGINT at ${delay} s" "$delay" "$tmp/q.out" "$tmp/q.err" -- \
        "$cli" quantize "$gm" --out "$out" --scheme nvfp4a16 --method gptq --calib "$repo/data/demo-calib.txt" \
        --nsamples 64 --seqlen 256 --quiet
    if [ -z "$answered" ]; then
        echo "quantize ended before the signal at ${delay} s (rc $rc): nothing to check"
        continue
    fi
    echo "quantize, SIGINT at ${delay} s: exit $rc, answered in ${answered} s"
    [ "$rc" -eq 130 ] || fail "quantize, SIGINT at ${delay} s: exit $rc, expected 130 ($(tail -2 "$tmp/q.err"))"
    grep -q "interrupted" "$tmp/q.err" || fail "quantize, SIGINT at ${delay} s: no 'interrupted' in: $(tail -2 "$tmp/q.err")"
    [ ! -e "$out" ] || fail "quantize, SIGINT at ${delay} s: $out exists (a partial checkpoint)"
done

# eval with --kl-base, streamed (layer by layer, the base's layer then the model's; then the scores)
for delay in 0.3 2; do
    interrupt "eval --kl-base, SIGINT at ${delay} s" "$delay" "$tmp/e.out" "$tmp/e.err" -- \
        "$cli" eval "$gm" --kl-base "$gm" --task text --data "$text" --stream on --max-length 512 \
        --work-dir "$tmp/ework-$delay"
    if [ -z "$answered" ]; then
        echo "eval ended before the signal at ${delay} s (rc $rc): nothing to check"
        continue
    fi
    echo "eval --kl-base (streamed), SIGINT at ${delay} s: exit $rc, answered in ${answered} s"
    [ "$rc" -eq 130 ] || fail "eval, SIGINT at ${delay} s: exit $rc, expected 130 ($(tail -2 "$tmp/e.err"))"
    grep -qi "interrupt" "$tmp/e.out" "$tmp/e.err" ||
        fail "eval, SIGINT at ${delay} s: no word of the interrupt in its output: $(tail -2 "$tmp/e.out") $(tail -2 "$tmp/e.err")"
done

# eval of the whole model (loaded in full, not streamed)
interrupt "eval (whole model), SIGINT at 0.3 s" 0.3 "$tmp/w.out" "$tmp/w.err" -- \
    "$cli" eval "$gm" --task text --data "$text" --stream off --max-length 512
if [ -n "$answered" ]; then
    echo "eval (whole model), SIGINT at 0.3 s: exit $rc, answered in ${answered} s"
    [ "$rc" -eq 130 ] || fail "eval (whole model), SIGINT at 0.3 s: exit $rc, expected 130 ($(tail -2 "$tmp/w.err"))"
fi

[ "$fails" -eq 0 ] || exit 1
echo "PASS"
