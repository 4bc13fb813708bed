"""An engine that replays fixed assistant turns, for the tests where the random tiny model cannot act as needed."""

from __future__ import annotations


class ScriptedEngine:
    """Replays fixed assistant turns. Used only where the random tiny model cannot act as needed
    (it never writes a tool call); everything around it (env, sandbox, loop, rewards) is real."""

    kv_budget = 1 << 20

    def __init__(self, tokenizer, turns: list[str]):
        from loomrl.engine.base import EngineMetrics

        self.turns = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in turns]
        self.calls: dict[str, int] = {}
        self.version = 0
        self.metrics = EngineMetrics()

    async def generate(self, request):
        from loomrl.engine.base import GenerationResult

        i = self.calls.get(request.program_id, 0)
        self.calls[request.program_id] = i + 1
        ids = self.turns[min(i, len(self.turns) - 1)]
        return GenerationResult(token_ids=ids, logprobs=[-1.0] * len(ids), versions=[0] * len(ids), finish_reason="stop")

    def update_weights(self, weights, version):
        self.version = version

    def update_adapter(self, weights, adapter, version):
        self.version = version

    def interrupt(self):
        pass  # every turn is answered at once: nothing is ever in flight to interrupt

    def release(self, program_id):
        pass

    def close(self):
        pass
