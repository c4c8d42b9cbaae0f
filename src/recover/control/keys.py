"""The one place that spells the control plane's store keys and their encodings.

Every module that touches the coordinator's store calls a named function here; no key string is
written anywhere else, so the layout can be read (and changed) in one sitting:

    gen/count                       generations published; the newest is count - 1
    gen/{g}/members, gen/{g}/reason member list of generation g (JSON), and why it was made
    gen{g}/pos{p}/...               generation g's communicator at position p (barrier, gloo)
    coord/liveness, coord/error     the coordinator's liveness address; why it gave up
    step/{t}/chain/{k}              ownership chain of step t (entry k written once); a step run
                                    again (exact mode, after an overflow) uses t = "{t}.{round}";
                                    entry 0 is absent when it was implied (recovery/chain.py)
    step/{t}/g{g}/ev{s}[/tag]       ranks of generation s with a verified result of that
                                    attempt (counted when the membership changed mid-decision)
    step/{t}/g{g}/count[/tag]       verified results of that attempt, counted (tag: with a token,
                                    64 bits only the token gives: a counter cannot be sealed)
    step/{t}/g{g}/decision          the commit decision of that attempt (written once): commit,
                                    commit-plan, commit@{s} (on evidence) or redo
    coord/replicas                  R, the replicas the job was started with
    coord/shards                    the ports of the coordinator's store shards (JSON; `[]`
                                    without shards): a step's count and decision there too
    join/{e}/donor/{rank}           where the donor's rank serves join e's state
    join/info/{replica}             how its latest transfer went (metrics)
    rec/{t}                         the committed step's metrics record (first writer wins)
    run/stopped                     why the run stopped early (below --min-replicas, ...)

Invariant: generation `g`'s member list is written exactly once (by the coordinator, with
compare-and-set) and published, by a push to every member and by incrementing `gen/count`, only
after it is written; so a reader told of g either way can always read generation g's members.
With a run token, the values the protocol decides by (members, chain entries, decisions, the
coordinator's parameters) are sealed (`control.sealed`): `put_once`, `read` and `set_sealed`
write and read them; a value that does not verify (a stranger's) is absent to every reader, and
a write-once writer that finds one replaces it by compare-and-set (DESIGN.md, "Trust").
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable

from torch.distributed import TCPStore

from recover.control import listen, sealed
from recover.deadline import Deadline, wait_until
from recover.settings import MAX_REPLICAS

GEN_COUNT = "gen/count"
LIVENESS_ADDR = "coord/liveness"
COORD_ERROR = "coord/error"
RUN_STOPPED = "run/stopped"
# Set by the launcher before it passes a SIGTERM on to every replica: the whole job is preempted,
# so the replicas that leave checkpoint (the leader) instead of handing their work to others.
JOB_PREEMPTED = "run/preempted"
# The coordinator's R, --stale-s and shard ports, for tools: a member takes them from its sealed
# welcome (`Membership.params`), never from here.
REPLICAS = "coord/replicas"
COORD_STALE_S = "coord/stale_s"
COORD_PID = "coord/pid"  # the coordinator's process id (a `coordinator` fault kills it)
SHARDS = "coord/shards"  # JSON [port, ...] of the store shards (control/shards.py)
COORD_EXITS = "coord/exits"  # JSON {replica: how the coordinator saw it end} (launcher summary)
# The coordinator's proof of its run token (admission.proof(token, RUN_PURPOSE); "-": none): a
# process checks it before it touches anything of the run's (recover.layouts.mesh).
RUN_PROOF = "coord/run"
RUN_PURPOSE = "recover-run"


# -- membership (written by the coordinator) --------------------------------------------------
def members_key(g: int) -> str:
    return f"gen/{g}/members"


def reason_key(g: int) -> str:
    return f"gen/{g}/reason"


def comm_prefix(g: int, position: int) -> str:
    """Namespace of generation g's communicator at one position (its barrier and gloo keys)."""
    return f"gen{g}/pos{position}"


def gloo_addr(prefix: str, rank: int) -> str:
    """The address a rank's gloo device binds in one communicator (`prefix` = gen{g}/pos{p})."""
    return f"{prefix}/addr/{rank}"


def encode_members(members: list[int]) -> bytes:
    return json.dumps(sorted(members)).encode()


def decode_members(raw: bytes) -> list[int]:
    """The members in a stored value, its seal (if any) dropped unverified: for tools and tests
    that show a value; the protocol reads members with `generation_members` (verified)."""
    head, sep, tag = raw.rpartition(b"|")
    return [int(m) for m in json.loads(head if sep and len(tag) == 32 else raw)]


def valid_members(raw: bytes) -> bool:
    """Whether an opened members value is one the coordinator writes: a sorted JSON list of
    distinct replica ids, within MAX_REPLICAS."""
    try:
        members = json.loads(raw)
    except ValueError:
        return False
    return (isinstance(members, list) and len(members) <= MAX_REPLICAS
            and all(type(m) is int and 0 <= m < MAX_REPLICAS for m in members)
            and members == sorted(set(members)))


# The push that tells members of a generation carries it as a change to the one before, so a
# member that knows that one learns the new one without a store round trip (a failure would
# otherwise send every rank of the job to the one store server at the same moment). A change
# larger than this is not pushed: those members read the store.
PUSH_DELTA_MAX = 1024


def gen_push(g: int, base: int | None, old: list[int], new: list[int]) -> str:
    """`gen <g>` and, when `base` is the generation published just before with members `old`,
    `<base> <left> <joined>` (comma-separated replicas, `-` for none)."""
    left, joined = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    if base is None or len(left) + len(joined) > PUSH_DELTA_MAX:
        return f"gen {g}\n"

    def csv(xs: list[int]) -> str:
        return ",".join(map(str, xs)) or "-"
    return f"gen {g} {base} {csv(left)} {csv(joined)}\n"


def read_gen_push(words: list[str], known: dict[int, list[int]]) -> tuple[int, list[int] | None]:
    """(g, its members) from a `gen_push` line's words; members None when the line carries no
    change or its base generation is not in `known` (then they are read from the store)."""
    g = int(words[1])
    if len(words) < 5 or int(words[2]) not in known:
        return g, None

    def ids(w: str) -> set[int]:
        return set() if w == "-" else {int(x) for x in w.split(",")}
    return g, sorted(set(known[int(words[2])]) - ids(words[3]) | ids(words[4]))


# -- the step protocol (written by the replicas) ----------------------------------------------
def chain_key(step: int | str, k: int) -> str:
    return f"step/{step}/chain/{k}"


def evidence_key(step: int | str, g: int, seen: int, token: str | None = None) -> str:
    """Ranks of generation `seen` (and of g) that hold a verified result of step t's attempt in
    generation g, counted (`add`) once each after the membership changed (recovery/decide.py);
    with a token its name carries a tag only the token gives (`sealed.hidden`)."""
    return sealed.hidden(token, f"step/{step}/g{g}/ev{seen}")


def decision_key(step: int | str, g: int) -> str:
    return f"step/{step}/g{g}/decision"


def count_key(step: int | str, g: int, token: str | None = None) -> str:
    """Verified results of step t's reduce in generation g, counted (`add`) by each rank; with a
    token its name carries a tag only the token gives (`sealed.hidden`)."""
    return sealed.hidden(token, f"step/{step}/g{g}/count")


COMMIT, REDO = b"commit", b"redo"  # decisions
# Also a commit; and the next step's plan (entry 0 of its chain) goes through the store, not
# implied (a joiner waits, a scheduled join is due, or a replica's ranks may see other speeds).
COMMIT_PLAN = b"commit-plan"
COMMITS = (COMMIT, COMMIT_PLAN)
# Also a commit, decided on evidence after a fault: `commit@{s}` implies the next step's plan
# for the members of generation s (every rank that counted the evidence learned s), not g's.
COMMIT_AT = b"commit@"


def commit_at(s: int) -> bytes:
    """The decision of a commit on evidence counted in generation s (`COMMIT_AT`)."""
    return COMMIT_AT + str(s).encode()


def is_commit(decision: bytes | None) -> bool:
    """Whether a decision value commits its attempt (`commit`, `commit-plan`, `commit@{s}`)."""
    return decision is not None and (decision in COMMITS or implied_generation(decision, 0)
                                     is not None)


def implied_generation(decision: bytes, g: int) -> int | None:
    """The generation whose members the next step's implied plan is for, after a commit in g
    with `decision`: g for `commit`, s for `commit@{s}`; None when the plan is stored (or not a
    commit)."""
    if decision == COMMIT:
        return g
    if decision.startswith(COMMIT_AT) and decision[len(COMMIT_AT):].isdigit():
        return int(decision[len(COMMIT_AT):])
    return None


def is_decision(value: bytes | None) -> bool:
    """Whether a value read from a decision key is one (a commit of any kind, or `redo`)."""
    return value == REDO or is_commit(value)


# -- joining (a replica admitted mid-run) ----------------------------------------------------
def donor_key(epoch: int, rank: int) -> str:
    """host:port where the donor's rank `rank` serves the state for join `epoch`."""
    return f"join/{epoch}/donor/{rank}"


def join_info_key(replica: int) -> str:
    """JSON {transfer_s, bytes, step} of a joiner's latest state transfer (for the metrics)."""
    return f"join/info/{replica}"


# -- the trainer's records ------------------------------------------------------------------
def record_key(step: int) -> str:
    return f"rec/{step}"


# -- access ----------------------------------------------------------------------------------
def serve_store(host: str, port: int) -> TCPStore:
    """A TCPStore server on `port` (0: any) of exactly `host` (control/listen.py: a name is
    resolved, IPv4 first; IPv6 is IPv6 only; never every interface unless `host` says so), or
    `listen.ListenError` (one line).

    Why our own listener, whatever the host: torch's server, given a host, listens on every
    interface (`*`) and dual-stack, so it sees a local client as ::ffff:127.0.0.1, and its one
    thread resolves every new peer's name; /etc/hosts does not answer a v4-mapped address, so each
    connection costs a DNS query, and one that gets no reply stalls the server for everyone for the
    resolver's 5 s (docs/MEASUREMENTS.md, "TCPStore"). An AF_INET listener shows peers as plain
    IPv4, which /etc/hosts answers for loopback. torch's libuv server takes an AF_INET6
    descriptor too; its peers' names are then looked up as IPv6, which /etc/hosts may not answer
    (many hosts list no ::1): an IPv6 store can pay that cost.
    """
    sock = listen.listen(host, port, backlog=4096)
    bound = sock.getsockname()[1]
    # The server's own client connects to the bound address, numeric: no name lookup.
    local = listen.bound_host(sock)
    # The store takes the descriptor over (it closes it when it stops): detach it from Python.
    return TCPStore(local, bound, is_master=True, wait_for_workers=False,
                    master_listen_fd=sock.detach(), use_libuv=True)


def connect_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A client of the coordinator's TCPStore; raises ConnectionError with a readable message."""
    try:
        return TCPStore(host, port, is_master=False, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # torch raises DistNetworkError / RuntimeError with C++ context
        raise ConnectionError(f"cannot reach the recover coordinator at {host}:{port}: "
                              f"{str(e).splitlines()[0]}") from None


def store_int(store: TCPStore, key: str) -> int:
    """Read an integer counter without blocking (add 0 creates it as 0 if missing)."""
    return int(store.add(key, 0))


_ABSENT = "\x00recover:absent"  # a value recover never stores


def try_get(store: TCPStore, key: str) -> bytes | None:
    """Non-blocking get in one round trip: None when the key does not exist yet.

    compare_set with an expected value that is never stored changes nothing and returns the
    current value, or the expected value itself when the key is missing (docs/MEASUREMENTS.md,
    "TCPStore").
    """
    v = store.compare_set(key, _ABSENT, _ABSENT)
    return None if v == _ABSENT.encode() else v


def generation_members(store: TCPStore, g: int, token: str | None = None) -> list[int] | None:
    """Generation g's members, or None if it was never published (or what is stored there is
    not the coordinator's: absent, logged)."""
    raw = read(store, token, members_key(g), valid_members)
    return None if raw is None else [int(m) for m in json.loads(raw)]


def newest_members(store: TCPStore, token: str | None = None) -> list[int] | None:
    """The newest published generation's members, or None before the first one (or when
    `gen/count` names one whose members are not the coordinator's: a forged count or value)."""
    count = store_int(store, GEN_COUNT)
    if count <= 0:
        return None
    if token:
        return generation_members(store, count - 1, token)
    raw = try_get(store, members_key(count - 1))
    try:
        return None if raw is None else decode_members(raw)
    except ValueError:
        sealed.rejected(members_key(count - 1), "not a member list")
        return None


# -- sealed values (control/sealed.py) -----------------------------------------------------
Check = Callable[[bytes], bool]
_REPLACE_TRIES = 16  # a stranger racing every replacement can stall a writer this many rounds


def _opened(token: str | None, key: str, raw: bytes | None, valid: Check | None
            ) -> bytes | None:
    value = sealed.open_value(token, key, raw)
    if value is not None and valid is not None and not valid(value):
        sealed.rejected(key, f"not a valid value: {value[:80]!r}")
        return None
    return value


def read(store: TCPStore, token: str | None, key: str, valid: Check | None = None
         ) -> bytes | None:
    """`key`'s value if it is present, authentic (sealed with the run's token) and `valid`;
    else None (a stranger's value is logged, rate-limited)."""
    return _opened(token, key, try_get(store, key), valid)


Accept = Callable[[bytes], "bytes | None"]


def wait_value(store: TCPStore, token: str | None, key: str, within: Deadline, what: str, *,
               valid: Check | None = None, poll_s: float = 0.01,
               stop: Callable[[], bool] | None = None) -> bytes | None:
    """`key`'s value as `read` gives it, polled every `poll_s` (one round trip each, never a
    blocking get: the caller's thread stays free to notice the run change); None as soon as
    `stop()` says it is no longer wanted; TimeoutError(`what`) once `within` has passed. For
    waits that a newer generation must not interrupt; `KeyWaiter` (control/waiter.py) is the
    blocking one that a newer generation does."""
    def arrived() -> tuple[bytes | None] | None:
        value = read(store, token, key, valid)
        if value is not None:
            return (value,)
        return (None,) if stop is not None and stop() else None

    return wait_until(arrived, within, poll_s, what)[0]


def opener(token: str | None, key: str, valid: Check | None = None) -> Accept:
    """What a blocking reader (`KeyWaiter.get`) applies to each value it reads: None keeps it
    waiting for an authentic, valid one."""
    return lambda raw: _opened(token, key, raw, valid)


def set_sealed(store: TCPStore, token: str | None, key: str, value: bytes | str) -> None:
    """`set` a value that readers open with `read` (or `opener`)."""
    store.set(key, sealed.seal(token, key, value.encode() if isinstance(value, str) else value))


def put_once(store: TCPStore, token: str | None, key: str, value: bytes | str,
             valid: Check | None = None) -> bytes:
    """Write `key` once (compare-and-set against ""), sealed; return the value that won, opened.

    A stored value that is not authentic or not `valid` never wins: it is replaced by
    compare-and-set against exactly it (so an honest writer racing us still wins once), a
    bounded number of times; a stranger who keeps rewriting it past that gets a ValueError,
    which callers handle as the store's failure. Without a token only invalid values can be
    told from honest ones (a tokenless run has no authenticated control plane)."""
    plain = value.encode() if isinstance(value, str) else value
    mine = sealed.seal(token, key, plain)
    expected: bytes | str = ""
    for _ in range(_REPLACE_TRIES):
        stored = store.compare_set(key, expected, mine)
        if stored == mine:
            return plain
        opened = _opened(token, key, stored, valid)
        if opened is not None:
            return opened
        expected = stored  # a stranger's: replace exactly it
    raise ValueError(f"{key}: a stranger rewrote it {_REPLACE_TRIES} times over ours")
