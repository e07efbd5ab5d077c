"""Train an EAGLE-1 head for a Llama target by self-distillation, on the CPU, within a time budget.

    python tools/train_eagle.py                       # SmolLM2-135M-Instruct, ~30 min
    python tools/train_eagle.py --minutes 8 --num-prompts 600 --out /tmp/eagle

Phases, each timed and printed:

1. prompts: the target writes its own prompts: a question or a task instruction about each of FIELDS,
   sampled at temperature 0.8 with a different seed each, so nothing is downloaded;
2. responses: the target answers every prompt greedily (kvloom's ``LLM.chat``): the tokens a drafter
   must learn to guess. The engine's model runner hands every step's hidden states to a recorder
   (``FeatureRecorder``), which keeps each position's feature f_t: the final hidden state *after* the
   final norm, the vector the LM head reads, which is what vLLM hands an EAGLE-1 drafter (its Llama
   returns the normed states, and the drafter's output goes to the LM head with no norm of its own).
   These are the very states the engine hands the head when it drafts;
3. features: only for replies read from a ``--replies`` file that lacks them, one prefill of kvloom's own
   model of the target (the engine's ops and dtype, bfloat16) over each whole sequence;
4. training: at position t the head reads (embed(x_{t+1}), f_t) and learns f_{t+1} (smooth L1) and, through
   the target's LM head, the target's next greedy token x_{t+2} (cross entropy), loss = v + 0.1 p as EAGLE
   weighs them, on response positions (tried on the same replies: cross entropy against the target's
   whole distribution there, as a distillation would, held no more first guesses, 0.39 against 0.40);
   AdamW with a cosine learning rate over the time left. The head guesses among the ``--draft-vocab``
   tokens most frequent in the replies (EAGLE-3's draft vocabulary):
   at batch 1 on the CPU a guess through the target's whole LM head ([49152, 576] for SmolLM2) costs
   several times the head's layer, and the rare tokens it drops are ones a small head seldom guesses;
5. evaluation: greedy chain speculative decoding with k drafts, simulated on held-out prompts: the head
   drafts k tokens feeding its own outputs back, the drafts that match the target's greedy tokens are
   accepted, and the target adds one. Mean acceptance length = tokens per target step (1 + accepted); also
   printed in the engine's units, drafts accepted of drafts proposed (at k = 4 a length of 1.4 is ~10%).
   The runtime drafts what this simulation does (exactly in float32, tests/unit/test_train_eagle.py), so
   ``benchmarks/speculative.py --methods eagle --eagle-model OUT --workload chat`` should show about the
   same length; on text unlike the training replies (its ``copy`` workload, a raw prompt) it is lower.

The head is saved (default ``kvloom.envs.cache_dir() / "eagle" / <model>``, never in the repository) in the
EAGLE-1 layout vLLM's ``llama_eagle.py`` loads, as yuhuili/EAGLE-LLaMA3-Instruct-8B ships it:

``config.json``: the target's Llama config with ``num_hidden_layers: 1``, ``architectures:
["LlamaForCausalLM"]`` (vLLM's EAGLEConfig renames it ``EagleLlamaForCausalLM`` under method "eagle"),
``torch_dtype: "bfloat16"``.

``model.safetensors`` (bfloat16; H hidden_size, I intermediate_size, D head_dim, n attention heads,
m KV heads; SmolLM2-135M: H 576, I 1536, D 64, n 9, m 3)::

    fc.weight                                 [H, 2H]  reads cat(embed(token), feature)
    layers.0.self_attn.q_proj.weight          [n*D, H]
    layers.0.self_attn.k_proj.weight          [m*D, H]
    layers.0.self_attn.v_proj.weight          [m*D, H]
    layers.0.self_attn.o_proj.weight          [H, n*D]
    layers.0.post_attention_layernorm.weight  [H]
    layers.0.mlp.gate_proj.weight             [I, H]
    layers.0.mlp.up_proj.weight               [I, H]
    layers.0.mlp.down_proj.weight             [H, I]

No ``input_layernorm`` (EAGLE-1 skips it), no final norm, and no ``embed_tokens``: the head uses the
target's (vLLM shares it when the checkpoint lacks it). With a draft vocabulary of N tokens (the default),
the head's LM head is saved as EAGLE-3 spells one: ``lm_head.weight`` [N, H] (the target's rows of those
tokens), ``d2t`` [N] int64 (draft id d is target id d + d2t[d]) and ``draft_vocab_size: N`` in config.json;
kvloom's loader reads them for EAGLE-1 too. ``--draft-vocab 0`` saves the plain EAGLE-1 layout above,
which shares the target's whole LM head, for a loader that expects only that. One step at position t::

    x   = fc(cat(embed(x_{t+1}), f_t))
    h   = x + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))   # rotary at t, causal over steps <= t
    out = h + mlp(post_attention_layernorm(h))                      # ~ f_{t+1}
    logits = lm_head(out)                          # guesses x_{t+2} (the draft vocabulary's rows)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvloom import envs
from kvloom.cpu_capability import cpu_capability
from kvloom.layers.rotary import rope_inverse_frequencies
from kvloom.loader import gguf, safetensors
from kvloom.loader.model_config import ModelConfig
from kvloom.loader.weights import DEFAULT_MODEL, ModelSource, iter_weights, load_model_config, resolve_model
from kvloom.models.registry import build_model, process_weights_after_loading
from kvloom.ops.metadata import whole_prefill
from kvloom.ops.table import select_ops

# What the target writes prompts about (phase 1): broad, so the prompts cover chat, facts, code and
# writing. The model writes the prompts themselves; these only steer the topic.
FIELDS = (
    "astronomy", "biology", "chemistry", "physics", "geology", "weather and climate", "the ocean",
    "animals", "plants and gardening", "human health", "nutrition and cooking", "baking", "fitness",
    "sleep", "psychology", "history of ancient Rome", "world history", "geography", "travel",
    "languages and grammar", "poetry", "novels and literature", "writing a story", "music", "painting",
    "photography", "film", "video games", "board games", "sports", "football", "mathematics",
    "algebra", "geometry", "statistics", "personal finance", "economics", "business and marketing",
    "careers and job interviews", "education and studying", "philosophy", "ethics", "law", "politics",
    "religion and mythology", "architecture", "cars", "airplanes", "trains", "space exploration",
    "energy and electricity", "the environment", "recycling", "computers", "the internet",
    "Python programming", "JavaScript", "SQL databases", "algorithms", "machine learning",
    "cybersecurity", "smartphones", "home repair", "parenting", "pets", "friendship", "holidays",
    "fashion", "email writing", "time management", "public speaking", "farming", "inventions",
)
# The target writes two thirds of the prompts from these (the 135M model writes good questions, not
# good task requests; few-shot lists confuse it).
PROMPT_KINDS = (
    "Write one question a curious person might ask about {field}. Reply with only the question.",
    "Write one question a student might ask a teacher about {field}. Reply with only the question.",
)
# The other third: tasks, filled in with a field.
TASK_TEMPLATES = (
    "Explain {field} to a beginner.", "Write a short story that involves {field}.",
    "Give me three tips about {field}.", "Write a short poem about {field}.",
    "What are the most important ideas in {field}?", "Summarize the history of {field} in a paragraph.",
    "List five interesting facts about {field}.", "Write an email to a friend about {field}.",
    "What are common mistakes people make with {field}?", "Describe a day in the life of someone who works "
    "in {field}.", "Compare two different approaches to {field}.", "Write the opening of a blog post about {field}.",
)
EVAL_DRAFT_TOKENS = 4
P_LOSS_WEIGHT = 0.1  # EAGLE's weight of the token loss next to the feature loss
# Guesses come from this many of the replies' most frequent tokens: at batch 1 on the CPU a guess through
# SmolLM2's whole [49152, 576] LM head costs several times the head's layer.
DRAFT_VOCAB_SIZE = 8192


@dataclass
class TrainingSequence:
    token_ids: torch.Tensor  # [n] int64: chat-templated prompt then the greedy response
    prompt_len: int
    features: torch.Tensor | None = None  # [n, H] bfloat16: f_t, the target's final normed hidden states


# ---------------------------------------------------------------------------------------------- the head


class LlamaLayer(nn.Module):
    """A Llama decoder layer in plain torch, HF's names; without input_layernorm it is EAGLE-1's layer."""

    def __init__(self, config: ModelConfig, input_layernorm: bool = True) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        if input_layernorm:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, self.num_heads * d, bias=config.attention_bias)
        self.self_attn.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.self_attn.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.self_attn.o_proj = nn.Linear(self.num_heads * d, h, bias=config.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, config.intermediate_size, bias=config.mlp_bias)
        self.mlp.up_proj = nn.Linear(h, config.intermediate_size, bias=config.mlp_bias)
        self.mlp.down_proj = nn.Linear(config.intermediate_size, h, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x: [B, T, H] -> [B, T, H]. cos, sin: [T, D/2] for the T new positions. cache: [keys, values] of
        earlier steps ([B, m, L, D] each; the list's items are replaced by the longer ones), or None for
        whole sequences (right-padded: padding only follows real tokens, so causality keeps it out)."""
        batch, length, _ = x.shape
        attn = self.self_attn
        normed = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        q = attn.q_proj(normed).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(normed).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(normed).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            past = cache[0].shape[2]
            k = cache[0] = torch.cat([cache[0], k], dim=2)
            v = cache[1] = torch.cat([cache[1], v], dim=2)
            # New step i sees every cached step and the new steps up to itself.
            mask = torch.arange(past + length)[None, :] <= (past + torch.arange(length))[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        h = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        mlp = self.mlp
        normed = self.post_attention_layernorm(h)
        return h + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalized in float32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Rotary(nn.Module):
    """cos and sin of each position's rotary angles: [T] positions -> two [T, D/2] tables."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # [D/2] float32, deliberately not a buffer: ``head.to(torch.bfloat16)`` would round it, and at
        # position 200 a bfloat16 frequency is off by up to ~0.3 rad (SmolLM2), so the evaluated head would rotate
        # differently from the runtime's (whose cos/sin table is built in float32, layers/rotary.py).
        self.inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).float()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class EagleHead(nn.Module):
    """EAGLE-1's drafter: fc + one decoder layer; state_dict() is the checkpoint layout above."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([LlamaLayer(config, input_layernorm=False)])
        self.rotary = Rotary(config)
        self.vocab = None

    @property
    def vocab(self) -> torch.Tensor | None:
        """The draft vocabulary: the target ids the head may guess, ascending ([N] int64), or None for all of
        them. Not a parameter: saved as the rows of the target's LM head it keeps, and d2t."""
        return self._vocab

    @vocab.setter
    def vocab(self, vocab: torch.Tensor | None) -> None:
        self._vocab = vocab
        # target id -> draft id, -100 (cross entropy's ignore index) outside the vocabulary; built once.
        self._draft_ids = None
        if vocab is not None:
            self._draft_ids = torch.full((self.config.vocab_size,), -100, dtype=torch.long)
            self._draft_ids[vocab] = torch.arange(len(vocab))

    def draft_lm_head(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The target's LM head [V, H] cut to the draft vocabulary's rows [N, H]."""
        return lm_head if self.vocab is None else lm_head[self.vocab]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.vocab is None else self.vocab[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids, -100 (cross entropy's ignore index) for ids outside the vocabulary."""
        return target_ids if self._draft_ids is None else self._draft_ids[target_ids]

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        """embeds, features: [B, T, H] (embed(x_{t+1}), f_t); positions: [T] (t) -> [B, T, H] ~ f_{t+1}."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        return self.layers[0](x, cos, sin, cache)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary (vLLM's neox style). x: [B, heads, T, D]; cos, sin: [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def head_config_dict(target_config: dict[str, Any], draft_vocab_size: int | None = None) -> dict[str, Any]:
    """config.json of the head: the target's Llama config with one layer, as EAGLE-1 checkpoints give it,
    and EAGLE-3's ``draft_vocab_size`` when the head guesses from a part of the vocabulary."""
    config = dict(target_config)
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  torch_dtype="bfloat16")
    if draft_vocab_size is not None:
        config["draft_vocab_size"] = draft_vocab_size
    return config


def draft_vocabulary(sequences: Sequence[TrainingSequence], size: int, vocab_size: int) -> torch.Tensor | None:
    """The ``size`` target ids most frequent among the replies' tokens (the tokens a head guesses), ascending;
    None when ``size`` covers the whole vocabulary. Ties go to the lower id."""
    if size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s.token_ids[s.prompt_len:], minlength=vocab_size)[:vocab_size]
    # Stable sort on descending counts keeps ascending ids among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:size]).values


def vocabulary_coverage(sequences: Sequence[TrainingSequence], vocab: torch.Tensor | None) -> float:
    """The share of the replies' tokens inside the draft vocabulary."""
    if vocab is None:
        return 1.0
    tokens = torch.cat([s.token_ids[s.prompt_len:] for s in sequences]) if sequences else torch.zeros(0)
    return float(torch.isin(tokens, vocab).float().mean()) if len(tokens) else 1.0


# ------------------------------------------------------------------------------------------- the target


class Target:
    """kvloom's own model of the target, as the engine builds it (same ops, same dtype), run on whole
    sequences at once to give their features; and the weights the head shares with it."""

    def __init__(self, source: ModelSource, dtype: torch.dtype = torch.bfloat16, block_size: int = 16) -> None:
        self.config = config = load_model_config(source)
        if config.architecture != "LlamaForCausalLM":
            raise ValueError(f"EAGLE training supports LlamaForCausalLM targets, got {config.architecture}")
        self.hf_config = (safetensors.read_config_json(source.path) if source.kind == "hf_dir"
                          else gguf.gguf_config_dict(source.path))
        self.ops = select_ops(torch.device("cpu"), dtype)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = build_model(config, self.ops)
        finally:
            torch.set_default_dtype(previous)
        model.load_weights(iter_weights(source))
        process_weights_after_loading(model, self.ops)
        self.model = model.eval()
        # A tied table may be held only in the LM head's packing (layers/embedding.py share_tied_table): read back
        # once here, for the head's training.
        embed, head = model.embed_tokens, model.lm_head
        with torch.no_grad():
            self._embed = embed.weight.data if embed.weight.numel() else embed(torch.arange(config.vocab_size))
        self._lm_head = head.weight.data if head.weight.numel() else self._embed
        self.dtype = dtype
        self.block_size = block_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._embed  # [V, H]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head  # [V, H]

    @torch.inference_mode()
    def forward(self, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
        """Token ids of whole sequences ([n_i] each) -> their features ([n_i, H] each): the hidden states
        after the final norm, the vector the LM head reads. All sequences go in one prefill step."""
        block_size = self.block_size
        mc = self.config
        metadata, positions, num_blocks = whole_prefill([len(ids) for ids in sequences], block_size,
                                                        mc.sliding_window)
        shape = (num_blocks, block_size, mc.num_key_value_heads, mc.head_dim)
        if not self.kv_caches or self.kv_caches[0][0].shape[0] < num_blocks:
            self.kv_caches = [(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                              for _ in range(mc.num_hidden_layers)]
        hidden = self.model(torch.cat(sequences), positions, self.kv_caches, metadata)
        starts = metadata.query_start_loc
        return [hidden[start:end] for start, end in zip(starts, starts[1:])]

    def features(self, sequences: list[TrainingSequence], max_batch_tokens: int,
                 deadline: float = math.inf) -> list[TrainingSequence]:
        """Fill sequences' features ([n, H] bfloat16) until ``deadline`` (time.monotonic()); returns
        the sequences that have them."""
        done: list[TrainingSequence] = []
        batch: list[TrainingSequence] = []
        # One flat prefill per batch, no padding: sequences go in their order, max_batch_tokens at a time.
        for index, sequence in enumerate(sequences):
            batch.append(sequence)
            batch_tokens = sum(len(s.token_ids) for s in batch)
            last = index == len(sequences) - 1
            if not last and batch_tokens + len(sequences[index + 1].token_ids) <= max_batch_tokens:
                continue
            if done and time.monotonic() > deadline:
                break
            for s, features in zip(batch, self.forward([s.token_ids for s in batch])):
                s.features = features.to(torch.bfloat16).clone()
                done.append(s)
            batch = []
        return done


def _length_batches(sequences: list[TrainingSequence], max_batch_tokens: int,
                    shuffle: random.Random | None = None) -> Iterator[list[TrainingSequence]]:
    """Batches of sequences of similar length, each at most max_batch_tokens when padded."""
    ordered = sorted(sequences, key=lambda s: len(s.token_ids))
    batches: list[list[TrainingSequence]] = []
    batch: list[TrainingSequence] = []
    for sequence in ordered:
        if batch and len(sequence.token_ids) * (len(batch) + 1) > max_batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(sequence)
    if batch:
        batches.append(batch)
    if shuffle is not None:
        shuffle.shuffle(batches)
    yield from batches


# ------------------------------------------------------------------------------------- phases 1 and 2


def _clean_prompt(text: str) -> str | None:
    """The question in a generated reply (quoted, after a colon, or the whole first line), or None."""
    text = text.strip().split("\n")[0].strip()
    quoted = re.search(r'"([^"]{10,})"', text) or re.search(r"'([^']{10,}\?)'", text)
    if quoted:
        text = quoted.group(1)
    elif ":" in text:
        text = text.rpartition(":")[2]
    text = text.strip()
    return text if 10 <= len(text) <= 300 and "?" in text else None


def task_prompts(count: int, seed: int) -> list[str]:
    """Up to ``count`` task prompts from TASK_TEMPLATES x FIELDS, in a seeded order."""
    prompts = [template.format(field=field) for template in TASK_TEMPLATES for field in FIELDS]
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def chat_in_chunks(llm: Any, requests: Iterable[tuple[list[dict[str, str]], Any]], chunk: int,
                   deadline: float = math.inf) -> Iterator[list[Any]]:
    """Phases 1 and 2's time budget: (conversation, SamplingParams) requests sent to ``llm.chat`` ``chunk``
    at a time; yields each chunk's outputs. No chunk after the first starts past ``deadline``
    (time.monotonic()); the caller may stop early by leaving the loop."""
    requests = iter(requests)
    sent = False
    while batch := list(itertools.islice(requests, chunk)):
        if sent and time.monotonic() > deadline:
            return
        yield llm.chat([conversation for conversation, _ in batch], [params for _, params in batch],
                       use_tqdm=False)
        sent = True


def generate_prompts(llm: Any, count: int, seed: int, deadline: float = math.inf) -> list[str]:
    """Up to ``count`` distinct prompts that the target writes itself (temperature 0.8, one seed each), from
    at most 4 * count + 128 requests."""
    from kvloom.sampling_params import SamplingParams

    first = seed * 1_000_003
    # No top-p: sorting the vocabulary for every row triples the step time on the CPU.
    requests = (([{"role": "user", "content": PROMPT_KINDS[i % len(PROMPT_KINDS)].format(
        field=FIELDS[(i // len(PROMPT_KINDS)) % len(FIELDS)])}], SamplingParams(temperature=0.8, max_tokens=40, seed=i))
        for i in range(first, first + 4 * count + 128))
    prompts: list[str] = []
    seen: set[str] = set()
    for outputs in chat_in_chunks(llm, requests, chunk=128, deadline=deadline):
        for output in outputs:
            prompt = _clean_prompt(output.outputs[0].text)
            if prompt is not None and prompt.lower() not in seen:
                seen.add(prompt.lower())
                prompts.append(prompt)
        print(f"  {len(prompts)} prompts written", flush=True)
        if len(prompts) >= count:
            break
    return prompts[:count]


class FeatureRecorder:
    """The engine's final hidden states of every position it computes, kept per request while the target
    answers (the model runner's ``hidden_state_sink``): the features come with the replies, with no second
    pass over them. The engine must not skip positions (no prefix caching)."""

    def __init__(self) -> None:
        # request id -> (first position, hidden states [n, H] bfloat16) of each step that computed some
        self.rows: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def __call__(self, items: Sequence[Any], query_start_loc: Sequence[int], hidden: torch.Tensor) -> None:
        for i, item in enumerate(items):
            # A copy: the hidden states may be a buffer the next step reuses (and a view would keep all of it).
            rows = hidden[query_start_loc[i]:query_start_loc[i + 1]].to(torch.bfloat16, copy=True)
            self.rows.setdefault(item.request_id, []).append((item.num_computed_tokens, rows))

    def features(self, request_id: str, length: int) -> torch.Tensor | None:
        """f_0 .. f_{length-2} of a finished request ([length, H], the last row zero: the final token is never
        run, and training never reads it), or None if some position was not recorded; forgets the request."""
        steps = self.rows.pop(request_id, [])
        if not steps:
            return None
        out = torch.zeros(length, steps[0][1].shape[1], dtype=torch.bfloat16)
        seen = torch.zeros(length, dtype=torch.bool)
        for first, rows in steps:  # in step order: a recomputation (preemption) writes the same rows again
            end = min(first + len(rows), length)
            out[first:end] = rows[:end - first]
            seen[first:end] = True
        return out if bool(seen[:length - 1].all()) else None


def generate_responses(llm: Any, prompts: list[str], max_tokens: int, deadline: float,
                       recorder: FeatureRecorder | None = None) -> list[TrainingSequence]:
    """The target's greedy reply to each prompt, as (chat-templated prompt + reply) token sequences; with
    their features when a ``recorder`` is the engine's hidden-state sink."""
    from kvloom.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    sequences: list[TrainingSequence] = []
    # Chunks of twice the engine's batch: continuous batching keeps it full until a chunk's last replies.
    for outputs in chat_in_chunks(llm, (([{"role": "user", "content": p}], params) for p in prompts), chunk=256,
                                  deadline=deadline):
        for output in outputs:
            prompt_ids = list(output.prompt_token_ids)
            response_ids = list(output.outputs[0].token_ids)
            token_ids = prompt_ids + response_ids
            features = None if recorder is None else recorder.features(output.request_id, len(token_ids))
            if response_ids:
                sequences.append(TrainingSequence(torch.tensor(token_ids, dtype=torch.long), len(prompt_ids),
                                                  features))
        print(f"  {len(sequences)} of {len(prompts)} replies", flush=True)
    return sequences


# ------------------------------------------------------------------------------------------ phase 4


def _training_batch(batch: list[TrainingSequence], embed: torch.Tensor, noise: float, rng: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embeds [B,T,H], features [B,T,H], target features [B,T,H], next tokens [B,T], mask [B,T]) with
    T = longest n - 1: step t reads (x_{t+1}, f_t) and learns f_{t+1} and x_{t+2} where x_{t+2} is a
    response token."""
    length = max(len(s.token_ids) for s in batch) - 1
    hidden = embed.shape[1]
    tokens = torch.zeros(len(batch), length + 1, dtype=torch.long)
    features = torch.zeros(len(batch), length + 1, hidden, dtype=torch.bfloat16)
    mask = torch.zeros(len(batch), length, dtype=torch.bool)
    for row, s in enumerate(batch):
        n = len(s.token_ids)
        tokens[row, :n] = s.token_ids
        features[row, :n] = s.features
        # steps t with prompt_len <= t + 2 <= n - 1
        mask[row, max(s.prompt_len - 2, 0):n - 2] = True
    inputs = features[:, :-1].float()
    if noise:
        # EAGLE's feature noise, uniform in [-noise/2, noise/2]: the head learns to read imperfect
        # features, as its own outputs are when it drafts a chain.
        inputs = inputs + (torch.rand(inputs.shape, generator=rng) - 0.5) * noise
    next_tokens = torch.cat([tokens[:, 2:], torch.zeros(len(batch), 1, dtype=torch.long)], dim=1)
    return embed[tokens[:, 1:]], inputs, features[:, 1:].float(), next_tokens, mask


def head_losses(head: EagleHead, lm_head: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                target_features: torch.Tensor, next_tokens: torch.Tensor, mask: torch.Tensor,
                ce_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(feature loss v, token loss p, top-1 accuracy) on the masked steps; p and the accuracy only on
    ``ce_rows`` of them when given (the LM head's [V, H] product is most of a step's time)."""
    positions = torch.arange(embeds.shape[1])
    out = head(embeds, features, positions)[mask]
    v = F.smooth_l1_loss(out.float(), target_features[mask])
    labels = head.to_draft_ids(next_tokens[mask])
    if ce_rows is not None:
        out, labels = out[ce_rows], labels[ce_rows]
    logits = out @ lm_head.to(out.dtype).T  # lm_head: the draft vocabulary's rows
    # A token outside the draft vocabulary is a guess the head cannot make: no token loss, and a miss.
    p = F.cross_entropy(logits.float(), labels, ignore_index=-100) if (labels >= 0).any() else logits.sum() * 0
    accuracy = (logits.argmax(-1) == labels).float().mean()
    return v, p, accuracy


def train_head(head: EagleHead, target: Target, sequences: list[TrainingSequence], deadline: float, *,
               lr: float, max_batch_tokens: int, max_epochs: int, noise: float, seed: int,
               ce_fraction: float = 1.0, log_every_s: float = 30.0) -> list[float]:
    """AdamW until ``deadline`` (time.monotonic()) or max_epochs; returns the loss of every step."""
    embed = target.embed_weight.detach()
    lm_head = head.draft_lm_head(target.lm_head_weight.detach())
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    # bf16 autocast only where oneDNN computes bf16 products natively (AVX-512 BF16 / AVX-NE-CONVERT): on an
    # AVX2 CPU torch emulates them, and a 4096-token step took ~130 s instead of a few in float32.
    bf16_autocast = cpu_capability().onednn_bf16
    start = time.monotonic()
    span = max(deadline - start, 1e-3)
    rng = random.Random(seed)
    noise_rng = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    last_log = start
    warmup_steps = 20
    for epoch in range(max_epochs):
        for batch in _length_batches(sequences, max_batch_tokens, shuffle=rng):
            now = time.monotonic()
            if now > deadline:
                return losses
            # Cosine over the time budget, after a short linear warm-up.
            progress = min((now - start) / span, 1.0)
            scale = min(1.0, (len(losses) + 1) / warmup_steps) * 0.5 * (1.0 + math.cos(math.pi * progress))
            for group in optimizer.param_groups:
                group["lr"] = lr * max(scale, 0.02)
            tensors = _training_batch(batch, embed, noise, noise_rng)
            if not tensors[4].any():
                continue
            rows = int(tensors[4].sum())
            ce_rows = None
            if ce_fraction < 1.0:
                ce_rows = torch.randperm(rows, generator=noise_rng)[:max(1, round(ce_fraction * rows))]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
                v, p, accuracy = head_losses(head, lm_head, *tensors, ce_rows=ce_rows)
            loss = v + P_LOSS_WEIGHT * p
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimizer.step()
            losses.append(loss.item())
            if time.monotonic() - last_log > log_every_s:
                last_log = time.monotonic()
                print(f"  epoch {epoch} step {len(losses)}: loss {loss.item():.4f} (v {v.item():.4f}, "
                      f"p {p.item():.3f}, top-1 {accuracy.item():.3f}), {last_log - start:.0f} s", flush=True)
    return losses


# ------------------------------------------------------------------------------------------ phase 5


@dataclass
class Simulation:
    """What greedy chain speculation with k drafts would do on some sequences (``simulate_speculation``)."""

    mean_acceptance_length: float  # tokens per target step: 1 + the drafts it accepted
    acceptance_by_position: list[float]  # draft i accepted / draft i reached (i.e. drafts 1..i-1 accepted)
    # The engine's units (its scheduler stats, benchmarks/speculative.py): drafts proposed, min(k, tokens
    # left) per step, and of them accepted. At k = 4 a mean length of 1.4 is only ~10% of drafts accepted.
    num_draft_tokens: int
    num_accepted_tokens: int
    # Per sequence, per target step: (tokens known when drafting, the drafts up to the first wrong one).
    # The runtime's proposer must make the same drafts after the same prefix (tests/unit/test_train_eagle.py).
    drafts: list[list[tuple[int, list[int]]]]


@torch.inference_mode()
def simulate_speculation(head: EagleHead, target: Target, sequences: list[TrainingSequence],
                         k: int = EVAL_DRAFT_TOKENS) -> Simulation:
    """Greedy chain speculation with k drafts, simulated on ``sequences`` (prompt + the target's greedy
    reply, with features).

    After the prompt the target has given x_P. Each step: the head, holding steps t <= p (x_{t+1}, f_t)
    in its KV cache, drafts d_1..d_k, step i reading (d_{i-1}, its own previous output); the drafts that
    equal x_{p+1}, x_{p+2}, ... are accepted and the target adds its own next token, so a step yields
    accepted + 1 tokens. The accepted steps then enter the cache with the target's true features.
    """
    dtype = head.fc.weight.dtype
    embed = target.embed_weight.to(dtype)
    lm_head = head.draft_lm_head(target.lm_head_weight).to(dtype)
    tokens_made = 0
    target_steps = 0
    proposed = 0
    accepted_at = [0] * k
    drafted_at = [0] * k
    records: list[list[tuple[int, list[int]]]] = []
    for sequence in sequences:
        ids, features, n = sequence.token_ids, sequence.features.to(dtype), len(sequence.token_ids)
        p = sequence.prompt_len - 1  # the newest token the target has produced is x_{p+1}
        cache: list[torch.Tensor] = [torch.zeros(1, head.layers[0].num_kv_heads, 0, head.config.head_dim,
                                                 dtype=dtype) for _ in range(2)]
        done = 0  # steps 0..done-1 are in the cache
        records.append([])
        while p + 1 < n - 1:
            # The true steps done..p enter the cache; the last one's output starts the chain.
            steps = torch.arange(done, p + 1)
            out = head(embed[ids[steps + 1]][None], features[steps][None], steps, cache)[:, -1:]
            done = p + 1
            remaining = n - 1 - (p + 1)  # reference tokens x_{p+2}..x_{n-1}
            draft_cache = list(cache)  # the drafts' keys and values go here, then are dropped
            accepted = 0
            drafts: list[int] = []
            for i in range(min(k, remaining)):
                token = int(head.to_target_ids((out[0, -1] @ lm_head.T).argmax()))
                drafts.append(token)
                drafted_at[i] += 1
                if token != int(ids[p + 2 + i]):
                    break
                accepted += 1
                accepted_at[i] += 1
                if i + 1 < min(k, remaining):
                    out = head(embed[token][None, None], out, torch.tensor([p + 1 + i]), draft_cache)
            records[-1].append((p + 2, drafts))
            proposed += min(k, remaining)
            made = min(accepted + 1, remaining)
            tokens_made += made
            target_steps += 1
            p += made
    return Simulation(tokens_made / max(target_steps, 1), [a / max(d, 1) for a, d in zip(accepted_at, drafted_at)],
                      proposed, sum(accepted_at), records)


# ------------------------------------------------------------------------------------------- driver


def default_out_dir(model_name: str) -> Path:
    return envs.cache_dir() / "eagle" / model_name


def save_head(head: EagleHead, target: Target, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in head.state_dict().items()}
    draft_vocab_size = None
    if head.vocab is not None:
        # EAGLE-3's spelling of a draft vocabulary: its own LM head (the target's rows), and d2t, draft id d
        # -> target id d + d2t[d].
        draft_vocab_size = len(head.vocab)
        state["lm_head.weight"] = head.draft_lm_head(target.lm_head_weight).detach().to(torch.bfloat16).contiguous()
        state["d2t"] = (head.vocab - torch.arange(draft_vocab_size)).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(head_config_dict(target.hf_config, draft_vocab_size), f, indent=2)
        f.write("\n")


def load_head(path: Path, target_config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> EagleHead:
    """A saved head; its LM head rows are the target's (save_head writes them from it), so only d2t is read."""
    from safetensors.torch import load_file

    head = EagleHead(target_config).to(dtype)
    state = load_file(str(path / "model.safetensors"))
    state.pop("lm_head.weight", None)
    d2t = state.pop("d2t", None)
    head.load_state_dict(state)
    if d2t is not None:
        head.vocab = d2t + torch.arange(len(d2t))
    return head


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/train_eagle.py",
        description="Train an EAGLE-1 head for a Llama model on its own generations (CPU, time-budgeted) "
                    "and print its mean acceptance length.")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="target: the default model, a HF directory or "
                        "a .gguf file (default %(default)s)")
    parser.add_argument("--out", default=None, help="where to save config.json and model.safetensors "
                        "(default: KVLOOM_CACHE_DIR/eagle/<model>, i.e. ~/.cache/kvloom/eagle/<model>)")
    parser.add_argument("--minutes", type=float, default=30.0, help="time budget of all phases together "
                        "(default %(default)s); training takes what generation leaves")
    parser.add_argument("--num-prompts", type=int, default=4000, help="training prompts the target writes "
                        "(default %(default)s)")
    parser.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the acceptance "
                        "length (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=192, help="longest greedy reply (default %(default)s)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=EVAL_DRAFT_TOKENS,
                        help="drafts per step in the evaluation (default %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per training batch "
                        "(default %(default)s)")
    parser.add_argument("--max-epochs", type=int, default=40, help="stop before the budget after this many "
                        "epochs (default %(default)s)")
    parser.add_argument("--noise", type=float, default=0.2, help="width of the uniform noise added to input "
                        "features while training, EAGLE's 0.2 (default %(default)s)")
    parser.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB_SIZE, help="the head guesses among the "
                        "replies' most frequent tokens, this many (EAGLE-3's draft_vocab_size): each guess then "
                        "costs a [N, H] product, not the target's whole LM head; 0 or at least the vocabulary: "
                        "all of it (default %(default)s)")
    parser.add_argument("--ce-fraction", type=float, default=1.0, help="share of each batch's steps whose "
                        "token loss is computed, to save the LM head's product with --draft-vocab 0 (default "
                        "%(default)s)")
    parser.add_argument("--max-model-len", type=int, default=512, help="the generating engine's max_model_len")
    parser.add_argument("--replies", default=None, help="a file of the replies (token ids and features): "
                        "read when it exists, skipping phases 1 and 2, and written after the features")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: KVLOOM_NUM_THREADS, "
                        "else every core)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _split(sequences: Sequence[TrainingSequence], eval_count: int, seed: int
           ) -> tuple[list[TrainingSequence], list[TrainingSequence]]:
    """(training, held-out): held-out gets eval_count sequences, at most a fifth."""
    shuffled = list(sequences)
    random.Random(seed).shuffle(shuffled)
    eval_count = min(eval_count, max(len(shuffled) // 5, 1))
    return shuffled[eval_count:], shuffled[:eval_count]


def generate_data(args: argparse.Namespace, threads: int, start: float, budget: float,
                  phase: Any) -> list[TrainingSequence]:
    """Phases 1 and 2 with kvloom's engine: prompts the target writes, then its greedy replies."""
    from kvloom.llm import LLM

    began = time.monotonic()
    # No prefix caching: the recorder needs every position's hidden state.
    llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_seqs=128, enable_prefix_caching=False,
              override_backend_config={"num_threads": threads})
    # Writing prompts may take 12% of the budget and answering them (with their features) until 60%;
    # training gets the rest. On 2 cores the default run writes ~2,800 prompts and has answered them all
    # by ~41%, so training gets ~half the budget: a run given more prompts (18%, then answering to 56%:
    # 3,460 replies, 23% more tokens) trained 750 steps instead of 1,087 and guessed worse on fresh
    # questions (mean acceptance length 1.72 against 1.76 on benchmarks/speculative.py's chat questions).
    total = args.num_prompts + args.eval_prompts
    tasks = task_prompts(total // 3, args.seed)
    prompts = generate_prompts(llm, total - len(tasks), args.seed, deadline=start + 0.12 * budget)
    prompts += tasks
    random.Random(args.seed).shuffle(prompts)
    print(f"{len(prompts)} prompts, e.g. {prompts[:3]}", flush=True)
    phase("prompts", began)
    began = time.monotonic()
    recorder = FeatureRecorder()
    llm.llm_engine.executor.driver.hidden_state_sink = recorder
    sequences = generate_responses(llm, prompts, args.max_tokens, deadline=start + 0.6 * budget,
                                   recorder=recorder)
    llm.llm_engine.executor.driver.hidden_state_sink = None
    phase("responses", began)
    return sequences


def save_replies(sequences: list[TrainingSequence], path: Path) -> None:
    """Token ids, prompt lengths and (where computed) features, for a later run's --replies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([(s.token_ids.to(torch.int32), s.prompt_len, s.features) for s in sequences], path)


def load_replies(path: Path) -> list[TrainingSequence]:
    return [TrainingSequence(ids.long(), prompt_len, features) for ids, prompt_len, features in torch.load(path)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "eval_prompts", "max_tokens", "num_speculative_tokens", "batch_tokens",
                 "max_epochs", "max_model_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.draft_vocab < 0:
        raise ValueError(f"--draft-vocab must be 0 (the whole vocabulary) or positive, got {args.draft_vocab}")
    if not 0.0 < args.ce_fraction <= 1.0:
        raise ValueError(f"--ce-fraction must be in (0, 1], got {args.ce_fraction}")
    if args.minutes <= 0:
        raise ValueError(f"--minutes must be positive, got {args.minutes}")
    start = time.monotonic()
    budget = args.minutes * 60.0
    threads = args.threads or envs.get_int("KVLOOM_NUM_THREADS") or os.cpu_count() or 1
    torch.manual_seed(args.seed)
    source = resolve_model(args.model)
    out = Path(args.out).expanduser() if args.out else default_out_dir(source.name)
    timings: dict[str, float] = {}

    def phase(name: str, began: float) -> None:
        timings[name] = time.monotonic() - began
        print(f"[{name}] {timings[name]:.1f} s (total {time.monotonic() - start:.1f} s)", flush=True)

    replies_path = Path(args.replies).expanduser() if args.replies else None
    if replies_path is not None and replies_path.exists():
        began = time.monotonic()
        sequences = load_replies(replies_path)
        print(f"{len(sequences)} replies from {replies_path}", flush=True)
        phase("responses", began)
    else:
        sequences = generate_data(args, threads, start, budget, phase)
    num_tokens = sum(len(s.token_ids) for s in sequences)
    num_response = sum(len(s.token_ids) - s.prompt_len for s in sequences)
    print(f"{len(sequences)} replies: {num_tokens} tokens, {num_response} of them generated", flush=True)

    began = time.monotonic()
    torch.set_num_threads(threads)
    target = Target(source)
    # Replies read from a --replies file without features get them from one prefill pass, which may take
    # 30% of the time left; sequences left without them are dropped.
    now = time.monotonic()
    target.features([s for s in sequences if s.features is None], max_batch_tokens=4096,
                    deadline=now + 0.3 * max(start + budget - now, 0.0))
    if replies_path is not None:
        save_replies(sequences, replies_path)
    sequences = [s for s in sequences if s.features is not None]
    print(f"features of {len(sequences)} sequences ({sum(len(s.token_ids) for s in sequences)} tokens)",
          flush=True)
    phase("features", began)

    train, held_out = _split(sequences, args.eval_prompts, args.seed)
    head = EagleHead(target.config)
    head.vocab = draft_vocabulary(train, args.draft_vocab or target.config.vocab_size, target.config.vocab_size)
    if head.vocab is not None:
        print(f"draft vocabulary: the {len(head.vocab)} most frequent reply tokens, covering "
              f"{vocabulary_coverage(train, head.vocab):.1%} of the training replies' tokens and "
              f"{vocabulary_coverage(held_out, head.vocab):.1%} of the held-out ones", flush=True)
    began = time.monotonic()
    eval_reserve = min(0.08 * budget, 150.0)
    losses = train_head(head, target, train, start + budget - eval_reserve, lr=args.lr,
                        max_batch_tokens=args.batch_tokens, max_epochs=args.max_epochs, noise=args.noise,
                        seed=args.seed, ce_fraction=args.ce_fraction)
    if losses:
        window = max(len(losses) // 10, 1)
        print(f"{len(losses)} steps; loss {sum(losses[:window]) / window:.4f} (first tenth) -> "
              f"{sum(losses[-window:]) / window:.4f} (last tenth)")
    phase("training", began)

    began = time.monotonic()
    save_head(head, target, out)
    # Simulated in bf16 only where the CPU multiplies bf16 natively (float32 elsewhere: same drafts to rounding).
    saved = load_head(out, target.config, torch.bfloat16 if cpu_capability().onednn_bf16 else torch.float32)
    simulation = simulate_speculation(saved, target, held_out, args.num_speculative_tokens)
    phase("evaluation", began)
    rates = ", ".join(f"{rate:.2f}" for rate in simulation.acceptance_by_position)
    print(f"saved to {out}")
    print(f"mean acceptance length {simulation.mean_acceptance_length:.3f} (k={args.num_speculative_tokens}, "
          f"greedy, {len(held_out)} held-out chat prompts): {simulation.num_accepted_tokens} of "
          f"{simulation.num_draft_tokens} drafts accepted; acceptance rate by draft position: {rates}")
    return {"out": str(out), "mean_acceptance_length": simulation.mean_acceptance_length,
            "acceptance_by_position": simulation.acceptance_by_position,
            "num_draft_tokens": simulation.num_draft_tokens, "num_accepted_tokens": simulation.num_accepted_tokens,
            "losses": losses, "timings": timings, "num_sequences": len(sequences)}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
