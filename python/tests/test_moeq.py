"""The Python package against the CLI (the same library behind both): the same checkpoints and
figures, errors as moeq.Error, progress, Ctrl-C. Run with pytest, or as a script (no pytest
needed). Needs MOEQ_CLI (the moeq binary) and MOEQ_REPO; MOEQ_LIBRARY (libmoeq.so) unless the
package was installed with its copy."""

import json
import os
import signal
import subprocess
import sys
import tempfile

import moeq

CLI = os.environ["MOEQ_CLI"]
REPO = os.environ["MOEQ_REPO"]
MODEL = os.path.join(REPO, "models", "olmoe-tiny")
CALIB = os.path.join(REPO, "data", "demo-calib.txt")
TMP = tempfile.mkdtemp(prefix="moeq-py-")


def cli(*args):
    return subprocess.run([CLI, *args], check=True, capture_output=True, text=True).stdout


def wiki():
    path = os.path.join(TMP, "wiki.txt")
    with open(path, "w") as f:
        for i in range(3):
            f.write(f" = Title {i} = \n The cat sat on the mat , and the history of the world is long . \n")
    return path


def test_version_and_inspect():
    assert cli("--version").splitlines()[0] == "moeq " + moeq.version()
    info = moeq.inspect(MODEL)
    assert info["model_type"] == "olmoe" and info["layers"] == 4 and info["experts"] == 8
    assert info["experts_per_token"] == 2 and info["parameters"] == info["tensor_elements"]
    assert 0 < info["active_parameters"] < info["parameters"]


def test_quantize_matches_cli():
    a, b = os.path.join(TMP, "py-int4"), os.path.join(TMP, "cli-int4")
    r = moeq.quantize(MODEL, a, scheme="int4", group_size=32)
    cli("quantize", MODEL, "--out", b, "--scheme", "int4", "--group-size", "32", "--quiet")
    with open(os.path.join(a, "model.safetensors"), "rb") as f1, open(os.path.join(b, "model.safetensors"), "rb") as f2:
        assert f1.read() == f2.read()
    assert r["linears_quantized"] == 112 and r["bytes_written"] > 0
    # INT4's scale sign through the binding: the CLI's bytes for the same flag
    c, d = os.path.join(TMP, "py-int4-pos"), os.path.join(TMP, "cli-int4-pos")
    moeq.quantize(MODEL, c, scheme="int4", group_size=32, int4_scale_sign="positive")
    cli("quantize", MODEL, "--out", d, "--scheme", "int4", "--group-size", "32", "--int4-scale-sign", "positive", "--quiet")
    with open(os.path.join(c, "model.safetensors"), "rb") as f1, open(os.path.join(d, "model.safetensors"), "rb") as f2:
        pos = f1.read()
        assert pos == f2.read()
    with open(os.path.join(a, "model.safetensors"), "rb") as f1:
        assert f1.read() != pos


def test_gptq_progress_and_reports():
    calls = []
    out, html = os.path.join(TMP, "gq"), os.path.join(TMP, "gq.html")
    r = moeq.quantize(MODEL, out, scheme="nvfp4a16", method="gptq", calib=CALIB, nsamples=8, seqlen=64,
                      act_order=False, report_html=html, progress=lambda label, d, t: calls.append((label, d, t)))
    assert calls and all(c[0] == "quantize" for c in calls)
    assert [c[1] for c in calls] == sorted(c[1] for c in calls) and calls[-1][1] == calls[-1][2]
    rep = json.load(open(os.path.join(out, "gptq_report.json")))
    assert abs(r["gptq_loss"] - rep["summary"]["gptq_loss_total"]) <= 1e-9 * r["gptq_loss"]
    assert open(html).read().startswith("<!DOCTYPE html>")
    # --ignore: those Linears are neither quantized nor reported
    ig = os.path.join(TMP, "ig")
    moeq.quantize(MODEL, ig, scheme="nvfp4a16", method="gptq", calib=CALIB, nsamples=4, seqlen=32, ignore=["self_attn"])
    mods = json.load(open(os.path.join(ig, "gptq_report.json")))["modules"]
    assert mods and not any("self_attn" in m["module"] for m in mods)
    # the samples chosen across experts from 4x as many candidates (a pass of its own, with its progress)
    calls = []
    r = moeq.quantize(MODEL, os.path.join(TMP, "gqb"), scheme="nvfp4a16", method="gptq", calib=CALIB, nsamples=4,
                      seqlen=64, calib_balance="experts", progress=lambda label, d, t: calls.append(label))
    assert r["gptq_samples"] == 4 and r["balance"]["candidates"] == 16, r
    assert r["balance"]["experts_under_chosen"] <= r["balance"]["experts_under_first"]
    assert calls[0] == "balance calibration" and calls[-1] == "quantize"


def test_evaluate_matches_cli():
    q = os.path.join(TMP, "ev")
    moeq.quantize(MODEL, q, scheme="nvfp4a16")
    data = wiki()
    e = moeq.evaluate(q, data, kl_base=MODEL)
    c = json.loads(cli("eval", q, "--data", data, "--kl-base", MODEL, "--json"))
    for k in ("word_perplexity", "loglikelihood", "kl_mean", "top1_changed", "base_word_perplexity", "tokens"):
        assert e[k] == c[k], k
    assert e["settings"] == c["settings"], (e["settings"], c["settings"])   # one table, two callers
    page = os.path.join(TMP, "ev.html")
    moeq.evaluate(q, data, kl_base=MODEL, html=page)
    assert 'id="kl-hist"' in open(page).read()
    t = moeq.evaluate(q, data, task="text", max_length=64)
    assert t["word_perplexity"] > 0 and t["documents"] == 1
    assert t["settings"]["task"] == "text" and t["settings"]["max_length"] == 64, t["settings"]
    # llama.cpp's Q8_0 activations emulated: the CLI's figure, not the plain one
    a = moeq.evaluate(q, data, act_quant="q8_0")
    c = json.loads(cli("eval", q, "--data", data, "--act-quant", "q8_0", "--json"))
    assert a["loglikelihood"] == c["loglikelihood"] != e["loglikelihood"], (a, c, e)
    expect_error(-5, "act_quant=q4", moeq.evaluate, q, data, act_quant="q4")


def expect_error(status, needle, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except moeq.Error as x:
        assert x.status == status and needle in str(x), (x.status, str(x))
        return
    raise AssertionError("no moeq.Error")


def test_errors():
    expect_error(-5, "group-size=x", moeq.quantize, MODEL, os.path.join(TMP, "e1"), scheme="int4", group_size="x")
    expect_error(-5, "'bogus'", moeq.quantize, MODEL, os.path.join(TMP, "e2"), scheme="int4", bogus=1)
    expect_error(-5, "scheme=int8", moeq.quantize, MODEL, os.path.join(TMP, "e3"), scheme="int8")
    expect_error(-5, "int4-scale-sign=both", moeq.quantize, MODEL, os.path.join(TMP, "e5"), scheme="int4",
                 int4_scale_sign="both")
    expect_error(-5, "calib-balance=all", moeq.quantize, MODEL, os.path.join(TMP, "e6"), scheme="int4",
                 calib_balance="all")
    nowhere = os.path.join(TMP, "no-such-model")
    try:
        moeq.quantize(nowhere, os.path.join(TMP, "e4"), scheme="int4")
        raise AssertionError("no error")
    except moeq.Error as x:
        assert "no-such-model" in str(x)
    os.makedirs(os.path.join(TMP, "exists"), exist_ok=True)
    with open(os.path.join(TMP, "exists", "f"), "w") as f:
        f.write("x")
    expect_error(-10, "exists", moeq.quantize, MODEL, os.path.join(TMP, "exists"), scheme="int4")
    for name in ("e1", "e2", "e3", "e4"):
        assert not os.path.exists(os.path.join(TMP, name))


def test_ctrl_c_stops_cleanly():
    out = os.path.join(TMP, "stopped")
    fired = []

    def progress(label, done, total):
        if not fired:
            fired.append(done)
            os.kill(os.getpid(), signal.SIGINT)   # what Ctrl-C does

    try:
        moeq.quantize(MODEL, out, scheme="nvfp4a16", method="gptq", calib=CALIB, nsamples=64, seqlen=128,
                      progress=progress)
        raise AssertionError("not interrupted")
    except KeyboardInterrupt:
        pass
    assert fired and not os.path.exists(out)
    # the library is usable again
    assert moeq.inspect(MODEL)["layers"] == 4


if __name__ == "__main__":
    failed = 0
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print("ok  ", name)
            except Exception as x:  # noqa: BLE001 (report every case)
                failed += 1
                print("FAIL", name, repr(x))
    sys.exit(1 if failed else 0)
