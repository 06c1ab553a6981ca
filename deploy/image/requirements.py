"""What the image installs, per variant, from pyproject.toml's pins: the Dockerfile's `requirements` stage.

    python requirements.py write OUT --variant cpu|cuda [--torch-index-url URL]   # OUT/{torch.txt,project.txt,...}
    python requirements.py check-torch cpu|cuda                                   # the installed torch is that build

The variants (the Dockerfile's `VARIANT` build argument):

    cpu   (default)  extras workers + models + omni; torch's CPU build from PyTorch's CPU index
    cuda             extras workers + models + omni + vllm-cuda; torch from PyPI, whose default wheels are the
                     CUDA build (with the NVIDIA libraries as wheels: ~5 GB), the one vLLM's CUDA wheels are built
                     against

Both install the `models` extra (datasets for `type: hf` tasks, math-verify for the `math` reward, gguf and
accelerate for GGUF imports): an image without it fails those tasks with a traceback and scores every `math`
sample 0. Both install the `omni` extra too (soxr and PyAV: resampled audio, mp4/webm video). The torch pin is
the `workers` extra's, so the image follows pyproject.toml without an edit here.
Standard library only: it runs in a bare python image before anything is installed.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
    "cpu": (("workers", "models", "omni"), "https://download.pytorch.org/whl/cpu"),
    "cuda": (("workers", "models", "omni", "vllm-cuda"), "https://pypi.org/simple"),
}
"""Each variant's extras of pyproject.toml and the index torch comes from (unless --torch-index-url names one)."""


def requirements(pyproject: dict[str, object], variant: str) -> tuple[str, list[str]]:
    """(the torch requirement, every requirement of the image) for `variant`; ValueError for an unknown one."""
    if variant not in VARIANTS:
        raise ValueError(f"VARIANT={variant!r}: one of {', '.join(VARIANTS)}")
    project = pyproject["project"]
    assert isinstance(project, dict)
    extras, _ = VARIANTS[variant]
    missing = [e for e in extras if e not in project["optional-dependencies"]]
    if missing:
        raise ValueError(f"pyproject.toml has no extra {missing} (variant {variant})")
    found = list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]
    torch = [r for r in found if r.replace(" ", "").startswith("torch==")]
    if len(torch) != 1:
        raise ValueError(f"expected one torch==... pin among the {variant} requirements, found {torch}")
    return torch[0], found


def write(out: Path, pyproject: Path, variant: str, torch_index_url: str = "") -> None:
    """OUT/torch.txt (the torch pin), OUT/project.txt (every requirement), OUT/torch-index, OUT/variant."""
    torch, found = requirements(tomllib.loads(pyproject.read_text()), variant)
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch.txt").write_text(torch + "\n")
    (out / "project.txt").write_text("\n".join(found) + "\n")
    (out / "torch-index").write_text((torch_index_url or VARIANTS[variant][1]) + "\n")
    (out / "variant").write_text(variant + "\n")


def check_torch(variant: str) -> None:
    """SystemExit unless the installed torch is the build `variant` needs (CUDA or CPU; no GPU needed to tell)."""
    import torch

    cuda = torch.version.cuda
    if (variant == "cuda") != bool(cuda):
        raise SystemExit(f"variant {variant} needs torch's {variant.upper()} build; installed: {torch.__version__}")
    print(f"torch {torch.__version__} (CUDA {cuda or 'none'}) for variant {variant}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write the requirement files of a variant")
    w.add_argument("out", type=Path)
    w.add_argument("--variant", required=True)
    w.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    w.add_argument("--torch-index-url", default="", help="where torch comes from (default: the variant's)")
    c = sub.add_parser("check-torch", help="exit 1 unless the installed torch is the variant's build")
    c.add_argument("variant", choices=sorted(VARIANTS))
    args = parser.parse_args(argv)
    if args.command == "check-torch":
        check_torch(args.variant)
        return 0
    try:
        write(args.out, args.pyproject, args.variant, args.torch_index_url)
    except ValueError as err:
        print(f"requirements: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
