"""Serving: an OpenAI-compatible HTTP server with continuous batching, and a page to chat with and look inside.

- ``options``: the server's settings (``ServeOptions``, the flags of ``tinygpt serve``).
- ``protocol``: request bodies checked into dataclasses; OpenAI-style errors.
- ``engine``: the batching scheduler (its own thread runs the model).
- ``chat_format``: chat messages -> the SFT template's prompt.
- ``inspect``: tokens, next-token probabilities, attention weights and the logit lens for the page.
- ``state``: the one state object behind the handlers (model, engine, requests in flight).
- ``edge``: middleware that refuses before a handler runs (Host, content type, body size and time).
- ``app``: one handler per endpoint and the routes; ``server``: running it with uvicorn (header timeout,
  connection limit, shutdown).
- ``replica_options`` / ``replicas``: the same app in N processes on Ray Serve (``--replicas N``,
  ``--autoscale MIN:MAX``; the ``cluster`` extra), and the deployment for a user's own Ray Serve application.

Needs the ``serve`` extra (``pip install -e '.[serve]'`` in a checkout: starlette + uvicorn); ``tinygpt serve`` is
the command.
"""
