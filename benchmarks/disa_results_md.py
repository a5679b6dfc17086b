"""Markdown rows of a benchmarks/disa_digits.py JSON file (the results file's table).

    python benchmarks/disa_results_md.py benchmarks/results/disa-digits-2026-11-25.json"""
import json
import sys


def rows(path):
    with open(path) as f:
        data = json.load(f)
    base = data["rows"][0]
    out = ["| policy | s/image | wall speed-up | GFLOP/image | FLOP ratio | class accuracy | digits-FID | Pareto |",
           "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        out.append("| %s | %.4f | %.2fx | %.4f | %.2fx | %.1f%% (%+.1f) | %.2f | %s |" % (
            r["policy"], r["seconds_per_image"], r["speedup"], r["gflop_per_image"], r["flop_ratio"],
            100 * r["accuracy"], 100 * (r["accuracy"] - base["accuracy"]), r["fid"], "yes" if r["pareto"] else ""))
    return "\n".join(out)


if __name__ == "__main__":
    print(rows(sys.argv[1]))
