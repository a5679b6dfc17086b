"""The README's code blocks, for the tests that run them verbatim."""
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def readme_sweep_example():
    """The README's pytest sweep example (the one ```python block defining
    test_cache_keeps_fid)."""
    with open(README) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    found = [b for b in blocks if "def test_cache_keeps_fid" in b]
    assert len(found) == 1, "README must hold exactly one pytest sweep example"
    return found[0]
