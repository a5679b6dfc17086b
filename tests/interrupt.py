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
