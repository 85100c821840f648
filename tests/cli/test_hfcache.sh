#!/usr/bin/env bash
# Model names as users type them: hub ids resolved in a local Hugging Face cache laid out as
# huggingface_hub writes it (refs/<branch> holding a commit hash, snapshots/<hash>/ of links into
# blobs/), through HF_HUB_CACHE, HF_HOME and --revision; a missing model says where it looked.
. "$(dirname "$0")/common.sh"

# a cache with two revisions of the bundled model: main and a tag v1
hub=$tmp/hub
repo=$hub/models--acme--olmoe-tiny
h1=1111111111111111111111111111111111111111
h2=2222222222222222222222222222222222222222
mkdir -p "$repo/blobs" "$repo/refs" "$repo/snapshots/$h1" "$repo/snapshots/$h2"
for f in "$model"/*; do
    b=$(basename "$f")
    cp "$f" "$repo/blobs/$b.blob"
    ln -s "../../blobs/$b.blob" "$repo/snapshots/$h1/$b"
    ln -s "../../blobs/$b.blob" "$repo/snapshots/$h2/$b"
done
printf '%s' "$h1" > "$repo/refs/main"
printf '%s\n' "$h2" > "$repo/refs/v1"
rm "$repo/snapshots/$h2/tokenizer.json"   # v1 differs: no tokenizer

HF_HUB_CACHE=$hub "$cli" inspect acme/olmoe-tiny > "$tmp/i.txt" 2>&1 || fail "inspect via HF_HUB_CACHE exited $?: $(cat "$tmp/i.txt")"
grep -q olmoe "$tmp/i.txt" || fail "inspect of the hub id: $(head -3 "$tmp/i.txt")"
mkdir -p "$tmp/home" && ln -s "$hub" "$tmp/home/hub"
HF_HUB_CACHE= HF_HOME=$tmp/home "$cli" tokenize acme/olmoe-tiny --text "hello world" > "$tmp/t1" ||
    fail "tokenize via HF_HOME exited $?"
"$cli" tokenize "$model" --text "hello world" > "$tmp/t2" || fail "tokenize of the directory exited $?"
cmp -s "$tmp/t1" "$tmp/t2" || fail "hub id and directory tokenize differently"
HF_HUB_CACHE= HF_HOME= HOME=$tmp/home2 "$cli" inspect acme/olmoe-tiny 2> "$tmp/e0" && fail "no cache: expected an error"
grep -q "$tmp/home2/.cache/huggingface/hub/models--acme--olmoe-tiny/refs/main" "$tmp/e0" ||
    fail "default cache location not named: $(cat "$tmp/e0")"

# revisions: a tag, a commit, an unknown one
HF_HUB_CACHE=$hub "$cli" tokenize acme/olmoe-tiny --revision v1 --text hi 2> "$tmp/e1" && fail "v1 has no tokenizer: expected an error"
grep -q "snapshots/$h2: no tokenizer.json or tiktoken.model" "$tmp/e1" || fail "--revision v1 did not pick its snapshot: $(cat "$tmp/e1")"
HF_HUB_CACHE=$hub "$cli" tokenize acme/olmoe-tiny --revision "$h1" --text "hello world" > "$tmp/t3" || fail "--revision COMMIT exited $?"
cmp -s "$tmp/t3" "$tmp/t2" || fail "--revision COMMIT: other ids"
HF_HUB_CACHE=$hub "$cli" inspect acme/olmoe-tiny --revision nope 2> "$tmp/e2"
[ $? -eq 1 ] || fail "unknown revision: expected exit 1"
grep -q "refs/nope" "$tmp/e2" && grep -q "never downloads" "$tmp/e2" || fail "unknown revision: message $(cat "$tmp/e2")"
"$cli" inspect "$model" --revision v1 2> "$tmp/e3"
[ $? -eq 1 ] || fail "--revision with a directory: expected exit 1"
grep -q "hub ids" "$tmp/e3" || fail "--revision with a directory: message $(cat "$tmp/e3")"

# a missing model: exit 1, where it looked, nothing written
HF_HUB_CACHE=$hub "$cli" quantize acme/missing --out "$tmp/q0" --scheme int4 2> "$tmp/e4"
[ $? -eq 1 ] || fail "missing model: expected exit 1"
grep -q "$hub/models--acme--missing" "$tmp/e4" || fail "missing model: message $(cat "$tmp/e4")"
[ ! -e "$tmp/q0" ] || fail "missing model: output written"

# quantize and eval take hub ids (eval's --kl-base too): the same as with the directory
HF_HUB_CACHE=$hub "$cli" quantize acme/olmoe-tiny --out "$tmp/q1" --scheme int4 --quiet || fail "quantize of the hub id exited $?"
"$cli" quantize "$model" --out "$tmp/q2" --scheme int4 --quiet || fail "quantize of the directory exited $?"
cmp -s "$tmp/q1/model.safetensors" "$tmp/q2/model.safetensors" || fail "hub id and directory quantize differently"
printf ' = T = \n The cat sat on the mat . \n' > "$tmp/w.txt"
HF_HUB_CACHE=$hub "$cli" eval "$tmp/q1" --data "$tmp/w.txt" --kl-base acme/olmoe-tiny --json > "$tmp/e.json" ||
    fail "eval --kl-base HUB_ID exited $?"
grep -q '"kl_mean"' "$tmp/e.json" || fail "eval --kl-base HUB_ID: no KL"

[ $fails -eq 0 ] && echo "all Hugging Face cache checks passed"
exit $((fails > 0))
