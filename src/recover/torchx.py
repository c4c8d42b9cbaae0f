"""recover as a TorchX component: `torchx run -s local_cwd recover.torchx:train --out DIR ...`.

Invariant: the AppDef's commands are `recover.app.cluster`'s (`coordinator_argv`, `worker_argv`),
the ones the Slurm and Kubernetes recipes render, so the three cannot drift apart. Role 0 is the
coordinator (one replica, never retried: a new one would be a new run); role i + 1 is replica i,
one torchrun of its ranks, started again up to `max_retries` times by a loop in its own task
(TorchX 0.7.0's local schedulers ignore a role's max_retries) and up to as many more by
schedulers that honour `Role.max_retries` (a lost pod or node). Only this module imports torchx
(the `torchx` extra). TorchX 0.7.0 resolves `NAME:function` by reading the source of the file
NAME (it execs it: so this module imports nothing relative and keeps its annotations real, no
`from __future__ import annotations`); `component_source`, registered as TorchX's `torchx.file`
hook, is what lets NAME be this module's dotted name rather than a path.
"""

import importlib.util
from pathlib import Path

import torchx
import torchx.specs as specs

from recover.app.cluster import ClusterJob, coordinator_argv, shell_words, worker_loop


def train(
    *train_args: str,
    out: str,
    replicas: int = 3,
    ranks: int = 1,
    port: int = 29600,
    max_retries: int = 3,
    gloo_ifname: str = "",
    wait_s: int = 600,
    image: str = "recover:0.8.0",
) -> specs.AppDef:
    """A recover run: a coordinator (`recover train --external-workers`) and one torchrun per
    replica, each restarted on failure and rejoining the running job by a live state transfer.

    Args:
        train_args: more `recover train` flags (after --), e.g. --preset small --steps 2000
        out: the run directory, on storage every host mounts at the same path
        replicas: R, the replica count (one role each)
        ranks: ranks per replica (torchrun's --nproc-per-node; the layout's, e.g. hsdp --shards)
        port: the coordinator's store port (its liveness listener takes port + 1)
        max_retries: restarts of one replica (torchrun's, and the scheduler's where it has them)
        gloo_ifname: the interface replicas reach each other on (default: the coordinator's)
        wait_s: how long a replica waits for the coordinator to write DIR/config.json
        image: the container image (schedulers that run containers)
    """
    job = ClusterJob(out=out, replicas=replicas, ranks=ranks, port=port, max_retries=max_retries,
                     gloo_ifname=gloo_ifname, train_args=tuple(train_args),
                     wait_s=wait_s, image=image).check()
    # Every scheduler sets the named variable to role 0's host (the coordinator's) on the others.
    host = f"$${{{specs.macros.rank0_env}:-localhost}}"
    roles = [_role("coordinator", job, f"exec {shell_words(coordinator_argv(job), {})}", 0)]
    roles += [_role(f"replica{i}", job, worker_loop(job, host, str(i)), max_retries)
              for i in range(replicas)]
    return specs.AppDef(name="recover", roles=roles)


def _role(name: str, job: ClusterJob, command: str, retries: int) -> specs.Role:
    """One task: `bash -c` so the coordinator's host variable expands where the task runs."""
    return specs.Role(name=name, image=job.image, entrypoint="bash",
                      args=["-c", command], num_replicas=1, max_retries=retries,
                      retry_policy=specs.RetryPolicy.REPLICA,
                      port_map={"store": job.port, "liveness": job.port + 1}
                      if name == "coordinator" else {})


def component_source(conf_file: str) -> str | None:
    """TorchX's `torchx.file` entry point (`get_file_contents`): the text of `conf_file`.

    `recover.<module>` names are read from the installed package, so `recover.torchx:train`
    works from any directory; every other name is read as TorchX itself does, relative to its
    installation (its builtin component files). A file of that name in the working directory
    still wins: TorchX reads it first."""
    if conf_file.startswith("recover.") and "/" not in conf_file:
        try:
            spec = importlib.util.find_spec(conf_file)
        except (ImportError, ValueError):  # a parent that is not a package; an empty part
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            return Path(spec.origin).read_text()
        return None
    builtin = Path(torchx.__file__).parent.parent / conf_file
    return builtin.read_text() if builtin.is_file() else None
