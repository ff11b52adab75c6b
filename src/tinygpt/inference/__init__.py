"""The inference engine: one KV cache, batch descriptions, scheduling, speculative decoding."""
