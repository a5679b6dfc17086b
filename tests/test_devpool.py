"""The device memory pool every CUDA backend on a device shares (issue 21, point 5;
csrc/backend/devpool.h), on a fake device: the pool's bookkeeping is plain C behind a
pluggable device allocator and per-owner stream queries, and _C._devpool_script drives it
with a device that is a byte budget and can be told to refuse, and owners whose "stream"
is a busy flag. What a GPU adds (cudaMalloc, cudaStreamQuery) is a thin layer in
cuda_backend.cu; these rules are the part that decides correctness:

- a model reuses its own freed blocks at once (stream order), another model only once
  the freeing stream is known to be past the free (waited for, or queried idle);
- out of memory: every owner's stream is waited for (not one that records a graph),
  every idle cached block goes back to the device, and the request is retried once;
- a second out-of-memory is a MemoryError naming the bytes and what the pool holds;
- accounting returns to zero when every block is freed, and the device gets every byte
  back when the last owner leaves."""
import random

import pytest

from marcache import _C

MiB = 1 << 20


def class_bytes(n):
    """devpool.h's size classes, from its text: 512-byte steps up to 4 KiB, above that 8
    classes per power of two (p / 8 apart in (p, 2p])."""
    if n <= 4096:
        return max(512, -(-n // 512) * 512)
    p = 4096
    while 2 * p < n:
        p *= 2
    step = p // 8
    return -(-n // step) * step


def run(capacity, steps):
    return _C._devpool_script(capacity, steps)


@pytest.mark.parametrize("n", [0, 1, 512, 513, 4096, 4097, 5000, 8192, 8193, 1000000, 3 << 20,
                               (1 << 30) + 1])
def test_size_classes(n):
    got = run(1 << 40, [("join", 0), ("alloc", 0, n), ("stats", 0)])[2]["in_use_bytes"]
    assert got == class_bytes(n)
    assert n <= got <= max(512, n + n // 8 + 511)


def test_a_model_reuses_its_own_freed_block_at_once():
    r = run_frees(64 * MiB, [("join", 0), ("alloc", 0, 3 * MiB), ("busy", 0, 1),
                             ("free", 0, None), ("alloc", 0, 3 * MiB), ("stats", 0)])
    first, again, stats = r[1], r[4], r[5]
    assert again == first  # busy stream: stream order makes its own reuse safe
    assert stats["device_allocs"] == 1 and stats["reuses_own"] == 1


def fill_frees(steps, results):
    """Replaces ("free", k, None) with the address of the latest alloc before it."""
    out, last = [], 0
    for i, s in enumerate(steps):
        if s[0] == "free" and s[2] is None:
            s = ("free", s[1], last)
        out.append(s)
        if s[0] == "alloc":
            last = results[i] if results is not None else 0  # 0: not a block, ignored
    return out


def run_frees(capacity, steps):
    """run() where ("free", k, None) frees the block of the alloc just before it (the
    script is run once per free to learn the addresses: the fake device hands them out
    deterministically)."""
    results = None
    for _ in range(1 + sum(1 for s in steps if s[0] == "free")):
        results = run(capacity, fill_frees(steps, results))
    return results


def test_a_second_model_reuses_memory_freed_by_the_first():
    r = run_frees(64 * MiB, [
        ("join", 0), ("join", 1),
        ("alloc", 0, 5 * MiB), ("busy", 0, 1), ("free", 0, None),
        ("alloc", 1, 5 * MiB),             # 0's stream may still read it: not handed over
        ("busy", 0, 0),                    # 0's stream finished (cudaStreamQuery says so)
        ("alloc", 1, 5 * MiB),             # now it is
        ("stats", 1)])
    freed_by_0, while_busy, after_idle, stats = r[2], r[5], r[7], r[8]
    assert while_busy != freed_by_0
    assert after_idle == freed_by_0
    assert stats["reuses_other"] == 1 and stats["device_allocs"] == 2 and stats["owners"] == 2


def test_a_wait_for_the_stream_hands_blocks_over_without_a_query():
    r = run_frees(64 * MiB, [
        ("join", 0), ("join", 1), ("alloc", 0, MiB), ("busy", 0, 1), ("free", 0, None),
        ("sync", 0), ("busy", 0, 1),       # waited for after the free, busy again since
        ("alloc", 1, MiB), ("stats", 1)])
    assert r[7] == r[2] and r[8]["reuses_other"] == 1


def test_out_of_memory_trims_other_models_caches_then_retries():
    r = run_frees(10 * MiB, [
        ("join", 0), ("join", 1),
        ("alloc", 0, 6 * MiB), ("busy", 0, 1), ("free", 0, None),  # 6 MiB cached by model 0
        ("alloc", 1, 8 * MiB),             # 6 + 8 > 10: refused, trim, retry
        ("stats", 0), ("stats", 1)])
    assert isinstance(r[5], int), r[5]
    s0, s1 = r[6], r[7]
    assert s1["trims"] == 1 and s1["device_frees"] == 1 and s1["device_allocs"] == 2
    assert s0["waits"] == 1, "the trim did not wait for model 0's stream before freeing"
    assert s1["in_use_bytes"] == 8 * MiB and s1["cached_bytes"] == 0
    assert s1["reserved_bytes"] == 8 * MiB and s1["peak_reserved_bytes"] == 8 * MiB
    assert s1["device_used"] == 8 * MiB


def test_a_transient_refusal_is_retried():
    r = run(64 * MiB, [("join", 0), ("fail_next", 1), ("alloc", 0, MiB), ("stats", 0)])
    assert isinstance(r[2], int) and r[3]["trims"] == 1 and r[3]["device_allocs"] == 1


def test_out_of_memory_twice_is_memory_error_naming_the_bytes_and_the_pool():
    r = run(64 * MiB, [("join", 0), ("join", 1), ("alloc", 1, 3 * MiB), ("fail_next", 2),
                       ("alloc", 0, 1000000), ("stats", 0)])
    msg = r[4]
    assert isinstance(msg, str), msg
    assert msg.startswith("cannot allocate a _devpool_script block on device 0, a 1000000-byte request rounded up "
                          "to its size class (%d bytes, 1.0 MiB): " % class_bytes(1000000)), msg
    assert "%d bytes in 1 blocks are in use by the 2 model(s)" % (3 * MiB) in msg
    assert "the fake device was told to refuse it" in msg  # the device's own reason
    assert r[5]["in_use_blocks"] == 1 and r[5]["trims"] == 1


def test_a_recording_model_is_never_waited_for_and_keeps_its_busy_blocks():
    r = run_frees(10 * MiB, [
        ("join", 0), ("join", 1),
        ("alloc", 0, 6 * MiB), ("busy", 0, 1), ("free", 0, None), ("capturing", 0, 1),
        ("alloc", 1, 8 * MiB),             # needs model 0's block, which may be in use
        ("stats", 0),
        ("capturing", 0, 0), ("alloc", 1, 8 * MiB), ("stats", 0)])
    assert isinstance(r[6], str) and "6291456 bytes stay cached" in r[6], r[6]
    assert r[7]["waits"] == 0 and r[7]["cached_bytes"] == 6 * MiB
    assert isinstance(r[9], int) and r[10]["waits"] == 1  # after the recording: trimmed


def test_pools_are_per_device_and_shared_on_a_device():
    r = run(64 * MiB, [("join", 0, 0), ("join", 1, 1), ("join", 2, 0),
                       ("alloc", 0, MiB), ("stats", 0), ("stats", 1), ("stats", 2)])
    assert r[4]["owners"] == 2 and r[5]["owners"] == 1
    assert r[6]["in_use_bytes"] == MiB and r[5]["in_use_bytes"] == 0


def test_accounting_returns_to_zero_and_the_device_gets_everything_back():
    rng = random.Random(5)
    sizes = [rng.choice([300, 5000, 70000, MiB, 3 * MiB + 17]) for _ in range(60)]
    owners = [rng.randrange(3) for _ in sizes]
    steps = [("join", 0), ("join", 1), ("join", 2)]
    steps += [("alloc", k, n) for k, n in zip(owners, sizes)]
    first = run(1 << 34, steps)
    addresses = first[3:]
    assert all(isinstance(a, int) for a in addresses) and len(set(addresses)) == len(sizes)
    # free them in a shuffled order, each by a random owner (a block may be freed by any
    # owner of the pool), with some streams busy; then allocate the same sizes again
    order = list(range(len(sizes)))
    rng.shuffle(order)
    frees = [("busy", 1, 1)] + [("free", rng.randrange(3), addresses[i]) for i in order]
    second = run(1 << 34, steps + frees + [("stats", 0), ("trim", 0), ("stats", 0),
                                          ("leave", 1), ("leave", 2), ("leave", 0),
                                          ("device_used",)])
    before_trim, after_trim, device_used = second[-7], second[-5], second[-1]
    total = sum(class_bytes(n) for n in sizes)
    assert before_trim["in_use_bytes"] == 0 and before_trim["in_use_blocks"] == 0
    assert before_trim["cached_bytes"] == total == before_trim["reserved_bytes"]
    assert before_trim["peak_reserved_bytes"] == total
    assert after_trim["cached_bytes"] == 0 and after_trim["reserved_bytes"] == 0
    assert after_trim["device_frees"] == after_trim["device_allocs"] == len(sizes)
    assert device_used == 0


def test_the_last_model_to_leave_gives_the_memory_back():
    r = run(64 * MiB, [("join", 0), ("join", 1), ("alloc", 0, MiB), ("alloc", 1, 2 * MiB),
                       ("leave", 0), ("device_used",), ("leave", 1), ("device_used",),
                       ("join", 0), ("stats", 0)])
    assert r[5] == 3 * MiB  # model 1 is still there: nothing given back yet
    assert r[7] == 0
    assert r[9]["owners"] == 1 and r[9]["device_allocs"] == 0  # a fresh pool


@pytest.mark.parametrize("steps,error,match", [
    ([("alloc", 0, 10)], ValueError, "owner 0 has not joined"),
    ([("join", 9)], ValueError, "owner 9 not in 0..7"),
    ([("join", 0), ("join", 0)], ValueError, "joined twice"),
    ([("join", 0), ("alloc", 0, -1)], ValueError, "negative size"),
    ([("join", 0), ("frobnicate", 0)], ValueError, "unknown step 'frobnicate'"),
])
def test_script_errors(steps, error, match):
    with pytest.raises(error, match=match):
        run(MiB, steps)
