"""Scoring and reranking: sequence classifiers (transformers' ``...ForSequenceClassification``) and a yes/no
reranker made of a causal LM (vLLM's hf_overrides for Qwen3-Reranker) score text pairs as transformers does
(its model's logits, by hand for the reranker), through ``LLM.score`` / ``LLM.classify`` and the server's
``/score``, ``/v1/score``, ``/rerank`` and ``/v1/rerank``; bad requests and a model that is no classifier get
a 400 in OpenAI's error shape."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
import torch

from kvloom import LLM, PoolingParams
from kvloom.scoring import QWEN3_RERANKER_TEMPLATE
from tests.tiny_models import BOS_ID, EOS_ID, save_tokenizer

QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of France is Paris.", "The quick brown fox jumps over the lazy dog.",
             "def fibonacci(n: int) -> int:", "Once upon a time, there was a little robot who wanted to learn how "
             "to read and write stories. It read every book in the library, from the first page to the last."]
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                      "is_original_qwen3_reranker": True}
TOL = 1e-5


def _tiny_config(family: str, vocab_size: int, **overrides: Any) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    kwargs: dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
                                  dtype="float32")
    if family == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return (Qwen3Config if family == "qwen3" else LlamaConfig)(**kwargs)


def _widen(model: torch.nn.Module) -> None:
    """Wider than the default init (std 0.02), so scores differ between documents and mistakes show."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.3 if "embed" in name or "score" in name else 0.1)


def build_classifier(path: str, family: str, num_labels: int = 1) -> str:
    """A tiny random ``<Family>ForSequenceClassification`` checkpoint (fp32) with the tests' tokenizer."""
    from transformers import AutoModelForSequenceClassification

    vocab_size = save_tokenizer(path)
    config = _tiny_config(family, vocab_size, num_labels=num_labels, tie_word_embeddings=False)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    _widen(model)
    model.save_pretrained(path)
    return path


def build_yes_no_reranker(path: str, tie_word_embeddings: bool) -> str:
    """A tiny random Qwen3ForCausalLM whose vocabulary holds "yes" and "no" as tokens (Qwen3-Reranker's kind)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    save_tokenizer(path)
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.add_tokens(["yes", "no"])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    config = _tiny_config("qwen3", tokenizer.get_vocab_size(with_added_tokens=True),
                          tie_word_embeddings=tie_word_embeddings)
    model = AutoModelForCausalLM.from_config(config).eval()
    _widen(model)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_classifier(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_classifier(str(tmp_path_factory.mktemp("llama_cls")), "llama")


@pytest.fixture(scope="module")
def qwen3_classifier(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_classifier(str(tmp_path_factory.mktemp("qwen3_cls")), "qwen3")


@pytest.fixture(scope="module")
def qwen3_reranker(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_yes_no_reranker(str(tmp_path_factory.mktemp("qwen3_reranker")), tie_word_embeddings=False)


def hf_pair_logits(model_dir: str, text_1: str, text_2: str) -> tuple[list[int], torch.Tensor]:
    """transformers' classifier on transformers' pair encoding: (its token ids, its logits [num_labels])."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(text_1, text_2)["input_ids"]
    with torch.no_grad():
        return ids, model(torch.tensor([ids])).logits[0]


def hf_yes_probability(model_dir: str, query: str, document: str) -> tuple[list[int], float]:
    """Qwen3-Reranker's score as its model card computes it: the causal LM's last logits of "yes" and "no" on
    the reranker prompt, softmaxed, the "yes" share."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    text = f"{prefix}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{suffix}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        last = model(torch.tensor([ids])).logits[0, -1]
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    return ids, torch.softmax(torch.stack([last[no], last[yes]]), dim=0)[1].item()


# ---- offline: LLM.score and LLM.classify ------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_classifier_scores_equal_transformers(family: str, llama_classifier: str, qwen3_classifier: str) -> None:
    model_dir = llama_classifier if family == "llama" else qwen3_classifier
    # A 16-token budget splits the long pair over several steps (pooled chunk by chunk).
    llm = LLM(model_dir, max_model_len=128, max_num_batched_tokens=16)
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert len(outputs) == len(DOCUMENTS)
    for document, output in zip(DOCUMENTS, outputs):
        ids, logits = hf_pair_logits(model_dir, QUERY, document)
        assert output.prompt_token_ids == ids
        assert abs(output.outputs.score - torch.sigmoid(logits[0]).item()) < TOL
    assert len({round(o.outputs.score, 4) for o in outputs}) > 1  # the documents score apart
    # Two lists pair by pair; the raw logit with use_activation=False.
    [pair] = llm.score([QUERY], [DOCUMENTS[1]], use_tqdm=False,
                       pooling_params=PoolingParams(use_activation=False))
    assert abs(pair.outputs.score - hf_pair_logits(model_dir, QUERY, DOCUMENTS[1])[1][0].item()) < TOL
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate(["hi"], use_tqdm=False)


def test_classify_gives_transformers_softmax_over_labels(tmp_path: Any) -> None:
    model_dir = build_classifier(str(tmp_path), "qwen3", num_labels=3)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir, max_model_len=128)
    outputs = llm.classify(DOCUMENTS, use_tqdm=False)
    for document, output in zip(DOCUMENTS, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer(document)["input_ids"]])).logits[0]
        assert output.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(output.outputs.probs), torch.softmax(logits, dim=0), atol=TOL)
    with pytest.raises(ValueError, match="one label"):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False)


@pytest.mark.parametrize("tied", [False, True])
def test_yes_no_reranker_scores_equal_its_yes_probability(tmp_path: Any, qwen3_reranker: str, tied: bool) -> None:
    model_dir = build_yes_no_reranker(str(tmp_path), tie_word_embeddings=True) if tied else qwen3_reranker
    llm = LLM(model_dir, max_model_len=512, hf_overrides=RERANKER_OVERRIDES)
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    oracle = [hf_yes_probability(model_dir, QUERY, document) for document in DOCUMENTS]
    assert [o.prompt_token_ids for o in outputs] == [ids for ids, _ in oracle]
    expected = [score for _, score in oracle]
    assert max(abs(o.outputs.score - e) for o, e in zip(outputs, expected)) < TOL
    # The template given explicitly (vLLM's way) is the same prompt.
    [again] = llm.score(QUERY, DOCUMENTS[0], use_tqdm=False, chat_template=QWEN3_RERANKER_TEMPLATE)
    assert abs(again.outputs.score - expected[0]) < TOL


def test_a_gguf_reranker_scores_as_its_checkpoint_and_from_the_packed_cache(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 GGUF of Q8_0 tensors (its LM head's rows dequantized into the head), made a reranker by
    hf_overrides, scores as its safetensors checkpoint up to the quantization, and the same again when its model
    is mapped from the packed model cache (the classifier pickles by name)."""
    from transformers import AutoModelForCausalLM

    from kvloom.ops import cpu
    from tests.tiny_models import write_tiny_gguf

    if not cpu.cpu_kernel_available():  # loaded from the usual cache before the packed cache moves to tmp_path
        pytest.skip("the CPU kernels are not built here")
    monkeypatch.setenv("KVLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVLOOM_PACKED_CACHE", "1")
    model_dir = str(tmp_path / "hf")
    model = AutoModelForCausalLM.from_config(_tiny_config("qwen3", save_tokenizer(model_dir),
                                                          tie_word_embeddings=False)).eval()
    _widen(model)
    model.save_pretrained(model_dir)
    q8_0 = 8  # ggml's Q8_0: every matrix, the LM head too (its rows read back from the int8 blocks)
    gguf_path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), model_dir, arch="qwen3", types={
        kind: q8_0 for kind in ("embed", "attn", "attn_o", "ffn", "ffn_down", "output")})
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["\u0120the", "\u0120fox"], "method": "from_2_way_softmax"}

    def scores(model_path: str) -> list[float]:
        llm = LLM(model_path, max_model_len=256, hf_overrides=overrides)
        return [o.outputs.score for o in llm.score(QUERY, DOCUMENTS[:3], use_tqdm=False)]

    reference, packed, mapped = scores(model_dir), scores(gguf_path), scores(gguf_path)
    assert os.listdir(tmp_path / "cache" / "packed")
    assert packed == mapped
    assert max(abs(a - b) for a, b in zip(packed, reference)) < 0.01


def test_score_refuses_a_model_that_is_no_classifier_and_bad_pairs(tiny_llama_dir: str,
                                                                   llama_classifier: str) -> None:
    llm = LLM(tiny_llama_dir, max_model_len=128)
    with pytest.raises(ValueError, match="hf_overrides"):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    with pytest.raises(ValueError, match="sequence classifier"):
        llm.classify(DOCUMENTS, use_tqdm=False)
    classifier = LLM(llama_classifier, max_model_len=128)
    with pytest.raises(ValueError, match="same length"):
        classifier.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="must not be empty"):
        classifier.score(QUERY, [], use_tqdm=False)
    with pytest.raises(ValueError, match="string or a list of strings"):
        classifier.score(QUERY, [1, 2], use_tqdm=False)
    with pytest.raises(ValueError, match="classifier_from_token"):
        LLM(tiny_llama_dir, max_model_len=128, hf_overrides={"architectures": ["LlamaForSequenceClassification"],
                                                             "classifier_from_token": ["no", "yes"]})
    with pytest.raises(ValueError, match="not one token"):
        LLM(tiny_llama_dir, max_model_len=128, hf_overrides=RERANKER_OVERRIDES | {
            "architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "certainly"]})


# ---- the server: /score, /v1/score, /rerank, /v1/rerank ---------------------------------------------------

def post(server: Any, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json={"model": "tiny", **body}, timeout=60)


def assert_400(response: httpx.Response, param: str, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"], error


def test_server_reranks_and_scores_as_transformers(qwen3_reranker: str, server_factory: Any) -> None:
    expected = [hf_yes_probability(qwen3_reranker, QUERY, document)[1] for document in DOCUMENTS]
    with server_factory(qwen3_reranker, "--served-model-name", "tiny", "--max-model-len", "512",
                        "--hf-overrides", json.dumps(RERANKER_OVERRIDES)) as server:
        for route in ("/v1/rerank", "/rerank"):
            documents: list[Any] = [DOCUMENTS[0], *({"text": d} for d in DOCUMENTS[1:])]
            response = post(server, route, {"query": QUERY, "documents": documents, "top_n": 3})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["model"] == "tiny" and body["id"] and body["usage"]["total_tokens"] > 0
            order = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i], reverse=True)[:3]
            assert [r["index"] for r in body["results"]] == order
            for result in body["results"]:
                assert abs(result["relevance_score"] - expected[result["index"]]) < TOL
                assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        bare = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
        assert len(bare.json()["results"]) == len(DOCUMENTS) and "document" not in bare.json()["results"][0]
        for route in ("/score", "/v1/score"):
            response = post(server, route, {"text_1": QUERY, "text_2": DOCUMENTS})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
            assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
            assert all(d["object"] == "score" and abs(d["score"] - e) < TOL for d, e in zip(body["data"], expected))
        pairs = post(server, "/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}).json()
        assert [round(d["score"], 5) for d in pairs["data"]] == [round(e, 5) for e in expected[:2]]

        assert_400(post(server, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), "text_1", "same length")
        assert_400(post(server, "/score", {"text_1": QUERY}), "text_2", "text_2")
        assert_400(post(server, "/v1/rerank", {"query": QUERY, "documents": []}), "documents", "not be empty")
        assert_400(post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}), "top_n",
                   "top_n")
        assert_400(post(server, "/v1/rerank", {"documents": DOCUMENTS}), "query", "query")
        assert_400(post(server, "/v1/rerank", {"query": QUERY, "documents": [{"title": "x"}]}), "documents", "")
        too_long = post(server, "/v1/rerank", {"query": QUERY, "documents": ["fox " * 600]})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "documents", too_long.text
        assert post(server, "/v1/rerank", {"model": "other", "query": QUERY, "documents": DOCUMENTS}
                    ).status_code == 404
        # A classifier does not generate (a 400 on every generating route); the server keeps serving after all that.
        for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "stream": True})):
            assert_400(post(server, route, body), "model", "sequence classifier")
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert server.wait_idle()["kvloom:num_requests_running"] == 0


def test_server_refuses_scoring_on_a_model_that_is_no_classifier(tiny_llama_dir: str, server_factory: Any) -> None:
    with server_factory(tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "128") as server:
        for route, body in (("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
                            ("/rerank", {"query": QUERY, "documents": DOCUMENTS}),
                            ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
                            ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})):
            assert_400(post(server, route, body), "model", "hf_overrides")
        assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
