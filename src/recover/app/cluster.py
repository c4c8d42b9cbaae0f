"""One recover job on a cluster scheduler, from one set of parameters: the coordinator's and each
replica's command, and the files a Slurm or Kubernetes user copies.

Invariant: the TorchX component (`recover.torchx`), the Slurm script and the Kubernetes manifests
take every command from `coordinator_argv` and `worker_argv` here, rendered from one `ClusterJob`,
so the three cannot drift apart (`examples/slurm/`, `examples/kubernetes/` are this module's
output for `EXAMPLE`; tests/test_torchx.py renders them again and compares). Nothing here imports
torch or torchx: `python -m recover.app.cluster` renders on any login node.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field

from recover.errors import ConfigError, RecoverError, UsageParser, usage_line

PROG = "python -m recover.app.cluster"
HOST, REPLICA = "@coordinator-host@", "@replica@"  # placeholders a renderer replaces
MAX_PORT = 65535


@dataclass(frozen=True)
class ClusterJob:
    """What a scheduler needs to know of a run; the rest is `recover train`'s own flags."""

    out: str  # the run directory, on storage every host mounts at the same path
    replicas: int = 3  # R: one scheduler task (a torchrun) per replica
    ranks: int = 1  # ranks per replica: torchrun's --nproc-per-node (the layout's, e.g. hsdp 2)
    port: int = 29600  # the coordinator's store port; its liveness listener takes port + 1
    max_retries: int = 3  # restarts of one replica (torchrun's, and the scheduler's task retries)
    gloo_ifname: str = ""  # the interface replicas reach each other on ("": the coordinator's)
    train_args: tuple[str, ...] = field(default_factory=tuple)  # more `recover train` flags
    wait_s: int = 600  # how long a replica waits for the coordinator to write DIR/config.json
    grace_s: int = 60  # SIGTERM to SIGKILL: above a step plus the preemption grace (30 s)
    image: str = "recover:0.8.0"  # Kubernetes: an image with recover and torch installed

    def check(self) -> ClusterJob:
        """One ConfigError line on the first parameter a scheduler would choke on later."""
        for name, value, low in (("replicas", self.replicas, 1), ("ranks", self.ranks, 1),
                                 ("port", self.port, 1), ("max_retries", self.max_retries, 0),
                                 ("wait_s", self.wait_s, 0), ("grace_s", self.grace_s, 1)):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, not {value!r}")
        if self.port + 1 > MAX_PORT:  # the liveness listener takes port + 1
            raise ConfigError(f"port {self.port}: port + 1 (the liveness listener) is over "
                              f"{MAX_PORT}")
        if not self.out.strip():
            raise ConfigError("out: the run directory (on shared storage) is required")
        return self


def coordinator_argv(job: ClusterJob, resume: bool = False) -> list[str]:
    """`recover train` as the control plane only: it prepares data, writes DIR/config.json,
    serves the store and writes the metrics; the replicas are the scheduler's tasks."""
    argv = ["recover", "train", "--external-workers", "--port", str(job.port),
            "--replicas", str(job.replicas), "--out", job.out, *job.train_args]
    return [*argv, "--resume"] if resume else argv


def worker_argv(job: ClusterJob, coordinator_host: str, replica: str) -> list[str]:
    """One replica: a `torchrun` of its ranks, `--standalone` (each replica's ranks meet on their
    own host, never with another replica's: one failure domain each). It is started again by a
    loop around it (`worker_loop`, the Slurm script's), not by torchrun's `--max-restarts`: a
    torchrun restart can hang its new worker on the agent's store for minutes."""
    argv = ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(job.ranks),
            "--max-restarts", "0", "-m", "recover.app.train.worker",
            "--run-dir", job.out, "--replica", replica,
            "--coordinator", f"{coordinator_host}:{job.port}", "--wait-s", str(job.wait_s)]
    return [*argv, "--gloo-ifname", job.gloo_ifname] if job.gloo_ifname else argv


def shell_words(argv: list[str], raw: dict[str, str]) -> str:
    """argv as one shell command line, each word quoted but those `raw` maps to an expression."""
    return " ".join(raw.get(a, shlex.quote(a)) for a in argv)


def worker_loop(job: ClusterJob, coordinator_host: str, replica: str) -> str:
    """bash: the replica's torchrun, started again when it fails, 1 + max_retries times at most,
    each under a new RECOVER_INCARNATION (a restarted replica's ranks build their group under a
    new name: the dead one's keys are stale). The two arguments are shell expressions."""
    raw = {f"{HOST}:{job.port}": f"{coordinator_host}:{job.port}", REPLICA: replica}
    command = shell_words(worker_argv(job, HOST, REPLICA), raw)
    return (f"for attempt in $(seq 0 {job.max_retries}); do "
            f'RECOVER_INCARNATION="$(hostname)-$(date +%s)-$attempt" {command} && exit 0; '
            "done; exit 1")


# The parameters examples/ is rendered from (tests/test_torchx.py checks the files are).
EXAMPLE = ClusterJob(out="/shared/recover/run1", train_args=("--preset", "small",
                                                             "--steps", "2000",
                                                             "--ckpt-every", "100"))


def slurm_script(job: ClusterJob) -> str:
    """An sbatch script: the coordinator as its own step (sharing the first node), one srun
    step per replica, each restarted by a loop of its own; the job requeued on preemption."""
    # Two words are the shell's: the coordinator's node and the loop's replica id.
    shell = {f"{HOST}:{job.port}": f'"$COORD_HOST":{job.port}', REPLICA: '"$i"'}
    worker = shell_words(worker_argv(job, HOST, REPLICA), shell)
    return SLURM.format(
        replicas=job.replicas, ranks=job.ranks, grace=job.grace_s, retries=job.max_retries,
        coordinator=shlex.join(coordinator_argv(job)), worker=worker,
        ports=f"{job.port} and {job.port + 1}", out=job.out)


SLURM = """\
#!/bin/bash
# recover on Slurm, rendered by `python -m recover.app.cluster slurm` (edit the parameters there
# and render again: the TorchX component takes the same ones). Written for Slurm 23.11 (srun
# --overlap, --kill-on-bad-exit, --signal, --requeue); checked here with `bash -n` only, never run
# on a Slurm cluster.
#SBATCH --job-name=recover
#SBATCH --nodes={replicas}
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --signal=TERM@{grace}
#SBATCH --open-mode=append
#SBATCH --output=recover-%j.out
# One replica per node ({ranks} rank(s) each); the coordinator shares the first node (--overlap).
# It listens on ports {ports} of every interface; replicas reach each other on ephemeral ports.
# Who can reach them: any process that reaches those ports can stall the job, and without the
# run token nothing more (docs/DESIGN.md, "Trust"); the data paths (gloo) are trusted as in
# torch.distributed. So keep the job's nodes' ports to the job (the cluster's private network or
# a firewall), and {out}/run.token (0600, made by the coordinator) readable by the job's user
# only; or set RECOVER_RUN_TOKEN in the job's environment from a secret store instead.
set -u

# After a requeue (preemption, a node lost) the coordinator resumes from DIR's latest checkpoint.
RESUME=""
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then RESUME=--resume; fi
COORD_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

srun --overlap --nodes=1 --ntasks=1 --nodelist="$COORD_HOST" --kill-on-bad-exit=0 \\
    {coordinator} $RESUME &
COORD=$!

# --kill-on-bad-exit=0: one replica's death must not end the others; its own loop restarts it
# (up to {retries} times, each a new incarnation) and the restarted replica rejoins the running job.
for ((i = 0; i < {replicas}; i++)); do
    (
        for ((attempt = 0; attempt <= {retries}; attempt++)); do
            RECOVER_INCARNATION="$SLURM_JOB_ID-$attempt" \\
                srun --nodes=1 --ntasks=1 --relative="$i" --kill-on-bad-exit=0 \\
                {worker} && exit 0
        done
        exit 1
    ) &
done

wait "$COORD"
code=$?
wait
exit "$code"
"""


def kubernetes_manifests(job: ClusterJob, name: str = "recover") -> str:
    """A Service with the coordinator's stable address, a NetworkPolicy that admits only the
    job's pods to its pods, the coordinator's Job, and one Indexed Job whose index i is replica
    i, each index retried on its own (backoffLimitPerIndex); every pod takes the run token from
    the Secret `{name}-token`."""
    service = f"{name}-coordinator"
    return KUBERNETES.format(
        name=name, service=service, port=job.port, liveness=job.port + 1, image=job.image,
        secret=f"{name}-token",
        replicas=job.replicas, retries=job.max_retries, grace=job.grace_s, claim=f"{name}-shared",
        coordinator=_yaml_list(coordinator_argv(job)),
        worker=_yaml_list(["bash", "-c", worker_loop(job, service, "$(RECOVER_REPLICA)")]))


def _yaml_list(argv: list[str]) -> str:
    """A flow sequence of double-quoted strings (JSON's, which YAML reads as-is)."""
    import json

    return "[" + ", ".join(json.dumps(a) for a in argv) + "]"


KUBERNETES = """\
# recover on Kubernetes, rendered by `python -m recover.app.cluster kubernetes` (edit the
# parameters there and render again: the TorchX component takes the same ones). Written for
# Kubernetes 1.33 (batch/v1 Indexed Jobs with backoffLimitPerIndex, GA there); checked here as
# YAML only (yaml.safe_load_all and the fields tests/test_torchx.py names), never applied.
# The run directory lives on a ReadWriteMany volume, the PersistentVolumeClaim `{claim}`.
# The run token lives in the Secret `{secret}`, never on that volume; make it once per run:
#   kubectl create secret generic {secret} --from-literal=token="$(openssl rand -hex 32)"
# Every pod reads it as RECOVER_RUN_TOKEN. The NetworkPolicy admits only this job's pods to any
# of its pods' ports: the coordinator's store and liveness ports, and the replicas' gloo ports
# (trusted as in torch.distributed: docs/DESIGN.md, "Trust"); it needs a network plugin that
# enforces NetworkPolicy.
apiVersion: v1
kind: Service
metadata:
  name: {service}
spec:
  selector:
    app: {name}
    role: coordinator
  ports:
    - name: store
      port: {port}
    - name: liveness
      port: {liveness}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {name}-job-only
spec:
  podSelector:
    matchLabels:
      app: {name}
  policyTypes: [Ingress]
  ingress:
    - from:
        - podSelector:
            matchLabels:
              app: {name}
---
apiVersion: batch/v1
kind: Job
metadata:
  name: {service}
spec:
  backoffLimit: 0
  template:
    metadata:
      labels:
        app: {name}
        role: coordinator
    spec:
      restartPolicy: Never
      terminationGracePeriodSeconds: {grace}
      containers:
        - name: coordinator
          image: {image}
          env:
            - name: RECOVER_RUN_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {secret}
                  key: token
          command: {coordinator}
          ports:
            - containerPort: {port}
            - containerPort: {liveness}
          volumeMounts:
            - name: shared
              mountPath: /shared
      volumes:
        - name: shared
          persistentVolumeClaim:
            claimName: {claim}
---
# Replica i is index i: a pod that fails is replaced (up to {retries} times for that index alone)
# and the new one rejoins the running job; the other indexes run on.
apiVersion: batch/v1
kind: Job
metadata:
  name: {name}-replicas
spec:
  completionMode: Indexed
  completions: {replicas}
  parallelism: {replicas}
  backoffLimitPerIndex: {retries}
  template:
    metadata:
      labels:
        app: {name}
        role: replica
    spec:
      restartPolicy: Never
      terminationGracePeriodSeconds: {grace}
      containers:
        - name: replica
          image: {image}
          env:
            - name: RECOVER_REPLICA
              valueFrom:
                fieldRef:
                  fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
            - name: RECOVER_RUN_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {secret}
                  key: token
          command: {worker}
          volumeMounts:
            - name: shared
              mountPath: /shared
      volumes:
        - name: shared
          persistentVolumeClaim:
            claimName: {claim}
"""


def parser() -> UsageParser:
    ap = UsageParser(prog=PROG, description="Render recover's Slurm script or Kubernetes "
                     "manifests (stdout) from the parameters the TorchX component takes; "
                     "flags after -- go to `recover train`.")
    ap.add_argument("kind", choices=("slurm", "kubernetes"))
    defaults = ClusterJob(out="")
    ap.add_argument("--out", required=True, help="run directory on shared storage")
    for name in ("replicas", "ranks", "port", "max_retries", "wait_s", "grace_s"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    ap.add_argument("--gloo-ifname", default="")
    ap.add_argument("--image", default=defaults.image)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Everything after `--` is recover train's, whatever it looks like.
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = parser()
    args = vars(ap.parse_args(argv[:cut]))
    kind = args.pop("kind")
    try:
        job = ClusterJob(**args, train_args=tuple(argv[cut + 1:])).check()
    except RecoverError as e:
        return usage_line(PROG, e)
    sys.stdout.write(slurm_script(job) if kind == "slurm" else kubernetes_manifests(job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
