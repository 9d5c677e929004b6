"""A rank gives glibc's free heap pages back once a period (issue 48: a rank's resident memory
grew with the steps while the bytes in use did not; train/heap.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from charllm_nemo.train.heap import HeapTrim, libc_malloc_trim


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_it_trims_once_a_period_between_steps() -> None:
    clock, pads = Clock(), []
    heap = HeapTrim(60.0, trim=lambda pad: pads.append(pad) or 1, clock=clock)
    assert heap.available
    assert not heap.after_step()  # the first period has not passed
    clock.now += 59.9
    assert not heap.after_step()
    clock.now += 0.2
    assert heap.after_step() and pads == [0]
    for _ in range(1000):  # a thousand fast steps within the next period: no trim
        clock.now += 0.05
        assert not heap.after_step()
    clock.now += 10.1
    assert heap.after_step()
    assert (heap.calls, pads) == (2, [0, 0])
    assert heap.seconds >= 0.0


def test_without_malloc_trim_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("charllm_nemo.train.heap.libc_malloc_trim", lambda: None)
    clock = Clock()
    heap = HeapTrim(1.0, clock=clock)
    clock.now += 10
    assert not heap.available
    assert not heap.after_step()
    assert heap.calls == 0


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(libc_malloc_trim() is None, reason="no glibc malloc_trim here")
def test_on_glibc_a_trim_gives_back_the_free_pages_of_a_fragmented_heap() -> None:
    """Blocks of 16 KiB (in the heap, below the mmap threshold), touched, then all but every
    16th freed: the holes hold whole free pages that stay resident (free() trims only the heap's
    top, which a kept block holds) until the trim."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 16 * 1024, 2048  # 32 MiB
    blocks = [libc.malloc(size) for _ in range(count)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, size)
    kept = blocks[15::16]
    try:
        for i, b in enumerate(blocks):
            if i % 16 != 15:
                libc.free(b)
        freed = size * (count - len(kept))
        before = _rss_anon()
        clock = Clock()
        heap = HeapTrim(1.0, clock=clock)
        clock.now += 1.0
        assert heap.after_step()
        after = _rss_anon()
        assert before - after > freed // 2, (before, after, freed)
    finally:
        for b in kept:
            libc.free(b)
