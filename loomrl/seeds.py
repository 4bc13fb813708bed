"""Random streams keyed by what they are for, not by the order things happen in.

A run's randomness is drawn from streams named by what they serve: an episode's environment by (run seed, purpose,
data position, group member), a turn's sampling by those and the turn's number, a sampled token by its request's seed
and its position in the sequence (engine/builtin/sampling.py token_uniforms). Which requests share an engine batch,
which episode starts first, or whether an infrastructure failure made an episode run again, then cannot change what
is drawn: a sync run on the built-in engine is a function of its config and seed, and two arms of a comparison that
differ in one setting draw the same tasks and the same sampling noise wherever their policies agree (common random
numbers: docs/reproducibility.md).

What it is not: the data order (rollout/worker.py DataOrder, a per-epoch permutation of the run seed) or the tasks
themselves (env.seed).
"""

from __future__ import annotations

import hashlib

MASK64 = (1 << 64) - 1


def keyed_seed(*parts: object) -> int:
    """A 62-bit seed named by `parts` (str() of each, joined): stable across processes, machines and Python versions,
    unlike hash()."""
    name = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little") >> 2


def part_seed(seed: int | None, part: int) -> int | None:
    """Part `part`'s sampling seed when a request is continued as a new request (a resume after a weight update):
    the request's for the first part, another one per later part (engines that seed a generator per request would
    otherwise replay the first part's draws: correlated tokens). None stays None."""
    if seed is None or part == 0:
        return seed
    return keyed_seed(seed, "part", part)


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints whose outputs look independent for consecutive inputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def uniform_at(seed: int, position: int) -> float:
    """The uniform in [0, 1) of stream `seed` at `position`: counter-based, so any position is drawn without the ones
    before it (a request divided at any point, engine/split.py, draws what the undivided one would). 24 bits, a float32's
    mantissa, so it stays below 1 as a float32."""
    return (mix64((mix64(seed & MASK64) + position * 0x9E3779B97F4A7C15) & MASK64) >> 40) * 2.0**-24
