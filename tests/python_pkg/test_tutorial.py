"""docs/python.md is runnable: its Python blocks run in order, in one namespace."""

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"


def test_tutorial_runs():
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 6
    ns = {"__name__": "tutorial"}
    for i, code in enumerate(blocks):
        if "from tqdm import" in code:
            try:
                import tqdm  # noqa: F401  (optional: only this block needs it)
            except ImportError:
                continue
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), ns)
