"""Compiles and loads the C data-plane client (`native/tls_link.cc`) against TensorFlow's BoringSSL.

TensorFlow's ``libtensorflow_framework.so.2`` exports BoringSSL's ``SSL_*``
symbols and its wheel ships the headers (``include/external/boringssl/src/include``),
as for the kernel library (`secure.kernels._build`). This small library is
separate from the kernels and built only when the C link is first asked for
(`native_link.NativeLink`), in seconds, into the kernels' cache directory
(``$TFE_ESTIMATOR_KERNEL_CACHE``, default ``~/.cache/tfe_estimator/kernels``)
under ``tls_link/<key>``; the key hashes the source, the flags, the planted
mutations (tests only) and TensorFlow's version. TensorFlow is found without
importing it (the benchmark's clients run without it). A stack without the
headers or symbols still runs: only asking for the C link raises
`NativeLinkUnavailable`, naming what is missing and the fix.

Example::

    library = native_build.load()          # ctypes.CDLL; compiles on first use
    library.tfe_link_ctx_new                # the functions of tls_link.cc
"""
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Sequence, Tuple

__all__ = ["NativeLinkUnavailable", "SOURCE", "MUTATIONS", "build", "load"]

SOURCE = pathlib.Path(__file__).parent / "native" / "tls_link.cc"
#: Compile-time defines that plant a leak, for the mutation tests only (`tls_link.cc`'s header).
MUTATIONS = ("TFE_LINK_MUTATION_NO_NAME_CHECK", "TFE_LINK_MUTATION_NO_CA_CHECK")
_FRAMEWORK = "libtensorflow_framework.so.2"


class NativeLinkUnavailable(RuntimeError):
    """The C data-plane client cannot be built here; the message names what is missing and the fix."""


def _tensorflow() -> Tuple[pathlib.Path, str]:
    """TensorFlow's package directory and version, without importing it."""
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise NativeLinkUnavailable("the C data-plane link needs TensorFlow's BoringSSL, and TensorFlow is not "
                                    "installed: install it or use the Python link (TFE_ESTIMATOR_DATA_LINK=python).")
    directory = pathlib.Path(list(spec.submodule_search_locations)[0])
    version = "unknown"
    for name in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        try:
            version = importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return directory, version


def _standard(version: str) -> str:
    """C++17 (newer BoringSSL headers need it), C++14 below TensorFlow 2.10 (as `kernels._build`)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return "-std=c++17"
    return "-std=c++14" if (major, minor) < (2, 10) else "-std=c++17"


def _command(output: pathlib.Path, defines: Sequence[str]) -> list:
    tf_dir, version = _tensorflow()
    include = tf_dir / "include" / "external" / "boringssl" / "src" / "include"
    if not (include / "openssl" / "ssl.h").is_file() or not (tf_dir / _FRAMEWORK).is_file():
        raise NativeLinkUnavailable(
            f"TensorFlow at {tf_dir} ships no BoringSSL headers ({include}/openssl/ssl.h) or no {_FRAMEWORK}: "
            "the C data-plane link cannot be built. Use the Python link (TFE_ESTIMATOR_DATA_LINK=python, the "
            "default) or a TensorFlow wheel that ships its headers (the `tensorflow` package).")
    return [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O2", _standard(version), "-Wall",
            "-Werror=unused-result", *[f"-D{d}" for d in defines], f"-I{include}", str(SOURCE), "-o", str(output),
            f"-L{tf_dir}", f"-l:{_FRAMEWORK}", f"-Wl,-rpath,{tf_dir}", "-Wl,--no-undefined"]


def build(defines: Sequence[str] = ()) -> pathlib.Path:
    """Compiles the library unless it is cached; returns its path. `defines`: planted mutations (tests only)."""
    from tfe_estimator.secure.kernels import _build  # pylint: disable=import-outside-toplevel

    unknown = set(defines) - set(MUTATIONS)
    if unknown:
        raise ValueError(f"defines={sorted(unknown)} are not mutations of {SOURCE.name}; known: {MUTATIONS}.")
    _, version = _tensorflow()
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in _command(pathlib.Path("out"), sorted(defines)):
        digest.update(part.encode() + b"\0")
    target = _build._cache_root() / "tls_link" / f"tf{version}-{digest.hexdigest()[:16]}" / "libtfe_tls_link.so"  # noqa  # pylint: disable=protected-access
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per entry; it takes seconds
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = pathlib.Path(tmp) / target.name
            command = _command(partial, sorted(defines))
            sys.stderr.write(f"tfe_estimator: compiling the C data-plane link (seconds) into {target.parent}\n")
            try:
                result = subprocess.run(command, capture_output=True, text=True, check=False)
            except FileNotFoundError:
                raise NativeLinkUnavailable(f"no C++ compiler {command[0]!r} for the C data-plane link: install g++ "
                                            "or set CXX, or use the Python link (TFE_ESTIMATOR_DATA_LINK=python)."
                                            ) from None
            if result.returncode != 0:
                tail = "\n".join(result.stderr.strip().splitlines()[-12:])
                raise NativeLinkUnavailable(
                    f"compiling the C data-plane link failed (exit {result.returncode}): {' '.join(command)}\n"
                    f"{tail}\nAn undefined SSL_* symbol: this TensorFlow does not export BoringSSL; use the Python "
                    "link (TFE_ESTIMATOR_DATA_LINK=python).")
            os.replace(partial, target)
    return target


@functools.lru_cache(maxsize=None)
def load(defines: Tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library with its functions' signatures declared (ctypes.CDLL: the GIL is released in each call)."""
    lib = ctypes.CDLL(str(build(defines)))
    p, s, u64, i, d = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int, ctypes.c_double
    cs, ip, u64p = ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)
    for name, result, args in [
            ("tfe_link_ctx_new", p, [cs, s, cs, cs, cs, p, s]),
            ("tfe_link_ctx_free", None, [p]),
            ("tfe_link_connect", p, [p, cs, i, d, ip, p, s]),
            ("tfe_link_stale", i, [p]),
            ("tfe_link_shutdown", None, [p]),
            ("tfe_link_close", None, [p]),
            ("tfe_link_call", i, [p, p, u64, p, u64, p, u64, d, ip, ip, u64p, p, s]),
            ("tfe_link_read", i, [p, p, u64, d, p, s])]:
        function = getattr(lib, name)
        function.restype, function.argtypes = result, args
    return lib
