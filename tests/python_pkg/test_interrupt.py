"""Long calls release the GIL, report progress, and stop on Ctrl-C with KeyboardInterrupt."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import spectral_cond as sc
from conftest import instance


def big_instance():
    # (64, 64, 64, 64): qr streams 4096 columns into a 4096 x 4096 triangular factor (seconds).
    return instance(np.random.default_rng(7), N=64, D=64, dk=64, dv=64)


def test_progress_is_reported_and_reaches_one(rng):
    X, WQ, WK, WV = instance(rng, N=16, D=16, dk=8, dv=8)
    seen = []
    r = sc.kappa_jacobian(X, WQ, WK, WV, method="qr", block_cols=64, progress=seen.append)
    assert r.info == "success"
    assert len(seen) >= 3 and seen[-1] == 1.0
    assert all(a <= b for a, b in zip(seen, seen[1:])) and all(0 <= f <= 1 for f in seen)


def test_a_raising_callback_cancels_with_its_exception(rng):
    X, WQ, WK, WV = instance(rng, N=16, D=16, dk=8, dv=8)

    class Stop(Exception):
        pass

    def cb(f):
        if f > 0.1:
            raise Stop("enough")

    with pytest.raises(Stop, match="enough"):
        sc.kappa_jacobian(X, WQ, WK, WV, method="qr", block_cols=64, progress=cb)
    # Nothing is left half-done: the next call answers normally.
    assert sc.kappa_jacobian(X, WQ, WK, WV, method="qr").info == "success"


def test_gil_is_released_during_a_long_call():
    X, WQ, WK, WV = big_instance()
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.01)

    t = threading.Thread(target=ticker)
    t.start()
    start = time.perf_counter()
    try:
        sc.kappa_jacobian(X, WQ, WK, WV, method="gram")
    finally:
        stop.set()
        t.join()
    elapsed = time.perf_counter() - start
    during = [x for x in ticks if start < x < start + elapsed]
    # With the GIL held the ticker could not run at all during the call.
    assert elapsed < 0.2 or len(during) >= 0.3 * elapsed / 0.01


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals are delivered to the main thread")
def test_ctrl_c_interrupts_a_long_qr_call_promptly():
    X, WQ, WK, WV = big_instance()
    sent = []

    def fire():
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(0.5, fire)
    start = time.perf_counter()
    timer.start()
    returned = False
    with pytest.raises(KeyboardInterrupt):
        sc.kappa_jacobian(X, WQ, WK, WV, method="qr", block_cols=256)
        returned = True  # the call finished before the signal: the test fails below
        time.sleep(5)
    end = time.perf_counter()
    timer.join()
    assert sent, "the timer did not fire"
    assert not returned, "kappa_jacobian finished before SIGINT arrived (make the call larger)"
    assert end - sent[0] < 2.0, f"KeyboardInterrupt came {end - sent[0]:.2f} s after SIGINT"
    # The library is left in a usable state.
    small = instance(np.random.default_rng(1), N=6, D=6, dk=4, dv=3)
    assert sc.kappa_jacobian(*small, method="qr").info == "success"
