"""Growing back: a replica that joins a running job, and the donor that hands it its state.

Invariant: a joiner is admitted (the coordinator publishes a generation with it) only after
every one of its ranks holds, verified, the state its donor rank had at one step boundary t:
parameters, optimizer state, the step, RNG, exact-mode exponents and any user state. Its first
step is t, on the failure-free trajectory; no running replica loses a step (the step t they are
in waits for the admission, or for it to be given up, then goes on with whoever is a member).
Donor side: the rank at the same position of the donor replica serves it (`serve`), called by
the step engine when step t's plan says "join". Both sides key the transfer by the run token
(`recover.replica.channel`): a joiner never uses a state that a token holder did not send it in
this join, and a donor sends nothing to a peer that did not prove the token. Without a token
there is no join: the joiner raises `TokenRequired`, a donor logs it and serves nothing.
Admission needs both ends' word, each over its own sealed liveness session: the joiner's rank
says `ready` once it verified the state, and the donor rank says `donated` once its stream
completed and the joiner acknowledged it (`transfer.send`'s `ok`, sealed by this transfer's
channel); so no `ready` from a process that received nothing admits it.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from recover.control import CoordinatorGone, Member, RunOver, keys
from recover.deadline import Deadline, wait_until
from recover.errors import RecoverError
from recover.replica import channel, transfer
from recover.settings import Hooks

CONNECT_S = 30.0  # a joiner is waiting when the join is announced: it connects at once


class TokenRequired(RecoverError, RuntimeError):
    """This process has no run token, and a state transfer is keyed by it."""


def _key(member: Member) -> bytes:
    """The transfer's key: the run token this rank proved at its hello."""
    if not member.token or member.token == "-":
        raise TokenRequired(
            f"replica {member.replica}: a live state transfer needs the run token, and this "
            "process has none: give every process of the run the same one (RECOVER_RUN_TOKEN, "
            "or ReplicaConfig(token=...); `recover train` writes DIR/run.token)")
    return member.token.encode()


class StepState:
    """What a joiner needs beyond the module and optimizer: the step, RNG, exact exponents."""

    def __init__(self, exact: Any | None) -> None:
        self.step = 0
        self.exact = exact

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": torch.tensor([self.step], dtype=torch.int64),
                              "rng": torch.get_rng_state()}
        if self.exact is not None:
            sd["exact_max"] = torch.tensor(self.exact.max_seen, dtype=torch.float64)
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.step = int(sd["step"][0])
        torch.set_rng_state(sd["rng"])
        if self.exact is not None:
            self.exact.set_maxima(sd["exact_max"].tolist())


log = logging.getLogger(__name__)


def serve(member: Member, rank: int, step: int, join: dict, module: nn.Module,
          optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any],
          exact: Any | None, hooks: Hooks | None = None) -> None:
    """Donor rank: stream this rank's state (after `step` optimizer steps) to the joiner's rank
    `rank`, once it proved the run token. Any failure is logged and given up: the coordinator
    then gives the join up too."""
    epoch, replica = int(join["epoch"]), int(join["replica"])
    ctx = channel.context(epoch, rank)
    t0 = time.monotonic()

    seen = [False]  # the plan may be read before this rank's own "join" push arrives

    def wanted() -> bool:  # the join is still on (not given up, e.g. for a forged address)
        now = member.join_requests.get(replica, (None, 0))[0]
        seen[0] = seen[0] or now == epoch
        return now == epoch or (now is None and not seen[0])

    try:
        key = _key(member)
        with socket.create_server((member.local_addr or "127.0.0.1", 0)) as srv:
            host, port = srv.getsockname()[:2]
            member.store.set(keys.donor_key(epoch, rank),
                             channel.sign_address(key, ctx, f"{host}:{port}"))
            session = channel.accept(srv, key, ctx, CONNECT_S, wanted)
        with session.sock:
            session.sock.settimeout(CONNECT_S)
            st = StepState(exact)
            st.step = step
            state = transfer.TrainingState(module, optimizer, {**extra, "_recover": st})
            if hooks is not None:
                hooks.phase("donate", step)  # fault injection: the donor dies mid-transfer
            sent = transfer.send(session, state.tensors, state.meta)
        member.report_donated(epoch, replica)  # the joiner's `ok` came: the coordinator's half
        log.info(f"donated {sent / 1e6:.1f} MB of state at step {step} to replica "
                 f"{replica} rank {rank} in {time.monotonic() - t0:.2f}s")
    except (OSError, TokenRequired, channel.ChannelError, transfer.TransferError) as e:
        log.warning(f"donation to replica {replica} (join {epoch}) failed: {e}")


def receive(member: Member, rank: int, module: nn.Module,
            optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any],
            exact: Any | None, timeout_s: float, hooks: Hooks | None = None,
            join_at: int = 0) -> tuple[int, float, int]:
    """Joiner rank: get the state from a donor (another one if a donor dies), tell the
    coordinator, wait for the admission. Returns (step to continue from, transfer s, bytes).
    `CoordinatorGone` if the store's connection breaks meanwhile (its coordinator died: a
    restarted one may be joined again), before the liveness socket has said so."""
    try:
        return _receive(member, rank, module, optimizer, extra, exact, timeout_s, hooks, join_at)
    except torch.distributed.DistNetworkError as e:
        raise CoordinatorGone(f"replica {member.replica}: the store's connection broke while it "
                              f"joined ({str(e).splitlines()[0][:120]})") from None


def _receive(member: Member, rank: int, module: nn.Module,
             optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any],
             exact: Any | None, timeout_s: float, hooks: Hooks | None, join_at: int
             ) -> tuple[int, float, int]:
    key = _key(member)
    if optimizer is not None:
        transfer.materialize_optimizer(optimizer)
    deadline = Deadline(timeout_s)
    while True:
        epoch = member.join_epoch
        value = _wait_key(member, keys.donor_key(epoch, rank), epoch, deadline)
        if value is None:  # a newer join epoch (the donor went away): try again
            continue
        ctx, addr = channel.context(epoch, rank), "the donor"
        st = StepState(exact)
        state = transfer.TrainingState(module, optimizer, {**extra, "_recover": st})
        t0 = time.monotonic()
        try:
            addr = channel.open_address(key, ctx, value)
            with transfer.connect(addr, CONNECT_S) as sock:
                sock.settimeout(CONNECT_S)
                session = channel.join(sock, key, ctx)
                if hooks is not None:  # fault injection: the joiner dies mid-transfer
                    hooks.phase("receive", join_at)
                meta, got = transfer.receive(session, state.tensors, state.meta)
        except (OSError, channel.ChannelError, transfer.TransferError) as e:
            log.warning(f"state transfer from {addr} (join {epoch}) failed: {e}; "
                        "asking for another donor")
            member.report_join_failed(epoch)
            _wait_epoch(member, epoch, deadline)
            continue
        state.finish(meta)
        took = time.monotonic() - t0
        member.store.set(keys.join_info_key(member.replica),
                         json.dumps({"transfer_s": round(took, 4), "bytes": got,
                                     "step": st.step}))
        member.report_ready(epoch)
        wait_until(functools.partial(_admitted_or_moved, member, epoch), deadline, 0.01,
                   f"replica {member.replica} was not admitted in time")
        if not member.joining:
            return st.step, took, got


def _check_over(member: Member) -> None:
    if member.run_over:
        raise RunOver(f"replica {member.replica}: the run ended before it was admitted")


def _admitted_or_moved(member: Member, epoch: int) -> bool:
    """Admitted (a generation includes us), or join `epoch` given up after all (e.g. a
    sibling's transfer failed); RunOver, or CoordinatorGone, when neither can come."""
    if not member.joining:
        return True
    _check_over(member)
    if member.coordinator_lost:
        raise CoordinatorGone(f"replica {member.replica}: the coordinator went away before "
                              "admitting it")
    return member.join_epoch != epoch


def _moved_on(member: Member, epoch: int, what: str) -> bool:
    """Join `epoch` is over (a newer one began); RunOver, or TimeoutError(`what`) when the
    coordinator is lost (nothing newer can come)."""
    if member.join_epoch != epoch:
        return True
    _check_over(member)
    if member.coordinator_lost:
        raise TimeoutError(what)
    return False


def _wait_key(member: Member, key: str, epoch: int, deadline: Deadline) -> bytes | None:
    """The donor's value of `key` (raw: the channel opens it), or None once join `epoch` is
    over."""
    what = f"no donor for replica {member.replica} (join {epoch}) in time"
    return keys.wait_value(member.store, None, key, deadline, what, poll_s=0.02,
                           stop=lambda: _moved_on(member, epoch, what))


def _wait_epoch(member: Member, epoch: int, deadline: Deadline) -> None:
    what = f"replica {member.replica} was given no other donor in time"
    wait_until(lambda: _moved_on(member, epoch, what), deadline, 0.02, what)
