"""The caches moved to ``tinygpt.inference.kv_cache`` (they attend, so they live with the engine); this name is kept
for imports written before."""

from .inference.kv_cache import KVCache, LayerCache, PagedKVCache, PagedLayerCache

__all__ = ["KVCache", "LayerCache", "PagedKVCache", "PagedLayerCache"]
