"""The shared K/V pool (engine/kv_pool.py): the longest prefix held for the current weight version, never a wrong prefix
on a hash collision (forced), never an old version's K/V, a byte bound that drops the least recently used entry, its
metrics; and wired into the built-in engine and the router: greedy outputs identical with the pool on and off, with
fewer prompt tokens prefilled; engine.kv_pool_dir builds the pool over a shared folder (tests/engine/test_kv_pool_shared.py
shares one between processes). Pool unit tests use standalone SequenceKVs of random values; the engine tests run the
real BuiltinEngine over the tiny random model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from loomrl.config import EngineConfig, EngineSetup, ModelConfig
from loomrl.engine.base import GenerationRequest, SamplingParams
from loomrl.engine.builtin.engine import BuiltinEngine
from loomrl.engine.builtin.runner import SequenceKV
from loomrl.engine.factory import make_engine
from loomrl.engine.kv_files import FileStore
from loomrl.engine.kv_pool import PoolFetch, SharedKVPool
from loomrl.engine.placement import BLOCK
from loomrl.engine.router import Router


def _kv(n: int, seed: int) -> SequenceKV:
    kv = SequenceKV(2, 2, 4, n, torch.float32)  # [layers, 2, kv_heads, n, head_dim]
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(seed)))
    kv.length = n
    return kv


ENTRY_BYTES = 2 * 2 * 2 * 4 * 4  # per token: layers x (K, V) x kv_heads x head_dim x 4 bytes


def test_get_serves_the_longest_prefix_held_with_its_kv():
    pool = SharedKVPool(capacity_bytes=1 << 20)
    a, b = list(range(40)), list(range(20)) + list(range(500, 528))
    kva, kvb = _kv(40, 1), _kv(48, 2)
    assert pool.put(a, kva, version=0) and pool.put(b, kvb, version=0)
    n, kv = pool.get(a[:35] + [999] * 10, version=0)
    assert n == 35 and kv is not None
    assert torch.equal(kv.data[:, :, :, :n], kva.data[:, :, :, :n])  # a's K/V, not b's
    n, kv = pool.get(b + [7], version=0)
    assert n == 48 and kv is not None and torch.equal(kv.data[:, :, :, :n], kvb.data[:, :, :, :n])
    assert pool.get([5] * 40, version=0) == (0, None)  # nothing shares a block
    assert pool.get(a, version=0, held=40) == (0, None)  # the asker holds it all already
    m = pool.metrics
    assert (m.hits, m.misses, m.tokens_served, m.puts) == (2, 2, 35 + 48, 2)
    assert m.bytes_in == (40 + 48) * ENTRY_BYTES and m.bytes_out == (35 + 48) * ENTRY_BYTES


def test_a_forced_hash_collision_never_serves_a_wrong_prefix():
    pool = SharedKVPool(capacity_bytes=1 << 20, hasher=lambda tokens: [7] * (len(tokens) // BLOCK))  # all collide
    a = list(range(48))
    pool.put(a, _kv(48, 1), version=0)
    assert pool.get(list(range(100, 148)), version=0) == (0, None)  # same hashes, other tokens
    assert pool.get(a[:10] + list(range(200, 238)), version=0) == (0, None)  # shares less than a block
    n, _ = pool.get(a[:20] + list(range(300, 328)), version=0)
    assert n == 20  # what the tokens confirm, never the hash alone
    assert pool.metrics.misses == 2


def test_an_old_version_is_never_served_and_is_dropped_on_a_new_one():
    pool = SharedKVPool(capacity_bytes=1 << 20)
    a = list(range(32))
    pool.new_version(0)
    pool.put(a, _kv(32, 1), version=0)
    assert pool.get(a, version=1) == (0, None)  # an engine on newer weights than the pool's
    pool.new_version(1)
    assert len(pool) == 0 and pool.nbytes == 0 and pool.metrics.version_drops == 1
    assert pool.get(a, version=0) == (0, None) and pool.get(a, version=1) == (0, None)
    assert not pool.put(a, _kv(32, 1), version=0)  # an instance still on version 0 finishing a turn
    assert pool.put(a, _kv(32, 2), version=1) and pool.get(a + [1], version=1)[0] == 32


def test_the_byte_bound_drops_the_least_recently_used_entry():
    pool = SharedKVPool(capacity_bytes=int(2.5 * 32 * ENTRY_BYTES))  # two entries of 32 tokens fit, not three
    a, b, c = ([k] * 32 for k in (1, 2, 3))
    pool.put(a, _kv(32, 1), 0)
    pool.put(b, _kv(32, 2), 0)
    assert pool.get(a, 0)[0] == 32  # a used last: b is the least recently used
    pool.put(c, _kv(32, 3), 0)
    assert pool.metrics.evictions == 1 and pool.nbytes <= pool.capacity_bytes
    assert pool.get(b, 0) == (0, None) and pool.get(a, 0)[0] == 32 and pool.get(c, 0)[0] == 32


def test_a_turn_that_extends_an_entry_replaces_it_and_a_covered_one_is_not_copied():
    pool = SharedKVPool(capacity_bytes=1 << 20)
    turn1, turn2 = list(range(32)), list(range(64))
    pool.put(turn1, _kv(32, 1), 0)
    assert pool.put(turn2, _kv(64, 2), 0) and len(pool) == 1 and pool.nbytes == 64 * ENTRY_BYTES
    assert not pool.put(turn1, _kv(32, 3), 0)  # held already (the longer entry serves it)
    assert pool.metrics.puts == 2


def test_fetch_cost_is_copying_what_the_pool_holds_plus_recomputing_the_rest():
    pool = SharedKVPool(capacity_bytes=1 << 20)
    pool.put(list(range(64)), _kv(64, 1), 0)
    fetch = PoolFetch(pool=pool, prefill_tokens_per_s=lambda: 100.0)
    prompt = list(range(64)) + [900] * 36
    assert fetch.fetch_s(prompt, held=64) is None  # the instance holds all the pool has
    seconds = fetch.fetch_s(prompt, held=16)
    assert seconds is not None
    assert seconds == pytest.approx(48 * pool.bytes_per_token / pool.copy_bytes_per_s + 36 / 100.0)
    assert pool.metrics.hits == 0  # a cost estimate is not a fetch


# -- with the engine -----------------------------------------------------------------------------------------------
def _programs(tokenizer, n: int = 4):
    out = []
    for p in range(n):
        prompt = tokenizer.encode(f"Program {p}: " + " ".join(f"fact {p}.{j} is {j * p % 7}." for j in range(12)))
        out.append((f"p{p}", prompt, tokenizer.encode(f" Tool said {p * 11}.")))
    return out


def _multi_turn(engine, programs, turns: int = 3, new_tokens: int = 5, concurrent: bool = True):
    """Each program: generate greedily, append its output and observation, again."""
    async def program(pid, prompt, obs):
        ctx, outs = list(prompt), []
        for _ in range(turns):
            r = await engine.generate(GenerationRequest(prompt_ids=ctx, program_id=pid, sampling=SamplingParams(
                temperature=0.0, max_tokens=new_tokens, ignore_eos=True)))
            outs.append(r.token_ids)
            await asyncio.sleep(0.01)
            ctx = ctx + r.token_ids + obs
        return outs

    async def go():
        if concurrent:
            return await asyncio.gather(*[program(*p) for p in programs])
        return [await program(*p) for p in programs]

    return asyncio.run(go())


def test_one_engine_with_a_pool_reuses_what_its_budget_evicted_with_identical_outputs(tiny_model, tokenizer):
    programs = _programs(tokenizer)
    budget = 2 * max(len(p[1]) for p in programs) + 40  # about two programs: the others' K/V is evicted
    runs = {}
    for on in (False, True):
        pool = SharedKVPool(capacity_bytes=64 << 20) if on else None
        eng = BuiltinEngine(tiny_model, eos_token_id=tokenizer.eos_token_id, kv_budget_tokens=budget, kv_pool=pool)
        try:
            runs[on] = (_multi_turn(eng, programs), eng.metrics.prefill_tokens, pool)
        finally:
            eng.close()
    (off, prefill_off, _), (on, prefill_on, pool) = runs[False], runs[True]
    assert on == off
    assert prefill_on < prefill_off  # (preemptions under the budget differ between the runs: no exact difference)
    assert pool is not None and pool.metrics.tokens_served > 0 and pool.metrics.evictions == 0


def _setup(instances: int, router: str, pool_bytes: int) -> EngineSetup:
    return EngineSetup(engine=EngineConfig(instances=instances, router=router, kv_pool_bytes=pool_bytes),
                       model=ModelConfig(kind="tiny"), seed=0, context_tokens=4096, interrupt_on_update=False, cpus=1)


def test_a_program_moved_to_another_instance_fetches_its_prefix_from_the_pool(tiny_model, tokenizer):
    """round_robin sends each turn of a program to the other instance of two: without a pool every turn recomputes
    what its last turn left on the other instance."""
    programs = _programs(tokenizer, 2)
    runs = {}
    for pool_bytes in (0, 64 << 20):
        router = make_engine(_setup(2, "round_robin", pool_bytes), tiny_model, tokenizer, 0)
        assert isinstance(router, Router)
        try:
            outs = _multi_turn(router, programs, concurrent=False)
            runs[pool_bytes] = (outs, router.metrics.prefill_tokens, router)
        finally:
            router.close()
    (off, prefill_off, r_off), (on, prefill_on, r_on) = runs[0], runs[64 << 20]
    assert on == off and prefill_on < prefill_off
    assert r_off.placer.fetch is None and isinstance(r_on.placer.fetch, PoolFetch)
    pools = {id(e.kv_pool) for e in r_on.instances}
    assert len(pools) == 1  # one pool shared by both instances
    pool = r_on.instances[0].kv_pool
    assert pool is not None and pool.metrics.tokens_served == prefill_off - prefill_on


def test_after_a_weight_update_nothing_of_the_old_version_is_served(tiny_model, tokenizer):
    router = make_engine(_setup(2, "round_robin", 64 << 20), tiny_model, tokenizer, 0)
    assert isinstance(router, Router)
    try:
        (pid, prompt, obs), = _programs(tokenizer, 1)
        first = _multi_turn(router, [(pid, prompt, obs)], turns=1)[0][0]
        pool = router.instances[0].kv_pool
        assert pool is not None and len(pool) == 1 and pool.version == 0
        router.update_weights(None, 1)  # same weights, new version: the old entries must not serve it
        assert len(pool) == 0 and pool.version == 1 and pool.metrics.version_drops == 1
        served = pool.metrics.tokens_served
        prefill = router.metrics.prefill_tokens
        ctx = list(prompt) + first + list(obs)
        asyncio.run(router.generate(GenerationRequest(prompt_ids=ctx, program_id=pid, sampling=SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True))))
        assert pool.metrics.tokens_served == served  # nothing served under version 1
        assert router.metrics.prefill_tokens - prefill == len(ctx)  # the whole prompt computed again
        assert len(pool) == 1 and pool.version == 1  # its turn is pooled under the new version
    finally:
        router.close()


def test_only_a_newer_version_replaces_the_one_served():
    """Engines of several processes publish their versions in any order: a late, older one changes nothing."""
    pool = SharedKVPool(capacity_bytes=1 << 20)
    pool.new_version(2)
    pool.put(list(range(32)), _kv(32, 1), version=2)
    pool.new_version(1)
    assert pool.version == 2 and len(pool) == 1 and pool.metrics.version_drops == 0


def test_kv_pool_dir_makes_the_factory_share_a_pool_folder(tiny_model, tokenizer, tmp_path):
    folder = tmp_path / "pool"
    setup = _setup(2, "round_robin", 64 << 20)
    setup.engine.kv_pool_dir = str(folder)
    router = make_engine(setup, tiny_model, tokenizer, 0)
    assert isinstance(router, Router)
    pool = router.instances[0].kv_pool
    try:
        assert pool is not None and isinstance(pool.store, FileStore) and pool.version == 0
        assert {id(e.kv_pool) for e in router.instances} == {id(pool)}
        _multi_turn(router, _programs(tokenizer, 1), turns=2)
        assert pool.metrics.puts >= 1 and list((folder / "kv").glob("*.kv"))  # the entries are files in the folder
    finally:
        router.close()
        if pool is not None:
            pool.close()
    assert not folder.exists()  # its last user removed it
