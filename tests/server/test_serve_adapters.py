"""`loomrl serve --adapter`: several LoRA adapters over one base model in one server, a request's `model` choosing
(runtime/serve.py, model/adapter.py shared_adapter_model, server/app.py). A tiny random model from the recipe's
config, two PEFT adapters made on it with peft (random A and B, different seeds), serve() itself in a thread, real
HTTP through the real `openai` client. Each name's greedy tokens and logprobs are checked against that adapter merged
into the base by PEFT and run by transformers; the engines' models are checked to share the base's untargeted
tensors (the same storage)."""

from __future__ import annotations

import copy
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from loomrl.config import ModelConfig, load_config

pytestmark = pytest.mark.integration  # starts a server: not in `make test-fast`

openai = pytest.importorskip("openai")
RECIPE = Path(__file__).resolve().parents[2] / "examples" / "calculator_tiny.yaml"
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPT = "The capital of France is"


def _make_adapter(base, folder: Path, seed: int) -> Path:
    """A PEFT adapter over a copy of `base` with random (nonzero) A and B, saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model

    from loomrl.model.adapter import quiet_peft

    with torch.random.fork_rng(), quiet_peft():
        torch.manual_seed(seed)
        peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS,
                                                               init_lora_weights=False))
        peft.save_pretrained(str(folder))
    return folder


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of `prompt` by `model` and each sampled token's logprob."""
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt):], logprobs


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """serve() of the tiny recipe's model as 'base' with adapters 'a' (a bare PEFT folder) and 'b' (a checkpoint at
    step 7); (base URL, {name: engine}, {name: PEFT-merged reference model}, tokenizer)."""
    import uvicorn

    from loomrl.model.adapter import merge_adapter
    from loomrl.model.loader import load_model
    from loomrl.run_folder import RunFolder
    from loomrl.runtime.serve import serve, served_adapter
    from loomrl.server import app as app_module

    tmp = tmp_path_factory.mktemp("adapters")
    cfg = load_config(RECIPE, [])
    base, tokenizer = load_model(cfg.model)  # the same seed's weights as the ones serve() loads
    folder_a = _make_adapter(base, tmp / "a", seed=1)
    folder_b = _make_adapter(base, tmp / "run" / "checkpoints" / "step_000007" / "model", seed=2)
    RunFolder(tmp / "run").latest.write_text("step_000007")  # as a run's checkpoint writer leaves it
    refs = {"base": base, "a": merge_adapter(copy.deepcopy(base), folder_a),
            "b": merge_adapter(copy.deepcopy(base), folder_b)}
    adapters = [served_adapter("a", folder_a), served_adapter("b", tmp / "run")]  # a run folder: its latest

    engines, servers = {}, []
    real_create, real_startup = app_module.create_app, uvicorn.Server.startup

    def create_app(engine, tokenizer, model_name, **kw):  # a spy: the engines serve() built
        engines.update({model_name: engine, **kw.get("adapters", {})})
        return real_create(engine, tokenizer, model_name, **kw)

    async def startup(self, sockets=None):  # a spy: the server, to stop it
        servers.append(self)
        await real_startup(self, sockets)

    mp = pytest.MonkeyPatch()
    mp.setattr(app_module, "create_app", create_app)
    mp.setattr(uvicorn.Server, "startup", startup)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    thread = threading.Thread(target=serve, args=(cfg, None, "127.0.0.1", port, "base", adapters), daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not (servers and servers[0].started):
        assert thread.is_alive() and time.time() < deadline, "serve() did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engines, refs, tokenizer
    finally:
        servers[0].should_exit = True
        thread.join(timeout=30)
        mp.undo()
    assert not thread.is_alive() and all(e._closed for e in engines.values())  # serve() closed every engine


def test_each_model_name_answers_with_its_adapter(served):
    base_url, engines, refs, tokenizer = served
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    prompt = tokenizer.encode(PROMPT)
    answers = {}
    for name, version in (("base", 0), ("a", 0), ("b", 7)):
        out = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=1,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        extra = out.choices[0].model_extra
        want_ids, want_lps = _greedy(refs[name], prompt, 6)
        assert out.model == name
        assert extra["token_ids"] == want_ids, name
        assert out.choices[0].logprobs.token_logprobs == pytest.approx(want_lps, abs=2e-4), name
        assert extra["policy_versions"] == [version] * 6  # b is a checkpoint at step 7; a bare folder is 0
        answers[name] = out.choices[0].logprobs.token_logprobs
        assert engines[name].metrics.requests == 1  # that name's engine, and no other, answered
    assert answers["a"] != answers["base"] and answers["b"] != answers["base"] and answers["a"] != answers["b"]
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0.0)
    assert chat.model == "b" and engines["b"].metrics.requests == 2


def test_unknown_model_is_a_404_listing_the_served_ones_and_models_lists_all(served):
    import httpx

    base_url, _, _, _ = served
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["base", "a", "b"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="c", prompt="x", max_tokens=2)
    body = missing.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert all(repr(n) in body["message"] for n in ("base", "a", "b", "c"))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="c", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert httpx.get(f"{base_url}/health").json()["models"] == {"base": 0, "a": 0, "b": 7}


def test_engines_share_every_untargeted_tensor_with_the_base(served):
    from loomrl.model.adapter import shared_parameters

    _, engines, _, _ = served
    base = engines["base"].model
    names = {n for n, _ in base.named_parameters(remove_duplicate=False)}
    targeted = {n for n in names if any(f".{t}." in n for t in TARGETS)}
    assert targeted and len(targeted) < len(names)
    for name in ("a", "b"):
        assert shared_parameters(base, engines[name].model) == names - targeted, name
    assert shared_parameters(engines["a"].model, engines["b"].model) == names - targeted


@pytest.mark.parametrize(("other", "refusal"), [
    ({"hidden_size": 32, "intermediate_size": 64}, r"adapter folder .*other.*has shape \[4, 64\].*another model"),
    ({"num_hidden_layers": 1}, r"adapter folder .*other.*target_modules match model\.layers\.1\..*another model"),
], ids=["narrower", "fewer-layers"])
@pytest.mark.filterwarnings("ignore:Found missing adapter keys")  # PEFT's, before our refusal of the same adapter
def test_an_adapter_of_another_base_model_is_refused_at_start(tmp_path, other, refusal):
    """A narrower model's adapter (shapes differ) and a shallower one's (its target_modules match layers it has no
    tensors for) are refused before the server listens, naming the folder and the mismatch."""
    from loomrl.model.loader import load_model
    from loomrl.runtime.failures import CannotStart
    from loomrl.runtime.serve import serve, served_adapter

    model, _ = load_model(ModelConfig(kind="tiny", tiny=other))
    folder = _make_adapter(model, tmp_path / "other", seed=3)
    cfg = load_config(RECIPE, [])
    with pytest.raises(CannotStart, match="--adapter x: " + refusal):
        serve(cfg, None, "127.0.0.1", 0, "base", [served_adapter("x", folder)])


def test_the_command_line_takes_repeated_adapters_beside_overrides():
    from loomrl.cli import _parse_args

    args = _parse_args(["serve", str(RECIPE), "--adapter", "a=runs/a", "engine.seed=1", "--adapter", "b=x/y=z"])
    assert args.adapter == [("a", Path("runs/a")), ("b", Path("x/y=z"))] and args.overrides == ["engine.seed=1"]
    with pytest.raises(SystemExit):
        _parse_args(["serve", str(RECIPE), "--adapter", "no-equals-sign"])
