"""The tiny random files of the FID / sampling tests (test_eval, test_sample_resume,
test_distributed): a MAR and a KL-16 VAE in the official key layouts (32 x 32 images),
an FID-Inception of the real topology at 1/16 width (128-d features, 10 classes), and
12 random reference images, also as a PNG folder. The numbers test the plumbing, not
image quality."""
import os

import numpy as np
from safetensors.numpy import save_file

from mar_fixtures import write_tiny_mar
from marcache.png import write_png
from reference import inception as RI
from reference import vae as ref_vae
from child_env import child_env

# the working directory of every subprocess: never the clone's root, whose unbuilt
# marcache/ source folder would shadow the installed package
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# ...and this session's import path, so a child finds the marcache under test (an in-place
# build at the root, or the installed one) from there
CHILD_ENV = child_env()


def write_tiny_eval_files(d):
    inception = d / "tiny_inception.safetensors"
    save_file(RI.random_weights(np.random.default_rng(10), divisor=16, num_classes=10), str(inception))
    mar = d / "tiny_mar.safetensors"
    write_tiny_mar(mar)
    vae = d / "tiny_vae.safetensors"
    save_file(dict(ref_vae.random_vae_weights(np.random.default_rng(3), ch=32, ch_mult=(1, 2),
                                              num_res_blocks=1)), str(vae))
    rng = np.random.default_rng(11)
    ref_images = rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    folder = d / "ref_png"
    folder.mkdir()
    for i, img in enumerate(ref_images):
        write_png(folder / f"{i:05d}.png", img)
    return dict(inception=inception, mar=mar, vae=vae, ref_images=ref_images, folder=folder, dir=d)
