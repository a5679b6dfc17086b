"""Every notebook in notebooks/ runs top to bottom on the package alone (issue 17), and the
committed files carry no outputs and valid cell ids (nbformat 4.5).

Needs nbclient, nbformat and ipykernel (the `test` extra); skipped only when nbclient is
missing and MARCACHE_REQUIRE_NOTEBOOKS is unset, so CI (which sets it or installs the
extra) cannot pass by skipping."""
import glob
import json
import os

import pytest

import marcache as mc

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(TESTS_DIR), "notebooks", "*.ipynb")))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mc.__file__)))

try:
    import nbclient
    import nbformat
except ImportError:
    if os.environ.get("MARCACHE_REQUIRE_NOTEBOOKS"):
        raise
    pytest.skip("nbclient/nbformat not installed (pip install -e \".[test]\"); set MARCACHE_REQUIRE_NOTEBOOKS=1 "
                "to make this an error", allow_module_level=True)


def test_the_notebooks_exist():
    names = {os.path.basename(p) for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "fid_sweep.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_notebook_is_clean(path):
    raw = json.load(open(path))
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5)
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)  # raises on a missing or malformed cell id
    ids = [c["id"] for c in raw["cells"]]
    assert len(ids) == len(set(ids)), "duplicate cell ids"
    for cell in raw["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, (cell["id"], "has outputs")
        source = "".join(cell["source"])
        # the notebooks must run on an installed package: nothing from the test tree
        assert "../tests" not in source and "mar_fixtures" not in source, cell["id"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    # the kernel imports the same marcache as this test, from a scratch working directory
    monkeypatch.setenv("PYTHONPATH", PACKAGE_ROOT)
    # One engine thread: on a shared 2-core machine under load, OpenMP threads waiting for
    # each other made the same generation 10x slower (measured 383 s against 40 s for 10
    # digits at load average 17). Single-threaded the notebooks take well under a minute idle.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    # every plotting cell produced a figure
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    plotting = [c for c in nb.cells if c.cell_type == "code" and "plt.subplots" in c.source]
    assert len(images) >= len(plotting) >= 1, (len(images), len(plotting))
