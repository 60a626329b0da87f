"""EleutherAI's lm-evaluation-harness against pdserve: its `local-completions` model scores a multiple-choice task
(defined here: tests/router/data/evals_mc.jsonl, 20 questions of four choices) through /v1/completions with the
request it sends for every such task (echo, logprobs 1, max_tokens 1, the prompt as token ids), and every
choice's log-likelihood must be transformers' on the same checkpoint, and so the accuracy. Offline: the task's
dataset is the local file, the tokenizer pdserve's own conversion of the GGUF's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.model.loader import default_model_path
from pdserve.model.tokenizer import _cached_gguf_tokenizer_dir
from router.compose import build_router
from router.config import RouterConfig

from conftest import transformers_gguf

pytestmark = pytest.mark.slow
MODEL = "smollm2"
DATA = Path(__file__).parent / "data" / "evals_mc.jsonl"
TASK = "pdserve_mc"
TOLERANCE = 1e-3  # a choice's log-likelihood (a sum over its tokens), pdserve against transformers, fp32


@pytest.fixture(scope="module")
def router(aloop, smol_1p1d):
    r = build_router(smol_1p1d, RouterConfig(port=0, http_port=0, served_model_name=MODEL))
    aloop.run(r.start())
    yield r
    aloop.run(r.stop(grace=5))


def task_dir(tmp_path: Path) -> Path:
    """The task's YAML, naming the local dataset by its absolute path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return tmp_path


def reference(model, hf_tokenizer, pairs) -> list[float]:
    """transformers' log-likelihood of each continuation after its context, tokenized as lm-evaluation-harness
    does (the whole text's tokens after the context's); the pairs of one question in one right-padded batch (a
    row's tokens never attend to the padding after them)."""
    rows = [(hf_tokenizer(c + x)["input_ids"], len(hf_tokenizer(c)["input_ids"])) for c, x in pairs]
    width = max(len(whole) for whole, _ in rows)
    ids = torch.tensor([whole + [0] * (width - len(whole)) for whole, _ in rows])
    mask = torch.tensor([[1] * len(whole) + [0] * (width - len(whole)) for whole, _ in rows])
    with torch.no_grad():
        lp = model(ids, attention_mask=mask).logits.float().log_softmax(-1)
    return [sum(lp[r, i - 1, whole[i]].item() for i in range(n, len(whole))) for r, (whole, n) in enumerate(rows)]


def offline_lm_eval(monkeypatch, tmp_path) -> None:
    """lm-eval as these tests run it: offline, its datasets cached under tmp_path, and without the environment
    report it adds to every result (torch's collect_env: a dozen subprocesses, ~3 s of CPU a run; never read)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval.evaluator  # after the environment: the datasets library reads it on import

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)


def test_lm_eval_local_completions_scores_like_transformers(router, tmp_path, monkeypatch):
    offline_lm_eval(monkeypatch, tmp_path)
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    tokenizer_dir = _cached_gguf_tokenizer_dir(default_model_path())
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url=http://127.0.0.1:{router.http_port}/v1/completions,model={MODEL},"
                   f"tokenizer={tokenizer_dir},tokenizer_backend=huggingface,num_concurrent=8",
        tasks=[TASK], log_samples=True,
        # The task alone: lm-eval's own thousands of task files take ~7 s of CPU to index.
        task_manager=TaskManager(include_path=str(task_dir(tmp_path / "tasks")), include_defaults=False))
    samples = out["samples"][TASK]
    assert len(samples) == 20 and all(len(s["filtered_resps"]) == 4 for s in samples)

    model = transformers_gguf(default_model_path())
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    correct, worst = 0, 0.0
    for s in samples:
        got = [float(ll) for ll, _ in s["filtered_resps"]]
        want = reference(model, hf_tokenizer, s["arguments"])  # [context, continuation] a choice
        assert got == pytest.approx(want, abs=TOLERANCE), (s["doc"], got, want)
        worst = max(worst, *(abs(a - b) for a, b in zip(got, want)))
        correct += max(range(4), key=want.__getitem__) == s["doc"]["answer"]
    acc = out["results"][TASK]["acc,none"]
    print(f"\nlm-eval {TASK}: acc {acc:.2f} (transformers {correct / 20:.2f}), largest difference {worst:.1e}")
    assert acc == pytest.approx(correct / 20)
