#!/usr/bin/env bash
# moeq generate: greedy output pinned (recorded after the golden forward tests passed, so it is
# anchored to a verified forward pass), deterministic sampling for a seed and any thread count,
# stopping at EOS (a copy of the model whose config names " ." as EOS), and usage/exit codes.
. "$(dirname "$0")/common.sh"

expected='The history of the world .
The man is the most of the world , and the same time is the most of the world .
The man is the only one of the'
out=$("$cli" generate "$model" --prompt "The history of the" -n 32 --greedy 2>"$tmp/err") ||
    fail "greedy exited $?: $(cat "$tmp/err")"
[ "$out" = "$expected" ] || fail "greedy output differs: got [$out]"
grep -q "prefill: .* tokens/s.*decode: .* tokens/s" "$tmp/err" || fail "no tokens/s on stderr: $(cat "$tmp/err")"
# greedy is the default; thread count changes nothing
out2=$("$cli" generate "$model" --prompt "The history of the" -n 32 --threads 1 2>/dev/null)
[ "$out2" = "$expected" ] || fail "default/1-thread output differs: got [$out2]"

s1=$("$cli" generate "$model" --prompt "Once upon a time" -n 24 --temp 0.8 --top-p 0.9 --seed 7 2>/dev/null) ||
    fail "sampling exited $?"
s2=$("$cli" generate "$model" --prompt "Once upon a time" -n 24 --temp 0.8 --top-p 0.9 --seed 7 --threads 1 2>/dev/null)
s3=$("$cli" generate "$model" --prompt "Once upon a time" -n 24 --temp 0.8 --top-p 0.9 --seed 8 2>/dev/null)
[ "$s1" = "$s2" ] || fail "same seed gave different text: [$s1] vs [$s2]"
[ "$s1" != "$s3" ] || fail "seeds 7 and 8 gave the same text: [$s1]"
case "$s1" in "Once upon a time"?*) ;; *) fail "sampled text does not continue the prompt: [$s1]" ;; esac
# a tiny top-p keeps only the most likely token: the same as greedy
g=$("$cli" generate "$model" --prompt "The history of the" -n 12 2>/dev/null)
t=$("$cli" generate "$model" --prompt "The history of the" -n 12 --temp 1.5 --top-p 1e-9 --seed 3 2>/dev/null)
[ "$g" = "$t" ] || fail "top-p 1e-9 differs from greedy: [$t] vs [$g]"

# EOS: a copy of the model whose config.json says eos_token_id = 270 (" .")
mkdir "$tmp/eos"
for f in model.safetensors tokenizer.json tokenizer_config.json; do ln -s "$model/$f" "$tmp/eos/$f"; done
sed 's/"eos_token_id": 0/"eos_token_id": 270/' "$model/config.json" > "$tmp/eos/config.json"
grep -q '"eos_token_id": 270' "$tmp/eos/config.json" || fail "could not set eos_token_id"
out=$("$cli" generate "$tmp/eos" --prompt "The history of the" -n 32 --greedy 2>/dev/null)
[ "$out" = "The history of the world" ] || fail "did not stop at EOS: [$out]"
out=$("$cli" generate "$tmp/eos" --prompt "The history of the" -n 32 --greedy --ignore-eos 2>/dev/null)
[ "$out" = "$expected" ] || fail "--ignore-eos: got [$out]"

# usage errors: exit 2 with a message naming the problem
"$cli" generate "$model" --prompt x -n 4 --bogus >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] || fail "bad flag: expected exit 2"
grep -q -- "--bogus" "$tmp/err" || fail "bad flag not named: $(cat "$tmp/err")"
# no prompt at all: stdin is read when it is not a terminal (an empty one is an empty prompt:
# the model's BOS alone, as --prompt ""), a usage error when it is one
out=$("$cli" generate "$model" -n 4 </dev/null 2>"$tmp/err") || fail "empty stdin: exit $?: $(cat "$tmp/err")"
out2=$("$cli" generate "$model" --prompt "" -n 4 2>/dev/null)
[ -n "$out" ] && [ "$out" = "$out2" ] || fail "empty stdin differs from --prompt \"\": [$out] vs [$out2]"
if command -v script >/dev/null 2>&1; then
    script -qec "'$cli' generate '$model' -n 4" /dev/null >"$tmp/tty" 2>&1
    [ $? -eq 2 ] || fail "no prompt on a terminal: expected exit 2: $(cat "$tmp/tty")"
    grep -q -- "--prompt-file" "$tmp/tty" || fail "no prompt on a terminal: the sources not named: $(cat "$tmp/tty")"
fi
"$cli" generate "$model" --prompt x -n 4 --greedy --temp 0.5 >/dev/null 2>&1
[ $? -eq 2 ] || fail "--greedy with --temp: expected exit 2"
"$cli" generate "$model" --prompt x -n 4 --top-p 1.5 >/dev/null 2>&1
[ $? -eq 2 ] || fail "--top-p 1.5: expected exit 2"
"$cli" generate "$model" --prompt x -n abc >/dev/null 2>&1
[ $? -eq 2 ] || fail "-n abc: expected exit 2"
"$cli" generate "$model" --prompt x -n 600 >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] || fail "-n past the context: expected exit 2"
grep -q "context of 512" "$tmp/err" || fail "context error not explained: $(cat "$tmp/err")"
"$cli" generate --help | grep -q -- "--top-p" || fail "--help does not list --top-p"

# ---- the library sampler's options ----------------------------------------------------------
# each that keeps only the most likely token gives greedy's text; --temp 0 is greedy
for opts in "--temp 0" "--top-k 1 --temp 1.7 --seed 5" "--min-p 1 --temp 2 --seed 9" \
            "--top-k 40 --top-p 1e-9 --min-p 0.05 --seed 1"; do
    t=$("$cli" generate "$model" --prompt "The history of the" -n 12 $opts 2>/dev/null)
    [ "$t" = "$g" ] || fail "$opts differs from greedy: [$t] vs [$g]"
done
# penalties change greedy's text (it repeats "the world"), the same way on any thread count;
# --repeat-last-n 0 turns them off
p1=$("$cli" generate "$model" --prompt "The history of the" -n 32 --repeat-penalty 1.5 2>/dev/null)
p2=$("$cli" generate "$model" --prompt "The history of the" -n 32 --repeat-penalty 1.5 --threads 1 2>/dev/null)
p0=$("$cli" generate "$model" --prompt "The history of the" -n 32 --repeat-penalty 1.5 --repeat-last-n 0 2>/dev/null)
[ "$p1" != "$expected" ] || fail "--repeat-penalty 1.5 changed nothing"
[ "$p1" = "$p2" ] || fail "--repeat-penalty: thread count changed the text: [$p1] vs [$p2]"
[ "$p0" = "$expected" ] || fail "--repeat-last-n 0 still penalized: [$p0]"
f1=$("$cli" generate "$model" --prompt "The history of the" -n 32 --frequency-penalty 2 --presence-penalty 0.5 2>/dev/null)
[ "$f1" != "$expected" ] || fail "--frequency-penalty/--presence-penalty changed nothing"
# every option together, sampled: reproducible by seed, another seed another text
a1=$("$cli" generate "$model" --prompt "Once upon a time" -n 24 --temp 0.9 --top-k 50 --top-p 0.95 --min-p 0.02 --repeat-penalty 1.1 --repeat-last-n 16 --presence-penalty 0.2 --frequency-penalty 0.1 --seed 11 2>/dev/null)
a2=$("$cli" generate "$model" --prompt "Once upon a time" -n 24 --temp 0.9 --top-k 50 --top-p 0.95 --min-p 0.02 --repeat-penalty 1.1 --repeat-last-n 16 --presence-penalty 0.2 --frequency-penalty 0.1 --seed 11 --threads 1 2>/dev/null)
[ -n "$a1" ] && [ "$a1" = "$a2" ] || fail "all options, seed 11: not reproducible: [$a1] vs [$a2]"

# ---- --stop: the output is cut exactly before the first occurrence of any stop string -------
gen=${expected#"The history of the"}   # the generated text
for stop in " world" "most" "world , and" "\nThe man" "time is the most" "."; do
    s=$(printf '%b' "$stop")
    want="The history of the${gen%%"$s"*}"
    out=$("$cli" generate "$model" --prompt "The history of the" -n 32 --stop "$s" 2>/dev/null)
    [ "$out" = "$want" ] || fail "--stop '$stop': got [$out], expected [$want]"
done
# several: the earliest wins; a stop string that never comes (though "the " keeps looking like
# its start, so that text is held back a while) leaves the output whole
out=$("$cli" generate "$model" --prompt "The history of the" -n 32 --stop "only" --stop "same" 2>/dev/null)
[ "$out" = "The history of the${gen%%same*}" ] || fail "--stop only --stop same: got [$out]"
out=$("$cli" generate "$model" --prompt "The history of the" -n 32 --stop "the zebra" --stop "world ! " 2>/dev/null)
[ "$out" = "$expected" ] || fail "--stop that never matches: got [$out]"
# it stops generating too: --json counts the tokens up to the one completing the stop string
"$cli" generate "$model" --prompt "The history of the" -n 32 --stop "world , and" --json >"$tmp/stop.json" 2>/dev/null ||
    fail "--stop --json exited $?"
grep -q '"finish_reason": "stop"' "$tmp/stop.json" || fail "--stop: finish_reason: $(cat "$tmp/stop.json")"
grep -q '"stop": "world , and"' "$tmp/stop.json" || fail "--stop: the stop string not reported"
[ "$(json_get "$tmp/stop.json" generated_tokens)" -lt 32 ] || fail "--stop did not end generation"
"$cli" generate "$model" --prompt x -n 4 --stop "" >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "--stop" "$tmp/err" || fail "--stop '': expected exit 2 naming --stop"

# ---- --json: the prompt's and the generated ids, the text without the prompt ----------------
"$cli" generate "$model" --prompt "The history of the" -n 32 --json >"$tmp/g.json" 2>"$tmp/err" ||
    fail "--json exited $?: $(cat "$tmp/err")"
python3 - "$tmp/g.json" "$gen" <<'PY' || fail "--json output: $(cat "$tmp/g.json")"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["prompt"] == "The history of the" and j["text"] == sys.argv[2], j
assert len(j["ids"]) == 32 and j["generated_tokens"] == 32 and j["finish_reason"] == "length", j
assert j["prompt_ids"][1:] == [349, 2232, 282, 263] and j["prompt_tokens"] == 5, j   # BOS, then the text
assert j["ids_without_text"] == [] and j["stop"] is None, j
PY
# the ids are the ones the text decodes from: tokenize's ids of the whole output equal them
# where the tokenization is canonical (here: every one)
"$cli" tokenize "$model" --text "$gen" --json >"$tmp/ids.json" 2>/dev/null || fail "tokenize exited $?"
python3 - "$tmp/g.json" "$tmp/ids.json" <<'PY' || fail "--json ids are not the text's tokens"
import json, sys
assert json.load(open(sys.argv[1]))["ids"] == json.load(open(sys.argv[2]))
PY
# at EOS: the EOS id ends the list, its text is not printed
"$cli" generate "$tmp/eos" --prompt "The history of the" -n 32 --json >"$tmp/e.json" 2>/dev/null
python3 - "$tmp/e.json" <<'PY' || fail "--json at EOS: $(cat "$tmp/e.json")"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["finish_reason"] == "eos" and j["ids"] == [853, 270] and j["text"] == " world", j
PY

# ---- the prompt from a file or stdin (one trailing newline dropped, as llama.cpp's -f) -------
printf 'The history of the\n' >"$tmp/prompt.txt"
out=$("$cli" generate "$model" --prompt-file "$tmp/prompt.txt" -n 32 2>"$tmp/err") || fail "--prompt-file exited $?: $(cat "$tmp/err")"
[ "$out" = "$expected" ] || fail "--prompt-file: got [$out]"
out=$(printf 'The history of the\n' | "$cli" generate "$model" --prompt - -n 32 2>/dev/null)
[ "$out" = "$expected" ] || fail "--prompt -: got [$out]"
out=$(printf 'The history of the' | "$cli" generate "$model" -n 32 2>/dev/null)
[ "$out" = "$expected" ] || fail "prompt on stdin: got [$out]"
# only one newline goes: a prompt ending in a blank line keeps one
printf 'The history of the\n\n' >"$tmp/prompt2.txt"
"$cli" generate "$model" --prompt-file "$tmp/prompt2.txt" -n 4 --json >"$tmp/p2.json" 2>/dev/null
python3 - "$tmp/p2.json" <<'PY' || fail "--prompt-file with a blank last line: $(cat "$tmp/p2.json")"
import json, sys
assert json.load(open(sys.argv[1]))["prompt"] == "The history of the\n"
PY
"$cli" generate "$model" --prompt-file "$tmp/no-such-file" -n 4 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "missing --prompt-file: expected exit 1"
grep -q -- "--prompt-file $tmp/no-such-file" "$tmp/err" || fail "missing --prompt-file not named: $(cat "$tmp/err")"
"$cli" generate "$model" --prompt-file "$tmp" -n 4 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q -- "--prompt-file $tmp" "$tmp/err" || fail "--prompt-file DIR: $(cat "$tmp/err")"
"$cli" generate "$model" --prompt x --prompt-file "$tmp/prompt.txt" -n 4 >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] || fail "--prompt with --prompt-file: expected exit 2"
grep -q -- "--prompt and --prompt-file" "$tmp/err" || fail "--prompt with --prompt-file not explained: $(cat "$tmp/err")"
printf 'bad \377 byte' >"$tmp/bad.txt"
"$cli" generate "$model" --prompt-file "$tmp/bad.txt" -n 4 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q -- "--prompt-file $tmp/bad.txt.*byte offset 4" "$tmp/err" ||
    fail "--prompt-file not UTF-8: $(cat "$tmp/err")"

# ---- ids past the tokenizer: a model with 50,304 embedding rows and olmoe-tiny's 4,096-id
# tokenizer (OLMoE pads the same way). Before, decoding such an id aborted generation.
"$cli" bench gen-model --like olmoe-1b-7b --out "$tmp/padded" --layers 1 --experts 2 --hidden 64 \
    --ffn 32 --vocab 50304 --quiet >/dev/null 2>"$tmp/err" || fail "gen-model exited $?: $(cat "$tmp/err")"
out=$("$cli" generate "$tmp/padded" --prompt "The history of the" -n 16 2>"$tmp/err") ||
    fail "padded vocabulary: exit $?: $(cat "$tmp/err")"
"$cli" generate "$tmp/padded" --prompt "The history of the" -n 16 --json >"$tmp/pad.json" 2>/dev/null ||
    fail "padded vocabulary --json: exit $?"
python3 - "$tmp/pad.json" "$out" <<'PY' || fail "padded vocabulary: $(cat "$tmp/pad.json")"
import json, sys
j = json.load(open(sys.argv[1]))
past = [i for i in j["ids"] if i >= 4096]
assert len(j["ids"]) == 16 and past, j                      # such ids were sampled, and listed
assert j["ids_without_text"] == past, j                     # they are the ones without text
assert sys.argv[2] == j["prompt"] + j["text"], (sys.argv[2], j)   # streaming printed the same
PY
# and the text is what the ids below 4096 decode to (each alone: tokenize maps that text back)
python3 - "$tmp/pad.json" >"$tmp/known.txt" <<'PY'
import json, sys
print(" ".join(str(i) for i in json.load(open(sys.argv[1]))["ids"] if i < 4096))
PY
python3 -c 'import json,sys; open(sys.argv[2], "w").write(json.load(open(sys.argv[1]))["text"])' "$tmp/pad.json" "$tmp/pad.txt"
"$cli" tokenize "$model" --file "$tmp/pad.txt" --json >"$tmp/known.json" 2>/dev/null
python3 - "$tmp/known.json" "$tmp/known.txt" <<'PY' || fail "padded vocabulary: the text is not the known ids' ($(cat "$tmp/known.txt"))"
import json, sys
assert json.load(open(sys.argv[1])) == [int(x) for x in open(sys.argv[2]).read().split()]
PY

# usage errors of the new options, each naming its flag
for bad in "--top-k -1" "--min-p 1.5" "--repeat-penalty 0" "--repeat-last-n -2" "--temp -1" \
           "--presence-penalty inf" "--frequency-penalty nan"; do
    "$cli" generate "$model" --prompt x -n 4 $bad >/dev/null 2>"$tmp/err"
    [ $? -eq 2 ] || fail "$bad: expected exit 2"
    grep -q -- "${bad%% *}" "$tmp/err" || fail "$bad: the flag not named: $(cat "$tmp/err")"
done
"$cli" generate "$model" --prompt x -n 4 --greedy --top-k 5 >/dev/null 2>&1
[ $? -eq 2 ] || fail "--greedy with --top-k: expected exit 2"
"$cli" generate "$model" --prompt x -n 4 --greedy --repeat-penalty 1.3 >/dev/null 2>&1 ||
    fail "--greedy with --repeat-penalty (penalties apply to greedy) exited $?"
for flag in --top-k --min-p --repeat-penalty --repeat-last-n --presence-penalty --frequency-penalty \
            --stop --prompt-file --json; do
    "$cli" generate --help | grep -q -- "$flag" || fail "--help does not list $flag"
done

# --device cuda: on a GPU (a CUDA build) the greedy text is the CPU's; elsewhere exit 1 naming the
# device before any text. The device flags' usage errors exit 2, naming the flag.
out=$("$cli" generate "$model" --prompt "The history of the" -n 32 --greedy --device cuda 2>"$tmp/err")
rc=$?
if [ $rc -eq 0 ]; then
    [ "$out" = "$expected" ] || fail "--device cuda: greedy output differs from the CPU's: got [$out]"
    grep -q "^device: cuda:0 " "$tmp/err" || fail "--device cuda: the device not named on stderr: $(cat "$tmp/err")"
    out=$("$cli" generate "$model" --prompt "The history of the" -n 8 --device cuda --gpu-precision bf16 2>"$tmp/err") ||
        fail "--device cuda --gpu-precision bf16 exited $?: $(cat "$tmp/err")"
else
    [ $rc -eq 1 ] || fail "--device cuda without a GPU: expected exit 1, got $rc"
    grep -q "cuda:0" "$tmp/err" || fail "--device cuda without a GPU: the device not named: $(cat "$tmp/err")"
    [ -z "$out" ] || fail "--device cuda without a GPU printed text: [$out]"
fi
for bad in "--device gpu" "--gpu-precision fp16" "--gpu-precision bf16" "--max-gpu-memory 2GB" \
           "--device cuda --max-gpu-memory lots"; do
    "$cli" generate "$model" --prompt x -n 4 $bad >/dev/null 2>"$tmp/err"
    [ $? -eq 2 ] || fail "$bad: expected exit 2"
    grep -q -- "--" "$tmp/err" || fail "$bad: no flag named: $(cat "$tmp/err")"
done
for flag in --device --gpu-precision --max-gpu-memory; do
    "$cli" generate --help | grep -q -- "$flag" || fail "--help does not list $flag"
done

# a missing model directory: exit 1, the path named
"$cli" generate "$tmp/no-such-model" --prompt x -n 4 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "missing model dir: expected exit 1"
grep -q "$tmp/no-such-model" "$tmp/err" || fail "missing model dir not named: $(cat "$tmp/err")"

[ $fails -eq 0 ] || exit 1
echo "test_generate: all checks passed"
