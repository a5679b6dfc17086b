"""What the plans of every kind share: the :class:`Plan` record, picking the state
dict out of a checkpoint, reading a configuration back from tensor shapes, the
key-and-shape comparison against a spec, and telling the kinds apart."""
from .tensors import _FLOAT_DTYPES, _ST_DTYPES, CheckpointError, LazyTensor


def _shape(t):
    return tuple(int(s) for s in t.shape)


class Plan:
    """What convert() will write: `tensors` (name -> LazyTensor, validated),
    `metadata` (str -> str), `dropped` (names read but not written), `notes`."""

    def __init__(self, kind, tensors, metadata, dropped=(), notes=()):
        self.kind = kind
        self.tensors = tensors
        self.metadata = metadata
        self.dropped = list(dropped)
        self.notes = list(notes)


def _fmt_shape(shape):
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _compare(path, what, expected, actual, optional=()):
    """Raises CheckpointError naming every missing key, every unexpected key and
    every wrong shape of `actual` (name -> tensor) against `expected`
    (name -> shape). Keys in `optional` may be present or absent."""
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected and k not in optional]
    wrong = [f"{k}: expected {_fmt_shape(expected[k])}, found {_fmt_shape(_shape(actual[k]))}"
             for k in expected if k in actual and _shape(actual[k]) != tuple(expected[k])]
    if not (missing or extra or wrong):
        return
    lines = [f"{path}: does not match the {what} ({len(expected)} tensors expected, {len(actual)} found):"]
    if missing:
        lines.append(f"  missing ({len(missing)}): " + ", ".join(missing))
    if extra:
        lines.append(f"  unexpected ({len(extra)}): " + ", ".join(extra))
    if wrong:
        lines.append(f"  wrong shape ({len(wrong)}):\n    " + "\n    ".join(wrong))
    raise CheckpointError("\n".join(lines))


def _check_float(path, tensors):
    bad = [f"{k} ({t.dtype})" for k, t in tensors.items() if t.dtype not in _FLOAT_DTYPES]
    if bad:
        raise CheckpointError(f"{path}: these weights are not floating point: " + ", ".join(bad))


def _is_tensor(value):
    """A LazyTensor, or anything with a tuple `shape` and a safetensors `dtype` string
    (the plans only look at names, shapes and dtypes)."""
    return isinstance(value, LazyTensor) or (isinstance(getattr(value, "shape", None), tuple) and
                                             getattr(value, "dtype", None) in _ST_DTYPES)


def _state_dict(root, path, prefer=("model", "state_dict")):
    """The tensor dict of a checkpoint: root[k] for the first k of `prefer`
    present, else root itself. Every value must be a tensor."""
    if not isinstance(root, dict):
        raise CheckpointError(f"{path}: the checkpoint holds a {type(root).__name__}, expected a dict")
    where = None
    sd = root
    for key in prefer:
        if key in root and isinstance(root[key], dict):
            sd, where = root[key], key
            break
    bad = [f"{k!r} ({type(v).__name__})" for k, v in sd.items() if not isinstance(k, str) or not _is_tensor(v)]
    if bad:
        inside = f"['{where}']" if where else ""
        raise CheckpointError(f"{path}{inside} is not a state dict of tensors: " + ", ".join(bad[:20]) +
                              (f" and {len(bad) - 20} more" if len(bad) > 20 else ""))
    return sd, where


def _dim(sd, key, axis):
    t = sd.get(key)
    if t is None or len(t.shape) <= axis:
        return None
    return int(t.shape[axis])


def _vote(*values):
    """The most common of the values that are not None (the earliest on a tie), so
    that one wrongly shaped tensor is reported as such instead of skewing the
    configuration read back from the others."""
    seen = [v for v in values if v is not None]
    if not seen:
        return None
    return max(seen, key=lambda v: (seen.count(v), -seen.index(v)))


def _first(*values):
    for v in values:
        if v is not None:
            return v
    return None


def _count(sd, prefix):
    """1 + the largest i of keys prefix + 'i.' (0 if none)."""
    n = 0
    for k in sd:
        if k.startswith(prefix):
            head = k[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                n = max(n, int(head) + 1)
    return n


def _sniff_kind(sd):
    if "class_emb.weight" in sd and any(k.startswith("diffloss.") for k in sd):
        return "mar"
    if "word_embed.weight" in sd and "pos_1LC" in sd:
        return "var"
    if "quantize.embedding.weight" in sd:
        return "vqvae"
    if "decoder.conv_in.weight" in sd:
        return "vae-kl16"
    if "Mixed_7c.branch_pool.conv.weight" in sd:
        return "inception"
    return None


#: kind -> how messages name it.
_KIND_NAMES = {"mar": "MAR", "vae-kl16": "KL-16 VAE", "var": "VAR", "vqvae": "VQVAE", "inception": "FID Inception"}
_KEYS_SHOWN = 6


def _wrong_kind(path, kind, sd, where=None):
    """The error for a state dict `sd` (found at root[where], or the root itself) that
    is not a `kind` checkpoint: it names the first keys found and, when the keys are
    another kind's, that kind and the command to use, so a newcomer who passed the
    wrong file or the wrong kind sees which one it was, and one with a part of the
    asked kind's keys that it is incomplete."""
    name = _KIND_NAMES[kind]
    inside = f" under ['{where}']" if where else ""
    keys = list(sd)
    shown = ", ".join(map(str, keys[:_KEYS_SHOWN]))
    if len(keys) > _KEYS_SHOWN:
        found_keys = f"its {len(keys)} keys{inside} begin {shown}, ..."
    elif keys:
        found_keys = f"its keys{inside} are {shown}"
    else:
        found_keys = f"it holds no tensors{inside}"
    found = _sniff_kind(sd)
    if found and found != kind:
        hint = f" It looks like a '{found}' checkpoint: use `convert {found}`."
    elif found is None and keys:
        hint = (" The keys match none of the kinds marcache converts (" + ", ".join(_KIND_NAMES) +
                "); check that this is an official checkpoint.")
    elif keys:
        hint = (f" It has keys that only a {name} checkpoint has, but not the ones its configuration is read "
                "from: an incomplete or damaged file?")
    else:
        hint = ""
    return CheckpointError(f"{path}: not a {name} checkpoint ({found_keys}).{hint}")
