"""Background threads start and stop cleanly and never deadlock with Python threads."""

from __future__ import annotations

import threading

import kvcached_core as kc


def test_create_and_destroy_managers_while_another_thread_allocates(settings):
    shared = kc.KVCacheManager(4096, 16 * 1024, 2, 2, device="cpu", settings=settings, reserved_pages=0)
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0]

    def churn() -> None:
        try:
            while not stop.is_set():
                ids = shared.alloc(64)
                if ids:
                    shared.free(ids)
                done[0] += 1
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for i in range(60):
            mgr = kc.KVCacheManager(256, 64 * 1024, 1, 2, device="cpu", settings=settings, pool_target=i % 3)
            ids = mgr.alloc(40)
            assert ids is not None
            if i % 2:
                mgr.free(ids)
            mgr.close() if i % 3 else None  # the rest are destroyed by garbage collection, threads running
            del mgr
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not worker.is_alive(), "allocating thread deadlocked"
    assert not errors, errors
    assert done[0] > 0
    shared.close()


def test_concurrent_alloc_free_from_threads_keeps_ids_unique(settings):
    mgr = kc.KVCacheManager(8192, 16 * 1024, 1, 2, device="cpu", settings=settings, reserved_pages=1)
    owned: list[set[int]] = [set() for _ in range(4)]
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            for step in range(400):
                ids = mgr.alloc(1 + (step * 7 + slot) % 50)
                if ids:
                    owned[slot].update(ids)
                if step % 3 == 0 and owned[slot]:
                    victims = [owned[slot].pop() for _ in range(min(len(owned[slot]), 40))]
                    mgr.free(victims)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    all_ids = [b for s in owned for b in s]
    assert len(all_ids) == len(set(all_ids)), "a block id was handed to two owners"
    assert mgr.snapshot()["allocated_blocks"] == len(all_ids)
    mgr.close()
