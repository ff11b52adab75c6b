"""Serving: an OpenAI-compatible HTTP server with continuous batching, and a page to chat with and look inside.

- ``protocol``: request bodies checked into dataclasses; OpenAI-style errors.
- ``engine``: the batching scheduler (its own thread runs the model).
- ``chat_format``: chat messages -> the SFT template's prompt.
- ``inspect``: tokens, next-token probabilities, attention weights and the logit lens for the page.
- ``app``: the ASGI app (Starlette) tying them together; ``server``: running it with uvicorn.

Needs the ``serve`` extra (``pip install 'tinygpt[serve]'``: starlette + uvicorn); ``tinygpt serve`` is the command.
"""
