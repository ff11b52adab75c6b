"""Replicas of ``tinygpt serve`` on Ray Serve: the same app and engine in N processes behind Ray's HTTP proxy.

Ray Serve runs an ASGI app through ``@serve.ingress`` (one copy per replica, its lifespan run by the replica, so the
engine thread starts and stops with it). ``TinyGPTReplica`` loads the model in the replica's own process and hands
Ray ``create_app``'s Starlette app from ``__serve_build_asgi_app__`` (``serve.ingress()`` with no app: the app is
built at replica start, after the constructor). Ray's proxy routes each request to a replica (power of two choices
over the requests each holds), restarts a replica whose process died or whose ``check_health`` fails, and with
``--autoscale MIN:MAX`` scales on the requests in flight per replica (``AutoscalingConfig.target_ongoing_requests``
= ``--max-batch``: the rows one engine decodes together).

What replicas do not do: split one model over processes (no tensor or pipeline parallelism: a GPT-2-sized model fits
one process; each replica holds a whole copy). Each replica has its own KV cache and prefix cache; requests are not
routed to the replica holding their prefix.

Needs the ``cluster`` extra (``ray[serve]``). ``replica_deployment`` is the deployment for a user's own Ray Serve
application; ``serve_replicas`` is ``tinygpt serve --replicas N``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from dataclasses import asdict
from typing import Any, Callable

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, HTTPOptions

from .options import ServeOptions
from .replica_options import RAY_ADDRESS_ENV, ReplicaOptions
from .server import _listen

APP_NAME = "tinygpt"
REPLICA_HEADER = "x-tinygpt-replica"  # which replica answered: "PID@HOST"
# Ray Serve reads this in its proxy process at start: an import path to a function returning proxy middlewares.
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "tinygpt.serving.replicas.proxy_middlewares"
HEALTH_CHECK_PERIOD_S = 2.0  # how soon a replica whose engine thread died is replaced
HEALTH_CHECK_TIMEOUT_S = 10.0


@serve.ingress()
class TinyGPTReplica:
    """One replica: the model loaded in this process, ``create_app`` over it (``tinygpt serve``'s app, unchanged).

    ``model``: what ``--model`` takes (a checkpoint folder, a Hugging Face folder, a hub name); every replica loads
    it itself, so a folder must be readable at the same path on every node. ``options``: ``ServeOptions``' fields."""

    def __init__(self, model: str, options: dict[str, Any], *, tokenizer_dir: str | None = None,
                 device: str | None = None, dtype: str = "auto", weights: str = "float32",
                 torch_threads: int = 1) -> None:
        import torch

        from ..devices import resolve_device
        from ..interop.pretrained import load_pretrained
        from .app import create_app

        torch.set_num_threads(torch_threads)  # a replica per core: threads beyond that fight the other replicas
        # --weights: the linears in float32, bf16 or int8 (fast.weights; a GGUF file's read straight into them)
        loaded, tokenizer = load_pretrained(model, tokenizer_dir=tokenizer_dir, device=resolve_device(device),
                                            weights=weights)
        if tokenizer is None:
            raise ValueError(f"{model} has no tokenizer: pass tokenizer_dir (--tokenizer-dir)")
        self._app = create_app(loaded, tokenizer, ServeOptions(**options), dtype=dtype)
        self._app.add_middleware(_ReplicaHeader, value=f"{os.getpid()}@{socket.gethostname()}")

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    def check_health(self) -> None:
        """Ray calls this every ``HEALTH_CHECK_PERIOD_S``; raising makes Ray replace the replica. The engine thread
        is the replica's whole work: once its lifespan started it, it must be alive."""
        engine = self._app.state.tinygpt.engine
        if engine is not None and not engine._thread.is_alive():
            raise RuntimeError("the engine thread stopped")


class _ReplicaHeader:
    """Names the replica that answered in ``REPLICA_HEADER`` (which one served a request, for logs and tests)."""

    def __init__(self, app: Any, value: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), value.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


def _lost_replica_error() -> bytes:
    """OpenAI's error object for a request whose replica died under it (the client may retry: another replica, or
    this one restarted, takes it)."""
    return json.dumps({"error": {"message": "the replica serving this request stopped (its process died) before "
                                            "the answer was complete; retry", "type": "server_error",
                                 "param": None, "code": "replica_lost"}}).encode()


class EndLostResponses:
    """Ray's proxy ends a response whose replica died by closing the connection: a started event stream stops
    mid-body (the client sees an incomplete chunked read), an unstarted answer gets uvicorn's plain-text 500. In the
    proxy, this ends the first with the error event and ``[DONE]`` that ``tinygpt serve`` sends when a row fails,
    and answers the second with a JSON 503 + Retry-After."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = stream = ended = False

        async def watched(message: dict[str, Any]) -> None:
            nonlocal started, stream, ended
            if message["type"] == "http.response.start":
                started = True
                stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        await self.app(scope, receive, watched)
        if not started:
            body = _lost_replica_error()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        elif stream and not ended:
            body = b"data: " + _lost_replica_error() + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list[Any]:
    """What Ray's proxy adds around its app (named by ``PROXY_CALLBACK_ENV``; set for the clusters this module
    starts, to set in ``ray start``'s environment for others)."""
    from starlette.middleware import Middleware

    return [Middleware(EndLostResponses)]


def deployment_options(options: ServeOptions, replicas: ReplicaOptions, device: str | None = None
                       ) -> dict[str, Any]:
    """``serve.deployment`` settings for these flags: the count or the autoscaling range, one request per queue
    place (Ray's default of 5 in flight per replica would cap the engine's batch), the shutdown timeout, and the
    resources of a replica: ``replica_threads`` CPUs, and a GPU when ``device`` is CUDA (Ray hides the GPUs from an
    actor that asked for none)."""
    settings: dict[str, Any] = {
        "name": APP_NAME,
        # Past max_batch + max_queue the engine answers 429 itself; Ray holds back only what could never be admitted.
        "max_ongoing_requests": options.max_batch + options.max_queue,
        "graceful_shutdown_timeout_s": options.shutdown_timeout,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "ray_actor_options": {"num_cpus": replicas.replica_threads, "num_gpus": 1 if _wants_gpu(device) else 0},
    }
    bounds = replicas.bounds
    if bounds is None:
        settings["num_replicas"] = replicas.replicas or 1
    else:
        settings["autoscaling_config"] = AutoscalingConfig(
            min_replicas=bounds[0], initial_replicas=max(1, bounds[0]), max_replicas=bounds[1],
            target_ongoing_requests=options.max_batch, upscale_delay_s=5.0, downscale_delay_s=60.0)
    return settings


def _wants_gpu(device: str | None) -> bool:
    if device in (None, "auto"):  # as resolve_device decides it, on the machine that starts the deployment
        import torch

        return torch.cuda.is_available()
    return str(device).startswith("cuda")


def replica_deployment(model: str, options: ServeOptions | None = None, replicas: ReplicaOptions | None = None, *,
                       tokenizer_dir: str | None = None, device: str | None = None, dtype: str = "auto",
                       weights: str = "float32") -> serve.Application:
    """The bound deployment (a Ray Serve ``Application``) for ``serve.run(app, route_prefix=...)`` or a user's own
    composition: ``TinyGPTReplica`` with ``deployment_options``. ``model`` is read by each replica (see
    ``TinyGPTReplica``)."""
    options = options if options is not None else ServeOptions()
    replicas = replicas if replicas is not None else ReplicaOptions(replicas=1)
    deployment = serve.deployment(TinyGPTReplica, **deployment_options(options, replicas, device))
    fields = {k: v for k, v in asdict(options).items()}
    return deployment.bind(model, fields, tokenizer_dir=tokenizer_dir, device=device, dtype=dtype, weights=weights,
                           torch_threads=replicas.replica_threads)


def build_app(args: dict[str, Any]) -> serve.Application:
    """An application builder for Ray Serve's config files (``import_path: tinygpt.serving.replicas:build_app``, as
    a KubeRay ``RayService``'s ``serveConfigV2`` names it) and ``serve run tinygpt.serving.replicas:build_app
    model=gpt2``: ``args`` holds ``model`` and any of ``tokenizer_dir``, ``device``, ``dtype``, ``weights``,
    ``replicas``, ``autoscale`` (``"MIN:MAX"``), ``replica_threads`` and ``ServeOptions``' fields, as the flags'
    values."""
    args = dict(args)
    if "model" not in args:
        raise ValueError("build_app needs args.model: a checkpoint folder, a Hugging Face folder or a hub name")
    model = str(args.pop("model"))
    loading = {key: args.pop(key) for key in ("tokenizer_dir", "device", "dtype", "weights") if key in args}
    replica_fields = {key: args.pop(key) for key in ("replicas", "autoscale", "replica_threads") if key in args}
    if "replicas" in replica_fields:
        replica_fields["replicas"] = int(replica_fields["replicas"])
    if "replica_threads" in replica_fields:
        replica_fields["replica_threads"] = int(replica_fields["replica_threads"])
    replicas = ReplicaOptions(**replica_fields)
    return replica_deployment(model, ServeOptions(**args), replicas if replicas.enabled else None, **loading)


def local_source(model: str) -> str:
    """``model`` as a path every replica on this machine can read: a local folder or file as it is, a hub name
    fetched once here (``interop.hf.resolve_hf_source``; a ``ValueError`` for neither, before Ray starts)."""
    from pathlib import Path

    if Path(model).exists():
        return model
    from ..interop.hf import resolve_hf_source

    return str(resolve_hf_source(model))


def _check_fits_here(replicas: ReplicaOptions, device: str | None) -> None:
    """On a local cluster, the replicas started at once must fit this machine's CPUs (and GPUs): Ray would leave
    the rest pending, and ``serve.run`` would wait for them forever."""
    count = replicas.replicas if replicas.bounds is None else max(1, replicas.bounds[0])
    cores = os.cpu_count() or 1
    if count * replicas.replica_threads > cores:
        need = count * replicas.replica_threads
        raise ValueError(f"{count} replica(s) x {replicas.replica_threads} thread(s) need {need} CPUs, and this "
                         f"machine has {cores} (Ray reserves --replica-threads CPUs per replica): "
                         f"start fewer, or join a larger cluster (--ray-address)")
    if _wants_gpu(device):
        import torch

        if count > torch.cuda.device_count():
            raise ValueError(f"{count} replica(s) on CUDA need {count} GPUs (one each), and this machine has "
                             f"{torch.cuda.device_count()}: start fewer, or join a larger cluster (--ray-address)")


def start_ray(address: str | None = None) -> None:
    """Join the cluster at ``address`` (or ``$RAY_ADDRESS``), or start a local one on this machine."""
    if ray.is_initialized():
        return
    address = address or os.environ.get(RAY_ADDRESS_ENV) or None
    if address is None:  # a local cluster's processes inherit this environment: its proxy ends lost responses
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    # The replicas import tinygpt from the driver's own path (a checkout run with PYTHONPATH=src included).
    ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=False,
             configure_logging=True, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})


def run_replicas(model: str, options: ServeOptions, replicas: ReplicaOptions, *, tokenizer_dir: str | None = None,
                 device: str | None = None, dtype: str = "auto", weights: str = "float32") -> str:
    """Start Ray Serve's proxy on ``options.host:options.port`` and the deployment behind it at ``/``; returns the
    URL once every replica is up (``serve.run`` waits)."""
    model = local_source(model)
    replicas = replicas if replicas.enabled else ReplicaOptions(replicas=1)
    if replicas.ray_address is None and RAY_ADDRESS_ENV not in os.environ:
        _check_fits_here(replicas, device)
        _listen(options.host, options.port).close()  # an address in use: one line now, not a dead proxy later
    start_ray(replicas.ray_address)
    serve.start(http_options=HTTPOptions(host=options.host, port=options.port,
                                         keep_alive_timeout_s=options.keep_alive_timeout))
    app = replica_deployment(model, options, replicas, tokenizer_dir=tokenizer_dir, device=device, dtype=dtype,
                             weights=weights)
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except RuntimeError as err:  # a replica's constructor failed (no such model, no tokenizer): the deployment's
        # status holds the replica's traceback, whose last line is its error
        raise ValueError(f"the replicas did not start: {_deploy_error() or err}") from None
    return f"http://{options.host}:{options.port}"


def _deploy_error() -> str | None:
    """The last line of the failed deployment's message (the replica's exception), if Serve has one."""
    try:
        message = serve.status().applications[APP_NAME].deployments[APP_NAME].message
    except (KeyError, AttributeError, RuntimeError):
        return None
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    return lines[-1] if lines else None


def serve_replicas(model: str, options: ServeOptions, replicas: ReplicaOptions, *,
                   tokenizer_dir: str | None = None, device: str | None = None, dtype: str = "auto",
                   weights: str = "float32", announce: Callable[[str], None] | None = None) -> list[int]:
    """``tinygpt serve --replicas N``: run until SIGTERM or SIGINT, then shut Serve down (and the local cluster,
    if this process started it). Returns the signals received."""
    received: list[int] = []
    stop = threading.Event()

    def note(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    previous: dict[int, Any] = {}
    try:
        url = run_replicas(model, options, replicas, tokenizer_dir=tokenizer_dir, device=device, dtype=dtype,
                           weights=weights)
        # after ray.init, which installs its own SIGTERM handler (it aborts the process)
        previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
        if announce is not None:
            announce(url)
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutdown()
    return received


def shutdown() -> None:
    """Stop Serve (each replica's lifespan stops its engine: in-flight rows end "cancelled") and leave the cluster
    (a local one started by ``start_ray`` stops with it)."""
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
