"""A custom multi-turn tool environment on loomrl's public API (docs/environments.md): a shop whose prices the agent
looks up with a tool before it answers. Train on it: `loomrl train examples/custom_env/train.yaml`."""

import random
import re

from pydantic import BaseModel

from loomrl.env import Environment, EpisodeContext, TaskSetup, ToolEnv, ToolError, tool
from loomrl.types import Task

ITEMS = ["apple", "pear", "lemon", "melon", "plum", "peach", "mango", "kiwi", "grape", "cherry", "onion", "carrot"]
HELD_OUT = ITEMS[-4:]  # never asked about in training: held-out success is tool use, not remembered prices


class ShopArgs(BaseModel):  # env.args, checked at load: a wrong field stops with one line
    max_price: int = 20


class ShopEpisode(ToolEnv):
    system_prompt = "You work in a shop. Look up a price with the price tool, then reply: It costs NUMBER."
    # a worked example (an item the shop does not sell): small models need one to call a tool at all
    few_shot = [{"role": "user", "content": "What does one fig cost?"}, {"role": "assistant", "content": "price(fig)"},
                {"role": "tool", "name": "price", "content": "4"}, {"role": "assistant", "content": "It costs 4."}]

    def __init__(self, ctx: EpisodeContext, prices: dict[str, int]):
        super().__init__(ctx)
        self.prices = prices

    @tool
    def price(self, item: str) -> int:
        """Look up the price of one item.

        Args:
            item: the item's name, e.g. apple
        """
        name = item.strip().lower()
        if name not in self.prices:  # the agent's mistake: said to it (any other exception is a bug in the tool)
            raise ToolError(f"no item named {item!r}; the shop sells {', '.join(sorted(self.prices))}")
        return self.prices[name]

    def final_answer(self, text: str) -> str | None:
        numbers = re.findall(r"\d+", text)
        return numbers[-1] if numbers else None


class Shop(Environment):
    Args = ShopArgs
    version = "shop-v1"

    def __init__(self, args: ShopArgs):
        self.prices = {item: random.Random(item).randint(1, args.max_price) for item in ITEMS}

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        def split(name: str, n: int) -> list[Task]:
            rng = random.Random(f"{setup.seed}:{name}")
            items = [rng.choice(HELD_OUT if name == "heldout" else ITEMS[:-4]) for _ in range(n)]
            return [Task(task_id=f"shop-{name}-{i}", prompt=f"What does one {item} cost?",
                         answer=str(self.prices[item]), split=name) for i, item in enumerate(items)]
        return split("train", setup.n_train), split("heldout", setup.n_heldout)

    def episode(self, ctx: EpisodeContext) -> ShopEpisode:
        return ShopEpisode(ctx, self.prices)
