"""A PEP 517 build backend with no requirements: writes the wheel of the moeq package, moeq/*.py
plus libmoeq.so ($MOEQ_LIBRARY, else ../build/libmoeq.so, as CMake builds it). Standard library
only, so `pip install ./python` needs no network."""

import base64
import hashlib
import os
import sysconfig
import zipfile

NAME, VERSION = "moeq", "0.1.0"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library():
    lib = os.environ.get("MOEQ_LIBRARY") or os.path.join(HERE, "..", "build", "libmoeq.so")
    if not os.path.isfile(lib):
        raise RuntimeError(f"moeq: {lib} not found: build the library first (./build.sh, or cmake --build "
                           "build), or set MOEQ_LIBRARY to a libmoeq.so")
    return lib


def _tag():
    return "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")


def _metadata():
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\nRequires-Python: >=3.8\n"
            "Summary: Quantize MoE LLMs (GPTQ and RTN into NVFP4 and INT4) and evaluate them as lm-eval does\n")


def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    d = os.path.join(metadata_directory, f"{NAME}-{VERSION}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(_metadata())
    return os.path.basename(d)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = []   # (path in the wheel, bytes)
    pkg = os.path.join(HERE, NAME)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                files.append((f"{NAME}/{name}", f.read()))
    with open(_library(), "rb") as f:
        files.append((f"{NAME}/libmoeq.so", f.read()))
    info = f"{NAME}-{VERSION}.dist-info"
    files.append((f"{info}/METADATA", _metadata().encode()))
    files.append((f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: moeq_build\nRoot-Is-Purelib: false\nTag: {_tag()}\n".encode()))
    record = ""
    for path, data in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(data)}\n"
    record += f"{info}/RECORD,,\n"
    files.append((f"{info}/RECORD", record.encode()))
    wheel = f"{NAME}-{VERSION}-{_tag()}.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files:
            zi = zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0))
            zi.external_attr = (0o755 if path.endswith(".so") else 0o644) << 16
            z.writestr(zi, data, zipfile.ZIP_DEFLATED)
    return wheel
