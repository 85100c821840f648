#!/usr/bin/env bash
# moeq tokenize: --json ids equal HF tokenizers' ids (taken from the shared tokenizer_golden.json
# when it was made), --file, readable output, and the exit codes of bad usage and missing files.
. "$(dirname "$0")/common.sh"

# expect_json TEXT IDS: stdout must be exactly the JSON array (whitespace ignored).
expect_json() {
    local out
    out=$("$cli" tokenize "$model" --text "$1" --json) || { fail "exit $? for '$1'"; return; }
    [ "$(printf '%s' "$out" | tr -d ' \n')" = "$2" ] || fail "'$1': expected $2, got $out"
    [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] || fail "'$1': --json printed more than one line"
}
# HF tokenizers ids (tokenizer_golden.json).
expect_json "Hello world" "[513,289,80,853]"
expect_json "it's don't I'll we've they're" "[275,504,2071,594,326,2144,357,3294,461,3005]"
expect_json "<|endoftext|> special in text" "[0,2285,290,3915]"
expect_json "" "[]"

printf 'tabs\tand\r\ncrlf' > "$tmp/in.txt"
out=$("$cli" tokenize "$model" --file "$tmp/in.txt" --json) || fail "--file exited $?"
[ "$out" = "[85,583,84,199,434,203,200,68,83,470]" ] || fail "--file: got $out"

out=$("$cli" tokenize "$model" --text "Hello world" 2>/dev/null) || fail "readable mode exited $?"
printf '%s\n' "$out" | grep -q '853 .*"Ġworld" .*" world"' || fail "readable output lacks token 853: $out"

"$cli" tokenize "$model" --text x --bogus >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] || fail "bad flag: expected exit 2"
grep -q -- "--bogus" "$tmp/err" || fail "bad flag: message does not name it"
"$cli" tokenize "$model" >/dev/null 2>&1
[ $? -eq 2 ] || fail "no --text/--file: expected exit 2"
"$cli" tokenize "$model" --text a --file "$tmp/in.txt" >/dev/null 2>&1
[ $? -eq 2 ] || fail "--text with --file: expected exit 2"
"$cli" tokenize --help >/dev/null || fail "--help: expected exit 0"

"$cli" tokenize "$tmp/no-model" --text x >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "missing model directory: expected exit 1"
grep -q "$tmp/no-model" "$tmp/err" || fail "missing model directory: path not named"
mkdir -p "$tmp/empty-model"
"$cli" tokenize "$tmp/empty-model" --text x >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "no tokenizer file: expected exit 1"
grep -q "$tmp/empty-model: no tokenizer.json or tiktoken.model" "$tmp/err" || fail "no tokenizer file: $(cat "$tmp/err")"
printf 'ab\377c' > "$tmp/bad.txt"
"$cli" tokenize "$model" --file "$tmp/bad.txt" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "invalid UTF-8: expected exit 1"
grep -q "byte offset 2" "$tmp/err" || fail "invalid UTF-8: offset not named: $(cat "$tmp/err")"

[ $fails -eq 0 ] || exit 1
echo "test_tokenize: all checks passed"
