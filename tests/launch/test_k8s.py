"""The Kubernetes manifests: schema-valid offline, and they place each group in the job.

Core objects are checked against the Kubernetes OpenAPI schemas shipped with
``kubernetes-validate`` (strict: unknown fields fail); the JobSet and TrainJob against the
pydantic models of ``kubeflow-trainer-api``, with a round trip that drops unknown fields.
"""

from __future__ import annotations


import pytest
import yaml

from ftlm.errors import ConfigError
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.launch.k8s import generate_k8s

kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
models = pytest.importorskip("kubeflow_trainer_api.models", reason="pip install -e '.[test]'")

CLUSTER = dict(groups=3, ranks_per_group=2, gpus_per_rank=4, metrics_port=9400,
               node_selector={"nvidia.com/gpu.product": "H100"},
               tolerations=["nvidia.com/gpu:NoSchedule",
                            {"key": "team", "operator": "Equal", "value": "ml"}],
               storage_class="fast", namespace="ml")


@pytest.fixture
def manifests(tmp_path, tiny_config):
    config = tiny_config()
    dashboards = tmp_path / "grafana"
    dashboards.mkdir()
    (dashboards / "ftlm.json").write_text('{"title": "ftlm"}\n')
    paths = generate_k8s(config, ClusterConfig(**CLUSTER), tmp_path / "k8s", config.to_toml(),
                         dashboards_dir=dashboards)
    docs = {p.relative_to(tmp_path / "k8s").as_posix(): yaml.safe_load(p.read_text())
            for p in paths if p.suffix == ".yaml"}
    return docs, config


def test_core_manifests_pass_strict_kubernetes_schemas(manifests):
    docs, _ = manifests
    core = {k: v for k, v in docs.items() if k.startswith(("base/", "jobs/"))
            or k.endswith("grafana-dashboards.yaml")}
    kinds = {d["kind"] for d in core.values()}
    assert kinds == {"Secret", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Job"}
    for name, doc in core.items():
        kv.validate(doc, "1.33.0", strict=True)  # raises ValidationError with the field path


def test_strict_validation_would_catch_an_unknown_field(manifests):
    docs, _ = manifests
    job = docs["jobs/job-g0.yaml"]
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 4
    with pytest.raises(kv.ValidationError):
        kv.validate(job, "1.33.0", strict=True)


def _round_trips(model_cls, doc: dict) -> None:
    obj = model_cls.from_dict(doc)
    assert obj.to_dict() == doc, "a field is unknown to the published API model"


def test_jobset_matches_published_model_and_restarts_only_the_failed_group(manifests):
    docs, _ = manifests
    js = docs["jobset/jobset.yaml"]
    _round_trips(models.JobsetV1alpha2JobSet, js)
    spec = js["spec"]
    assert [r["name"] for r in spec["replicatedJobs"]] == ["g0", "g1", "g2"]
    rules = spec["failurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["RestartJob"]
    assert rules[0]["targetReplicatedJobs"] == ["g0", "g1", "g2"]
    for rj in spec["replicatedJobs"]:
        assert rj["replicas"] == 1 and rj["template"]["spec"]["backoffLimit"] == 0


def test_trainjobs_match_published_model(manifests):
    docs, _ = manifests
    tjs = {k: v for k, v in docs.items() if k.startswith("trainjob/")}
    assert len(tjs) == 3
    for doc in tjs.values():
        _round_trips(models.TrainerV1alpha1TrainJob, doc)
        assert doc["spec"]["trainer"]["numProcPerNode"] == 2
        assert doc["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"


def test_group_pods_carry_the_job_environment_and_resources(manifests):
    docs, config = manifests
    for i in range(3):
        pod = docs[f"jobs/job-g{i}.yaml"]["spec"]["template"]
        c = pod["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["FTLM_GROUP_ID"]["value"] == f"g{i}"
        assert env["FTLM_GROUPS"]["value"] == "3"
        job = pod["metadata"]["labels"]["ftlm.dev/job"]
        assert env["FTLM_COORDINATOR"]["value"] == f"http://{job}-coordinator.ml.svc.cluster.local:29510"
        assert env["FTLM_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
        assert c["command"][:4] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
        assert pod["spec"]["tolerations"][0] == {"key": "nvidia.com/gpu", "operator": "Exists",
                                                 "effect": "NoSchedule"}
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"
        claim = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
        assert claim[0]["persistentVolumeClaim"]["claimName"] == docs["base/pvc.yaml"]["metadata"]["name"]


def test_secret_config_and_coordinator_fit_together(manifests):
    docs, config = manifests
    token = docs["base/secret.yaml"]["stringData"]["token"]
    assert len(token) == 64 and int(token, 16) >= 0
    assert docs["base/configmap.yaml"]["data"]["config.toml"] == config.to_toml()
    dep = docs["base/coordinator-deployment.yaml"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][3:8] == ["coordinator", "/etc/ftlm/config.toml", "--host", "0.0.0.0", "--port"]
    assert "tcpSocket" in c["readinessProbe"] and "tcpSocket" in c["livenessProbe"]
    svc = docs["base/coordinator-service.yaml"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert docs["monitoring/grafana-dashboards.yaml"]["data"] == {"ftlm.json": '{"title": "ftlm"}\n'}
    pm = docs["monitoring/podmonitor.yaml"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} == {"http", "metrics"}


def test_missing_dashboards_folder_leaves_a_note(tmp_path, tiny_config):
    config = tiny_config()
    paths = generate_k8s(config, ClusterConfig(), tmp_path / "k8s", config.to_toml(),
                         dashboards_dir=tmp_path / "absent")
    names = {p.name for p in paths}
    assert "NO_DASHBOARDS.txt" in names and "grafana-dashboards.yaml" not in names


def test_regenerating_with_fewer_groups_removes_old_group_files(tmp_path, tiny_config):
    config = tiny_config()
    for groups in (3, 1):
        generate_k8s(config, ClusterConfig(groups=groups), tmp_path / "k8s", config.to_toml(),
                     dashboards_dir=tmp_path)
    assert sorted(p.name for p in (tmp_path / "k8s" / "jobs").iterdir()) == ["job-g0.yaml"]


@pytest.mark.parametrize("field,value,match", [
    ("groups", 0, "cluster.groups=0"), ("memory", "lots", "cluster.memory"),
    ("name", "Bad_Name", "cluster.name"), ("tolerations", ["x:Sometimes"], "effect"),
    ("image_pull_policy", "Maybe", "IfNotPresent"), ("node_selector", ["novalue"], "key=value")])
def test_bad_cluster_values_are_refused_with_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ClusterConfig(**{field: value})


def test_repository_dashboards_ship_as_a_valid_config_map(tmp_path, tiny_config):
    from ftlm.launch.k8s import DASHBOARDS
    if not (DASHBOARDS.is_dir() and any(DASHBOARDS.rglob("*.json"))):
        pytest.skip(f"no Grafana dashboards under {DASHBOARDS}")
    import json
    config = tiny_config()
    generate_k8s(config, ClusterConfig(), tmp_path / "k8s", config.to_toml())
    doc = yaml.safe_load((tmp_path / "k8s/monitoring/grafana-dashboards.yaml").read_text())
    kv.validate(doc, "1.33.0", strict=True)
    assert doc["data"] and all(json.loads(text) for text in doc["data"].values())
