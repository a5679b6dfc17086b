"""Sharded sampling and exact FID on Ray (issue 19). Optional: ``pip install "marcache[ray]"``.

A run of N images is cut into the chunk plan of :mod:`marcache.chunks` (contiguous
ranges of global image indices, class-major labels, each a whole number of
generation batches); consecutive chunks form *shards*, a few per worker so that a
dead worker loses little and fast workers take more. Each worker is a Ray actor that
loads the model (and the FID network) once, on its GPU when ``gpus_per_worker`` is
given and else on the CPU with a thread count, then runs shards: it generates every
batch of its chunks with ``generate(first_index=...)`` (image i's noise is keyed by
(seed, i), so which worker makes an image never changes its bytes), and sends back,
per shard, never the images unless asked:

- n, sum_x = sum (x - c) and sum_xxt = sum (x - c)(x - c)^T in float64 over the
  2048-d pool features x of its images, about a shift c common to every shard (the
  reference statistics' mean, so that forming the covariance from the sums does not
  cancel its leading digits); every batch goes through the network exactly as
  :func:`marcache.eval.sweep` sends it, so the features are the same bits;
- the 1008 logits of each image, for the Inception Score (the driver lays them out in
  index order: the torch-fidelity protocol shuffles rows with a fixed permutation, so
  the order matters);
- or, for ``sample``, the chunks it wrote as part files (the workers write through
  :class:`marcache.chunks.PartStore`; the driver alone writes the manifest).

Why the merge does not depend on the shard count or order. The driver adds the
shards' (n, sum_x, sum_xxt) (:class:`ShardMerger`). In exact arithmetic a sum over
all images is the same for every partition of the index set and every order of
adding the parts, and each image's own term is the same bits in every plan (same
batches, same network, same float64 conversion). In float64 the only difference is
the rounding of the additions, about 1e-16 of the sums' size per addition: the
merged mean and covariance of 1, 2 or 3 shards of uneven size agree with a single
process's to 1e-12 relative and FID to 1e-9 (tests/test_distributed.py), far below the
two decimals FID is reported with.

Faults: a worker that dies (the process exits, the node goes away) loses its shard
only: the driver starts a new worker and reruns that shard, at most `max_retries`
times per shard, and the merge counts a shard once, by its id, however often its
result arrives. Ctrl-C on the driver kills the workers. One tqdm bar shows images
done / total and images/s across workers (a progress actor the workers report to).

Ray: ``RayExecutor(address=None)`` joins the Ray this process is connected to, or
else calls ``ray.init()``: a local Ray on this machine; ``address="auto"`` or
``"HOST:6379"`` joins a cluster started with ``ray start`` (marcache and the model
files must be on every node, at the same paths; for ``sample``, the output's folder
must be shared, as the workers write the parts there).
"""
import collections
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._progress import Progress
from .chunks import DEFAULT_CHUNK_IMAGES, PartStore, chunk_plan, iter_generated, run_settings, shard_plan
from .eval import (InceptionV3, Stats, SweepResult, class_major_labels, fid, inception_score,
                   load_reference)


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("marcache.distributed needs Ray: pip install 'marcache[ray]' (or pip install ray)") from None
    return ray


@dataclass(frozen=True)
class ModelSpec:
    """How a worker loads the model: the arguments of marcache.load, without the device
    (each worker's own: its GPU, or the CPU)."""
    path: str
    vae_path: Optional[str] = None
    dtype: str = "fp32"
    heads: Optional[int] = None
    diffusion_steps: Optional[int] = None

    @classmethod
    def from_model(cls, model):
        if getattr(model, "path", None) is None:
            raise ValueError("a distributed run loads the model from its file in every worker: this model has no "
                             "path (load it with marcache.load)")
        heads = steps = None
        if model.family == "mar":
            heads, steps = int(model.config["heads"]), len(model.timesteps)
        return cls(os.fspath(model.path), None if model.vae_path is None else os.fspath(model.vae_path),
                   model.dtype, heads, steps)

    def family(self):
        """"mar" or "var", from the file's metadata or tensor names (without loading it)."""
        from .model import _kind_from_names, file_kind

        for path, what in ((self.path, "model"), (self.vae_path, "VAE")):
            if path is not None and not os.path.exists(path):
                raise FileNotFoundError(f"{what} file not found: {path}")
        kind = file_kind(self.path) or _kind_from_names(self.path)
        return "var" if kind == "var" else "mar"

    def load(self, device, threads):
        import marcache as mc

        return mc.load(self.path, vae=self.vae_path, device=device, dtype=self.dtype, heads=self.heads,
                       diffusion_steps=self.diffusion_steps, threads=threads)


@dataclass
class ShardTask:
    """One shard of one run, as a worker receives it."""
    shard: int
    chunks: list                 # marcache.chunks.Chunk, consecutive
    cache: object
    settings: dict               # the model's generation settings
    seed: int
    per_class: int
    batch_size: int
    features: bool = False       # send feature sums and logits (needs the worker's Inception)
    shift: Optional[np.ndarray] = None
    images: bool = False         # send the images themselves
    parts_of: Optional[str] = None  # write the chunks as part files of this output
    attempt: int = 0
    exit_at: Optional[str] = None   # test hook (marcache.chunks.EXIT_HOOK_ENV's format)


@dataclass
class ShardResult:
    shard: int
    start: int
    stop: int
    n: int
    sum_x: Optional[np.ndarray]
    sum_xxt: Optional[np.ndarray]
    logits: Optional[np.ndarray]
    images: Optional[np.ndarray]
    chunks: list
    generate_seconds: float
    inception_seconds: float
    flops: float
    worker_pid: int
    attempt: int


class ShardWorker:
    """The Ray actor: the model and the FID network loaded once, shards run on demand."""

    def __init__(self, spec, inception_path, device, threads):
        self.model = spec.load(device, threads)
        self.inception = None if inception_path is None else InceptionV3.load(inception_path, threads=threads,
                                                                              device=device)

    def ready(self):
        return os.getpid()

    def run(self, task, board=None):
        model, chunks = self.model, task.chunks
        labels = class_major_labels(chunks[-1].stop, task.per_class, model.config.get("num_classes", 1000))
        if task.features and self.inception is None:
            raise ValueError("feature sums asked of a worker started without an Inception network")
        dim = self.inception.feature_dim if task.features else 0
        shift = np.zeros(dim) if task.shift is None else np.asarray(task.shift, np.float64)
        sum_x, sum_xxt = np.zeros(dim), np.zeros((dim, dim))
        logits, images_out = [], []
        totals = dict(n=0, gen=0.0, inc=0.0, flops=0.0)
        store = PartStore.attach(task.parts_of) if task.parts_of is not None else None

        def batches(chunk):
            nonlocal sum_x, sum_xxt
            for images, info, seconds in iter_generated(model, chunk, labels, task.batch_size, task.seed,
                                                        task.cache, task.settings, exit_at=task.exit_at or ""):
                totals["gen"] += seconds
                totals["flops"] += info.flops
                if task.features:
                    t0 = time.perf_counter()
                    # one network call per generation batch, as eval.sweep makes it: the same features
                    pool, lg = self.inception.features(images, batch_size=len(images))
                    x = pool.astype(np.float64) - shift
                    sum_x += x.sum(axis=0)
                    sum_xxt += x.T @ x
                    logits.append(lg)
                    totals["inc"] += time.perf_counter() - t0
                if task.images:
                    images_out.append(images)
                totals["n"] += len(images)
                if board is not None:
                    board.report.remote(task.shard, task.attempt, totals["n"])
                yield images

        for chunk in chunks:
            if store is not None:
                store.write_chunk(chunk, batches(chunk))
            else:
                for _ in batches(chunk):
                    pass
        return ShardResult(
            shard=task.shard, start=chunks[0].start, stop=chunks[-1].stop, n=totals["n"],
            sum_x=sum_x if task.features else None, sum_xxt=sum_xxt if task.features else None,
            logits=np.concatenate(logits) if logits else None,
            images=np.concatenate(images_out) if images_out else None,
            chunks=list(chunks), generate_seconds=totals["gen"], inception_seconds=totals["inc"],
            flops=totals["flops"], worker_pid=os.getpid(), attempt=task.attempt)


class _ProgressBoard:
    """Ray actor: images done per shard, the latest attempt's count only (a rerun shard
    starts again from 0), for the driver's one bar."""

    def __init__(self):
        self.counts = {}

    def report(self, shard, attempt, done):
        previous = self.counts.get(shard)
        if previous is None or attempt >= previous[0]:
            self.counts[shard] = (attempt, done)

    def total(self):
        return sum(done for _, done in self.counts.values())


class ShardMerger:
    """Adds shard results of one plan: each shard once, by its id (a result that
    arrives twice is not counted twice), its index range checked against the plan.

    shards: the plan (lists of consecutive chunks). shift: the common shift c of the
    workers' sums. The sums are added in float64; see the module docstring for why the
    result does not depend on the shard count or the order of arrival."""

    def __init__(self, shards, shift=None):
        self.ranges = {i: (s[0].start, s[-1].stop, sum(c.size for c in s)) for i, s in enumerate(shards)}
        self.shift = shift
        self.results = {}
        self.duplicates = 0
        self.n = 0
        self.sum_x = self.sum_xxt = None

    def add(self, result):
        """Adds a result; False (and nothing added) for a shard already merged."""
        if result.shard not in self.ranges:
            raise ValueError(f"shard {result.shard} is not in the plan (shards 0..{len(self.ranges) - 1})")
        start, stop, size = self.ranges[result.shard]
        if (result.start, result.stop, result.n) != (start, stop, size):
            raise ValueError(f"shard {result.shard}: images {result.start}..{result.stop - 1} (n {result.n}), the "
                             f"plan says {start}..{stop - 1} (n {size})")
        if result.shard in self.results:
            self.duplicates += 1
            return False
        if result.sum_x is not None:
            if self.sum_x is None:
                self.sum_x, self.sum_xxt = np.zeros_like(result.sum_x), np.zeros_like(result.sum_xxt)
            self.sum_x += result.sum_x
            self.sum_xxt += result.sum_xxt
        self.n += result.n
        # the sums are merged; keep the rest (logits, images, timings) for the report
        self.results[result.shard] = dataclasses.replace(result, sum_x=None, sum_xxt=None)
        return True

    @property
    def complete(self):
        return len(self.results) == len(self.ranges)

    def ordered(self):
        if not self.complete:
            missing = sorted(set(self.ranges) - set(self.results))
            raise ValueError(f"shards not merged yet: {missing}")
        return [self.results[i] for i in sorted(self.results)]

    def stats(self):
        """Stats of every image's features, each counted once."""
        self.ordered()
        return Stats.from_sums(self.n, self.sum_x, self.sum_xxt, self.shift)

    def logits(self):
        return np.concatenate([r.logits for r in self.ordered()])

    def images(self):
        return np.concatenate([r.images for r in self.ordered()])


def _worker_lost(ray):
    """The exceptions of a task whose actor died or became unreachable."""
    errors = ray.exceptions
    return tuple({errors.RayActorError, getattr(errors, "ActorUnavailableError", errors.RayActorError)})


def as_executor(executor):
    """sweep's executor argument: "ray" (a RayExecutor with its defaults) or a RayExecutor."""
    if isinstance(executor, RayExecutor):
        return executor
    if executor == "ray":
        return RayExecutor()
    raise ValueError(f"executor must be None, 'ray' or a marcache.distributed.RayExecutor, got {executor!r}")


class RayExecutor:
    """Runs chunk plans on Ray workers.

    address: None joins the Ray this process is connected to, or else starts a local
      one (ray.init()); "auto" or "HOST:PORT" joins a cluster (ray start).
    workers: actors, each loading the model and the FID network once (default: one per
      GPU with gpus_per_worker, else one per threads_per_worker CPUs of the cluster).
    gpus_per_worker: GPUs each worker reserves (0: the CPU).
    threads_per_worker: OpenMP threads of each CPU worker, also the CPUs it reserves
      from Ray (default 1; 0 = the cluster's CPUs divided among the workers).
    shards_per_worker: shards per worker (at most one per chunk): smaller shards lose
      less to a dead worker and balance uneven workers, at a per-shard cost
      (benchmarks/bench_distributed.py measures it).
    chunk_images: images per chunk (rounded up to whole batches).
    max_retries: reruns of a shard whose worker died, each on a new worker.
    init_kwargs: extra ray.init arguments when this executor starts Ray.
    """

    def __init__(self, address=None, workers=None, gpus_per_worker=0, threads_per_worker=1, shards_per_worker=4,
                 chunk_images=DEFAULT_CHUNK_IMAGES, max_retries=2, init_kwargs=None, _exit_at=None):
        if gpus_per_worker < 0 or (workers is not None and workers < 1) or threads_per_worker < 0 \
                or shards_per_worker < 1 or chunk_images < 1 or max_retries < 0:
            raise ValueError(f"RayExecutor: workers >= 1, gpus_per_worker >= 0, threads_per_worker >= 0, "
                             f"shards_per_worker >= 1, chunk_images >= 1 and max_retries >= 0, got {workers}, "
                             f"{gpus_per_worker}, {threads_per_worker}, {shards_per_worker}, {chunk_images}, "
                             f"{max_retries}")
        self.address, self.requested_workers = address, workers
        self.gpus_per_worker, self.threads_per_worker = gpus_per_worker, threads_per_worker
        self.shards_per_worker, self.chunk_images, self.max_retries = shards_per_worker, chunk_images, max_retries
        self.init_kwargs = dict(init_kwargs or {})
        self._exit_at = _exit_at  # test hook: marcache.chunks.EXIT_HOOK_ENV's format, for the first worker's task
        self.workers = workers
        self.worker_pids = []  # process ids of the workers first started (a local cluster's)
        self.last_run = {}

    # -- Ray ----------------------------------------------------------------

    def _connect(self):
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.address, **self.init_kwargs)
        return ray

    def _layout(self, ray):
        """(workers, threads, device) for this cluster."""
        resources = ray.cluster_resources()
        if self.gpus_per_worker > 0:
            workers = self.requested_workers or max(1, int(resources.get("GPU", 0) // self.gpus_per_worker))
            return workers, max(1, self.threads_per_worker), "cuda"
        cpus = int(resources.get("CPU", 1))
        workers = self.requested_workers or max(1, cpus // max(1, self.threads_per_worker))
        threads = self.threads_per_worker or max(1, cpus // workers)
        return workers, threads, "cpu"

    def _start(self, ray, spec, inception_path):
        workers, threads, device = self._layout(ray)
        self.workers = workers
        options = dict(num_gpus=self.gpus_per_worker, num_cpus=1 if device == "cuda" else threads, max_restarts=0)
        actor = ray.remote(ShardWorker).options(**options)

        def new_worker():
            return actor.remote(spec, inception_path, device, threads)

        pool = [new_worker() for _ in range(workers)]
        try:
            self.worker_pids = ray.get([w.ready.remote() for w in pool])
        except ray.exceptions.RayActorError as exc:
            for w in pool:
                ray.kill(w)
            raise ValueError(f"a Ray worker could not load {spec.path}"
                             f"{'' if inception_path is None else ' or ' + inception_path}: {exc}") from None
        return pool, new_worker, device

    def _run(self, ray, pool, new_worker, tasks, total, desc, progress, on_result):
        """Runs tasks on the pool (a shard per idle worker), reruns the shard of a dead
        worker on a new one (bounded), passes each result to on_result. Ctrl-C (or
        any error) kills the workers."""
        board = ray.remote(_ProgressBoard).options(num_cpus=0).remote()
        queue = collections.deque(tasks)
        idle, pending, failures = list(pool), {}, collections.Counter()
        bar = Progress(total, desc, enabled=progress)
        shown = 0
        try:
            while queue or pending:
                while queue and idle:
                    task, worker = queue.popleft(), idle.pop()
                    pending[worker.run.remote(task, board)] = (task, worker)
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in ready:
                    task, worker = pending.pop(ref)
                    try:
                        result = ray.get(ref)
                    except _worker_lost(ray) as exc:
                        failures[task.shard] += 1
                        if failures[task.shard] > self.max_retries:
                            raise RuntimeError(f"shard {task.shard} (images {task.chunks[0].start}.."
                                               f"{task.chunks[-1].stop - 1}): its worker died "
                                               f"{failures[task.shard]} times (max_retries {self.max_retries}); "
                                               f"last: {exc}") from None
                        ray.kill(worker)
                        replacement = new_worker()
                        pool[pool.index(worker)] = replacement
                        idle.append(replacement)
                        queue.appendleft(dataclasses.replace(task, attempt=task.attempt + 1, exit_at=None))
                        continue
                    idle.append(worker)
                    on_result(result)
                done = ray.get(board.total.remote())
                bar.update(done - shown)
                shown = done
        except BaseException:
            for worker in pool:
                ray.kill(worker)
            pool.clear()
            raise
        finally:
            bar.close()
            ray.kill(board)
        self.last_run = {"failures": sum(failures.values())}

    def _tasks(self, shards, **common):
        tasks = [ShardTask(shard=i, chunks=chunks, **common) for i, chunks in enumerate(shards)]
        if tasks and self._exit_at is not None:
            tasks[0] = dataclasses.replace(tasks[0], exit_at=self._exit_at)
        return tasks

    def _shards(self, chunks):
        return shard_plan(chunks, self.workers * self.shards_per_worker)

    @staticmethod
    def _close(ray, pool):
        for worker in pool:
            ray.kill(worker)

    # -- runs ---------------------------------------------------------------

    def _score_config(self, ray, pool, new_worker, name, cache, n, per_class, reference, seed, batch_size, progress,
                      is_protocol, method, settings, store=None):
        chunks = chunk_plan(n, batch_size, self.chunk_images)
        shards = self._shards(chunks)
        shift = reference.mu
        merger = ShardMerger(shards, shift)

        def on_result(result):
            if merger.add(result) and store is not None:
                for chunk in result.chunks:
                    store.mark_done(chunk)

        tasks = self._tasks(shards, cache=cache, settings=settings, seed=seed, per_class=per_class,
                            batch_size=batch_size, features=True, shift=shift,
                            parts_of=None if store is None else store.out)
        self._run(ray, pool, new_worker, tasks, n, f"sweep {name}", progress, on_result)
        stats, logits = merger.stats(), merger.logits()
        results = merger.ordered()
        isc = inception_score(logits, splits=min(10, n), protocol=is_protocol)
        return SweepResult(name=name, cache=cache, n=n, fid=fid(stats, reference, method=method),
                           inception_score=isc.mean, is_std=isc.std,
                           seconds_per_image=sum(r.generate_seconds for r in results) / n,
                           flops_per_image=sum(r.flops for r in results) / n,
                           inception_seconds_per_image=sum(r.inception_seconds for r in results) / n,
                           stats=stats, logits=logits, settings=dict(settings))

    def sweep(self, model, inception, items, n, per_class, reference, seed=0, batch_size=16, progress=False,
              is_protocol="torch-fidelity", method="auto", **settings):
        """marcache.eval.sweep(executor=...): [(name, cache)] -> [SweepResult]."""
        if inception.path is None:
            raise ValueError("a distributed sweep loads the Inception network from its file in every worker: "
                             "this one has no path (load it with InceptionV3.load)")
        if not isinstance(reference, Stats):
            reference = load_reference(reference, inception)
        spec = ModelSpec.from_model(model)
        ray = self._connect()
        pool, new_worker, _ = self._start(ray, spec, os.fspath(inception.path))
        try:
            return [self._score_config(ray, pool, new_worker, name, cache, n, per_class, reference, seed, batch_size,
                                       progress, is_protocol, method, settings) for name, cache in items]
        finally:
            self._close(ray, pool)

    def score(self, spec, inception_path, reference, cache, n, per_class, seed=0, batch_size=16,
              chunk_images=None, progress=False, out=None, restart=False, is_protocol="torch-fidelity",
              method="auto", **settings):
        """FID and IS of one configuration straight from the workers (the CLI's
        ``sample --ray --fid``): a SweepResult. out: also write the ADM .npz (the parts
        of every chunk, then the merged file; a part store left by an unfinished run
        must be discarded with restart=True, since FID needs every image's features)."""
        if chunk_images is not None:
            self.chunk_images = chunk_images
        inception_path = os.fspath(inception_path)
        if not os.path.exists(inception_path):
            raise FileNotFoundError(f"Inception weights not found: {inception_path}")
        if not isinstance(reference, Stats):
            reference = _reference_stats(reference, inception_path)
        ray = self._connect()
        store = None
        if out is not None:
            chunks = chunk_plan(n, batch_size, self.chunk_images)
            _, threads, device = self._layout(ray)
            store = PartStore(out, run_settings(spec, n, per_class, seed, batch_size, chunks, cache, settings,
                                                device=device, threads=threads), restart=restart)
            if store.done:
                raise ValueError(f"{store.dir} holds images of an unfinished run: FID needs every image's features; "
                                 f"rerun with --restart, or finish it without --fid and run fid on the file")
        pool, new_worker, _ = self._start(ray, spec, inception_path)
        try:
            result = self._score_config(ray, pool, new_worker, "ray", cache, n, per_class, reference, seed,
                                        batch_size, progress, is_protocol, method, settings, store=store)
        finally:
            self._close(ray, pool)
        if store is not None:
            store.assemble(chunk_plan(n, batch_size, self.chunk_images))
        return result

    def sample(self, spec, out, cache, n, per_class, seed=0, batch_size=16, chunk_images=None, progress=False,
               restart=False, **settings):
        """Writes the ADM .npz of n images: every shard writes its chunks as part files
        (resuming the chunks an earlier run of the same settings left, as the
        single-process sample does), then the driver copies them in index order into
        one file. Returns the output path."""
        if chunk_images is not None:
            self.chunk_images = chunk_images
        ray = self._connect()
        chunks = chunk_plan(n, batch_size, self.chunk_images)
        _, threads, device = self._layout(ray)
        store = PartStore(out, run_settings(spec, n, per_class, seed, batch_size, chunks, cache, settings,
                                            device=device, threads=threads), restart=restart)
        todo = store.pending(chunks)
        if todo:
            pool, new_worker, _ = self._start(ray, spec, None)
            try:
                shards = self._shards(todo)
                merger = ShardMerger(shards)

                def on_result(result):
                    if merger.add(result):
                        for chunk in result.chunks:
                            store.mark_done(chunk)

                tasks = self._tasks(shards, cache=cache, settings=settings, seed=seed, per_class=per_class,
                                    batch_size=batch_size, parts_of=os.fspath(out))
                self._run(ray, pool, new_worker, tasks, sum(c.size for c in todo), "sample", progress, on_result)
            finally:
                self._close(ray, pool)
        return store.assemble(chunks)

    def images(self, spec, cache, n, per_class, seed=0, batch_size=16, progress=False, **settings):
        """The n images in index order, in memory (small runs and tests)."""
        ray = self._connect()
        pool, new_worker, _ = self._start(ray, spec, None)
        try:
            shards = self._shards(chunk_plan(n, batch_size, self.chunk_images))
            merger = ShardMerger(shards)
            tasks = self._tasks(shards, cache=cache, settings=settings, seed=seed, per_class=per_class,
                                batch_size=batch_size, images=True)
            self._run(ray, pool, new_worker, tasks, n, "generate", progress, merger.add)
        finally:
            self._close(ray, pool)
        return merger.images()


def _reference_stats(path, inception_path):
    """Reference statistics of an .npz: mu/sigma, or computed from its images."""
    with np.load(path) as f:
        has_moments = "mu" in f.files and "sigma" in f.files
    return load_reference(path, None if has_moments else InceptionV3.load(inception_path))


__all__ = ["RayExecutor", "ModelSpec", "ShardTask", "ShardResult", "ShardMerger", "ShardWorker", "as_executor"]
