"""bench_official.py's summary (issue 23): the ratio it reports against the official code is
the ratio of the medians over the rounds, and the spread beside it is each round's own
official / marcache. The timed runs need PyTorch and the official checkouts, so only the
arithmetic is tested here, on times whose answers are worked out by hand."""
import pytest

from benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def bench_official():
    return import_benchmark("bench_official")


def test_the_ratio_is_of_the_medians_and_each_round_keeps_its_own(bench_official):
    # Rounds in order; the medians are 84 and 28 (ratio 3.0), the rounds' own ratios
    # 80/28, 84/30, 90/27: the median of those (2.86) is not the ratio of the medians.
    times = {("idle", 1, "LazyMAR", "official"): [80.0, 84.0, 90.0],
             ("idle", 1, "LazyMAR", "marcache"): [28.0, 30.0, 27.0]}
    (row,) = bench_official.ratio_rows(times, ["idle"], [1], ["LazyMAR"])
    assert (row["official"], row["marcache"]) == (84.0, 28.0)
    assert row["ratio"] == pytest.approx(3.0)
    assert row["round_ratios"] == pytest.approx([80 / 28, 2.8, 90 / 27])
    assert bench_official.spread(row["round_ratios"]) == "2.80 / 2.86 / 3.33x"


def test_every_load_batch_and_policy_gets_its_row_in_order(bench_official):
    times = {}
    for load in ("idle", "busy"):
        for batch in (1, 8):
            for policy in ("NoCache", "LazyMAR"):
                scale = (2 if load == "busy" else 1) * batch * (1 if policy == "NoCache" else 0.5)
                times[(load, batch, policy, "official")] = [3.0 * scale]
                times[(load, batch, policy, "marcache")] = [1.0 * scale]
    rows = bench_official.ratio_rows(times, ["idle", "busy"], [1, 8], ["NoCache", "LazyMAR"])
    assert [(r["load"], r["batch"], r["policy"]) for r in rows] == [
        (load, batch, policy) for load in ("idle", "busy") for batch in (1, 8) for policy in ("NoCache", "LazyMAR")]
    assert [r["ratio"] for r in rows] == pytest.approx([3.0] * 8)
    assert rows[5]["marcache"] == pytest.approx(1.0)  # busy, batch 1, LazyMAR: 2 x 1 x 0.5 x 1 s
    assert rows[7]["official"] == pytest.approx(24.0)  # busy, batch 8, LazyMAR: 2 x 8 x 0.5 x 3 s
