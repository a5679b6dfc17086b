"""The one Python generation driver every model family's generate uses: the
progress bar, wall time and the GenerationInfo, around the one engine binding
(csrc/python/py_generate.c, which releases the GIL, records every step's
telemetry and stops on Ctrl-C between steps)."""
import sys
import time


def run(native_generate, total_steps, progress=False, desc="generate", **kwargs):
    """Calls ``native_generate(callback=..., **kwargs)`` -> (output, step dicts) with a
    tqdm bar advanced by one per step when `progress` is true, or when it is "auto" and
    stderr is a terminal (a log file gets no carriage-return updates). Returns (output,
    step dicts, seconds)."""
    bar = None
    callback = None
    if progress == "auto":
        progress = sys.stderr is not None and sys.stderr.isatty()
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=int(total_steps), desc=desc, unit="step")
            callback = lambda info: bar.update(1)  # noqa: E731
        except ImportError:
            bar = None
    t0 = time.perf_counter()
    try:
        output, steps = native_generate(callback=callback, **kwargs)
    finally:
        if bar is not None:
            bar.close()
    return output, steps, time.perf_counter() - t0
