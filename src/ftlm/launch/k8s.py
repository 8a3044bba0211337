"""Kubernetes manifests for a fault-tolerant job (``ftlm launch k8s``).

Pure functions build each object as a dict from the run config and the ``[cluster]`` section;
``generate_k8s`` writes them, one object per file, in folders that are applied together:

* ``base/``: the job token Secret, the config ConfigMap, the checkpoint PVC, the coordinator
  Deployment and Service (always needed);
* ``jobset/jobset.yaml``: the replica groups as one JobSet, one replicated job per group, whose
  failure policy restarts only the failed group's Job (``RestartJob``);
* ``jobs/``: the same groups as one indexed Job each, for clusters without JobSet;
* ``trainjob/``: one Kubeflow Trainer v2 TrainJob per group;
* ``monitoring/``: a PodMonitor (Prometheus Operator) and the Grafana dashboards as a ConfigMap.

It does not talk to a cluster: ``kubectl apply`` does (docs/kubernetes.md).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from ftlm.config import RunConfig
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.launch.yaml_text import dump_yaml

CONFIG_DIR = "/etc/ftlm"  # the ConfigMap's mount: config.toml
TOKEN_DIR = "/var/run/ftlm"  # the Secret's mount: token (the coordinator reads a file)
LABEL = "ftlm.dev/job"
DASHBOARDS = Path(__file__).resolve().parents[3] / "deploy" / "grafana"


class Names:
    """Object names of one job, derived from its name."""

    def __init__(self, run: RunConfig, cluster: ClusterConfig):
        self.job = cluster.job_name(run.run.name)
        self.secret = f"{self.job}-token"
        self.config = f"{self.job}-config"
        self.claim = cluster.claim_name(self.job)
        self.coordinator = f"{self.job}-coordinator"
        self.url = (f"http://{self.coordinator}.{cluster.namespace}.svc.cluster.local:"
                    f"{cluster.coordinator_port}")


def _meta(name: str, names: Names, cluster: ClusterConfig, component: str,
          **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": cluster.namespace,
            "labels": {LABEL: names.job, "ftlm.dev/component": component}, **extra}


def secret(names: Names, cluster: ClusterConfig, token: str) -> dict[str, Any]:
    """The shared job token (DESIGN.md section 9): a fresh one per generation."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(names.secret, names, cluster, "token"),
            "stringData": {"token": token}}


def config_map(names: Names, cluster: ClusterConfig, config_toml: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(names.config, names, cluster, "config"),
            "data": {"config.toml": config_toml}}


def claim(names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """Durable storage shared by the groups: run directory, events and checkpoints."""
    spec: dict[str, Any] = {"accessModes": [cluster.storage_access_mode],
                            "resources": {"requests": {"storage": cluster.storage_size}}}
    if cluster.storage_class:
        spec["storageClassName"] = cluster.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(names.claim, names, cluster, "storage"), "spec": spec}


def _scrape(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}


def coordinator_deployment(run: RunConfig, names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    port = cluster.coordinator_port
    # /status and /metrics need the token, so the probes only check that the port accepts.
    probe = {"tcpSocket": {"port": "http"}, "periodSeconds": 5, "timeoutSeconds": 2}
    labels = {LABEL: names.job, "ftlm.dev/component": "coordinator"}
    container = {
        "name": "coordinator", "image": cluster.image, "imagePullPolicy": cluster.image_pull_policy,
        "command": ["python", "-m", "ftlm.cli", "coordinator", f"{CONFIG_DIR}/config.toml",
                    "--host", "0.0.0.0", "--port", str(port),
                    "--set", f"ft.token_file={TOKEN_DIR}/token",
                    "--set", f"ft.groups={cluster.groups}"],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {**probe, "initialDelaySeconds": 2},
        "livenessProbe": {**probe, "initialDelaySeconds": 10, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                      "limits": {"memory": "2Gi"}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}],
    }
    pod: dict[str, Any] = {"containers": [container], "volumes": [
        {"name": "config", "configMap": {"name": names.config}},
        {"name": "token", "secret": {"secretName": names.secret}}]}
    if cluster.service_account:
        pod["serviceAccountName"] = cluster.service_account
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(names.coordinator, names, cluster, "coordinator"),
            # Recreate: two coordinators of one job must never answer at the same time.
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels, "annotations": _scrape(port)},
                                  "spec": pod}}}


def coordinator_service(names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(names.coordinator, names, cluster, "coordinator"),
            "spec": {"selector": {LABEL: names.job, "ftlm.dev/component": "coordinator"},
                     "ports": [{"name": "http", "port": cluster.coordinator_port,
                                "targetPort": "http", "protocol": "TCP"}]}}


def group_env(names: Names, cluster: ClusterConfig, group: str) -> list[dict[str, Any]]:
    """The environment of DESIGN.md section 10 that places a group in the job (torchrun sets the rest)."""
    return [{"name": "FTLM_COORDINATOR", "value": names.url},
            {"name": "FTLM_GROUP_ID", "value": group},
            {"name": "FTLM_GROUPS", "value": str(cluster.groups)},
            {"name": "FTLM_TOKEN", "valueFrom": {"secretKeyRef": {"name": names.secret,
                                                                  "key": "token"}}},
            # Other groups reach this pod's rendezvous store and state server at its own IP.
            {"name": "FTLM_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"}]


def train_args(run: RunConfig, names: Names, cluster: ClusterConfig) -> list[str]:
    """``ftlm train`` and the overrides that place its run directory on the durable volume."""
    return ["-m", "ftlm.cli", "train", f"{CONFIG_DIR}/config.toml",
            # The coordinator comes from FTLM_COORDINATOR; a URL left in the config would win.
            "--set", "ft.coordinator=",
            "--set", f"run.dir={cluster.mount_path}/{names.job}",
            "--set", "observe.progress=false"]


def group_pod(run: RunConfig, names: Names, cluster: ClusterConfig, group: str) -> dict[str, Any]:
    """The pod template of one replica group: torchrun with one process per rank."""
    requests: dict[str, Any] = {"cpu": cluster.cpu, "memory": cluster.memory}
    limits: dict[str, Any] = {"memory": cluster.memory}
    if cluster.gpus_per_group:
        requests["nvidia.com/gpu"] = str(cluster.gpus_per_group)
        limits["nvidia.com/gpu"] = str(cluster.gpus_per_group)
    container: dict[str, Any] = {
        "name": "trainer", "image": cluster.image, "imagePullPolicy": cluster.image_pull_policy,
        "command": ["torchrun", "--standalone", "--nnodes=1",
                    f"--nproc-per-node={cluster.ranks_per_group}",
                    *train_args(run, names, cluster)],
        "env": group_env(names, cluster, group),
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "storage", "mountPath": cluster.mount_path},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    annotations: dict[str, str] = {}
    if cluster.metrics_port:
        container["ports"] = [{"name": "metrics", "containerPort": cluster.metrics_port,
                               "protocol": "TCP"}]
        annotations = _scrape(cluster.metrics_port)
    spec: dict[str, Any] = {
        # A failed rank fails the pod, the pod fails its Job, and the scheduler restarts the
        # whole group as a new incarnation (DESIGN.md section 5).
        "restartPolicy": "Never",
        # SIGTERM first: the trainer finishes its step and stops within the grace period.
        "terminationGracePeriodSeconds": cluster.grace_seconds,
        # The image runs as uid 1000 (deploy/Dockerfile): let it write the volume.
        "securityContext": {"fsGroup": 1000},
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": names.config}},
                    {"name": "storage", "persistentVolumeClaim": {"claimName": names.claim}},
                    # NCCL and the data loader need more shared memory than the 64 MiB default.
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if cluster.node_selector:
        spec["nodeSelector"] = dict(cluster.node_selector)
    if cluster.tolerations:
        spec["tolerations"] = [dict(t) for t in cluster.tolerations]
    if cluster.service_account:
        spec["serviceAccountName"] = cluster.service_account
    labels = {LABEL: names.job, "ftlm.dev/component": "group", "ftlm.dev/group": group}
    metadata: dict[str, Any] = {"labels": labels}
    if annotations:
        metadata["annotations"] = annotations
    return {"metadata": metadata, "spec": spec}


def group_job_spec(run: RunConfig, names: Names, cluster: ClusterConfig, group: str,
                   backoff_limit: int) -> dict[str, Any]:
    return {"completionMode": "Indexed", "completions": 1, "parallelism": 1,
            "backoffLimit": backoff_limit, "template": group_pod(run, names, cluster, group)}


def jobset(run: RunConfig, names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """All groups in one JobSet; a failed group's Job is recreated alone (``RestartJob``)."""
    groups = cluster.group_names()
    replicated = [{"name": g, "replicas": 1,
                   "template": {"metadata": {"labels": {LABEL: names.job, "ftlm.dev/group": g}},
                                # backoffLimit 0: the JobSet, not the Job, decides the restart.
                                "spec": group_job_spec(run, names, cluster, g, 0)}}
                  for g in groups]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": _meta(names.job, names, cluster, "groups"),
        "spec": {
            "failurePolicy": {"maxRestarts": cluster.max_restarts, "rules": [
                {"name": "restartFailedGroup", "action": "RestartJob",
                 "targetReplicatedJobs": groups}]},
            # When one group has trained every step the job is done: a group still restarting
            # would have nobody left to recover from (the local launcher stops it too).
            "successPolicy": {"operator": "Any", "targetReplicatedJobs": groups},
            "replicatedJobs": replicated,
        },
    }


def group_job(run: RunConfig, names: Names, cluster: ClusterConfig, group: str) -> dict[str, Any]:
    """One group as a plain indexed Job: the Job controller restarts its pod (backoffLimit)."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(f"{names.job}-{group}", names, cluster, "group"),
            "spec": group_job_spec(run, names, cluster, group, cluster.max_restarts)}


def trainjob(run: RunConfig, names: Names, cluster: ClusterConfig, group: str) -> dict[str, Any]:
    """One group as a Kubeflow Trainer v2 TrainJob on the torch runtime (which runs torchrun)."""
    pod = group_pod(run, names, cluster, group)
    container = pod["spec"]["containers"][0]
    pod_patch: dict[str, Any] = {
        "volumes": pod["spec"]["volumes"],
        "containers": [{"name": "node", "volumeMounts": container["volumeMounts"]}],
        "terminationGracePeriodSeconds": cluster.grace_seconds}
    for key in ("nodeSelector", "tolerations", "serviceAccountName", "securityContext"):
        if key in pod["spec"]:
            pod_patch[key] = pod["spec"][key]
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": _meta(f"{names.job}-{group}", names, cluster, "group"),
        "spec": {
            "runtimeRef": {"name": cluster.trainjob_runtime, "kind": "ClusterTrainingRuntime",
                           "apiGroup": "trainer.kubeflow.org"},
            "trainer": {"image": cluster.image, "numNodes": 1,
                        "numProcPerNode": cluster.ranks_per_group,
                        # torchrun takes the node count and rank layout from the runtime's PET_*.
                        "command": ["torchrun", *train_args(run, names, cluster)],
                        "env": container["env"],
                        "resourcesPerNode": container["resources"]},
            "runtimePatches": [{"manager": "ftlm.dev/launcher", "trainingRuntimeSpec": {
                "template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {
                    "template": {"metadata": {"labels": pod["metadata"]["labels"]},
                                 "spec": pod_patch}}}}]}}}}],
        },
    }


def pod_monitor(names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """Prometheus Operator scrape config; /metrics needs the job token like every request."""
    auth = {"type": "Bearer", "credentials": {"name": names.secret, "key": "token"}}
    endpoints = [{"port": "http", "path": "/metrics", "interval": "15s", "authorization": auth}]
    if cluster.metrics_port:
        endpoints.append({"port": "metrics", "path": "/metrics", "interval": "15s",
                          "authorization": auth})
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": _meta(names.job, names, cluster, "monitoring"),
            "spec": {"selector": {"matchLabels": {LABEL: names.job}},
                     "podMetricsEndpoints": endpoints}}


def dashboards_config_map(names: Names, cluster: ClusterConfig,
                          dashboards: dict[str, str]) -> dict[str, Any]:
    """Grafana dashboards, labelled for the Grafana sidecar that loads ConfigMaps."""
    meta = _meta(f"{names.job}-dashboards", names, cluster, "monitoring")
    meta["labels"]["grafana_dashboard"] = "1"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": dict(dashboards)}


def build_manifests(run: RunConfig, cluster: ClusterConfig, config_toml: str, token: str,
                    dashboards: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Every object of the job, keyed by its file path relative to the output folder."""
    names = Names(run, cluster)
    out = {
        "base/secret.yaml": secret(names, cluster, token),
        "base/configmap.yaml": config_map(names, cluster, config_toml),
        "base/pvc.yaml": claim(names, cluster),
        "base/coordinator-deployment.yaml": coordinator_deployment(run, names, cluster),
        "base/coordinator-service.yaml": coordinator_service(names, cluster),
        "jobset/jobset.yaml": jobset(run, names, cluster),
        "monitoring/podmonitor.yaml": pod_monitor(names, cluster),
    }
    if cluster.pvc_name:  # an existing claim: do not create (or overwrite) it
        del out["base/pvc.yaml"]
    for g in cluster.group_names():
        out[f"jobs/job-{g}.yaml"] = group_job(run, names, cluster, g)
        out[f"trainjob/trainjob-{g}.yaml"] = trainjob(run, names, cluster, g)
    if dashboards:
        out["monitoring/grafana-dashboards.yaml"] = dashboards_config_map(names, cluster, dashboards)
    return out


def read_dashboards(folder: Path = DASHBOARDS) -> dict[str, str]:
    """The Grafana dashboards (``*.json`` anywhere under ``folder``, keyed by file name);
    empty when the folder does not exist."""
    if not folder.is_dir():
        return {}
    return {p.name: p.read_text() for p in sorted(folder.rglob("*.json"))}


def generate_k8s(run_config: RunConfig, cluster: ClusterConfig, out_dir: Path,
                 config_toml: str, dashboards_dir: Path = DASHBOARDS) -> list[Path]:
    """Write the job's manifests under ``out_dir`` (one object per file); returns the paths."""
    dashboards = read_dashboards(dashboards_dir)
    manifests = build_manifests(run_config, cluster, config_toml, secrets.token_hex(32), dashboards)
    out_dir = Path(out_dir)
    # A regeneration with fewer groups must not leave the old groups' files behind.
    for folder in ("jobs", "trainjob"):
        for old in (out_dir / folder).glob("*.yaml"):
            old.unlink()
    (out_dir / "monitoring" / "NO_DASHBOARDS.txt").unlink(missing_ok=True)
    written = []
    for rel, obj in manifests.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_yaml(obj))
        if rel == "base/secret.yaml":
            path.chmod(0o600)  # it holds the job token
        written.append(path)
    if not dashboards:
        note = out_dir / "monitoring" / "NO_DASHBOARDS.txt"
        note.write_text(f"No Grafana dashboards were found in {dashboards_dir} when these "
                        "manifests were generated; regenerate once deploy/grafana/*.json exists.\n")
        written.append(note)
    return written
