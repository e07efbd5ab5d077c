"""The server's long tail through the official ``openai`` client and raw HTTP, against transformers and the
offline LLM: echo with max_tokens=0 (lm-evaluation-harness's log-likelihood request) and prompt_logprobs,
logit_bias / allowed_token_ids / bad_words, every vLLM sampling field honoured or refused with a 400,
/v1/embeddings from the same process, and lm-eval's local-completions where lm-eval is installed."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from vllm_fields import VLLM_SAMPLING_FIELDS

from kvloom import LLM, SamplingParams
from kvloom.entrypoints.openai.protocol import CompletionRequest
from kvloom.entrypoints.openai.serving_engine import REFUSED_FIELDS

Server = Any
DATA = Path(__file__).resolve().parents[1] / "data" / "tiny_mc.jsonl"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, server_factory: Any) -> Any:
    with server_factory(tiny_llama_dir, "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir: str):
    """token ids -> each position's log-softmax [T, V] (fp32, transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


def post(server: Server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json={"model": "tiny", **body}, timeout=60)


# ---- log-probabilities for evaluation ---------------------------------------------------------------

def test_echo_with_max_tokens_0_returns_the_prompt_and_transformers_logprobs(server, client, offline,
                                                                            hf_logprobs) -> None:
    ids = offline.get_tokenizer().encode(PROMPT)
    reply = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    choice = reply.choices[0]
    assert choice.text == PROMPT and reply.usage.completion_tokens == 0
    token_logprobs = choice.logprobs.token_logprobs
    assert token_logprobs[0] is None and len(token_logprobs) == len(ids)
    expected = hf_logprobs(ids)
    for position in range(1, len(ids)):
        assert abs(token_logprobs[position] - expected[position - 1, ids[position]].item()) < 1e-4
    # Streamed, the same prompt and logprobs, and no generated text.
    stream = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1,
                                       stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == token_logprobs
    bad = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_on_completions_and_chat_equal_the_offline_engine(server, client, offline) -> None:
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    got = reply.choices[0].model_extra["prompt_logprobs"]
    [expected] = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                                  use_tqdm=False)
    assert got[0] is None and len(got) == len(expected.prompt_logprobs)
    for entry, want in zip(got[1:], expected.prompt_logprobs[1:]):
        assert {int(t) for t in entry} == set(want)
        for token, lp in want.items():
            assert abs(entry[str(token)]["logprob"] - lp.logprob) < 1e-5 and entry[str(token)]["rank"] == lp.rank
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    rows = chat.model_extra["prompt_logprobs"]
    assert rows[0] is None and all(len(row) == 1 for row in rows[1:]) and len(rows) > 5
    refused = post(server, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    over = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "prompt_logprobs": 21})
    assert over.status_code == 400 and "--max-logprobs" in over.json()["error"]["message"]


def test_log_likelihoods_as_lm_eval_computes_them_equal_transformers(server, offline, hf_logprobs) -> None:
    """lm-evaluation-harness's local-completions log-likelihood: context + continuation as token ids, echo,
    max_tokens=0, logprobs=1; the continuation's summed logprobs pick the answer."""
    tokenizer = offline.get_tokenizer()
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    correct_server = correct_hf = 0
    for row in rows:
        context = tokenizer.encode(row["question"])
        prompts = [context + tokenizer.encode(" " + choice, add_special_tokens=False) for choice in row["choices"]]
        reply = post(server, "/v1/completions", {"prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 1,
                                                 "temperature": 0}).json()
        ours, theirs = [], []
        for ids, choice in zip(prompts, sorted(reply["choices"], key=lambda c: c["index"])):
            ours.append(sum(choice["logprobs"]["token_logprobs"][len(context):]))
            expected = hf_logprobs(ids)
            theirs.append(sum(expected[p - 1, ids[p]].item() for p in range(len(context), len(ids))))
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3
        correct_server += int(max(range(len(ours)), key=ours.__getitem__) == row["answer"])
        correct_hf += int(max(range(len(theirs)), key=theirs.__getitem__) == row["answer"])
    assert correct_server == correct_hf


def test_lm_eval_local_completions_matches_its_hf_model(server, tiny_llama_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-evaluation-harness itself: its local-completions model against the server and its hf model on the
    same checkpoint, over tests/data/tiny_mc.yaml. The tokenizer is the checkpoint's own (a local path): lm-eval
    needs one to find where each continuation starts (its ctxlen), and nothing may come from the hub."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: it reads this once
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]', "
                                  "kvloom's eval extra); test_log_likelihoods_as_lm_eval_computes_them_equal_"
                                  "transformers checks the same requests")
    from lm_eval.tasks import TaskManager

    # The task's data_files path is relative to the working directory.
    monkeypatch.chdir(DATA.parent)
    # include_defaults=False: indexing lm-eval's thousands of built-in task files takes half a minute.
    tasks = TaskManager(include_path=str(DATA.parent), include_defaults=False)
    results = {}
    for name, args in (("local-completions", f"model=tiny,base_url={server.url}/v1/completions,"
                                              f"tokenizer_backend=huggingface,tokenizer={tiny_llama_dir},"
                                              "tokenized_requests=True,num_concurrent=2,max_retries=1"),
                       ("hf", f"pretrained={tiny_llama_dir},dtype=float32,device=cpu")):
        results[name] = lm_eval.simple_evaluate(model=name, model_args=args, tasks=["kvloom_tiny_mc"],
                                                task_manager=tasks, log_samples=True, bootstrap_iters=0)
    # Per question, each choice's (log-likelihood, is_greedy) after lm-eval's filters.
    samples = {name: [[float(r[0]) for r in s["filtered_resps"]]
                      for s in sorted(result["samples"]["kvloom_tiny_mc"], key=lambda s: s["doc_id"])]
               for name, result in results.items()}
    assert len(samples["local-completions"]) == len(samples["hf"]) == len(DATA.read_text().splitlines())
    for ours, theirs in zip(samples["local-completions"], samples["hf"]):
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3
    accuracy = {name: r["results"]["kvloom_tiny_mc"]["acc,none"] for name, r in results.items()}
    assert accuracy["local-completions"] == accuracy["hf"]


# ---- logits processors ------------------------------------------------------------------------------

def test_logit_bias_allowed_token_ids_and_bad_words_equal_the_offline_engine(server, client, offline) -> None:
    base = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    word = offline.get_tokenizer().decode(base.token_ids[:2])
    cases = [({"logit_bias": {str(base.token_ids[0]): -100, "17": 5}}, {"logit_bias": {base.token_ids[0]: -100,
                                                                                       17: 5}}),
             ({"allowed_token_ids": [40, 41, 300]}, {"allowed_token_ids": [40, 41, 300]}),
             ({"bad_words": [word]}, {"bad_words": [word]})]
    for body, kwargs in cases:
        expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, **kwargs),
                                    use_tqdm=False)[0].outputs[0].text
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                          logit_bias=body.pop("logit_bias", None), extra_body=body)
        assert reply.choices[0].text == expected != base.text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          logit_bias={"5": 100})
    assert chat.choices[0].message.content == offline.get_tokenizer().decode([5] * 4)


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"400": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"allowed_token_ids": [1, 400]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
])
def test_bad_logits_processor_fields_are_400s_naming_them(server: Server, body: dict, param: str) -> None:
    for route, extra in (("/v1/completions", {"prompt": PROMPT}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        response = post(server, route, {**extra, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_every_vllm_sampling_field_is_honoured_or_refused_on_the_server(server: Server) -> None:
    """Each vLLM SamplingParams field is a declared request field (passed to SamplingParams, whose honouring
    test_api_tail_offline.py checks) or a 400 naming it; none is silently ignored."""
    declared = set(CompletionRequest.model_fields)
    for name in VLLM_SAMPLING_FIELDS:
        if name in declared:
            continue
        assert name in REFUSED_FIELDS, f"{name} would be silently ignored"
        response = post(server, "/v1/completions", {"prompt": PROMPT, name: 3 if name != "detokenize" else False})
        assert response.status_code == 400 and response.json()["error"]["param"] == name, (name, response.text)


# ---- embeddings -------------------------------------------------------------------------------------

def test_embeddings_endpoint_in_openais_shape_equal_the_offline_engine(server, client, offline) -> None:
    texts = ["The quick brown fox", "Once upon a time"]
    reply = client.embeddings.create(model="tiny", input=texts)
    expected = [o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)]
    assert [d.index for d in reply.data] == [0, 1] and reply.object == "list"
    for data, want in zip(reply.data, expected):
        torch.testing.assert_close(torch.tensor(data.embedding), torch.tensor(want), atol=1e-6, rtol=1e-5)
    ids = [offline.get_tokenizer().encode(t) for t in texts]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    raw = post(server, "/v1/embeddings", {"input": ids, "encoding_format": "base64"}).json()
    for data, want in zip(raw["data"], expected):
        vector = struct.unpack(f"<{len(want)}f", base64.b64decode(data["embedding"]))
        torch.testing.assert_close(torch.tensor(vector), torch.tensor(want), atol=1e-6, rtol=1e-5)
    single = post(server, "/v1/embeddings", {"input": ids[0]}).json()
    torch.testing.assert_close(torch.tensor(single["data"][0]["embedding"]), torch.tensor(expected[0]),
                               atol=1e-6, rtol=1e-5)
    for body, param in (({"input": "x", "dimensions": 8}, "dimensions"), ({"input": []}, "input"),
                        ({"input": [5, 400]}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens")):
        response = post(server, "/v1/embeddings", body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert post(server, "/v1/embeddings", {"input": "x", "model": "other"}).status_code == 404
    metrics = server.metrics()
    assert metrics['kvloom:embedding_requests_total'] >= 1
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_embeddings_and_generation_run_together(server: Server) -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, server, "/v1/embeddings", {"input": f"text {i}"}) for i in range(6)]
        futures += [pool.submit(post, server, "/v1/completions", {"prompt": f"text {i}", "max_tokens": 8})
                    for i in range(6)]
        assert all(f.result().status_code == 200 for f in futures)
