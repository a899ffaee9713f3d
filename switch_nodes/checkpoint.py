"""Durable shard checkpoints: ``torch.distributed.checkpoint`` folders, atomic, checksummed, the last few kept.

A node's checkpoint of step ``s`` is the folder ``node<index>-step<s>.dcp/``, in the format of
exports (:mod:`.export`, written with :func:`luwu.protocol.dcp_files.save_tensor` and
:func:`~luwu.protocol.dcp_files.write_metadata`), so ``torch.distributed.checkpoint.load`` reads it
with no LuWu code:

- ``__0_0.distcp`` and ``.metadata``: the node's fp32 master weights ``model.<name>`` and
  optimizer state ``optim.state.<name>.<state>`` (and torch's ``optim.state.<name>.step``), the key
  layout of exports and of torch's distributed state dicts. A node knows its parameters' positions,
  not their shapes (HELLO carries positions), so each tensor is flat: its size is the extent of the
  parameter this node holds, and each segment is the chunk at its offset. A parameter split over
  nodes is in several nodes' folders, each with its own chunks.
- ``luwu_node.json``: what restoring needs beyond tensors: job, node index, layout hash, world size,
  optimizer kind, step, parameter names, per bucket its spec, version, initialized flag, step
  counters and which state tensors it holds (state never used is not written: it is zero).
- ``luwu_sha256.json``: the size and sha256 of every other file.

Written into a temporary folder, every file and the folder fsynced, renamed into place and the
directory fsynced, so a crash leaves either the old or the new checkpoint. A checkpoint that cannot
be read whole (a file missing, altered or truncated, a manifest that is not what a node writes, or
reading it raises anything at all, such as JSON nested past the recursion limit) is corrupt: it is
skipped (and reported), and the previous checkpoint is used. Files of the old format
(:mod:`.legacy_checkpoint`) are listed and read too, to be converted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from luwu.protocol.dcp_files import DcpFolder, save_tensor, write_metadata
from luwu.protocol.errors import CorruptCheckpointError
from luwu.protocol.layout import Bucket
from luwu.switch_nodes import legacy_checkpoint
from luwu.switch_nodes.export import MODEL, OPTIM_STATE

__all__ = ["Checkpoint", "CheckpointStore", "CorruptCheckpointError", "param_keys"]

log = logging.getLogger(__name__)

SUFFIX = ".dcp"
DATA, MANIFEST, CHECKSUMS = "__0_0.distcp", "luwu_node.json", "luwu_sha256.json"
CHUNK = 8 << 20
#: Order of the checkpoints of one step, the preferred last: an old-format file, a folder set aside
#: while a newer one of its step took its name, the folder.
_LEGACY, _REPLACED, _CURRENT = 0, 1, 2


@dataclass
class Checkpoint:
    path: Path
    step: int
    meta: dict  # job, node, layout, world_size, optimizer, step, param_names, buckets: [{id, spec, ...}]
    tensors: dict[int, list[torch.Tensor]]  # bucket id -> [params, *state (the kind's), steps]
    legacy: bool = False  # read from an old-format file (to be written again as a folder)


def param_keys(names: dict[str, str], params) -> dict[int, str]:
    """Each parameter's name in a checkpoint: its name from ``names`` (index as a string -> name),
    else (unnamed, or a name two parameters share) ``#<index>``."""
    params = sorted(set(params))
    given = [names.get(str(p)) or "" for p in params]
    out = {}
    for p, name in zip(params, given):
        out[p] = name if name and not name.startswith("#") and given.count(name) == 1 else f"#{p}"
    return out


class _HashingFile:
    """A file being written, hashed on the way (what ``torch.save`` and our writes go through)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()
        self.error: OSError | None = (
            None  # what a write raised (torch.save reports it as RuntimeError)
        )

    def write(self, data) -> int:
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


class CheckpointStore:
    def __init__(self, directory: str, node_index: int, keep: int = 3):
        self.dir = Path(directory)
        self.node = node_index
        self.keep = max(2, keep)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.last_step: int | None = None
        self.last_time: float | None = None

    def _name(self, step: int) -> Path:
        return self.dir / f"node{self.node}-step{step:010d}{SUFFIX}"

    def list(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint of this node, oldest first (of one step, the preferred last)."""
        kinds = {
            SUFFIX: _CURRENT,
            SUFFIX + ".replaced": _REPLACED,
            legacy_checkpoint.SUFFIX: _LEGACY,
        }
        out = []
        for p in self.dir.glob(f"node{self.node}-step*"):
            stem, _, suffix = p.name.partition(".")
            kind = kinds.get("." + suffix)
            try:
                step = int(stem.split("-step", 1)[1])
            except (IndexError, ValueError):
                continue
            if kind is not None:
                out.append((step, kind, p))
        return [(step, p) for step, _, p in sorted(out)]

    # ----------------------------------------------------------------- writing
    def save(self, meta: dict, tensors: dict[int, dict[str, torch.Tensor]]) -> Path:
        """Write ``meta`` (the manifest; per bucket its ``spec`` and the ``states`` it holds) and each
        bucket's flat tensors by name (``params`` and those states) as the checkpoint of
        ``meta["step"]``; returns its folder."""
        step = meta["step"]
        final = self._name(step)
        for stale in self.dir.glob(f".node{self.node}-step*{SUFFIX}.tmp"):
            _remove(stale)  # left by a crash: this node is its only writer
        tmp = self.dir / f".{final.name}.tmp"
        replaced = final.with_name(final.name + ".replaced")
        try:
            tmp.mkdir()
            sums = self._write_files(tmp, meta, tensors)
            (tmp / CHECKSUMS).write_bytes(json.dumps({"files": sums}, indent=1).encode())
            with open(tmp / CHECKSUMS, "rb") as f:
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if (
                final.exists()
            ):  # (a second checkpoint of one step: the first stays readable till then)
                _remove(replaced)
                os.rename(final, replaced)
            os.rename(tmp, final)
        except BaseException:
            _remove(tmp)  # a full disk leaves no partial folder behind
            raise
        _fsync_dir(self.dir)
        _remove(replaced)
        self.last_step, self.last_time = step, time.time()
        for _, old in self.list()[: -self.keep]:
            _remove(old)
        return final

    def _write_files(self, folder: Path, meta: dict, tensors: dict) -> dict[str, dict]:
        """The data file, ``.metadata`` and the manifest, each synced; returns their sizes and sha256."""
        sums = {}
        with open(folder / DATA, "xb") as raw:
            f = _HashingFile(raw)
            try:
                pieces = self._pieces(f, meta, tensors)
            except RuntimeError:
                if f.error is not None:  # a full disk is an OSError, whoever wrote
                    raise f.error from None
                raise
            f.flush()
            os.fsync(raw.fileno())
        sums[DATA] = {"bytes": (folder / DATA).stat().st_size, "sha256": f.sha.hexdigest()}
        path = write_metadata(folder, [(DATA, pieces)])
        sums[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
        body = json.dumps(meta, separators=(",", ":")).encode()
        with open(folder / MANIFEST, "xb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        sums[MANIFEST] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        return sums

    @staticmethod
    def _pieces(f, meta: dict, tensors: dict) -> list[list]:
        """Every bucket's segments of its weights and states, and torch's step of each parameter whose
        first segment this node holds, into ``f``; returns the DCP entries of them."""
        specs = [(b, Bucket.from_wire(b["spec"])) for b in meta["buckets"]]
        keys = param_keys(meta["param_names"], (s.param for _, sp in specs for s in sp.segments))
        extent: dict[int, int] = {}
        for _, spec in specs:
            for s in spec.segments:
                extent[s.param] = max(extent.get(s.param, 0), s.param_offset + s.numel)
        step_kept = meta.get("step_in_state", True)
        out = []
        for saved, spec in specs:
            flats = tensors[saved["id"]]
            for si, s in enumerate(spec.segments):
                name, size = keys[s.param], [extent[s.param]]
                for state in ("params", *saved["states"]):
                    key = MODEL + name if state == "params" else f"{OPTIM_STATE}{name}.{state}"
                    at, n = save_tensor(f, flats[state].narrow(0, s.offset, s.numel))
                    out.append([key, size, [s.param_offset], [s.numel], at, n])
                step = saved["steps"][si]
                if step_kept and s.param_offset == 0 and step > 0:
                    at, n = save_tensor(f, torch.tensor(step, dtype=torch.float32))
                    out.append([f"{OPTIM_STATE}{name}.step", [], [], [], at, n])
        return out

    # ----------------------------------------------------------------- reading
    def load(self, path: Path) -> Checkpoint:
        """The checkpoint in ``path``; raises :class:`CorruptCheckpointError` for one that cannot be read
        whole, whatever goes wrong while reading it (``OSError``: it could not be opened or read)."""
        try:
            if path.name.endswith(legacy_checkpoint.SUFFIX):
                meta, tensors = legacy_checkpoint.read(path)
                return Checkpoint(path, int(meta["step"]), meta, tensors, legacy=True)
            return self._load(path)
        except (CorruptCheckpointError, OSError):
            raise
        except Exception as exc:  # noqa: BLE001  (a crafted or damaged manifest: RecursionError, KeyError...)
            raise CorruptCheckpointError(
                f"{path}: unreadable ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None

    def _load(self, path: Path) -> Checkpoint:
        """Verify the small files, read the tensors while another thread hashes the tensor file (hashlib
        releases the GIL: the check costs no time of its own), then compare."""
        sizes, pending = self._verify(path)
        with ThreadPoolExecutor(1) as pool:
            hashes = {name: pool.submit(_sha256, path / name) for name in pending}

            def check() -> None:
                for name, want in pending.items():
                    if hashes[name].result() != want:
                        raise CorruptCheckpointError(
                            f"{path}: {name} does not match its checksum (altered or truncated)"
                        )

            try:
                ckpt = self._read(path, sizes)
            except Exception:
                check()  # a damaged file is reported as such, not as what reading it ran into
                raise
            check()
        return ckpt

    def _read(self, path: Path, sizes: dict[str, int]) -> Checkpoint:
        meta = json.loads((path / MANIFEST).read_bytes())
        folder = DcpFolder(path, f"node {self.node}: checkpoint {path}")
        for info in folder.metadata.storage_data.values():
            if str(info.relative_path) not in sizes:
                raise CorruptCheckpointError(f"{path}: {info.relative_path} is not in {CHECKSUMS}")
        names = meta["state_names"]
        specs = [(b, Bucket.from_wire(b["spec"])) for b in meta["buckets"]]
        need = sum(sp.numel * 4 * (1 + len(b["states"])) for b, sp in specs)
        if need > sum(sizes.values()) or not all(
            set(b["states"]) <= set(names) and len(b["steps"]) == len(sp.segments)
            for b, sp in specs
        ):
            raise CorruptCheckpointError(f"{path}: its manifest does not describe its files")
        keys = param_keys(meta["param_names"], (s.param for _, sp in specs for s in sp.segments))
        tensors, wants = {}, {}
        for saved, spec in specs:  # every size checked above: allocate, then read
            flats = {
                n: torch.empty(spec.numel, dtype=torch.float32)
                for n in ("params", *saved["states"])
            }
            for s in spec.segments:
                for n, flat in flats.items():
                    key = (
                        MODEL + keys[s.param]
                        if n == "params"
                        else f"{OPTIM_STATE}{keys[s.param]}.{n}"
                    )
                    wants.setdefault(key, []).append(
                        ((s.param_offset,), flat.narrow(0, s.offset, s.numel))
                    )
            zero = torch.zeros(1, dtype=torch.float32).expand(
                spec.numel
            )  # state never used: not allocated
            states = [flats.get(n, zero) for n in names]
            steps = torch.tensor([float(x) for x in saved["steps"]], dtype=torch.float32)
            tensors[saved["id"]] = [flats["params"], *states, steps]
        folder.read(wants)
        return Checkpoint(path, int(meta["step"]), meta, tensors)

    @staticmethod
    def _verify(path: Path) -> tuple[dict[str, int], dict[str, str]]:
        """Check that every file ``luwu_sha256.json`` lists is there with its size, and the sha256 of
        all but the tensor file; returns name -> size and the sha256 still to check (the tensor file's)."""
        listed = json.loads((path / CHECKSUMS).read_bytes())["files"]
        for required in (DATA, ".metadata", MANIFEST):
            if required not in listed:
                raise CorruptCheckpointError(f"{path}: {CHECKSUMS} does not list {required}")
        sizes, pending = {}, {}
        for name, want in listed.items():
            file = path / name
            if Path(name).name != name or not file.is_file():
                raise CorruptCheckpointError(f"{path}: {name} is missing")
            size = file.stat().st_size
            if size != want["bytes"]:
                raise CorruptCheckpointError(
                    f"{path}: {name} does not match its checksum (truncated or extended)"
                )
            if name == DATA:
                pending[name] = str(want["sha256"])
            elif _sha256(file) != want["sha256"]:
                raise CorruptCheckpointError(
                    f"{path}: {name} does not match its checksum (altered)"
                )
            sizes[name] = size
        return sizes, pending

    def candidates(self, at_step: int | None = None):
        """The checkpoints that read whole, newest first (at exactly ``at_step`` if given); corrupt ones are
        skipped and logged. A caller that cannot use one takes the next."""
        for step, path in reversed(self.list()):
            if at_step is not None and step != at_step:
                continue
            try:
                ckpt = self.load(path)
            except (CorruptCheckpointError, OSError) as exc:
                log.error("skipping checkpoint %s: %s", path, exc)
                continue
            yield ckpt

    def used(self, ckpt: Checkpoint) -> None:
        """``ckpt`` is the state the node holds now (the last checkpoint's step and time)."""
        self.last_step, self.last_time = ckpt.step, ckpt.path.stat().st_mtime

    def latest(self, at_step: int | None = None) -> Checkpoint | None:
        """The newest valid checkpoint (at exactly ``at_step`` if given); corrupt ones are skipped."""
        for ckpt in self.candidates(at_step):
            self.used(ckpt)
            return ckpt
        return None
