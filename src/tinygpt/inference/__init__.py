"""The inference core: one cache allocated once, one batch description, a scheduler with a token budget.

``blocks`` (the cache's accounting: fixed-size blocks, per-row block tables, prefix hashes, reference counts, LRU),
``batch`` (what one forward computes: the description the model's attention reads), ``row`` (one request's state),
``scheduler`` (the whole policy: who runs this step and with how many tokens), ``runner`` (the model on a scheduled
batch, then each row's own sampling), ``engine`` (the loop that ties them). ``tinygpt.generate``, the server's
``serving.engine`` and the lm-eval class all run on ``engine.InferenceEngine``.

This package's ``__init__`` imports nothing: ``batch`` is imported by ``layers`` (it holds tensors and ints only),
and the rest sit above ``model``.
"""
