"""The seed's section 9 cost model reproduces its two worked examples exactly, rounding included, in the model and
through `loomrl estimate-cost`; a bad flag is argparse's error naming it."""

from __future__ import annotations

import json

import pytest

from loomrl.cli import main
from loomrl.planning.cost import CostInputs, estimate_cost, round_figure

SEED = dict(tasks=5000, rollouts_per_task=4, turns=20, tokens_per_turn=500, inference_tokens_per_s=5000,
            inference_gpus=8, train_gpus=8)


def test_the_rollout_example_is_200m_tokens_11_hours_89_gpu_hours():
    # "对 5k 任务、每任务 4 条 rollout、平均 20 轮、每轮 500 token:约 200M token ... 约需 11 wall-clock hours(≈89 GPU-hours)"
    est = estimate_cost(CostInputs(**SEED, train_tokens_per_s=5000))
    assert est.inference.tokens == 200_000_000
    assert est.inference.wall_hours == pytest.approx(40_000 / 3600)
    assert [round_figure(v) for v in (est.inference.tokens, est.inference.wall_hours, est.inference.gpu_hours)] \
        == ["200M", "11", "89"]


def test_the_training_example_is_11_to_28_hours_89_to_222_gpu_hours():
    # "7B 模型在 8×A100 上 PPO 训练约 2k-5k token/s ... 200M token 训练 1 epoch ≈ 11-28 wall-clock hours(≈89-222 GPU-hours)"
    fast, slow = (estimate_cost(CostInputs(**SEED, train_tokens_per_s=r, epochs=1)) for r in (5000, 2000))
    assert fast.training.tokens == slow.training.tokens == 200_000_000
    assert [round_figure(e.training.wall_hours) for e in (fast, slow)] == ["11", "28"]
    assert [round_figure(e.training.gpu_hours) for e in (fast, slow)] == ["89", "222"]


def test_epochs_multiply_training_tokens_and_environments_cost_sandbox_hours():
    est = estimate_cost(CostInputs(**SEED, train_tokens_per_s=5000, epochs=2, sandboxes=100, sandbox_hours=168,
                                   sandbox_price_per_hour=0.5, gpu_price_per_hour=2.0))
    assert est.training.tokens == 400_000_000
    assert est.environments.sandbox_hours == 16_800 and est.environments.usd == pytest.approx(8400)
    assert est.gpu_usd == pytest.approx((88.888_889 + 177.777_778) * 2, rel=1e-6)
    assert est.total_usd == pytest.approx(est.gpu_usd + 8400)


def test_the_cli_prints_both_examples_in_one_table(capsys):
    assert main(["estimate-cost", "--tasks", "5000", "--rollouts-per-task", "4", "--turns", "20", "--tokens-per-turn",
                 "500", "--inference-tokens-per-s", "5000", "--gpus", "8", "--train-tokens-per-s", "2000-5000",
                 "--epochs", "1"]) == 0
    rows = {line.split("  ")[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["inference (rollout)"][-4:] == ["200M", "11", "89", "0"]
    assert rows["training"][-4:] == ["200M", "11-28", "89-222", "0"]


def test_the_cli_json_and_the_section_43_rule(capsys):
    assert main(["estimate-cost", "--train-tokens-per-s", "5000", "--sandboxes", "100", "--sandbox-hours", "168",
                 "--sandbox-price", "0.5", "--env-step-s", "5", "--gen-step-s", "0.2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (est,) = out["estimates"]
    assert est["inference"]["tokens"] == 200_000_000 and est["environments"]["usd"] == pytest.approx(8400)
    assert out["capacity"]["workers"] == 26 and round(out["capacity"]["utilisation_one_worker"], 3) == 0.038


@pytest.mark.parametrize(("argv", "flag"), [(["--tasks", "-1"], "--tasks"), (["--turns", "x"], "--turns"),
                                            (["--train-tokens-per-s", "5000-2000"], "--train-tokens-per-s"),
                                            (["--gpu-price", "-2"], "--gpu-price")])
def test_a_bad_flag_is_refused_naming_it(capsys, argv, flag):
    with pytest.raises(SystemExit) as stop:
        main(["estimate-cost", *argv])
    assert stop.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err.strip().splitlines()[-1]
