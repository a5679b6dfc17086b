"""Ctrl-C without timing: SIGINT made pending so that only the engine's own signal check
can turn it into KeyboardInterrupt (tests of MAR generate, the VAE and the Inception)."""
import ctypes
import itertools
import operator
import signal


def _libc_raise():
    """libc raise() through ctypes: the signal is delivered to this thread before it returns
    and only trips Python's flag; unlike signal.raise_signal or os.kill, ctypes does not then
    run the Python handler itself, so the KeyboardInterrupt is left to the next check."""
    libc_raise = getattr(ctypes.CDLL(None), "raise")
    libc_raise.argtypes = [ctypes.c_int]
    return libc_raise


def call_with_sigint_pending(fn, *args):
    """Calls fn(*args) with SIGINT already pending when it starts, with no Python bytecode
    in between (itertools.starmap, operator.call and the ctypes call are all C), so the
    interpreter cannot handle the signal first: only fn's own signal check can raise.
    Returns True when fn raised KeyboardInterrupt, False when it returned normally (the
    interrupt then comes from the interpreter afterwards, after a marker was appended)."""
    marker = []
    try:
        list(itertools.starmap(operator.call, [(_libc_raise(), signal.SIGINT), (fn, *args),
                                               (marker.append, True)]))
    except KeyboardInterrupt:
        return not marker
    raise AssertionError("SIGINT was raised but no KeyboardInterrupt came")


def gil_released_during(call, bound_seconds=60.0):
    """Whether another Python thread ran while `call()` was running: proof that the C code
    behind it released the GIL. The switch interval is raised to 1000 s, so the calling
    thread gives the GIL up only where C code releases it; a watcher thread records whether
    the caller was inside `call` when it got to run. No rate or tick count is measured: one
    observation inside the call is the proof, and `call` is repeated (within bound_seconds)
    until there is one."""
    import sys
    import threading
    import time

    inside = [False]
    seen_inside, stop = threading.Event(), threading.Event()

    def watch():
        while not stop.is_set():
            if inside[0]:
                seen_inside.set()
            time.sleep(0.001)

    old_interval = sys.getswitchinterval()
    watcher = threading.Thread(target=watch)
    watcher.start()
    sys.setswitchinterval(1000.0)
    try:
        deadline = time.perf_counter() + bound_seconds
        while not seen_inside.is_set() and time.perf_counter() < deadline:
            inside[0] = True
            call()
            inside[0] = False
    finally:
        sys.setswitchinterval(old_interval)
        stop.set()
        watcher.join()
    return seen_inside.is_set()
