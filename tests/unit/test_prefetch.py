"""The Prefetcher: order, nested batches, loader errors, shutdown, resume, budgets, metrics."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import random
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict, namedtuple

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import DataLoader, Dataset

from luwu.gpu_workers.batches import batch_nbytes
from luwu.gpu_workers.batches import map_tensors as _map_tensors
from luwu.gpu_workers.config import PrefetchConfig
from luwu.gpu_workers.prefetch import Prefetcher
from luwu.protocol.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

Pair = namedtuple("Pair", "x y")


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("luwu-prefetch")]


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = set(threading.enumerate())
    yield
    # A DataLoader's queue feeder threads exit shortly after its workers stop: allow a moment.
    assert wait_until(lambda: set(threading.enumerate()) <= before, 5.0), (
        set(threading.enumerate()) - before
    )


class Counting:
    """A re-iterable source that counts the batches pulled from it (to see how far ahead a producer got)."""

    def __init__(self, n: int | None = 20, numel: int = 4, delay_s: float = 0.0):
        self.n, self.numel, self.delay_s = n, numel, delay_s
        self.pulled = 0
        self.finished = 0  # generators closed (finally ran)

    def __len__(self) -> int:
        assert self.n is not None
        return self.n

    def __iter__(self):
        try:
            i = 0
            while self.n is None or i < self.n:
                if self.delay_s:
                    time.sleep(self.delay_s)
                self.pulled += 1
                yield torch.full((self.numel,), float(i))
                i += 1
        finally:
            self.finished += 1


class StatefulRange:
    """A source with its own position, like a sampler-aware loader (torchdata's StatefulDataLoader)."""

    def __init__(self, n: int):
        self.n = n
        self.pos = 0  # batches yielded in the current pass
        self.pulled = 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            self.pulled += 1
            yield torch.tensor(self.pos - 1)
        self.pos = 0  # the next pass starts over

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def values(batches) -> list[int]:
    return [int(b.flatten()[0]) for b in batches]


# ---------------------------------------------------------------- order and batches


class JitteryCopy:
    """Stands in for the pin + device copy (no GPU here): it releases the GIL for a varying
    time after the fetch, so with several threads later batches are often ready first."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def __call__(self, batch):
        time.sleep(self.rng.choice([0.0, 0.0, 0.001, 0.003]))
        return batch, None


@pytest.mark.parametrize("num_threads", [1, 4])
def test_order_is_the_source_order(num_threads):
    source = [{"x": torch.full((2,), float(i)), "parts": [torch.zeros(i % 7)]} for i in range(200)]
    pf = Prefetcher(source, depth=8, num_threads=num_threads)
    pf._transfer = JitteryCopy(seed=num_threads)
    out = list(pf)
    assert len(out) == len(source)
    assert all(o is s for o, s in zip(out, source))


def test_nested_batches_pass_unchanged_and_are_sized():
    batch = {
        "image": torch.zeros(2, 3, dtype=torch.float32),  # 24 bytes
        "parts": [
            torch.zeros(5, dtype=torch.int64),
            (torch.zeros(3, dtype=torch.uint8), "tag"),
        ],  # 40 + 3
        "pair": Pair(torch.zeros(1, dtype=torch.float16), np.zeros(4, dtype=np.int32)),  # 2 + 16
        "meta": {"id": 7, "name": "x"},
    }
    assert batch_nbytes(batch) == 24 + 40 + 3 + 2 + 16
    out = list(Prefetcher([batch, batch]))
    assert len(out) == 2 and out[0] is batch and out[1] is batch


def test_device_copy_rebuilds_containers_with_their_types():
    # The function the CUDA and pinning paths map batches through.
    d = defaultdict(list, {"a": torch.ones(2)})
    batch = (d, Pair(torch.ones(1), [torch.zeros(2), "s"]), 3)
    out = _map_tensors(batch, lambda t: t * 2)
    assert type(out) is tuple and type(out[0]) is defaultdict and out[0].default_factory is list
    assert type(out[1]) is Pair and out[1].y[1] == "s" and out[2] == 3
    assert torch.equal(out[0]["a"], torch.full((2,), 2.0)) and torch.equal(
        out[1].x, torch.full((1,), 2.0)
    )
    assert torch.equal(batch[0]["a"], torch.ones(2))  # the input is untouched


# ---------------------------------------------------------------- loader errors


RAISED: list[BaseException] = []


def _decode_record(index: int):
    error = OSError(f"corrupt record {index}")
    RAISED.append(error)
    raise error


class Broken:
    def __init__(self, n_ok: int):
        self.n_ok = n_ok

    def __iter__(self):
        for i in range(self.n_ok):
            yield torch.tensor(i)
        yield _decode_record(self.n_ok)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_loader_error_reaches_the_loop_as_the_same_object_with_its_traceback(num_threads):
    RAISED.clear()
    got = []
    with pytest.raises(OSError, match="corrupt record 5") as info:
        for batch in Prefetcher(Broken(5), depth=2, num_threads=num_threads):
            got.append(int(batch))
    assert got == [0, 1, 2, 3, 4]
    assert info.value is RAISED[0]
    frames = traceback.extract_tb(info.value.__traceback__)
    assert [f.name for f in frames][-2:] == ["__iter__", "_decode_record"]
    assert frames[-1].line == "raise error"
    assert not prefetch_threads()


def test_loader_error_on_a_resumed_pass_while_skipping_is_raised():
    RAISED.clear()
    pf = Prefetcher(Broken(2))
    pf.load_state_dict({"epoch": 0, "batches_consumed": 4})
    with pytest.raises(OSError):
        next(iter(pf))
    assert RAISED


# ---------------------------------------------------------------- shutdown


def test_break_stops_the_threads_and_closes_the_source():
    source = Counting(n=None)  # endless: threads would wait forever if not stopped
    pf = Prefetcher(source, depth=3)
    for batch in pf:
        if int(batch[0]) == 4:
            break
    assert not prefetch_threads()
    assert source.finished == 1  # our iterator was closed, the generator's finally ran
    assert source.pulled <= 5 + 3


def _train_until_failure(pf):
    for batch in pf:
        if int(batch[0]) == 2:
            raise RuntimeError("loss is nan")


def test_exception_in_the_training_loop_stops_the_threads():
    source = Counting(n=None)
    with pytest.raises(RuntimeError, match="nan"):
        _train_until_failure(Prefetcher(source, depth=2))
    assert not prefetch_threads()
    assert source.finished == 1


def test_dropping_the_iterator_stops_the_threads():
    source = Counting(n=None)
    pf = Prefetcher(source, depth=2)
    it = iter(pf)
    next(it)
    assert wait_until(lambda: len(prefetch_threads()) == 1)
    del it  # the last reference: collected at once, which closes the pass
    assert not prefetch_threads()
    assert source.finished == 1


def test_close_and_context_manager_stop_the_pass():
    source = Counting(n=None)
    with Prefetcher(source, depth=2, num_threads=2) as pf:
        it = iter(pf)
        assert int(next(it)[0]) == 0
        assert len(prefetch_threads()) == 2
    assert not prefetch_threads()
    with pytest.raises(StopIteration):
        next(it)
    assert int(next(iter(pf))[0]) == 0  # a closed Prefetcher can start a new pass
    pf.close()


def test_a_new_pass_closes_the_previous_one():
    pf = Prefetcher(Counting(n=None))
    first = iter(pf)
    next(first)
    second = iter(pf)
    assert len(prefetch_threads()) == 1
    with pytest.raises(StopIteration):
        next(first)
    assert int(next(second)[0]) == 0
    pf.close()


EXIT_SCRIPT = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from luwu.gpu_workers.prefetch import Prefetcher

class Endless:
    def __iter__(self):
        i = 0
        while True:
            yield torch.tensor(i)
            i += 1

running = iter(Prefetcher(Endless(), depth=2))
next(running)
loading = iter(Prefetcher(DataLoader(TensorDataset(torch.arange(64)), batch_size=4, num_workers=2)))
next(loading)
print("exiting", flush=True)
"""


@pytest.mark.timeout(60)
def test_the_interpreter_exits_cleanly_with_passes_still_running():
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=45
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "exiting\n"
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


class Blocking:
    """A source whose next() blocks until released, like a loader stuck on I/O."""

    def __init__(self):
        self.release = threading.Event()

    def __iter__(self):
        yield torch.tensor(0)
        self.release.wait(10)
        yield torch.tensor(1)


def test_close_does_not_hang_on_a_source_stuck_in_next(caplog):
    source = Blocking()
    pf = Prefetcher(source, shutdown_timeout_s=0.1)
    it = iter(pf)
    next(it)
    with caplog.at_level(logging.WARNING, logger="luwu.gpu_workers.prefetch"):
        start = time.monotonic()
        pf.close()
    assert time.monotonic() - start < 2
    assert "still inside the source's next()" in caplog.text
    source.release.set()  # the stuck thread finishes its next() and exits on its own
    assert wait_until(lambda: not prefetch_threads())


def test_timeout_names_the_loader_and_batch():
    source = Blocking()
    pf = Prefetcher(source, timeout_s=0.2, name="val")
    it = iter(pf)
    next(it)
    with pytest.raises(TimeoutError, match=r"prefetch val: no batch 1 .*0\.2 s"):
        next(it)
    source.release.set()
    assert int(next(it)) == 1  # the pass is still usable once the loader catches up
    pf.close()


# ---------------------------------------------------------------- resume


def test_resume_continues_with_the_next_unseen_batch():
    source = Counting(20)
    pf = Prefetcher(source, depth=4)
    it = iter(pf)
    consumed = [next(it) for _ in range(7)]
    assert wait_until(
        lambda: source.pulled == 7 + 4
    )  # fetched ahead, not consumed: not in the state
    state = pf.state_dict()
    assert state == {"epoch": 0, "batches_consumed": 7}
    pf.close()

    fresh = list(Counting(20))
    resumed = Prefetcher(Counting(20), depth=4)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert torch.equal(rest[0], fresh[7])
    assert values(consumed + rest) == values(fresh)
    assert resumed.state_dict() == {"epoch": 1, "batches_consumed": 0}
    assert values(resumed) == values(fresh)  # the next pass is a whole new epoch


def test_resume_across_epochs_and_after_leaving_a_pass_early():
    pf = Prefetcher(Counting(6))
    assert len(list(pf)) == 6
    it = iter(pf)
    next(it), next(it)
    assert pf.state_dict() == {"epoch": 1, "batches_consumed": 2}
    del it
    assert pf.state_dict() == {"epoch": 1, "batches_consumed": 2}  # a crash handler saves this
    assert pf.epoch == 1
    assert values(pf) == list(range(6))  # but iterating again starts a new epoch, like a DataLoader
    assert pf.state_dict() == {"epoch": 3, "batches_consumed": 0}


def test_resume_with_a_stateful_source_restores_its_state_instead_of_skipping():
    source = StatefulRange(12)
    pf = Prefetcher(source, depth=4)
    it = iter(pf)
    assert values([next(it) for _ in range(3)]) == [0, 1, 2]
    assert wait_until(lambda: source.pos == 3 + 4)  # the source itself is ahead
    state = pf.state_dict()
    assert state == {"epoch": 0, "batches_consumed": 3, "source": {"pos": 3}}
    pf.close()

    restarted = StatefulRange(12)
    resumed = Prefetcher(restarted, depth=4)
    resumed.load_state_dict(state)
    assert values(resumed) == list(range(3, 12))
    assert restarted.pulled == 9  # nothing re-read
    assert resumed.state_dict() == {"epoch": 1, "batches_consumed": 0, "source": {"pos": 0}}


def test_load_state_dict_refuses_bad_state():
    pf = Prefetcher(Counting(4))
    with pytest.raises(ValueError, match="batches_consumed.*-1"):
        pf.load_state_dict({"epoch": 0, "batches_consumed": -1})
    with pytest.raises(ValueError, match="unknown keys"):
        pf.load_state_dict({"epoch": 0, "batches_consumed": 0, "step": 3})
    with pytest.raises(ValueError, match="no load_state_dict"):
        pf.load_state_dict({"epoch": 0, "batches_consumed": 1, "source": {"pos": 1}})


# ---------------------------------------------------------------- bounds


def test_byte_budget_bounds_how_far_ahead_the_producer_gets():
    source = Counting(n=None, numel=256)  # 1 KiB per batch
    pf = Prefetcher(source, depth=50, max_bytes=3 * 1024)
    it = iter(pf)
    depth = "luwu_prefetch_queue_depth_batches"
    labels = {"loader": "train"}
    assert wait_until(lambda: pf.registry.get_sample_value(depth, labels) == 3)
    time.sleep(0.2)  # without the budget it would run on towards depth=50
    assert source.pulled == 3
    assert pf.registry.get_sample_value("luwu_prefetch_queue_bytes", labels) == 3 * 1024
    next(it)
    assert wait_until(lambda: source.pulled == 4)
    time.sleep(0.1)
    assert source.pulled == 4
    pf.close()


def test_a_batch_larger_than_the_budget_still_flows_one_at_a_time():
    source = Counting(8, numel=1024)
    got, ahead = [], []
    for batch in Prefetcher(source, depth=4, max_bytes=100):
        got.append(int(batch[0]))
        time.sleep(0.01)
        ahead.append(source.pulled - len(got))  # batches pulled ahead of the loop
    assert got == list(range(8))
    assert max(ahead) <= 1  # depth alone would allow 4


def test_depth_bounds_how_far_ahead_the_producer_gets():
    source = Counting(n=None)
    pf = Prefetcher(source, depth=2)
    it = iter(pf)
    assert wait_until(lambda: source.pulled == 2)
    time.sleep(0.2)
    assert source.pulled == 2
    for consumed in range(1, 6):
        next(it)
        assert wait_until(lambda consumed=consumed: source.pulled == consumed + 2)
    pf.close()


# ---------------------------------------------------------------- len and epochs


def test_len_and_epochs_follow_the_wrapped_iterable():
    source = Counting(5)
    pf = Prefetcher(source)
    assert len(pf) == 5
    assert values(pf) == values(pf) == list(range(5))
    assert pf.epoch == 2
    with pytest.raises(TypeError):
        len(Prefetcher(iter([1, 2])))
    once = Prefetcher(
        x for x in [torch.tensor(1), torch.tensor(2)]
    )  # a one-shot iterator: one epoch only
    assert values(once) == [1, 2] and list(once) == []


class Squares(Dataset):
    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise ValueError(f"cannot decode sample {i}")
        return {"x": torch.tensor([i, i * i]), "i": i}


@pytest.mark.timeout(60)
def test_dataloader_with_two_workers():
    loader = DataLoader(Squares(40), batch_size=4, num_workers=2)
    expected = list(loader)
    pf = Prefetcher(loader, depth=3)
    assert len(pf) == 10
    out = list(pf)
    assert len(out) == 10
    assert all(
        torch.equal(o["x"], e["x"]) and torch.equal(o["i"], e["i"]) for o, e in zip(out, expected)
    )

    for _batch in pf:  # leaving early shuts the loader's worker processes down too
        break
    assert not prefetch_threads()
    assert wait_until(lambda: not multiprocessing.active_children())


@pytest.mark.timeout(60)
def test_dataloader_worker_error_reaches_the_loop():
    pf = Prefetcher(DataLoader(Squares(40, fail_at=13), batch_size=4, num_workers=2))
    seen = []
    with pytest.raises(ValueError, match="cannot decode sample 13") as info:
        for batch in pf:
            seen.append(int(batch["i"][0]))
    assert seen == [0, 4, 8]
    assert not prefetch_threads()
    # The traceback still holds the DataLoader iterator, but its workers are stopped already.
    assert info.value is not None and not multiprocessing.active_children()


@pytest.mark.timeout(60)
def test_dataloader_with_persistent_workers_keeps_them_across_passes():
    loader = DataLoader(Squares(16), batch_size=4, num_workers=2, persistent_workers=True)
    pf = Prefetcher(loader)
    for _batch in pf:
        break
    workers = multiprocessing.active_children()
    assert len(workers) == 2
    assert [int(b["i"][0]) for b in pf] == [0, 4, 8, 12]
    assert multiprocessing.active_children() == workers
    del pf, loader
    gc.collect()


# ---------------------------------------------------------------- metrics


def test_metrics_count_batches_and_waits():
    registry = CollectorRegistry()
    pf = Prefetcher(Counting(10), depth=3, registry=registry, name="val")
    labels = {"loader": "val"}
    assert len(list(pf)) == 10
    assert registry.get_sample_value("luwu_prefetch_batches_produced_total", labels) == 10
    assert registry.get_sample_value("luwu_prefetch_batches_consumed_total", labels) == 10
    assert registry.get_sample_value("luwu_prefetch_data_wait_seconds_count", labels) == 10
    assert registry.get_sample_value("luwu_prefetch_queue_depth_batches", labels) == 0
    assert pf.last_wait_s >= 0

    other = Prefetcher(Counting(4), registry=registry, name="train")  # two loaders, one registry
    list(other)
    assert (
        registry.get_sample_value("luwu_prefetch_batches_consumed_total", {"loader": "train"}) == 4
    )
    assert registry.get_sample_value("luwu_prefetch_batches_consumed_total", labels) == 10


def test_stall_fraction_separates_a_slow_loader_from_a_slow_step():
    slow_loader = Prefetcher(Counting(12, delay_s=0.02), depth=2)
    list(slow_loader)
    stall = slow_loader.registry.get_sample_value(
        "luwu_prefetch_stall_fraction", {"loader": "train"}
    )
    assert stall == pytest.approx(slow_loader.stall_fraction) and stall > 0.5
    assert slow_loader.last_wait_s > 0.005

    slow_step = Prefetcher(Counting(12), depth=4)
    for _ in slow_step:
        time.sleep(0.02)  # the training step
    assert slow_step.stall_fraction < 0.5


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("depth", 0),
        ("depth", 2.5),
        ("max_bytes", 0),
        ("num_threads", 0),
        ("num_threads", 3),  # more than depth=2
        ("pin_memory", "yes"),
        ("device", "gpu7"),
        ("timeout_s", 0),
        ("timeout_s", float("inf")),
        ("shutdown_timeout_s", -1.0),
        ("name", ""),
    ],
)
def test_config_refuses_bad_values_naming_field_and_value(field, value):
    with pytest.raises(ConfigError, match=rf"prefetch\.{field} .*{value!r}"):
        PrefetchConfig(**{field: value})


def test_from_config_builds_the_same_prefetcher():
    cfg = PrefetchConfig(depth=3, max_bytes=1 << 20, num_threads=2, name="val")
    pf = Prefetcher.from_config(Counting(5), cfg)
    assert pf.config == cfg
    assert (
        Prefetcher(Counting(5), depth=3, max_bytes=1 << 20, num_threads=2, name="val").config == cfg
    )
    assert values(pf) == list(range(5))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_cuda_settings_without_cuda_are_refused():
    with pytest.raises(ConfigError, match="prefetch.device='cuda' needs CUDA"):
        Prefetcher([1], device="cuda")
    with pytest.raises(ConfigError, match="prefetch.pin_memory=True needs CUDA"):
        Prefetcher([1], pin_memory=True)
    assert Prefetcher([torch.ones(1)], device="cpu")._transfer is None  # cpu: nothing to copy
