"""The settings of ``tinygpt serve`` (torch- and starlette-free, so the CLI can build its flags cheaply).

``tinygpt serve``'s flags are made from these fields (``cli.common.add_options``); ``create_app`` and
``run_server`` take the same dataclass. Where uvicorn has the setting it is passed on (``keep_alive_timeout`` ->
``timeout_keep_alive``, ``max_connections`` -> ``limit_concurrency``, ``shutdown_timeout`` ->
``timeout_graceful_shutdown``, ``max_header_bytes`` -> ``h11_max_incomplete_event_size``); the rest is
``serving.edge`` (body size, content type, Host, body timeout) and ``serving.server`` (header timeout, the
connection limit at accept, file descriptors).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .. import checks
from ..checks import option

API_KEY_ENV = "TINYGPT_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SPECULATIVE = ("off", "lookup", "draft")
# Descriptors kept for everything but client connections (model files, logs) and for an accept burst: asyncio
# accepts up to the listen backlog (``serving.server.ACCEPT_BACKLOG`` = 64) at once, before a connection past the
# limit can be closed, so the limit keeps three bursts' worth free.
FD_RESERVE = 256
DEFAULT_MODEL_NAME = "tinygpt"  # the base's id when ``model_name`` is not given (``tinygpt serve`` always gives it)


def default_max_connections() -> int:
    """What the process's file-descriptor limit allows: the soft ``ulimit -n`` minus ``FD_RESERVE``, at most 4096."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1000
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - FD_RESERVE))


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` or ``localhost``: an address only this machine can reach."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class ServeOptions:
    """Every server setting. Each field's ``metadata`` holds its command-line help."""

    model_name: str | None = option(None, "the model's id in the API", metavar="NAME",
                                    default_help="the model folder's name or the hub name")
    adapter: list[str] | None = option(None, "also serve this LoRA adapter of the model (a folder in PEFT's format, "
                                             "as tinygpt lora saves it) as the model NAME (repeatable): a request's "
                                             "model field picks the base or an adapter, and rows of different "
                                             "adapters decode in one batch", metavar="NAME=DIR", action="append",
                                       default_help="none")
    host: str = option("127.0.0.1", "address to bind; on a loopback address only requests whose Host is a "
                                    "loopback name are served (DNS-rebinding defence)")
    port: int = option(8000, "port to listen on (0: any free port)")
    tool: bool = option(False, "let every answer call the calculator (<<4*12= -> 48>>, as tinygpt grpo trains): "
                               "the server forces the result after each call; a request that constrains its output "
                               "(response_format, grammar, regex, tools) runs without it")
    max_batch: int = option(8, "rows decoded together; requests beyond wait in the queue")
    max_queue: int = option(64, "rows (and /inspect requests) that may wait for the batch; beyond, 429 + "
                                "Retry-After")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every endpoint but / and /health",
                                 metavar="KEY", default_help=f"${API_KEY_ENV} if set, else no key")
    cors_origin: list[str] | None = option(None, "let pages from these origins call the API from a browser "
                                                 "(e.g. http://localhost:3000; * for any)", metavar="ORIGIN",
                                           default_help="none")
    docs_url: str | None = option(None, "where the page's links to the guide (docs/...) lead: this URL + the "
                                        "page's path, e.g. a repository's https://host/owner/tinygpt/blob/main/docs",
                                  metavar="URL", default_help="served read-only from the checkout's docs/ folder")
    max_body_bytes: int = option(2 ** 20, "largest request body; beyond, 413")
    header_timeout: float = option(10.0, "seconds a connection may take to send a request's headers; beyond, "
                                         "408 and closed")
    body_timeout: float = option(30.0, "seconds a request may take to send its body; beyond, 408")
    write_timeout: float = option(30.0, "seconds a client may leave its answer unread (the server's send buffer "
                                        "full); beyond, the connection is closed and the answer dropped")
    max_body_connections: int | None = option(None, "requests sending their bodies at once at most; beyond, 503 "
                                                    "(so slow senders cannot take every connection)",
                                              default_help="half of --max-connections")
    min_body_rate: int = option(1024, "bytes per second a request body must average after its first "
                                      "second; slower, 408", metavar="BYTES")
    template_timeout: float = option(2.0, "seconds the chat template may take to render one request's prompt; "
                                          "beyond, 400")
    keep_alive_timeout: int = option(5, "seconds an idle keep-alive connection stays open (uvicorn's "
                                        "timeout_keep_alive)")
    max_header_bytes: int = option(16384, "largest request head (request line + headers); beyond, 400 (uvicorn's "
                                          "h11_max_incomplete_event_size)")
    max_connections: int | None = option(None, "open connections at most; beyond, 503 and closed",
                                         default_help="ulimit -n minus 256, at most 4096")
    shutdown_timeout: float = option(10.0, "on SIGTERM/SIGINT, seconds the in-flight requests get to finish; then "
                                           "every stream ends with an error event and [DONE]; a second signal "
                                           "exits at once")
    log_level: str = option("info", "uvicorn's log level", choices=LOG_LEVELS)
    # The engine (``inference``): how a step is spent and what the cache keeps.
    token_budget: int | None = option(None, "tokens per forward: every running row's decode first, then chunks of "
                                            "waiting prompts", metavar="N",
                                      default_help="256, or --max-batch if larger")
    cache_tokens: int | None = option(None, "positions the KV cache holds, allocated once", metavar="N",
                                      default_help="--max-batch x the context")
    prefix_cache: bool = option(True, "reuse the cached keys/values of a prompt's prefix (a shared system prompt, "
                                      "the previous turns of a chat)")
    speculative: str = option("off", "speculative decoding, drafts verified in one forward (the same tokens for "
                                     "greedy rows, the same distribution for sampled ones): lookup = drafts copied "
                                     "from the row's own text; draft = drafts from --draft's model (which implies "
                                     "it)", choices=SPECULATIVE)
    speculative_tokens: int = option(4, "draft tokens verified per forward at most, with --speculative lookup or "
                                        "--draft", metavar="K")
    draft: str | None = option(None, "a small model sharing --model's tokenizer that drafts for it (greedy "
                                     "drafts, a small cache per row); implies --speculative draft",
                               metavar="DIR|HUBNAME")
    compile: bool = option(False, "compile the decode step (one row ahead of time, several rows with torch.compile; "
                                  "a C++ compiler on a CPU): seconds at the first decodes, then a cheaper step "
                                  "(docs/performance.md)")

    def __post_init__(self) -> None:
        checks.int_in_range("port", self.port, 0, 65535)
        checks.positive_int("max_batch", self.max_batch)
        checks.non_negative_int("max_queue", self.max_queue)
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key.strip()):
            raise checks.OptionError("api_key", self.api_key, "must not be empty")
        checks.int_in_range("max_body_bytes", self.max_body_bytes, 1024, None)
        checks.positive_number("header_timeout", self.header_timeout)
        checks.positive_number("body_timeout", self.body_timeout)
        checks.positive_number("write_timeout", self.write_timeout)
        checks.non_negative_int("min_body_rate", self.min_body_rate)
        checks.positive_number("template_timeout", self.template_timeout)
        checks.positive_int("keep_alive_timeout", self.keep_alive_timeout)
        checks.int_in_range("max_header_bytes", self.max_header_bytes, 1024, None)
        checks.positive_int("max_connections", self.max_connections, optional=True)
        if self.max_connections is None:
            self.max_connections = default_max_connections()
        checks.positive_int("max_body_connections", self.max_body_connections, optional=True)
        if self.max_body_connections is None:
            self.max_body_connections = max(1, self.max_connections // 2)
        checks.non_negative_number("shutdown_timeout", self.shutdown_timeout)
        checks.choice("log_level", self.log_level, LOG_LEVELS)
        checks.int_in_range("token_budget", self.token_budget, self.max_batch, None, optional=True,
                            note="(--max-batch: every running row decodes at every step)")
        checks.positive_int("cache_tokens", self.cache_tokens, optional=True)
        checks.choice("speculative", self.speculative, SPECULATIVE)
        if self.draft is not None and self.speculative == "off":
            self.speculative = "draft"  # --draft MODEL alone turns drafting on (off is also the default)
        if self.draft is not None and self.speculative != "draft":
            raise checks.OptionError("speculative", self.speculative, "conflicts with --draft MODEL (drafts come "
                                                                        "from the model: --speculative draft)")
        if self.speculative == "draft" and self.draft is None:
            raise checks.OptionError("speculative", self.speculative, "needs --draft MODEL: the model that drafts")
        checks.positive_int("speculative_tokens", self.speculative_tokens)
        _ = self.adapters  # a malformed NAME=DIR fails here, before any model is loaded
        for origin in self.cors_origin or []:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise checks.OptionError("cors_origin", origin, "must be * or an origin like http://host:port")
        if self.docs_url is not None and not self.docs_url.startswith(("http://", "https://")):
            raise checks.OptionError("docs_url", self.docs_url, "must be an http:// or https:// URL")

    @property
    def served_name(self) -> str:
        """The base model's id in the API."""
        return self.model_name or DEFAULT_MODEL_NAME

    @property
    def adapters(self) -> dict[str, str]:
        """``--adapter NAME=DIR`` as {NAME: DIR}, in the order given (the adapters' indices)."""
        out: dict[str, str] = {}
        for value in self.adapter or []:
            name, sep, directory = value.partition("=") if isinstance(value, str) else ("", "", "")
            if not sep or not name.strip() or not directory:
                raise checks.OptionError("adapter", value, "must be NAME=DIR (a name for the API, an adapter "
                                                           "folder)")
            if name != name.strip():
                raise checks.OptionError("adapter", value, "has spaces around its NAME")
            if name == self.served_name:
                raise checks.OptionError("adapter", value, f"names the base model ({self.served_name!r}): give the "
                                                           f"adapter another NAME")
            if name in out:
                raise checks.OptionError("adapter", value, f"repeats the NAME {name!r}: each adapter needs its own")
            out[name] = directory
        return out

    @property
    def loopback_only(self) -> bool:
        """Bound to a loopback address: refuse requests whose Host header names anything else."""
        return is_loopback(self.host)
