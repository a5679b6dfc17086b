"""Which way should a load read the file (issue 18)? Peak RSS and time of moving a file's bytes
into a resident anonymous buffer of the same size (as a load fills the weights), four ways,
in 4 MiB pieces: mmap + copy (marcache before issue 18), mmap + copy + madvise(MADV_DONTNEED)
of each consumed piece (marcache now), pread straight into the buffer, pread into a 4 MiB
bounce buffer + copy (what a non-host backend would need). NumPy only, no marcache.

    python benchmarks/bench_read_paths.py benchmarks/.cache/mar_base_random.safetensors

Each way runs in a fresh child, alternated over two rounds; "extra_peak_mib" is the growth
of the peak RSS beyond the filled buffer."""
import json, mmap, os, resource, subprocess, sys, time
import numpy as np
PIECE = 4 << 20

def child(way, path):
    size = os.path.getsize(path)
    dst = np.empty(size, np.uint8)
    dst[::4096] = 0  # touch: the destination is resident, as the weights are
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        if way in ("mmap", "mmap+madvise"):
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            view = memoryview(m)
            for off in range(0, size, PIECE):
                n = min(PIECE, size - off)
                dst[off:off + n] = np.frombuffer(view[off:off + n], np.uint8)
                if way == "mmap+madvise":
                    m.madvise(mmap.MADV_DONTNEED, off - off % mmap.PAGESIZE, n + off % mmap.PAGESIZE)
            del view
            m.close()
        elif way == "pread-direct":
            mv = memoryview(dst)
            for off in range(0, size, PIECE):
                n = min(PIECE, size - off)
                got = os.preadv(f.fileno(), [mv[off:off + n]], off)
                assert got == n
        else:  # pread into a bounce buffer, then copy
            bounce = bytearray(PIECE)
            for off in range(0, size, PIECE):
                n = min(PIECE, size - off)
                got = os.preadv(f.fileno(), [memoryview(bounce)[:n]], off)
                dst[off:off + n] = np.frombuffer(bounce, np.uint8, n)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"way": way, "extra_peak_mib": (peak - base) / 1024, "file_mib": size / 2**20, "seconds": secs}))

if __name__ == "__main__":
    if len(sys.argv) == 3:
        child(sys.argv[1], sys.argv[2])
    else:
        path = sys.argv[1]
        ways = ["mmap", "mmap+madvise", "pread-direct", "pread-bounce"]
        for rnd in range(2):
            for way in (ways if rnd == 0 else ways[::-1]):
                out = subprocess.run([sys.executable, __file__, way, path], capture_output=True, text=True)
                print(out.stdout.strip() or out.stderr, flush=True)
