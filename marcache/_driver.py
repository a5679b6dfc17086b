"""The one Python generation driver every model family's generate uses: the
progress bar, wall time and the GenerationInfo, around the one engine binding
(csrc/python/py_generate.c, which releases the GIL, records every step's
telemetry and stops on Ctrl-C between steps)."""
import time

from ._progress import Progress


def run(native_generate, total_steps, progress=False, desc="generate", **kwargs):
    """Calls ``native_generate(callback=..., **kwargs)`` -> (output, step dicts) with a
    progress bar (marcache._progress: tqdm) advanced by one per step when `progress` is
    true, or when it is "auto" and stderr is a terminal (a log file gets no
    carriage-return updates). Returns (output, step dicts, seconds)."""
    bar = Progress(int(total_steps), desc, unit="step", enabled=progress)
    callback = (lambda info: bar.update(1)) if bar.enabled else None
    t0 = time.perf_counter()
    try:
        output, steps = native_generate(callback=callback, **kwargs)
    finally:
        bar.close()
    return output, steps, time.perf_counter() - t0
