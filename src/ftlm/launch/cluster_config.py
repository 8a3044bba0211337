"""Settings of a job on a cluster scheduler (Kubernetes or Slurm): the ``[cluster]`` section.

Only the dataclass, its validation and small derived values (names, totals) live here; the
manifest and script generators in ``ftlm.launch.k8s`` and ``ftlm.launch.slurm`` read it. It says
nothing about training itself: that is the run config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ftlm.errors import ConfigError

_S = "cluster"  # section name in error messages
# Kubernetes object names (RFC 1123 labels) and quantities such as 4, 500m, 16Gi, 1.5.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
_ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (
            high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"{_S}.{name}={value!r} must be an integer {bound}")


def _quantity(name: str, value: Any, example: str) -> None:
    if not isinstance(value, str) or not _QUANTITY.match(value):
        raise ConfigError(f"{_S}.{name}={value!r} must be a Kubernetes quantity such as {example!r}")


def _parse_node_selector(value: Any, name: str = "node_selector") -> dict[str, str]:
    """A dict, or ``key=value`` strings (the form ``--set cluster.node_selector=a=b,c=d`` gives)."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = []
        for entry in value:
            key, sep, val = str(entry).partition("=")
            if not sep:
                raise ConfigError(f"{_S}.{name} entry {entry!r} must be key=value, "
                                  "e.g. nvidia.com/gpu.product=H100")
            items.append((key.strip(), val.strip()))
    else:
        raise ConfigError(f"{_S}.{name}={value!r} must be a table of label = value")
    for key, val in items:
        if not isinstance(key, str) or not key or not isinstance(val, str):
            raise ConfigError(f"{_S}.{name} entry {key!r}={val!r} must map a label name "
                              "to a string value")
    return dict(items)


def _parse_toleration(entry: Any) -> dict[str, str]:
    """A Kubernetes toleration table, or ``key[=value][:Effect]`` (operator Exists without value)."""
    if isinstance(entry, str):
        rest, _, effect = entry.partition(":")
        key, sep, val = rest.partition("=")
        entry = {"key": key, "operator": "Equal" if sep else "Exists"}
        if sep:
            entry["value"] = val
        if effect:
            entry["effect"] = effect
    if not isinstance(entry, dict) or not entry.get("key"):
        raise ConfigError(f"{_S}.tolerations entry {entry!r} must be a table with a key (or the "
                          "string key[=value][:Effect], e.g. nvidia.com/gpu:NoSchedule)")
    allowed = {"key", "operator", "value", "effect", "tolerationSeconds"}
    unknown = set(entry) - allowed
    if unknown:
        raise ConfigError(f"{_S}.tolerations entry {entry!r} has unknown fields {sorted(unknown)}; "
                          f"valid: {sorted(allowed)}")
    if entry.get("operator", "Equal") not in ("Equal", "Exists"):
        raise ConfigError(f"{_S}.tolerations operator {entry['operator']!r}; valid: Equal, Exists")
    if "effect" in entry and entry["effect"] not in _EFFECTS:
        raise ConfigError(f"{_S}.tolerations effect {entry['effect']!r}; valid: {', '.join(_EFFECTS)}")
    return dict(entry)


@dataclass
class ClusterConfig:
    """The ``[cluster]`` section: how a job is laid out on Kubernetes or Slurm."""

    name: str = ""
    """Job name (a DNS label: lowercase letters, digits, '-'); empty means one derived from run.name."""
    groups: int = 2
    """Replica groups the job starts with (each restarts on its own)."""
    spares: int = 0
    """Hot spare groups started beside them (``ft.spares``): each follows every step without
    training and takes a failed group's place at once; a spare costs a group's resources."""
    ranks_per_group: int = 1
    """Ranks (torchrun processes, FSDP shards) in each replica group, over nodes_per_group nodes."""
    nodes_per_group: int = 1
    """Nodes (pods / Slurm nodes) of one replica group; ranks_per_group must be a multiple of it."""
    gpus_per_rank: int = 0
    """GPUs each rank uses; 0 trains on CPU. A group requests ranks_per_group x this."""
    image: str = "ftlm:latest"
    """Container image with ftlm installed (see deploy/Dockerfile)."""
    image_pull_policy: str = "IfNotPresent"
    """Kubernetes image pull policy: Always, IfNotPresent or Never."""
    cpu: str = "4"
    """CPU request of one replica group's pod (a Kubernetes quantity)."""
    memory: str = "16Gi"
    """Memory request (and limit) of one replica group's pod."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels a group's pod must match, e.g. {"nvidia.com/gpu.product" = "H100"}."""
    tolerations: list[Any] = field(default_factory=list)
    """Taints the group pods tolerate: tables or strings key[=value][:Effect]."""
    namespace: str = "default"
    """Kubernetes namespace of every object."""
    cluster_domain: str = ""
    """Kubernetes DNS domain (e.g. cluster.local); empty: <service>.<namespace>.svc (search path)."""
    prefer_node_labels: dict[str, str] = field(default_factory=dict)
    """Preferred node labels key=value (e.g. a spot pool: cloud.google.com/gke-spot=true); any one matches."""
    spread_topology_key: str = "topology.kubernetes.io/zone"
    """Node label the group pods are spread over (failure domains); empty: no spread constraint."""
    coordinator_priority: int = 1000000
    """Value of the coordinator's PriorityClass (above the groups, so it is evicted last); 0: none."""
    service_account: str = ""
    """Service account of the pods; empty means the namespace's default (the coordinator's, with
    coordinator_standby: one generated for it, allowed to hold its Lease and label its pods)."""
    coordinator_standby: bool = True
    """Kubernetes: two coordinator pods, one serving while it holds a Lease and one warm standby
    that takes over ~10 s after the holder's node is lost (docs/kubernetes.md); false: one pod,
    replaced by the Deployment (about 60-70 s after a node loss)."""
    coordinator_port: int = 29510
    """TCP port of the coordinator (quorum, /status, /metrics)."""
    metrics_port: int = 9400
    """Groups' metrics base port: local rank r at +r (Slurm: + group index x ranks per node); 0: not set."""
    mount_path: str = "/mnt/ftlm"
    """Where the durable volume is mounted; the run directory (and checkpoints) go under it."""
    storage_size: str = "100Gi"
    """Size of the checkpoint volume claim."""
    storage_class: str = ""
    """Storage class of the checkpoint volume claim; empty means the cluster default."""
    storage_access_mode: str = "ReadWriteMany"
    """Access mode of the claim; groups on different nodes share it, so ReadWriteMany."""
    pvc_name: str = ""
    """Existing claim to use instead of creating one; empty creates <name>-checkpoints."""
    max_restarts: int = 100
    """Restarts of one group (JobSet / Job backoff / Slurm resubmissions) before giving up."""
    grace_seconds: int = 120
    """Seconds between the stop signal and the kill: the group finishes its step and saves."""
    trainjob_runtime: str = ""
    """ClusterTrainingRuntime the TrainJobs use; empty: the job's own TrainingRuntime (max_restarts)."""
    slurm_partition: str = ""
    """Slurm partition; empty means the cluster's default."""
    slurm_account: str = ""
    """Slurm account to charge; empty means the user's default."""
    slurm_time: str = "24:00:00"
    """Wall-time limit of each Slurm group job ([D-]HH:MM:SS)."""
    slurm_coordinator_partition: str = ""
    """Partition of the coordinator job (a small CPU one that is not preempted); empty: slurm_partition."""
    slurm_coordinator_time: str = ""
    """Wall-time limit of the coordinator job; empty: slurm_time. Give it more than the groups."""
    rendezvous_port: int = 29400
    """TCP port of torchrun's c10d rendezvous on a multi-node group's first node."""
    slurm_cpus_per_rank: int = 4
    """CPUs per rank (task) of a Slurm group job."""
    slurm_setup: str = ""
    """Shell lines run first in every Slurm script, e.g. 'source /shared/ftlm/.venv/bin/activate'."""
    python: str = "python3"
    """Python interpreter (with ftlm installed) on the Slurm nodes."""
    watch_interval: int = 30
    """Seconds between the Slurm watcher's polls of squeue/sacct."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or (self.name and not _valid_name(self.name)):
            raise ConfigError(f"{_S}.name={self.name!r} must be empty or a DNS label of at most 40 "
                              "lowercase letters, digits and '-', e.g. tiny-ft")
        _int("groups", self.groups, 1, 512)
        _int("spares", self.spares, 0, 512)
        _int("ranks_per_group", self.ranks_per_group, 1, 1024)
        _int("nodes_per_group", self.nodes_per_group, 1, 1024)
        if self.ranks_per_group % self.nodes_per_group:
            raise ConfigError(f"{_S}.ranks_per_group={self.ranks_per_group} must be a multiple of "
                              f"{_S}.nodes_per_group={self.nodes_per_group} (the same ranks on each node)")
        _int("gpus_per_rank", self.gpus_per_rank, 0, 16)
        if not isinstance(self.image, str) or not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"{_S}.image={self.image!r} must be an image reference such as "
                              "registry.example.com/ftlm:0.1")
        if self.image_pull_policy not in _PULL_POLICIES:
            raise ConfigError(f"{_S}.image_pull_policy={self.image_pull_policy!r}; valid: "
                              f"{', '.join(_PULL_POLICIES)}")
        _quantity("cpu", self.cpu, "4")
        _quantity("memory", self.memory, "16Gi")
        _quantity("storage_size", self.storage_size, "100Gi")
        self.node_selector = _parse_node_selector(self.node_selector)
        if not isinstance(self.tolerations, list):
            raise ConfigError(f"{_S}.tolerations={self.tolerations!r} must be a list")
        self.tolerations = [_parse_toleration(t) for t in self.tolerations]
        for name in ("namespace", "trainjob_runtime"):
            value = getattr(self, name)
            if not isinstance(value, str) or not (_DNS_LABEL.match(value) or (
                    value == "" and name == "trainjob_runtime")):
                raise ConfigError(f"{_S}.{name}={value!r} must be a DNS label (lowercase letters, "
                                  "digits, '-')")
        for name in ("service_account", "storage_class", "pvc_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and not re.match(r"^[a-z0-9][-a-z0-9.]*$", value)):
                raise ConfigError(f"{_S}.{name}={value!r} must be empty or a Kubernetes name")
        if not isinstance(self.cluster_domain, str) or (
                self.cluster_domain
                and not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", self.cluster_domain)):
            raise ConfigError(f"{_S}.cluster_domain={self.cluster_domain!r} must be empty or a DNS "
                              "domain such as cluster.local")
        self.prefer_node_labels = _parse_node_selector(
            [self.prefer_node_labels] if isinstance(self.prefer_node_labels, str) else
            self.prefer_node_labels, "prefer_node_labels")
        if not isinstance(self.spread_topology_key, str) or any(
                c.isspace() for c in self.spread_topology_key):
            raise ConfigError(f"{_S}.spread_topology_key={self.spread_topology_key!r} must be a node "
                              "label name such as topology.kubernetes.io/zone, or empty")
        _int("coordinator_priority", self.coordinator_priority, 0, 1000000000)
        if not isinstance(self.coordinator_standby, bool):
            raise ConfigError(f"{_S}.coordinator_standby={self.coordinator_standby!r} must be true or false")
        _int("coordinator_port", self.coordinator_port, 1, 65535)
        _int("rendezvous_port", self.rendezvous_port, 1, 65535)
        _int("metrics_port", self.metrics_port, 0, 65535)
        if self.metrics_port == self.coordinator_port:
            raise ConfigError(f"{_S}.metrics_port={self.metrics_port} must differ from "
                              f"{_S}.coordinator_port")
        if not isinstance(self.mount_path, str) or not self.mount_path.startswith("/"):
            raise ConfigError(f"{_S}.mount_path={self.mount_path!r} must be an absolute path")
        if self.storage_access_mode not in _ACCESS_MODES:
            raise ConfigError(f"{_S}.storage_access_mode={self.storage_access_mode!r}; valid: "
                              f"{', '.join(_ACCESS_MODES)}")
        _int("max_restarts", self.max_restarts, 0)
        _int("grace_seconds", self.grace_seconds, 10, 3600)
        _int("slurm_cpus_per_rank", self.slurm_cpus_per_rank, 1)
        _int("watch_interval", self.watch_interval, 1, 3600)
        for name in ("slurm_time", "slurm_coordinator_time"):
            value = getattr(self, name)
            if not isinstance(value, str) or not (
                    _SLURM_TIME.match(value) or (value == "" and name != "slurm_time")):
                raise ConfigError(f"{_S}.{name}={value!r} must be a Slurm time such as "
                                  "24:00:00 or 2-00:00:00")
        for name in ("slurm_partition", "slurm_coordinator_partition", "slurm_account", "python"):
            value = getattr(self, name)
            if not isinstance(value, str) or any(c.isspace() or c in "'\"$`;" for c in value):
                raise ConfigError(f"{_S}.{name}={value!r} must be a single word without quotes")
        if not self.python:
            raise ConfigError(f"{_S}.python must name an interpreter, e.g. python3")
        if not isinstance(self.slurm_setup, str):
            raise ConfigError(f"{_S}.slurm_setup must be a string of shell lines")

    # -- derived values --------------------------------------------------------------------------
    def job_name(self, run_name: str) -> str:
        """The job's name: ``name``, or run.name made into a DNS label."""
        if self.name:
            return self.name
        slug = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")[:40].strip("-")
        return slug or "ftlm"

    def group_names(self) -> list[str]:
        """Replica group ids, spares included, as the local launcher names them: g0, g1, ..."""
        return [f"g{i}" for i in range(self.groups + self.spares)]

    def ft_settings(self) -> list[str]:
        """The coordinator's ``--set`` overrides of the job's shape: the groups that train and
        the spares beside them."""
        return [f"ft.groups={self.groups}", f"ft.spares={self.spares}"]

    @property
    def gpus_per_group(self) -> int:
        """GPUs one replica group requests (over all its nodes)."""
        return self.ranks_per_group * self.gpus_per_rank

    @property
    def ranks_per_node(self) -> int:
        """torchrun processes on each node of a group (--nproc-per-node)."""
        return self.ranks_per_group // self.nodes_per_group

    @property
    def gpus_per_node(self) -> int:
        """GPUs one node (pod) of a group requests."""
        return self.ranks_per_node * self.gpus_per_rank

    @property
    def shutdown_timeout(self) -> int:
        """torchrun's --shutdown-timeout: seconds from SIGTERM to SIGKILL of the trainers, a margin
        inside grace_seconds so that they exit before the scheduler kills the whole node/pod."""
        return max(self.grace_seconds - 10, self.grace_seconds // 2)

    def claim_name(self, job: str) -> str:
        """The checkpoint volume claim's name."""
        return self.pvc_name or f"{job}-checkpoints"


def _valid_name(name: str) -> bool:
    return len(name) <= 40 and bool(_DNS_LABEL.match(name))
