"""The K/V pool shared by processes (engine.kv_pool_dir; engine/kv_files.py): a real second process (multiprocessing
spawn) and this one open the same folder. A turn run in the other process is served to this one's engine with greedy
tokens identical to an engine with no pool; a version published in one process makes the other's entries unservable;
the byte bound holds across both (least recently used first, whoever used it); a forced hash collision serves nothing;
a writer that dies mid-write leaves a file that is never served and is swept; a folder no live process uses is stale
and wiped; the last process to close removes it. Nothing is mocked: the crash is a real os._exit inside a real write.
Pool-level checks use standalone SequenceKVs of random values; the turn runs the real BuiltinEngine on the tiny model."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.builtin.runner import SequenceKV
from loomrl.engine.kv_files import FileStore
from loomrl.engine.kv_pool import SharedKVPool, open_pool
from loomrl.engine.placement import BLOCK, block_hashes

pytestmark = pytest.mark.integration  # starts a process (a few seconds)

ENTRY_BYTES = 2 * 2 * 2 * 4 * 4  # per token of _kv: layers x (K, V) x kv_heads x head_dim x 4 bytes


def _kv(n: int, seed: int) -> SequenceKV:
    kv = SequenceKV(2, 2, 4, n, torch.float32)  # [layers, 2, kv_heads, n, head_dim]
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(seed)))
    kv.length = n
    return kv


def _collide(tokens: list[int]) -> list[int]:
    return [7] * (len(tokens) // BLOCK)  # every block of every prefix hashes alike


def _greedy(prompt: list[int], pid: str) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, program_id=pid,
                             sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))


# -- the other process -----------------------------------------------------------------------------------------------
def _half_then_die(path: Path, data: torch.Tensor) -> None:
    raw = data.contiguous().view(-1).view(torch.uint8).numpy()
    with open(path, "wb") as f:
        f.write(memoryview(raw)[: len(raw) // 2])
        f.flush()
    os._exit(3)  # the writer dies with its file half written


def _serve(conn) -> None:
    """Commands from the test, one at a time: (name, args) -> reply."""
    from loomrl.config import ModelConfig
    from loomrl.engine import kv_files
    from loomrl.model.loader import load_model

    pools: dict[str, SharedKVPool] = {}
    engines: dict[str, BuiltinEngine] = {}
    while True:
        cmd, args = conn.recv()
        if cmd == "open":
            folder, capacity, collide = args
            pools[folder] = SharedKVPool(capacity_bytes=capacity, hasher=_collide if collide else block_hashes,
                                         store=FileStore(folder, capacity))
            reply = None
        elif cmd == "turn":
            folder, prompt, pid = args
            if folder not in engines:
                model, tok = load_model(ModelConfig(kind="tiny"))
                engines[folder] = BuiltinEngine(model, eos_token_id=tok.eos_token_id, kv_pool=pools[folder])
            reply = asyncio.run(engines[folder].generate(_greedy(prompt, pid))).token_ids
        elif cmd == "put":
            folder, tokens, seed, version = args
            reply = pools[folder].put(tokens, _kv(len(tokens), seed), version)
        elif cmd == "get":
            folder, tokens, version = args
            reply = pools[folder].get(tokens, version)[0]
        elif cmd == "new_version":
            folder, version = args
            reply = pools[folder].new_version(version)
        elif cmd == "metrics":
            m = pools[args[0]].metrics
            reply = (m.puts, m.evictions, m.version_drops, m.hits)
        elif cmd == "crash_put":
            folder, tokens = args
            kv_files.write_entry = _half_then_die
            pools[folder].put(tokens, _kv(len(tokens), 9), pools[folder].version or 0)
            reply = "not reached"
        elif cmd == "exit_dirty":
            os._exit(0)  # no close: its folder stays, with nobody using it
        else:
            for e in engines.values():
                e.close()
            for p in pools.values():
                p.close()
            conn.send("bye")
            return
        conn.send(reply)


class Other:
    """The other process: call(name, *args) runs a command there and returns its reply."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child_conn,), daemon=True)
        self.proc.start()

    def call(self, name: str, *args):
        self.conn.send((name, args))
        if not self.conn.poll(120):
            raise TimeoutError(f"the other process did not answer {name} in 120 s")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.call("stop")
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def other():
    o = Other()
    yield o
    o.stop()


# -- tests -------------------------------------------------------------------------------------------------------------
def test_a_turn_of_another_process_is_served_here_with_identical_tokens(other, tmp_path, tiny_model, tokenizer):
    folder = str(tmp_path / "pool")
    prompt = tokenizer.encode("Program 0: " + " ".join(f"fact {j} is {j * 3 % 7}." for j in range(12)))
    obs = tokenizer.encode(" Tool said 42.")
    pool = open_pool(64 << 20, folder)
    other.call("open", folder, 64 << 20, False)
    plain = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id)  # no pool: the reference
    pooled = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, kv_pool=pool)
    try:
        first = other.call("turn", folder, prompt, "p0")  # computed there, its K/V put in the folder
        assert first == asyncio.run(plain.generate(_greedy(prompt, "p0"))).token_ids
        second = prompt + first + obs
        want = asyncio.run(plain.generate(_greedy(second, "p1"))).token_ids  # another program id: no cache reuse
        got = asyncio.run(pooled.generate(_greedy(second, "p0"))).token_ids
        assert got == want
        assert pooled.metrics.reused_tokens == len(prompt) + len(first) - 1  # all the other process's turn left
        assert pool.metrics.hits == 1 and pool.metrics.tokens_served == pooled.metrics.reused_tokens
    finally:
        plain.close()
        pooled.close()
        pool.close()


def test_a_version_published_in_one_process_makes_the_others_entries_unservable(other, tmp_path):
    folder = str(tmp_path / "pool")
    pool = open_pool(1 << 20, folder)
    other.call("open", folder, 1 << 20, False)
    a = list(range(40))
    assert other.call("put", folder, a, 1, 0)
    assert pool.get(a, version=0)[0] == 40  # served here, from the other process's put
    other.call("new_version", folder, 1)
    assert pool.version == 1 and len(pool) == 0 and pool.get(a, version=0) == (0, None)
    assert pool.get(a, version=1) == (0, None)
    assert not pool.put(a, _kv(40, 2), version=0)  # an engine here still on version 0: refused
    pool.new_version(0)  # an older version published late changes nothing
    assert pool.version == 1 and other.call("metrics", folder)[2] == 1  # the drop counted where it happened
    pool.close()


def test_the_byte_bound_holds_across_processes_least_recently_used_first(other, tmp_path):
    folder = str(tmp_path / "pool")
    capacity = int(2.5 * 32 * ENTRY_BYTES)  # two entries of 32 tokens fit, not three
    pool = open_pool(capacity, folder)
    other.call("open", folder, capacity, False)
    a, b, c = ([k] * 32 for k in (1, 2, 3))
    assert pool.put(a, _kv(32, 1), 0)
    assert other.call("put", folder, b, 2, 0)
    assert other.call("get", folder, a, 0) == 32  # a used last, by the other process: b is the least recent
    assert pool.put(c, _kv(32, 3), 0)
    assert pool.metrics.evictions == 1 and other.call("metrics", folder)[1] == 0
    assert len(pool) == 2 and pool.nbytes == 2 * 32 * ENTRY_BYTES <= capacity
    assert other.call("get", folder, b, 0) == 0 and pool.get(a, 0)[0] == 32 and other.call("get", folder, c, 0) == 32
    assert len(list((Path(folder) / "kv").glob("*.kv"))) == 2  # the evicted entry's file is gone too
    pool.close()


def test_a_forced_hash_collision_serves_nothing_across_processes(other, tmp_path):
    folder = str(tmp_path / "pool")
    pool = SharedKVPool(capacity_bytes=1 << 20, hasher=_collide, store=FileStore(folder, 1 << 20))
    other.call("open", folder, 1 << 20, True)
    a = list(range(48))
    assert other.call("put", folder, a, 1, 0)
    assert pool.get(list(range(100, 148)), version=0) == (0, None)  # same hashes, other tokens
    assert pool.get(a[:10] + list(range(200, 238)), version=0) == (0, None)  # shares less than a block
    n, kv = pool.get(a[:20] + list(range(300, 328)), version=0)
    assert n == 20 and kv is not None  # what the tokens confirm, with the other process's K/V
    assert torch.equal(kv.data[:, :, :, :20], _kv(48, 1).data[:, :, :, :20])
    pool.close()


def test_a_half_written_file_is_never_served_and_a_stale_folder_is_wiped(other, tmp_path):
    """Runs last: the other process dies in it."""
    folder = str(tmp_path / "pool")
    pool = open_pool(1 << 20, folder)  # a live user: the crash below must not make the folder look stale
    other.call("open", folder, 1 << 20, False)
    whole, torn = list(range(32)), list(range(1000, 1032))
    assert other.call("put", folder, whole, 1, 0)
    other.conn.send(("crash_put", (folder, torn)))
    other.proc.join(60)
    assert other.proc.exitcode == 3
    tmp = list((Path(folder) / "kv").glob("tmp-*"))
    assert len(tmp) == 1 and tmp[0].stat().st_size == 32 * ENTRY_BYTES // 2
    assert pool.get(torn, 0) == (0, None) and len(pool) == 1  # never indexed: never served
    assert pool.get(whole, 0)[0] == 32  # the dead writer's complete entry is whole: it may serve
    entry, = (Path(folder) / "kv").glob("*.kv")
    os.truncate(entry, 100)  # a torn entry file under its final name: refused by its size, its row dropped
    assert pool.get(whole, 0) == (0, None) and len(pool) == 0
    pool.new_version(1)  # the sweep: its writer is dead
    assert not list((Path(folder) / "kv").glob("tmp-*"))
    pool.close()
    assert not Path(folder).exists()  # the last user removed it

    stale = Other()  # a process that dies without closing leaves a folder nobody uses
    try:
        stale.call("open", folder, 1 << 20, False)
        assert stale.call("put", folder, whole, 1, 0)
        stale.conn.send(("exit_dirty", ()))
        stale.proc.join(60)
    finally:
        stale.stop()
    assert len(list((Path(folder) / "kv").glob("*.kv"))) == 1
    pool = open_pool(1 << 20, folder)  # its only user: all of it is stale
    assert len(pool) == 0 and pool.version is None and pool.get(whole, 0) == (0, None)
    assert not list((Path(folder) / "kv").glob("*"))
    pool.close()
