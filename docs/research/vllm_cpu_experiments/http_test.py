import json, time, httpx
B = "http://127.0.0.1:8011"
ids = json.load(open("/work/notes/exp/sampled_processed_logprobs_float32.json"))["prompt"]
c = httpx.Client(timeout=60)
def show(name, r):
    print(f"--- {name}: HTTP {r.status_code}")
    print(json.dumps(r.json(), indent=None)[:1500])
r = c.post(B + "/v1/completions", json={"model": "smollm2", "prompt": ids, "max_tokens": 12, "temperature": 0.7,
       "top_p": 0.9, "seed": 1, "logprobs": 0, "return_token_ids": True, "priority": 0})
show("/v1/completions prompt=ids return_token_ids logprobs=0", r)
r = c.post(B + "/v1/completions", json={"model": "smollm2", "prompt": ids, "max_tokens": 12, "temperature": 0,
       "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True})
show("/v1/completions greedy return_tokens_as_token_ids", r)
r = c.post(B + "/inference/v1/generate", json={"token_ids": ids, "sampling_params": {"max_tokens": 12,
       "temperature": 0.7, "top_p": 0.9, "seed": 1, "logprobs": 0}, "priority": 3})
show("/inference/v1/generate", r)
for path, kw in [("/pause", {"params": {"mode": "keep"}}), ("/is_paused", None), ("/update_weight_version", {"json": {"new_version": "v9"}}),
                 ("/resume", {}), ("/weight_info", None), ("/reset_prefix_cache", {})]:
    r = c.get(B + path) if kw is None else c.post(B + path, **kw)
    print(f"--- {path}: HTTP {r.status_code} {r.text[:300]}")
r = c.post(B + "/inference/v1/generate", json={"token_ids": ids, "sampling_params": {"max_tokens": 5, "temperature": 0}})
show("/inference/v1/generate after version v9", r)
