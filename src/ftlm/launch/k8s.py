"""Kubernetes manifests for a fault-tolerant job (``ftlm launch k8s``).

Pure functions build each object as a dict from the run config and the ``[cluster]`` section;
``generate_k8s`` writes them, one object per file, in folders that are applied together:

* ``base/``: the job token Secret, the config ConfigMap, the checkpoint PVC, the coordinator
  Deployment, Service, PodDisruptionBudget and PriorityClass, and with a standby coordinator
  (``cluster.coordinator_standby``) its ServiceAccount, Role and RoleBinding (always needed);
* ``jobs/``: the replica groups, one indexed Job each (N pods for an N-node group, found by
  torchrun's c10d rendezvous through a headless Service): the default, plain Kubernetes;
* ``jobset/jobset.yaml``: the same groups as one JobSet whose failure policy restarts only the
  failed group's Job (``RestartJob``: behind a JobSet feature gate, see docs/kubernetes.md);
* ``trainjob/``: one Kubeflow Trainer v2 TrainJob per group and the TrainingRuntime they use;
* ``monitoring/``: a PodMonitor, a PrometheusRule (the alerts of ``ftlm.launch.alerts``) and
  the Grafana dashboards as a ConfigMap;
* ``kustomization.yaml`` in each folder and at the top (base + jobs), so that a platform team
  patches the output with overlays instead of regenerating it.

It does not talk to a cluster: ``kubectl apply -k`` does (docs/kubernetes.md).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from ftlm.config import RunConfig
from ftlm.launch.alerts import AlertBounds, dump_yaml, prometheus_rule_groups
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.launch.lease import LEADER_LABEL

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
        self.nodes = f"{self.job}-nodes"  # headless Service: DNS names of multi-node group pods
        # <service>.<namespace>.svc resolves through the pods' DNS search path whatever the
        # cluster's domain; cluster.cluster_domain spells it out where that path is changed.
        self.domain = f"svc.{cluster.cluster_domain}" if cluster.cluster_domain else "svc"
        self.url = (f"http://{self.coordinator}.{cluster.namespace}.{self.domain}:"
                    f"{cluster.coordinator_port}")

    def group_job(self, group: str) -> str:
        return f"{self.job}-{group}"


def _meta(name: str, names: Names, cluster: ClusterConfig, component: str,
          **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": cluster.namespace,
            "labels": {LABEL: names.job, "ftlm.dev/component": component}, **extra}


def secret(names: Names, cluster: ClusterConfig, token: str) -> dict[str, Any]:
    """The shared job token (docs/design.md, 'Security'): a fresh one per generation."""
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


# Pod Security Standards, "restricted" profile: what every pod and container of the job sets.
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                # The image runs as uid 1000 (deploy/Dockerfile): let it write the volume.
                "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                      "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def priority_class(names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """Cluster-scoped: the coordinator outranks the groups, so it is the last pod evicted or
    preempted for room (a group restarts in seconds; every group stalls without it)."""
    return {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": names.coordinator,
                         "labels": {LABEL: names.job, "ftlm.dev/component": "coordinator"}},
            "value": cluster.coordinator_priority, "globalDefault": False,
            "preemptionPolicy": "PreemptLowerPriority",
            "description": f"ftlm coordinator of job {names.job}"}


def coordinator_disruption_budget(names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """With a standby, one coordinator pod at a time may be evicted (a drain of the holder's node
    hands the lease over in about a second). Without one, no voluntary eviction (a drain waits for
    an operator to move it with ``kubectl delete pod``, at a moment of their choosing);
    involuntary loss is the Deployment's."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(names.coordinator, names, cluster, "coordinator"),
            "spec": {"maxUnavailable": 1 if cluster.coordinator_standby else 0,
                     "selector": {"matchLabels": {
                LABEL: names.job, "ftlm.dev/component": "coordinator"}}}}


COORDINATOR_NODE_LOSS_SECONDS = 10
"""How long the coordinator's pod stays bound to a node that stopped reporting (NotReady or
unreachable) before it is evicted and the Deployment starts a replacement elsewhere. Kubernetes
adds 300 s by default (``DefaultTolerationSeconds``): right for a pod that is fine on its own
while its node is back within minutes, but every group stalls while the coordinator is gone, and
a new one rebuilds its state from the groups' heartbeats in a second (docs/kubernetes.md)."""


def node_loss_tolerations(seconds: int) -> list[dict[str, Any]]:
    """Tolerations that evict a pod ``seconds`` after its node went NotReady or unreachable."""
    return [{"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": seconds} for taint in ("not-ready", "unreachable")]


def coordinator_deployment(run: RunConfig, names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """The coordinator: with ``coordinator_standby``, two pods of which the Lease holder serves
    (``ftlm.launch.lease``); else one, replaced by the Deployment."""
    port = cluster.coordinator_port
    standby = cluster.coordinator_standby
    # /status and /metrics need the token, so the probes only check that the port accepts (a
    # standby's port accepts too: it answers 503, so both pods are Ready and a drain moves either).
    probe = {"tcpSocket": {"port": "http"}, "periodSeconds": 5, "timeoutSeconds": 2}
    labels = {LABEL: names.job, "ftlm.dev/component": "coordinator"}
    lease = ["--lease", names.coordinator] if standby else []
    container = {
        "name": "coordinator", "image": cluster.image, "imagePullPolicy": cluster.image_pull_policy,
        "command": ["python", "-m", "ftlm.cli", "coordinator", f"{CONFIG_DIR}/config.toml",
                    "--host", "0.0.0.0", "--port", str(port), *lease,
                    "--set", f"ft.token_file={TOKEN_DIR}/token",
                    *[arg for s in cluster.ft_settings() for arg in ("--set", s)]],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {**probe, "initialDelaySeconds": 2},
        "livenessProbe": {**probe, "initialDelaySeconds": 10, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                      "limits": {"memory": "2Gi"}},
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}],
    }
    pod: dict[str, Any] = {"containers": [container], "securityContext": dict(POD_SECURITY),
                           "volumes": [{"name": "config", "configMap": {"name": names.config}},
                                       {"name": "token", "secret": {"secretName": names.secret}}],
                           "tolerations": node_loss_tolerations(COORDINATOR_NODE_LOSS_SECONDS)}
    if cluster.coordinator_priority:
        pod["priorityClassName"] = names.coordinator
    if standby:
        # The lease's identity and namespace; the label the Service selects is set by the holder.
        container["env"] = [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
                            for name, path in (("POD_NAME", "metadata.name"),
                                               ("POD_NAMESPACE", "metadata.namespace"))]
        pod["serviceAccountName"] = cluster.service_account or names.coordinator
        pod["automountServiceAccountToken"] = True  # the API token the lease is held with
        # Not both on one node: a node's loss must leave the standby.
        pod["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": labels},
                                                "topologyKey": "kubernetes.io/hostname"}}]}}
    elif cluster.service_account:
        pod["serviceAccountName"] = cluster.service_account
    # Without a standby, Recreate: two coordinators of one job must never answer at the same
    # time; a new one (its node lost or drained) rebuilds its state from the groups' heartbeats.
    # With one, the lease keeps the second from answering, and a rolling update moves one pod
    # at a time (the holder's SIGTERM releases the lease to the other).
    strategy = ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
                if standby else {"type": "Recreate"})
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(names.coordinator, names, cluster, "coordinator"),
            "spec": {"replicas": 2 if standby else 1, "strategy": strategy,
                     "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels, "annotations": _scrape(port)},
                                  "spec": pod}}}


def coordinator_service(names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """Where the groups reach the coordinator: with a standby, only the pod the Lease holder
    labelled (``LEADER_LABEL``)."""
    selector = {LABEL: names.job, "ftlm.dev/component": "coordinator"}
    if cluster.coordinator_standby:
        selector[LEADER_LABEL] = "true"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(names.coordinator, names, cluster, "coordinator"),
            "spec": {"selector": selector,
                     "ports": [{"name": "http", "port": cluster.coordinator_port,
                                "targetPort": "http", "protocol": "TCP"}]}}


def coordinator_rbac(names: Names, cluster: ClusterConfig) -> dict[str, dict[str, Any]]:
    """What the coordinator pods may do with the API (with a standby): hold their Lease and move
    the leader label between their pods; a service account of their own unless one is named."""
    subject = cluster.service_account or names.coordinator
    out: dict[str, dict[str, Any]] = {
        "base/coordinator-role.yaml": {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(names.coordinator, names, cluster, "coordinator"),
            "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                       "verbs": ["get", "create", "update"]},
                      {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}]},
        "base/coordinator-rolebinding.yaml": {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _meta(names.coordinator, names, cluster, "coordinator"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.coordinator},
            "subjects": [{"kind": "ServiceAccount", "name": subject, "namespace": cluster.namespace}]},
    }
    if not cluster.service_account:
        out["base/coordinator-serviceaccount.yaml"] = {
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _meta(names.coordinator, names, cluster, "coordinator")}
    return out


def nodes_service(names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """Headless Service that gives each group pod a DNS name, <job>-<g>-<index>.<job>-nodes,
    so the nodes of a multi-node group find their first node's c10d rendezvous store."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(names.nodes, names, cluster, "group"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL: names.job, "ftlm.dev/component": "group"},
                     "ports": [{"name": "rendezvous", "port": cluster.rendezvous_port,
                                "targetPort": cluster.rendezvous_port, "protocol": "TCP"}]}}


def group_env(names: Names, cluster: ClusterConfig, group: str) -> list[dict[str, Any]]:
    """The environment that places a group in the job (docs/design.md, 'Environment'); torchrun
    sets the rest."""
    return [{"name": "FTLM_COORDINATOR", "value": names.url},
            {"name": "FTLM_GROUP_ID", "value": group},
            {"name": "FTLM_GROUPS", "value": str(cluster.groups)},
            {"name": "FTLM_TOKEN", "valueFrom": {"secretKeyRef": {"name": names.secret,
                                                                  "key": "token"}}},
            # Other groups reach this pod's rendezvous store and state server at its own IP.
            {"name": "FTLM_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            *_incarnation(cluster)]


def _incarnation(cluster: ClusterConfig) -> list[dict[str, Any]]:
    """One incarnation id shared by every rank of a pod and new for each pod: its uid. A pod is a
    whole group when the group has one node; the nodes of a larger group cannot share one this
    way, and their trainers agree on rank 0's (see docs/kubernetes.md, multi-node groups)."""
    if cluster.nodes_per_group > 1:
        return []
    return [{"name": "FTLM_INCARNATION", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]


def train_args(run: RunConfig, names: Names, cluster: ClusterConfig) -> list[str]:
    """``ftlm train`` and the overrides that place its run directory on the durable volume and
    turn on the per-rank metrics that the PodMonitor scrapes."""
    args = ["-m", "ftlm.cli", "train", f"{CONFIG_DIR}/config.toml",
            # The coordinator comes from FTLM_COORDINATOR; a URL left in the config would win.
            "--set", "ft.coordinator=",
            "--set", f"run.dir={cluster.mount_path}/{names.job}",
            "--set", "observe.progress=false"]
    if cluster.metrics_port:
        args += ["--set", "observe.metrics=true", "--set", "observe.metrics_host=0.0.0.0",
                 "--set", f"observe.metrics_port={cluster.metrics_port}"]
    return args


def metrics_port_names(cluster: ClusterConfig) -> list[str]:
    """Names of the group pods' metrics ports, one per rank of a node (rank r: metrics_port + r)."""
    if not cluster.metrics_port:
        return []
    return ["metrics"] + [f"metrics-{i}" for i in range(1, cluster.ranks_per_node)]


def torchrun_command(run: RunConfig, names: Names, cluster: ClusterConfig, group: str,
                     head: str) -> list[str]:
    """The trainer container's command: torchrun with one process per rank of this node;
    ``head`` is the DNS name of the group's first pod (its c10d store) when it has several."""
    # SIGTERM (drain, spot reclaim, delete) reaches torchrun; it passes it to the trainers and
    # kills them only after this, inside terminationGracePeriodSeconds (its default is 30 s).
    common = [f"--nproc-per-node={cluster.ranks_per_node}",
              f"--shutdown-timeout={cluster.shutdown_timeout}"]
    if cluster.nodes_per_group == 1:
        return ["torchrun", "--standalone", "--nnodes=1", *common, *train_args(run, names, cluster)]
    placement = [f"--nnodes={cluster.nodes_per_group}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={head}:{cluster.rendezvous_port}",
                 f"--rdzv-id={names.group_job(group)}",
                 # A lost node (its pod is replaced under the same index) restarts the workers of
                 # the others, which meet the new pod in the rendezvous: a new incarnation.
                 f"--max-restarts={cluster.max_restarts}", *common]
    return ["torchrun", *placement, *per_local_rank_program(run, names, cluster)]


def per_local_rank_program(run: RunConfig, names: Names, cluster: ClusterConfig) -> list[str]:
    """torchrun's program and its arguments where a group may span nodes (a multi-node Job or
    JobSet, every TrainJob). A rank's metrics port would follow its global rank, which c10d
    hands out in arrival order (node 1's ranks on ports no pod declares): each process gets the
    port of its local rank, the ones every pod declares (``metrics_port_names``)."""
    if not cluster.metrics_port:
        return train_args(run, names, cluster)
    script = (f'export FTLM_METRICS_PORT=$(({cluster.metrics_port} + LOCAL_RANK)); '
              'exec python "$@"')
    return ["--no-python", "sh", "-c", script, "ftlm-train", *train_args(run, names, cluster)]


def metrics_ports(cluster: ClusterConfig) -> list[dict[str, Any]]:
    """The named container ports of a node's ranks (local rank l: metrics_port + l)."""
    return [{"name": name, "containerPort": cluster.metrics_port + i, "protocol": "TCP"}
            for i, name in enumerate(metrics_port_names(cluster))]


PROBE_GRACE_SECONDS = 3600
"""How long a trainer may take to start serving metrics (loading a model may take minutes)."""


def rank_probes(cluster: ClusterConfig) -> dict[str, Any]:
    """The trainer container's startup and liveness probes (none without metrics).

    A single-node pod: local rank 0 serves /metrics from a thread of the trainer, so a process
    that no longer accepts there is wedged or gone; the startup probe allows an hour before the
    liveness probe counts. A node of a multi-node group: when another node is lost its torchrun
    stops the trainers and waits in the rendezvous for the replacement, serving nothing, so the
    probe is ``ftlm.launch.rank_probe``, which passes while the agent waits. (Hangs inside a step
    are the coordinator's to detect: heartbeat timeout.)"""
    if not cluster.metrics_port:
        return {}
    timing = {"periodSeconds": 10, "timeoutSeconds": 5}
    if cluster.nodes_per_group > 1:
        check: dict[str, Any] = {"exec": {"command": [
            "python", "-m", "ftlm.launch.rank_probe", str(cluster.metrics_port),
            str(PROBE_GRACE_SECONDS)]}}
        return {"livenessProbe": {**check, **timing, "failureThreshold": 6}}
    check = {"tcpSocket": {"port": "metrics"}}
    return {"startupProbe": {**check, **timing,
                             "failureThreshold": PROBE_GRACE_SECONDS // timing["periodSeconds"]},
            "livenessProbe": {**check, **timing, "failureThreshold": 6}}


def _affinity(names: Names, cluster: ClusterConfig, group: str) -> dict[str, Any]:
    affinity: dict[str, Any] = {}
    if cluster.prefer_node_labels:
        # Any one of the labels (e.g. a spot node pool) is preferred, none is required.
        affinity["nodeAffinity"] = {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "preference": {"matchExpressions": [
                {"key": key, "operator": "In", "values": [value]}]}}
            for key, value in cluster.prefer_node_labels.items()]}
    if cluster.nodes_per_group > 1 and cluster.spread_topology_key:
        # The nodes of one group all-reduce with each other every step: keep them together.
        affinity["podAffinity"] = {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {
                "topologyKey": cluster.spread_topology_key,
                "labelSelector": {"matchLabels": {LABEL: names.job, "ftlm.dev/group": group}}}}]}
    return affinity


def group_pod(run: RunConfig, names: Names, cluster: ClusterConfig, group: str,
              head: str = "") -> dict[str, Any]:
    """The pod template of one node of a replica group: torchrun with one process per rank."""
    requests: dict[str, Any] = {"cpu": cluster.cpu, "memory": cluster.memory}
    limits: dict[str, Any] = {"memory": cluster.memory}
    if cluster.gpus_per_node:
        requests["nvidia.com/gpu"] = str(cluster.gpus_per_node)
        limits["nvidia.com/gpu"] = str(cluster.gpus_per_node)
    container: dict[str, Any] = {
        "name": "trainer", "image": cluster.image, "imagePullPolicy": cluster.image_pull_policy,
        "command": torchrun_command(run, names, cluster, group, head),
        "env": group_env(names, cluster, group),
        "resources": {"requests": requests, "limits": limits},
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "storage", "mountPath": cluster.mount_path},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    ports = metrics_ports(cluster)
    if cluster.nodes_per_group > 1:
        ports.append({"name": "rendezvous", "containerPort": cluster.rendezvous_port,
                      "protocol": "TCP"})
    if ports:
        container["ports"] = ports
    container.update(rank_probes(cluster))
    annotations = _scrape(cluster.metrics_port) if cluster.metrics_port else {}
    spec: dict[str, Any] = {
        # A failed rank fails the pod, the pod fails its Job, and the scheduler restarts the
        # whole group as a new incarnation (docs/design.md, 'Failure detection').
        "restartPolicy": "Never",
        # SIGTERM first: the trainer finishes its step, leaves the quorum and stops in time.
        "terminationGracePeriodSeconds": cluster.grace_seconds,
        "securityContext": dict(POD_SECURITY),
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
    affinity = _affinity(names, cluster, group)
    if affinity:
        spec["affinity"] = affinity
    if cluster.spread_topology_key and cluster.nodes_per_group == 1:
        # Groups over failure domains: one zone (or rack) lost takes as few groups as possible.
        spec["topologySpreadConstraints"] = [{
            "maxSkew": 1, "topologyKey": cluster.spread_topology_key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {LABEL: names.job, "ftlm.dev/component": "group"}}}]
    if cluster.service_account:
        spec["serviceAccountName"] = cluster.service_account
    labels = {LABEL: names.job, "ftlm.dev/component": "group", "ftlm.dev/group": group}
    metadata: dict[str, Any] = {"labels": labels}
    if annotations:
        metadata["annotations"] = annotations
    return {"metadata": metadata, "spec": spec}


def pod_failure_policy() -> dict[str, Any]:
    """A pod lost to a disruption (preemption, spot reclaim, drain, eviction, node pressure) is
    replaced without counting against the restarts: only real failures use up backoffLimit."""
    return {"rules": [{"action": "Ignore",
                       "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}


def group_job_spec(run: RunConfig, names: Names, cluster: ClusterConfig, group: str,
                   backoff_limit: int, head: str = "") -> dict[str, Any]:
    """One Job per group, one pod per node of the group (completion index = node)."""
    n = cluster.nodes_per_group
    return {"completionMode": "Indexed", "completions": n, "parallelism": n,
            "backoffLimit": backoff_limit, "podFailurePolicy": pod_failure_policy(),
            "template": group_pod(run, names, cluster, group, head)}


def jobset(run: RunConfig, names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """All groups in one JobSet; a failed group's Job is recreated alone (``RestartJob``)."""
    groups = cluster.group_names()
    replicated = [{"name": g, "replicas": 1,
                   "template": {"metadata": {"labels": {LABEL: names.job, "ftlm.dev/group": g}},
                                # backoffLimit 0: the JobSet, not the Job, decides the restart.
                                # Its pods are <jobset>-<g>-0-<index>.<jobset> (JobSet's DNS).
                                "spec": group_job_spec(
                                    run, names, cluster, g, 0,
                                    f"{names.job}-{g}-0-0.{names.job}.{cluster.namespace}."
                                    f"{names.domain}")}}
                  for g in groups]
    meta = _meta(names.job, names, cluster, "groups")
    meta["annotations"] = {"ftlm.dev/requires": "JobSet with the RestartJob failure-policy action "
                                                "enabled; otherwise use jobs/ (docs/kubernetes.md)"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta,
        "spec": {
            "failurePolicy": {"maxRestarts": cluster.max_restarts, "rules": [
                {"name": "restartFailedGroup", "action": "RestartJob",
                 "targetReplicatedJobs": groups}]},
            # When one group has trained every step the job is done: a group still restarting
            # would have nobody left to recover from (the local launcher stops it too).
            "successPolicy": {"operator": "Any", "targetReplicatedJobs": groups},
            **({"network": {"enableDNSHostnames": True}} if cluster.nodes_per_group > 1 else {}),
            "replicatedJobs": replicated,
        },
    }


def group_job(run: RunConfig, names: Names, cluster: ClusterConfig, group: str) -> dict[str, Any]:
    """One group as a plain indexed Job: the Job controller replaces a failed pod (backoffLimit);
    ``kubectl delete job`` of another group never touches this one."""
    head = f"{names.group_job(group)}-0.{names.nodes}.{cluster.namespace}.{names.domain}"
    spec = group_job_spec(run, names, cluster, group, cluster.max_restarts, head)
    if cluster.nodes_per_group > 1:
        # Pod hostnames of an indexed Job are <job>-<index>; the headless Service names them.
        spec["template"]["spec"]["subdomain"] = names.nodes
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(names.group_job(group), names, cluster, "group"),
            "spec": spec}


def training_runtime(run: RunConfig, names: Names, cluster: ClusterConfig) -> dict[str, Any]:
    """The job's own namespaced TrainingRuntime: a TrainJob cannot patch the restart policy of
    the runtime it refers to, so ``max_restarts`` and the disruption rule live here."""
    node_job = {"metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                "spec": {"backoffLimit": cluster.max_restarts,
                         "podFailurePolicy": pod_failure_policy(),
                         "template": {"spec": {"restartPolicy": "Never", "containers": [
                             {"name": "node", "image": cluster.image,
                              "imagePullPolicy": cluster.image_pull_policy,
                              # A TrainJob cannot patch ports: its ranks' ports live here.
                              **({"ports": metrics_ports(cluster)} if cluster.metrics_port
                                 else {})}]}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
            "metadata": _meta(f"{names.job}-runtime", names, cluster, "runtime"),
            "spec": {"mlPolicy": {"numNodes": cluster.nodes_per_group, "torch": {}},
                     "template": {"spec": {
                         "failurePolicy": {"maxRestarts": cluster.max_restarts},
                         "replicatedJobs": [{"name": "node", "replicas": 1,
                                             "template": node_job}]}}}}


def trainjob(run: RunConfig, names: Names, cluster: ClusterConfig, group: str) -> dict[str, Any]:
    """One group as a Kubeflow Trainer v2 TrainJob on the torch runtime (which runs torchrun)."""
    pod = group_pod(run, names, cluster, group)
    container = pod["spec"]["containers"][0]
    pod_patch: dict[str, Any] = {
        "volumes": pod["spec"]["volumes"],
        "containers": [{"name": "node", "volumeMounts": container["volumeMounts"],
                        "securityContext": container["securityContext"]}],
        "terminationGracePeriodSeconds": cluster.grace_seconds}
    for key in ("nodeSelector", "tolerations", "serviceAccountName", "securityContext", "affinity"):
        if key in pod["spec"]:
            pod_patch[key] = pod["spec"][key]
    metadata = _meta(names.group_job(group), names, cluster, "group")
    if cluster.trainjob_runtime:
        ref = {"name": cluster.trainjob_runtime, "kind": "ClusterTrainingRuntime",
               "apiGroup": "trainer.kubeflow.org"}
        if cluster.metrics_port:
            # Ports come from the runtime's container, which is the platform's here.
            ports = ", ".join(f"{p['name']}={p['containerPort']}" for p in metrics_ports(cluster))
            metadata["annotations"] = {"ftlm.dev/requires": (
                f"the node container of ClusterTrainingRuntime {cluster.trainjob_runtime} "
                f"declares the ports {ports} (TCP), which the PodMonitor scrapes; otherwise "
                "the ranks' metrics are not scraped (docs/kubernetes.md)")}
    else:
        ref = {"name": f"{names.job}-runtime", "kind": "TrainingRuntime",
               "apiGroup": "trainer.kubeflow.org"}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": metadata,
        "spec": {
            "runtimeRef": ref,
            "trainer": {"image": cluster.image, "numNodes": cluster.nodes_per_group,
                        "numProcPerNode": cluster.ranks_per_node,
                        # torchrun takes the node count and rank layout from the runtime's PET_*.
                        "command": ["torchrun", f"--shutdown-timeout={cluster.shutdown_timeout}",
                                    *per_local_rank_program(run, names, cluster)],
                        "env": container["env"],
                        "resourcesPerNode": container["resources"]},
            "runtimePatches": [{"manager": "ftlm.dev/launcher", "trainingRuntimeSpec": {
                "template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {
                    "template": {"metadata": {"labels": pod["metadata"]["labels"]},
                                 "spec": pod_patch}}}}]}}}}],
        },
    }


def pod_monitor(names: Names, cluster: ClusterConfig, run: RunConfig) -> dict[str, Any]:
    """Prometheus Operator scrape config; /metrics needs the job token like every request.

    The trainers label their series ``job=<run.name>`` themselves (``honorLabels`` keeps it,
    where Prometheus would otherwise rename it ``exported_job``); the coordinator's series carry
    no job label, so the scrape sets the same one: the dashboards' ``$job`` selects both."""
    auth = {"type": "Bearer", "credentials": {"name": names.secret, "key": "token"}}
    job_label = {"targetLabel": "job", "replacement": run.run.name, "action": "replace"}
    endpoints: list[dict[str, Any]] = [{"port": "http", "path": "/metrics", "interval": "15s",
                                        "authorization": auth, "relabelings": [job_label]}]
    for port in metrics_port_names(cluster):
        endpoints.append({"port": port, "path": "/metrics", "interval": "15s",
                          "honorLabels": True, "authorization": auth})
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": _meta(names.job, names, cluster, "monitoring"),
            "spec": {"selector": {"matchLabels": {LABEL: names.job}},
                     "podMetricsEndpoints": endpoints}}


def prometheus_rule(names: Names, cluster: ClusterConfig, run: RunConfig) -> dict[str, Any]:
    """The alerts of ``ftlm.launch.alerts`` for this job, for the Prometheus Operator."""
    meta = _meta(f"{names.job}-alerts", names, cluster, "monitoring")
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": meta,
            "spec": {"groups": prometheus_rule_groups(AlertBounds(), job=run.run.name)}}


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
        "base/coordinator-pdb.yaml": coordinator_disruption_budget(names, cluster),
        "base/coordinator-priorityclass.yaml": priority_class(names, cluster),
        "base/nodes-service.yaml": nodes_service(names, cluster),
        "jobset/jobset.yaml": jobset(run, names, cluster),
        "monitoring/podmonitor.yaml": pod_monitor(names, cluster, run),
        "monitoring/prometheusrule.yaml": prometheus_rule(names, cluster, run),
    }
    if cluster.pvc_name:  # an existing claim: do not create (or overwrite) it
        del out["base/pvc.yaml"]
    if not cluster.coordinator_priority:
        del out["base/coordinator-priorityclass.yaml"]
    if cluster.nodes_per_group == 1:
        del out["base/nodes-service.yaml"]
    if cluster.coordinator_standby:
        out.update(coordinator_rbac(names, cluster))
    for g in cluster.group_names():
        out[f"jobs/job-{g}.yaml"] = group_job(run, names, cluster, g)
        out[f"trainjob/trainjob-{g}.yaml"] = trainjob(run, names, cluster, g)
    if not cluster.trainjob_runtime:
        out["trainjob/trainingruntime.yaml"] = training_runtime(run, names, cluster)
    if dashboards:
        out["monitoring/grafana-dashboards.yaml"] = dashboards_config_map(names, cluster, dashboards)
    return out


def kustomizations(files: list[str]) -> dict[str, dict[str, Any]]:
    """``kustomization.yaml`` of each folder (its files) and of the top (base + jobs, the
    default; point an overlay at ``jobset``, ``trainjob`` or ``monitoring`` to add those)."""
    folders: dict[str, list[str]] = {}
    for rel in sorted(files):
        folder, _, name = rel.partition("/")
        folders.setdefault(folder, []).append(name)
    out = {f"{folder}/kustomization.yaml": {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": names} for folder, names in folders.items()}
    out["kustomization.yaml"] = {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                 "kind": "Kustomization", "resources": ["base", "jobs"]}
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
    manifests.update(kustomizations(list(manifests)))
    out_dir = Path(out_dir)
    # A regeneration with fewer groups (or without an optional object) leaves no old file behind.
    for folder in ("base", "jobs", "jobset", "trainjob", "monitoring"):
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
