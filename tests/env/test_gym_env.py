from __future__ import annotations

import asyncio
from collections import deque

import gymnasium as gym
import pytest

from loomrl.config import ConfigError
from loomrl.env.base import StepResult
from loomrl.env.tasks.gym_text import (
    GYM_GAMES,
    GymTextEnv,
    generate_gym_tasks,
    gym_reward,
    make_gym_splits,
    parse_action,
    worked_example,
)
from loomrl.types import RolloutStatus, Task, Trajectory, Turn

FROZENLAKE = GYM_GAMES["frozenlake"].actions


def _task(game: str, episode_seed: int = 0) -> Task:
    return Task(task_id=f"t-{game}", prompt="", answer="success", family=game,
                data={"game": game, "episode_seed": episode_seed})


def _play(task: Task, actions: list[str], env: GymTextEnv | None = None) -> tuple[str, list[StepResult]]:
    """Reset, then step each action until done; the first user message and every step's result."""
    env = env or GymTextEnv()

    async def go() -> tuple[str, list[StepResult]]:
        obs = await env.reset(task)
        steps = []
        for action in actions:
            steps.append(await env.step(action))
            if steps[-1].done:
                break
        await env.close()
        return obs.messages[-1]["content"], steps

    return asyncio.run(go())


@pytest.mark.parametrize("game", sorted(GYM_GAMES))
def test_reset_renders_state_and_legal_actions(game):
    text, _ = _play(_task(game), [])
    assert "\x1b" not in text
    assert f"Legal actions: {', '.join(GYM_GAMES[game].actions)}." in text
    if game != "blackjack":
        grid = text.split("\n")[:-2]  # the sentence and the legal actions follow the grid
        assert "\n".join(grid).count("@") == 1  # the agent's cell survives stripping the colours
    obs = asyncio.run(GymTextEnv().reset(_task(game)))
    assert obs.messages[0]["role"] == "system" and "move(" in obs.messages[0]["content"]


def test_frozenlake_shortest_path_reaches_the_goal():
    # SFFF / FHFH / FFFH / HFFG: along the top row, down column 3, then right onto G.
    _, steps = _play(_task("frozenlake"), ["right", "right", "down", "down", "down", "right"])
    assert [s.done for s in steps] == [False] * 5 + [True]
    assert [s.reward for s in steps] == [0.0] * 5 + [1.0]
    assert "row 1, column 2" in steps[0].observation[0]["content"]
    last = steps[-1]
    assert last.info["success"] and last.info["return"] == 1.0 and last.info["final_answer"] == "success"
    assert last.observation == []  # the Env protocol: nothing to append when done


def test_frozenlake_hole_ends_without_success():
    _, steps = _play(_task("frozenlake"), ["down", "right"])  # (1, 1) is a hole
    assert steps[-1].done and not steps[-1].info["success"] and steps[-1].info["final_answer"] == "failure"


def test_step_budget_truncates():
    budget = GYM_GAMES["frozenlake"].max_steps
    _, steps = _play(_task("frozenlake"), ["left"] * (budget + 5))
    assert len(steps) == budget and steps[-1].done and steps[-1].info["truncated"]
    assert not steps[-1].info["success"]


def test_frozenlake_random_maps_vary_with_the_seed():
    tasks = generate_gym_tasks(["frozenlake_random"], 8, seed=1, split="train")
    assert len({t.prompt for t in tasks}) > 1
    assert all(t.prompt.startswith("@") for t in tasks)


def _taxi_route(episode_seed: int) -> list[str]:
    """Shortest action sequence that delivers the passenger, by BFS over the game's transition table."""
    env = gym.make(GYM_GAMES["taxi"].gym_id)
    start, _ = env.reset(seed=episode_seed)
    table, names = env.unwrapped.P, list(GYM_GAMES["taxi"].actions)
    queue, seen = deque([(start, [])]), {start}
    while queue:
        state, route = queue.popleft()
        for action, [(_, nxt, _, terminated)] in table[state].items():
            if terminated:
                return [*route, names[action]]
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, [*route, names[action]]))
    raise AssertionError("no route")


def test_taxi_moves_penalties_and_delivery():
    task = generate_gym_tasks(["taxi"], 1, seed=3, split="train")[0]
    start, steps = _play(task, ["dropoff"])
    assert steps[0].reward == -10.0 and not steps[0].done  # no passenger aboard: an illegal dropoff
    route = _taxi_route(task.data["episode_seed"])
    move = next(a for a in route if a not in ("pickup", "dropoff"))
    _, steps = _play(task, [move])
    assert steps[0].reward == -1.0 and steps[0].observation[0]["content"].split("\n", 1)[1] != start
    _, steps = _play(task, route)
    assert len(steps) == len(route) and steps[-1].done and steps[-1].reward == 20.0
    assert steps[-1].info["success"] and steps[-1].info["return"] == 20.0 - (len(route) - 1)


def test_cliffwalking_cliff_and_goal():
    _, steps = _play(_task("cliffwalking"), ["right"])
    assert steps[0].reward == -100.0 and not steps[0].done
    assert "row 4, column 1" in steps[0].observation[0]["content"]  # back at the start
    _, steps = _play(_task("cliffwalking"), ["up"] + ["right"] * 11 + ["down"])
    assert steps[-1].done and steps[-1].info["success"] and steps[-1].info["return"] == -13.0


@pytest.mark.parametrize("seed", range(5))
def test_blackjack_stick_ends_the_hand(seed):
    text, steps = _play(_task("blackjack", seed), ["stick"])
    assert text.startswith("Your sum is ") and "the dealer shows" in text
    last = steps[0]
    assert last.done and last.reward in (-1.0, 0.0, 1.0)
    assert last.info["success"] == (last.reward > 0)


def test_invalid_replies_end_the_episode_after_the_limit():
    _, steps = _play(_task("frozenlake"), ["jump", "I am not sure.", "right", "move(fly)", "", "<tool_call>oops</tool_call>"])
    assert [s.info["invalid"] for s in steps] == [True, True, False, True, True, True]
    assert [s.done for s in steps] == [False] * 5 + [True]  # the valid move reset the count
    assert "Legal actions: left, down, right, up." in steps[0].observation[0]["content"]
    assert all(s.reward == 0.0 for s in steps if s.info["invalid"])
    assert steps[-1].info["invalid_limit"] and steps[-1].info["final_answer"] == "failure"
    assert steps[-1].info["return"] == 0.0


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>{"name": "move", "arguments": {"action": "Left"}}</tool_call>', "left"),
    ("move(down)", "down"),
    ("I will go move('RIGHT') now.", "right"),
    ("move(action=up)", "up"),
    ("Thinking it over.\n**Right**\n", "right"),
    ("<think>left looks bad, so down?\nleft\n</think>\nup", "up"),
    ("move(down) then move(right)", "down"),  # the first action is played
    ("down\nright", "down"),
])
def test_action_forms_parse(text, expected):
    assert parse_action(text, FROZENLAKE) == (expected, None)


@pytest.mark.parametrize("text", [
    "move(jump)\nleft",  # the first action decides; later ones are not tried
    '<tool_call>{"name": "walk", "arguments": {"action": "left"}}</tool_call>',
    '<tool_call>{"name": "move", "arguments": {"direction": "left"}}</tool_call>',
    "I would go left.",
    "<think>left",
])
def test_unparseable_actions_are_invalid(text):
    word, error = parse_action(text, FROZENLAKE)
    assert word is None and error


def test_hermes_and_call_forms_step_the_game():
    moves = ['<tool_call>{"name": "move", "arguments": {"action": "right"}}</tool_call>', "move(Right)"]
    _, steps = _play(_task("frozenlake"), moves)
    assert [s.info["action"] for s in steps] == ["right", "right"]
    assert "row 1, column 3" in steps[-1].observation[0]["content"]


def test_splits_are_disjoint_reproducible_and_match_reset():
    games = ["frozenlake", "taxi", "cliffwalking", "blackjack"]
    train, heldout = make_gym_splits(games, 12, 8, seed=5)
    again_train, again_heldout = make_gym_splits(games, 12, 8, seed=5)
    assert [t.data for t in train] == [t.data for t in again_train]
    assert [t.data for t in heldout] == [t.data for t in again_heldout]
    seeds = [t.data["episode_seed"] for t in train + heldout]
    assert len(seeds) == len(set(seeds))
    assert [t.family for t in train[:4]] == games and {t.split for t in heldout} == {"heldout"}
    for task in train[:4]:
        text, _ = _play(task, [])
        assert text == task.prompt
    assert make_gym_splits(games, 12, 8, seed=6)[0][1].data != train[1].data


@pytest.mark.parametrize("game", sorted(GYM_GAMES))
def test_worked_example_is_a_real_game_shown_before_the_task(game):
    """few_shot="game": state, move, the env's own next state, move; then the task's state, as without it."""
    shots = worked_example(GYM_GAMES[game])
    assert [m["role"] for m in shots] == ["user", "assistant", "user", "assistant"]
    moves = [m["content"] for m in shots[1::2]]
    assert all(parse_action(m, GYM_GAMES[game].actions)[0] for m in moves)
    follows = shots[2]["content"]  # the env's answer to the first move, or (Blackjack) the next hand
    assert follows.startswith(f"You played {moves[0][5:-1]}; reward ") or (game == "blackjack" and "sum is" in follows)
    if game == "blackjack":
        assert sorted(moves) == ["move(hit)", "move(stick)"]  # each action shown once
    task = _task(game, episode_seed=3)
    plain = asyncio.run(GymTextEnv().reset(task)).messages
    shown = asyncio.run(GymTextEnv(few_shot="game").reset(task)).messages
    assert shown == [plain[0], *shots, plain[1]]
    if game.startswith("frozenlake"):  # a map of its own, so the fixed task map's route is not shown
        assert shots[0]["content"].split("\nYou")[0] != plain[1]["content"].split("\nYou")[0]
    if game == "taxi":  # the moves shown are the way on (a shortest delivery starts with them)
        assert _taxi_route(GYM_GAMES["taxi"].example[0].seed)[:2] == ["east", "south"]


def test_unknown_game_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        generate_gym_tasks(["chess"], 1, 0, "train")
    assert str(err.value) == ("config error: env.families: unknown gym game 'chess'; choose from blackjack, "
                              "cliffwalking, frozenlake, frozenlake_random, taxi")


def test_gym_reward_reads_success():
    _, steps = _play(_task("cliffwalking"), ["up"] + ["right"] * 11 + ["down"])
    traj = Trajectory(task_id="t", trajectory_id="x", group_id="g",
                      turns=[Turn(reward_step=s.reward, done=s.done) for s in steps],
                      final_answer=steps[-1].info["final_answer"])
    assert gym_reward(traj, _task("cliffwalking")) == {"correct": 1.0}  # the return (-13) is not rewarded
    traj.final_answer = None  # cut off by the agent loop before the game ended
    assert gym_reward(traj, _task("cliffwalking")) == {"correct": 0.0}
    traj.status = RolloutStatus.ENV_ERROR
    assert gym_reward(traj, _task("cliffwalking")) == {"correct": 0.0}


def test_forfeiting_never_scores_above_playing_and_losing():
    """GRPO normalises rewards by the group's std, so a 0.01 "tie-breaker" is a full advantage in a group that all
    failed. A game's return (Blackjack -1 for a loss, Taxi and CliffWalking -1 a step) must then not rank three
    invalid replies, which never step the game, above playing it: SmolLM2 learned to forfeit blackjack (training
    success 0.17 -> 0.03 in 3 steps) while the return was part of the reward."""
    def total(task: Task, actions: list[str]) -> float:
        _, steps = _play(task, actions)
        traj = Trajectory(task_id="t", trajectory_id="x", group_id="g", final_answer=steps[-1].info["final_answer"],
                          turns=[Turn(reward_step=s.reward, done=s.done) for s in steps])
        return sum(gym_reward(traj, task).values())

    lost = next(t for seed in range(50) if _play(t := _task("blackjack", seed), ["stick"])[1][-1].reward < 0)
    forfeit = total(lost, ["no idea"] * 3)
    assert forfeit <= total(lost, ["stick"])
    taxi = _task("taxi", 3)
    assert total(taxi, ["no idea"] * 3) <= total(taxi, ["north", "west", "no idea", "no idea", "no idea"])
