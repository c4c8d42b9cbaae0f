"""What `Replica` enforces of the invariant for a loop of the user's own: per-id RNG, and one run.

Invariants:
- `id_rng(seed, id)` runs its body on RNG state that is a pure function of (seed, id): the CPU
  generator and the current CUDA device's (where CUDA is in use) are seeded with
  `id_seed(seed, id, DROPOUT_STREAM)` (the stream the reference app seeds dropout with, so an own
  loop and `recover train` draw the same masks), and every generator it seeded is put back as it
  was after the body, whatever the body raises. So a microbatch's dropout is the same whichever
  replica computes it, in whichever order, and the caller's own random stream never moves.
- A replica joins a run only with the run's identity (`identity`: N, microbatch size, the data's
  identity, the seed, the model's entry names and shapes) and, before the run's first generation,
  with the first replica's initial model state (`state_digest`). Both are compared, before this
  process says hello, with what the first process at the same rank position wrote under a key of
  this module's, sealed with the run token (`recover.control.sealed`): a difference is a
  `JoinRefused` of one line naming the first differing field or entry, before anything is
  computed. A stored value that does not verify (written without the token) or does not parse is
  logged (rate-limited) and ignored: it can delay nothing and decide nothing.
- An uncaught user's error (`ONE_LINE_ERRORS`: a refusal, an unreachable coordinator, a bad
  config) ends an own loop's process with one line (exit 1), an uncaught `RunOver` (the run ended
  before this replica was admitted: nothing failed) with one line and exit 0
  (`one_line_errors`), not a traceback; a run's fault keeps its traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn

from recover.control import RunOver, keys
from recover.control.sealed import open_value, rejected, seal
from recover.errors import CheckpointError, ConfigError, DataError, RecoverError
from recover.layouts.sharded import local_tensor
from recover.recovery import ExactOverflow
from recover.workload import Stream, id_seed

log = logging.getLogger(__name__)

DROPOUT_STREAM = Stream.DROPOUT  # id_seed's stream of a microbatch's own randomness (`Stream`)
IDENTITY_KEY = "own/identity/pos{rank}"  # this module's store keys (one per rank position)
INIT_KEY = "own/init/pos{rank}"


class JoinRefused(RecoverError):
    """This process is not a replica of the run it tried to join (one line says why)."""


class CoordinatorUnreachable(RecoverError):
    """Nothing accepted a connection at the coordinator's address within the connect timeout."""


class CoordinatorGoneForGood(RecoverError):
    """The coordinator went away mid-run and none came back (or none was waited for): this
    replica stops; one line says where it was and how to wait for a restarted one."""


# What an own loop's process ends with in one line: the user's input or environment at fault.
# A run's faults are RecoverErrors too (ReplicaFault, CoordinatorLost, BelowMinReplicas, ...)
# and keep their traceback: they say where in recover the run gave out.
ONE_LINE_ERRORS: tuple[type[RecoverError], ...] = (
    ConfigError, DataError, CheckpointError, JoinRefused, CoordinatorUnreachable,
    CoordinatorGoneForGood, ExactOverflow)


# -- per-id randomness ----------------------------------------------------------------------------
def rng_devices() -> list[int]:
    """The CUDA devices whose generator a microbatch may draw from: the current one, where CUDA
    is initialized in this process (none otherwise: seeding would initialize it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


@contextmanager
def id_rng(seed: int, mb_id: int, devices: list[int]) -> Iterator[None]:
    """Run the body on RNG state derived from (seed, mb_id), restored after (module invariant).
    Only the generators named are touched: `torch.manual_seed` would reseed every CUDA device's
    and leave those outside `fork_rng` moved."""
    s = id_seed(seed, mb_id, stream=DROPOUT_STREAM)
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(s)
        for d in devices:
            torch.cuda.default_generators[d].manual_seed(s)
        yield


# -- the run's identity ---------------------------------------------------------------------------
def data_identity(data: Any) -> dict[str, Any] | None:
    """What defines an `IdBatches` (or any object with its attributes) as the run's data: its
    item count, microbatch size, seed and sampling (None: no data given)."""
    if data is None:
        return None
    return {"items": int(len(data.dataset)), "microbatch_size": int(data.microbatch_size),
            "seed": int(data.seed), "sampling": str(getattr(data, "sampling", "")),
            "stream": int(getattr(data, "stream", 0))}


def identity(module: nn.Module, microbatches: int, seed: int, fingerprint: str,
             data: Any = None, microbatch_size: int | None = None) -> dict[str, Any]:
    """The run's identity as this rank holds it (`module`'s entries are its local ones)."""
    d = data_identity(data)
    if microbatch_size is None and d is not None:
        microbatch_size = d["microbatch_size"]
    return {"microbatches": int(microbatches), "microbatch_size": microbatch_size, "data": d,
            "seed": int(seed), "fingerprint": fingerprint,
            "params": [[name, list(p.shape)] for name, p in module.named_parameters()]}


def run_fingerprint(ident: dict[str, Any]) -> str:
    """16 hex digits of what every rank of every replica shares (not the per-rank entries: the
    stages of a pipeline hold different ones): the hello's fingerprint of an own loop."""
    shared = {k: v for k, v in ident.items() if k != "params"}
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def identity_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first field in which `mine` differs from the run's (`theirs`), in words; None if
    none does. ValueError (or TypeError) when `theirs` is not an identity at all."""
    if not isinstance(theirs, dict) or set(theirs) != set(mine):
        raise ValueError("not a run identity")
    names = {"microbatches": "N (microbatches per step)", "microbatch_size": "the microbatch size",
             "data": "the data (IdBatches)", "seed": "the seed (ReplicaConfig.seed)",
             "fingerprint": "the fingerprint (ReplicaConfig.fingerprint)"}
    for field, label in names.items():
        if mine.get(field) != theirs.get(field):
            return f"{label} is {mine.get(field)!r} here, {theirs.get(field)!r} in the run"
    here = {n: s for n, s in mine.get("params", [])}
    run = {n: s for n, s in theirs.get("params", [])}
    for name, shape in mine.get("params", []):
        if name not in run:
            return f"the model differs: parameter {name!r} is not in the run's model"
        if shape != run[name]:
            return (f"the model differs: parameter {name!r} has shape {shape} here, "
                    f"{run[name]} in the run")
    missing = [n for n in run if n not in here]
    if missing:
        return f"the model differs: the run's model has parameter {missing[0]!r}, this one not"
    return None


def state_digest(module: nn.Module) -> list[list[str]]:
    """[name, 12 hex digits of sha256 of its bytes] for every entry of this rank's state dict
    (parameters and buffers, local shards), in order."""
    out = []
    for name, t in module.state_dict().items():
        if not isinstance(t, torch.Tensor):
            continue
        data = local_tensor(t).detach().cpu().contiguous().reshape(-1)
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        out.append([name, hashlib.sha256(raw).hexdigest()[:12]])
    return out


def first_state_difference(mine: list[list[str]], theirs: list[list[str]]) -> str | None:
    run = {n: d for n, d in theirs}
    for name, digest in mine:
        if run.get(name, digest) != digest:
            return name
    return None


def _agree(store: Any, token: str | None, key: str, mine: Any) -> Any | None:
    """Write `mine` under `key` if nobody did (first writer wins); the run's value as stored
    (None: ours is the run's, or the stored one is not authentic or not JSON: ignored)."""
    raw = json.dumps(mine, sort_keys=True).encode()
    sealed = seal(token, key, raw)
    got = store.compare_set(key, "", sealed)
    if got == sealed:
        return None
    value = open_value(token, key, got)
    if value is None:
        return None  # logged by open_value
    try:
        return json.loads(value)
    except ValueError:
        rejected(key, "it is not JSON")
        return None


def check_join(store: Any, token: str | None, rank: int, replica: int, ident: dict[str, Any],
               module: nn.Module | None, adopt: bool = False) -> bool:
    """JoinRefused (one line) unless this rank's identity, and (given `module`, before the run's
    first generation) its initial state, are the run's (module invariant). With `adopt`, other
    initial state is not refused: True says this rank must take a running replica's."""
    key = IDENTITY_KEY.format(rank=rank)
    theirs = _agree(store, token, key, ident)
    if theirs is not None:
        try:
            why = identity_difference(json.loads(json.dumps(ident)), theirs)
        except (AttributeError, TypeError, ValueError):  # not an identity: decides nothing
            rejected(key, "it is not a run identity")
            why = None
        if why is not None:
            raise JoinRefused(f"replica {replica} rank {rank} is refused: {why}")
    # Generations published already: this process joins a running run as a joiner, and a running
    # replica's state replaces its own (rejoin). A forged count can only skip this check.
    if module is None or keys.store_int(store, keys.GEN_COUNT) > 0:
        return False
    digest = state_digest(module)
    theirs = _agree(store, token, INIT_KEY.format(rank=rank), digest)
    if theirs is not None:
        try:
            name = first_state_difference(digest, theirs)
        except (TypeError, ValueError):
            rejected(INIT_KEY.format(rank=rank), "it is not a list of [name, digest]")
            return False
        if name is not None and adopt:
            log.warning(f"replica {replica} rank {rank}: its initial model state differs from the "
                        f"run's at {name!r}: it takes a running replica's (init='adopt')")
            return True
        if name is not None:
            raise JoinRefused(
                f"replica {replica} rank {rank} is refused: its initial model state differs from "
                f"the run's first replica at {name!r}: build the model after the same "
                "torch.manual_seed on every replica (or load the same weights); "
                "ReplicaConfig(init='adopt') takes a running replica's instead")
    return False


# -- one line, not a traceback --------------------------------------------------------------------
def one_line_errors() -> None:
    """Where the process has Python's own excepthook, an uncaught one of `ONE_LINE_ERRORS` (a
    refusal, an unreachable coordinator) ends it with one line on stderr, not a traceback (exit
    code 1); an
    uncaught `RunOver` (this replica started after the run had finished: nothing failed) with
    one line and exit code 0, as `recover train`'s worker ends then (`run_over_exit`)."""
    if sys.excepthook is not sys.__excepthook__:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
        if isinstance(e, RunOver):
            run_over_exit(e)
        if isinstance(e, ONE_LINE_ERRORS):  # not any RecoverError: a fault keeps its traceback
            line = " ".join(str(e).splitlines()).strip() or kind.__name__
            sys.stderr.write(f"recover: error: {line}\n")
            sys.stderr.flush()
            return
        previous(kind, e, tb)

    sys.excepthook = hook


def run_over_exit(e: BaseException) -> None:
    """End the process with one line and exit code 0: the run it came to join is over. An
    excepthook cannot choose the exit code (the interpreter then ends with 1), so the atexit
    handlers run here (a `Replica`'s goodbye, logging's flush) and the process ends with
    os._exit(0); threads this process started (a member's) are not waited for. Once per
    process: a second caller (another thread) waits for the first's exit."""
    if not _ENDING.acquire(blocking=False):
        while True:
            time.sleep(1.0)
    line = " ".join(str(e).splitlines()).strip() or type(e).__name__
    sys.stderr.write(f"recover: {line}: nothing to do, exiting\n")
    for name in ("last_exc", "last_value", "last_type", "last_traceback"):
        with contextlib.suppress(AttributeError):  # a clean end: `exit_code` must read 0
            delattr(sys, name)
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(0)


_ENDING = threading.Lock()  # held by the one run_over_exit that ends the process
_EXIT: list[object] = []  # the code the last sys.exit call was given


def record_exit_code() -> None:
    """Remember what `sys.exit` is called with (once per process), for `exit_code`."""
    if getattr(sys.exit, "_recover", False):
        return
    original = sys.exit

    def exit(code: object = None) -> None:  # noqa: A001 - sys.exit's own name
        _EXIT[:] = [code]
        original(code)

    exit._recover = True  # type: ignore[attr-defined]
    sys.exit = exit


def exit_code() -> int:
    """The exit code the interpreter is ending with, as far as it can be known at exit: 1 after
    an uncaught exception, else what `sys.exit` was given (0 for None, 1 for a message), else 0.
    (A `raise SystemExit(n)` that bypasses sys.exit reads as 0.)"""
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return 1
    code = _EXIT[0] if _EXIT else None
    if code is None:
        return 0
    return code if isinstance(code, int) else 1
