"""The engine's check of a request's adapter before it is queued (no torch: the engine side).

A request's ``LoRARequest`` is refused with a ``ValueError`` when the engine serves no adapters, when its
adapter does not fit the served model (``peft.check_adapter``), when its id already names another adapter,
or when speculative decoding is on (drafts come from the base model or a draft model that knows nothing of
the adapter, so its acceptance would be wasted work; refused per request, base requests still speculate).
"""

from __future__ import annotations

from kvloom.lora.peft import AdapterInfo, ModelShape, check_adapter
from kvloom.lora.request import LoRARequest


class LoRAChecker:
    def __init__(self, enabled: bool, shape: ModelShape, max_lora_rank: int, speculative: bool,
                 served_model_name: str | None = None) -> None:
        self.enabled = enabled
        self.shape = shape
        self.max_lora_rank = max_lora_rank
        self.speculative = speculative
        self.served_model_name = served_model_name
        # Adapter id -> the request that first used it, and its checked adapter.
        self.known: dict[int, tuple[LoRARequest, AdapterInfo]] = {}

    def check(self, lora_request: object) -> AdapterInfo:
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a kvloom.lora.request.LoRARequest or None, got "
                             f"{type(lora_request).__name__}")
        if not self.enabled:
            raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True "
                             "(kvloom serve --enable-lora)")
        if self.speculative:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: speculative decoding does not run with "
                             f"LoRA adapters (the drafts know nothing of the adapter); send the request to an "
                             f"engine without speculative decoding, or without lora_request")
        known = self.known.get(lora_request.lora_int_id)
        if known is not None:
            previous, info = known
            if (previous.lora_name, previous.lora_path) == (lora_request.lora_name, lora_request.lora_path):
                return info
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} already names adapter "
                             f"{previous.lora_name!r} at {previous.lora_path!r}; give each adapter its own id")
        if (lora_request.base_model_name is not None and self.served_model_name is not None
                and lora_request.base_model_name != self.served_model_name):
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is for base model "
                             f"{lora_request.base_model_name!r}, but this engine serves {self.served_model_name!r}")
        info = check_adapter(lora_request.lora_path, self.shape, self.max_lora_rank)
        self.known[lora_request.lora_int_id] = (lora_request, info)
        return info

    def forget(self, lora_int_id: int) -> None:
        """The id is free again (its adapter was unloaded)."""
        self.known.pop(lora_int_id, None)
