"""Sharded sampling on a local Ray (issue 19): images/s with 1 and 2 CPU workers, the
overhead of a shard, and a single process for comparison.

Every configuration writes the same ADM .npz of the shipped digits MAR (16 px images,
so the model's own work, not the image size, dominates) through
marcache.distributed.RayExecutor.sample (actor start and model load included in the
wall time: what a user waits for), in this order per repeat, rotated by one each
repeat so that drift in the machine's load spreads over all of them:

- "1 process": the single-process sample loop (marcache.chunks), 1 thread;
- "ray 1x1": one worker of one thread, one shard;
- "ray 2x1": two workers of one thread each, one shard each;
- "ray 1x1, S shards": one worker, the run cut into S shards; the time beyond
  "ray 1x1", divided by S - 1, is the overhead of one shard (a Ray task round trip,
  the progress reports, a part file's fsync and the manifest rewrite).

    python benchmarks/bench_distributed.py --n 64 --batch 8 --repeats 3

On a GPU node: --gpus 1 runs one worker per GPU instead (workers = the GPUs Ray sees).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import marcache as mc  # noqa: E402
from marcache import chunks as ch  # noqa: E402
from marcache import digits  # noqa: E402
from marcache import distributed as dist  # noqa: E402
from marcache.eval import class_major_labels  # noqa: E402


def single_process(out, args):
    model = mc.load(digits.MODEL_PATH, threads=1)
    plan = ch.chunk_plan(args.n, args.batch, args.batch)
    labels = class_major_labels(args.n, args.per_class, 10)
    settings = dict(steps=args.steps, cfg=digits.CFG)
    store = ch.PartStore(out, ch.run_settings(model, args.n, args.per_class, 0, args.batch, plan, mc.NoCache(),
                                              settings), restart=True)
    for chunk in plan:
        store.write_chunk(chunk, (images for images, _, _ in ch.iter_generated(
            model, chunk, labels, args.batch, 0, mc.NoCache(), settings)))
        store.mark_done(chunk)
    store.assemble(plan)


def ray_run(out, args, workers, shards_per_worker):
    executor = dist.RayExecutor(workers=workers, threads_per_worker=1, gpus_per_worker=args.gpus,
                                shards_per_worker=shards_per_worker, chunk_images=args.batch)
    executor.sample(dist.ModelSpec(digits.MODEL_PATH), out, mc.NoCache(), args.n, args.per_class,
                    batch_size=args.batch, restart=True, steps=args.steps, cfg=digits.CFG)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--per-class", type=int, default=None,
                        help="images per class, class-major (default: enough for --n over the 10 digits)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=digits.STEPS)
    parser.add_argument("--shards", type=int, default=8, help="S of the 'ray 1x1, S shards' configuration")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpus", type=float, default=0, help="GPUs per worker (0: CPU workers)")
    args = parser.parse_args()
    if args.per_class is None:
        args.per_class = -(-args.n // 10)
    if args.n > 10 * args.per_class:
        parser.error(f"--n {args.n} images at --per-class {args.per_class} need more than the 10 digit classes")

    import ray

    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    ray.init(num_cpus=2 if not args.gpus else None, include_dashboard=False, log_to_driver=False)
    gpus = ray.cluster_resources().get("GPU", 0)
    if args.gpus and gpus < args.gpus:
        ray.shutdown()
        raise SystemExit(f"--gpus {args.gpus}: the Ray cluster has {gpus:g} GPUs, so no worker could start")
    configs = [("1 process", lambda out: single_process(out, args)),
               ("ray 1x1", lambda out: ray_run(out, args, 1, 1)),
               ("ray 2x1", lambda out: ray_run(out, args, 2, 1)),
               (f"ray 1x1, {args.shards} shards", lambda out: ray_run(out, args, 1, args.shards))]
    if args.gpus and gpus < 2 * args.gpus:  # two workers would wait for GPUs forever
        print(f"ray 2x1 left out: two workers of {args.gpus:g} GPU need {2 * args.gpus:g}, the cluster has {gpus:g}",
              file=sys.stderr)
        configs = [c for c in configs if c[0] != "ray 2x1"]
    times = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = configs[repeat % len(configs):] + configs[:repeat % len(configs)]
            for name, run in order:
                t0 = time.perf_counter()
                run(os.path.join(tmp, "s.npz"))
                times[name].append(time.perf_counter() - t0)
                print(f"repeat {repeat}: {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    ray.shutdown()
    print(f"{args.n} digits images, {args.steps} steps, batch {args.batch}, {args.repeats} repeats; "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    print("| configuration | median s (min..max) | images/s (median) |")
    print("|---|---|---|")
    for name, _ in configs:
        t = times[name]
        print(f"| {name} | {statistics.median(t):.2f} ({min(t):.2f}..{max(t):.2f}) | "
              f"{args.n / statistics.median(t):.2f} |")
    one, many = times["ray 1x1"], times[f"ray 1x1, {args.shards} shards"]
    per_shard = [(m - o) / (args.shards - 1) for o, m in zip(one, many)]
    print(f"overhead per extra shard: median {statistics.median(per_shard):.3f} s "
          f"(per repeat: {', '.join(f'{p:.3f}' for p in per_shard)})")


if __name__ == "__main__":
    main()
