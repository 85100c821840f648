#!/usr/bin/env bash
# moeq eval on the bundled olmoe-tiny with small generated texts: the --json object and its
# counts, thread independence, --task text on JSONL, --limit, KL against itself and through saved
# logits, a silent stderr when it is not a terminal, Ctrl-C (partial result, exit 130), and the
# errors for bad input (missing/empty file, invalid UTF-8, --max-length, mismatched logits).
. "$(dirname "$0")/common.sh"
have_python=0
command -v python3 >/dev/null && have_python=1

# Three small wikitext-layout documents: 3 + 4 + 3 lines, one " = = " heading (not a title).
cat > "$tmp/wiki.txt" <<'EOF'
 = First Title = 
 The cat sat on the mat . It was a sunny day , and the cat was happy @-@ ish . 
 = Second Title = 
 Robert ( born 1960 ) is an English actor . He said " hello " to everyone . 
 = = Career = = 
 He played in 2001 and 2002 , earning 1 @,@ 000 dollars . 
 = Third Title = 
 Short page . 
EOF
"$cli" eval "$model" --data "$tmp/wiki.txt" --json > "$tmp/out.json" 2> "$tmp/err"
rc=$?
[ $rc -eq 0 ] || fail "eval exited $rc: $(cat "$tmp/err")"
[ ! -s "$tmp/err" ] || fail "stderr not silent when it is not a terminal: $(cat "$tmp/err")"
[ "$(head -c1 "$tmp/out.json")" = "{" ] && [ "$(tail -n1 "$tmp/out.json")" = "}" ] ||
    fail "--json: stdout is not one object"
for key in word_perplexity byte_perplexity bits_per_byte loglikelihood tokens words bytes \
           documents tokens_per_second; do
    [ -n "$(json_get "$tmp/out.json" $key)" ] || fail "--json lacks $key"
done
[ "$(json_get "$tmp/out.json" documents)" = 3 ] || fail "documents: $(json_get "$tmp/out.json" documents)"
[ "$(json_get "$tmp/out.json" bytes)" = "$(wc -c < "$tmp/wiki.txt")" ] || fail "bytes"
# words: sum over pages of len(re.split(r"\s+", page)), computed with CPython.
[ "$(json_get "$tmp/out.json" words)" = 78 ] || fail "words: $(json_get "$tmp/out.json" words)"
[ "$(json_get "$tmp/out.json" max_length)" = 512 ] || fail "default max_length"
if [ $have_python = 1 ]; then
    python3 - "$tmp/out.json" <<'EOF' || fail "--json output does not parse or is inconsistent"
import json, math, sys
r = json.load(open(sys.argv[1]))
assert abs(r["word_perplexity"] - math.exp(-r["loglikelihood"] / r["words"])) < 1e-9 * r["word_perplexity"]
assert abs(r["bits_per_byte"] + r["loglikelihood"] / r["bytes"] / math.log(2)) < 1e-12
EOF
fi

# Same numbers with one thread and with --max-length smaller than the documents.
"$cli" eval "$model" --data "$tmp/wiki.txt" --json --threads 1 > "$tmp/t1.json" 2>/dev/null
[ "$(json_get "$tmp/t1.json" loglikelihood)" = "$(json_get "$tmp/out.json" loglikelihood)" ] ||
    fail "--threads 1 changes the log-likelihood"
"$cli" eval "$model" --data "$tmp/wiki.txt" --json --max-length 8 --threads 2 > "$tmp/l8a.json" 2>/dev/null
"$cli" eval "$model" --data "$tmp/wiki.txt" --json --max-length 8 --threads 1 > "$tmp/l8b.json" 2>/dev/null
[ "$(json_get "$tmp/l8a.json" loglikelihood)" = "$(json_get "$tmp/l8b.json" loglikelihood)" ] ||
    fail "--max-length 8: threads change the result"
[ "$(json_get "$tmp/l8a.json" tokens)" = "$(json_get "$tmp/out.json" tokens)" ] || fail "--max-length 8: token count"
[ "$(json_get "$tmp/l8a.json" loglikelihood)" != "$(json_get "$tmp/out.json" loglikelihood)" ] ||
    fail "--max-length 8 gives the same log-likelihood as 512"
"$cli" eval "$model" --data "$tmp/wiki.txt" --json --limit 1 > "$tmp/lim.json" 2>/dev/null
[ "$(json_get "$tmp/lim.json" documents)" = 1 ] || fail "--limit 1"

# --task text on JSONL (no detokenizer), with an empty document (counted, warned about).
printf '{"text": "The cat sat on the mat ."}\n{"page": ""}\n\n{"text": "A dog barked at night."}\n' > "$tmp/d.jsonl"
"$cli" eval "$model" --task text --data "$tmp/d.jsonl" --json > "$tmp/txt.json" 2> "$tmp/err" ||
    fail "--task text exited $?: $(cat "$tmp/err")"
[ "$(json_get "$tmp/txt.json" documents)" = 3 ] || fail "--task text: documents"
[ "$(json_get "$tmp/txt.json" empty_documents)" = 1 ] || fail "--task text: empty_documents"
grep -q "document 2 (0 bytes) tokenizes to nothing" "$tmp/err" || fail "no warning for the empty document"
[ -n "$(json_get "$tmp/txt.json" token_perplexity)" ] || fail "--task text: token_perplexity"
"$cli" eval "$model" --task text --data "$tmp/wiki.txt" --json > "$tmp/whole.json" 2>/dev/null
[ "$(json_get "$tmp/whole.json" documents)" = 1 ] || fail "--task text on a text file: one document"

# KL against itself, directly and through saved logits.
"$cli" eval "$model" --data "$tmp/wiki.txt" --kl-base "$model" --json > "$tmp/kl.json" 2>/dev/null ||
    fail "--kl-base exited $?"
[ "$(json_get "$tmp/kl.json" kl_mean)" = 0 ] || fail "KL against itself: $(json_get "$tmp/kl.json" kl_mean)"
[ "$(json_get "$tmp/kl.json" top1_changed)" = 0 ] || fail "top1_changed against itself"
[ -n "$(json_get "$tmp/kl.json" kl_p99)" ] || fail "kl_p99 missing"
"$cli" eval "$model" --data "$tmp/wiki.txt" --save-logits "$tmp/base.topk" --top-k 16 --quiet > /dev/null 2>&1 ||
    fail "--save-logits exited $?"
[ -s "$tmp/base.topk" ] || fail "--save-logits wrote nothing"
"$cli" eval "$model" --data "$tmp/wiki.txt" --kl-logits "$tmp/base.topk" --json > "$tmp/kll.json" 2>/dev/null ||
    fail "--kl-logits exited $?"
[ "$(json_get "$tmp/kll.json" kl_top_k)" = 16 ] || fail "--kl-logits: kl_top_k"
[ "$(json_get "$tmp/kll.json" top1_changed)" = 0 ] || fail "--kl-logits against itself: top1_changed"
"$cli" eval "$model" --data "$tmp/wiki.txt" --kl-logits "$tmp/base.topk" --limit 2 > /dev/null 2> "$tmp/err"
[ $? -eq 1 ] || fail "saved logits of other documents: expected exit 1"
grep -q "base.topk: saved for other token ids" "$tmp/err" || fail "mismatch message: $(cat "$tmp/err")"

# Confidence diagnostics: a higher temperature flattens the distribution.
"$cli" eval "$model" --data "$tmp/wiki.txt" --entropy --json > "$tmp/e1.json" 2>/dev/null ||
    fail "--entropy exited $?"
"$cli" eval "$model" --data "$tmp/wiki.txt" --entropy --temperature 2 --json > "$tmp/e2.json" 2>/dev/null ||
    fail "--temperature exited $?"
awk -v a="$(json_get "$tmp/e1.json" entropy_mean)" -v b="$(json_get "$tmp/e2.json" entropy_mean)" \
    'BEGIN { exit !(a > 0 && b > a) }' || fail "entropy at T=2 not above T=1"
[ "$(json_get "$tmp/e1.json" token_perplexity)" != "$(json_get "$tmp/e2.json" token_perplexity)" ] ||
    fail "--temperature did not change the perplexity"

# Bad input.
expect_fail() {   # expect_fail CODE PATTERN args...
    local code=$1 pat=$2
    shift 2
    "$cli" eval "$@" > "$tmp/o" 2> "$tmp/err"
    local rc=$?
    [ $rc -eq "$code" ] || fail "eval $*: expected exit $code, got $rc"
    grep -q -- "$pat" "$tmp/err" || fail "eval $*: message lacks '$pat': $(cat "$tmp/err")"
    [ ! -s "$tmp/o" ] || fail "eval $*: printed a result"
}
expect_fail 1 "$tmp/missing.txt" "$model" --data "$tmp/missing.txt"
: > "$tmp/empty.txt"
expect_fail 1 "empty.txt: the file is empty" "$model" --data "$tmp/empty.txt"
printf ' = T = \nab\377c\n' > "$tmp/bad.txt"
expect_fail 1 "bad.txt: invalid UTF-8 at byte offset 10" "$model" --data "$tmp/bad.txt"
printf '{"text": 3}\n' > "$tmp/bad.jsonl"
expect_fail 1 "bad.jsonl:1" "$model" --data "$tmp/bad.jsonl"
expect_fail 1 "exceeds the model's max_position_embeddings" "$model" --data "$tmp/wiki.txt" --max-length 100000
expect_fail 1 "$tmp/nomodel" "$tmp/nomodel" --data "$tmp/wiki.txt"
expect_fail 2 "--data" "$model"
expect_fail 2 "only one of --kl-base and --kl-logits" "$model" --data "$tmp/wiki.txt" --kl-base "$model" --kl-logits x
expect_fail 2 "--task" "$model" --data "$tmp/wiki.txt" --task nope
expect_fail 2 "--temperature must be a positive" "$model" --data "$tmp/wiki.txt" --temperature 0
expect_fail 2 "--temperature must be a positive" "$model" --data "$tmp/wiki.txt" --temperature -1
"$cli" eval --help > /dev/null || fail "--help: expected exit 0"

# The progress bar: drawn with an ETA when stderr is a terminal (a pty from script(1)), not with
# --quiet; stdout keeps only the result.
if command -v script >/dev/null; then
    script -qec "'$cli' eval '$model' --data '$tmp/wiki.txt' --json > '$tmp/tty.json'" /dev/null > "$tmp/tty.out" 2>&1
    grep -q "ETA" "$tmp/tty.out" || fail "no progress bar on a terminal: $(cat "$tmp/tty.out")"
    [ "$(json_get "$tmp/tty.json" loglikelihood)" = "$(json_get "$tmp/out.json" loglikelihood)" ] ||
        fail "stdout under a terminal differs"
    script -qec "'$cli' eval '$model' --data '$tmp/wiki.txt' --quiet > /dev/null" /dev/null > "$tmp/tty.out" 2>&1
    ! grep -q "ETA" "$tmp/tty.out" || fail "--quiet still draws the progress bar"
fi

# Ctrl-C: a long text (about 100K tokens), interrupted after a moment, prints the partial result.
for i in $(seq 1 40); do
    printf ' = Page %d = \n' "$i"
    for j in $(seq 1 60); do
        printf ' Sentence %d of page %d tells of the river , the hills and the %d old towns . \n' "$j" "$i" "$((i * j))"
    done
done > "$tmp/long.txt"
"$cli" eval "$model" --data "$tmp/long.txt" --json > "$tmp/int.json" 2> "$tmp/err" &
pid=$!
sleep 2
kill -INT $pid
wait $pid
rc=$?
[ $rc -eq 130 ] || fail "Ctrl-C: expected exit 130, got $rc"
[ "$(json_get "$tmp/int.json" interrupted)" = true ] || fail "Ctrl-C: no partial result: $(cat "$tmp/int.json")"
docs=$(json_get "$tmp/int.json" documents)
[ -n "$docs" ] && [ "$docs" -lt 40 ] || fail "Ctrl-C: documents $docs"
grep -q "interrupted after $docs of 40 documents" "$tmp/err" || fail "Ctrl-C: message: $(cat "$tmp/err")"

# Streamed (--stream on): the whole model's numbers; the plan; a budget too small for one layer.
"$cli" eval "$model" --data "$tmp/wiki.txt" --json --stream on > "$tmp/st.json" 2>/dev/null ||
    fail "--stream on failed"
for key in loglikelihood words bytes tokens documents; do
    [ "$(json_get "$tmp/st.json" $key)" = "$(json_get "$tmp/out.json" $key)" ] || fail "--stream on: $key differs"
done
grep -q '"streamed": true' "$tmp/st.json" || fail "--stream on: the plan does not say streamed"
"$cli" eval "$model" --data "$tmp/wiki.txt" --stream on --dry-run > "$tmp/plan.txt" 2>&1 || fail "--dry-run failed"
grep -q "eval plan: streamed layer by layer" "$tmp/plan.txt" || fail "--dry-run: $(cat "$tmp/plan.txt")"
! grep -q "word_perplexity" "$tmp/plan.txt" || fail "--dry-run ran the evaluation"
expect_fail 1 "one layer needs" "$model" --data "$tmp/wiki.txt" --stream on --max-memory 1MB
expect_fail 2 "--resume continues a streamed run" "$model" --data "$tmp/wiki.txt" --stream off --resume
expect_fail 2 "--max-memory: cannot read" "$model" --data "$tmp/wiki.txt" --max-memory lots

# Ctrl-C of a streamed run whose boundary is in files (each layer durable): exit 130, the work
# directory kept; --resume then gives the uninterrupted run's numbers and removes it.
if [ $have_python = 1 ]; then
    "$cli" eval "$model" --data "$tmp/long.txt" --stream on --dry-run --json > "$tmp/lp.json" 2>/dev/null
    budget=$(python3 -c 'import json,sys; p=json.load(open(sys.argv[1]))["plan"]; print(p["peak_bytes"] - p["read_ahead_bytes"] - p["boundary_bytes"] // 2)' "$tmp/lp.json")
    "$cli" eval "$model" --data "$tmp/long.txt" --json --stream on --max-memory "$budget" > "$tmp/full.json" 2>/dev/null ||
        fail "streamed run with files failed"
    grep -q '"boundary_in_memory": \[false' "$tmp/full.json" || fail "--max-memory $budget: the boundary stayed in memory"
    "$cli" eval "$model" --data "$tmp/long.txt" --json --stream on --max-memory "$budget" --work-dir "$tmp/w" > "$tmp/sint.json" 2> "$tmp/err" &
    pid=$!
    for i in $(seq 1 60); do [ -f "$tmp/w/eval-stream.json" ] && break; sleep 0.5; done
    kill -INT $pid
    wait $pid
    rc=$?
    [ $rc -eq 130 ] || fail "streamed Ctrl-C: expected exit 130, got $rc"
    grep -q -- "--resume continues" "$tmp/err" || fail "streamed Ctrl-C: message: $(cat "$tmp/err")"
    [ -f "$tmp/w/eval-stream.json" ] || fail "streamed Ctrl-C: the work directory's record is gone"
    "$cli" eval "$model" --data "$tmp/long.txt" --json --stream on --max-memory "$budget" --work-dir "$tmp/w" --resume > "$tmp/res.json" 2>/dev/null ||
        fail "--resume failed"
    [ "$(json_get "$tmp/res.json" loglikelihood)" = "$(json_get "$tmp/full.json" loglikelihood)" ] ||
        fail "--resume: $(json_get "$tmp/res.json" loglikelihood) against $(json_get "$tmp/full.json" loglikelihood)"
    grep -q '"layers_resumed": 0' "$tmp/res.json" && fail "--resume resumed no layer"
    [ ! -e "$tmp/w/eval-stream.json" ] || fail "--resume left its record behind"
fi

# --device cuda: where no GPU answers (none on the machine, or a build without CUDA) exit 1 with a
# message naming the device; on a GPU the figures agree with the CPU's (a loose 1e-3 relative
# here: tests/test_gpu_eval.c holds the derived tolerance, about 1e-3 for this model in fp32).
"$cli" eval "$model" --data "$tmp/wiki.txt" --json --device cuda > "$tmp/gpu.json" 2> "$tmp/err"
rc=$?
if [ $rc -eq 0 ]; then
    rel_close "$(json_get "$tmp/gpu.json" loglikelihood)" "$(json_get "$tmp/out.json" loglikelihood)" 1e-3 ||
        fail "--device cuda: loglikelihood $(json_get "$tmp/gpu.json" loglikelihood) against the CPU's $(json_get "$tmp/out.json" loglikelihood)"
else
    [ $rc -eq 1 ] || fail "--device cuda without a GPU: expected exit 1, got $rc"
    grep -q "cuda:0" "$tmp/err" && grep -Eq "no CUDA device|built without CUDA" "$tmp/err" ||
        fail "--device cuda without a GPU: message: $(cat "$tmp/err")"
fi
expect_fail 2 "--gpu-precision needs --device cuda" "$model" --data "$tmp/wiki.txt" --gpu-precision tf32
expect_fail 2 "expected cpu, cuda or cuda:N" "$model" --data "$tmp/wiki.txt" --device gpu

[ $fails -eq 0 ] || exit 1
echo "test_eval: all checks passed"
