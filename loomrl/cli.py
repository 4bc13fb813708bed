"""`loomrl` command line. Heavy imports (torch, transformers) happen inside the commands, so
`loomrl --help` answers at once."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loomrl", description="Reinforcement learning for multi-turn, tool-using LLM agents.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy from a YAML recipe", description="Train from a YAML recipe. "
                       "Override any field with dotted KEY=VALUE pairs, e.g. trainer.lr=1e-6 runtime.mode=async.")
    t.add_argument("config", help="YAML recipe, e.g. examples/calculator_smollm2.yaml")
    t.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE")
    t.add_argument("--resume", action="store_true", help="continue the run in the recipe's run folder from its latest checkpoint")
    e = sub.add_parser("eval", help="held-out success of a checkpoint")
    e.add_argument("config", help="YAML recipe the checkpoint was trained with")
    e.add_argument("overrides", nargs="*", help="dotted overrides KEY=VALUE")
    e.add_argument("--checkpoint", required=True, help="a checkpoint folder or a run folder (its latest checkpoint)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from loomrl.config import ConfigError, load_config
    from loomrl.env.sandbox import SandboxError
    from loomrl.model.loader import ModelLoadError

    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "train":
            from loomrl.runtime.local import LocalRun

            start = float(os.environ.get("LOOMRL_WALL_START", time.time()))
            summary = LocalRun(cfg, resume=args.resume, wall_start=start).train()
            print(json.dumps(summary), flush=True)
        elif args.command == "eval":
            from loomrl.runtime.local import evaluate_checkpoint

            print(json.dumps(evaluate_checkpoint(cfg, Path(args.checkpoint))), flush=True)
    except (ConfigError, ModelLoadError, SandboxError) as err:
        print(str(err), file=sys.stderr)
        return 2
    except Exception as err:  # RunError and friends carry their own message
        from loomrl.runtime.local import RunError

        if isinstance(err, RunError):
            print(str(err), file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
