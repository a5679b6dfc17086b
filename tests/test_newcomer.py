"""The demo picture labels its panels (policy, s/image) and its rows (class) (issue 17)."""
import os

import numpy as np

from marcache import demo


def _rows(per_class, names=("NoCache", "LazyMAR", "MARche")):
    rng = np.random.default_rng(0)
    return [dict(policy=name, seconds_per_image=0.125 * (i + 1),
                 images=rng.integers(0, 256, (10 * per_class, 16, 16, 3), dtype=np.uint8))
            for i, name in enumerate(names)]


def test_font_draws_every_character_of_the_labels():
    for ch in "NOCACHELAZYMARMARCHE0123456789./ S/IMAGE-+:" + "abcdefghijklmnopqrstuvwxyz":
        mask = demo.text_image(ch, scale=1)
        assert mask.shape == (5, 4)
        if ch != " ":
            assert mask.sum() > 0, repr(ch)  # a glyph, not a blank fallback
    assert demo.text_image("1", 1)[:, :3].tolist() == [[0, 1, 0], [1, 1, 0], [0, 1, 0], [0, 1, 0], [1, 1, 1]]
    # distinct glyphs: no two characters render the same
    shapes = {demo.text_image(ch, 1).tobytes() for ch in demo._FONT}
    assert len(shapes) == len(demo._FONT)


def test_unlabelled_panels_keep_the_plain_layout():
    img = demo.panels(_rows(2), 2, labels=False)
    assert img.shape == (10 * 48 + 11 * 2, 3 * (2 * 48 + 3 * 2) + 2 * 12, 3)


def test_panels_carry_titles_and_row_labels():
    per_class = 3
    rows = _rows(per_class)
    plain = demo.panels(rows, per_class, labels=False)
    img = demo.panels(rows, per_class)
    band, margin = img.shape[0] - plain.shape[0], img.shape[1] - plain.shape[1]
    assert band > 0 and margin > 0
    # the images are the plain layout, moved by the label band and margin
    np.testing.assert_array_equal(img[band:, margin:], plain)
    panel_width = per_class * 48 + (per_class + 1) * 2
    for i, r in enumerate(rows):
        left = margin + i * (panel_width + 12)
        title = img[:band, left:left + panel_width, 0]
        # exactly the two lines drawn: the policy and its seconds per image
        want = np.full_like(title, 255)
        for top, text in ((2, r["policy"]), (16, f"{r['seconds_per_image']:.3f} s/image")):
            mask = demo.text_image(text, 2)
            if mask.shape[1] > panel_width:
                mask = demo.text_image(text, 1)
            x = (panel_width - mask.shape[1]) // 2
            want[top:top + mask.shape[0], x:x + mask.shape[1]][mask.astype(bool)] = 0
        np.testing.assert_array_equal(title, want, err_msg=r["policy"])
    for c in range(10):
        top = band + 2 + c * 50
        label = img[top:top + 48, :margin, 0]
        ink = (label == 0).astype(np.uint8)
        ys, xs = np.nonzero(ink)
        glyph = ink[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
        want = demo.text_image(str(c), 2)[:, :6]
        want = want[:, np.nonzero(want.any(axis=0))[0].min():np.nonzero(want.any(axis=0))[0].max() + 1]
        np.testing.assert_array_equal(glyph, want, err_msg=f"row label {c}")


def test_auto_progress_shows_only_on_a_terminal(capsys, monkeypatch):
    from marcache._progress import Progress

    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    bar = Progress(3, "x", enabled="auto")
    bar.update(3)
    bar.close()
    assert not bar.enabled and capsys.readouterr().err == ""
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    bar = Progress(3, "x", enabled="auto")
    bar.update(3)
    bar.close()
    assert bar.enabled and "3/3" in capsys.readouterr().err


def test_every_subprocess_a_test_starts_sets_its_working_directory():
    """`python -m pytest` from a clone's root (issue 17): a child process started there
    would import the unbuilt marcache/ source folder instead of the installed package, so
    every subprocess call in the tests names its working directory (cwd=)."""
    import ast
    import glob

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    missing = []
    for path in sorted(glob.glob(os.path.join(tests_dir, "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess" and \
                    node.func.attr in ("run", "Popen", "check_output", "check_call", "call") and \
                    not any(k.arg == "cwd" for k in node.keywords):
                missing.append(f"{os.path.basename(path)}:{node.lineno}")
    assert not missing, f"subprocess calls without cwd=: {missing}"
