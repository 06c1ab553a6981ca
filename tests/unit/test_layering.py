"""The dependency rule: schemas <- relax_bus <- workers, and no ML library below workers."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAVY = {"torch", "transformers", "vllm", "safetensors", "tokenizers"}


def imported_roots(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for n in names:
                found.setdefault(n.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_schemas_depends_on_pydantic_and_msgpack_only():
    allowed = {"pydantic", "msgpack", "schemas", "__future__"} | set(sys.stdlib_module_names)
    bad = {k: v for k, v in imported_roots("schemas").items() if k not in allowed}
    assert not bad, f"schemas imports {bad}"


def test_relax_bus_imports_no_ml_library_and_no_workers():
    roots = imported_roots("relax_bus")
    bad = {k: v for k, v in roots.items() if k in HEAVY | {"workers"}}
    assert not bad, f"relax_bus imports {bad}"


def module_strings(package: str) -> list[tuple[str, int, str]]:
    """Every string constant in `package` that names a module of the roles' package, and every string
    handed to `importlib.import_module` / `__import__` (a dynamic import the checks above cannot see)."""
    found = []
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.search(r"\bworkers\.\w", node.value)
            ):
                found.append((where, node.lineno, node.value[:60]))
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                if name in {"import_module", "__import__"}:
                    found.append((where, node.lineno, ast.unparse(node)[:60]))
    return found


def test_relax_bus_names_no_roles_module_and_imports_nothing_dynamically():
    assert module_strings("relax_bus") == []


def test_dynamic_import_check_would_catch_one(tmp_path):
    (tmp_path / "relax_bus").mkdir()
    (tmp_path / "relax_bus" / "x.py").write_text(
        "import importlib\nm = importlib.import_module('workers.roles.serve')\nn = __import__(name)\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = module_strings("relax_bus")
    finally:
        ROOT = saved
    assert sorted((line, text.split("(")[0]) for _, line, text in found) == [
        (2, "importlib.import_module"),
        (2, "workers.roles.serve"),
        (3, "__import__"),
    ], found


def test_importing_every_bus_module_loads_no_ml_library():
    modules = [f"relax_bus.{p.stem}" for p in (ROOT / "relax_bus").glob("*.py") if p.stem != "__init__"]
    modules += [f"schemas.{p.stem}" for p in (ROOT / "schemas").glob("*.py") if p.stem != "__init__"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(set(sys.modules) & set({sorted(HEAVY)!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_layering_check_would_catch_a_violation(tmp_path):
    (tmp_path / "relax_bus").mkdir()
    (tmp_path / "relax_bus" / "x.py").write_text("import torch\nfrom transformers import AutoModel\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert set(imported_roots("relax_bus")) == {"torch", "transformers"}
    finally:
        ROOT = saved


@pytest.mark.parametrize("cli", ["relax_bus.cli", "workers.cli"])
def test_cli_help_imports_nothing_heavy(cli):
    heavy = ("nats", "pydantic", "msgpack", "yaml", "torch")
    code = (
        f"import sys, {cli}\n"
        f"try:\n    {cli}.main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[]"
