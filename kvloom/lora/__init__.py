"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch (docs/lora.md).

``request.py`` ``LoRARequest`` (which adapter a request runs with), ``peft.py`` the adapter's on-disk format
read and checked without torch (the engine refuses a bad adapter before queueing), ``weights.py`` its tensors
as the model's fused projections hold them, ``model_manager.py`` the runner's compute slots and host cache and
the per-layer delta (kvloom/ops/lora.py). Only ``LoRARequest`` is loaded here: this package is imported by
the torch-free engine side.
"""

from kvloom.lora.request import LoRARequest

__all__ = ["LoRARequest"]
