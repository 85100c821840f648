#!/usr/bin/env bash
# moeq quantize killed (SIGKILL) at several points of a GPTQ run — after the first layer, inside
# a layer's expert chunks, between two Linears being written, just before the final rename —
# leaves no OUT_DIR, refuses to start over without --resume, and the same command with --resume
# finishes with a checkpoint byte-identical to an uninterrupted run's. Also: --dry-run writes
# nothing, a --max-memory too small is refused before any work, bad values exit 2.
. "$(dirname "$0")/common.sh"

calib=$repo/data/demo-calib.txt
args=(--scheme nvfp4a16 --method gptq --calib "$calib" --nsamples 8 --seqlen 64 --expert-chunk 3
      --quiet)
"$cli" quantize "$model" --out "$tmp/base" "${args[@]}" || fail "the uninterrupted run exited $?"

same() { same_checkpoint "$tmp/base" "$1" "$2" "the uninterrupted run"; }

for fault in layer:0 chunk:1:1 linear:2:5 rename:0; do
    MOEQ_FAULT=$fault "$cli" quantize "$model" --out "$tmp/q" "${args[@]}" 2>/dev/null
    rc=$?
    [ $rc -eq 137 ] || fail "$fault: the killed run exited $rc, expected 137 (SIGKILL)"
    [ -e "$tmp/q" ] && fail "$fault: OUT_DIR exists after the kill"
    [ -f "$tmp/q.moeq-work/manifest.json" ] || fail "$fault: no work manifest"
    err=$("$cli" quantize "$model" --out "$tmp/q" "${args[@]}" 2>&1)
    rc=$?
    [ $rc -eq 1 ] || fail "$fault: starting over without --resume exited $rc"
    printf '%s\n' "$err" | grep -q -- "--resume" || fail "$fault: the refusal does not mention --resume: $err"
    "$cli" quantize "$model" --out "$tmp/q" "${args[@]}" --resume || fail "$fault: --resume exited $?"
    [ -e "$tmp/q.moeq-work" ] && fail "$fault: the work directory is left after the resumed run"
    same "$tmp/q" "$fault"
    rm -rf "$tmp/q"
done

# a resume with another option is refused, saying which
MOEQ_FAULT=layer:1 "$cli" quantize "$model" --out "$tmp/q" "${args[@]}" 2>/dev/null
err=$("$cli" quantize "$model" --out "$tmp/q" "${args[@]}" --percdamp 0.1 --resume 2>&1)
[ $? -eq 1 ] || fail "a resume with another --percdamp did not exit 1"
printf '%s\n' "$err" | grep -q "percdamp" || fail "the refusal does not name percdamp: $err"
rm -rf "$tmp/q.moeq-work"

# an expert-balanced calibration: the resume takes the choice the work directory kept (no second
# pass over the candidates); a record that is not this run's is chosen again, the same way
bargs=(--scheme nvfp4a16 --method gptq --calib "$calib" --nsamples 8 --seqlen 64 --expert-chunk 3
       --calib-balance experts --calib-pool 16)
"$cli" quantize "$model" --out "$tmp/bbase" "${bargs[@]}" 2>/dev/null >&2 || fail "the balanced run exited $?"
for record in kept damaged; do
    MOEQ_FAULT=layer:1 "$cli" quantize "$model" --out "$tmp/bq" "${bargs[@]}" 2>/dev/null
    [ -f "$tmp/bq.moeq-work/calib-choice.json" ] || fail "balanced: no calib-choice.json in the work directory"
    [ $record = damaged ] && echo '{"candidates": 16, "chosen": [0]}' > "$tmp/bq.moeq-work/calib-choice.json"
    err=$("$cli" quantize "$model" --out "$tmp/bq" "${bargs[@]}" --resume 2>&1 >/dev/null) ||
        fail "balanced, $record record: --resume exited $?"
    if [ $record = kept ]; then
        printf '%s\n' "$err" | grep -q "the interrupted run chose" || fail "balanced: the resume chose again: $err"
    else
        printf '%s\n' "$err" | grep -q "choosing again" || fail "balanced: a damaged record was used: $err"
    fi
    same_checkpoint "$tmp/bbase" "$tmp/bq" "balanced, $record record" "the uninterrupted balanced run"
    rm -rf "$tmp/bq"
done
cmp -s "$tmp/base/model.safetensors" "$tmp/bbase/model.safetensors" && fail "balanced: the same checkpoint as the first 8 samples'"

# --dry-run prints the plan and writes nothing
out=$("$cli" quantize "$model" --out "$tmp/dry" "${args[@]}" --dry-run) || fail "--dry-run exited $?"
[ -e "$tmp/dry" ] || [ -e "$tmp/dry.moeq-work" ] && fail "--dry-run wrote something"
printf '%s\n' "$out" | grep -q "calibration activations" || fail "--dry-run: no activations line: $out"
printf '%s\n' "$out" | grep -q "3 experts at a time" || fail "--dry-run: no expert chunk line: $out"
printf '%s\n' "$out" | grep -q "estimated time" || fail "--dry-run: no time estimate: $out"

# a budget below the plan: refused before any work, naming what is needed
err=$("$cli" quantize "$model" --out "$tmp/small" "${args[@]}" --max-memory 2MB 2>&1)
[ $? -eq 1 ] || fail "--max-memory 2MB did not exit 1"
printf '%s\n' "$err" | grep -q "too small" || fail "--max-memory 2MB: $err"
[ -e "$tmp/small" ] || [ -e "$tmp/small.moeq-work" ] && fail "--max-memory 2MB left output"
"$cli" quantize "$model" --out "$tmp/x" "${args[@]}" --max-memory lots >/dev/null 2>&1
[ $? -eq 2 ] || fail "--max-memory lots did not exit 2"
"$cli" quantize "$model" --out "$tmp/x" "${args[@]}" --activations tape >/dev/null 2>&1
[ $? -eq 2 ] || fail "--activations tape did not exit 2"

exit $((fails > 0))
