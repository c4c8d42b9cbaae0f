"""The three policies' reactions to a replica loss, as step-by-step event loops over a `Job`.

Invariant (what each policy promises, and what the simulator checks):
- recover: every step commits exactly N microbatches; a loss inside a step costs detection, a
  rebuild and the recompute of the lost replica's quota spread over the survivors; no work is ever
  rolled back. Later steps spread N over fewer replicas (step time grows with ceil(N / r)).
- ckpt-restart: every committed step holds N microbatches, but a loss tears the whole job down: the
  steps since the last checkpoint are rolled back, the job pays detection + restart, and resumes on
  the survivors (plus hot spares, if any). A checkpoint every K steps costs C (K from Young-Daly
  unless given); a loss during a checkpoint or a restart discards it.
- shrink-batch (torchft): the faulted step is discarded, the survivors keep their own per-replica
  quota, so the global batch shrinks to their share (the failure-free trajectory is not preserved).
recover and shrink-batch pay `control_plane_s` after every step's all-reduce (their per-step
agreement); ckpt-restart has none (plain synchronous training between checkpoints).
"""

from __future__ import annotations

from recover.app.sim.job import Job, ceil_div, replica_quotas
from recover.app.sim.params import young_daly_steps
from recover.app.sim.results import PolicyResult


def run_recover(job: Job) -> PolicyResult:
    """In-step recovery: the faulted step completes on the survivors; the batch stays N."""
    p, n, cp = job.p, job.p.n_microbatches, job.p.control_plane_s
    while not job.done():
        job.admit()
        quotas = replica_quotas(job.active, n)
        st = p.step_time(max(quotas.values()), len(job.active)) + cp
        if (m := job.free_steps(st)) > 0:
            job.advance(m, st, n)
            continue
        compute_s = st - p.allreduce_s - cp
        job.inject(job.steps, compute_s)
        compute_end, end, lost = job.t + compute_s, job.t + st, 0
        while (hit := job.next_loss(end)) is not None:
            f, slot = hit
            lost += quotas.get(slot, 0)
            job.request_spare(f.time_s)
            if job.too_few():
                job.t = f.time_s
                return job.result()
            redo = ceil_div(lost, len(job.active)) * p.mb_time(len(job.active))
            end = max(compute_end, f.time_s + p.detect_s) + p.rebuild_s + redo + p.allreduce_s + cp
        if job.over_budget(end):
            break
        job.t = end
        job.steps += 1
        job.committed += n
        job.processed += n + lost
        job.record()
    return job.result()


def _ckpt_interval(job: Job) -> int:
    p = job.p
    if p.ckpt_interval_steps is not None:
        return p.ckpt_interval_steps
    n = p.n_microbatches
    st = p.step_time(max(replica_quotas(job.active, n).values()), len(job.active))
    mtbf = job.sched.mtbf_s(len(job.active) * p.gpus_per_replica)
    return young_daly_steps(p.ckpt_cost_s, mtbf, st)


def run_ckpt_restart(job: Job) -> PolicyResult:
    """Checkpoint every K steps; on a loss, roll back to the last checkpoint and restart the job."""
    p, n = job.p, job.p.n_microbatches
    last = 0  # committed steps held by the last checkpoint
    detect = p.detect_s if p.restart_detect_s is None else p.restart_detect_s
    k = _ckpt_interval(job)
    while not job.done():
        st = p.step_time(max(replica_quotas(job.active, n).values()), len(job.active))
        hit = None
        if (m := min(job.free_steps(st), k - (job.steps - last))) > 0:
            job.advance(m, st, n)
        else:
            job.inject(job.steps, st - p.allreduce_s)
            hit = job.next_loss(job.t + st)
            if hit is None:
                if job.over_budget(job.t + st):
                    break
                job.advance(1, st, n)
        if hit is None:
            if job.steps - last < k:
                continue
            hit = job.next_loss(job.t + p.ckpt_cost_s)
            if hit is None:
                if job.over_budget(job.t + p.ckpt_cost_s):
                    break
                job.t += p.ckpt_cost_s
                last = job.steps
                job.res.checkpoints += 1
                job.record()
                continue
        # A loss: the job is torn down and restarted from the last checkpoint.
        job.t = hit[0].time_s
        job.steps, job.committed = last, last * n
        job.record()
        while True:
            while len(job.active) < p.replicas and job.spare_pool:  # hot spares join the restart
                job.active = sorted(job.active + [job.spare_pool.pop(0)])
            if job.too_few():
                return job.result()
            ready = job.t + detect + p.restart_cost_s
            again = job.next_loss(ready)
            if again is None:
                break
            job.t = again[0].time_s
        job.res.restarts += 1
        if job.over_budget(ready):
            break
        job.t = ready
        job.record()
        k = _ckpt_interval(job)
    return job.result()


def run_shrink_batch(job: Job) -> PolicyResult:
    """Discard the faulted step; survivors continue with their own quotas (the batch shrinks)."""
    p = job.p
    # Per slot and fixed for the run; a spare inherits its predecessor's quota.
    quota = replica_quotas(job.active, p.n_microbatches)

    def lose(slot: int, t: float) -> None:
        spare = job.request_spare(t)
        if spare is not None:
            quota[spare] = quota[slot]

    while not job.done():
        job.admit()
        batch = sum(quota[s] for s in job.active)
        st = p.step_time(max(quota[s] for s in job.active), len(job.active)) + p.control_plane_s
        compute_s = st - p.allreduce_s - p.control_plane_s
        m, hit = job.free_steps(st), None
        if m == 0:
            job.inject(job.steps, compute_s)
            hit = job.next_loss(job.t + st)
            if hit is None and job.over_budget(job.t + st):
                break
        if m > 0 or hit is None:
            job.advance(max(m, 1), st, batch)
            job.res.min_batch_mb = min(job.res.min_batch_mb, batch)
            continue
        f, slot = hit
        lose(slot, f.time_s)
        resume = max(job.t + compute_s, f.time_s + p.detect_s) + p.rebuild_s
        while (more := job.next_loss(resume)) is not None:  # losses while detecting/rebuilding
            lose(more[1], more[0].time_s)
            resume = max(resume, more[0].time_s + p.detect_s + p.rebuild_s)
        if job.too_few():
            job.t = f.time_s
            break
        job.processed += batch
        job.res.discarded_steps += 1
        if job.over_budget(resume):
            break
        job.t = resume
    return job.result()

