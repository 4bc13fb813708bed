from __future__ import annotations

import pytest

from loomrl.config import ConfigError, load_config, parse_overrides, save_resolved


def test_defaults_and_dotted_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  lr: 1.0e-5\n  group_size: 4\n")
    cfg = load_config(recipe, ["trainer.lr=2e-6", "runtime.mode=async", "env.families=[add, sub]"])
    assert cfg.trainer.lr == 2e-6
    assert cfg.trainer.group_size == 4
    assert cfg.runtime.mode == "async"
    assert cfg.env.families == ["add", "sub"]


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["name=x", "trainer.lr=3e-6"])
    save_resolved(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_misspelt_field_names_it_and_suggests_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lrr=1e-6"])
    msg = str(err.value)
    assert "trainer.lrr" in msg and "did you mean 'lr'" in msg
    assert len(msg.splitlines()) == 1


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lr=fast"])
    assert "'trainer.lr'" in str(err.value) and "'fast'" in str(err.value)
    with pytest.raises(ConfigError, match="runtime.mode"):
        load_config(None, ["runtime.mode=parallel"])
    with pytest.raises(ConfigError, match="trainer.group_size"):
        load_config(None, ["trainer.group_size=1"])


def test_missing_recipe_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["trainer.lr"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_a_retired_field_or_value_says_what_replaced_it():
    with pytest.raises(ConfigError) as kind:
        load_config(None, ["engine.kind=torch"])
    assert str(kind.value) == ("config error: 'engine.kind' the torch engine is retired: use engine.kind=builtin "
                               "(the default)")
    with pytest.raises(ConfigError, match="'engine.batch_wait_ms' was an option of the torch engine"):
        load_config(None, ["engine.batch_wait_ms=5"])
    assert load_config(None, ["engine.kind=builtin"]).engine.kind == "builtin"


def test_moved_ray_and_runtime_fields_name_their_new_place():
    with pytest.raises(ConfigError) as moved:
        load_config(None, ["ray.num_rollout_workers=4"])
    assert str(moved.value) == "config error: 'ray.num_rollout_workers' moved: use ray.rollout.count"
    with pytest.raises(ConfigError, match="'ray.max_trainer_restarts' moved: use runtime.max_trainer_restarts"):
        load_config(None, ["ray.max_trainer_restarts=3"])
    with pytest.raises(ConfigError, match="'ray.max_group_attempts' moved: use runtime.max_group_attempts"):
        load_config(None, ["ray.max_group_attempts=3"])
    with pytest.raises(ConfigError, match="'trainer.loss' is a section now: use trainer.loss.kind="):
        load_config(None, ["trainer.loss=gspo"])
    with pytest.raises(ConfigError, match="'trainer.clip_eps' moved: use trainer.loss.clip_low"):
        load_config(None, ["trainer.clip_eps=0.3"])
    assert load_config(None, ["trainer.loss.kind=gspo"]).trainer.loss.kind == "gspo"
    with pytest.raises(ConfigError, match="'env.crash_rate' moved: use env.args.crash_rate"):
        load_config(None, ["env.crash_rate=0.3"])
    with pytest.raises(ConfigError, match="'env.calculator' moved: use env.args"):
        load_config(None, ["env.calculator.crash_rate=0.3"])
    with pytest.raises(ConfigError, match="'reward.format_weight' moved: use env.args.format_weight"):
        load_config(None, ["reward.format_weight=0"])
    assert load_config(None, ["env.args.crash_rate=0.3"]).env.args == {"crash_rate": 0.3}
    cfg = load_config(None, ["ray.rollout.count=4", "ray.rollout.num_gpus=0.5", "ray.trainer.num_gpus=1",
                             "runtime.max_trainer_restarts=1"])
    assert (cfg.ray.rollout.count, cfg.ray.rollout.num_gpus, cfg.ray.trainer.num_gpus) == (4, 0.5, 1.0)
    assert cfg.runtime.max_trainer_restarts == 1


def test_gpus_are_asked_for_with_num_gpus_not_as_a_custom_resource():
    """Ray refuses "GPU" (and "CPU") inside an actor's resources: the config says what to set instead."""
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["ray.trainer.resources={GPU: 1}"])
    assert str(bad.value) == ("config error: 'ray.trainer': 'GPU' cannot be a custom resource: set num_gpus=1.0 "
                              "instead")
    with pytest.raises(ConfigError, match="'ray.rollout': 'CPU' cannot be a custom resource: set num_cpus=2"):
        load_config(None, ["ray.rollout.resources={CPU: 2}"])
    with pytest.raises(ConfigError, match="ray.rollout.count: at least one rollout actor"):
        load_config(None, ["ray.rollout.count=0"])


@pytest.mark.integration
def test_every_recipe_in_examples_loads():
    """The shipped recipes (the GPU one included, whose Ray backend defers the device check to its actors)
    use only current field names and valid values."""
    from pathlib import Path

    recipes = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml"))
    assert any(r.parent.name == "gpu" for r in recipes)
    for recipe in recipes:
        load_config(recipe)


def test_gpu_recipes_fill_one_8_gpu_node_with_vllm_engines():
    """examples/gpu: vLLM engines (not the CPU-built built-in engine) and FSDP2 ranks, 8 GPUs in all, the weights
    broadcast to the engine actors on GPUs of their own, or colocated (engine i asleep on trainer rank i's GPU while
    it steps, then pushed each version a bucket at a time by that rank: cuda_ipc); each recipe says plainly that it has not run on a GPU."""
    from pathlib import Path

    recipes = sorted((Path(__file__).resolve().parents[1] / "examples" / "gpu").glob("*.yaml"))
    assert len(recipes) >= 2
    for recipe in recipes:
        cfg = load_config(recipe)
        assert cfg.engine.kind == "vllm" and cfg.trainer.parallel == "fsdp", recipe.name
        gpus = cfg.trainer.world_size * cfg.ray.trainer.num_gpus + cfg.ray.engine.count * cfg.ray.engine.num_gpus
        assert gpus == 8 and cfg.ray.rollout.num_gpus == 0, recipe.name
        assert cfg.ray.rollout.count >= cfg.ray.engine.count, recipe.name  # rollout actor i uses engine i mod count
        if cfg.engine.sleep_while_training:  # colocated: a share of each GPU, each rank pushing to its engine
            assert cfg.ray.engine.count == cfg.trainer.world_size == 8, recipe.name
            assert cfg.runtime.weight_transport == "cuda_ipc", recipe.name
        else:
            assert cfg.runtime.weight_transport == "broadcast", recipe.name
        assert "NOTHING OF THIS RECIPE HAS RUN ON A GPU" in recipe.read_text(), recipe.name
        # each tells the user to `ray start --head` first: unset, ray.address started a private cluster beside it
        assert "ray start --head" in recipe.read_text() and cfg.ray.address == "auto", recipe.name
    assert any(load_config(r).engine.sleep_while_training for r in recipes)  # a colocated one ships

def test_fsdp_needs_async_mode():
    with pytest.raises(ConfigError, match="trainer.parallel=fsdp needs runtime.mode=async"):
        load_config(None, ["trainer.parallel=fsdp", "runtime.mode=sync"])
    cfg = load_config(None, ["trainer.parallel=fsdp", "runtime.mode=async"])
    assert cfg.trainer.distributed and cfg.trainer.world_size == 1


def test_on_and_off_are_strings_in_recipes_and_overrides(tmp_path):
    """YAML 1.1 (PyYAML's default) reads on/off/yes/no as booleans, so `tree_merge: on` was refused; loomrl reads
    YAML 1.2's booleans only (true/false), and bool fields still accept yes/no/on/off."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  tree_merge: on\nprogress: off\neval:\n  before: no\n")
    cfg = load_config(recipe, ["runtime.interrupt_on_update=yes"])
    assert cfg.trainer.tree_merge == "on" and cfg.progress is False and cfg.eval.before is False
    assert cfg.runtime.interrupt_on_update is True
    assert load_config(None, ["trainer.tree_merge=off"]).trainer.tree_merge == "off"
    assert parse_overrides(["a=on", "b=true", "c=[1, 2]", "d=null"]) == {"a": "on", "b": True, "c": [1, 2], "d": None}
    save_resolved(cfg, tmp_path / "resolved.yaml")  # and back: "on" is quoted on the way out
    assert load_config(tmp_path / "resolved.yaml").trainer.tree_merge == "on"


def test_a_vllm_engine_actor_asks_for_its_tensor_parallel_gpus():
    with pytest.raises(ConfigError, match=r"ray.engine.num_gpus=1 but engine.vllm.tensor_parallel_size=2"):
        load_config(None, ["engine.kind=vllm", "runtime.mode=async", "runtime.backend=ray", "ray.engine.count=2",
                           "ray.engine.num_gpus=1", "engine.vllm.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"ray.rollout.num_gpus=1 but engine.vllm.tensor_parallel_size=4"):
        load_config(None, ["engine.kind=vllm", "runtime.mode=async", "runtime.backend=ray", "ray.rollout.num_gpus=1",
                           "engine.vllm.tensor_parallel_size=4"])
    cfg = load_config(None, ["engine.kind=vllm", "runtime.mode=async", "runtime.backend=ray", "ray.engine.count=2",
                             "ray.engine.num_gpus=2", "engine.vllm.tensor_parallel_size=2"])
    assert cfg.ray.engine.num_gpus == 2


def test_names_from_other_frameworks_suggest_loomrls():
    """Spelling alone finds lr_min_ratio for learning_rate; the aliases and abbreviations find lr."""
    def hint(override: str) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        return str(err.value).split("; ", 1)[1]

    assert hint("trainer.learning_rate=1e-5") == "did you mean 'lr'?"
    assert hint("learning_rate=1e-5") == "did you mean 'trainer.lr'?"  # another section: its dotted name
    assert hint("trainer.num_generations=8") == "did you mean 'group_size'?"  # TRL
    assert hint("trainer.beta=0.04") == "did you mean 'trainer.loss.kl_coef'?"  # TRL's KL coefficient
    assert hint("sampling.max_new_tokens=64") == "did you mean 'max_tokens'?"
    assert hint("trainer.mbs=4") == "did you mean 'micro_batch_size'?"  # an abbreviation
    assert hint("trainer.temperature=0.7") == "did you mean 'sampling.temperature' or 'eval.temperature'?"
    assert hint("trainer.lrr=1e-6") == "did you mean 'lr'?"  # spelling, as before


def test_every_alias_names_a_field():
    from loomrl.config import ALIASES, RunConfig, _all_fields

    fields = set(_all_fields(RunConfig))
    assert {alias: target for alias, target in ALIASES.items() if target not in fields} == {}
    assert not set(ALIASES) & {f.rsplit(".", 1)[-1] for f in fields}  # an alias is never a real name
