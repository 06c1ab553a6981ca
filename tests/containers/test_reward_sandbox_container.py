"""The reward sandbox of the project image, in containers set up as the shipped deployments run the reward role.

The image is ./Dockerfile's, built here under the name docker-compose.yml gives it (a warm build reuses
every layer but the project's: ~30 s). Each container runs a reward worker as the image's user (uid 10001)
holding RELAX_PASSWORD, with a 0600 credentials file of that uid, a module on its import path and a
listening TCP port on its loopback, and scores the hostile reward `tests.security.reward_attacks:escape`
(the function of tests/security/test_reward_sandbox.py) through the sandbox:

- set up exactly as the compose reward service (its `security_opt`, read from docker-compose.yml) and as the
  Kubernetes reward pod (read-only root, every capability dropped, no privilege escalation, the Localhost
  seccomp profile deploy/seccomp/reward-sandbox.json), the attack reaches none of it;
- without the shipped profile, under the engine's default one, the reward is refused with one line.

Podman's own default profile (containers-common) already allows the four calls the sandbox needs; Docker's
and containerd's allow them only with CAP_SYS_ADMIN. The default profile of those engines is therefore
played by the shipped profile without its four additions (`engine_default`), which is what it is built from.

Needs root and Podman (`.ci/containers.sh` readies the host): skipped on a developer machine without
them, failed where containers are required (CI=true or RELAX_REQUIRE_CONTAINERS=1).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.container_host import BUILD_TIMEOUT_S, project_image
from tests.security.test_reward_sandbox import ISOLATED, WORKER

pytestmark = pytest.mark.containers

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
IMAGE = COMPOSE["x-relax"]["image"]
REWARD = COMPOSE["services"]["reward"]
K8S = ROOT / "deploy" / "k8s" / "base"
PROFILE = ROOT / "deploy" / "seccomp" / "reward-sandbox.json"
SANDBOX_CALLS = ("mount", "pivot_root", "umount2", "unshare")
"""What the shipped profile allows beyond the engines' default: the sandbox's namespaces and its view."""
UID = 10001  # the image's `relax` user, which the compose service and the pod run as

# Inside the container, as the worker's uid: its files, then WORKER ($1, with the sandbox config $2), then
# what became of the module it imports and of its working directory.
SCRIPT = """set -e
top=/var/lib/relax/attack
mkdir -p $top/auth $top/modules $top/work
chmod 700 $top/auth
printf 'RELAX_PASSWORD=s3cret\\n' > $top/auth/admin.env
chmod 600 $top/auth/admin.env
printf 'PLANTED = False\\n' > $top/modules/victim.py
cd $top/work
python -c "$1" $top "$2"
python -c 'import json, os, sys; t = sys.argv[1]; print(json.dumps({"victim": open(t + "/modules/victim.py").read(),
    "work": os.listdir(t + "/work"), "uid": os.getuid()}))' $top
"""


@pytest.fixture(scope="module")
def image() -> str:
    """The project image, built from this tree (shared by the tier's modules)."""
    built = project_image()
    assert built == IMAGE, (built, IMAGE)
    return built


def compose_options(profile: Path = PROFILE) -> list[str]:
    """`podman run` options of the compose reward service: its security_opt (the seccomp file as given by
    `profile`), the image's own user, a volume at the work dir."""
    assert "user" not in REWARD and "cap_add" not in REWARD and "privileged" not in REWARD, REWARD
    options = ["-v", "/var/lib/relax"]
    for opt in REWARD["security_opt"]:
        name, _, value = opt.replace(":", "=", 1).partition("=")
        if name == "seccomp":
            assert (ROOT / value).resolve() == PROFILE, value
            value = str(profile)
        options += ["--security-opt", f"{name}={value}"]
    return options


def kubernetes_options() -> list[str]:
    """`podman run` options of the Kubernetes reward pod: pod-defaults.yaml's security context and volumes,
    reward.yaml's seccomp profile (the kubelet's relax/reward-sandbox.json is the shipped file)."""
    defaults = yaml.safe_load((K8S / "pod-defaults.yaml").read_text())["spec"]["template"]["spec"]
    (reward,) = yaml.safe_load((K8S / "reward.yaml").read_text())["spec"]["template"]["spec"]["containers"]
    pod, container = defaults["securityContext"], defaults["containers"][0]["securityContext"]
    assert reward["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "relax/reward-sandbox.json",
    }
    assert container == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    options = ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    options += ["--user", f"{pod['runAsUser']}:{pod['runAsGroup']}", "--security-opt", f"seccomp={PROFILE}"]
    for mount in defaults["containers"][0]["volumeMounts"]:  # emptyDirs: the work dir and /tmp
        options += ["-v", mount["mountPath"]]
    home = next(e["value"] for e in defaults["containers"][0]["env"] if e["name"] == "HOME")
    return [*options, "-e", f"HOME={home}"]


def engine_default(tmp_path: Path) -> Path:
    """The shipped profile with its four additions allowed only with CAP_SYS_ADMIN again, as the engines'
    default profile has them; asserts that these four are all it adds."""
    profile = json.loads(PROFILE.read_text())
    allowed = next(
        r for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not (r.get("includes") or r.get("args"))
    )
    assert set(SANDBOX_CALLS) <= set(allowed["names"]), "the shipped profile must allow the sandbox's calls"
    allowed["names"] = [n for n in allowed["names"] if n not in SANDBOX_CALLS]
    admin = [
        r
        for r in profile["syscalls"]
        if {**r.get("includes", {}), **r.get("excludes", {})} == {"caps": ["CAP_SYS_ADMIN"]}
    ]
    assert {r["action"] for r in admin} == {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}, admin
    for rule in admin:
        assert not set(SANDBOX_CALLS) & set(rule["names"]), rule
        rule["names"] = sorted({*rule["names"], *SANDBOX_CALLS})
    path = tmp_path / "engine-default.json"
    path.write_text(json.dumps(profile))
    return path


def attack(image: str, options: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the reward worker and its hostile reward in a container with `options`; its two JSON lines."""
    args = ["podman", "run", "--rm", *options, "-e", "RELAX_PASSWORD=s3cret", "-e", "PYTHONPATH=/src"]
    args += ["-v", f"{ROOT / 'tests'}:/src/tests:ro", "--entrypoint", "sh", image, "-c", SCRIPT, "sh", WORKER, "{}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) >= 2, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    found, after = json.loads(lines[-2]), json.loads(lines[-1])
    found["log"] = done.stdout + done.stderr
    assert after["uid"] == UID, after
    assert after["victim"] == "PLANTED = False\n" and after["work"] == [], after
    return found, after


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
@pytest.mark.parametrize("deployment", ["compose", "kubernetes"])
def test_as_shipped_the_attack_reaches_nothing(image: str, deployment: str) -> None:
    """The worker's environ and memory, its 0600 credentials file, its loopback port, a module on its
    import path and its working directory are out of the reward's reach."""
    found, _ = attack(image, compose_options() if deployment == "compose" else kubernetes_options())
    assert "components" in found, found
    assert found["components"] == ISOLATED, found
    info = found["info"]
    assert info["uid"] == UID and info["view_refused"] is None and info["namespaces_refused"] is None, info
    assert set(info["namespaces"]) == {"pid", "net", "user"}, info


@pytest.mark.timeout(BUILD_TIMEOUT_S + 300)
def test_without_the_shipped_profile_code_executing_rewards_are_refused_in_one_line(image: str, tmp_path: Path) -> None:
    found, _ = attack(image, compose_options(engine_default(tmp_path)))
    assert "refused" in found, found
    line = found["refused"]
    assert "\n" not in line and line.startswith("the reward sandbox cannot isolate user code"), line
    assert "namespaces refused" in line and "sandbox: unisolated" in line, line
    assert "Traceback" not in found["log"], found["log"]
