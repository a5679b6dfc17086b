"""Per-phase telemetry of a MAR generation (issue 23): each step's encoder, decoder and head
share of the time, FLOPs and weight bytes, and GenerationInfo.phases.

The FLOPs and bytes are checked against counts written here from the model's shapes (the
blocks' GEMMs and attention, each Linear's weights once per call) and against
marcache.flops (the head, for every policy); the seconds against the step's own clock."""
import pytest

import marcache as mc
from mar_fixtures import write_tiny_mar

# 8 AR steps reach LazyMAR's cached steps (from step 5) and MARche's; 16 diffusion steps
# reach the head cache's reused and recomputed evaluations (head_period 7).
STEPS, CFG, DIFFUSION_STEPS = 8, 3.0, 16
# MAR's MLP runs its rows in chunks of this many (csrc/models/mar.c): each chunk reads fc1
# and fc2 again, and the telemetry counts what is streamed.
MLP_CHUNK_ROWS = 4096


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("phases") / "tiny_mar.safetensors"
    write_tiny_mar(path, seed=5, depth=4)  # LazyMAR selects at decoder layer 3
    return path


def attn_flops(n_seq, rows, keys, dim):
    return 2 * n_seq * rows * dim * 3 * dim + 2 * n_seq * rows * dim * dim + 4 * n_seq * rows * keys * dim


def mlp_flops(rows, dim, hidden):
    return 2 * rows * dim * hidden + 2 * rows * hidden * dim


def block_bytes(rows, dim, hidden, itemsize):
    chunks = -(-rows // MLP_CHUNK_ROWS)
    return (4 * dim * dim + chunks * 2 * dim * hidden) * itemsize


def read_block_flops(n_seq, rows, read, keys, dim, hidden):
    """The decoder's last block, whose outputs are read at `read` rows per sequence: k and v
    of every row (the keys), q, attention, proj and the MLP of the read rows alone."""
    every, some = n_seq * rows, n_seq * read
    return 2 * every * dim * 2 * dim + 2 * some * dim * dim + 4 * some * keys * dim + 2 * some * dim * dim + \
        mlp_flops(some, dim, hidden)


@pytest.mark.parametrize("n_images", [1, 8])
@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("bf16", 2)])
def test_nocache_phases_count_every_block_and_weight(tiny_path, backend, n_images, dtype, itemsize):
    """NoCache runs every block on every row but the decoder's last, whose outputs only the
    predicted rows reach the head from: per step the encoder meter holds depth x (attention
    over the P + K rows of 2B sequences + their MLP), the decoder's the same over P + S rows
    for all but its last block, which computes k and v of every row and the rest on the
    predicted rows; the weight bytes are the blocks' Linear matrices (MLP ones once per
    4096-row chunk: 8 images with CFG put 16 x 320 = 5120 decoder rows through two chunks)."""
    m = mc.load(tiny_path, device=backend, dtype=dtype, diffusion_steps=DIFFUSION_STEPS)
    c = m.config
    D, Dd, P, S = c["width"], c["decoder_width"], c["buffer_size"], c["seq_len"]
    _, info = m.generate_tokens(labels=list(range(n_images)), steps=STEPS, cfg=CFG, return_info=True)
    n_seq = 2 * n_images
    for s in info.steps:
        known = S - s["masked_before"]
        enc, dec = s["phases"]["encoder"], s["phases"]["decoder"]
        rows_e, rows_d = P + known, P + S
        want_enc = c["depth"] * (attn_flops(n_seq, rows_e, rows_e, D) + mlp_flops(n_seq * rows_e, D, c["mlp_hidden"]))
        want_dec = (c["decoder_depth"] - 1) * (attn_flops(n_seq, rows_d, rows_d, Dd)
                                               + mlp_flops(n_seq * rows_d, Dd, c["decoder_mlp_hidden"])) + \
            read_block_flops(n_seq, rows_d, s["predicted"], rows_d, Dd, c["decoder_mlp_hidden"])
        assert enc["flops"] == want_enc, (s["step"], enc["flops"], want_enc)
        assert dec["flops"] == want_dec, (s["step"], dec["flops"], want_dec)
        assert enc["weight_bytes"] == c["depth"] * block_bytes(n_seq * rows_e, D, c["mlp_hidden"], itemsize)
        assert dec["weight_bytes"] == (c["decoder_depth"] - 1) * block_bytes(
            n_seq * rows_d, Dd, c["decoder_mlp_hidden"], itemsize) + block_bytes(
            n_seq * s["predicted"], Dd, c["decoder_mlp_hidden"], itemsize)
        # The rest of the step's FLOPs are the two embedding GEMMs: z_proj of the known tokens
        # and decoder_embed of the encoder's rows, on every sequence.
        rest = s["flops"] - enc["flops"] - dec["flops"] - s["phases"]["head"]["flops"]
        assert rest == 2 * n_seq * known * c["token_channels"] * D + 2 * n_seq * rows_e * D * Dd, s["step"]
    if n_images == 8:
        assert max(s["phases"]["decoder"]["weight_bytes"] for s in info.steps) == \
            ((c["decoder_depth"] - 1) * (4 * Dd * Dd + 2 * 2 * Dd * c["decoder_mlp_hidden"]) +
             4 * Dd * Dd + 2 * Dd * c["decoder_mlp_hidden"]) * itemsize


POLICIES = [
    "mc.NoCache()",
    "mc.LazyMAR()",
    "mc.LazyMAR(head_cache=False)",
    "mc.MARche(refresh_period=3, cond_cache=True, head_cache=True)",
    "mc.DiSA()",
    "mc.DiSA(inner=mc.LazyMAR())",
    "mc.CfgFreeLate(0.5)",
]


@pytest.mark.parametrize("policy", POLICIES)
def test_head_phase_equals_marcache_flops_and_the_phases_add_up(tiny_path, backend, policy):
    """The head meter's FLOPs and weight bytes summed over the steps equal marcache.flops's
    head and head_params_read x 4 (fp32) for every policy, head caches and respacings
    included; encoder + decoder + head + other equal the step totals; on a synchronous
    backend every phase is timed and the phases fit inside the steps' own seconds; on CUDA
    none is."""
    cache = eval(policy)
    m = mc.load(tiny_path, device=backend, diffusion_steps=DIFFUSION_STEPS)
    _, info = m.generate_tokens(labels=[3, 7], steps=STEPS, cfg=CFG, cache=cache, return_info=True)
    report = mc.flops(m, steps=STEPS, cfg=CFG, cache=cache, batch=2)
    phases = info.phases
    assert set(phases) == {"encoder", "decoder", "head", "other"}
    assert phases["head"]["flops"] == report.head
    assert phases["head"]["weight_bytes"] == report.head_params_read * 4
    assert phases["encoder"]["flops"] + phases["decoder"]["flops"] + phases["head"]["flops"] \
        + phases["other"]["flops"] == pytest.approx(info.flops, rel=1e-12)
    # The encoder and decoder meters count blocks only: the embeddings are the policies' rest.
    assert 0 < phases["encoder"]["flops"] < report.encoder
    assert 0 < phases["decoder"]["flops"] <= report.decoder
    if backend == "cuda":
        # Host time around queued GPU work is not its compute time: not reported.
        assert all(p["seconds"] is None and p["gflops_per_s"] is None for p in phases.values())
        assert all(p["seconds"] is None for s in info.steps for p in s["phases"].values())
        return
    step_seconds = sum(s["seconds"] for s in info.steps)
    timed = [phases[n]["seconds"] for n in ("encoder", "decoder", "head")]
    assert all(t is not None and t > 0 for t in timed), timed
    assert sum(timed) <= step_seconds * (1 + 1e-9)
    assert phases["other"]["seconds"] == pytest.approx(step_seconds - sum(timed), abs=1e-9)
    for name in ("encoder", "decoder", "head"):
        p = phases[name]
        assert p["gflops_per_s"] == pytest.approx(p["flops"] / p["seconds"] / 1e9)
        assert p["gb_per_s"] == pytest.approx(p["weight_bytes"] / p["seconds"] / 1e9)


def test_cached_steps_meter_fewer_rows_than_full_ones(tiny_path, backend):
    """LazyMAR's cached steps prune decoder rows after the selection layer and reuse the
    encoder: their decoder and encoder meters must hold less than its full steps' of the
    same known-token count would, so the meters follow the rows actually run."""
    m = mc.load(tiny_path, device=backend, diffusion_steps=DIFFUSION_STEPS)
    _, lazy = m.generate_tokens(labels=[3], steps=STEPS, cfg=CFG, cache=mc.LazyMAR(), return_info=True)
    _, full = m.generate_tokens(labels=[3], steps=STEPS, cfg=CFG, return_info=True)
    cached = [i for i, s in enumerate(lazy.steps) if not s["full"]]
    assert cached, "LazyMAR ran no cached step"
    for i in cached:
        for name in ("encoder", "decoder"):
            assert lazy.steps[i]["phases"][name]["flops"] < full.steps[i]["phases"][name]["flops"], (i, name)


def test_var_has_no_mar_phases(tmp_path):
    from var_fixtures import write_var_and_vqvae

    var_path, _, vq_path, _ = write_var_and_vqvae(tmp_path, 1, 2)
    m = mc.load(var_path, vae=vq_path)
    _, _, info = m.generate_tokens(labels=[1], return_info=True)
    assert info.phases is None
