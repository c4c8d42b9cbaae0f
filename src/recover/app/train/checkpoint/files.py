"""The checkpoint folder on disk: authenticated manifests, publishing, `latest`, pruning.

Invariants (several processes may write into one `root` at once, e.g. two replicas that both
believed they led around a membership change):
- A writer builds a step in its own temp folder `.tmp_step_XXXXXXXX_{host}_{pid}` and publishes it
  with one `rename`, which fails if the step already exists: a published step is never overwritten
  by a concurrent writer, and never half-written. An existing step is replaced only if it fails
  verification (moved aside first, by an atomic rename only one process can win).
- No writer deletes another live writer's files: leftovers are removed only by their own writer,
  or once their writer's PID is dead (on this host; another host's leftovers are left alone).
- `latest` never moves back: it is rewritten, under a lock, only to name a higher step than the
  one it names (or when what it names is gone).
- `meta.json` holds the manifest (step, RNG, every file's sha256, ...) and its HMAC-SHA256 keyed
  by the run token; it is authenticated before any field is used and before any DCP file (whose
  metadata is a pickle) is opened. Every failure is a one-line `CheckpointError` naming the file,
  whatever a crafted folder holds (a huge, deeply nested or non-regular meta.json included).
- A publish that fails (a full disk, no permission, an I/O error) leaves no temp file of its own
  behind and `latest` where it was.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

from recover.deadline import poll_until
from recover.errors import CheckpointError

KEEP = 3
FORMAT = 2  # 2: authenticated manifest (format 1 had bare digests, which authenticate nothing)
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
# Leftovers: .tmp_step_N_{host}_{pid} (a save), .bad_step_N_... (a step replaced for failing
# verification), .latest.{host}_{pid}.tmp (a pointer write). No host: an older, local writer.
_LEFTOVER = re.compile(r"^\.(?:tmp|bad)_step_\d{8,}_(?:(?P<host>.+)_)?(?P<pid>\d+)$|"
                       r"^\.latest\.(?:(?P<lhost>.+)_)?(?P<lpid>\d+)\.tmp$")
_LOCK_S = 30.0
# A manifest holds the RNG states and one digest per file (one file per rank): kilobytes, and a
# digest more per rank. Anything far bigger is not ours, and is not read.
MAX_META_BYTES = 64 << 20

log = logging.getLogger(__name__)


def writer_tag() -> str:
    """`{host}_{pid}`: names this process's temp files so that others can tell whose they are."""
    return f"{socket.gethostname()}_{os.getpid()}"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Published steps, oldest first."""
    found = []
    for p in Path(root).iterdir() if Path(root).is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, text: str) -> None:
    # fsync before the rename: after a power loss the new name must not point at empty contents.
    tmp = path.with_name(f".{path.name}.{writer_tag()}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A full disk fails the write or the fsync: a half-written temp file must not stay
        # behind holding the space (and `path` still holds its old contents).
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


# -- the manifest ------------------------------------------------------------------------------
def _mac(key: bytes, manifest: str) -> str:
    return hmac.new(key, manifest.encode(), hashlib.sha256).hexdigest()


def write_manifest(folder: Path, manifest: dict[str, Any], key: bytes) -> None:
    """Record every file of `folder` (its sha256) in the manifest, sign it, write meta.json."""
    manifest = dict(manifest, files={f.name: sha256(f) for f in sorted(folder.iterdir())
                                     if f.is_file() and f.name != "meta.json"})
    text = json.dumps(manifest, sort_keys=True)
    write_atomic(folder / "meta.json", json.dumps({"manifest": text, "hmac": _mac(key, text)}))


def _read_meta(meta_file: Path) -> Any:
    """meta.json's outer JSON: a regular file (a FIFO would block the read), at most
    `MAX_META_BYTES` (nothing bigger is read into memory), nested shallowly enough to parse."""
    path = meta_file.parent
    try:
        with open(meta_file, "rb", opener=lambda p, fl: os.open(p, fl | os.O_NONBLOCK)) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: not a "
                                      "regular file")
            raw = f.read(MAX_META_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: meta.json is missing") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: "
                              f"{e.strerror or type(e).__name__}") from None
    if len(raw) > MAX_META_BYTES:
        raise CheckpointError(f"checkpoint {path} has an oversized meta.json (over "
                              f"{MAX_META_BYTES:,} bytes): not a recover manifest")
    try:
        return json.loads(raw.decode())
    except RecursionError:
        raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: nested too deeply "
                              "to be a recover manifest") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"checkpoint {path} has an unreadable meta.json: "
                              f"{type(e).__name__}") from None


def read_manifest(path: Path, key: bytes) -> dict[str, Any]:
    """The authenticated manifest of checkpoint `path`; its files are not checked here."""
    meta_file = path / "meta.json"
    outer = _read_meta(meta_file)
    if not (isinstance(outer, dict) and isinstance(outer.get("manifest"), str)
            and isinstance(outer.get("hmac"), str)):
        raise CheckpointError(f"checkpoint {meta_file} is not an authenticated recover manifest "
                              "(tampered, or written by an older recover)")
    if not hmac.compare_digest(_mac(key, outer["manifest"]), outer["hmac"]):
        raise CheckpointError(f"checkpoint {meta_file} fails authentication: tampered, or "
                              "written by another run (its HMAC does not match this run's token)")
    try:
        m = json.loads(outer["manifest"])  # authentic: written by this run's code
    except (ValueError, RecursionError):
        m = None  # only the token's holder could have signed it: still not a manifest
    ok = (isinstance(m, dict) and m.get("format") == FORMAT and isinstance(m.get("step"), int)
          and isinstance(m.get("files"), dict) and ".metadata" in m["files"])
    if not ok:
        raise CheckpointError(f"checkpoint {meta_file} is not a format-{FORMAT} recover manifest")
    named = _STEP_DIR.match(path.name)
    if named and int(named.group(1)) != m["step"]:  # a renamed folder would relabel the state
        raise CheckpointError(f"checkpoint {path} holds step {m['step']}, not the step its "
                              "name says")
    return m


def verify_files(path: Path, manifest: dict[str, Any]) -> None:
    for name, digest in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if sha256(f) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match its "
                                  "sha256 (truncated or modified)")


def verify(path: Path, key: bytes) -> dict[str, Any]:
    """Authenticate the manifest and check every file; return the manifest."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    m = read_manifest(path, key)
    verify_files(path, m)
    return m


def find_latest(root: Path, key: bytes) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer one skipped (and why)."""
    skipped = []
    for _, path in reversed(step_dirs(root)):
        try:
            verify(path, key)
            return path, skipped
        except CheckpointError as e:
            skipped.append(f"skipped {path.name}: {e}")
    return None, skipped


# -- publishing --------------------------------------------------------------------------------
def publish(root: Path, tmp: Path, final: Path, key: bytes) -> bool:
    """Move a complete `tmp` to `final`, then advance `latest` and prune. False if another
    writer's verified copy of the step was already there (then `tmp` is dropped, theirs kept).

    The rename is the commit: an OSError before it is raised (nothing published, `latest` not
    moved; `tmp` is the caller's to remove); once the step is in place, a failure to move
    `latest` or to prune is logged, not raised (a resume finds the step by listing the folder).
    """
    mine = _rename_into_place(tmp, final)
    if not mine:
        try:
            verify(final, key)
        except CheckpointError:
            # The existing copy is bad (a tampered file, a resumed run re-saving over a corrupt
            # one): move it aside (one process wins this rename) and try once more.
            bad = final.with_name(f".bad_{final.name}_{writer_tag()}")
            try:
                os.rename(final, bad)
            except FileNotFoundError:
                pass  # another writer moved it first
            try:
                mine = _rename_into_place(tmp, final)
            finally:
                shutil.rmtree(bad, ignore_errors=True)
    if not mine:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        advance_latest(root, final.name)
        prune(root, keep=final)
    except (OSError, CheckpointError) as e:
        log.warning(f"published {final.name}, but could not update `latest` or prune "
                    f"{root}: {e}")
    return mine


def _rename_into_place(tmp: Path, final: Path) -> bool:
    try:
        os.rename(tmp, final)  # atomic; fails when `final` exists (it is never an empty folder)
        return True
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise


def _step_of(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def advance_latest(root: Path, name: str) -> bool:
    """Point `latest` at step folder `name` unless it names a higher step that exists."""
    with _locked(root / ".latest.lock"):
        try:
            current = (root / "latest").read_text().strip()
        except OSError:
            current = ""
        now = _step_of(current)
        if now is not None and now > (_step_of(name) or 0) and (root / current).is_dir():
            return False
        write_atomic(root / "latest", name + "\n")
        return True


class _locked:
    """An exclusive `flock` on `path`, waited for at most `_LOCK_S` (every wait is bounded)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if not poll_until(self._take, _LOCK_S, 0.01):
            os.close(self.fd)
            raise CheckpointError(f"{self.path} stayed locked for {_LOCK_S:.0f}s")

    def _take(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _writer_gone(host: str | None, pid: int) -> bool:
    """True only for this process's own leftovers or a dead writer on this host."""
    if host is not None and host != socket.gethostname():
        return False  # its PID means nothing here: leave it to its own host
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def prune(root: Path, keep: Path) -> None:
    """Keep the newest `KEEP` steps (and `keep`); drop leftovers whose writer is this process or
    dead. A step is kept even if older than others: a run resumed from it writes it."""
    others = [p for _, p in step_dirs(root) if p != keep]
    for p in others[:max(0, len(others) - (KEEP - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        m = _LEFTOVER.match(p.name)
        if m is None:
            continue
        host, pid = (m["host"], m["pid"]) if m["pid"] else (m["lhost"], m["lpid"])
        if _writer_gone(host, int(pid)):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
