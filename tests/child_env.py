"""The environment every test's child Python process runs in.

A child must import the marcache under test. With an in-place build that marcache is found through
the parent's sys.path (pytest puts the checkout and tests/ there), not through anything the child
would find on its own, so the parent's sys.path travels as PYTHONPATH. One helper, so a new
subprocess test cannot forget it (a42adf5 fixed one that had).
"""
import os
import sys


def child_env(**extra):
    """os.environ, plus the parent's import path, plus `extra` (a value of None removes that key)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
