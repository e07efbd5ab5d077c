"""EAGLE speculation: a small head that reads the target's hidden states guesses the next k tokens.

The same schedule as the draft model's (draft_model.py: the head's KV cache lives in the target's blocks,
its first pass covers every token the target kept, then each guess is fed back), but the head at position
p reads (the target's hidden state at p, the token at p + 1) and guesses the token at p + 2, so its first
pass is the step's kept tokens shifted by one:

    target step   positions s .. s + n_valid - 1 kept, new token t sampled at position s + n_valid
    head pass 1   position p in s .. s + n_valid - 1: (h_p, x_{p+1}), the last one (h, t) -> guess 1
    head step j   (its own hidden state from step j - 1, guess j - 1) at the next position -> guess j

EAGLE-1 reads the target's final hidden states; EAGLE-3 the residual stream entering three of its layers,
fused by the head's ``fc``. A chain of guesses, no tree. The head's KV at a position depends on the token
after it, so the prefix cache names a block by its tokens and the next one
(``KVCacheManager.name_with_next_token``): a hit block's head KV, its last position included, was computed
with this request's tokens. (Naming by the block's tokens alone, and serving a hit one block short, was not
enough: a block filled by a request that diverged right after it could sit inside a later hit.)
"""

from __future__ import annotations

import torch
from torch import nn

from kvloom.config import SpeculativeConfig
from kvloom.loader.model_config import ModelConfig
from kvloom.models.eagle import load_eagle_head
from kvloom.models.registry import process_weights_after_loading
from kvloom.platform import default_dtype
from kvloom.spec_decode.draft_model import DraftModelProposer, DraftRequest, StepInputs


class EagleProposer(DraftModelProposer):
    """``speculative_config`` methods ``eagle`` (EAGLE-1) and ``eagle3``."""

    reads_hidden_states = True

    def _load(self, speculative: SpeculativeConfig, target_config: ModelConfig, target: nn.Module
              ) -> tuple[ModelConfig, nn.Module]:
        with default_dtype(self.dtype), torch.device(self.device):
            head = load_eagle_head(speculative.model, speculative.method, target_config, target, self.ops)
            if speculative.quantization == "int8":
                head.quantize(target)
        process_weights_after_loading(head, self.ops)
        self.aux_hidden_state_layers = head.config.aux_hidden_state_layers
        return head.config.model, head

    def first_pass(self, request: DraftRequest) -> tuple[list[int], list[int]]:
        return request.token_ids[1:request.num_valid + 1], request.hidden_rows[:request.num_valid]

    def forward(self, inputs: StepInputs, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(inputs.input_ids, inputs.positions, hidden, self.kv_caches, inputs.metadata)

    def next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.next_tokens(hidden)

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.combine_hidden_states(hidden)
