"""The bindings: ctypes over libmoeq.so's C API (include/moeq.h). Options travel as the CLI's
flag names and strings (moeq_*_options_set), results come back as JSON, so nothing here
mirrors a C struct except the three ints of moeq_model_options."""

import ctypes
import json
import os
import signal
import threading

_here = os.path.dirname(os.path.abspath(__file__))


class Error(Exception):
    """A failed moeq call: status (the library's code, e.g. -2) and the library's message."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


class _ModelOptions(ctypes.Structure):
    _fields_ = [("keep_packed", ctypes.c_int), ("no_tokenizer", ctypes.c_int), ("act_quant", ctypes.c_int)]


_PROGRESS = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64)
_lib = None


def _load():
    global _lib
    if _lib is not None:
        return _lib
    path = os.environ.get("MOEQ_LIBRARY") or os.path.join(_here, "libmoeq.so")
    lib = ctypes.CDLL(path)
    if lib.moeq_abi_version() != 1:
        raise ImportError(f"{path}: interface version {lib.moeq_abi_version()}, this package needs 1")
    c_p, c_str, c_int = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    sigs = {
        "moeq_version": ([], c_str),
        "moeq_status_text": ([c_int], c_str),
        "moeq_last_error": ([], c_str),
        "moeq_set_progress": ([_PROGRESS, c_p], None),
        "moeq_set_threads": ([c_int], None),
        "moeq_interrupt": ([], None),
        "moeq_clear_interrupt": ([], None),
        "moeq_resolve_model": ([c_str, c_str, ctypes.POINTER(c_p)], c_int),
        "moeq_quant_options_size": ([], ctypes.c_size_t),
        "moeq_quant_result_size": ([], ctypes.c_size_t),
        "moeq_eval_options_size": ([], ctypes.c_size_t),
        "moeq_eval_result_size": ([], ctypes.c_size_t),
        "moeq_quant_options_init": ([c_p], None),
        "moeq_quant_options_set": ([c_p, c_str, c_str], c_int),
        "moeq_quant_options_set_ignore": ([c_p, ctypes.POINTER(c_str), ctypes.c_int32], None),
        "moeq_quantize": ([c_str, c_str, c_p, c_p], c_int),
        "moeq_quant_result_json": ([c_p], c_p),
        "moeq_eval_options_init": ([c_p], None),
        "moeq_eval_options_set": ([c_p, c_str, c_str], c_int),
        "moeq_eval_options_set_base": ([c_p, c_p], None),
        "moeq_eval_options_set_docs": ([c_p] + [c_p] * 5, None),
        "moeq_eval_html_flat": ([c_str, c_str, c_str, c_str, c_p, c_p] + [c_p] * 5, c_int),
        "moeq_docs_count": ([c_p], ctypes.c_int64),
        "moeq_eval": ([c_p, c_p, c_p, c_p], c_int),
        "moeq_eval_result_json": ([c_p], c_p),
        "moeq_eval_settings_json": ([c_p], c_p),
        "moeq_model_open": ([c_str, ctypes.POINTER(_ModelOptions), ctypes.POINTER(c_p)], c_int),
        "moeq_model_free": ([c_p], None),
        "moeq_docs_load": ([c_str, c_int, ctypes.POINTER(c_p)], c_int),
        "moeq_docs_free": ([c_p], None),
        "moeq_inspect_json": ([c_str, ctypes.POINTER(c_p)], c_int),
        "moeq_string_free": ([c_p], None),
    }
    for name, (args, res) in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    _lib = lib
    return lib


def version():
    return _load().moeq_version().decode()


def _fail(st, msg):
    return Error(st, msg or _load().moeq_status_text(st).decode())


def _call(fn, *args):
    """fn(*args) in this thread; raises Error with the message (thread-local in the library)."""
    st = fn(*args)
    if st != 0:
        raise _fail(st, _load().moeq_last_error().decode())


def _text(lib, p):
    try:
        return ctypes.string_at(p).decode()
    finally:
        lib.moeq_string_free(p)


def _value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _resolve(lib, name, revision=None):
    out = ctypes.c_void_p()
    _call(lib.moeq_resolve_model, os.fsencode(name), revision.encode() if revision else None, ctypes.byref(out))
    return _text(lib, out)


def _run_interruptible(lib, fn, *args):
    """Runs a long C call on a worker thread so that Ctrl-C reaches it at once: while it runs, a
    SIGINT handler (main thread only) asks the library to stop (moeq_interrupt); the call then
    returns MOEQ_E_INTERRUPTED, having cleaned up (no partial output), and KeyboardInterrupt is
    raised here. No KeyboardInterrupt can fire while the worker still runs."""
    box = {}

    def work():
        st = fn(*args)
        box["st"] = st
        box["msg"] = lib.moeq_last_error().decode() if st != 0 else ""

    hit = []

    def on_sigint(signum, frame):
        hit.append(signum)
        lib.moeq_interrupt()

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, on_sigint) if main else None
    try:
        lib.moeq_clear_interrupt()
        t = threading.Thread(target=work, name="moeq", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
    finally:
        if main:
            signal.signal(signal.SIGINT, old)
        lib.moeq_clear_interrupt()
    if hit:
        raise KeyboardInterrupt
    if box["st"] != 0:
        raise _fail(box["st"], box["msg"])


def _with_progress(lib, progress):
    if progress is None:
        lib.moeq_set_progress(_PROGRESS(0), None)
        return None

    def cb(_user, label, done, total):
        try:
            progress(label.decode() if label else "", int(done), int(total))
        except Exception:  # a callback must not unwind through C
            pass

    f = _PROGRESS(cb)
    lib.moeq_set_progress(f, None)
    return f


def quantize(model, out, *, scheme, method="rtn", ignore=(), progress=None, threads=None, revision=None,
             **options):
    """Quantizes MODEL (a directory or a Hugging Face hub id in the local cache) into OUT, as
    `moeq quantize MODEL --out OUT --scheme SCHEME --method METHOD --flag value ...` does
    (ignore: the --ignore patterns). Returns the run's summary (dict). progress(label, done,
    total) is called as it goes."""
    lib = _load()
    if threads is not None:
        lib.moeq_set_threads(int(threads))
    opts = ctypes.create_string_buffer(lib.moeq_quant_options_size())
    lib.moeq_quant_options_init(opts)
    keep = []  # the option strings live as long as the call (the library keeps pointers)
    for k, v in [("scheme", scheme), ("method", method)] + list(options.items()):
        if v is None:
            continue
        key, val = k.replace("_", "-").encode(), (os.fsencode(v) if isinstance(v, os.PathLike) else _value(v).encode())
        keep += [key, val]
        _call(lib.moeq_quant_options_set, opts, key, val)
    pats = [p.encode() for p in ([ignore] if isinstance(ignore, str) else list(ignore))]
    arr = (ctypes.c_char_p * max(len(pats), 1))(*pats)
    keep += [pats, arr]
    lib.moeq_quant_options_set_ignore(opts, arr, len(pats))
    src = _resolve(lib, os.fspath(model), revision).encode()
    res = ctypes.create_string_buffer(lib.moeq_quant_result_size())
    cb = _with_progress(lib, progress)
    try:
        _run_interruptible(lib, lib.moeq_quantize, src, os.fsencode(out), opts, res)
    finally:
        _with_progress(lib, None)
        del cb
    return json.loads(_text(lib, lib.moeq_quant_result_json(res)))


_LAYOUTS = {"wikitext": 0, "jsonl": 1, "whole": 2}


_ACT_QUANT = {None: 0, "none": 0, "nvfp4": 1, "q8_0": 2}


def evaluate(model, data, *, task="wikitext", layout=None, kl_base=None, dequantize=False, html=None,
             act_quant=None, progress=None, threads=None, revision=None, **options):
    """Evaluates MODEL on DATA as `moeq eval` does (lm-eval's wikitext protocol by default):
    perplexities, and with kl_base the KL to that model, top-1 changes and its perplexity;
    html: also the evaluation page (moeq eval --html); act_quant: "nvfp4" (W4A4) or "q8_0"
    (llama.cpp's Q8_0 activations), as moeq eval --act-quant, on the dequantized path; the other
    keywords are moeq eval's flags (moeq_eval_option_info: max_length, limit, device, ...). Returns
    a dict, with the options given under "settings"."""
    lib = _load()
    if act_quant not in _ACT_QUANT:
        raise Error(-5, f"act_quant={act_quant}: expected nvfp4 or q8_0")
    aq = _ACT_QUANT[act_quant]
    if threads is not None:
        lib.moeq_set_threads(int(threads))
    data = os.fspath(data)
    if layout is None:
        layout = "jsonl" if data.endswith(".jsonl") else "wikitext" if task == "wikitext" else "whole"
    if layout not in _LAYOUTS:
        raise Error(-5, f"layout={layout}: expected wikitext, jsonl or whole")
    opts = ctypes.create_string_buffer(lib.moeq_eval_options_size())
    lib.moeq_eval_options_init(opts)
    keep = []
    for k, v in [("task", task)] + list(options.items()):
        if v is None:
            continue
        key, val = k.replace("_", "-").encode(), _value(v).encode()
        keep += [key, val]
        _call(lib.moeq_eval_options_set, opts, key, val)
    docs, m, base = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    mo = _ModelOptions(0 if dequantize or aq else 1, 0, aq)
    bo = _ModelOptions(0 if dequantize else 1, 0, 0)
    cb = None
    try:
        _call(lib.moeq_docs_load, os.fsencode(data), _LAYOUTS[layout], ctypes.byref(docs))
        _call(lib.moeq_model_open, _resolve(lib, os.fspath(model), revision).encode(), ctypes.byref(mo), ctypes.byref(m))
        if kl_base is not None:
            _call(lib.moeq_model_open, _resolve(lib, os.fspath(kl_base)).encode(), ctypes.byref(bo), ctypes.byref(base))
            lib.moeq_eval_options_set_base(opts, base)
        res = ctypes.create_string_buffer(lib.moeq_eval_result_size())
        n = lib.moeq_docs_count(docs)
        per = [(ctypes.c_double * max(n, 1))() for _ in range(4)] if html else None
        tok = (ctypes.c_int64 * max(n, 1))() if html else None
        if html:
            lib.moeq_eval_options_set_docs(opts, per[0], tok, per[1], per[2], per[3])
        cb = _with_progress(lib, progress)
        _run_interruptible(lib, lib.moeq_eval, m, docs, opts, res)
        if html:
            _call(lib.moeq_eval_html_flat, os.fsencode(html), os.fsencode(os.fspath(model)),
                  os.fsencode(os.fspath(kl_base)) if kl_base is not None else None, os.fsencode(data), docs, res,
                  per[0], per[3], per[1], per[2], tok)
        out = json.loads(_text(lib, lib.moeq_eval_result_json(res)))
        out["settings"] = json.loads(_text(lib, lib.moeq_eval_settings_json(opts)))
        return out
    finally:
        _with_progress(lib, None)
        del cb
        if base:
            lib.moeq_model_free(base)
        if m:
            lib.moeq_model_free(m)
        if docs:
            lib.moeq_docs_free(docs)


def inspect(model, *, revision=None):
    """A checkpoint's facts (config and safetensors headers; no weights read) as a dict."""
    lib = _load()
    out = ctypes.c_void_p()
    _call(lib.moeq_inspect_json, _resolve(lib, os.fspath(model), revision).encode(), ctypes.byref(out))
    return json.loads(_text(lib, out))
