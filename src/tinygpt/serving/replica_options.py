"""The replica flags of ``tinygpt serve`` (``--replicas N``, ``--autoscale MIN:MAX``): torch- and ray-free, so the CLI
builds its flags cheaply and checks them before Ray is imported (``serving.replicas`` runs them)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ..checks import option

RAY_ADDRESS_ENV = "RAY_ADDRESS"
CLUSTER_EXTRA = "pip install -e '.[cluster]' in a checkout, or pip install 'ray[serve]>=2.40'"


@dataclass
class ReplicaOptions:
    """How many copies of the server Ray Serve runs. ``replicas`` and ``autoscale`` are exclusive; neither means one
    process without Ray (plain ``tinygpt serve``)."""

    replicas: int | None = option(None, "run N copies of the server (model, engine, app) on Ray Serve, whose proxy "
                                        "on --host:--port spreads requests over them and restarts a copy that "
                                        "dies (needs the cluster extra)", metavar="N",
                                  default_help="one process, no Ray")
    autoscale: str | None = option(None, "like --replicas, but between MIN and MAX copies, scaled on the requests "
                                         "in flight per copy (target: --max-batch)", metavar="MIN:MAX",
                                   default_help="off")
    replica_threads: int = option(1, "torch threads (and Ray CPUs) per replica", metavar="N")
    ray_address: str | None = option(None, "the Ray cluster to run on (ray start's address, or auto)",
                                     metavar="ADDRESS",
                                     default_help=f"${RAY_ADDRESS_ENV} if set, else a new local cluster")

    def __post_init__(self) -> None:
        checks.positive_int("replicas", self.replicas, optional=True)
        checks.positive_int("replica_threads", self.replica_threads)
        if self.replicas is not None and self.autoscale is not None:
            raise checks.OptionError("autoscale", self.autoscale, "conflicts with --replicas: give a fixed count or "
                                                                  "a range, not both")
        _ = self.bounds  # a malformed MIN:MAX fails here, before Ray or a model is loaded

    @property
    def enabled(self) -> bool:
        """Serve through Ray (either flag given)."""
        return self.replicas is not None or self.autoscale is not None

    @property
    def bounds(self) -> tuple[int, int] | None:
        """``--autoscale MIN:MAX`` as (MIN, MAX); None without it."""
        if self.autoscale is None:
            return None
        low, sep, high = str(self.autoscale).partition(":")
        try:
            bounds = (int(low), int(high)) if sep else None
        except ValueError:
            bounds = None
        if bounds is None or bounds[0] < 0 or bounds[1] < 1 or bounds[0] > bounds[1]:
            raise checks.OptionError("autoscale", self.autoscale, "must be MIN:MAX with 0 <= MIN <= MAX and MAX >= 1 "
                                                                  "(e.g. 1:4)")
        return bounds
