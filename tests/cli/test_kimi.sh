#!/usr/bin/env bash
# Kimi K2 from the command line: tests/data/deepseekv3-tiny's weights as model_type kimi_k2 with the
# tiktoken tokenizer of tests/data/kimi-tiny-tokenizer (tiktoken.model, tokenizer_config.json whose
# auto_map names tokenization_kimi, whose ids test_tiktoken checks against tiktoken itself):
# tokenize, GPTQ calibrated from text (the output carries tiktoken.model and the Python code the
# checkpoint's auto_map needs), eval, and GGUF with the tokenizer as llama.cpp's converter writes
# it (pre-tokenizer "kimi-k2", merges recovered from the ranks) whose rebuilt tokenizer gives the
# same ids as the tiktoken.model on the demo texts.
. "$(dirname "$0")/common.sh"
src=$tmp/kimi
mkdir -p "$src"
cp "$repo"/tests/data/deepseekv3-tiny/* "$repo"/tests/data/kimi-tiny-tokenizer/{tiktoken.model,tokenizer_config.json} "$src"/
sed -i 's/"model_type": "deepseek_v3"/"model_type": "kimi_k2"/' "$src/config.json"
grep -q '"model_type": "kimi_k2"' "$src/config.json" || fail "config.json: model_type not rewritten"
echo '# stands in for the tokenizer code Kimi K2 ships' > "$src/tokenization_kimi.py"

# tokenize: the tiktoken.model is found in the directory; a reserved special written in the text
ids=$("$cli" tokenize "$src" --json --text "[BOS]Hello World<|reserved_token_1000|>") || fail "tokenize exited $?"
[ "$ids" = "[956,26,498,136,397,281,316,1000]" ] || fail "tokenize: $ids"

# GPTQ from calibration text, every format's side files
"$cli" quantize "$src" --out "$tmp/q" --scheme nvfp4 --calib "$repo/data/demo-calib.txt" --nsamples 4 \
    --seqlen 64 --quiet 2>"$tmp/q.log" || fail "quantize (GPTQ from text) exited $?: $(tail -3 "$tmp/q.log")"
for f in tiktoken.model tokenizer_config.json tokenization_kimi.py; do
    cmp -s "$src/$f" "$tmp/q/$f" || fail "quantize: $f not carried to the checkpoint"
done
"$cli" eval "$tmp/q" --task text --data "$repo/data/demo-eval.txt" --json >"$tmp/e.json" 2>/dev/null ||
    fail "eval of the Kimi checkpoint exited $?"
tokens=$(json_get "$tmp/e.json" tokens)
[ -n "$tokens" ] && [ "$tokens" -gt 1000 ] || fail "eval: tokens '$tokens'"

# GGUF: the tokenizer as llama.cpp's converter writes a tiktoken one
"$cli" quantize "$src" --out "$tmp/k.gguf" --scheme int4 --group-size 32 --method rtn --format gguf \
    --ignore 'model\.layers\.0\.mlp\.down_proj' --quiet 2>"$tmp/g.log" || fail "quantize --format gguf exited $?: $(tail -3 "$tmp/g.log")"
out=$("$cli" inspect "$tmp/k.gguf") || fail "inspect exited $?"
for want in '^  tokenizer.ggml.model  *STRING  *"gpt2"$' '^  tokenizer.ggml.pre  *STRING  *"kimi-k2"$' \
    '^  tokenizer.ggml.bos_token_id  *UINT32  *956$' '^  tokenizer.ggml.eos_token_id  *UINT32  *957$' \
    '^  tokenizer.ggml.merges  *ARRAY  *\[STRING x 700\]' '^  tokenizer.ggml.tokens  *ARRAY  *\[STRING x 4096\]'; do
    printf '%s\n' "$out" | grep -q "$want" || fail "inspect lacks $want"
done
for text in demo-eval.txt demo-calib.txt; do
    a=$("$cli" tokenize "$src" --json --file "$repo/data/$text") || fail "tokenize $text exited $?"
    b=$("$cli" tokenize "$tmp/k.gguf" --json --file "$repo/data/$text" 2>/dev/null) || fail "tokenize k.gguf exited $?"
    [ -n "$a" ] && [ "$a" = "$b" ] || fail "$text: the GGUF's rebuilt tokenizer gives other ids than tiktoken.model"
done
# a tiktoken tokenizer whose split pattern moeq does not know is refused by name
sed -i 's/tokenization_kimi/tokenization_other/' "$src/tokenizer_config.json"
msg=$("$cli" tokenize "$src" --text hi 2>&1) && fail "an unknown tiktoken tokenizer was accepted"
grep -q "tokenization_other.TikTokenTokenizer" <<< "$msg" || fail "unknown tokenizer message: $msg"
[ $fails = 0 ] && echo ok
exit $((fails > 0))
