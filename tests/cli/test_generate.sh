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
"$cli" generate "$model" -n 4 >/dev/null 2>&1
[ $? -eq 2 ] || fail "missing --prompt: expected exit 2"
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

# a missing model directory: exit 1, the path named
"$cli" generate "$tmp/no-such-model" --prompt x -n 4 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "missing model dir: expected exit 1"
grep -q "$tmp/no-such-model" "$tmp/err" || fail "missing model dir not named: $(cat "$tmp/err")"

[ $fails -eq 0 ] || exit 1
echo "test_generate: all checks passed"
