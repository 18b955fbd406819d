"""Layerwise load and reload machinery, named as in vLLM's model_loader/reload package."""

from layerwise.reload.session import (
    finalize_layerwise_reload,
    get_layerwise_info,
    initialize_layerwise_reload,
    online_process_loader,
    record_metadata_for_reloading,
)
from layerwise.reload.types import LayerReloadingInfo

__all__ = [
    "LayerReloadingInfo", "finalize_layerwise_reload", "get_layerwise_info", "initialize_layerwise_reload",
    "online_process_loader", "record_metadata_for_reloading",
]
