#!/usr/bin/env bash
# quantize --resume on a damaged work directory (issue 58): a GPTQ run killed after its second
# layer, its work directory copied and damaged one way per case. The activation snapshots truncated,
# corrupted, grown by a byte, missing or taken from another run are recomputed, with a warning naming
# the file; a tensor whose CRC in the manifest is changed or malformed, and records past the plan's
# layers, make those layers be redone, the warning naming the manifest; each of these resumes to
# the uninterrupted run's bytes. A manifest that is not JSON, of another version, from another model
# or from other options is refused (exit 1) naming it, and nothing is written. Nothing damaged is
# ever used silently.
. "$(dirname "$0")/common.sh"

calib=$repo/data/demo-calib.txt
args=(--scheme nvfp4a16 --method gptq --calib "$calib" --nsamples 4 --seqlen 32 --quiet)
"$cli" quantize "$model" --out "$tmp/base" "${args[@]}" || fail "the uninterrupted run exited $?"
# killed after layer 1 is recorded; the snapshots written in place (the one the manifest names and
# maybe the next, whose record the kill cut short)
{ MOEQ_FAULT=layer:1 MOEQ_SNAPSHOT_IN_PLACE=1 "$cli" quantize "$model" --out "$tmp/k" "${args[@]}"; } 2>/dev/null
[ -f "$tmp/k.moeq-work/manifest.json" ] || { fail "the killed run left no manifest"; exit 1; }
ls "$tmp/k.moeq-work"/acts-*.bin >/dev/null 2>&1 || fail "the killed run left no activation snapshot"

# damaged NAME: a copy of the killed run's work directory for the case NAME (its OUT_DIR $tmp/NAME)
damaged() {
    rm -rf "$tmp/$1" "$tmp/$1.moeq-work"
    cp -a "$tmp/k.moeq-work" "$tmp/$1.moeq-work"
    w=$tmp/$1.moeq-work
    m=$w/manifest.json
}
# resumes NAME WARNING: --resume succeeds with the uninterrupted run's bytes and says WARNING
resumes() {
    local err
    err=$("$cli" quantize "$model" --out "$tmp/$1" "${args[@]}" --resume 2>&1 >/dev/null) ||
        { fail "$1: --resume exited $?: $err"; return; }
    printf '%s\n' "$err" | grep -qF -- "$2" || fail "$1: no warning '$2': $err"
    same_checkpoint "$tmp/base" "$tmp/$1" "$1"
    [ -e "$tmp/$1.moeq-work" ] && fail "$1: the work directory is left"
    rm -rf "$tmp/$1"
}
# refused NAME MESSAGE: --resume exits 1 saying MESSAGE; no OUT_DIR, the work directory kept
refused() {
    local err rc
    err=$("$cli" quantize "$model" --out "$tmp/$1" "${args[@]}" --resume 2>&1 >/dev/null)
    rc=$?
    [ $rc -eq 1 ] || fail "$1: --resume exited $rc, expected 1 (refused): $err"
    printf '%s\n' "$err" | grep -qF -- "$2" || fail "$1: the refusal does not say '$2': $err"
    [ -e "$tmp/$1" ] && fail "$1: OUT_DIR was written"
    [ -f "$tmp/$1.moeq-work/manifest.json" ] || fail "$1: the work directory went"
    rm -rf "$tmp/$1.moeq-work"
}
# every_acts CMD: runs CMD FILE on each snapshot of $w
every_acts() { local f; for f in "$w"/acts-*.bin; do "$@" "$f"; done; }
flip() { printf '\x5a' | dd of="$1" bs=1 seek=$(($(stat -c %s "$1") / 2)) conv=notrunc status=none; }
grow() { printf '\0' >> "$1"; }
cut_short() { truncate -s $(($(stat -c %s "$1") - 9)) "$1"; }

# ---- activations: recomputed ----------------------------------------------------------------------
damaged truncated; every_acts cut_short
resumes truncated "are missing, corrupt or another run's; they are recomputed"
damaged corrupted; every_acts flip
resumes corrupted "are missing, corrupt or another run's; they are recomputed"
damaged grown; every_acts grow
resumes grown "are missing, corrupt or another run's; they are recomputed"
damaged missing; rm -f "$w"/acts-*.bin
resumes missing "are missing, corrupt or another run's; they are recomputed"
# another run's snapshots (other calibration samples, the same shapes): the manifest's CRC differs
{ MOEQ_FAULT=layer:1 MOEQ_SNAPSHOT_IN_PLACE=1 "$cli" quantize "$model" --out "$tmp/other" "${args[@]}" \
    --calib-sampling random; } 2>/dev/null
damaged foreign
for f in "$tmp/other.moeq-work"/acts-*.bin; do cp "$f" "$w/"; done
resumes foreign "are missing, corrupt or another run's; they are recomputed"
rm -rf "$tmp/other.moeq-work"

# ---- the manifest's records: the layers redone ------------------------------------------------------
# a tensor's CRC changed: that layer and the ones after it are redone
damaged crc
python3 - "$m" <<'PY' || fail "crc: could not edit the manifest"
import json, sys
m = json.load(open(sys.argv[1]))
t = m["layers"][0]["tensors"]
k = sorted(t)[0]
t[k] = (t[k] + 1) % 2**32
json.dump(m, open(sys.argv[1], "w"), indent=1)
PY
resumes crc "the work manifest recorded"
# a CRC that is no CRC (it was cast unchecked); a report without its figures
damaged badcrc
python3 - "$m" <<'PY' || fail "badcrc: could not edit the manifest"
import json, sys
m = json.load(open(sys.argv[1]))
t = m["layers"][0]["tensors"]
t[sorted(t)[0]] = 1e300
m["layers"][0]["report"] = {}
json.dump(m, open(sys.argv[1], "w"), indent=1)
PY
resumes badcrc "manifest.json: bad CRC of tensor"
# records past the plan's four layers in a run killed just before its rename, every layer recorded
# (they were taken, the reports of layers 4.. written past the plan's)
{ MOEQ_FAULT=rename:0 "$cli" quantize "$model" --out "$tmp/extra" "${args[@]}"; } 2>/dev/null
python3 - "$tmp/extra.moeq-work/manifest.json" <<'PY' || fail "extra: could not edit the manifest"
import json, sys
m = json.load(open(sys.argv[1]))
assert len(m["layers"]) == 4, len(m["layers"])
m["layers"] += [{"layer": l, "tensors": {}, "report": {"expert_chunks": 1}} for l in range(4, 40)]
json.dump(m, open(sys.argv[1], "w"), indent=1)
PY
resumes extra "manifest.json: records past the plan's 4 layers; they are dropped"

# ---- the manifest itself: refused -----------------------------------------------------------------
damaged torn; truncate -s 100 "$m"
refused torn "$tmp/torn.moeq-work/manifest.json: not JSON"
damaged version; sed -i 's/"version":[[:space:]]*[0-9][0-9]*,/"version": 99,/' "$m"
refused version "manifest.json: not a work manifest of this version of moeq"
# the work directory of another model (a generated one of the same family and shapes but other
# weights) or of other options
"$cli" bench gen-model --like olmoe-1b-7b --out "$tmp/m2" --layers 4 --experts 8 --hidden 256 --ffn 256 \
    --vocab 4096 --quiet >/dev/null 2>&1 || fail "gen-model exited $?"
{ MOEQ_FAULT=layer:1 "$cli" quantize "$tmp/m2" --out "$tmp/m2q" "${args[@]}"; } 2>/dev/null
damaged model; cp "$tmp/m2q.moeq-work/manifest.json" "$m"
refused model "manifest.json: the source differs from the interrupted run's"
rm -rf "$tmp/m2q.moeq-work" "$tmp/m2"
damaged options
err=$("$cli" quantize "$model" --out "$tmp/options" "${args[@]}" --block-size 64 --resume 2>&1)
[ $? -eq 1 ] || fail "options: a resume with another --block-size was not refused"
printf '%s\n' "$err" | grep -q "manifest.json: the options differ.*block_size" || fail "options: $err"
rm -rf "$tmp/options.moeq-work"

exit $((fails > 0))
