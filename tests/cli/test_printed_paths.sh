#!/usr/bin/env bash
# What a command prints is what it wrote: every absolute path that quantize (RTN and GPTQ into
# compressed-tensors, ModelOpt, GPTQ and GGUF, with --report and --report-html), eval (--save-logits,
# --html, --kl-logits, a streamed run with --work-dir) and export-gguf print on stdout or stderr
# exists once the command has ended; the paths each run must print are checked by name too, so that
# a run printing none cannot pass. Issue 58: quantize --format gguf printed X.gguf/gptq_report.json
# and wrote X.gguf.gptq_report.json.
. "$(dirname "$0")/common.sh"

calib=$repo/data/demo-calib.txt
text=$repo/data/demo-eval.txt
gargs=(--method gptq --calib "$calib" --nsamples 4 --seqlen 32)

# check_paths WHAT FILE MUST...: every absolute path in FILE (a token starting with / after the
# start of a line, a blank, a quote, '(' or '='; a trailing ':', ',', '.' or ';' is punctuation)
# exists, and each MUST path is among them
check_paths() {
    local what=$1 file=$2 p n=0
    shift 2
    while IFS= read -r p; do
        p=${p#[[:space:]\"\'(=]}
        p=${p%[:,.;]}
        n=$((n + 1))
        [ -e "$p" ] || fail "$what: printed $p, which does not exist"
    done < <(grep -oE "(^|[[:space:]\"'(=])/[^[:space:]\"'),]+" "$file")
    for p in "$@"; do
        grep -qF -- "$p" "$file" || fail "$what: did not print $p: $(cat "$file")"
    done
    [ $n -gt 0 ] || fail "$what: printed no path at all"
}
# run WHAT MUST... -- COMMAND...: COMMAND's stdout and stderr into $tmp/log, then check_paths
run() {
    local what=$1 must=()
    shift
    while [ "$1" != -- ]; do must+=("$1"); shift; done
    shift
    "$@" > "$tmp/log" 2>&1 || fail "$what: exited $?: $(cat "$tmp/log")"
    check_paths "$what" "$tmp/log" "${must[@]}"
}

run "quantize rtn compressed-tensors" "$tmp/ct:" -- \
    "$cli" quantize "$model" --out "$tmp/ct" --scheme nvfp4a16
run "quantize rtn modelopt" "$tmp/mo:" -- \
    "$cli" quantize "$model" --out "$tmp/mo" --scheme nvfp4a16 --format modelopt
run "quantize gptq --format gptq" "report: $tmp/gq/gptq_report.json" "report page: $tmp/page.html" -- \
    "$cli" quantize "$model" --out "$tmp/gq" --scheme int4 --group-size 32 --format gptq "${gargs[@]}" \
    --report-html "$tmp/page.html"
[ -s "$tmp/gq/gptq_report.json" ] || fail "gptq: no report in the checkpoint"
# the issue's case: the report goes beside the .gguf file and is printed so
run "quantize gptq --format gguf" "report: $tmp/g.gguf.gptq_report.json" "$tmp/g.gguf:" -- \
    "$cli" quantize "$model" --out "$tmp/g.gguf" --scheme int4 --group-size 32 --format gguf "${gargs[@]}"
[ -e "$tmp/g.gguf/gptq_report.json" ] && fail "gguf: a report inside the file's path"
mkdir "$tmp/r"
run "quantize gptq --report" "report: $tmp/r/mine.json" -- \
    "$cli" quantize "$model" --out "$tmp/ct2" --scheme nvfp4a16 "${gargs[@]}" --report "$tmp/r/mine.json"
[ -e "$tmp/ct2/gptq_report.json" ] && fail "--report: the default report was written as well"
# a report into OUT_DIR itself: it exists by the time the report is written
run "quantize gptq --report OUT_DIR/FILE" "report: $tmp/ct3/mine.json" -- \
    "$cli" quantize "$model" --out "$tmp/ct3" --scheme nvfp4a16 "${gargs[@]}" --report "$tmp/ct3/mine.json"

# a report or page into a folder that does not exist: refused before any work, naming the file
# (it used to fail at the end, naming a temporary file, with the checkpoint already published)
for flag in --report --report-html; do
    "$cli" quantize "$model" --out "$tmp/nr" --scheme nvfp4a16 "${gargs[@]}" $flag "$tmp/none/r" > "$tmp/log" 2>&1
    rc=$?
    [ $rc -eq 1 ] || fail "$flag into a missing folder: exit $rc, expected 1"
    grep -q "$tmp/none/r: .*$tmp/none is not a directory" "$tmp/log" || fail "$flag into a missing folder: $(cat "$tmp/log")"
    grep -q "layer 1/4" "$tmp/log" && fail "$flag into a missing folder: refused only after the work"
    [ -e "$tmp/nr" ] || [ -e "$tmp/nr.moeq-work" ] && fail "$flag into a missing folder: left $(ls -d "$tmp"/nr*)"
done

# a killed run: the refusal to start over names the work directory it kept (a failed command may
# name its intended OUT_DIR, so only the kept directory is checked here)
MOEQ_FAULT=layer:0 "$cli" quantize "$model" --out "$tmp/k" --scheme nvfp4a16 "${gargs[@]}" --quiet 2>/dev/null
"$cli" quantize "$model" --out "$tmp/k" --scheme nvfp4a16 "${gargs[@]}" > "$tmp/log" 2>&1 &&
    fail "a run over a kept work directory without --resume succeeded"
grep -q "^moeq quantize: error: $tmp/k.moeq-work: " "$tmp/log" || fail "the refusal does not name the work directory: $(cat "$tmp/log")"
[ -d "$tmp/k.moeq-work" ] || fail "the refusal names $tmp/k.moeq-work, which does not exist"

run "export-gguf" "wrote $tmp/e.gguf" -- "$cli" export-gguf "$tmp/gq" "$tmp/e.gguf"
run "eval --save-logits --html" "$model" -- \
    "$cli" eval "$model" --task text --data "$text" --save-logits "$tmp/l.bin" --html "$tmp/e.html"
[ -s "$tmp/l.bin" ] && [ -s "$tmp/e.html" ] || fail "eval: --save-logits or --html not written"
run "eval --kl-logits" "$tmp/ct" -- \
    "$cli" eval "$tmp/ct" --task text --data "$text" --kl-logits "$tmp/l.bin"
run "eval streamed" "$model" -- \
    "$cli" eval "$model" --task text --data "$text" --stream on --work-dir "$tmp/ew"

exit $((fails > 0))
