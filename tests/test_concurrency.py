"""Threads and concurrency (issue 18; README "Threads and concurrency").

- Separate models in separate threads run at the same time (the GIL is released while the
  engine computes) and give exactly the results of the same calls made one after another:
  N threads x M calls, for tiny random MAR models and for tiny VAR models with their VQVAE.
  The first call of every thread waits inside its step-0 callback until all N threads are
  inside a generate call, so the calls really overlap, however loaded the machine.
- A second concurrent generate call on one MAR or VAR model is refused with RuntimeError
  (tests/test_bad_input.py has the MAR case; the VAR case is here).
- Decoder calls on one KL-16 VAE / VQVAE from several threads wait for each other (a lock
  per decoder) and give the same images as alone.
"""
import os

import threading

import numpy as np
import pytest

import marcache as mc
from mar_fixtures import write_tiny_mar
from var_api_files import write_tiny_var, write_tiny_vqvae

N_THREADS = 3
M_CALLS = 3
MAR_STEPS = 4
TIMEOUT = 300.0          # seconds a thread may wait for the others: generous for a loaded machine


def _work_list(thread):
    """(label, seed) of each call thread `thread` makes; all N x M differ."""
    return [((7 * thread + 3 * call) % 10, 100 * thread + call) for call in range(M_CALLS)]


def _run_in_threads(body):
    """Runs body(i) in N threads; returns their results in thread order, re-raising the
    first exception a thread raised."""
    results, errors = [None] * N_THREADS, [None] * N_THREADS

    def run(i):
        try:
            results[i] = body(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def _barrier_callback(barrier):
    """A step callback that, at step 0, waits until every thread is inside a generate call."""
    def on_step(info):
        if info["step"] == 0:
            barrier.wait()
    return on_step


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("concurrency")
    paths = {"mar": d / "mar.safetensors", "var": d / "var.safetensors", "vqvae": d / "vqvae.safetensors"}
    write_tiny_mar(paths["mar"], num_classes=10)
    write_tiny_var(paths["var"])
    write_tiny_vqvae(paths["vqvae"])
    # the tiny KL-16 VAE of the converter's fixture (16 latent channels, as the tiny MAR's tokens)
    from marcache import convert as conv

    paths["vae"] = d / "vae.safetensors"
    conv.convert("vae-kl16", os.path.join(os.path.dirname(__file__), "fixtures", "tiny_kl16.ckpt"), paths["vae"])
    return paths


def _mar_call(model, label, seed, callback=None):
    tokens, _ = model._mar.generate(np.array([label, (label + 1) % 10], np.int32), steps=MAR_STEPS, cfg=2.0,
                                    seed=seed, callback=callback)
    return tokens


def test_mar_models_in_threads_equal_sequential_calls(files):
    sequential = mc.load(files["mar"], threads=1)
    reference = [[_mar_call(sequential, label, seed) for label, seed in _work_list(i)] for i in range(N_THREADS)]
    models = [mc.load(files["mar"], threads=1) for _ in range(N_THREADS)]
    all_inside = threading.Barrier(N_THREADS, timeout=TIMEOUT)

    def body(i):
        out = []
        for call, (label, seed) in enumerate(_work_list(i)):
            out.append(_mar_call(models[i], label, seed, _barrier_callback(all_inside) if call == 0 else None))
        return out

    threaded = _run_in_threads(body)
    for i in range(N_THREADS):
        for call in range(M_CALLS):
            assert threaded[i][call].shape[0] == 2
            np.testing.assert_array_equal(threaded[i][call], reference[i][call], err_msg=f"thread {i}, call {call}")
    assert len({r.tobytes() for row in reference for r in row}) == N_THREADS * M_CALLS   # the calls differ


def _var_tokens(model, label, seed, callback=None):
    (tokens, f_hat), _ = model._var.generate(np.array([label], np.int32), model._vqvae, cfg=1.5, top_k=900, top_p=0.96,
                                             seed=seed, cache=mc.NoCache().as_dict(), callback=callback)
    return tokens, f_hat


def test_var_models_in_threads_equal_sequential_calls(files):
    """VAR transformer and VQVAE per thread: the tokens and the decoded images of every call
    equal the same call made alone, bitwise (and the public generate gives those images)."""
    sequential = mc.load(files["var"], vae=files["vqvae"], threads=1)
    reference = [[sequential.generate(labels=[label], seed=seed) for label, seed in _work_list(i)]
                 for i in range(N_THREADS)]
    models = [mc.load(files["var"], vae=files["vqvae"], threads=1) for _ in range(N_THREADS)]
    all_inside = threading.Barrier(N_THREADS, timeout=TIMEOUT)

    def body(i):
        out = []
        for call, (label, seed) in enumerate(_work_list(i)):
            _, f_hat = _var_tokens(models[i], label, seed, _barrier_callback(all_inside) if call == 0 else None)
            out.append(models[i].decode(f_hat))
        return out

    threaded = _run_in_threads(body)
    for i in range(N_THREADS):
        for call in range(M_CALLS):
            np.testing.assert_array_equal(threaded[i][call], reference[i][call], err_msg=f"thread {i}, call {call}")
    assert len({r.tobytes() for row in reference for r in row}) > 1


def test_a_second_call_on_one_var_model_is_refused(files):
    """Two overlapping generate calls on one VAR: the first holds the model in its step-0
    callback until the second has been tried; the second is refused with RuntimeError and
    the first's result equals a solo run."""
    model = mc.load(files["var"], vae=files["vqvae"], threads=1)
    solo = _var_tokens(model, 3, 5)[0]
    first_inside, second_tried = threading.Event(), threading.Event()
    outcome = {}

    def hold(info):
        if info["step"] == 0:
            first_inside.set()
            assert second_tried.wait(TIMEOUT)

    def first():
        outcome["first"] = _var_tokens(model, 3, 5, hold)[0]

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert first_inside.wait(TIMEOUT)
        with pytest.raises(RuntimeError, match="this VAR model is already running a call in another thread"):
            model.generate_tokens(labels=[3], seed=5)
    finally:
        second_tried.set()
        thread.join(TIMEOUT)
    np.testing.assert_array_equal(outcome["first"], solo)
    np.testing.assert_array_equal(_var_tokens(model, 3, 5)[0], solo)


@pytest.mark.parametrize("family", ["var", "mar"])
def test_decoders_shared_by_threads_wait_for_each_other(files, family):
    """One model's decoder (VAR: the VQVAE; MAR: the KL-16 VAE) decoding in N threads at
    once: no refusal, each thread's images equal the same decode alone (the decoder's lock
    serialises the calls)."""
    if family == "var":
        model = mc.load(files["var"], vae=files["vqvae"], threads=1)
        latents = [_var_tokens(model, label, 40 + label)[1] for label in range(N_THREADS)]
    else:
        model = mc.load(files["mar"], vae=files["vae"], threads=1)
        latents = [_mar_call(model, label, 40 + label) for label in range(N_THREADS)]
    alone = [model.decode(x) for x in latents]
    start = threading.Barrier(N_THREADS, timeout=TIMEOUT)

    def body(i):
        start.wait()
        return [model.decode(latents[i]) for _ in range(M_CALLS)]

    for i, images in enumerate(_run_in_threads(body)):
        for got in images:
            np.testing.assert_array_equal(got, alone[i])
