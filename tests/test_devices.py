"""One cell per GPU: device leases exclude each other across threads and processes, and die with their holder.
The lease logic does not touch CUDA, so a pretended device count exercises it on a CPU machine."""

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from mergecal.errors import MergecalError
from mergecal.pipeline.devices import device_lease


def test_cpu_needs_no_lease(tmp_path):
    with device_lease("cpu", tmp_path / "locks") as device:
        assert device == "cpu"
    assert not (tmp_path / "locks").exists()


def test_threads_never_share_a_device_and_use_every_device(tmp_path):
    holders: dict[str, int] = {}
    seen, overlaps, peak = set(), [], [0]
    guard = threading.Lock()

    def cell(i):
        with device_lease("cuda", tmp_path, count=2, poll_seconds=0.01) as device:
            with guard:
                if device in holders:
                    overlaps.append((device, holders[device], i))
                holders[device] = i
                seen.add(device)
                peak[0] = max(peak[0], len(holders))
            time.sleep(0.05)
            with guard:
                del holders[device]

    threads = [threading.Thread(target=cell, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []
    assert seen == {"cuda:0", "cuda:1"} and peak[0] == 2


def test_an_explicit_device_is_taken_in_turns(tmp_path):
    order = []

    def cell(i):
        with device_lease("cuda:1", tmp_path, count=2, poll_seconds=0.01) as device:
            order.append(("in", i, device))
            time.sleep(0.03)
            order.append(("out", i, device))

    threads = [threading.Thread(target=cell, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(device == "cuda:1" for _, _, device in order)
    assert [kind for kind, _, _ in order] == ["in", "out"] * 3  # strictly one at a time


def _hold_forever(lock_dir, ready):
    with device_lease("cuda:0", lock_dir, count=1):
        ready.set()
        time.sleep(600)


def test_a_killed_holder_frees_its_device(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_forever, args=(str(tmp_path), ready))
    holder.start()
    try:
        assert ready.wait(60)
        got = []
        waiter = threading.Thread(target=lambda: got.append(_lease_once(tmp_path)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got  # held by the other process
        os.kill(holder.pid, signal.SIGKILL)
        waiter.join(30)
        assert got == ["cuda:0"]
    finally:
        holder.kill()
        holder.join()


def _lease_once(lock_dir):
    with device_lease("cuda", lock_dir, count=1, poll_seconds=0.01) as device:
        return device


@pytest.mark.parametrize("device, count, message", [
    ("cuda", 0, "no CUDA device is visible"),
    ("cuda:2", 2, r"device='cuda:2': this machine has 2 CUDA device\(s\)"),
    ("cuda:x", 2, r"device='cuda:x'"),
])
def test_impossible_devices_are_one_clear_error(tmp_path, device, count, message):
    with pytest.raises(MergecalError, match=message):
        with device_lease(device, tmp_path, count=count):
            pass


def test_leases_are_keyed_by_host_and_device(tmp_path):
    """Workers of two hosts sharing one checkout (a network file system) each have their own GPU 0."""
    with device_lease("cuda:0", tmp_path, count=1, host="gpu-a") as first:
        got = []
        other = threading.Thread(target=lambda: got.append(_lease_on(tmp_path, "gpu-b")))
        other.start()
        other.join(10)
        assert first == "cuda:0" and got == ["cuda:0"]  # not waiting for gpu-a's lease
        same = threading.Thread(target=lambda: got.append(_lease_on(tmp_path, "gpu-a")))
        same.start()
        same.join(0.5)
        assert same.is_alive() and got == ["cuda:0"]  # gpu-a's GPU 0 is taken
    same.join(10)
    assert got == ["cuda:0", "cuda:0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda-gpu-a-0.lock", "cuda-gpu-b-0.lock"]


def _lease_on(lock_dir, host):
    with device_lease("cuda:0", lock_dir, count=1, poll_seconds=0.01, host=host) as device:
        return device
