"""Compiles the kernel library against the installed TensorFlow, once, into a cache.

The library is built with the machine's C++ compiler (``$CXX``, default
``g++``) from the sources in ``kernels/src`` with TensorFlow's own compile and
link flags, and with the BoringSSL headers that TensorFlow's wheel ships
(``include/external/boringssl/src/include``): the cipher is BoringSSL's, whose
symbols ``libtensorflow_framework.so.2`` exports. ``-Wl,--no-undefined`` makes
the link step prove that every symbol (``EVP_aes_128_ctr``, ``RAND_bytes``, ...)
is there.

The result is cached per TensorFlow version, Python version and a hash of the
sources' contents and the flags (`cache_key`; not the checkout's path) under ``$TFE_ESTIMATOR_KERNEL_CACHE`` (default
``$XDG_CACHE_HOME/tfe_estimator/kernels`` or ``~/.cache/tfe_estimator/kernels``),
and built under a file lock: the tasks of a cluster start at the same moment,
and exactly one of them compiles. Each source compiles to an object file of its
own, all at once on as many cores as there are sources (``noise_ops.cc`` alone
takes most of a build), into an object cache keyed by that source's contents,
the headers beside it, the flags and TensorFlow's version: a build after a change
to one source recompiles only that one. A build takes minutes, so it says so on
standard error before it starts and when it ends (as does a process that waits
for another's build): ``tfe-estimator build-kernels`` does it ahead of time.

Example::

    >>> from tfe_estimator.secure.kernels import _build
    >>> path = _build.build()          # compiles on first use, then reuses
    >>> path.name
    'libtfe_estimator_kernels.so'
"""
import fcntl
import hashlib
import logging
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from typing import List, Optional

__all__ = ["KernelBuildError", "build", "cache_key", "library_path", "compile_command", "compile_flags", "SOURCE_DIR"]

log = logging.getLogger("tfe_estimator")

SOURCE_DIR = pathlib.Path(__file__).parent / "src"
LIBRARY_NAME = "libtfe_estimator_kernels.so"
CACHE_ENV = "TFE_ESTIMATOR_KERNEL_CACHE"
#: About what a build takes on a 2-core machine (g++ 12, TensorFlow 2.15; issue 41): said before each build.
BUILD_MINUTES = 2
#: The optimization level of every build. Only a test building a planted mutation of a source changes it
#: (``-O1`` compiles ~3x faster and computes the same values: the sources rely on no undefined behaviour).
OPTIMIZATION = "-O3"


class KernelBuildError(RuntimeError):
    """The kernel library could not be compiled; the message names the command and the fix."""


def _sources() -> List[pathlib.Path]:
    return sorted(SOURCE_DIR.glob("*.cc"))


def _tf():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf


def _cxx_standard(tf_version: str) -> str:
    # TF 2.9's headers break under C++17 (StringPiece becomes std::string_view
    # and loading fails on an undefined OpKernelRegistrar symbol).
    major, minor = (int(p) for p in tf_version.split(".")[:2])
    return "-std=c++14" if (major, minor) < (2, 10) else "-std=c++17"


def compile_flags() -> List[str]:
    """The compiler and its flags for our sources (no inputs, no output, no linking).

    ``-Werror=unused-result``: a cipher call whose result is ignored
    (`TFE_MUST_CHECK` in aes_ctr.h) does not build.
    """
    tf = _tf()
    include = pathlib.Path(tf.sysconfig.get_include())
    flags = [f for f in tf.sysconfig.get_compile_flags() if not f.lstrip("-").startswith("std=")]
    return [os.environ.get("CXX", "g++"), "-fPIC", OPTIMIZATION, _cxx_standard(tf.__version__), "-Werror=unused-result",
            *flags, f"-I{include / 'external' / 'boringssl' / 'src' / 'include'}"]


def compile_command(output: pathlib.Path) -> List[str]:
    """One compiler command that builds the whole library into `output` (`build` does the same in steps)."""
    compiler, *flags = compile_flags()
    return [compiler, "-shared", *flags, *[str(s) for s in _sources()], "-o", str(output), *_link_flags()]


def _link_flags() -> List[str]:
    return [*_tf().sysconfig.get_link_flags(), "-Wl,--no-undefined"]


def _tf_dirs_replaced(flags: List[str]) -> List[str]:
    """`flags` with TensorFlow's own directories replaced by a placeholder (a key must not depend on them)."""
    tf = _tf()
    tf_dirs = sorted({tf.sysconfig.get_include(), tf.sysconfig.get_lib()}, key=len, reverse=True)
    replaced = []
    for flag in flags:
        for tf_dir in tf_dirs:
            flag = flag.replace(tf_dir, "<tensorflow>")
        replaced.append(flag)
    return replaced


def _object_path(source: pathlib.Path) -> pathlib.Path:
    """Where `source`'s object file lives in the object cache: keyed by its contents, the headers beside it,
    the compile flags, and TensorFlow's and Python's versions."""
    digest = hashlib.sha256()
    for path in [source, *sorted(source.parent.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for flag in _tf_dirs_replaced(compile_flags()):
        digest.update(flag.encode() + b"\0")
    digest.update(f"tf{_tf().__version__}-py{sys.version_info[0]}{sys.version_info[1]}".encode())
    return _cache_root() / "objects" / f"{source.stem}-{digest.hexdigest()[:16]}.o"


def _compile_object(source: pathlib.Path) -> pathlib.Path:
    """Compiles `source` into the object cache unless it is there; returns the object's path."""
    target = _object_path(source)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler, *flags = compile_flags()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = pathlib.Path(tmp) / target.name
        _compile([compiler, "-c", *flags, str(source), "-o", str(partial)])
        os.replace(partial, target)  # atomic: another build may be compiling the same object
    return target


def _cache_root() -> pathlib.Path:
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tfe_estimator" / "kernels"


def cache_key(source_dir: Optional[pathlib.Path] = None) -> str:
    """The cache entry's name: TensorFlow and Python versions and a hash of what the build depends on.

    The hash covers the sources' names and contents, the compiler and its flags and the link flags, with
    TensorFlow's own directories replaced by a placeholder: not where the sources or TensorFlow live, so a
    second checkout (or virtualenv) of the same code reuses the build. `source_dir` defaults to
    `SOURCE_DIR` as it is when called (a tool may point it at other sources).
    """
    tf = _tf()
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(SOURCE_DIR if source_dir is None else source_dir).iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for flag in _tf_dirs_replaced([*compile_flags(), *tf.sysconfig.get_link_flags()]):
        digest.update(flag.encode() + b"\0")
    return f"tf{tf.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{digest.hexdigest()[:16]}"


def library_path() -> pathlib.Path:
    """Where the library for this TensorFlow, Python and source version lives (see `cache_key`)."""
    return _cache_root() / cache_key() / LIBRARY_NAME


def build(force: bool = False) -> pathlib.Path:
    """Compiles the library unless it is cached; returns its path.

    Args:
      force: recompile even if a cached library exists.

    Raises:
      KernelBuildError: no compiler, or the compiler failed (the message
        names the command, its last output lines and the fix).
    """
    target = library_path()
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        _lock(lock, target)  # one builder per cache entry; the others wait
        if target.exists() and not force:
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = pathlib.Path(tmp) / LIBRARY_NAME
            _say(f"compiling tfe_estimator's kernels for TensorFlow {_tf().__version__} (once per TensorFlow "
                 f"version, cached in {target.parent}; about {BUILD_MINUTES} minutes on 2 cores; `tfe-estimator "
                 "build-kernels` does it ahead)")
            started = time.monotonic()
            sources = _sources()
            with futures.ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                objects = list(pool.map(_compile_object, sources))  # the first failure is raised here
            compiler = compile_flags()[0]
            _compile([compiler, "-shared", *[str(o) for o in objects], "-o", str(partial), *_link_flags()])
            os.replace(partial, target)  # atomic: a reader sees no half-written file
    _say(f"compiled tfe_estimator's kernels in {time.monotonic() - started:.0f} s: {target}")
    return target


def _say(line: str) -> None:
    """One line on standard error, whatever the logging set-up: a silent build looks like a hang."""
    sys.stderr.write(f"tfe_estimator: {line}\n")
    sys.stderr.flush()


def _lock(lock, target: pathlib.Path) -> None:
    """Takes the cache entry's build lock; says so when another process holds it (it is compiling)."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _say(f"waiting for another process to compile tfe_estimator's kernels into {target.parent} (about "
             f"{BUILD_MINUTES} minutes)")
        fcntl.flock(lock, fcntl.LOCK_EX)


def _compile(command: List[str]) -> None:
    if shutil.which(command[0]) is None:
        raise KernelBuildError(
            f"No C++ compiler {command[0]!r} on PATH, and tfe_estimator's AES-CTR kernels must be "
            "compiled against the installed TensorFlow. Install one (Debian/Ubuntu: "
            "`apt-get install g++`) or set CXX to a compiler, then run `tfe-estimator "
            "build-kernels`. Secure aggregation does not run without them."
        )
    log.info("compiling the tfe_estimator kernels: %s", shlex.join(command))
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise KernelBuildError(
            f"Compiling tfe_estimator's kernels failed (exit {result.returncode}):\n"
            f"  {shlex.join(command)}\n{tail}\n"
            "Fix: use g++ >= 9 (C++17; TensorFlow 2.9 needs C++14 headers, which this "
            "command selects), and a TensorFlow wheel that ships its headers (the "
            "`tensorflow` or `tensorflow-cpu` package). Then run `tfe-estimator build-kernels`."
        )
