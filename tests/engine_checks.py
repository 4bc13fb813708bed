"""References the engine tests compare against: transformers' own greedy `generate` and a full forward pass;
`Recording`, a run's real engine wrapped to record the ids it samples (the exact-token checks of training runs); and
the vLLM servers the HTTP tests start (start_vllm_server, wait_healthy, stop_server)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch


def greedy_reference(model, tokenizer, prompt: list[int], max_tokens: int) -> list[int]:
    """Token ids transformers' greedy `generate` produces after `prompt`."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt):].tolist()


def forward_logits(model, prompt: list[int], sampled: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Logits (divided by the temperature when > 0) that predicted each sampled token: [len(sampled), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1]
    return logits / temperature if temperature > 0 else logits


def token_logprobs(logits: torch.Tensor, sampled: list[int]) -> torch.Tensor:
    """log softmax(logits) at each sampled token."""
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sampled).unsqueeze(1)).squeeze(1)


def run_requests(engine, prompts: list[list[int]], **sampling) -> list:
    """GenerationResults of `prompts` sent to `engine` at once, with the same SamplingParams fields."""
    from loomrl.engine.base import GenerationRequest, SamplingParams

    async def go():
        return await asyncio.gather(*[engine.generate(GenerationRequest(prompt_ids=p, program_id=f"p{i}",
                                                                        sampling=SamplingParams(**sampling)))
                                      for i, p in enumerate(prompts)])

    return asyncio.run(go())


def check_sampled_logprobs(engine, model, prompts: list[list[int]], atol: float) -> None:
    """T=0.7, top_p=0.9, seeded: the same ids twice, and each logprob that of softmax(logits / T) renormalised over
    the top-p set (vLLM's processed_logprobs) from a float32 forward of `model`, not of the raw or the untruncated
    distribution (some tokens' logprobs differ between the two, so the comparison tells them apart)."""
    from loomrl.engine.builtin.sampling import filter_logits

    runs = [run_requests(engine, prompts, temperature=0.7, top_p=0.9, max_tokens=32, seed=11, ignore_eos=True)
            for _ in "ab"]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]  # seeded sampling is reproducible
    truncated = 0
    for p, r in zip(prompts, runs[0]):
        logits = forward_logits(model, p, r.token_ids, 0.7)
        rows = len(logits)
        kept = token_logprobs(filter_logits(logits, torch.zeros(rows, dtype=torch.long), torch.full((rows,), 0.9)),
                              r.token_ids)
        assert torch.allclose(torch.tensor(r.logprobs), kept, atol=atol, rtol=0)
        truncated += int((kept - token_logprobs(logits, r.token_ids) > 1e-3).sum())
    assert truncated > 0


def check_stop_token_kept(engine, prompt: list[int]) -> list[int]:
    """A stop token ends generation and stays in the ids; the 12 greedy ids (ignoring eos) it was picked from."""
    greedy = run_requests(engine, [prompt], temperature=0.0, max_tokens=12, ignore_eos=True)[0].token_ids
    stopped = run_requests(engine, [prompt], temperature=0.0, max_tokens=12, stop_token_ids=[greedy[2]])[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == greedy[2] and len(stopped.token_ids) <= 3
    assert stopped.token_ids == greedy[: len(stopped.token_ids)]
    return greedy


# The tiny random Llama the vLLM tests serve: head_dim 32 (vLLM's CPU attention takes head sizes 32, 64, 80, ...
# only) and init_std 0.1 (a peaked distribution, so that greedy ids do not hinge on the rounding of near-ties)
VLLM_TINY = {"head_dim": 32, "init_std": 0.1}
VLLM_OVERRIDES = ["engine.kind=vllm", "runtime.mode=async", "model.kind=tiny", "model.tiny.head_dim=32",
                  "model.tiny.init_std=0.1", "engine.vllm.block_size=32", "engine.vllm.max_model_len=512",
                  f"engine.vllm.kv_cache_memory_bytes={64 << 20}", "engine.vllm.cpu_reserved_cores=0"]


def vllm_tiny_pair():
    """(A, B, tokenizer): VLLM_TINY's model from seed 0 and from seed 1, with SmolLM2's real tokenizer."""
    from loomrl.config import ModelConfig, TinyModelConfig
    from loomrl.model.loader import load_model

    a, tokenizer = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(**VLLM_TINY, seed=0)))
    b, _ = load_model(ModelConfig(kind="tiny", tiny=TinyModelConfig(**VLLM_TINY, seed=1)))
    return a, b, tokenizer


class Recording:
    """The run's real engine, recording the ids it samples per trajectory (the exact-token check)."""

    def __init__(self, engine):
        self._engine = engine
        self.sampled: dict[str, list[int]] = {}

    async def generate(self, request):
        result = await self._engine.generate(request)
        self.sampled.setdefault(request.program_id, []).extend(result.token_ids)
        return result

    def __getattr__(self, name):
        return getattr(self._engine, name)


TESTS = Path(__file__).resolve().parent
# the flags every vLLM server of the HTTP tests runs with: what loomrl's HTTP adapter needs (engine/vllm/http.py)
VLLM_SERVER_FLAGS = ("--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
                     "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--enable-scale-out",
                     "--logprobs-mode", "processed_logprobs", "--scheduling-policy", "priority",
                     "--worker-extension-cls", "loomrl.engine.vllm.worker.WorkerExtension",
                     "--weight-transfer-config", '{"backend": "loomrl_inline"}')


def start_vllm_server(folder: Path, *flags: str, max_model_len: int = 512, log_name: str = "server.log",
                      env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, Path]:
    """A vLLM server on the model saved in `folder` with VLLM_SERVER_FLAGS and `flags`, in a process group of its own
    (stop_server), its output in `folder/log_name`: (process, base URL, log path). It is starting, not yet healthy."""
    port, log_path = free_port(), folder / log_name
    full_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **(env or {}),
                "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--port", str(port),
             "--max-model-len", str(max_model_len), *VLLM_SERVER_FLAGS, *flags],
            env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log_path


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, deadline: float) -> None:
    """Until `url`/health answers 200; RuntimeError with the server's log tail when it exits or `deadline`
    (time.monotonic) passes first."""
    import httpx

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM server did not answer /health in time:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a server started on it may still race another)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_segments(pgid: int) -> set[Path]:
    """The POSIX shared-memory segments (/dev/shm/psm_*: vLLM's message queues, 160-240 MiB each) that a process of
    group `pgid` has mapped."""
    found: set[Path] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            maps = (proc / "maps").read_text()
        except (OSError, ProcessLookupError):
            continue  # gone, or not ours to read
        found.update(Path(line.split(maxsplit=5)[5]) for line in maps.splitlines()
                     if len(line.split(maxsplit=5)) == 6 and line.split(maxsplit=5)[5].startswith("/dev/shm/psm_"))
    return found


def kill_server(proc: subprocess.Popen) -> None:
    """SIGKILL a server's whole process group (start_new_session), then unlink the shared-memory segments its
    processes had mapped: SIGKILL also kills the group's resource tracker, which would have unlinked them, and each
    left behind holds up to 240 MiB of /dev/shm until reboot."""
    segments = _group_segments(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for segment in segments:
        segment.unlink(missing_ok=True)


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server started in a process group of its own (start_new_session): SIGTERM, then (kill_server) SIGKILL
    after 30 s; a process already gone (a test killed it) is left as it is."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_server(proc)
