"""SGLang's /generate and vLLM's /inference/v1/generate on the shared SmolLM2 1P1D cluster, over real HTTP
(router.sglang_api, router.vllm_api): tokens, text and logprobs equal to pdserve's own API's (the OpenAI door,
gRPC), batches, n, streams, the prompt's logprobs, finish reasons, bad input refused by name; and the
control routes: a real flush of every worker's prefix cache, pause and continue, the model's info, the health
request, the memory routes' 501, and the admin role they take.

The request bodies are the ones the RL frameworks' own code sends (AReaL 1.0.4's SGLangBackend, lm-eval's
sglang-generate, SkyRL's RemoteInferenceClient), copied field for field where the client itself is not run."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from pdserve.client import Client
from router.compose import build_router
from router.config import RouterConfig

from conftest import SMOL_MODEL, wait_for

pytestmark = pytest.mark.slow
MODEL = SMOL_MODEL
PROMPT = "The capital of France is"
ADMIN = "admin-key-for-rl-tests"


@pytest.fixture(scope="module")
def cluster(smol_1p1d):
    return smol_1p1d


@pytest.fixture(scope="module")
def router(smol_router):
    return smol_router


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}", timeout=120) as h:
        yield h


@pytest.fixture(scope="module")
def tokenizer(cluster):
    return cluster.info.tokenizer


@pytest.fixture(scope="module")
def ids(tokenizer):
    return tokenizer.encode(PROMPT)


def areal_generate(input_ids, max_new_tokens=8, **sampling) -> dict:
    """The body AReaL's SGLangBackend.build_generation_request sends (greedy, its defaults)."""
    params = {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": max_new_tokens, "temperature": 0.0,
              "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True, "frequency_penalty": 0.0,
              **sampling}
    return {"input_ids": list(input_ids), "image_data": None, "sampling_params": params, "return_logprob": True,
            "stream": False}


def grpc_reference(router, ids, max_tokens=8, **kw):
    with Client(f"127.0.0.1:{router.port}") as c:
        return c.complete(token_ids=ids, max_tokens=max_tokens, temperature=0.0, logprobs=2, timeout=120, **kw)


def test_generate_answers_as_sglang_with_the_tokens_and_logprobs_of_pdserves_api(router, http, ids, tokenizer):
    r = http.post("/generate", json=areal_generate(ids))
    assert r.status_code == 200, r.text
    out = r.json()
    ref = grpc_reference(router, ids)
    meta = out["meta_info"]
    assert out["output_ids"] == list(ref.token_ids) and len(out["output_ids"]) == 8
    assert out["text"] == tokenizer.decode(out["output_ids"])
    assert [x[1] for x in meta["output_token_logprobs"]] == out["output_ids"]
    assert [x[0] for x in meta["output_token_logprobs"]] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 8
    assert meta["weight_version"] == "0" and meta["output_weight_versions"] == [0] * 8
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: none of the prompt's


def test_a_batch_of_texts_with_n_and_top_logprobs_and_text_in_logprobs(http, tokenizer):
    texts = [PROMPT, "One, two, three,"]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 4, "temperature": 0.8, "n": 2, "sampling_seed": 7},
            "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert isinstance(answers, list) and len(answers) == 4
    for i, a in enumerate(answers):  # prompt i's sample j at i * n + j
        meta = a["meta_info"]
        assert meta["prompt_tokens"] == len(tokenizer.encode(texts[i // 2])) and len(a["output_ids"]) == 4
        assert [x[2] for x in meta["output_token_logprobs"]] == [tokenizer.decode([t]) for t in a["output_ids"]]
        tops = meta["output_top_logprobs"]
        assert len(tops) == 4 and all(len(t) == 3 and t[0][0] >= t[1][0] >= t[2][0] for t in tops)
    # sample j is seeded seed + j: the same prompt's two samples are a request of n = 1 each with that seed
    one = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.8,
                                                                           "sampling_seed": 8}}).json()
    assert one["output_ids"] == answers[1]["output_ids"]


def test_input_logprobs_from_logprob_start_len_equal_the_prompt_logprobs_of_the_openai_door(router, http, ids):
    # lm-eval's sglang-generate and AReaL's score request: the prompt's logprobs from a position on
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 0, "stream": False}
    meta = http.post("/generate", json=body).json()["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and entries[0][0] is None
    ref = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                                             "prompt_logprobs": 0}).json()["choices"][0]["prompt_logprobs"]
    assert [e[0] for e in entries[1:]] == pytest.approx([d[str(t)]["logprob"] for d, t in zip(ref[1:], ids[1:])],
                                                        abs=1e-4)
    later = http.post("/generate", json={**body, "logprob_start_len": len(ids) - 2}).json()["meta_info"]
    assert [e[1] for e in later["input_token_logprobs"]] == ids[-2:]


def test_stop_strings_and_tokens_say_what_they_matched(http, ids, tokenizer):
    greedy = http.post("/generate", json=areal_generate(ids, 8)).json()["output_ids"]
    token = greedy[2]
    r = http.post("/generate", json=areal_generate(ids, 8, stop_token_ids=[token])).json()
    assert r["output_ids"] == greedy[:3] and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    word = tokenizer.decode(greedy[3:5]).strip()
    r = http.post("/generate", json=areal_generate(ids, 8, stop=[word])).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": word} and word not in r["text"]


def test_a_stream_is_sglangs_server_sent_events_with_cumulative_answers(http, ids):
    whole = http.post("/generate", json=areal_generate(ids, 6)).json()
    chunks = []
    with http.stream("POST", "/generate", json={**areal_generate(ids, 6), "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    answers = [json.loads(c) for c in chunks[:-1]]
    assert len(answers) >= 2 and all(a["meta_info"]["finish_reason"] is None for a in answers[:-1])
    lengths = [len(a["output_ids"]) for a in answers]
    assert lengths == sorted(lengths) and answers[-1]["output_ids"] == whole["output_ids"]
    assert answers[-1]["text"] == whole["text"] and answers[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert [x[1] for x in answers[-1]["meta_info"]["output_token_logprobs"]] == whole["output_ids"]


@pytest.mark.parametrize("body, param", [
    ({"input_ids": [1, 2], "text": "x"}, "text"),
    ({"input_ids": [1, 2], "image_data": ["a.png"]}, "image_data"),
    ({"input_ids": [1, 2], "no_such_field": 1}, "no_such_field"),
    ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"1": 2.0}}}, "sampling_params.logit_bias"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_token": 2}}, "sampling_params.max_new_token"),
    ({"input_ids": [1, 2], "top_logprobs_num": -1, "return_logprob": True}, "top_logprobs_num"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 1}]}, "sampling_params"),
    ({"input_ids": [[1]] * 129}, "input_ids"),
    ({"text": []}, "text"),
])
def test_bad_generate_bodies_are_refused_by_field(http, body, param):
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_value_out_of_range_is_a_400_and_the_server_stays_up(http, ids):
    r = http.post("/generate", json={"input_ids": [10 ** 9], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "unknown token ids" in r.json()["error"]["message"]
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": -1}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    assert http.post("/generate", json=areal_generate(ids, 2)).status_code == 200


def skyrl_generate(ids, **sampling) -> dict:
    """The body SkyRL's RemoteInferenceClient._generate_single sends (its sampling_params are vLLM's)."""
    return {"sampling_params": {"max_tokens": 8, "temperature": 0.0, "logprobs": 1, **sampling}, "model": MODEL,
            "token_ids": list(ids)}


def test_vllm_generate_returns_token_ids_and_logprobs_equal_to_pdserves_api(router, http, ids):
    r = http.post("/inference/v1/generate", json=skyrl_generate(ids), headers={"X-Session-ID": "s1"})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    ref = grpc_reference(router, ids)
    assert choice["token_ids"] == list(ref.token_ids) and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ref.token_ids]
    assert [c["logprob"] for c in content] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
    assert all(len(c["top_logprobs"]) == 1 for c in content) and out["prompt_logprobs"] is None
    assert choice["weight_versions"] == [0] * 8
    p = http.post("/inference/v1/generate", json=skyrl_generate(ids, prompt_logprobs=1, max_tokens=1)).json()
    assert p["prompt_logprobs"][0] is None and all(str(t) in d for d, t in zip(p["prompt_logprobs"][1:], ids[1:]))
    bad = http.post("/inference/v1/generate", json=skyrl_generate(ids, best_of=2))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.best_of"
    assert http.post("/inference/v1/generate", json={**skyrl_generate(ids), "model": "other"}).status_code == 404


def sse(http, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_vllm_generate_streams_each_samples_new_tokens_then_the_usage(http, ids):
    whole = http.post("/inference/v1/generate", json=skyrl_generate(ids, max_tokens=6, n=2, seed=5,
                                                                     temperature=1.0)).json()
    body = {**skyrl_generate(ids, max_tokens=6, n=2, seed=5, temperature=1.0), "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(http, "/inference/v1/generate", body)
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    *parts, usage = events
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12,
                                                         "total_tokens": len(ids) + 12}
    for j, want in enumerate(whole["choices"]):
        mine = [e["choices"][0] for e in parts if e["choices"][0]["index"] == j]
        assert len(mine) >= 2 and all(c["finish_reason"] is None for c in mine[:-1])
        assert mine[-1]["finish_reason"] == "length"
        assert [t for c in mine for t in c["token_ids"]] == want["token_ids"]
        assert [x for c in mine for x in c["logprobs"]["content"]] == want["logprobs"]["content"]
        assert [v for c in mine for v in c["weight_versions"]] == want["weight_versions"]
    counts = [e["usage"]["completion_tokens"] for e in parts if e["choices"][0]["index"] == 0]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(e["request_id"] == events[0]["request_id"] for e in events)
    bad = http.post("/inference/v1/generate", json={**skyrl_generate(ids), "stream_options": {"include_usage": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options"


def cached_tokens(http, ids) -> int:
    return http.post("/generate", json=areal_generate(ids, 1)).json()["meta_info"]["cached_tokens"]


def test_flush_cache_and_reset_prefix_cache_forget_every_workers_prefix_cache(http, cluster, tokenizer):
    ids = tokenizer.encode("A prompt for the flush test, long enough to fill a few blocks of sixteen tokens each, "
                           "so that its second run finds them in the prefill worker's prefix cache.")
    cached_tokens(http, ids)
    assert cached_tokens(http, ids) >= 16  # a repeat: its blocks come from the cache
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"], r.text
    assert all(cluster.scaling.kv_index.blocks(w.worker_id) == 0 for w in cluster.scaling.workers)
    assert cached_tokens(http, ids) == 0  # computed again
    assert cached_tokens(http, ids) >= 16
    r = http.post("/reset_prefix_cache", json={"reset_running_requests": False})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert cached_tokens(http, ids) == 0


def test_a_flush_while_a_request_holds_kv_is_refused_and_says_why(http, ids):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}}
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", http.post("/generate", json=body)))
    t.start()
    try:
        wait_for(lambda: any(s["running"] for s in http.get("/get_server_info").json()["internal_states"]), 60,
                 what="the request running")
        r = http.post("/flush_cache")
        assert r.status_code == 400 and not r.json()["success"] and "running requests" in r.json()["message"]
    finally:
        t.join(300)
    assert done["r"].status_code == 200


def test_pause_and_continue_generation_and_vllms_pause_resume(http, ids, router):
    r = http.post("/pause_generation", json={"mode": "retract"})
    assert r.status_code == 200 and router.weights.paused
    assert http.get("/is_paused").json() == {"is_paused": True}
    held = {}
    t = threading.Thread(target=lambda: held.setdefault("r", http.post("/generate", json=areal_generate(ids, 2))))
    t.start()
    try:
        t.join(1.0)
        assert t.is_alive()  # waits at the gate while paused
    finally:
        assert http.post("/continue_generation").status_code == 200
        t.join(120)
    assert held["r"].status_code == 200 and len(held["r"].json()["output_ids"]) == 2
    assert http.post("/pause", params={"mode": "wait", "clear_cache": "true"}).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").status_code == 200 and not router.weights.paused
    assert http.post("/pause", params={"mode": "sideways"}).status_code == 400


def test_model_and_server_info_health_generate_world_size_and_the_memory_routes(http, cluster):
    info = http.get("/get_model_info").json()
    assert info["is_generation"] and info["model_path"] == cluster.info.path and info["weight_version"] == "0"
    assert http.get("/get_weight_version").json() == {"weight_version": "0"}
    assert http.get("/health_generate").status_code == 200
    assert http.get("/get_world_size").json() == {"world_size": 2}
    for route in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = http.post(route, json={})
        assert r.status_code == 501 and "sleep mode" in r.json()["message"]


def test_the_control_routes_take_the_admin_key_and_generate_the_inference_one(aloop, cluster, ids):
    r = build_router(cluster, RouterConfig(port=0, http_port=0, served_model_name=MODEL, api_key="inference",
                                           admin_api_key=ADMIN))
    aloop.run(r.start())
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{r.http_port}", timeout=120) as h:
            user = {"Authorization": "Bearer inference"}
            assert h.post("/generate", json=areal_generate(ids, 1), headers=user).status_code == 200
            assert h.post("/inference/v1/generate", json=skyrl_generate(ids), headers=user).status_code == 200
            for route in ("/pause_generation", "/flush_cache", "/pause", "/reset_prefix_cache",
                          "/update_weights_from_disk", "/init_weight_transfer_engine", "/start_weight_update",
                          "/update_weights", "/finish_weight_update", "/init_weights_update_group"):
                assert h.post(route, json={}, headers=user).status_code == 403, route
            assert h.get("/weight_info", headers=user).status_code == 403
            assert h.get("/get_model_info", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    finally:
        aloop.run(r.stop(grace=5))


def test_lm_evals_sglang_generate_model_scores_as_its_local_completions_model(router, tmp_path, monkeypatch):
    """lm-eval's sglang-generate model (its own code) scores the multiple-choice task of test_lm_eval through
    /generate's input logprobs (logprob_start_len 0, batched input_ids): every choice's log-likelihood equals
    what its local-completions model reads from /v1/completions on the same cluster."""
    from test_lm_eval import TASK, offline_lm_eval, task_dir

    offline_lm_eval(monkeypatch, tmp_path)
    import lm_eval
    from lm_eval.tasks import TaskManager

    from pdserve.model.loader import default_model_path
    from pdserve.model.tokenizer import _cached_gguf_tokenizer_dir

    tokenizer = _cached_gguf_tokenizer_dir(default_model_path())
    tasks = TaskManager(include_path=str(task_dir(tmp_path / "tasks")), include_defaults=False)
    base = f"http://127.0.0.1:{router.http_port}"
    scores = {}
    for model, url in (("sglang-generate", "/generate"), ("local-completions", "/v1/completions")):
        args = (f"base_url={base}{url},model={MODEL},tokenizer={tokenizer},tokenizer_backend=huggingface,"
                "batch_size=4,num_concurrent=4")
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=[TASK], task_manager=tasks, log_samples=True)
        scores[model] = [[float(ll) for ll, _ in s["filtered_resps"]] for s in out["samples"][TASK]]
    assert len(scores["sglang-generate"]) == 20 and all(len(s) == 4 for s in scores["sglang-generate"])
    for got, want in zip(scores["sglang-generate"], scores["local-completions"]):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("body, says", [
    ({"model_path": "/etc"}, "weights root"),
    ({"model_path": "/nowhere/model", "weight_version": "v2"}, "weight_version must be an integer"),
    ({"model_path": "/nowhere/model", "keep_pause": True}, "not paused"),
])
def test_update_weights_from_disk_refuses_what_it_cannot_apply_and_applies_nothing(http, router, body, says):
    r = http.post("/update_weights_from_disk", json=body)
    assert r.status_code == 400 and not r.json()["success"] and says in r.json()["message"], r.text
    assert router.weights.version == 0 and not router.weights.paused
    bad = http.post("/update_weights_from_disk", json={**body, "no_such_field": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "no_such_field"


GROUP = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3, "group_name": "g"}
ANNOUNCED = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[576]]}


@pytest.mark.parametrize("route, body, says", [
    ("/init_weights_update_group", {**GROUP, "master_port": "29x"}, "master_port must be int"),
    ("/init_weights_update_group", {**GROUP, "pp_rank": 1}, "pp_rank is not a field"),
    ("/init_weights_update_group", {**GROUP, "backend": "mpi"}, "backend must be one of"),
    ("/update_weights_from_distributed", {**ANNOUNCED, "lora_name": "a"}, "lora_name is not a field"),
    ("/update_weights_from_distributed", {**ANNOUNCED, "abort_all_requests": "yes"}, "abort_all_requests must be"),
    ("/update_weights_from_distributed", {**ANNOUNCED, "group_name": 7}, "group_name must be str"),
])
def test_bad_weight_group_bodies_are_refused_by_field(http, router, route, body, says):
    r = http.post(route, json=body)
    assert r.status_code == 400 and not r.json()["success"] and says in r.json()["message"], r.text
    assert router.weights.version == 0 and not router.weights.client_group


def test_vllms_checkpoint_path_weight_transfer_refuses_out_of_order_calls_and_other_forms(http, router):
    """The calls' order and bodies (the update that applies a checkpoint: tests/router/test_rl_routes_clients.py,
    on a cluster of its own)."""
    def call(route, body=None, status=200):
        r = http.post(route, json=body)
        assert r.status_code == status, (route, r.text)
        return r.json()

    assert http.get("/weight_info").json() == {"weight_version": "0"}
    assert "/init_weight_transfer_engine first" in call("/start_weight_update", None, 409)["error"]["message"]
    nccl = {"init_info": {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}}
    assert call("/init_weight_transfer_engine", nccl, 400)["error"]["param"] == "init_info.master_address"
    assert call("/init_weight_transfer_engine", {}, 400)["error"]["param"] == "init_info"
    call("/init_weight_transfer_engine", {"init_info": {}})
    assert "/start_weight_update first" in call("/update_weights", {"update_info": {"path": "/x"}}, 409)["error"][
        "message"]
    assert call("/start_weight_update", {"is_checkpoint_format": False}, 400)["error"]["param"] == \
        "is_checkpoint_format"
    call("/start_weight_update", {"is_checkpoint_format": True})
    assert "already under way" in call("/start_weight_update", None, 409)["error"]["message"]
    packed = {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[576]]}}
    assert call("/update_weights", packed, 400)["error"]["param"] == "update_info.dtype_names"
    for path, says in (("/etc", "weights root"), ("relative/dir", "absolute")):
        answer = call("/update_weights", {"update_info": {"path": path}}, 400)["error"]
        assert answer["param"] == "update_info.path" and says in answer["message"]
    assert call("/finish_weight_update", {"weight_version": "v2"}, 400)["error"]["param"] == "weight_version"
    assert "no checkpoint was given" in call("/finish_weight_update", {}, 409)["error"]["message"]  # it ends
    assert "no weight update is under way" in call("/finish_weight_update", None, 409)["error"]["message"]
    assert call("/update_weight_version", {"new_version": "7"}, 501)["error"]["type"] == "not_implemented"
    assert router.weights.version == 0 and http.get("/weight_info").json() == {"weight_version": "0"}
