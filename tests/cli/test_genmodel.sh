#!/usr/bin/env bash
# moeq bench gen-model: the full-size plans match the published parameter counts (worked out by
# hand below from the hub configs); small variants of every family, cut into several shards, load
# with `inspect` with the parameter and tensor counts computed here from the shapes; every shard is
# a well-formed safetensors file and the index maps exactly the tensors the shards hold; the same
# seed gives the same bytes whatever the thread count, another seed other bytes; norms are 1.0;
# with python3, the bytes of one tensor are recomputed from the documented generator; a variant
# quantizes; bad usage and an existing --out are refused and leave nothing behind.
. "$(dirname "$0")/common.sh"
gen() { "$cli" bench gen-model "$@"; }

# ---- full-size plans (--dry-run writes nothing) ----------------------------------------------
# total and active parameters, from the hub configs:
#   OLMoE-1B-7B   2*50304*2048 + 2048 + 16*(4*2048^2 + 4*2048 + 64*2048 + {64|8}*3*2048*1024)
#   Qwen3-30B-A3B 2*151936*2048 + 2048 + 48*(2*4096*2048 + 2*512*2048 + 2*2048 + 2*128
#                 + 128*2048 + {128|8}*3*2048*768)
#   Mixtral-8x7B  2*32000*4096 + 4096 + 32*(2*4096^2 + 2*1024*4096 + 2*4096 + 8*4096
#                 + {8|2}*3*4096*14336)
#   Qwen1.5-MoE   2*151936*2048 + 2048 + 24*(4*2048^2 + 3*2048 + 2*2048 + 60*2048
#                 + {60|4}*3*2048*1408 + 3*2048*5632 + 2048)
#   Llama-3.2-1B  128256*2048 (tied) + 2048 + 16*(2*2048^2 + 2*512*2048 + 2*2048 + 3*2048*8192)
# = 6.92B / 1.28B, 30.5B / 3.3B, 46.7B / 12.9B, 14.3B / 2.7B, 1.24B: the model cards' figures.
dry() { # dry NAME TOTAL ACTIVE TENSORS SHARDS
    local out
    out=$(gen --like "$1" --dry-run) || { fail "$1 --dry-run exited $?"; return; }
    printf '%s\n' "$out" | grep -q "^gen-model $1: $2 parameters ($3 active), $4 tensors, .* in $5 shards\? " ||
        fail "$1: plan is not $2 ($3 active), $4 tensors, $5 shards: $(printf '%s\n' "$out" | tail -1)"
    printf '%s\n' "$out" | sed '$d' > "$tmp/dry-$1.json"
}
dry olmoe-1b-7b 6919161856 1282017280 3219 3
dry qwen3-30b-a3b 30532122624 3353032704 18867 13
dry mixtral-8x7b 46702792704 12879925248 995 19
dry qwen2-moe-a2.7b 14315784192 2689173504 4659 6
dry llama-3.2-1b 1235814400 1235814400 146 1
# DeepSeek-V3: 2*129280*7168 + 7168 + 61*(7168*1536 + 1536 + 1536*128*192 + 7168*576 + 512
#   + 512*128*256 + 128*128*7168 + 2*7168) + 3*3*7168*18432 + 58*(256*7168 + 256
#   + {256|8}*3*7168*2048 + 3*7168*2048) = 671.0B / 37.6B (its card: 671B, 37B activated)
dry deepseek-v3 671026419200 37552297472 45395 270
# a few config values the parser does not cover by counting
cfg_has() { grep -q "^  \"$2\": $3,\{0,1\}$" "$tmp/dry-$1.json" || fail "$1: config lacks \"$2\": $3"; }
cfg_has olmoe-1b-7b eos_token_id 50279
cfg_has olmoe-1b-7b bos_token_id null
cfg_has olmoe-1b-7b pad_token_id 1
cfg_has olmoe-1b-7b clip_qkv null
cfg_has olmoe-1b-7b rms_norm_eps 1e-05
cfg_has qwen3-30b-a3b norm_topk_prob true
cfg_has qwen3-30b-a3b max_position_embeddings 40960
cfg_has qwen3-30b-a3b rope_theta 1000000.0
cfg_has qwen3-30b-a3b eos_token_id 151645
cfg_has mixtral-8x7b num_local_experts 8
cfg_has mixtral-8x7b sliding_window null
cfg_has qwen2-moe-a2.7b shared_expert_intermediate_size 5632
cfg_has qwen2-moe-a2.7b norm_topk_prob false
cfg_has llama-3.2-1b tie_word_embeddings true
cfg_has llama-3.2-1b rope_theta 500000.0
cfg_has llama-3.2-1b architectures '\["LlamaForCausalLM"\]'
cfg_has llama-3.2-1b torch_dtype '"bfloat16"'
grep -q rope_scaling "$tmp/dry-llama-3.2-1b.json" && fail "llama: rope_scaling must be left out"
cfg_has deepseek-v3 q_lora_rank 1536
cfg_has deepseek-v3 n_group 8
cfg_has deepseek-v3 topk_group 4
cfg_has deepseek-v3 first_k_dense_replace 3
cfg_has deepseek-v3 topk_method '"noaux_tc"'

# ---- small variants of each family -----------------------------------------------------------
L=2 E=4 D=64 F=32 V=4096
# params FAMILY HEADS KV_HEADS HEAD_DIM SHARED TIED: total parameters of the variant's shapes
params() {
    local fam=$1 h=$2 kv=$3 hd=$4 s=$5 tied=$6
    local q=$((h * hd)) k=$((kv * hd))
    local layer=$((D * q + 2 * D * k + q * D + 2 * D))
    case $fam in
    olmoe) layer=$((layer + q + k + E * D + E * 3 * D * F)) ;;
    qwen3) layer=$((layer + 2 * hd + E * D + E * 3 * D * F)) ;;
    mixtral) layer=$((layer + E * D + E * 3 * D * F)) ;;
    qwen2) layer=$((layer + q + 2 * k + E * D + E * 3 * D * F + 3 * D * s + D)) ;;
    llama) layer=$((layer + 3 * D * F)) ;;
    esac
    echo $(((tied ? 1 : 2) * V * D + D + L * layer))
}
# tensors FAMILY TIED: tensor count (embed, norm, [lm_head] + per layer)
tensors() {
    local per
    case $1 in
    olmoe | qwen3) per=$((9 + 3 * E)) ;;
    mixtral) per=$((7 + 3 * E)) ;;
    qwen2) per=$((14 + 3 * E)) ;;
    llama) per=9 ;;
    esac
    echo $((3 - $2 + L * per))
}
# header_len FILE: the u64 little-endian at the start
header_len() { od -An -t u8 -N 8 "$1" | tr -d ' '; }
header() { local n; n=$(header_len "$1"); head -c $((8 + n)) "$1" | tail -c "$n"; }
# check_files DIR: each shard is laid out as the spec says and the index maps exactly its tensors
check_files() {
    local d=$1 f n end size
    : > "$tmp/held"
    for f in "$d"/model-*-of-*.safetensors; do
        n=$(header_len "$f")
        [ $((n % 8)) -eq 0 ] || fail "$f: header length $n is not a multiple of 8"
        header "$f" | grep -q '^{"__metadata__":{"format":"pt"}' || fail "$f: no __metadata__ first"
        # offsets contiguous from 0 in header order, and the file ends at the last one
        end=$(header "$f" | grep -o '"data_offsets":\[[0-9]*,[0-9]*\]' | tr -c '0-9\n' ' ' |
            awk 'BEGIN { e = 0 } { if ($1 != e) { print "hole"; exit } e = $2 } END { print e }')
        size=$(stat -c %s "$f")
        [ "$end" != hole ] && [ $((8 + n + end)) -eq "$size" ] ||
            fail "$f: data ends at $end, file is $size bytes (header $n)"
        header "$f" | grep -o '"[^"]*":{"dtype":"BF16"' | sed 's/":{.*//; s/^"//' |
            sed "s|\$| ${f##*/}|" >> "$tmp/held"
    done
    sort "$tmp/held" > "$tmp/held.s"
    sed -n 's/^    "\([^"]*\)": "\([^"]*\)",\{0,1\}$/\1 \2/p' "$d/model.safetensors.index.json" |
        sort > "$tmp/mapped.s"
    cmp -s "$tmp/held.s" "$tmp/mapped.s" || fail "$d: the index does not map exactly the shards' tensors"
    local total sum
    total=$(sed -n 's/^ *"total_size": \([0-9]*\)$/\1/p' "$d/model.safetensors.index.json")
    sum=0
    for f in "$d"/model-*-of-*.safetensors; do
        sum=$((sum + $(stat -c %s "$f") - 8 - $(header_len "$f")))
    done
    [ "$total" = "$sum" ] || fail "$d: total_size $total, shards hold $sum bytes of data"
    wc -l < "$tmp/mapped.s" | tr -d ' '
}

variant() { # variant NAME FAMILY HEADS KV HEAD_DIM SHARED TIED [extra flags]
    local name=$1 fam=$2 h=$3 kv=$4 hd=$5 s=$6 tied=$7
    shift 7
    local d=$tmp/$name
    gen --like "$name" --out "$d" --layers $L --hidden $D --ffn $F --vocab $V \
        --max-shard-size 20KB --quiet "$@" > "$tmp/$name.out" 2> "$tmp/$name.err" ||
        { fail "$name: gen-model exited $?: $(cat "$tmp/$name.err")"; return; }
    [ -s "$tmp/$name.err" ] && fail "$name: --quiet printed: $(cat "$tmp/$name.err")"
    local want nt out shards
    want=$(params "$fam" "$h" "$kv" "$hd" "$s" "$tied")
    nt=$(tensors "$fam" "$tied")
    grep -q "^gen-model $name: $want parameters" "$tmp/$name.out" ||
        fail "$name: summary does not say $want parameters: $(cat "$tmp/$name.out")"
    out=$("$cli" inspect "$d") || { fail "$name: inspect exited $?"; return; }
    printf '%s\n' "$out" | grep -q "parameters .*total ($want)" ||
        fail "$name: inspect does not report $want parameters: $(printf '%s\n' "$out" | grep parameters)"
    printf '%s\n' "$out" | grep -q "^tensors *$nt, " || fail "$name: inspect does not report $nt tensors"
    printf '%s\n' "$out" | grep -q "BF16 *$want values" || fail "$name: not $want BF16 values"
    shards=$(ls "$d"/model-*-of-*.safetensors 2>/dev/null | wc -l)
    [ "$shards" -ge 3 ] || fail "$name: expected several shards at 20KB, got $shards"
    ls "$d"/model-00001-of-$(printf %05d "$shards").safetensors >/dev/null 2>&1 || fail "$name: shard names"
    [ "$(check_files "$d")" = "$nt" ] || fail "$name: the index does not list $nt tensors"
    for f in config.json generation_config.json tokenizer.json tokenizer_config.json; do
        [ -s "$d/$f" ] || fail "$name: no $f"
    done
}
# --hidden 64 keeps the heads: head_dim 64/16, 64/32 (qwen3's head_dim 128 is not derived)
variant olmoe-1b-7b olmoe 16 16 4 0 0 --experts $E
variant qwen3-30b-a3b qwen3 32 4 128 0 0 --experts $E
variant mixtral-8x7b mixtral 32 8 2 0 0 --experts $E
variant qwen2-moe-a2.7b qwen2 16 16 4 $((4 * F)) 0 --experts $E
variant llama-3.2-1b llama 32 8 2 0 1
grep -q '"model.layers.1.block_sparse_moe.experts.3.w2.weight"' \
    "$tmp/mixtral-8x7b/model.safetensors.index.json" || fail "mixtral: no expert w2 in the index"
grep -q '"model.layers.1.mlp.shared_expert_gate.weight"' "$tmp/qwen2-moe-a2.7b/model.safetensors.index.json" ||
    fail "qwen2: no shared_expert_gate"
grep -q '"model.layers.0.self_attn.k_proj.bias"' "$tmp/qwen2-moe-a2.7b/model.safetensors.index.json" ||
    fail "qwen2: no k_proj bias"
grep -q '"lm_head.weight"' "$tmp/llama-3.2-1b/model.safetensors.index.json" && fail "llama: tied, yet lm_head written"
"$cli" inspect "$tmp/qwen3-30b-a3b" --tensors | grep -q "model.layers.1.self_attn.k_norm.weight *BF16 *\[128\] " ||
    fail "qwen3: k_norm is not per head [128]"
"$cli" inspect "$tmp/olmoe-1b-7b" --tensors | grep -q "model.layers.0.mlp.gate.weight *BF16 *\[4, 64\] " ||
    fail "olmoe: router is not [4, 64]"
grep -q '"num_experts_per_tok": 4,' "$tmp/olmoe-1b-7b/config.json" || fail "olmoe: top-k not capped at --experts 4"
grep -q '"bos_token_id": 0,' "$tmp/qwen3-30b-a3b/config.json" ||
    fail "qwen3: bos 151643 is outside --vocab 4096 and must become the bundled tokenizer's 0"

# norms are exactly 1.0 (bf16 0x3F80): the final norm is the last tensor but lm_head of its shard
f=$(sed -n 's/^    "model.norm.weight": "\(.*\)",\{0,1\}$/\1/p' "$tmp/mixtral-8x7b/model.safetensors.index.json")
off=$(header "$tmp/mixtral-8x7b/$f" | grep -o '"model.norm.weight":{[^}]*}' | sed 's/.*"data_offsets":\[\([0-9]*\),.*/\1/')
n=$(header_len "$tmp/mixtral-8x7b/$f")
vals=$(tail -c +$((9 + n + off)) "$tmp/mixtral-8x7b/$f" | head -c $((2 * D)) | od -An -t x2 -v | tr -s ' ' '\n' | sort -u | tr -d '\n')
[ "$vals" = "3f80" ] || fail "mixtral: model.norm.weight is not all 1.0 (got $vals)"

# ---- determinism ----------------------------------------------------------------------------------
base=(--like qwen2-moe-a2.7b --layers 2 --experts 4 --hidden 64 --ffn 32 --vocab 4096 --max-shard-size 300KB --quiet)
gen "${base[@]}" --out "$tmp/s1" --seed 7 --threads 1 >/dev/null || fail "seed 7 / 1 thread exited $?"
gen "${base[@]}" --out "$tmp/s2" --seed 7 --threads 2 >/dev/null || fail "seed 7 / 2 threads exited $?"
gen "${base[@]}" --out "$tmp/s3" --seed 8 >/dev/null || fail "seed 8 exited $?"
for f in "$tmp"/s1/*; do
    cmp -s "$f" "$tmp/s2/${f##*/}" || fail "seed 7: ${f##*/} differs between 1 and 2 threads"
done
for f in "$tmp"/s1/model-*.safetensors; do
    cmp -s "$f" "$tmp/s3/${f##*/}" && fail "seeds 7 and 8 give the same ${f##*/}"
done
[ "$(ls "$tmp/s1" | wc -l)" -eq "$(ls "$tmp/s3" | wc -l)" ] || fail "seeds 7 and 8 give other files"

# The generator as documented in bench_genmodel.c, in Python: key = mix(mix(seed + G) ^ fnv1a(name)),
# u = 16-bit part i % 4 of mix(key + (i / 4 + 1) G), value i = bf16_rne(f32(0.02 * PHI^-1((u + 0.5)
# / 65536))) with CPython's own inverse normal CDF (statistics.NormalDist, AS241 in C).
# The second tensor, an embedding of 4097 x 66 values (not a multiple of 4), ends in a partial
# group of four.
gen --like qwen3-30b-a3b --out "$tmp/odd" --layers 1 --experts 2 --hidden 66 --ffn 16 --vocab 4097 \
    --seed 3 --quiet >/dev/null || fail "qwen3 --hidden 66 exited $?"
if command -v python3 >/dev/null; then
    python3 - "$tmp/s1" "$tmp/odd" <<'EOF' || fail "python: the bytes are not the documented generator's"
import json, os, struct, sys
from statistics import NormalDist
d = sys.argv[1]
M = (1 << 64) - 1
G = 0x9E3779B97F4A7C15
def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)
def f32(x): return struct.unpack('<f', struct.pack('<f', x))[0]
def bf16(x):
    u = struct.unpack('<I', struct.pack('<f', x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
nd = NormalDist()
def tensor(path, name):
    raw = open(path, 'rb').read()
    n = struct.unpack('<Q', raw[:8])[0]
    meta = json.loads(raw[8:8 + n])[name]
    a, b = meta['data_offsets']
    return meta, struct.unpack('<%dH' % ((b - a) // 2), raw[8 + n + a:8 + n + b])
def check(path, name, seed, shape, which):
    meta, got = tensor(path, name)
    assert meta['dtype'] == 'BF16' and meta['shape'] == shape, meta
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & M
    key = mix(mix((seed + G) & M) ^ h)
    for i in which(len(got)):
        u = (mix((key + (i // 4 + 1) * G) & M) >> (16 * (i % 4))) & 0xFFFF
        want = bf16(f32(0.02 * nd.inv_cdf((u + 0.5) / 65536.0)))
        assert got[i] == want, '%s[%d]: %04x, want %04x' % (name, i, got[i], want)
    return got
idx = json.load(open(os.path.join(d, 'model.safetensors.index.json')))['weight_map']
name = 'model.layers.1.mlp.experts.2.down_proj.weight'
got = check(os.path.join(d, idx[name]), name, 7, [64, 32], range)
vals = [struct.unpack('<f', struct.pack('<I', x << 16))[0] for x in got]
mean = sum(vals) / len(vals)
std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
assert abs(mean) < 0.002 and 0.018 < std < 0.022, (mean, std)
check(os.path.join(sys.argv[2], 'model.safetensors'), 'model.embed_tokens.weight', 3, [4097, 66],
      lambda n: list(range(1000)) + list(range(n - 1001, n)))
EOF
else
    echo "test_genmodel: python3 not found, the byte-level reference check is skipped"
fi

# ---- quantize a variant (RTN INT4 groups of 128 need in-features of 128) ------------------------
gen --like olmoe-1b-7b --out "$tmp/q" --layers 2 --experts 4 --hidden 128 --ffn 128 --vocab 4096 \
    --quiet >/dev/null || fail "olmoe 128 exited $?"
[ -f "$tmp/q/model.safetensors" ] && [ ! -e "$tmp/q/model.safetensors.index.json" ] ||
    fail "one shard: expected model.safetensors and no index"
"$cli" quantize "$tmp/q" --out "$tmp/q-int4" --scheme int4 --method rtn --quiet >/dev/null 2>"$tmp/qerr" ||
    fail "quantize int4 rtn of a generated model exited $?: $(cat "$tmp/qerr")"
"$cli" inspect "$tmp/q-int4" 2>/dev/null | grep -q "int4 (compressed-tensors)" || fail "quantized variant: no int4 weights"

# ---- errors ---------------------------------------------------------------------------------------
gen --like gpt-17 --out "$tmp/x" >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] || fail "unknown --like: expected exit 2"
grep -q "gpt-17" "$tmp/err" && grep -q "olmoe-1b-7b" "$tmp/err" && grep -q "llama-3.2-1b" "$tmp/err" ||
    fail "unknown --like: the name and the known names are not listed: $(cat "$tmp/err")"
[ ! -e "$tmp/x" ] || fail "unknown --like left $tmp/x"
gen --like llama-3.2-1b --out "$tmp/x" --experts 4 >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "--experts" "$tmp/err" || fail "--experts on a dense model: expected exit 2 naming the flag"
gen --like olmoe-1b-7b --out "$tmp/x" --max-shard-size 5XB >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "--max-shard-size" "$tmp/err" || fail "bad --max-shard-size: expected exit 2 naming the flag"
gen --like olmoe-1b-7b --out "$tmp/x" --hidden 70 >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "--hidden" "$tmp/err" || fail "--hidden not a multiple of 2 * heads: expected exit 2"
gen --like olmoe-1b-7b --out "$tmp/x" --bogus >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "--bogus" "$tmp/err" || fail "bad flag: expected exit 2 naming it"
gen --like olmoe-1b-7b >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "--out" "$tmp/err" || fail "no --out: expected exit 2 naming it"
[ ! -e "$tmp/x" ] || fail "a usage error left $tmp/x"

small=(--like llama-3.2-1b --layers 1 --hidden 64 --ffn 32 --vocab 4096 --quiet)
mkdir "$tmp/exists" && echo keep > "$tmp/exists/marker"
gen "${small[@]}" --out "$tmp/exists" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] || fail "existing --out without --force: expected exit 1"
grep -q "$tmp/exists" "$tmp/err" && grep -q -- "--force" "$tmp/err" ||
    fail "existing --out: message does not name the directory and --force: $(cat "$tmp/err")"
[ -f "$tmp/exists/marker" ] || fail "existing --out was touched without --force"
gen "${small[@]}" --out "$tmp/exists/" --force >/dev/null || fail "--force exited $?"
[ ! -e "$tmp/exists/marker" ] && [ -f "$tmp/exists/model.safetensors" ] || fail "--force did not replace the directory"
ls -d "$tmp"/*.tmp-* "$tmp"/*.old-* >/dev/null 2>&1 && fail "temporary directories left: $(ls -d "$tmp"/*.tmp-* "$tmp"/*.old-*)"
# a write that fails part way (a file size limit standing in for a full disk): exit 1 naming the
# shard, nothing left
(trap '' XFSZ; ulimit -f 1000; gen --like qwen3-30b-a3b --out "$tmp/full" --layers 2 --experts 4 \
    --hidden 64 --ffn 32 --vocab 4096 --quiet) >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "full.tmp-[0-9]*/model.safetensors: write failed" "$tmp/err" ||
    fail "failed write: expected exit 1 naming the shard: $(cat "$tmp/err")"
ls -d "$tmp"/full* >/dev/null 2>&1 && fail "the failed write left $(ls -d "$tmp"/full*)"
# a file system without room for Mixtral's 93.4 GB (only tried where df says so): the message
# names the directory and nothing is left
free_kb=$(df -Pk "$tmp" | awk 'NR == 2 { print $4 }')
if [ -n "$free_kb" ] && [ "$free_kb" -lt 90000000 ]; then
    gen --like mixtral-8x7b --out "$tmp/big" --quiet >/dev/null 2>"$tmp/err"
    [ $? -eq 1 ] && grep -q "$tmp/big: needs 93.41 GB" "$tmp/err" ||
        fail "too little space: expected exit 1 naming the directory: $(cat "$tmp/err")"
    ls -d "$tmp"/big* >/dev/null 2>&1 && fail "the no-space run left $(ls -d "$tmp"/big*)"
fi

# the tokenizer: --tokenizer DIR's copied byte for byte; one missing or with more ids than
# --vocab refused naming the flag, nothing left; without the flag, the bundled one found beside
# the executable (a copy of the binary in a tree of its own with a marked tokenizer)
bundled=$(dirname "$0")/../../models/olmoe-tiny
mkdir -p "$tmp/tok" "$tmp/notok" "$tmp/tree/bin" "$tmp/tree/models/olmoe-tiny"
{ cat "$bundled/tokenizer.json"; echo; } > "$tmp/tok/tokenizer.json"   # differs by a newline
gen "${small[@]}" --out "$tmp/given" --tokenizer "$tmp/tok" >/dev/null 2>"$tmp/err" ||
    fail "--tokenizer exited $?: $(cat "$tmp/err")"
cmp -s "$tmp/tok/tokenizer.json" "$tmp/given/tokenizer.json" || fail "--tokenizer: not the given tokenizer.json"
[ -e "$tmp/given/tokenizer_config.json" ] && fail "--tokenizer: a tokenizer_config.json the directory lacks"
gen "${small[@]}" --out "$tmp/none" --tokenizer "$tmp/notok" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q -- "--tokenizer $tmp/notok" "$tmp/err" ||
    fail "--tokenizer without tokenizer.json: expected exit 1 naming the flag: $(cat "$tmp/err")"
gen --like llama-3.2-1b --layers 1 --hidden 64 --ffn 32 --vocab 100 --quiet --out "$tmp/small-vocab" \
    --tokenizer "$tmp/tok" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "do not fit vocab_size 100" "$tmp/err" ||
    fail "--tokenizer beyond --vocab: expected exit 1: $(cat "$tmp/err")"
ls -d "$tmp"/none* "$tmp"/small-vocab* >/dev/null 2>&1 && fail "a refused tokenizer left $(ls -d "$tmp"/none* "$tmp"/small-vocab*)"
cp "$cli" "$tmp/tree/bin/moeq"
cp "$tmp/tok/tokenizer.json" "$tmp/tree/models/olmoe-tiny/"
"$tmp/tree/bin/moeq" bench gen-model "${small[@]}" --out "$tmp/beside" >/dev/null 2>"$tmp/err" ||
    fail "gen-model from a copied binary exited $?: $(cat "$tmp/err")"
cmp -s "$tmp/tok/tokenizer.json" "$tmp/beside/tokenizer.json" ||
    fail "the tokenizer beside the executable (../models/olmoe-tiny) was not the one copied"

[ $fails -eq 0 ] || exit 1
echo "test_genmodel: all checks passed"
