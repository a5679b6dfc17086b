"""Command line: python -m marcache {demo, generate, sample, fid, reference, info, flops, caches, convert}.

generate, sample and flops take MAR and VAR models: --cfg for both, --steps,
--cfg-schedule and --temperature for MAR, --top-k, --top-p and --more-smooth for VAR."""
import argparse
import dataclasses
import json
import math
import os
import sys
import time
import typing

# The shipped digits MAR: `--model digits` anywhere a model file is asked for.
DIGITS_MODEL = "digits"


def cache_policies():
    """CLI name -> cache-policy dataclass. The one place a policy is registered for the
    command line; its fields (and their defaults) are read from the dataclass itself."""
    from marcache.policies import POLICIES

    # the class name in lower case: nocache, lazymar, marche, cfgfreelate
    return {policy.__name__.lower(): policy for policy in POLICIES}


def _holds_policy(field):
    """Whether a policy field holds another policy (CfgFreeLate.inner)."""
    from marcache.policies import POLICIES

    default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    return isinstance(default, POLICIES)


def _policy_value(where, value):
    """A policy-valued field from the command line (a policy name: "lazymar") or from a
    JSON file (a name, or an object of fields with "policy": NAME)."""
    if isinstance(value, str):
        value = {"policy": value.strip()}
    if not isinstance(value, dict) or "policy" not in value:
        raise ValueError(f"{where}: expected a policy name or a JSON object with \"policy\"")
    value = dict(value)
    name = value.pop("policy")
    registry = cache_policies()
    if name not in registry:
        raise ValueError(f"{where}: unknown cache policy {name!r}; expected one of {', '.join(registry)}")
    cls = registry[name]
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no field {', '.join(unknown)}")
    return cls(**{k: _coerce(cls.__name__, known[k], v) for k, v in value.items()})


def _field_kind(annotation):
    """(base type, optional) of a policy field's annotation: bool, int, float, str or tuple."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = typing.get_origin(annotation) is typing.Union and len(args) < len(typing.get_args(annotation))
    if optional and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) in (tuple, typing.Tuple) or annotation is tuple:
        return tuple, optional
    return (annotation if annotation in (bool, int, float, str) else str), optional


def _coerce(policy, field, value):
    """A --cache-opt string (or a JSON value) as the field's type; a clear ValueError otherwise."""
    if _holds_policy(field):
        return _policy_value(f"--cache-opt {field.name}={value!r} ({policy} field holding a policy)", value)
    base, optional = _field_kind(field.type)
    where = f"--cache-opt {field.name}={value!r} ({policy} field of type {base.__name__}" \
            f"{' or none' if optional else ''})"
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    if not isinstance(value, str):  # from a JSON file: already typed
        if base is tuple and isinstance(value, list):
            return tuple(value)
        return value
    text = value.strip()
    if base is bool:
        words = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
                 "off": False}
        if text.lower() not in words:
            raise ValueError(f"{where}: expected true or false")
        return words[text.lower()]
    try:
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if base is tuple:
            items = json.loads(text) if text.startswith("[") else [t for t in text.split(",") if t.strip()]
            return tuple(float(t) for t in items)
    except ValueError:
        raise ValueError(f"{where}: not a valid value") from None
    return text


def make_cache(name, options=(), file=None):
    """The policy object of --cache NAME, --cache-opt KEY=VALUE (repeatable) and
    --cache-file FILE (a JSON object of fields, optionally with "policy": NAME;
    --cache-opt wins over the file)."""
    registry = cache_policies()
    fields = {}
    if file is not None:
        with open(file) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--cache-file {file}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--cache-file {file}: expected a JSON object of policy fields, got "
                             f"{type(data).__name__}")
        data = dict(data)
        named = data.pop("policy", None)
        if named is not None:
            if name is not None and named != name:
                raise ValueError(f"--cache {name} but --cache-file {file} says policy {named!r}")
            name = named
        fields.update(data)
    name = name or "nocache"
    if name not in registry:
        raise ValueError(f"unknown cache policy {name!r}; expected one of {', '.join(registry)}")
    cls = registry[name]
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"--cache-opt expects KEY=VALUE, got {option!r}")
        fields[key.strip().replace("-", "_")] = value
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}; its fields: "
                         f"{', '.join(known) or '(none)'} (python -m marcache caches)")
    try:
        return cls(**{k: _coerce(cls.__name__, known[k], v) for k, v in fields.items()})
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _cache_of(args):
    return make_cache(args.cache, args.cache_opt or (), args.cache_file)


def _add_cache_arguments(parser):
    parser.add_argument("--cache", default=None, choices=list(cache_policies()),
                        help="cache policy (default nocache); python -m marcache caches lists them")
    parser.add_argument("--cache-opt", action="append", metavar="KEY=VALUE",
                        help="a field of the policy, e.g. --cache-opt period=5 (repeatable)")
    parser.add_argument("--cache-file", default=None, metavar="JSON",
                        help="a JSON object of the policy's fields (and optionally \"policy\": NAME)")


def _add_progress_arguments(parser):
    parser.add_argument("--quiet", action="store_true", help="no progress bars and no notes on stderr")
    parser.add_argument("--progress", action="store_true",
                        help="progress bars even when stderr is not a terminal (default: only on a terminal)")


def _add_fid_network_arguments(parser):
    """The options of every command that runs the FID network, and the progress switches."""
    parser.add_argument("--batch-size", type=int, default=64, help="images per FID-network batch")
    parser.add_argument("--threads", type=int, default=0, help="OpenMP threads (0 = all)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (the FID network)")
    _add_progress_arguments(parser)


def _progress(args):
    """Bars only on a terminal (so logs get no \\r updates), unless --progress; never with --quiet."""
    if getattr(args, "quiet", False):
        return False
    return bool(getattr(args, "progress", False)) or sys.stderr.isatty()


def _model_path(path):
    if path == DIGITS_MODEL:
        from . import digits

        return digits.MODEL_PATH
    return path


def _default_scale(height, width, target=256):
    """The smallest integer upscale that makes an image at least `target` pixels on its short side."""
    return max(1, math.ceil(target / max(1, min(height, width))))


def _describe_default(value):
    if isinstance(value, tuple) and len(value) > 6:
        return f"({len(value)} values: {value[0]}, {value[1]}, ..., {value[-1]})"
    return repr(value)


def _cmd_caches(args):
    del args
    for name, cls in cache_policies().items():
        doc = (cls.__doc__ or "").strip().splitlines()
        print(f"{name}: marcache.{cls.__name__}  {doc[0] if doc else ''}")
        fields = dataclasses.fields(cls)
        if not fields:
            print("    (no fields)")
        for f in fields:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            base, optional = _field_kind(f.type)
            kind = "policy" if _holds_policy(f) else base.__name__ + (" or none" if optional else "")
            print(f"    {f.name:<22} {kind:<14} default {_describe_default(default)}")
    print("\nuse: --cache NAME --cache-opt FIELD=VALUE ... (or --cache-file policy.json) on generate, sample, "
          "flops and demo")


# Generation flags each model family takes (argparse dest -> flag); the other family's
# flags are refused rather than ignored.
_FAMILY_FLAGS = {
    "mar": {"steps": "--steps", "cfg_schedule": "--cfg-schedule", "temperature": "--temperature"},
    "var": {"top_k": "--top-k", "top_p": "--top-p", "more_smooth": "--more-smooth"},
}


def _generation_settings(args, family, what):
    """model.generate's settings from the command line for a model of `family`: the
    flags given (the model's defaults otherwise), a ValueError for a flag of the other
    family."""
    for other, flags in _FAMILY_FLAGS.items():
        if other == family:
            continue
        given = [flag for dest, flag in flags.items() if getattr(args, dest, None) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to {other.upper()} models "
                             f"only; {what} is a {family.upper()} model")
    settings = {dest: getattr(args, dest) for dest in _FAMILY_FLAGS[family]
                if getattr(args, dest, None) not in (None, False)}
    if getattr(args, "cfg", None) is not None:
        settings["cfg"] = args.cfg
    return settings


def _add_generation_arguments(parser):
    """The sampling flags of generate and sample: --cfg for both families, the MAR and
    the VAR ones (a flag of the other family is an error)."""
    parser.add_argument("--cfg", type=float, default=None,
                        help="guidance scale (MAR: default 1.0 = off; VAR: default 1.5, 0 = off)")
    parser.add_argument("--steps", type=int, default=None, help="MAR: AR steps (default 64)")
    parser.add_argument("--cfg-schedule", default=None, choices=["linear", "constant"],
                        help="MAR: the CFG schedule (default linear)")
    parser.add_argument("--temperature", type=float, default=None, help="MAR: sampling temperature (default 1.0)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="VAR: keep the k largest logits per token (default 900; 0 keeps all)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="VAR: nucleus sampling mass (default 0.96; 0 or 1 keeps all)")
    parser.add_argument("--more-smooth", action="store_true",
                        help="VAR: the official visualisation mode (Gumbel-softmax mix of codewords; not for FID)")


def _cmd_generate(args):
    import marcache as mc
    from .png import grid, write_png

    import numpy as np

    cache = _cache_of(args)
    if args.scale is not None and args.scale < 1:
        raise ValueError(f"--scale must be >= 1, got {args.scale}")
    model = mc.load(_model_path(args.model), vae=args.vae, device=args.device, dtype=args.dtype,
                    threads=args.threads)
    labels = args.labels if args.labels else None
    settings = _generation_settings(args, model.family, args.model)
    images, info = model.generate(labels=labels, num_images=None if labels else args.num_images, seed=args.seed,
                                  first_index=args.first_index, cache=cache, progress=_progress(args),
                                  return_info=True, **settings)
    # Default: a model that decodes its own pixels (the digits MAR, 16 px) is upscaled to at least
    # 256 px; a VAE's output is the model's resolution (256 px for the released MARs) and is kept.
    if args.scale is not None:
        scale = args.scale
    else:
        scale = 1 if args.vae else _default_scale(*images.shape[1:3])
    if scale > 1:  # nearest neighbour: every pixel becomes a scale x scale block
        images = np.repeat(np.repeat(images, scale, axis=1), scale, axis=2)
    write_png(args.out, grid(images, columns=args.columns))
    print(f"wrote {args.out}: {len(images)} images of {images.shape[2]}x{images.shape[1]} px"
          f"{f' (upscaled {scale}x)' if scale > 1 else ''}, cache {type(cache).__name__}, {info.seconds:.1f} s "
          f"({info.seconds / len(images):.2f} s/image, {info.flops / 1e12:.4f} TFLOPs)")


def _cmd_demo(args):
    from .demo import run

    if args.per_class < 1:
        raise ValueError(f"--per-class must be >= 1, got {args.per_class}")
    if args.frontier:
        from .demo import run_frontier

        if args.cache is not None or args.cache_opt or args.cache_file:
            raise ValueError("--frontier runs its own grid of policies (NoCache, LazyMAR, MARche, DiSA and their "
                             "compositions); leave out --cache")
        if args.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {args.batch}")
        out = "frontier.png" if args.out == "demo.png" else args.out
        run_frontier(out=out, per_class=args.per_class, steps=args.steps, cfg=args.cfg, seed=args.seed,
                     threads=args.threads, batch_size=args.batch, quiet=args.quiet)
        return
    policies = None
    if args.cache is not None or args.cache_opt or args.cache_file:
        import marcache as mc

        cache = _cache_of(args)
        # NoCache is the baseline every other column is measured against
        policies = [("NoCache", mc.NoCache())]
        if not isinstance(cache, mc.NoCache):
            policies.append((type(cache).__name__, cache))
    rows, reference = run(out=args.out, per_class=args.per_class, steps=args.steps, cfg=args.cfg, seed=args.seed,
                          threads=args.threads, quiet=args.quiet, policies=policies,
                          var=policies is None and not args.no_var)  # --cache compares one policy with NoCache
    if args.quiet:  # the result, without the running commentary
        from .demo import format_table

        print(format_table(rows, reference))


def _cmd_sample(args):
    import marcache as mc
    from .chunks import PartStore, chunk_plan, iter_generated, run_settings
    from ._progress import Progress
    from .eval import class_major_labels

    if args.n < 1 or args.per_class < 1 or args.batch_size < 1:
        raise ValueError(f"--n, --per-class and --batch-size must be >= 1, got {args.n}, {args.per_class}, "
                         f"{args.batch_size}")
    if args.chunk_size < 1 or args.workers < 1 or args.gpus_per_worker < 0 or args.max_retries < 0:
        raise ValueError(f"--chunk-size and --workers must be >= 1 and --gpus-per-worker and --max-retries >= 0, "
                         f"got {args.chunk_size}, {args.workers}, {args.gpus_per_worker}, {args.max_retries}")
    if args.ray is not None:
        return _cmd_sample_ray(args)
    if args.fid is not None:
        raise ValueError("--fid scores the images on Ray workers without writing them: it needs --ray "
                         "(on one machine: --ray --workers 1); without Ray, run sample, then fid")
    out = args.out or "samples.npz"
    cache = _cache_of(args)
    model = mc.load(_model_path(args.model), vae=args.vae, device=args.device, dtype=args.dtype,
                    threads=args.threads)
    settings = _generation_settings(args, model.family, args.model)
    labels = class_major_labels(args.n, args.per_class, model.config.get("num_classes", 1000))
    chunks = chunk_plan(args.n, args.batch_size, args.chunk_size)
    store = PartStore(out, run_settings(model, args.n, args.per_class, args.seed, args.batch_size, chunks, cache,
                                        settings, threads=args.threads), restart=args.restart)
    todo = store.pending(chunks)
    resumed = args.n - sum(c.size for c in todo)
    if resumed and not args.quiet:
        print(f"resuming {out}: {resumed} of {args.n} images already in {store.dir}", file=sys.stderr)
    bar = Progress(args.n, "sample", enabled=_progress(args))
    bar.update(resumed)
    t0 = time.perf_counter()
    flops = 0.0

    def batches(chunk):
        nonlocal flops
        for images, info, _ in iter_generated(model, chunk, labels, args.batch_size, args.seed, cache, settings):
            flops += info.flops
            bar.update(len(images))
            yield images

    try:
        for chunk in todo:
            store.write_chunk(chunk, batches(chunk))
            store.mark_done(chunk)
    except KeyboardInterrupt:
        done = args.n - sum(c.size for c in store.pending(chunks))
        print(f"{done} of {args.n} images are kept in {store.dir}: run the same command again to resume",
              file=sys.stderr)
        raise
    finally:
        bar.close()
    store.assemble(chunks)
    dt = time.perf_counter() - t0
    made = args.n - resumed
    print(f"wrote {out}: {args.n} images (arr_0 uint8 NHWC), labels i // {args.per_class}, seed {args.seed}, "
          f"cache {type(cache).__name__}"
          f"{f', {resumed} resumed from an earlier run' if resumed else ''}; "
          f"{dt:.1f} s ({dt / max(made, 1):.3f} s/image, {flops / max(made, 1) / 1e12:.3f} TFLOPs/image)")


def _cmd_sample_ray(args):
    from . import distributed

    cache = _cache_of(args)
    address = None if args.ray == "local" else args.ray
    executor = distributed.RayExecutor(address=address, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                                       threads_per_worker=args.threads, max_retries=args.max_retries)
    spec = distributed.ModelSpec(_model_path(args.model), vae_path=args.vae, dtype=args.dtype)
    settings = _generation_settings(args, spec.family(), args.model)
    if args.fid is not None:
        if args.inception is None:
            raise ValueError("--fid needs --inception (the FID-Inception .safetensors)")
        result = executor.score(spec, args.inception, args.fid, cache, args.n, args.per_class, seed=args.seed,
                                batch_size=args.batch_size, chunk_images=args.chunk_size, progress=_progress(args),
                                out=args.out, restart=args.restart, **settings)
        print(f"{args.n} images on {executor.workers} Ray workers, cache {type(cache).__name__}, seed {args.seed}"
              f"{f'; wrote {args.out}' if args.out else ''}")
        print(f"FID: {result.fid:.4f}")
        print(f"IS:  {result.inception_score:.4f} +- {result.is_std:.4f} (torch-fidelity)")
        return
    out = args.out or "samples.npz"
    t0 = time.perf_counter()
    executor.sample(spec, out, cache, args.n, args.per_class, seed=args.seed, batch_size=args.batch_size,
                    chunk_images=args.chunk_size, progress=_progress(args), restart=args.restart, **settings)
    dt = time.perf_counter() - t0
    print(f"wrote {out}: {args.n} images (arr_0 uint8 NHWC), labels i // {args.per_class}, seed {args.seed}, "
          f"cache {type(cache).__name__}, {executor.workers} Ray workers; {dt:.1f} s")


def _cmd_fid(args):
    from .eval import InceptionV3, fid, inception_score, iter_npz_images, load_reference, npz_image_count

    if args.reference == DIGITS_MODEL:
        return _cmd_fid_digits(args)
    if args.inception is None:
        raise ValueError("--inception is required (the FID-Inception .safetensors) unless the reference is "
                         "'digits' (the shipped digits classifier and training digits)")
    inception = InceptionV3.load(args.inception, threads=args.threads, device=args.device)
    if not inception.standard:
        print("warning: this Inception is not the standard FID network (its widths differ); "
              "numbers are not comparable with published FIDs", file=sys.stderr)
    reference = load_reference(args.reference, inception, args.batch_size, progress=_progress(args))
    stats, logits = inception.stats(iter_npz_images(args.samples, args.batch_size), progress=_progress(args),
                                    total=npz_image_count(args.samples))
    value = fid(stats, reference, method=args.method)
    isc = inception_score(logits, splits=min(args.splits, len(logits)), protocol=args.is_protocol)
    print(f"samples:   {args.samples} ({stats.n} images)")
    print(f"reference: {args.reference}")
    print(f"FID: {value:.4f}")
    print(f"IS:  {isc.mean:.4f} +- {isc.std:.4f} ({isc.splits} splits, {args.is_protocol})")


def _cmd_fid_digits(args):
    """fid SAMPLES digits: the digits-FID (the shipped classifier's 64-d features against the
    1,500 training digits) and the classifier's Inception Score, for samples of the digits model."""
    from . import digits
    from .eval import fid, inception_score, iter_npz_images

    stats, logits = digits.sample_stats(iter_npz_images(args.samples, args.batch_size))
    value = fid(stats, digits.reference_stats(), method=args.method)
    isc = inception_score(logits, splits=min(args.splits, len(logits)), protocol=args.is_protocol)
    print(f"samples:   {args.samples} ({stats.n} images)")
    print("reference: the 1,500 training digits (features of the shipped digits classifier)")
    print(f"digits-FID: {value:.4f}")
    print(f"IS:  {isc.mean:.4f} +- {isc.std:.4f} ({isc.splits} splits, {args.is_protocol}; "
          f"the digits classifier's 10 classes)")


def _cmd_reference(args):
    from .eval import InceptionV3, make_reference

    inception = InceptionV3.load(args.inception, threads=args.threads, device=args.device)
    stats = make_reference(args.source, args.out, inception, batch_size=args.batch_size, progress=_progress(args))
    print(f"wrote {args.out}: mu [{stats.dim}], sigma [{stats.dim}, {stats.dim}] over {stats.n} images")


def _cmd_info(args):
    import marcache as mc

    if args.path is None:
        for k, v in mc.build_info().items():
            print(f"{k}: {v}")
        return
    model = mc.load(args.path)
    print(model)
    for k, v in model.config.items():
        print(f"  {k}: {v}")


def _cmd_flops(args):
    import marcache as mc
    from .flops import _family

    cache = _cache_of(args)
    if args.model in mc.MAR_CONFIGS or args.model in mc.VAR_CONFIGS:
        target = args.model
    else:  # a model file (or `digits`): its configuration is read back from the file
        target = mc.load(_model_path(args.model))
    family = _family(target)
    settings = _generation_settings(args, family, args.model)
    settings.pop("cfg_schedule", None)   # the FLOPs do not depend on the schedule or the temperature
    settings.pop("temperature", None)
    settings.pop("top_k", None)          # nor on the sampling filters
    settings.pop("top_p", None)
    rep = mc.flops(target, cache=cache, batch=1, **settings)
    if family == "var":
        cfg = settings.get("cfg", 1.5)
        print(f"{args.model}, cfg {cfg}{', more_smooth' if settings.get('more_smooth') else ''}, cache "
              f"{type(cache).__name__}: {rep.total / 1e12:.4f} TFLOPs per image (GFLOP: blocks' GEMMs "
              f"{rep.linear / 1e9:.2f}, attention {rep.attention / 1e9:.2f}, head {rep.head / 1e9:.2f}, adaLN "
              f"{rep.adaln / 1e9:.2f}, word_embed {rep.embed / 1e9:.2f}"
              f"{f', more_smooth {rep.smooth / 1e9:.2f}' if rep.smooth else ''})")
        print(f"{'scale':>5} {'tokens':>6} {'kv':>5} {'GFLOP':>10} {'share':>7}")
        for s in rep.per_scale:
            print(f"{s['scale']:>5} {s['tokens']:>6} {s['keys']:>5} {s['total'] / 1e9:>10.2f} "
                  f"{100 * s['total'] / rep.total:>6.1f}%")
        return
    steps, cfg = settings.get("steps", 64), settings.get("cfg", 1.0)
    print(f"{args.model}, {steps} steps, cfg {cfg}, cache {type(cache).__name__}: "
          f"{rep.total / 1e12:.4f} TFLOPs per image "
          f"(encoder {rep.encoder / 1e12:.3f}, decoder {rep.decoder / 1e12:.3f}, head {rep.head / 1e12:.3f})")


def _cmd_convert(args):
    from . import convert as conv

    t0 = time.perf_counter()
    plan = conv.convert(args.kind, args.src, args.out, dtype=args.dtype, weights=args.weights, heads=args.heads,
                        progress=_progress(args))
    seconds = time.perf_counter() - t0
    size = os.path.getsize(args.out)
    for note in plan.notes:
        print(note)
    print(f"wrote {args.out}: kind {args.kind}, {len(plan.tensors)} tensors, "
          f"{int(plan.metadata['num_params']):,} parameters as {args.dtype}, {size / 2**20:,.1f} MiB, "
          f"{seconds:.1f} s (source sha256 {plan.metadata['source_sha256'][:16]}...)")


def _convert_epilog():
    from .convert import KINDS

    lines = ["kinds and the official files they take:"]
    for kind, (_, files, what) in KINDS.items():
        lines.append(f"  {kind:<10} {files}")
        lines.append(f"  {'':<10}   {what}")
    lines += ["",
              "Reads PyTorch zip (and legacy) checkpoints without PyTorch through a restricted unpickler,",
              "checks every key and shape against the spec before writing, streams tensor by tensor,",
              "and records kind, hyper-parameters and the source SHA-256 in __metadata__.",
              "",
              "example:",
              "  python -m marcache convert mar pretrained_models/mar/mar_base/checkpoint-last.pth -o mar_base.safetensors",
              "  python -m marcache convert vae-kl16 pretrained_models/vae/kl16.ckpt -o kl16.safetensors"]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m marcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from . import digits

    m = sub.add_parser("demo", help="the shipped digits MAR with every cache policy, and the digits VAR: a PNG "
                                    "and a table",
                       description="Generates digits of every class with the shipped MAR (trained on "
                                   "scikit-learn's digits) for NoCache and every cache policy at its default "
                                   "settings, and with the shipped digits VAR (cfg 1.5, top_k 900, top_p 0.96), "
                                   "prints seconds per image, speedup, class accuracy, digits-FID and "
                                   "pixel fidelity to NoCache, and writes a PNG with one panel per policy and "
                                   "one for the VAR.")
    m.add_argument("--out", default="demo.png")
    m.add_argument("--per-class", type=int, default=10, help="digits of each class per policy")
    m.add_argument("--steps", type=int, default=digits.STEPS)
    m.add_argument("--cfg", type=float, default=digits.CFG)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--threads", type=int, default=0)
    m.add_argument("--quiet", action="store_true", help="print only the table")
    m.add_argument("--no-var", action="store_true", help="leave the digits VAR out (MAR policies only; --cache leaves it out too)")
    m.add_argument("--frontier", action="store_true",
                   help="the speed-quality frontier instead: NoCache, LazyMAR, MARche, DiSA and DiSA composed with "
                        "each, alternating batch by batch; a table (s/image, FLOPs, digits-FID, class accuracy, "
                        "the Pareto set) and a plot (--out, default frontier.png; needs matplotlib)")
    m.add_argument("--batch", type=int, default=8, help="--frontier: images per generate call")
    _add_cache_arguments(m)
    m.set_defaults(func=_cmd_demo)

    g = sub.add_parser("generate", help="generate a PNG grid of class-conditional images")
    g.add_argument("--model", required=True, help="MAR or VAR .safetensors (converted official checkpoint), or "
                                                  "'digits' for the shipped digits MAR")
    g.add_argument("--vae", default=None, help="the decoder .safetensors: KL-16 VAE for a MAR, VQVAE for a VAR "
                                               "(not for pixel-token models such as the digits MAR, which decode "
                                               "themselves)")
    g.add_argument("--labels", type=int, nargs="*", default=[], help="ImageNet class indices (none: unconditional)")
    g.add_argument("--num-images", type=int, default=4, help="images for unconditional generation")
    _add_generation_arguments(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--first-index", type=int, default=0)
    g.add_argument("--columns", type=int, default=None)
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="type of the transformer's Linear weights (16-bit: autocast's arithmetic)")
    g.add_argument("--threads", type=int, default=0)
    g.add_argument("--scale", type=int, default=None,
                   help="integer nearest-neighbour upscale of each image (default: 1 with --vae, whose "
                        "output is the model's resolution; for models that decode themselves, such as the "
                        "16 px digits MAR, the smallest that makes it at least 256 px)")
    _add_cache_arguments(g)
    _add_progress_arguments(g)
    g.add_argument("--out", default="grid.png")
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("sample", help="generate an ADM sample batch (.npz, arr_0 uint8 NHWC) for FID")
    s.add_argument("--model", required=True, help="MAR or VAR .safetensors, or 'digits' for the shipped digits MAR")
    s.add_argument("--vae", default=None, help="the decoder .safetensors: KL-16 VAE for a MAR, VQVAE for a VAR (not "
                                               "needed by models that decode themselves, such as the digits MAR)")
    s.add_argument("--n", type=int, default=50000, help="number of images (50000 for paper numbers)")
    s.add_argument("--per-class", type=int, default=50, help="image i has class i // per_class")
    _add_generation_arguments(s)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    s.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="type of the transformer's Linear weights (16-bit: autocast's arithmetic)")
    s.add_argument("--threads", type=int, default=0, help="OpenMP threads (of each worker with --ray; 0 = all)")
    _add_cache_arguments(s)
    _add_progress_arguments(s)
    s.add_argument("--out", default=None, help="the ADM .npz (default samples.npz; with --fid none unless given)")
    s.add_argument("--chunk-size", type=int, default=1000,
                   help="images per part file (rounded up to whole batches): a killed run, run again with the "
                        "same command, resumes after the last complete part")
    s.add_argument("--restart", action="store_true",
                   help="discard the parts of an earlier run of this --out instead of resuming it")
    s.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray workers: alone, a local Ray on this machine; 'auto' or HOST:PORT joins a "
                        "running cluster (ray start); needs pip install 'marcache[ray]'")
    s.add_argument("--workers", type=int, default=1, help="--ray: workers, each loading the model once")
    s.add_argument("--gpus-per-worker", type=float, default=0,
                   help="--ray: GPUs of each worker (0: the CPU, with --threads threads)")
    s.add_argument("--max-retries", type=int, default=2,
                   help="--ray: times a shard is rerun on a new worker after its worker died")
    s.add_argument("--fid", default=None, metavar="REFERENCE",
                   help="--ray: FID and IS against this reference .npz, from the workers' feature sums (no "
                        "image file unless --out is given); needs --inception")
    s.add_argument("--inception", default=None, help="--fid: the FID-Inception .safetensors")
    s.set_defaults(func=_cmd_sample)

    d = sub.add_parser("fid", help="FID and IS of a sample batch against reference statistics")
    d.add_argument("samples", help="sample batch .npz (arr_0 uint8 NHWC)")
    d.add_argument("reference", help="reference .npz: mu/sigma (adm_in256_stats.npz, ADM reference batch) or arr_0; "
                                     "or 'digits' (samples of the digits MAR: the shipped classifier's features "
                                     "against the training digits, no --inception needed)")
    d.add_argument("--inception", default=None, help="FID-Inception .safetensors (pytorch-fid key names)")
    d.add_argument("--method", default="auto", choices=["auto", "sqrtm", "eigvals", "symmetric"],
                   help="Tr sqrt(S1 S2): sqrtm = ADM evaluator (SciPy), eigvals = torch-fidelity, "
                        "symmetric = NumPy; auto = sqrtm with SciPy, else symmetric")
    d.add_argument("--is-protocol", default="torch-fidelity", choices=["torch-fidelity", "adm"])
    d.add_argument("--splits", type=int, default=10)
    _add_fid_network_arguments(d)
    d.set_defaults(func=_cmd_fid)

    r = sub.add_parser("reference", help="reference statistics (mu, sigma) of an image folder or .npz")
    r.add_argument("source", help="folder of images (PNG; others need Pillow) or .npz with arr_0")
    r.add_argument("out", help="output .npz (mu, sigma, n)")
    r.add_argument("--inception", required=True)
    _add_fid_network_arguments(r)
    r.set_defaults(func=_cmd_reference)

    i = sub.add_parser("info", help="build facts, or the config of a model file")
    i.add_argument("path", nargs="?")
    i.set_defaults(func=_cmd_info)

    f = sub.add_parser("flops", help="FLOPs of a run without running it")
    f.add_argument("model", help="mar_base, mar_large, mar_huge, var_d16, var_d20, var_d24, var_d30, a MAR or VAR "
                                 ".safetensors file, or 'digits'")
    _add_generation_arguments(f)
    _add_cache_arguments(f)
    f.set_defaults(func=_cmd_flops)

    c = sub.add_parser("convert", help="convert an official PyTorch checkpoint to safetensors (no PyTorch needed)",
                       description="Convert an official PyTorch checkpoint to a marcache safetensors file, "
                                   "without PyTorch.",
                       epilog=_convert_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("kind", choices=["mar", "vae-kl16", "var", "vqvae", "inception"], help="what the checkpoint holds")
    c.add_argument("src", help="the PyTorch checkpoint (.pth / .ckpt)")
    c.add_argument("-o", "--out", required=True, help="output .safetensors file")
    c.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="dtype of the floating-point tensors in the output (default fp32)")
    c.add_argument("--weights", default="model_ema", choices=["model_ema", "model"],
                   help="mar only: the EMA weights used for evaluation (default) or the raw weights")
    c.add_argument("--heads", type=int, default=None,
                   help="mar only: attention heads, for widths other than the released 768/1024/1280")
    _add_progress_arguments(c)
    c.set_defaults(func=_cmd_convert)

    k = sub.add_parser("caches", help="the cache policies and their fields with defaults")
    k.set_defaults(func=_cmd_caches)

    # A mistyped option of a command (generate --stpes 8) is reported with that command's
    # usage, not the top level's (argparse's default, since subparsers pass unknown options up).
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub.choices[args.command].error("unrecognized arguments: " + " ".join(unknown))
    t0 = time.perf_counter()
    try:
        args.func(args)
    except (ValueError, KeyError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted after {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
