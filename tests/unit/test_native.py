"""The fused C kernels of the blockwise codecs against their torch path: the same bits, always.

A node and its workers may run different paths (one host without a C compiler); the int8 pull
deltas need the node's shadow and every worker's copy to agree bit for bit, so "close" is not
enough here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from luwu.protocol import native
from luwu.protocol.codecs import get_codec
from luwu.protocol.feedback import DeltaEncoder, ErrorFeedback

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def path(monkeypatch):
    """use(True/False): switch between the kernels and the torch path (LUWU_NATIVE)."""

    def use(on: bool) -> None:
        monkeypatch.setenv("LUWU_NATIVE", "1" if on else "0")
        native.reset()
        if on:
            assert native.kernels() is not None, f"the kernels did not load: {native.reason}"
        else:
            assert native.kernels() is None and native.reason == "LUWU_NATIVE=0"

    yield use
    monkeypatch.delenv("LUWU_NATIVE")
    native.reset()


def test_kernels_build_where_a_compiler_is():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the torch path is used (and tested below)")
    native.reset()
    assert native.kernels() is not None, native.reason


def _run_both(path, fn):
    path(False)
    a = fn()
    path(True)
    b = fn()
    return a, b


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize(
    "name,block",
    [("int8", 256), ("int8", 64), ("int8", 1), ("int4", 64), ("int4", 2), ("int4", 256)],
)
@pytest.mark.parametrize("n", [1, 7, 255, 256, 1000, (1 << 19) + 77])
def test_same_bits_as_torch(path, name, block, n):
    codec = get_codec(name, block=block)
    g = torch.Generator().manual_seed(n + block)
    # magnitudes over 6 decades, exact zeros and an all-zero block, ties of the rounding
    x = torch.randn(n, generator=g) * torch.logspace(-4, 2, n)
    x[: min(n, block)] = 0.0
    x[n // 2 :: 97] = 0.5
    r0 = torch.randn(n, generator=g) * 1e-2
    acc0 = torch.randn(n, generator=g)

    def run():
        r = r0.clone()
        ef = codec.encode_feedback_(x, r)
        plain = codec.encode(x)
        meta = plain.meta
        added = acc0.clone()
        codec.decode_add_(added, ef.frames, meta, alpha=0.37)
        over = torch.full((n,), 5.0)
        codec.decode_(over, ef.frames, meta, alpha=-0.25)
        pair = torch.full((n,), 5.0)
        codec.decode_pair_(pair, (ef.frames, meta), (plain.frames, meta), 1 / 3)
        return [*ef.frames, r, *plain.frames, added, over, pair]

    a, b = _run_both(path, run)
    for i, (u, v) in enumerate(zip(a, b)):
        assert _same(u, v), (
            f"{name} block {block} n {n}: output {i} differs between the kernels and torch"
        )


def test_delta_shadow_matches_a_worker_on_the_other_path(path):
    """The node encodes pull deltas with the kernels; a worker without them decodes with torch."""
    n = 300_001
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, generator=g)
    path(True)
    enc = DeltaEncoder("int8")
    replies = []
    for step in range(6):  # a full reply, then deltas
        if step:
            w.add_(torch.randn(n, generator=g) * 1e-3)
        r = enc.encode("b", w, step)
        replies.append((r.codec, r.delta, [f.clone() for f in r.encoded.frames], r.encoded.meta))
    assert [r[1] for r in replies] == [False] + [True] * 5
    shadow = enc.shadow("b").clone()
    path(False)
    copy = torch.empty(n)
    for codec, delta, frames, meta in replies:
        c = get_codec(codec)
        (c.decode_add_ if delta else c.decode_)(copy, frames, meta)
    assert _same(copy, shadow)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_nonfinite_blocks_decode_nonfinite(path, name):
    codec = get_codec(name)
    n = 4 * codec.block
    x = torch.randn(n)
    x[3] = float("nan")
    x[codec.block + 5] = float("inf")
    for on in (False, True):
        path(on)
        enc = codec.encode(x)
        out = torch.zeros(n)
        codec.decode_add_(out, enc.frames, enc.meta)
        assert not out[: 2 * codec.block].isfinite().any(), (
            f"native={on}: a NaN/inf block must decode non-finite"
        )
        assert out[2 * codec.block :].isfinite().all()


def test_short_frames_never_reach_the_kernels(path):
    """A frame shorter than its element count (validate() would refuse it first) raises, as on the torch
    path, instead of being read past its end by address."""
    path(True)
    codec = get_codec("int8")
    enc = codec.encode(torch.randn(1024))
    short = [enc.frames[0][:100], enc.frames[1]]
    with pytest.raises(RuntimeError):
        codec.decode_add_(torch.zeros(1024), short, enc.meta)


def test_no_compiler_leaves_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LUWU_CACHE_DIR", str(tmp_path / "cache"))
    native.reset()
    try:
        assert native.kernels() is None
        assert "no-such-cc" in native.reason
        codec = get_codec("int8")
        x = torch.randn(5000)
        out = torch.zeros(5000)
        enc = codec.encode(x)
        codec.decode_add_(out, enc.frames, enc.meta)
        assert (out - x).abs().max() <= x.abs().max() / 254 * 1.01
    finally:
        monkeypatch.delenv("CC")
        native.reset()


def test_builds_once_into_the_cache(monkeypatch, tmp_path):
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    monkeypatch.setenv("LUWU_CACHE_DIR", str(tmp_path))
    native.reset()
    try:
        assert native.kernels() is not None, native.reason
        libs = list(tmp_path.glob("blockquant-*.so"))
        assert len(libs) == 1 and not list(tmp_path.glob(".blockquant-*"))
        stamp = libs[0].stat().st_mtime_ns
        native.reset()
        assert native.kernels() is not None
        assert (
            list(tmp_path.glob("blockquant-*.so")) == libs and libs[0].stat().st_mtime_ns == stamp
        )
    finally:
        native.reset()


def test_what_the_kernels_cannot_take_goes_the_torch_way(path):
    """A bf16 accumulator or a non-contiguous one is never written by address as fp32."""
    path(True)
    codec = get_codec("int8")
    x = torch.randn(4096)
    enc = codec.encode(x)
    ref = torch.zeros(4096)
    codec.decode_add_(ref, enc.frames, enc.meta)
    half = torch.zeros(4096, dtype=torch.bfloat16)
    codec.decode_add_(half, enc.frames, enc.meta)
    assert torch.equal(half, ref.to(torch.bfloat16))
    strided = torch.zeros(4096, 2)[:, 0]  # every other element
    codec.decode_add_(strided, enc.frames, enc.meta)
    assert torch.equal(strided, ref)


def _planted_library(folder, marker, key_name):
    """A library whose constructor writes ``marker``: what another user could plant in a shared cache."""
    src = folder.parent / "planted.c"
    src.write_text(
        f'#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
    )
    subprocess.run(
        [
            shutil.which("cc") or shutil.which("gcc"),
            "-shared",
            "-fPIC",
            "-o",
            str(folder / key_name),
            str(src),
        ],
        check=True,
        timeout=60,
    )


@pytest.mark.parametrize("how", ["folder open to others", "library owned by another user"])
def test_a_planted_library_is_never_loaded(monkeypatch, tmp_path, how):
    """Only a folder and a library owned by this user alone are trusted: a library another user planted
    (world-writable cache, or a file they own) is ignored and the kernels are built in a private folder."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    if how == "library owned by another user" and os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    cache.mkdir(mode=0o700)
    tmp.mkdir()
    monkeypatch.setenv("LUWU_CACHE_DIR", str(cache))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    native.reset()
    try:
        assert native.kernels() is not None, (
            native.reason
        )  # learn the library's name, then plant over it
        name = next(cache.glob("blockquant-*.so")).name
        for p in cache.glob("blockquant-*.so"):
            p.unlink()
        marker = tmp_path / "planted-ran"
        for folder in (cache, tmp / f"luwu-{os.getuid()}"):
            folder.mkdir(exist_ok=True)
            _planted_library(folder, marker, name)
            if how == "folder open to others":
                os.chmod(folder, 0o777)
            else:
                os.chown(folder / name, 65534, 65534)
        native.reset()
        assert native.kernels() is not None, native.reason
        assert not marker.exists(), "a library planted by someone else was loaded"
        codec = get_codec("int8")  # and the kernels built privately still work
        x, out = torch.randn(4096), torch.zeros(4096)
        enc = codec.encode(x)
        codec.decode_add_(out, enc.frames, enc.meta)
        assert (out - x).abs().max() <= x.abs().max() / 254 * 1.01
    finally:
        native.reset()


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_bf16_residual_in_one_pass_gives_the_widened_paths_bits(path, name):
    """compression.residual_dtype = "bfloat16": the kernel reads and rounds the bf16 residual itself
    (no fp32 scratch, one pass); the frames and the residual equal, bit for bit, the torch path that
    widens the residual, encodes with it and rounds it back. Odd tails, huge and tiny values, zeros."""
    g = torch.Generator().manual_seed(5)
    n = 3 * 1024 + 7
    xs = [torch.randn(n, generator=g) * 10.0 ** (k % 5 - 2) for k in range(6)]
    xs[2][:100] = 0.0
    xs[3][7] = 3e38  # near fp32's largest: the rest of its block quantizes to zero codes
    runs = {}
    for on in (True, False):
        path(on)
        codec = get_codec(name)
        ef = ErrorFeedback(torch.bfloat16)
        assert codec.takes_bf16_residual(xs[0]) is on
        frames = []
        for x in xs:
            enc = ef.encode("b", codec, x)
            frames.append([f.clone() for f in enc.frames])
        runs[on] = frames, ef.residual("b").clone(), ef.nbytes
    (fused, r_fused, nbytes_fused), (torch_path, r_torch, nbytes_torch) = runs[True], runs[False]
    for a, b in zip(fused, torch_path, strict=True):
        for fa, fb in zip(a, b, strict=True):
            assert torch.equal(fa.view(torch.uint8), fb.view(torch.uint8))
    assert torch.equal(r_fused.view(torch.int16), r_torch.view(torch.int16))
    assert nbytes_fused == 2 * n and nbytes_torch == 2 * n + 4 * n  # no fp32 scratch
