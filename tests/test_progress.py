"""The benchmark's progress line (mergecal.pipeline.progress) and what its cells keep quiet
(mergecal.pipeline.quiet): counts, elapsed time, the estimate of the time left, and tqdm bars and open_clip's
random-initialisation notice silenced only while a cell runs."""

import calendar
import concurrent.futures
import io
import logging
import threading

import pytest

from mergecal.errors import ParameterError
from mergecal.pipeline import quiet
from mergecal.pipeline.progress import (MIN_COMPUTED, RECENT, Progress, clock, eta_range, progress_interval,
                                       running_cells)

NOON = calendar.timegm((2026, 12, 1, 12, 0, 0))  # a wall clock for the estimate's UTC end


# ------------------------------------------------------------------------------------------------- progress

def test_interval_defaults_to_30_seconds_and_reads_the_environment():
    assert progress_interval({}) == 30.0
    assert progress_interval({"MERGECAL_PROGRESS_SECONDS": ""}) == 30.0
    assert progress_interval({"MERGECAL_PROGRESS_SECONDS": "2.5"}) == 2.5


@pytest.mark.parametrize("given", ["0", "-3", "soon", "nan", "inf"])
def test_a_bad_interval_is_one_line_naming_the_variable(given):
    with pytest.raises(ParameterError, match=rf"^MERGECAL_PROGRESS_SECONDS='{given}': expected a number of "
                                             r"seconds greater than 0$"):
        progress_interval({"MERGECAL_PROGRESS_SECONDS": given})


@pytest.mark.parametrize("seconds, shown", [(0, "0:00"), (59.6, "1:00"), (372, "6:12"), (3599, "59:59"),
                                            (3600, "1:00:00"), (3 * 3600 + 62, "3:01:02"), (-1, "0:00")])
def test_clock(seconds, shown):
    assert clock(seconds) == shown


def test_counts_running_and_elapsed_with_no_estimate_before_enough_computed_cells():
    board = Progress(total=320, started=100.0)
    for t in range(12):
        board.record(100.0 + t / 100, cached=True, failed=False)  # cached: done at once, no estimate from them
    for t in range(MIN_COMPUTED - 1):
        board.record(110.0 + t, cached=False, failed=t == 0)
    assert board.line(472.0, NOON, running=4) == ("cells 16/320 done (12 cached, 1 failed), 4 running, "
                                                  f"elapsed 6:12, ETA after {MIN_COMPUTED} computed cells")
    assert board.line(472.0, NOON) == (f"cells 16/320 done (12 cached, 1 failed), elapsed 6:12, "
                                       f"ETA after {MIN_COMPUTED} computed cells")  # runner does not tell


def test_the_estimate_is_the_remaining_cells_at_the_computed_cells_rate():
    board = Progress(total=110, started=0.0)
    for _ in range(10):
        board.record(0.5, cached=True, failed=False)
    for t in range(1, 21):  # 20 computed cells, one every 10 s: 80 cells left take 800 s
        board.record(10.0 * t, cached=False, failed=False)
    assert eta_range(board.computed_at, 0.0, 200.0, 80) == (800.0, 800.0)
    assert board.line(200.0, NOON, running=2) == ("cells 30/110 done (10 cached, 0 failed), 2 running, "
                                                  "elapsed 3:20, ETA ~13:20 (~12:13 UTC)")


def test_a_change_of_rate_gives_both_ends():
    """The first cells cheap, the recent ones four times dearer (a track of costlier cells): the line shows the
    estimate at the rate since the start and at the recent rate."""
    computed = [1.0 * t for t in range(1, 41)] + [40.0 + 4.0 * t for t in range(1, RECENT + 1)]
    now = computed[-1]  # 59 cells in the 119 s since the first completed; the last RECENT in 80 s
    low, high = eta_range(computed, 0.0, now, 100)
    assert (low, high) == (pytest.approx(100 / (59 / 119)), pytest.approx(100 / (RECENT / 80)))
    board = Progress(total=160, started=0.0, done=60, computed_at=computed)
    assert board.line(now, NOON).endswith("ETA 3:22-6:40 (12:03-12:07 UTC)")


def test_the_workers_start_up_is_not_taken_for_cell_time():
    """A process pool's workers start for 3 minutes (a Prefect server each), then a cell completes every 2 s."""
    computed = [180.0 + 2.0 * t for t in range(6)]
    assert eta_range(computed, 0.0, computed[-1], 4) == (pytest.approx(8.0), pytest.approx(8.0))


def test_a_stall_lengthens_the_recent_estimate():
    computed = [float(t) for t in range(1, 31)]
    assert eta_range(computed, 0.0, 30.0, 10) == (10.0, 10.0)
    # 100 s without a completion: 29 cells in the 129 s since the first, the last RECENT in the 120 s since the 10th
    assert eta_range(computed, 0.0, 130.0, 10) == (pytest.approx(10 * 129 / 29), pytest.approx(10 * 120 / RECENT))


def test_no_estimate_once_every_cell_is_done():
    board = Progress(total=6, started=0.0)
    for t in range(6):
        board.record(float(t), cached=t < 2, failed=t == 5)
    assert board.line(61.0, NOON, running=0) == "cells 6/6 done (2 cached, 1 failed), 0 running, elapsed 1:01"


def test_a_line_is_due_every_interval_from_the_start_or_the_last_line():
    board = Progress(total=3, started=10.0)
    assert not board.due(39.9, 30.0) and board.due(40.0, 30.0)
    board.last_line = 40.0
    assert not board.due(69.0, 30.0) and board.due(70.0, 30.0)


# ---------------------------------------------------------------------------------------------------- quiet

def _bars(**kwargs) -> str:
    from tqdm import tqdm

    out = io.StringIO()
    for _ in tqdm(range(3), file=out, mininterval=0, **kwargs):
        pass
    bar = tqdm(range(2), "positional", 2, True, out, None, 0, 10.0, None, None, False)  # disable by position
    list(bar)
    return out.getvalue()


def test_tqdm_bars_are_disabled_while_a_cell_runs_whatever_their_caller_passes():
    assert "3/3" in _bars(disable=False) and "2/2" in _bars()
    with quiet.quiet_cell():
        assert _bars(disable=False) == "" and _bars() == ""  # lm-eval's HFLM passes disable=False itself
        with quiet.quiet_cell():  # overlapping cells (the thread runner): still off
            assert _bars() == ""
        assert _bars(disable=False) == ""
    assert "3/3" in _bars(disable=False)  # back as it was once no cell runs


def test_quietly_keeps_the_signature_prefect_reads():
    import inspect

    def cell(key: str, source: dict | None = None) -> dict:
        return {"key": key, "bars": _bars()}

    wrapped = quiet.quietly(cell)
    assert inspect.signature(wrapped) == inspect.signature(cell) and wrapped.__name__ == "cell"
    assert wrapped("k") == {"key": "k", "bars": ""}


@pytest.mark.slow
def test_overlapping_create_clip_calls_leave_logging_as_it_was():
    """Two threads building the testbed's CLIP at once: open_clip's random-initialisation notice for the testbed's
    architecture is not shown, every other line is, and logging is left as it was (``create_clip`` once saved and
    restored a process-wide ``logging.disable``: two threads at once left it disabled, every later line lost)."""
    from mergecal.backbones.open_clip_vit import create_clip

    other = "a line logged while models are built"
    shown = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())
    root = logging.getLogger()
    disabled, level = logging.root.manager.disable, root.level
    logging.disable(logging.NOTSET)
    root.setLevel(logging.WARNING)
    root.addHandler(handler)
    try:
        for _ in range(3):
            threads = [threading.Thread(target=create_clip, args=("mergecal-vit-micro",)) for _ in range(2)]
            [t.start() for t in threads]
            logging.warning(other)
            [t.join() for t in threads]
            assert logging.root.manager.disable == logging.NOTSET and not root.filters
        logging.warning("No pretrained weights loaded for model 'ViT-B-32'. Model initialized randomly.")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logging.disable(disabled)
    assert shown.count(other) == 3 and not [m for m in shown if "mergecal-vit-micro" in m]
    assert shown[-1].startswith("No pretrained weights loaded for model 'ViT-B-32'")  # another model's is kept


def test_running_cells_counts_a_thread_pools_started_futures_only():
    class Wrapped:
        def __init__(self, future):
            self.wrapped_future = future

    release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        first, second = pool.submit(release.wait), pool.submit(release.wait)
        while not first.running():
            release.wait(0.01)
        assert running_cells([Wrapped(first), Wrapped(second)]) == 1  # the second waits for the worker
        assert running_cells([Wrapped(first), object()]) is None  # a future that does not tell
        release.set()
    assert running_cells([Wrapped(first), Wrapped(second)]) == 0
