"""The dependency rule: schemas <- relax_bus <- workers, no ML library below workers, no import cycles.

The import contracts live in pyproject.toml (`[tool.importlinter]`) and `lint-imports` checks them; the checks
here are the ones it cannot express: the third-party packages schemas may use at all, module names written as
strings and dynamic imports in relax_bus, and what importing the bus loads at run time.
"""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

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


LINT_IMPORTS = pathlib.Path(sys.executable).with_name("lint-imports")


def lint_imports(root: pathlib.Path, config: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--no-cache", str(config)],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        timeout=60,
    )


def test_the_import_contracts_hold():
    """Every contract of pyproject.toml: the layers, no ML library below workers, no import cycles."""
    out = lint_imports(ROOT, ROOT / "pyproject.toml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_import_contracts_would_catch_a_violation(tmp_path):
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    picked = [c for c in contracts if c["id"] in {"top-layers", "no-ml-below-workers"}]
    lines = [
        "[tool.importlinter]",
        'root_packages = ["schemas", "relax_bus", "workers"]',
        "include_external_packages = true",
    ]
    for contract in picked:
        lines.append("[[tool.importlinter.contracts]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in contract.items()]
    (tmp_path / "pyproject.toml").write_text("\n".join(lines) + "\n")
    for package in ("schemas", "relax_bus", "workers"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "relax_bus" / "x.py").write_text("import torch\nfrom workers import roles\n")
    (tmp_path / "workers" / "roles.py").write_text("")
    out = lint_imports(tmp_path, tmp_path / "pyproject.toml")
    assert out.returncode != 0
    assert "relax_bus.x -> torch" in out.stdout, out.stdout
    assert "relax_bus.x -> workers.roles" in out.stdout, out.stdout


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


@pytest.mark.parametrize("cli", ["relax_bus.ops.cli", "workers.cli"])
def test_cli_help_imports_nothing_heavy(cli):
    heavy = ("nats", "pydantic", "msgpack", "yaml", "torch")
    code = (
        f"import sys, {cli}\n"
        f"try:\n    {cli}.main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "[]"
