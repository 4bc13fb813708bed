"""The K/V pool's store shared by processes (engine.kv_pool_dir): one file per entry in a folder on tmpfs (/dev/shm:
host memory), an SQLite index beside them. Every engine process on a node given the same folder shares its entries,
its served weight version and its byte bound (engine/kv_store.py's KVStore; SharedKVPool checks tokens above it).

Layout of the folder:
- `index.db` (SQLite, WAL, a bounded busy timeout): the served version; per entry its key, tokens, block hashes,
  version, shape and dtype, file name, bytes and last use (time.time_ns: one node, one clock).
- `kv/<uuid>.kv`: an entry's K/V, raw bytes of a contiguous [layers, 2, kv_heads, tokens, head_dim] tensor. A put
  writes `kv/tmp-<pid>-<uuid>`, renames it (atomic) and only then commits its index row: a reader only ever opens a
  file that a committed row names, so a writer that crashes mid-write leaves a `tmp-` file that nothing serves.
- `users.lock`: every process using the folder holds a shared flock on it (the kernel releases it when a process
  dies). A process that opens the folder and can take it exclusively is its only user: whatever is there is stale
  (a crashed run's) and is wiped before use, so K/V of another run's weights that happen to carry the same version
  number is never served. The last process to close it (it can take the lock exclusively) removes the folder.

Reads map the entry's file copy-on-write (mmap, MAP_PRIVATE) and hand the mapping to the engine, which copies the
prefix into its running K/V. Another process may evict (unlink) the file meanwhile: on Linux the mapping keeps the
inode alive until it is dropped, and files are never rewritten in place (each entry's name is new), so a reader sees
the whole entry or, when the unlink came before its open, a miss. A file whose size is not the row's is never
served (its row is dropped). Stale `tmp-` files of dead writers and `.kv` files no row names (a writer that died
between rename and commit) are removed at each new version and when a sole user opens the folder.

Errors: an index call that fails (a busy timeout past BUSY_TIMEOUT_S, a folder removed under a late process) is
logged with its cause and counts as a miss or a put not kept: the engine recomputes, it never waits unbounded.

What it is not: a store across nodes (a folder is one host's memory), nor durable (tmpfs, synchronous=OFF).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import sqlite3
import threading
import time
import uuid
import weakref
from pathlib import Path

import numpy as np
import torch

from loomrl.engine.kv_store import Candidate, nbytes_of
from loomrl.processes import pid_alive

log = logging.getLogger("loomrl")

BUSY_TIMEOUT_S = 5.0  # SQLite waits this long for another process's write transaction before the call fails
OPEN_TRIES = 50  # opening races a last user removing the folder: tries, OPEN_RETRY_S apart
OPEN_RETRY_S = 0.1
ORPHAN_AGE_S = 60.0  # a `.kv` file no row names, this old, was left by a writer that died between rename and commit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER);
CREATE TABLE IF NOT EXISTS entries (key INTEGER PRIMARY KEY AUTOINCREMENT, version INTEGER NOT NULL,
    tokens BLOB NOT NULL, shape TEXT NOT NULL, dtype TEXT NOT NULL, file TEXT NOT NULL, nbytes INTEGER NOT NULL,
    last_use INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (hash INTEGER NOT NULL, key INTEGER NOT NULL, PRIMARY KEY (hash, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_by_key ON blocks (key);
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_use, key);
"""


def write_entry(path: Path, data: torch.Tensor) -> None:
    """The raw bytes of `data` into `path` (module-level: a test makes a writer crash halfway through it)."""
    raw = data.contiguous().view(-1).view(torch.uint8).numpy()
    with open(path, "wb") as f:
        f.write(memoryview(raw))


def _read_entry(path: Path, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The entry's K/V over a private mapping of its file; None when it is gone or not `nbytes` long."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != nbytes:
                return None
            mapped = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)  # outlives the descriptor and an unlink
    except (FileNotFoundError, ValueError):
        return None
    raw = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8))  # keeps the mapping alive as long as it lives
    return raw.view(dtype).view(shape)


    return True


def _remove_folder(root: Path) -> None:
    """Everything the store put under `root`, then `root` (left when another process created a file meanwhile)."""
    for p in [*(root / "kv").glob("*"), *root.glob("index.db*"), root / "users.lock"]:
        p.unlink(missing_ok=True)
    for d in (root / "kv", root):
        with contextlib.suppress(OSError):
            d.rmdir()


def _close(conn: sqlite3.Connection, lock_fd: int, root: Path) -> None:
    """Close the index; the last user (the lock can be taken exclusively) removes the folder."""
    with contextlib.suppress(sqlite3.Error):
        conn.close()
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _remove_folder(root)
    except BlockingIOError:
        pass  # others use it still
    finally:
        os.close(lock_fd)


class FileStore:
    """KVStore over a folder shared by processes; thread-safe (one SQLite connection under a lock per process)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.root = Path(directory)
        self._lock = threading.Lock()
        self._lock_fd = self._join()
        try:
            self._conn = sqlite3.connect(self.root / "index.db", timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                         check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=OFF")  # tmpfs: nothing survives the host anyway
            self._conn.executescript(_SCHEMA)
        except sqlite3.Error as e:
            os.close(self._lock_fd)
            raise RuntimeError(f"K/V pool folder {self.root}: its index could not be opened ({e})") from e
        self._finalizer = weakref.finalize(self, _close, self._conn, self._lock_fd, self.root)

    def _join(self) -> int:
        """Hold a shared lock on the folder's users.lock (wiping a stale folder first when this is its only user)."""
        path = self.root / "users.lock"
        for _ in range(OPEN_TRIES):
            (self.root / "kv").mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                for p in [*(self.root / "kv").glob("*"), *self.root.glob("index.db*")]:  # no one else: all stale
                    p.unlink(missing_ok=True)
                fcntl.flock(fd, fcntl.LOCK_SH)
            except BlockingIOError:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # a last user is removing the folder, or a sole one wiping it
                    os.close(fd)
                    time.sleep(OPEN_RETRY_S)
                    continue
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:  # not a lock file a last user removed meanwhile
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)
        raise TimeoutError(f"K/V pool folder {self.root}: could not join it in {OPEN_TRIES * OPEN_RETRY_S:.0f} s "
                           "(another process kept removing or wiping it)")

    def close(self) -> None:
        with self._lock:
            self._finalizer()

    # -- the index ------------------------------------------------------------------------------------------------
    def _run(self, what: str, fn, default):
        """fn(connection) under this process's lock; a failing index call is logged and answers `default`."""
        with self._lock:
            if not self._finalizer.alive:
                return default
            try:
                return fn(self._conn)
            except sqlite3.Error as e:
                log.warning("K/V pool %s: %s failed (%s): treated as a miss", self.root, what, e)
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
                return default

    def served(self) -> int | None:
        def read(c: sqlite3.Connection) -> int | None:
            row = c.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
            return None if row is None else row[0]

        return self._run("reading the version", read, None)

    def publish(self, version: int) -> tuple[int, int]:
        def swap(c: sqlite3.Connection) -> tuple[int, list[str]]:
            c.execute("BEGIN IMMEDIATE")
            row = c.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
            if row is not None and version <= row[0]:
                c.execute("COMMIT")
                return row[0], []
            files = [f for (f,) in c.execute("SELECT file FROM entries")]
            c.execute("DELETE FROM entries")
            c.execute("DELETE FROM blocks")
            c.execute("INSERT OR REPLACE INTO meta VALUES ('version', ?)", (version,))
            c.execute("COMMIT")
            return version, files

        served, files = self._run("publishing a version", swap, (None, []))
        self._unlink(files)
        if files or served == version:
            self._sweep()
        return served if served is not None else version, len(files)

    def candidates(self, hashes: list[int], version: int) -> list[Candidate]:
        marks = ",".join("?" * len(hashes))

        def read(c: sqlite3.Connection) -> list[Candidate]:
            rows = c.execute(f"SELECT DISTINCT e.key, e.tokens FROM blocks b JOIN entries e ON e.key = b.key "
                             f"WHERE b.hash IN ({marks}) AND e.version = ?", (*hashes, version)).fetchall()
            return [Candidate(key=k, tokens=tuple(np.frombuffer(t, dtype=np.int64).tolist())) for k, t in rows]

        return self._run("looking up a prefix", read, []) if hashes else []

    def load(self, key: int, *, data: bool = True) -> torch.Tensor | None:
        def touch(c: sqlite3.Connection):
            c.execute("UPDATE entries SET last_use = ? WHERE key = ?", (time.time_ns(), key))
            return c.execute("SELECT file, nbytes, shape, dtype FROM entries WHERE key = ?", (key,)).fetchone()

        row = self._run("reading an entry", touch, None)
        if row is None or not data:
            return None
        file, nbytes, shape, dtype = row
        out = _read_entry(self.root / "kv" / file, nbytes, tuple(int(s) for s in shape.split(",")),
                          getattr(torch, dtype))
        if out is None:  # unlinked before we opened it (evicted meanwhile), or not whole: never served
            self._unlink(self._run("dropping an unreadable entry", lambda c: self._delete(c, [key]), []))
        return out

    def insert(self, *, tokens: list[int], hashes: list[int], version: int, data: torch.Tensor,
               replaces: list[int]) -> int | None:
        unique = uuid.uuid4().hex
        name, tmp = f"{unique}.kv", self.root / "kv" / f"tmp-{os.getpid()}-{unique}"
        try:
            write_entry(tmp, data)  # outside every lock: other processes' reads and writes go on
            os.rename(tmp, self.root / "kv" / name)  # complete under its final name before any row names it
        except OSError as e:
            log.warning("K/V pool %s: writing an entry failed (%s): not kept", self.root, e)
            tmp.unlink(missing_ok=True)
            return None
        nbytes = nbytes_of(data)
        shape = ",".join(str(s) for s in data.shape)
        dtype = str(data.dtype).removeprefix("torch.")

        def add(c: sqlite3.Connection) -> tuple[int | None, list[str]]:
            c.execute("BEGIN IMMEDIATE")
            row = c.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
            if row is None or row[0] != version:  # a new version was published meanwhile
                c.execute("COMMIT")
                return None, [name]
            gone = self._delete(c, replaces)
            key = c.execute("INSERT INTO entries (version, tokens, shape, dtype, file, nbytes, last_use) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)", (version, np.asarray(tokens, dtype=np.int64).tobytes(),
                                                             shape, dtype, name, nbytes, time.time_ns())).lastrowid
            c.executemany("INSERT OR IGNORE INTO blocks VALUES (?, ?)", [(h, key) for h in hashes])
            evicted, total = 0, c.execute("SELECT SUM(nbytes) FROM entries").fetchone()[0]
            while total > self.capacity_bytes:  # least recently used first, of every process; the new one is newest
                lru, size = c.execute("SELECT key, nbytes FROM entries WHERE key != ? ORDER BY last_use, key LIMIT 1",
                                      (key,)).fetchone()
                gone += self._delete(c, [lru])
                total, evicted = total - size, evicted + 1
            c.execute("COMMIT")
            return evicted, gone

        evicted, gone = self._run("adding an entry", add, (None, [name]))
        self._unlink(gone)  # after the commit: a reader that mapped one keeps its pages
        return evicted

    @staticmethod
    def _delete(c: sqlite3.Connection, keys: list[int]) -> list[str]:
        """Rows of `keys` removed (inside the caller's transaction, or on their own); their files, to unlink."""
        files = []
        for key in keys:
            row = c.execute("SELECT file FROM entries WHERE key = ?", (key,)).fetchone()
            if row is not None:
                files.append(row[0])
                c.execute("DELETE FROM entries WHERE key = ?", (key,))
                c.execute("DELETE FROM blocks WHERE key = ?", (key,))
        return files

    def _unlink(self, files: list[str]) -> None:
        for f in files:
            (self.root / "kv" / f).unlink(missing_ok=True)

    def _sweep(self) -> None:
        """Remove `tmp-` files of writers no longer alive and old `.kv` files that no row names."""
        listed = self._run("listing entries", lambda c: [f for (f,) in c.execute("SELECT file FROM entries")], None)
        if listed is None:  # without the list every `.kv` file would look orphaned
            return
        named, now = set(listed), time.time()
        for p in (self.root / "kv").glob("*"):
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                if p.name.startswith("tmp-"):
                    if not pid_alive(int(p.name.split("-")[1])):
                        p.unlink()
                elif p.name not in named and now - p.stat().st_mtime > ORPHAN_AGE_S:
                    p.unlink()

    def usage(self) -> tuple[int, int]:
        def read(c: sqlite3.Connection) -> tuple[int, int]:
            n, b = c.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM entries").fetchone()
            return n, b

        return self._run("counting entries", read, (0, 0))
