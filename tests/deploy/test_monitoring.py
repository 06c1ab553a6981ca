"""The compose `monitoring` profile: Prometheus scrapes the metrics service where it listens, Grafana reads
that Prometheus, and every series the provisioned dashboard plots is one the metrics role exports.

Offline and without containers: the files are read as the services would read them, and the exported
series are those of a real `PrometheusSink` fed one step, one event and the server state. (The compose
test runs the profile's Prometheus for real and queries it.)"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml

from schemas import Metric, RunEvent
from workers.config import load_config
from workers.metrics.prometheus import PrometheusSink

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "relax-run.json"
PROMQL_WORDS = {"rate", "increase", "sum", "by", "le", "histogram_quantile", "label_values", "run", "hop", "role"}


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def _exported_series() -> set[str]:
    """Names of every series a metrics role with some data serves (histogram parts included)."""
    sink = PrometheusSink("r", "127.0.0.1", 0)
    try:
        values = {"reward_mean": 0.5, "version": 1.0, "lag_mean": 1.0, "lag_max": 1.0, "lag_1": 2.0}
        values |= {"rollout_tokens_per_s": 900.0, "train_s": 0.1}  # the keys of an actor's step (actor.py)
        sink.observe(Metric(run="r", step=1, values=values))
        sink.observe(RunEvent(run="r", event="group_dropped"))
        sink.observe(RunEvent(run="r", event="group_requeued"))
        sink.set_server_state({"prompts": 1}, {"rollout": 1}, dead_letters=0)
        with urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        sink.close()
    return set(re.findall(r"^([a-z_]+)\{", text, re.MULTILINE))


def _expressions(panels: list[dict]) -> list[str]:
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_prometheus_scrapes_the_metrics_service_where_it_listens():
    services = _compose()
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = [t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    config = load_config(ROOT / "examples" / "compose.yaml").metrics
    assert targets == [f"metrics:{config.prometheus_port}"] and config.prometheus_host == "0.0.0.0", targets
    assert any(p.endswith(f":{config.prometheus_port}") for p in services["metrics"]["ports"]), services["metrics"]
    prometheus = services["prometheus"]
    assert "monitoring" in prometheus["profiles"] and "monitoring" in services["grafana"]["profiles"]
    assert "./deploy/monitoring/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "--web.listen-address=:9090" in prometheus["command"]
    # Loopback only, like every other published port of the stack.
    for name in ("metrics", "prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), (name, services[name]["ports"])


def test_grafana_reads_that_prometheus_and_provisions_the_dashboard():
    provisioning = MONITORING / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "relax.yaml").read_text())["providers"]
    grafana = _compose()["grafana"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounted[provider["options"]["path"]] == "./deploy/monitoring/grafana/dashboards"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} | {
        p["datasource"]["uid"] for p in dashboard["panels"]
    }
    assert uids == {source["uid"]}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("reward", "staleness", "queue", "throughput"):  # what the dashboard is for
        assert topic in titles, (topic, titles)


def test_every_series_on_the_dashboard_is_exported_by_the_metrics_role():
    exported = _exported_series()
    dashboard = json.loads(DASHBOARD.read_text())
    named = set()
    for expr in _expressions(dashboard["panels"]):
        named |= {w for w in re.findall(r"\b([a-z_]+)\b(?=\{|\[|\))", expr) if w not in PROMQL_WORDS}
    assert named, "no series found in the dashboard's expressions"
    assert named <= exported, f"plotted but never exported: {sorted(named - exported)}"
    variable = dashboard["templating"]["list"][0]
    assert variable["name"] == "run" and "relax_step" in variable["definition"]
