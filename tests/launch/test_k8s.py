"""The Kubernetes manifests: schema-valid offline, and they place each group in the job.

Core objects are checked against the Kubernetes OpenAPI schemas shipped with
``kubernetes-validate`` (strict: unknown fields fail); the JobSet, TrainJob and TrainingRuntime
against the pydantic models of ``kubeflow-trainer-api``, with a round trip that drops unknown
fields. Semantic checks follow: the Pod Security "restricted" profile, the graceful-stop grace,
metrics that the PodMonitor finds, multi-node groups, spot scheduling, the kustomizations.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from ftlm.errors import ConfigError
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.launch.k8s import COORDINATOR_NODE_LOSS_SECONDS, generate_k8s, read_dashboards
from ftlm.launch.lease import LEADER_LABEL

kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
models = pytest.importorskip("kubeflow_trainer_api.models", reason="pip install -e '.[test]'")

CLUSTER = dict(groups=3, ranks_per_group=2, gpus_per_rank=4, metrics_port=9400,
               node_selector={"nvidia.com/gpu.product": "H100"},
               tolerations=["nvidia.com/gpu:NoSchedule",
                            {"key": "team", "operator": "Equal", "value": "ml"}],
               storage_class="fast", namespace="ml")


def _generate(tmp_path, config, **cluster):
    dashboards = tmp_path / "grafana"
    dashboards.mkdir(exist_ok=True)
    (dashboards / "ftlm.json").write_text('{"title": "ftlm"}\n')
    out = tmp_path / "k8s"
    paths = generate_k8s(config, ClusterConfig(**cluster), out, config.to_toml(),
                         dashboards_dir=dashboards)
    return {p.relative_to(out).as_posix(): yaml.safe_load(p.read_text())
            for p in paths if p.suffix == ".yaml"}


@pytest.fixture
def manifests(tmp_path, tiny_config):
    config = tiny_config()
    return _generate(tmp_path, config, **CLUSTER), config


@pytest.fixture
def multi_node(tmp_path, tiny_config):
    """Two groups of 2 nodes x 4 ranks (1 GPU each), preferring a spot pool."""
    config = tiny_config()
    return _generate(tmp_path, config, groups=2, nodes_per_group=2, ranks_per_group=8,
                     gpus_per_rank=1, namespace="ml", grace_seconds=90,
                     prefer_node_labels={"cloud.google.com/gke-spot": "true"},
                     tolerations=["cloud.google.com/gke-spot=true:NoSchedule"]), config


def _core(docs: dict) -> dict:
    return {k: v for k, v in docs.items() if k.startswith(("base/", "jobs/"))
            and not k.endswith("kustomization.yaml") or k.endswith("grafana-dashboards.yaml")}


def test_core_manifests_pass_strict_kubernetes_schemas(manifests, multi_node):
    docs, _ = manifests
    kinds = {d["kind"] for d in _core(docs).values()}
    assert kinds == {"Secret", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Job",
                     "PodDisruptionBudget", "PriorityClass", "ServiceAccount", "Role", "RoleBinding"}
    for layout in (docs, multi_node[0]):
        for name, doc in _core(layout).items():
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
    # RestartJob is behind a JobSet feature gate: the object says so, and it is not the default.
    assert "RestartJob" in js["metadata"]["annotations"]["ftlm.dev/requires"]
    spec = js["spec"]
    assert [r["name"] for r in spec["replicatedJobs"]] == ["g0", "g1", "g2"]
    rules = spec["failurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["RestartJob"]
    assert rules[0]["targetReplicatedJobs"] == ["g0", "g1", "g2"]
    for rj in spec["replicatedJobs"]:
        assert rj["replicas"] == 1 and rj["template"]["spec"]["backoffLimit"] == 0


def test_trainjobs_match_published_model_and_keep_max_restarts(manifests):
    docs, _ = manifests
    tjs = {k: v for k, v in docs.items() if k.startswith("trainjob/trainjob-")}
    assert len(tjs) == 3
    runtime = docs["trainjob/trainingruntime.yaml"]
    _round_trips(models.TrainerV1alpha1TrainingRuntime, runtime)
    for doc in tjs.values():
        _round_trips(models.TrainerV1alpha1TrainJob, doc)
        assert doc["spec"]["trainer"]["numProcPerNode"] == 2
        assert doc["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
        # Defect 4: a TrainJob cannot patch restarts, so it refers to the job's own runtime ...
        assert doc["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"],
                                             "kind": "TrainingRuntime",
                                             "apiGroup": "trainer.kubeflow.org"}
        assert "--shutdown-timeout=110" in doc["spec"]["trainer"]["command"]
    # ... whose JobSet and Job carry cluster.max_restarts and ignore disruptions.
    spec = runtime["spec"]["template"]["spec"]
    assert spec["failurePolicy"]["maxRestarts"] == 100
    node = spec["replicatedJobs"][0]["template"]["spec"]
    assert node["backoffLimit"] == 100
    assert node["podFailurePolicy"]["rules"][0]["action"] == "Ignore"


def test_group_pods_carry_the_job_environment_and_resources(manifests):
    docs, config = manifests
    for i in range(3):
        pod = docs[f"jobs/job-g{i}.yaml"]["spec"]["template"]
        c = pod["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["FTLM_GROUP_ID"]["value"] == f"g{i}"
        assert env["FTLM_GROUPS"]["value"] == "3"
        job = pod["metadata"]["labels"]["ftlm.dev/job"]
        # Defect 4: no hard-coded cluster.local; the search path completes <svc>.<ns>.svc.
        assert env["FTLM_COORDINATOR"]["value"] == f"http://{job}-coordinator.ml.svc:29510"
        assert env["FTLM_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
        # Every rank of the pod shares one incarnation id, new for each pod.
        assert env["FTLM_INCARNATION"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
        assert c["command"][:5] == ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node=2",
                                    "--shutdown-timeout=110"]
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
    selector = dict(svc["spec"]["selector"])
    assert selector.pop(LEADER_LABEL) == "true"  # set on its own pod by the lease holder
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert docs["monitoring/grafana-dashboards.yaml"]["data"] == {"ftlm.json": '{"title": "ftlm"}\n'}
    pm = docs["monitoring/podmonitor.yaml"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} == {"http", "metrics", "metrics-1"}
    # The coordinator outranks the groups; a voluntary disruption takes one of its two pods at most.
    pc = docs["base/coordinator-priorityclass.yaml"]
    assert dep["spec"]["template"]["spec"]["priorityClassName"] == pc["metadata"]["name"]
    assert "namespace" not in pc["metadata"]  # cluster-scoped
    pdb = docs["base/coordinator-pdb.yaml"]
    assert pdb["spec"]["maxUnavailable"] == 1 and dep["spec"]["replicas"] == 2
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()


def test_a_lost_coordinator_node_frees_its_pod_in_seconds_not_five_minutes(manifests):
    """A node that stops reporting gets the NoExecute taints not-ready/unreachable; without its
    own tolerations the coordinator's pod would get Kubernetes' default 300 s on them, and every
    group would stall that long before a replacement starts."""
    docs, _ = manifests
    pod = docs["base/coordinator-deployment.yaml"]["spec"]["template"]["spec"]
    tolerations = {t["key"]: t for t in pod["tolerations"]}
    assert set(tolerations) == {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
    for t in tolerations.values():
        assert t["effect"] == "NoExecute" and t["operator"] == "Exists"
        assert t["tolerationSeconds"] == COORDINATOR_NODE_LOSS_SECONDS <= 30
    # The groups' pods keep the default: a group restarts on its own, and its node may be back.
    for path, doc in docs.items():
        if path.startswith("jobs/") and doc.get("kind") == "Job":
            keys = {t.get("key") for t in doc["spec"]["template"]["spec"].get("tolerations", [])}
            assert not keys & set(tolerations), path


def test_the_standby_coordinator_holds_a_lease_with_just_the_rights_it_uses(manifests):
    """Two coordinator pods run ``--lease <job>-coordinator`` with their pod's name and namespace,
    on different nodes where they can, under a service account whose Role grants exactly the
    calls the election makes (replayed here against ``ftlm.testing.kube_api``)."""
    from ftlm.launch.lease import LeaseElector, PodLabels
    from ftlm.testing.kube_api import KubeState
    docs, _ = manifests
    dep = docs["base/coordinator-deployment.yaml"]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    name = dep["metadata"]["name"]
    assert c["command"][c["command"].index("--lease") + 1] == name
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    sa = docs["base/coordinator-serviceaccount.yaml"]
    binding = docs["base/coordinator-rolebinding.yaml"]
    role = docs["base/coordinator-role.yaml"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == binding["subjects"][0]["name"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    # Every call of a takeover, a renewal and a release, as the API server would authorise it.
    state = KubeState()
    state.add_pod("a", "10.0.0.1", 29510, namespace="ml")
    state.add_pod("b", "10.0.0.2", 29510, namespace="ml", labels={LEADER_LABEL: "true"})
    e = LeaseElector(state.in_process(), "ml", name, "a")
    assert e.try_acquire_or_renew() and e.try_acquire_or_renew()
    assert PodLabels(state.in_process(), "ml").take_over("a")
    e.release()
    verbs = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch"}
    used = set()
    for method, path, _ in state.calls:
        group = "coordination.k8s.io" if "/leases" in path else ""
        resource = "leases" if "/leases" in path else "pods"
        verb = "list" if method == "GET" and path.split("?")[0].endswith("/pods") else verbs[method]
        used.add((group, resource, verb))
    assert used == granted


def test_without_a_standby_the_coordinator_is_one_pod_recreated(tmp_path, tiny_config):
    docs = _generate(tmp_path, tiny_config(), coordinator_standby=False, namespace="ml")
    dep = docs["base/coordinator-deployment.yaml"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "--lease" not in dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert LEADER_LABEL not in docs["base/coordinator-service.yaml"]["spec"]["selector"]
    assert docs["base/coordinator-pdb.yaml"]["spec"]["maxUnavailable"] == 0
    assert not [p for p in docs if "role" in p or "serviceaccount" in p]


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
    assert sorted(p.name for p in (tmp_path / "k8s" / "jobs").iterdir()) == [
        "job-g0.yaml", "kustomization.yaml"]


def test_written_files_load_back_to_exactly_the_built_objects(tmp_path, tiny_config, monkeypatch):
    from ftlm.launch import k8s
    monkeypatch.setattr(k8s.secrets, "token_hex", lambda n: "ab" * n)
    config = tiny_config()
    docs = _generate(tmp_path, config, **CLUSTER)
    built = k8s.build_manifests(config, ClusterConfig(**CLUSTER), config.to_toml(), "ab" * 32,
                                read_dashboards(tmp_path / "grafana"))
    built.update(k8s.kustomizations(list(built)))
    assert docs == built
    text = (tmp_path / "k8s/base/configmap.yaml").read_text()
    assert "config.toml: |\n" in text  # a config file reads as a literal block, not one long line


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


# -- semantics ------------------------------------------------------------------------------------
def _pod_templates(docs: dict) -> dict[str, dict]:
    """Every pod template of the output, by file (Deployment, Jobs, JobSet's jobs)."""
    out = {}
    for name, doc in docs.items():
        if doc["kind"] in ("Deployment", "Job"):
            out[name] = doc["spec"]["template"]
        elif doc["kind"] == "JobSet":
            for rj in doc["spec"]["replicatedJobs"]:
                out[f"{name}:{rj['name']}"] = rj["template"]["spec"]["template"]
    return out


def restricted_violations(pod: dict) -> list[str]:
    """What breaks the Pod Security Standards' "restricted" profile (kubernetes.io/docs/concepts/
    security/pod-security-standards), checked field by field as the admission controller does."""
    spec, bad = pod["spec"], []
    psc = spec.get("securityContext", {})
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            bad.append(host)
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                       "persistentVolumeClaim", "projected", "secret"}
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= allowed_volumes:
            bad.append(f"volume {v['name']}: {kinds - allowed_volumes}")
    if psc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            bad.append(f"{c['name']}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{c['name']}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{c['name']}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{c['name']}: adds capabilities")
        if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
            bad.append(f"{c['name']}: runAsNonRoot")
        if sc.get("runAsUser") == 0:
            bad.append(f"{c['name']}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{c['name']}: seccompProfile {seccomp}")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                bad.append(f"{c['name']}: hostPort")
    return bad


def test_every_pod_meets_the_restricted_pod_security_profile(manifests, multi_node):
    for docs in (manifests[0], multi_node[0]):
        pods = _pod_templates(docs)
        assert len(pods) >= 3
        for name, pod in pods.items():
            assert restricted_violations(pod) == [], name
    # The check can fail: the pod of before (fsGroup only) did.
    pod = json.loads(json.dumps(pods["jobs/job-g0.yaml"]))
    pod["spec"]["securityContext"] = {"fsGroup": 1000}
    del pod["spec"]["containers"][0]["securityContext"]
    assert len(restricted_violations(pod)) >= 3


def test_graceful_stop_fits_inside_the_grace_period(manifests, multi_node):
    """Defect 2: torchrun SIGKILLs its trainers 30 s after SIGTERM unless told otherwise. Each
    group command is read by torchrun's own argument parser (nothing here runs it), so a flag
    it does not know fails too."""
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    for docs in (manifests[0], multi_node[0]):
        commands = []
        for name, pod in _pod_templates(docs).items():
            if pod["metadata"]["labels"]["ftlm.dev/component"] == "group":
                commands.append((name, pod["spec"]["containers"][0]["command"],
                                 pod["spec"]["terminationGracePeriodSeconds"]))
        for name, doc in docs.items():
            if doc["kind"] == "TrainJob":
                (patch,) = doc["spec"]["runtimePatches"]
                (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
                grace = node["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                commands.append((name, doc["spec"]["trainer"]["command"], grace))
        assert len(commands) >= 4
        for name, command, grace in commands:
            assert command[0] == "torchrun", name
            args = parser.parse_args(command[1:])
            assert args.shutdown_timeout is not None, f"{name}: torchrun's 30 s default applies"
            assert 30 < args.shutdown_timeout < grace, name
            assert "ftlm.cli" in [args.training_script, *args.training_script_args], name


def test_group_metrics_are_on_and_every_rank_port_is_scraped(manifests):
    """Defect 4: the generated args never turned metrics on, only rank 0's port was declared,
    and the scraped series lost their job label (so the dashboards' $job stayed empty)."""
    docs, config = manifests
    pod = docs["jobs/job-g1.yaml"]["spec"]["template"]
    c = pod["spec"]["containers"][0]
    args = c["command"]
    for setting in ("observe.metrics=true", "observe.metrics_host=0.0.0.0",
                    "observe.metrics_port=9400"):
        assert setting in args
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 9400, "metrics-1": 9401}  # 2 ranks: port + rank
    endpoints = docs["monitoring/podmonitor.yaml"]["spec"]["podMetricsEndpoints"]
    rank_ports = [e for e in endpoints if e["port"].startswith("metrics")]
    assert {e["port"] for e in rank_ports} == set(ports)
    assert all(e["honorLabels"] for e in rank_ports)
    (coord,) = [e for e in endpoints if e["port"] == "http"]
    assert coord["relabelings"] == [{"targetLabel": "job", "replacement": config.run.name,
                                     "action": "replace"}]
    # Probes on the trainers, on the declared metrics port.
    assert c["livenessProbe"]["tcpSocket"]["port"] == "metrics"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600


def test_spot_capacity_scheduling_and_disruptions(manifests, multi_node):
    docs, _ = manifests
    for name in ("jobs/job-g0.yaml", "jobs/job-g2.yaml"):
        spec = docs[name]["spec"]
        # A reclaimed or drained pod does not use up the group's restarts.
        assert spec["podFailurePolicy"] == {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}
        assert spec["backoffLimit"] == 100
        tsc = spec["template"]["spec"]["topologySpreadConstraints"][0]
        assert tsc["topologyKey"] == "topology.kubernetes.io/zone"
        assert tsc["labelSelector"]["matchLabels"]["ftlm.dev/component"] == "group"
    pod = multi_node[0]["jobs/job-g0.yaml"]["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["preference"]["matchExpressions"] == [
        {"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]}]
    assert pod["tolerations"] == [{"key": "cloud.google.com/gke-spot", "operator": "Equal",
                                   "value": "true", "effect": "NoSchedule"}]
    # The nodes of one group stay in one zone rather than spread.
    assert "podAffinity" in pod["affinity"] and "topologySpreadConstraints" not in pod


def test_multi_node_groups_meet_through_a_headless_service(multi_node):
    docs, _ = multi_node
    svc = docs["base/nodes-service.yaml"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    job = docs["jobs/job-g1.yaml"]
    name = job["metadata"]["name"]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    pod = spec["template"]
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    c = pod["spec"]["containers"][0]
    cmd = c["command"]
    assert "--standalone" not in cmd and "--nnodes=2" in cmd and "--nproc-per-node=4" in cmd
    assert "--rdzv-backend=c10d" in cmd
    # Pod 0 of the indexed Job is <job>-0.<service>: the c10d store of the group.
    assert f"--rdzv-endpoint={name}-0.{svc['metadata']['name']}.ml.svc:29400" in cmd
    assert f"--rdzv-id={name}" in cmd and "--shutdown-timeout=80" in cmd
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"  # per node
    assert {"name": "rendezvous", "containerPort": 29400, "protocol": "TCP"} in c["ports"]
    # Each local rank exports on metrics_port + LOCAL_RANK, the ports the pod declares.
    script = cmd[cmd.index("-c") + 1]
    assert "FTLM_METRICS_PORT=$((9400 + LOCAL_RANK))" in script
    assert len([p for p in c["ports"] if p["name"].startswith("metrics")]) == 4
    js = docs["jobset/jobset.yaml"]
    _round_trips(models.JobsetV1alpha2JobSet, js)
    assert js["spec"]["network"] == {"enableDNSHostnames": True}
    js_cmd = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["command"]
    assert f"--rdzv-endpoint={js['metadata']['name']}-g0-0-0.{js['metadata']['name']}.ml.svc:29400" in js_cmd
    tj = docs["trainjob/trainjob-g0.yaml"]
    assert tj["spec"]["trainer"]["numNodes"] == 2 and tj["spec"]["trainer"]["numProcPerNode"] == 4


def test_cluster_domain_is_used_when_set(tmp_path, tiny_config):
    docs = _generate(tmp_path, tiny_config(), cluster_domain="corp.internal", namespace="ml")
    env = {e["name"]: e for e in docs["jobs/job-g0.yaml"]["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["FTLM_COORDINATOR"]["value"].endswith(".ml.svc.corp.internal:29510")
    with pytest.raises(ConfigError, match="cluster.cluster_domain"):
        ClusterConfig(cluster_domain="Bad Domain")


def test_kustomizations_list_every_object_and_build(tmp_path, tiny_config):
    docs = _generate(tmp_path, tiny_config(), **CLUSTER)
    out = tmp_path / "k8s"
    for folder in ("base", "jobs", "jobset", "trainjob", "monitoring"):
        k = yaml.safe_load((out / folder / "kustomization.yaml").read_text())
        files = sorted(p.name for p in (out / folder).glob("*.yaml") if p.name != "kustomization.yaml")
        assert sorted(k["resources"]) == files, folder
    top = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert top["resources"] == ["base", "jobs"]  # the default: plain indexed Jobs
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: the kustomization was not built")
    r = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    built = [d for d in yaml.safe_load_all(r.stdout) if d]
    expected = [k for k in docs if k.startswith(("base/", "jobs/")) and "kustomization" not in k]
    assert len(built) == len(expected)
    # A platform team's overlay patches the output without regenerating it.
    overlay = tmp_path / "overlays" / "prod"
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../../k8s"], "images": [{"name": "ftlm", "newTag": "0.2"}],
        "patches": [{"target": {"kind": "Job", "labelSelector": "ftlm.dev/component=group"},
                     "patch": "- op: add\n  path: /spec/template/spec/priorityClassName\n"
                              "  value: batch-low\n"}]}))
    r = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    jobs = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "Job"]
    assert len(jobs) == 3
    for job in jobs:
        pod = job["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == "batch-low"
        assert pod["containers"][0]["image"] == "ftlm:0.2"


def test_repository_dashboards_pick_their_datasource():
    """Defect 4: a hard-coded datasource uid breaks the dashboards in any other Grafana."""
    dashboards = read_dashboards()
    if not dashboards:
        pytest.skip("no Grafana dashboards in the repository")
    for name, text in dashboards.items():
        board = json.loads(text)
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        uids = set(re.findall(r'"uid":\s*"([^"]*)"', json.dumps(board.get("panels", []))
                              + json.dumps(board["templating"])))
        assert uids <= {"${datasource}"}, f"{name}: hard-coded datasource uids {uids}"


def _rank_pods(docs: dict) -> list[tuple[str, dict, list[str], list[dict]]]:
    """(file, pod labels, trainer command, declared container ports) of every group pod of every
    layout: jobs/, jobset/ and trainjob/ (whose ports the job's TrainingRuntime declares)."""
    found = []
    for name, doc in docs.items():
        if doc.get("kind") == "Job":
            templates = [doc["spec"]["template"]]
        elif doc.get("kind") == "JobSet":
            templates = [rj["template"]["spec"]["template"] for rj in doc["spec"]["replicatedJobs"]]
        elif doc.get("kind") == "TrainJob":
            (patch,) = doc["spec"]["runtimePatches"]
            (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            runtime = docs["trainjob/trainingruntime.yaml"]["spec"]["template"]["spec"]
            (container,) = runtime["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
                "containers"]
            found.append((name, node["template"]["spec"]["template"]["metadata"]["labels"],
                          doc["spec"]["trainer"]["command"], container.get("ports", [])))
            continue
        else:
            continue
        for t in templates:
            c = t["spec"]["containers"][0]
            found.append((name, t["metadata"]["labels"], c["command"], c.get("ports", [])))
    return found


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_layouts_ranks_are_scraped(tmp_path, tiny_config, nodes):
    """Every rank of every node, in each layout, serves on a port its pod declares by a name the
    PodMonitor scrapes, and the PodMonitor selects the pod. (The TrainJob's pods declared no port,
    and its node 1's ranks served on metrics_port + global rank.)"""
    docs = _generate(tmp_path, tiny_config(), groups=2, nodes_per_group=nodes,
                     ranks_per_group=4 * nodes, metrics_port=9400)
    monitor = docs["monitoring/podmonitor.yaml"]["spec"]
    scraped = {e["port"] for e in monitor["podMetricsEndpoints"]}
    pods = _rank_pods(docs)
    assert {n.split("/")[0] for n, *_ in pods} == {"jobs", "jobset", "trainjob"}
    for name, labels, command, ports in pods:
        assert monitor["selector"]["matchLabels"].items() <= labels.items(), name
        declared = {p["containerPort"]: p.get("name") for p in ports}
        per_local_rank = any("FTLM_METRICS_PORT=$((9400 + LOCAL_RANK))" in a for a in command)
        assert per_local_rank or nodes == 1, f"{name}: ranks serve on metrics_port + global rank"
        for node in range(nodes):
            for local in range(4):
                port = 9400 + local if per_local_rank else 9400 + node * 4 + local
                assert port in declared, f"{name}: node {node} rank {local} serves on undeclared {port}"
                assert declared[port] in scraped, f"{name}: port {declared[port]} is not scraped"


def test_a_multi_node_pods_liveness_follows_its_torchrun_agent(tmp_path, tiny_config, multi_node):
    """A pod whose torchrun waits in the rendezvous for a replacement node serves no metrics: a
    probe of that port killed the survivor after 6 x 10 s. The probe asks about the agent."""
    from ftlm.launch.rank_probe import main
    docs, _ = multi_node
    for name in ("jobs/job-g0.yaml", "jobset/jobset.yaml"):
        doc = docs[name]
        spec = (doc["spec"]["template"] if doc["kind"] == "Job" else
                doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
        probe = spec["spec"]["containers"][0]["livenessProbe"]
        assert "tcpSocket" not in probe, name
        command = probe["exec"]["command"]
        assert command[:3] == ["python", "-m", "ftlm.launch.rank_probe"], command
        assert int(command[3]) == 9400 and float(command[4]) >= 600
        assert main(command[3:]) in (0, 1)  # its arguments parse (2 would fail every probe)
        assert probe["timeoutSeconds"] > 3  # the port check's own timeout fits inside
    # Single-node pods keep the TCP probe: their torchrun never waits for a peer.
    single = _generate(tmp_path, tiny_config(), groups=2, metrics_port=9400)
    c = single["jobs/job-g0.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["tcpSocket"] == {"port": "metrics"}


def test_the_rank_probe_reads_the_agents_children_and_decides():
    from ftlm.launch.rank_probe import verdict, worker_ages
    assert verdict([], False, 9400, 3600)[0]  # the agent waits for a rendezvous
    assert verdict([30.0], False, 9400, 3600)[0]  # trainers still loading
    assert verdict([7200.0], True, 9400, 3600)[0]
    alive, why = verdict([7200.0, 7300.0], False, 9400, 3600)
    assert not alive and "9400" in why
    # This test's process is a child of its parent: the ages of the parent's children include it.
    ages = worker_ages(agent=os.getppid())
    assert ages and all(a >= 0 for a in ages)
    assert worker_ages(agent=os.getpid()) == []  # no child process of ours is running
