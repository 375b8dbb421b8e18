"""Writes the zeroshard wheel: the package's .py files and its extension,
plus the .dist-info (METADATA, WHEEL, RECORD) that pip needs.

    build_wheel.py --out=WHEEL --version=V --python_tag=cp311
        --platform_tag=linux_x86_64 --ext_suffix=.cpython-311-x86_64-linux-gnu.so
        --extension=_zeroshard.so zeroshard/__init__.py zeroshard/torch.py ...

The version must equal `__version__` in the package's __init__.py (it is the
project's one version; the build states it too only because the wheel's
file name must be known before the build runs), else this exits 1. The
output depends on the inputs only: entries sorted, timestamps fixed.
Standard library only, so it runs under any python3 without network.
"""

import argparse
import base64
import hashlib
import pathlib
import re
import sys
import zipfile

NAME = "zeroshard"
SUMMARY = ("ZeRO-as-a-service client: shard optimizer states (and stage 3 "
           "parameters) on zeroshardd daemons")
# zip's earliest representable time; any fixed value makes builds repeatable.
FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def _metadata(version, python_tag):
    major, minor = python_tag[2], python_tag[3:]
    # The extension imports no third-party module; zeroshard.torch needs
    # torch and numpy, which a venv with --system-site-packages takes from
    # Debian's python3-torch and python3-numpy, so they are only an extra.
    return (f"Metadata-Version: 2.1\n"
            f"Name: {NAME}\n"
            f"Version: {version}\n"
            f"Summary: {SUMMARY}\n"
            f"Requires-Python: =={major}.{minor}.*\n"
            f"Provides-Extra: torch\n"
            f"Requires-Dist: numpy; extra == \"torch\"\n"
            f"Requires-Dist: torch; extra == \"torch\"\n")


def _wheel(tag):
    return (f"Wheel-Version: 1.0\n"
            f"Generator: {NAME} build_wheel.py\n"
            f"Root-Is-Purelib: false\n"
            f"Tag: {tag}\n")


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
    return f"{path},sha256={digest.rstrip(b'=').decode()},{len(data)}\n"


def _package_version(init_py):
    match = re.search(r'^__version__ = "([^"]+)"$', init_py, re.MULTILINE)
    return match.group(1) if match else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--python_tag", required=True)  # e.g. cp311
    parser.add_argument("--platform_tag", required=True)  # e.g. linux_x86_64
    parser.add_argument("--ext_suffix", required=True)  # the interpreter's EXT_SUFFIX
    parser.add_argument("--extension", required=True)  # the built _zeroshard.so
    parser.add_argument("sources", nargs="+")  # the package's .py files
    args = parser.parse_args()

    # Archive name -> bytes. The extension is renamed to the suffix only the
    # target interpreter imports, so another Python fails with ImportError
    # instead of loading an incompatible library.
    files = {}
    for source in args.sources:
        path = pathlib.Path(source)
        files[f"{NAME}/{path.name}"] = path.read_bytes()
    files[f"{NAME}/_zeroshard{args.ext_suffix}"] = pathlib.Path(
        args.extension).read_bytes()

    init_key = f"{NAME}/__init__.py"
    if init_key not in files:
        sys.exit(f"build_wheel.py: no __init__.py among {args.sources}")
    package_version = _package_version(files[init_key].decode())
    if package_version != args.version:
        sys.exit(f"build_wheel.py: the build says version {args.version!r} "
                 f"but {init_key} has __version__ = {package_version!r}; "
                 f"make them equal")

    tag = f"{args.python_tag}-{args.python_tag}-{args.platform_tag}"
    expected_name = f"{NAME}-{args.version}-{tag}.whl"
    if pathlib.Path(args.out).name != expected_name:
        sys.exit(f"build_wheel.py: --out must be named {expected_name}")

    dist_info = f"{NAME}-{args.version}.dist-info"
    files[f"{dist_info}/METADATA"] = _metadata(
        args.version, args.python_tag).encode()
    files[f"{dist_info}/WHEEL"] = _wheel(tag).encode()
    record_path = f"{dist_info}/RECORD"
    record = "".join(_record_line(path, data)
                     for path, data in sorted(files.items()))
    files[record_path] = (record + f"{record_path},,\n").encode()

    # The package first, .dist-info last (RECORD at the very end), as
    # the wheel spec recommends.
    order = sorted(p for p in files if not p.startswith(dist_info))
    order += sorted(p for p in files if p.startswith(dist_info)
                    and p != record_path) + [record_path]
    with zipfile.ZipFile(args.out, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path in order:
            info = zipfile.ZipInfo(path, date_time=FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            mode = 0o755 if path.endswith(".so") else 0o644
            info.external_attr = (0o100000 | mode) << 16  # a regular file
            wheel.writestr(info, files[path])


if __name__ == "__main__":
    main()
