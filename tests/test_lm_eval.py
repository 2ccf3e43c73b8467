"""lm-evaluation-harness (lm-eval 0.4.13) scoring a local task through `gemma4-serve`.

The harness runs as users run it (`--model local-completions`, base_url only): it detects the
server's tokenizer (/tokenizer_info, /tokenize), encodes each (context, continuation) pair through
it, sends token-id prompts with `echo`, `logprobs: 1`, `max_tokens: 1` and reads the prompt
tokens' logprobs and alternatives. Every example's log-likelihood and greedy flag must equal what
the in-process model gives (a float64 log-softmax of its plain forward pass over the same ids).

Runs with `make test-interop` (the harness pulls datasets, scikit-learn, ...: that environment,
not the main test one); deselected where lm-eval is not installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemma4_nnx.decode.engine import Engine
from tests.helpers import ServerThread, tokenizer_and_model

pytestmark = pytest.mark.interop

NAME = "tiny-gemma4"
# Contexts start with <bos> written out (the harness adds no special tokens; /tokenize turns the
# text into the <bos> id). The test adds the model's own greedy continuation of the first context
# as a choice, so both answers of the greedy check occur.
DOCS = [
    {"context": "<bos>the model reads the", "choices": [" text", " model", " alpha"], "gold": 0},
    {"context": "<bos>alpha beta gamma", "choices": [" delta", " the", " reads text"], "gold": 0},
    {"context": "<bos>text text text", "choices": [" text", " beta"], "gold": 1},
]
TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
"""


def _reference(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """The harness's split (encode the whole, the continuation is what follows the context's ids),
    scored by a float64 log-softmax of the plain forward pass."""
    whole = tok.encode(context + continuation, add_bos=False)
    n = len(tok.encode(context, add_bos=False))
    x = np.asarray(model(np.asarray([whole])), np.float64)[0]
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    cols = range(n - 1, len(whole) - 1)
    ll = sum(logp[c, whole[c + 1]] for c in cols)
    greedy = all(int(np.argmax(logp[c])) == whole[c + 1] for c in cols)
    return float(ll), greedy


def test_lm_eval_local_task_through_the_server(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    tok, model = tokenizer_and_model(tmp_path)
    docs = [dict(d, choices=list(d["choices"])) for d in DOCS]
    ctx = tok.encode(DOCS[0]["context"], add_bos=False)
    best = int(np.argmax(np.asarray(model(np.asarray([ctx])))[0, -1]))
    docs[0]["choices"].append(tok.decode([best]))
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_choice.yaml").write_text(TASK.format(data=data))

    engine = Engine(model, tok, max_batch=4, max_length=64)
    try:
        with ServerThread(engine, NAME) as server:
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={"model": NAME, "base_url": url, "max_retries": 1},
                tasks=["tiny_choice"],
                task_manager=TaskManager(include_path=str(tasks)),
                log_samples=True,
                batch_size=4,
            )
    finally:
        engine.close()
    samples = results["samples"]["tiny_choice"]
    assert len(samples) == len(docs)
    greedy_seen = set()
    for sample in samples:
        assert len(sample["resps"]) == len(sample["arguments"])
        for args, resp in zip(sample["arguments"], sample["resps"], strict=True):
            context, continuation = args[0], args[1]
            ll, greedy = resp[0]
            want_ll, want_greedy = _reference(model, tok, context, continuation)
            assert abs(ll - want_ll) <= 1e-4 * max(1.0, abs(want_ll)), (context, continuation, ll, want_ll)
            assert greedy == want_greedy, (context, continuation)
            greedy_seen.add(greedy)
    assert greedy_seen == {True, False}, "the greedy check was not exercised both ways"
    # the accuracy the harness reports follows from those log-likelihoods
    acc = np.mean(
        [int(np.argmax([r[0][0] for r in s["resps"]]) == s["doc"]["gold"]) for s in samples],
    )
    assert results["results"]["tiny_choice"]["acc,none"] == pytest.approx(acc)
