"""The deploy files follow the role registry: `python -m workers.launch.deploy_files` writes each role's
compose services and Kubernetes manifest, and the committed files are what it writes.

Offline and fast: the files are parsed as YAML here; tests/compose validates them with docker-compose
and tests/deploy/test_k8s.py renders and validates the manifests with kubectl.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from workers.launch import deploy_files
from workers.role_registry import ROLE_NAMES, ROLES, RoleDef, RoleDeploy

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ("docker-compose.yml", "docker-compose.auth.yml", "docker-compose.cluster.yml", "docker-compose.gpu.yml")
K8S_BASE = Path("deploy/k8s/base")
K8S_GPU = Path("deploy/k8s/overlays/gpu/kustomization.yaml")


def worker_role(command: Any) -> str | None:
    """The ROLE of a `relax ... worker ROLE ...` command (a list or a string), else None."""
    words = (" ".join(command) if isinstance(command, list) else str(command or "")).split()
    return words[words.index("worker") + 1] if "worker" in words[:-1] else None


def services(text: str) -> dict[str, Any]:
    found: dict[str, Any] = yaml.safe_load(text)["services"]
    return found


def copy_of_deploy_files(to: Path) -> Path:
    for name in COMPOSE:
        shutil.copy(ROOT / name, to / name)
    shutil.copytree(ROOT / K8S_BASE, to / K8S_BASE)
    (to / K8S_GPU).parent.mkdir(parents=True)
    shutil.copy(ROOT / K8S_GPU, to / K8S_GPU)
    return to


def test_the_committed_files_are_what_the_registry_generates() -> None:
    stale = deploy_files.differences()
    assert not stale, f"run `python -m workers.launch.deploy_files`: {stale} differ from the role registry"


def test_each_compose_file_has_one_service_per_registry_role_and_no_other() -> None:
    base = services((ROOT / "docker-compose.yml").read_text())
    runs = {name: worker_role(s.get("command")) for name, s in base.items()}
    assert {name: role for name, role in runs.items() if role is not None} == {r: r for r in ROLE_NAMES}, runs
    auth = services((ROOT / "docker-compose.auth.yml").read_text())
    users = {s["environment"]["AUTH_ROLE"] for s in auth.values() if "AUTH_ROLE" in s.get("environment", {})}
    assert users == {*ROLE_NAMES, "admin", "observer"}, users
    for role in ROLE_NAMES:
        assert auth[role]["volumes"] == [f"auth-{role}:/auth/{role}:ro"], auth[role]
        assert f"auth-{role}:/auth/{role}" in auth["auth"]["volumes"], role
    cluster = services((ROOT / "docker-compose.cluster.yml").read_text())
    for role in ROLE_NAMES:
        assert "nats-2" in cluster[role]["environment"]["RELAX_NATS_URL"], (role, cluster[role])
    gpu = services((ROOT / "docker-compose.gpu.yml").read_text())
    assert {name: s["image"] for name, s in gpu.items()} == {n: deploy_files.CUDA_IMAGE for n in (*ROLE_NAMES, "init")}
    for name, parsed in (("auth", auth), ("cluster", cluster), ("gpu", gpu)):
        # An override's own services are these tools; any other name there is a role left behind.
        extra = set(parsed) - set(base) - {"auth", "routes", "nats-2", "nats-3", "inspect"}
        assert not extra, f"docker-compose.{name}.yml has services docker-compose.yml lacks: {extra}"


def test_a_new_role_is_deployed_by_rerunning_the_generator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    judge = RoleDef("judge", input="scored", output=lambda c: "train", grants={}, module="workers.roles.judge")
    monkeypatch.setattr(deploy_files, "ROLES", (*ROLES, judge))
    root = copy_of_deploy_files(tmp_path)
    changed = deploy_files.write(root)
    assert set(changed) == {*COMPOSE, str(K8S_BASE / "kustomization.yaml"), str(K8S_BASE / "judge.yaml")}, changed
    assert "judge" in services((root / "docker-compose.gpu.yml").read_text())  # the CUDA image, and no GPU
    assert deploy_files.differences(root) == []  # written once, it is stable

    base = services((root / "docker-compose.yml").read_text())
    assert worker_role(base["judge"]["command"]) == "judge" and base["judge"]["restart"] == "on-failure"
    auth = services((root / "docker-compose.auth.yml").read_text())
    assert (
        auth["judge"]["environment"] == {"AUTH_ROLE": "judge"}
        and "auth-judge" in yaml.safe_load((root / "docker-compose.auth.yml").read_text())["volumes"]
    )
    assert "judge" in services((root / "docker-compose.cluster.yml").read_text())
    (deployment,) = yaml.safe_load_all((root / K8S_BASE / "judge.yaml").read_text())
    assert deployment["kind"] == "Deployment" and deployment["metadata"]["name"] == "relax-judge"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert worker_role(container["args"]) == "judge"
    assert container["envFrom"] == [{"secretRef": {"name": "relax-judge"}}]
    kustomization = yaml.safe_load((root / K8S_BASE / "kustomization.yaml").read_text())
    assert "judge.yaml" in kustomization["resources"]


def test_a_role_gone_from_the_registry_leaves_no_deploy_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deploy_files, "ROLES", tuple(r for r in ROLES if r.name != "metrics"))
    root = copy_of_deploy_files(tmp_path)
    deploy_files.write(root)
    assert not (root / K8S_BASE / "metrics.yaml").exists()
    assert "metrics.yaml" not in yaml.safe_load((root / K8S_BASE / "kustomization.yaml").read_text())["resources"]
    for name in COMPOSE:
        assert "metrics" not in services((root / name).read_text()), name
    assert (root / K8S_BASE / "actor.yaml").exists(), "a hand-written manifest is never deleted"


def test_a_file_without_its_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="no region `# >>> generated: roles`"):
        deploy_files.fill("services:\n  nats: {}\n", {"roles": ["  feeder: {}"]}, "docker-compose.yml")


def test_a_role_given_gpus_gets_its_devices_in_both_gpu_variants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpus` in a registry entry is all it takes: its own devices in docker-compose.gpu.yml (after the other GPU
    roles' default indices) and `nvidia.com/gpu` plus the GPU nodes' patch in the Kubernetes overlay."""
    judge = RoleDef(
        "judge",
        input="scored",
        output=lambda c: "train",
        grants={},
        module="workers.roles.judge",
        deploy=RoleDeploy(gpus=2),
    )
    monkeypatch.setattr(deploy_files, "ROLES", (*ROLES, judge))
    root = copy_of_deploy_files(tmp_path)
    assert str(K8S_GPU) in deploy_files.write(root)
    before = sum(r.deploy.gpus for r in ROLES)
    devices = services((root / "docker-compose.gpu.yml").read_text())["judge"]["deploy"]["resources"]["reservations"]
    (device,) = devices["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], device
    assert device["device_ids"] == [f"${{RELAX_GPU_JUDGE_{i}:-{before + i}}}" for i in range(2)], device
    patches = yaml.safe_load((root / K8S_GPU).read_text())["patches"]
    mine = [p for p in patches if p.get("target", {}).get("name") == "relax-judge"]
    assert [p.get("path") for p in mine] == ["gpu-nodes.yaml", None], mine
    limits = yaml.safe_load(mine[1]["patch"])["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "2"}, limits
