"""The layers: the engine core imports alone, and no import runs from a lower layer to a higher one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FRONT_DOORS = ("triton_python_backend_utils", "tritonclient", "dynamo", "build_engine", "client", "load_tests")
# each package may import itself and the ones after it; nothing in backend/ imports build_engine, client, tests
LAYERS = ("backend.dynamo", "backend.triton", "backend.serving", "backend.engine")
DOORS = ("backend.dynamo", "backend.triton")  # siblings: neither imports the other


def test_the_engine_core_imports_alone_and_runs():
    code = ("import sys; import backend.engine.engine, backend.engine.runners.torch_runner; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(FRONT_DOORS)!r}), "
            "sorted(m for m in sys.modules if m.startswith(('backend.serving', 'backend.triton'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []", f"the core pulled in a front door: {out.stdout}"


def test_engine_errors_import_without_torch():
    code = "import sys; import backend.engine.errors; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("layer", LAYERS)
def test_no_import_points_up(layer):
    higher = LAYERS[:LAYERS.index(layer)]
    folder = REPO / layer.replace(".", "/")
    wrong = [(str(f.relative_to(REPO)), name) for f in folder.rglob("*.py") for name in _imports(f)
             if name.startswith(higher) or name.split(".")[0] in ("build_engine", "client", "load_tests", "tests")]
    assert wrong == []


def test_front_doors_do_not_import_each_other():
    wrong = [(str(f.relative_to(REPO)), name) for door in DOORS
             for f in (REPO / door.replace(".", "/")).rglob("*.py") for name in _imports(f)
             if name.startswith(tuple(d for d in DOORS if d != door))]
    assert wrong == []
