"""The KV page allocator as Python sees it: ``specdial._core.KvPagePool``, ``Int64Array`` and
``KvError``. Slot arrays must reach numpy/torch without a copy; every error must say what was
wrong and leave the pool unchanged; freeing every request must return every page."""

from __future__ import annotations

import ctypes
import gc
import random
import warnings

import numpy as np
import pytest

from specdial._core import Int64Array, KvError, KvPagePool


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def state(pool: KvPagePool, ids) -> tuple:
    """Everything observable about the pool, to check that errors change nothing."""
    tables = []
    for rid in ids:
        if rid in pool:
            n = pool.len_of(rid)
            tables.append((rid, n, pool.slots(rid, 0, n).tolist(), pool.page_table(rid).tolist()))
    return (pool.num_free_pages(), pool.num_used_pages(), pool.num_requests(), tables)


# ---------------------------------------------------------------- round trip and zero copy


def test_reserve_and_slots_round_trip_through_numpy_zero_copy():
    pool = KvPagePool(8, 4)
    pool.add_request(1)
    arr = pool.reserve(1, 6)
    assert isinstance(arr, Int64Array)
    assert len(arr) == 6
    view = np.asarray(arr)
    assert view.dtype == np.int64 and view.shape == (6,)
    assert not view.flags.writeable and view.flags.c_contiguous
    # A fresh pool hands out pages 0, 1, ... in order.
    np.testing.assert_array_equal(view, np.arange(6))
    # Zero copy: two numpy views of the same Int64Array share its Rust-owned memory.
    again = np.asarray(arr)
    assert address(again) == address(view)
    assert np.shares_memory(view, again)

    slots = pool.slots(1, 0, 6)
    np.testing.assert_array_equal(np.asarray(slots), view)
    np.testing.assert_array_equal(np.asarray(pool.slots(1, 2, 5)), view[2:5])
    assert len(pool.slots(1, 3, 3)) == 0


def test_slots_are_consistent_with_the_page_table():
    pool = KvPagePool(16, 4)
    for rid in (1, 2, 3):
        pool.add_request(rid)
    for step in range(6):  # interleave requests so pages are not contiguous per request
        for rid in (1, 2, 3):
            pool.reserve(rid, 1 + (rid + step) % 3)
    pool.truncate(2, 3)
    pool.reserve(1, 5)  # reuses pages freed by request 2
    seen = []
    for rid in (1, 2, 3):
        n = pool.len_of(rid)
        table = np.asarray(pool.page_table(rid))
        slots = np.asarray(pool.slots(rid, 0, n))
        t = np.arange(n)
        np.testing.assert_array_equal(slots, table[t // 4] * 4 + t % 4)
        assert len(table) == -(-n // 4)
        seen.append(slots)
    every = np.concatenate(seen)
    assert len(np.unique(every)) == len(every), "a slot is owned by two requests"
    assert every.min() >= 0 and every.max() < pool.num_slots


def test_int64array_buffer_protocol():
    pool = KvPagePool(4, 2)
    pool.add_request(0)
    arr = pool.reserve(0, 3)
    mv = memoryview(arr)
    assert mv.format == "q" and mv.itemsize == 8 and mv.ndim == 1
    assert mv.shape == (3,) and mv.strides == (8,) and mv.readonly
    assert mv.tolist() == [0, 1, 2] == arr.tolist()
    assert bytes(mv) == np.arange(3, dtype=np.int64).tobytes()
    mv.release()
    assert "Int64Array(len=3, [0, 1, 2])" == repr(arr)
    # Read-only: a writable buffer request is refused.
    with pytest.raises((BufferError, TypeError)):
        (ctypes.c_int64 * 3).from_buffer(arr)
    with pytest.raises(ValueError):
        np.asarray(arr).setflags(write=True)
    # Empty arrays work too.
    empty = np.asarray(pool.reserve(0, 0))
    assert empty.shape == (0,) and empty.dtype == np.int64


def test_views_keep_the_array_alive():
    pool = KvPagePool(64, 16)
    pool.add_request(7)
    view = np.asarray(pool.reserve(7, 100))  # the Int64Array itself is dropped at once
    gc.collect()
    pool.reserve(7, 100)  # more allocations must not reuse the viewed memory
    np.testing.assert_array_equal(view, np.arange(100))


def test_torch_views_are_zero_copy():
    torch = pytest.importorskip("torch")
    pool = KvPagePool(8, 4)
    pool.add_request(1)
    arr = pool.reserve(1, 5)
    base = address(np.asarray(arr))
    with warnings.catch_warnings():
        # torch warns (once) that it does not support read-only memory; nothing writes here.
        warnings.simplefilter("ignore", UserWarning)
        via_numpy = torch.as_tensor(np.asarray(arr))
        via_buffer = torch.frombuffer(arr, dtype=torch.int64)
    for t in (via_numpy, via_buffer):
        assert t.dtype == torch.int64 and t.shape == (5,)
        assert t.data_ptr() == base
        assert t.tolist() == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------- accounting


def test_pool_sizes_and_counts():
    pool = KvPagePool(10, 16)
    assert (pool.num_pages, pool.page_size, pool.num_slots) == (10, 16, 160)
    assert (pool.num_free_pages(), pool.num_used_pages(), pool.num_requests()) == (10, 0, 0)
    pool.add_request(3)
    assert 3 in pool and pool.has_request(3) and 4 not in pool
    assert pool.len_of(3) == 0
    pool.reserve(3, 17)
    assert pool.len_of(3) == 17
    assert (pool.num_free_pages(), pool.num_used_pages(), pool.num_requests()) == (8, 2, 1)
    assert repr(pool) == "KvPagePool(num_pages=10, page_size=16, free_pages=8, requests=1)"


def test_can_reserve_and_pages_needed_match_reserve():
    pool = KvPagePool(3, 4)
    pool.add_request(1)
    pool.reserve(1, 5)  # pages 0, 1; 3 free slots left in page 1
    assert pool.pages_needed(1, 3) == 0
    assert pool.pages_needed(1, 4) == 1
    assert pool.pages_needed(1, 8) == 2
    assert pool.can_reserve(1, 7)
    assert not pool.can_reserve(1, 8)
    assert not pool.can_reserve(99, 0)  # unknown request: False, not an error
    assert pool.can_reserve(1, 2**64 - 1) is False
    pool.reserve(1, 7)
    assert pool.num_free_pages() == 0
    assert pool.can_reserve(1, 0)


def test_truncate_frees_pages_at_page_boundaries():
    pool = KvPagePool(4, 4)
    pool.add_request(1)
    first = np.asarray(pool.reserve(1, 12)).copy()  # 3 full pages
    assert pool.truncate(1, 9) == 0  # still in the third page
    assert pool.truncate(1, 8) == 1  # third page now empty
    assert pool.num_free_pages() == 2
    assert pool.truncate(1, 8) == 0  # no-op
    assert pool.truncate(1, 1) == 1
    assert pool.page_table(1).tolist() == [0]
    # Re-reserving after a truncate gets the same slots back.
    np.testing.assert_array_equal(np.asarray(pool.reserve(1, 11)), first[1:])
    assert pool.truncate(1, 0) == 3
    assert pool.num_free_pages() == 4 and 1 in pool


def test_no_leak_after_freeing_every_request():
    rng = random.Random(1234)
    pool = KvPagePool(64, 8)
    live: dict[int, int] = {}
    next_id = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.15 or not live:
            pool.add_request(next_id)
            live[next_id] = 0
            next_id += 1
        elif op < 0.75:
            rid = rng.choice(list(live))
            steps = rng.randrange(8)
            if pool.can_reserve(rid, steps + 1):
                slots = pool.reserve(rid, steps + 1)
                assert len(slots) == steps + 1
                accepted = rng.randrange(steps + 1)
                live[rid] += accepted + 1
                pool.truncate(rid, live[rid])
            else:
                with pytest.raises(KvError):
                    pool.reserve(rid, steps + 1)
                pool.free_request(rid)
                del live[rid]
        else:
            rid = rng.choice(list(live))
            assert pool.free_request(rid) == -(-live.pop(rid) // 8)
        assert pool.num_free_pages() + pool.num_used_pages() == 64
        assert pool.num_used_pages() == sum(-(-n // 8) for n in live.values())
    for rid in list(live):
        pool.free_request(rid)
    assert pool.num_free_pages() == 64
    assert pool.num_used_pages() == 0
    assert pool.num_requests() == 0


# ---------------------------------------------------------------- errors


def test_kv_error_is_a_value_error_named_specdial_kv_error():
    assert issubclass(KvError, ValueError)
    assert KvError.__module__ == "specdial" and KvError.__name__ == "KvError"
    import specdial

    if hasattr(specdial, "KvError"):
        assert specdial.KvError is KvError


@pytest.mark.parametrize(
    ("num_pages", "page_size", "message"),
    [
        (0, 16, "num_pages must be >= 1, got 0"),
        (16, 0, "page_size must be >= 1"),
        (-1, 16, "num_pages must be an integer in 0..=4294967295, got -1"),
        (16, -2, "page_size must be an integer in 0..=4294967295, got -2"),
        (2**32, 1, "num_pages must be an integer in 0..=4294967295, got 4294967296"),
        (2**32 - 1, 2**32 - 1, "exceeds the largest i64 slot index"),
    ],
)
def test_bad_pool_sizes(num_pages, page_size, message):
    with pytest.raises(KvError, match=message):
        KvPagePool(num_pages, page_size)


def test_every_error_names_what_was_wrong_and_changes_nothing():
    pool = KvPagePool(4, 4)
    pool.add_request(1)
    pool.reserve(1, 6)
    pool.add_request(2)
    pool.reserve(2, 4)
    ids = (1, 2, 9)
    before = state(pool, ids)

    cases = [
        (lambda: pool.add_request(1), r"request 1 is already registered"),
        (lambda: pool.reserve(1, 100), r"request 1: reserving 100 tokens needs 25 more pages, only 1 of 4 pages are free"),
        (lambda: pool.reserve(9, 1), r"unknown request 9 \(never added, or already freed\)"),
        (lambda: pool.slots(9, 0, 0), r"unknown request 9"),
        (lambda: pool.slots(1, 4, 9), r"request 1: token range 4\.\.9 is invalid for a request of length 6 tokens"),
        (lambda: pool.slots(1, 3, 2), r"token range 3\.\.2 is invalid"),
        (lambda: pool.truncate(1, 7), r"request 1: cannot truncate to 7 tokens, its length is only 6 tokens"),
        (lambda: pool.truncate(9, 0), r"unknown request 9"),
        (lambda: pool.free_request(9), r"unknown request 9"),
        (lambda: pool.len_of(9), r"unknown request 9"),
        (lambda: pool.page_table(9), r"unknown request 9"),
        (lambda: pool.pages_needed(9, 1), r"unknown request 9"),
        (lambda: pool.reserve(1, -1), r"n_tokens must be an integer in 0\.\.=\d+, got -1"),
        (lambda: pool.can_reserve(1, -1), r"n_tokens must be an integer"),
        (lambda: pool.add_request(-5), r"request_id must be an integer in 0\.\.=\d+, got -5"),
        (lambda: pool.reserve(2**64, 1), r"request_id must be an integer in 0\.\.=18446744073709551615, got 18446744073709551616"),
        (lambda: pool.slots(1, -1, 2), r"start must be an integer"),
        (lambda: pool.slots(1, 0, -2), r"end must be an integer"),
        (lambda: pool.truncate(1, -3), r"new_len must be an integer"),
    ]
    for call, message in cases:
        with pytest.raises(KvError, match=message):
            call()
        assert state(pool, ids) == before, message

    # Non-integers are type errors, as anywhere in Python.
    with pytest.raises(TypeError):
        pool.reserve(1, 1.5)
    with pytest.raises(TypeError):
        pool.add_request("1")
    assert state(pool, ids) == before


def test_free_twice_is_an_error():
    pool = KvPagePool(4, 4)
    pool.add_request(5)
    pool.reserve(5, 5)
    assert pool.free_request(5) == 2
    with pytest.raises(KvError, match=r"unknown request 5 \(never added, or already freed\)"):
        pool.free_request(5)
    assert pool.num_free_pages() == 4 and pool.num_requests() == 0
    pool.add_request(5)  # the id can be reused once freed
    assert pool.len_of(5) == 0
