"""The fused C kernels of the codecs (``blockquant.c``: int8, int4; ``bf16steps.c``: bf16_steps), compiled at first use.

Like DeepSpeed's CPU Adam, the kernels are built on the machine that runs
them (``cc -O3 -march=native``), once, into a cache keyed by the source, the
compiler, the flags and the CPU (a home directory shared between different
hosts gets one library per CPU kind). Without a C compiler, or with
``LUWU_NATIVE=0``, the codecs keep their torch path, which gives the same
bits (``tests/unit/test_native.py``): nodes and workers may mix the two.

``LUWU_CACHE_DIR`` sets the cache folder (default ``$XDG_CACHE_HOME/luwu`` or
``~/.cache/luwu``; a per-user temporary folder when that cannot be written). A folder or library
not owned by this user alone is never used: the kernels are then built in a private folder.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("blockquant.c", "bf16steps.c"))
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-fno-math-errno",
    "-shared",
    "-fPIC",
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
reason: str = ""
"""Why the kernels are not in use (empty while they are, or before the first :func:`kernels`)."""


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    env = os.environ.get("LUWU_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "luwu"


def _trusted(path: Path) -> bool:
    """Whether ``path`` (a folder or a library) is ours alone: no link, owned by this user, not writable
    by group or others. A library another user could have planted is never loaded (its constructor
    would run as this user, root included)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    return not os.path.islink(path) and st.st_uid == uid and not st.st_mode & 0o022


def _folders() -> list[Path]:
    """Cache folders to try, in order: the configured cache, a per-user temporary folder; each is
    created mode 700 and used only if :func:`_trusted`."""
    uid = os.getuid() if hasattr(os, "getuid") else "u"
    return [_cache_dir(), Path(tempfile.gettempdir()) / f"luwu-{uid}"]


def _compile(cc: str, folder: Path, lib: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=".blockquant-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        out = subprocess.run(
            [cc, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=120
        )
        if out.returncode != 0:
            raise RuntimeError(f"{cc} failed: {out.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)  # atomic: processes building at once all load a whole library
        return lib
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(cc: str) -> Path:
    src = b"\0".join(p.read_bytes() for p in SOURCES)
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, timeout=30
    ).stdout.splitlines()[:1]
    key = hashlib.sha256(
        b"\0".join(
            [
                src,
                " ".join(FLAGS).encode(),
                "".join(version).encode(),
                _cpu_id().encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:16]
    name = f"blockquant-{key}.so"
    for folder in _folders():
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if not _trusted(folder):
            log.warning(
                "luwu: not using the kernel cache %s: it is not owned by this user alone (mode or owner)",
                folder,
            )
            continue
        lib = folder / name
        if lib.exists():
            if _trusted(lib):
                return lib
            log.warning(
                "luwu: ignoring %s: not owned by this user alone; building a private copy", lib
            )
            continue
        try:
            return _compile(cc, folder, lib)
        except OSError:
            continue
    # no folder to trust: a private one for this process (mkdtemp makes it mode 700)
    folder = Path(tempfile.mkdtemp(prefix="luwu-kernels-"))
    return _compile(cc, folder, folder / name)


def _load() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc, or $CC)")
    lib = ctypes.CDLL(str(_build(cc)))
    i64, i32, f32, p = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
    lib.luwu_block_encode.argtypes = [p, p, p, p, i64, i64, i32, f32, f32, p]
    lib.luwu_block_encode_bf16res.argtypes = [p, p, p, p, i64, i64, i32, f32, f32, p]
    lib.luwu_block_encode_over.argtypes = [p, p, i64, i64, i32, f32, f32, p]
    lib.luwu_block_decode.argtypes = [p, p, p, i64, i64, i32, f32, i32]
    lib.luwu_block_decode_pair.argtypes = [p, p, p, p, p, i64, i64, i32, f32]
    for f in (
        lib.luwu_block_encode,
        lib.luwu_block_encode_bf16res,
        lib.luwu_block_encode_over,
        lib.luwu_block_decode,
        lib.luwu_block_decode_pair,
    ):
        f.restype = None
    lib.luwu_block_encode_pieces.argtypes = [p, p, i32, p, p, i64, i64, i32, f32, f32, p]
    lib.luwu_block_encode_pieces.restype = i32
    lib.luwu_copy_nonfinite.argtypes = [p, p, i64]
    lib.luwu_copy_nonfinite.restype = i32
    lib.luwu_bf16_round.argtypes = [p, p, i64]
    lib.luwu_bf16_round.restype = None
    lib.luwu_bf16_steps_encode.argtypes = [p, p, p, p, i64]
    lib.luwu_bf16_steps_apply.argtypes = [p, i32, p, p, i64, i64]
    lib.luwu_bf16_steps_encode.restype = lib.luwu_bf16_steps_apply.restype = i64
    lib.luwu_bf16_steps_count.argtypes = [p, i64]
    lib.luwu_bf16_steps_count.restype = i64
    return lib


def kernels() -> ctypes.CDLL | None:
    """The loaded kernels, or None (then :data:`reason` says why, logged once)."""
    global _lib, _tried, reason
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("LUWU_NATIVE", "1") == "0":
                reason = "LUWU_NATIVE=0"
            else:
                try:
                    _lib = _load()
                except (
                    Exception
                ) as exc:  # any failure leaves the torch path, which is correct, only slower
                    reason = f"{type(exc).__name__}: {exc}"
                    log.warning(
                        "luwu: the fused codec kernels are not available (%s); using the torch path, "
                        "about 3x slower per byte",
                        reason,
                    )
            _tried = True
    return _lib


def reset() -> None:
    """Forget the loaded kernels: the next :func:`kernels` reads ``LUWU_NATIVE``, ``CC`` and the cache
    folder again (tests switch paths with it)."""
    global _lib, _tried, reason
    with _lock:
        _lib, _tried, reason = None, False, ""
