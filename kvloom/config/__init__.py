"""The one engine configuration.

``EngineConfig`` (``engine.py``) is a dataclass that validates itself; its knobs are grouped by concern
(model, cache, scheduler, parallel, speculative, backend). ``LLM(**kwargs)``, the CLI flags of
``kvloom serve`` / ``kvloom generate`` (``args.py``) and the server all come from its fields, so a knob is
declared once. Backend knobs (the attention backend, CPU threads, buckets) live in ``BackendConfig``
(``backend.py``), set through ``override_backend_config``; speculative decoding in ``SpeculativeConfig``
(``speculative.py``). Other spellings (the seeds', vLLM arguments kvloom takes only at some values) are
mapped in ``compat.py``; ``resolved.py`` settles the config against the model and the machine.
Importing this package loads no torch.
"""

from kvloom.config.args import add_engine_args, config_from_args
from kvloom.config.backend import BackendConfig, parse_overrides
from kvloom.config.compat import QUANTIZATION_ALIASES
from kvloom.config.engine import DEFAULT_MODEL, EXECUTOR_BACKENDS, GROUPS, EngineConfig
from kvloom.config.parsing import parse_memory
from kvloom.config.resolved import ResolvedConfig, resolve_config
from kvloom.config.speculative import SpeculativeConfig

__all__ = ["BackendConfig", "DEFAULT_MODEL", "EXECUTOR_BACKENDS", "EngineConfig", "GROUPS", "QUANTIZATION_ALIASES",
           "ResolvedConfig", "SpeculativeConfig", "add_engine_args", "config_from_args", "parse_memory",
           "parse_overrides", "resolve_config"]
