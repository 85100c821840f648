#!/usr/bin/env bash
# --report-html: one self-contained page drawn from the JSON report. The page parses as XML
# (XHTML), loads nothing (no scripts, no external references), and every plotted value read
# back from its data-* attributes equals the JSON report's: layer losses (GPTQ and RTN sums),
# tokens per expert with the fallback experts marked, GPTQ/RTN per expert, seconds per stage and
# peak memory per layer. The same for `moeq eval --html` against `eval --json`. Where Chromium is
# installed it must render both pages headless.
. "$(dirname "$0")/common.sh"
calib=$repo/data/demo-calib.txt
"$cli" quantize "$model" --out "$tmp/q" --scheme nvfp4a16 --method gptq --calib "$calib" \
    --nsamples 8 --seqlen 64 --report-html "$tmp/r.html" --quiet || fail "quantize --report-html exited $?"
[ -s "$tmp/r.html" ] || fail "no page written"
python3 - "$tmp/r.html" "$tmp/q/gptq_report.json" <<'PY' || fail "the page does not match the JSON report"
import json, math, sys
import xml.etree.ElementTree as ET
page, rep = sys.argv[1], json.load(open(sys.argv[2]))
root = ET.parse(page).getroot()        # well-formed XHTML, or this raises
text = open(page).read()
assert "<script" not in text and "http://" not in text.replace("http://www.w3.org/", ""), "external content"
S = "{http://www.w3.org/2000/svg}"
def close(a, b): return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-30)
rects = [e for e in root.iter(S + "rect") if e.get("class")]
L = len(rep["layers"])
gq = [0.0] * L; rt = [0.0] * L
tok, fb, eg, er = {}, set(), {}, {}
for m in rep["modules"]:
    l = m["layer"]
    if m["method"].startswith("gptq") and m["loss"] is not None and m["rtn_loss"] is not None:
        gq[l] += m["loss"]; rt[l] += m["rtn_loss"]
    if "expert" in m:
        k = (l, m["expert"])
        tok.setdefault(k, m["tokens"])
        if m["method"] != "gptq": fb.add(k)
        eg[k] = eg.get(k, 0) + m["loss"]; er[k] = er.get(k, 0) + m["rtn_loss"]
bars = {(e.get("class"), int(e.get("data-layer"))): float(e.get("data-value")) for e in rects if e.get("class").startswith("bar")}
assert len(bars) == 2 * L, bars
for l in range(L):
    assert close(bars[("bar gptq", l)], gq[l]) and close(bars[("bar rtn", l)], rt[l]), (l, bars, gq, rt)
cells = [e for e in rects if e.get("class").startswith("cell") and e.get("data-tokens") is not None]
assert len(cells) == len(tok), (len(cells), len(tok))
for e in cells:
    k = (int(e.get("data-layer")), int(e.get("data-expert")))
    assert float(e.get("data-tokens")) == tok[k], k
    assert ("fallback" in e.get("class")) == (k in fb), k
ratios = [e for e in rects if e.get("data-ratio") is not None]
assert len(ratios) == len(eg)
for e in ratios:
    k = (int(e.get("data-layer")), int(e.get("data-expert")))
    assert close(float(e.get("data-ratio")), eg[k] / er[k]), k
stages = {(e.get("class").split()[1], int(e.get("data-layer"))): float(e.get("data-seconds")) for e in rects if e.get("class").startswith("stage")}
for x in rep["layers"]:
    for st in ("forward", "hessians", "gptq", "write"):
        assert close(stages[(st, x["layer"])], x["seconds"][st]), (st, x)
peaks = {int(e.get("data-layer")): float(e.get("data-bytes")) for e in root.iter(S + "circle") if e.get("class") == "peak"}
assert all(peaks[x["layer"]] == x["peak_anon_bytes"] for x in rep["layers"]), peaks
summ = [e for e in root.iter() if e.get("id") == "summary"][0]
assert close(float(summ.get("data-gptq")), rep["summary"]["gptq_loss_total"])
assert fb, "olmoe-tiny with 8 x 64 tokens should have fallback experts"
PY
# headless Chromium renders it (when installed): a screenshot, no console errors
chrome=$(command -v chromium || command -v chromium-browser || true)
if [ -n "$chrome" ]; then
    timeout 120 "$chrome" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1050,1800 \
        --enable-logging=stderr --v=0 --screenshot="$tmp/shot.png" "file://$tmp/r.html" > "$tmp/chrome.log" 2>&1 ||
        fail "chromium exited $?: $(tail -3 "$tmp/chrome.log")"
    [ "$(head -c 8 "$tmp/shot.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "no PNG screenshot"
    [ "$(wc -c < "$tmp/shot.png")" -gt 20000 ] || fail "the screenshot is (nearly) blank"
    grep -q "CONSOLE" "$tmp/chrome.log" && fail "console messages: $(grep CONSOLE "$tmp/chrome.log" | head -3)"
else
    echo "note: chromium not installed: the render check was skipped (apt install chromium)"
fi
# moeq eval --html: the evaluation page, read back against the --json output
for i in 1 2 3; do
    printf ' = Title %d = \n The cat sat on the mat , and the history of the world is long . He said " hello " to everyone in %d . \n' "$i" "$((1990 + i))"
done > "$tmp/wiki.txt"
"$cli" eval "$tmp/q" --data "$tmp/wiki.txt" --kl-base "$model" --html "$tmp/e.html" --json --per-doc > "$tmp/e.json" 2>/dev/null ||
    fail "eval --html exited $?"
"$cli" eval "$model" --data "$tmp/wiki.txt" --kl-base "$model" --json > "$tmp/self.json" 2>/dev/null || fail "eval against itself exited $?"
python3 - "$tmp/e.html" "$tmp/e.json" "$tmp/self.json" <<'PY' || fail "the evaluation page does not match --json"
import json, math, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
r, me = json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
def close(a, b): return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-30)
rects = list(root.iter("{http://www.w3.org/2000/svg}rect"))
bins = [int(e.get("data-count")) for e in rects if e.get("class") == "bin"]
assert len(bins) == 18 and sum(bins) == r["kl_tokens"], bins
summ = [e for e in root.iter() if e.get("id") == "summary"][0]
assert close(float(summ.get("data-kl-mean")), r["kl_mean"]) and close(float(summ.get("data-top1-changed")), r["top1_changed"])
docs = {d["doc"]: d for d in r["per_doc"]}
kl = {int(e.get("data-doc")): float(e.get("data-kl")) for e in rects if e.get("data-kl") is not None}
assert close(sum(kl[d] * docs[d]["tokens"] for d in kl) / r["kl_tokens"], r["kl_mean"]), kl
top = {int(e.get("data-doc")): float(e.get("data-top1")) for e in rects if e.get("data-top1") is not None}
assert close(sum(top[d] * docs[d]["tokens"] for d in top) / r["kl_tokens"], r["top1_changed"]), top
ppl = {int(e.get("data-doc")): float(e.get("data-ppl")) for e in rects if e.get("class") == "ppl model"}
for d, x in docs.items():
    assert close(ppl[d], math.exp(-x["loglikelihood"] / x["tokens"])), (d, ppl)
assert len([e for e in rects if e.get("class") == "ppl base"]) == len(docs)
# the base's perplexity from the KL pass is what evaluating the base itself gives
assert r["base_word_perplexity"] == me["word_perplexity"], (r["base_word_perplexity"], me["word_perplexity"])
# the model against itself: KL 0, the base's perplexity the model's to the bit
assert me["kl_mean"] == 0 and me["base_word_perplexity"] == me["word_perplexity"], me
PY
if [ -n "$chrome" ]; then
    timeout 120 "$chrome" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1050,1400 \
        --enable-logging=stderr --v=0 --screenshot="$tmp/eshot.png" "file://$tmp/e.html" > "$tmp/echrome.log" 2>&1 ||
        fail "chromium (eval page) exited $?"
    [ "$(wc -c < "$tmp/eshot.png")" -gt 20000 ] || fail "the eval page's screenshot is (nearly) blank"
    grep -q "CONSOLE" "$tmp/echrome.log" && fail "eval page console messages"
fi

# the report is GPTQ's
"$cli" quantize "$model" --out "$tmp/u" --scheme int4 --report-html "$tmp/u.html" 2> "$tmp/err"
[ $? -eq 1 ] || fail "--report-html without GPTQ: expected exit 1"
grep -q "report_html" "$tmp/err" || fail "--report-html without GPTQ: message $(cat "$tmp/err")"
[ ! -e "$tmp/u.html" ] && [ ! -e "$tmp/u" ] || fail "a refused run wrote something"

[ $fails -eq 0 ] && echo "all report page checks passed"
exit $((fails > 0))
