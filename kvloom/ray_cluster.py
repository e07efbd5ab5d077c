"""Ray, where kvloom uses it: the optional import and joining (or starting) a cluster.

Ray is an optional dependency (``pip install kvloom[ray]``). ``connect`` joins the cluster this
machine belongs to (``RAY_ADDRESS``, or the one ``ray start`` left on this machine: Ray's
``address="auto"``); with none running it starts a local one, as vLLM does. No torch here.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from types import ModuleType

logger = logging.getLogger("kvloom")

INSTALL_HINT = "install it with: pip install 'kvloom[ray]'"

_lock = threading.Lock()


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def require_ray(what: str) -> ModuleType:
    """The ray module; ValueError naming ``what`` needed it when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"{what} needs Ray, which is not installed; {INSTALL_HINT}") from None
    return ray


def connect(what: str) -> ModuleType:
    """Ray, initialized in this process: the running cluster if there is one, else a local one."""
    ray = require_ray(what)
    with _lock:
        if ray.is_initialized():
            return ray
        try:
            ray.init(address="auto", logging_level=logging.WARNING)
            logger.info("joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)
        except ConnectionError:
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
            logger.info("no Ray cluster was running: started a local one")
    return ray


def node_ip_address() -> str:
    """This node's address as Ray sees it (where the other nodes reach this process)."""
    import ray

    return ray.util.get_node_ip_address()
