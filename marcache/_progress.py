"""The one progress display of every long operation (generation, conversion and its
hash, the FID network, sweeps, sampling): tqdm, or a plain line on stderr when tqdm is
missing."""
import sys
import time


class Progress:
    """tqdm when installed, else one line rewritten on stderr; nothing when disabled.

    enabled: True, False, or "auto": only when stderr is a terminal, so that logs and
    captured output get no carriage-return updates. unit="B" counts bytes: tqdm scales
    them by 1024, the stderr line shows MiB, the percentage and the update's label, at
    most every 0.5 s and at the end. Any other unit counts items: the stderr line shows
    n/total and the rate at every update."""

    def __init__(self, total, desc, unit="img", enabled=True):
        if enabled == "auto":
            enabled = sys.stderr is not None and sys.stderr.isatty()
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, bool(enabled)
        self.n = 0
        self.bar = None
        self._t0 = time.perf_counter()
        self._last = float("-inf")
        if not self.enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        scale = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
        self.bar = tqdm(total=total, desc=desc, unit=unit, **scale)

    def update(self, k, label=""):
        self.n += k
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(k)
            return
        now = time.perf_counter()
        if self.unit == "B":
            if now - self._last < 0.5 and self.n < self.total:
                return
            self._last = now
            pct = 100.0 * self.n / self.total if self.total else 100.0
            line = (f"{self.desc}: {self.n / 2**20:,.1f} / {self.total / 2**20:,.1f} MiB ({pct:5.1f}%) "
                    f"{label[:48]:<48}")
        else:
            dt = now - self._t0
            rate = self.n / dt if dt > 0 else 0.0
            line = f"{self.desc}: {self.n}/{self.total if self.total is not None else '?'} ({rate:.2f}/s)"
        sys.stderr.write("\r" + line)
        sys.stderr.flush()

    def close(self):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()
