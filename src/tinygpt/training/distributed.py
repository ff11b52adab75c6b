"""Data parallelism under ``torchrun``: process-group setup, DDP or FSDP2 wrapping, and full (unsharded) state.

Outside torchrun (no ``WORLD_SIZE`` in the environment) everything here is the identity: one process, rank 0.
Under ``torchrun --nproc_per_node=N`` each process joins the group (gloo on CPU, nccl on CUDA), takes GPU
``LOCAL_RANK``, and the model is wrapped in DDP -- or sharded with FSDP2 ``fully_shard`` (one unit per transformer
block, then the root) when asked. Every rank seeds identically; only rank 0 writes files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..devices import resolve_device


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False  # this context created the process group, so closing it destroys the group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun in every worker: 0, then 1, 2, ... per restart


def restart_count() -> int:
    """How many times torchrun (``--max-restarts N``) has restarted this job's workers; 0 outside torchrun."""
    try:
        return int(os.environ.get(RESTART_ENV, "0"))
    except ValueError:
        return 0


def init_distributed(device: str | None = None) -> DistContext:
    """Join the torchrun process group when launched by torchrun; otherwise a single-process context."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 and not dist.is_initialized():
        return DistContext(rank=0, local_rank=0, world_size=1, device=resolve_device(device))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        resolved = torch.device("cuda", local_rank)
        torch.cuda.set_device(resolved)
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = "nccl" if resolved.type == "cuda" else "gloo"
        device_id = resolved if resolved.type == "cuda" else None
        attempt = restart_count()
        if attempt == 0:
            dist.init_process_group(backend=backend, device_id=device_id)
        else:
            # torchrun keeps its store across restarts, and the group's keys (each rank's address) of the attempt
            # before are still in it: a restarted rank could read a dead worker's address and fail to connect.
            # Each attempt gets its own key space.
            from torch.distributed.rendezvous import rendezvous

            store, rank, world = next(rendezvous("env://"))
            dist.init_process_group(backend=backend, device_id=device_id, rank=rank, world_size=world,
                                    store=dist.PrefixStore(f"tinygpt-attempt-{attempt}", store))
    return DistContext(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=resolved,
                       owns_group=owns_group)


def close_distributed(ctx: DistContext) -> None:
    """Destroy the process group if ``init_distributed`` created it (a caller's own group is left alone)."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, ctx: DistContext, *, fsdp: bool = False) -> nn.Module:
    """DDP (gradients all-reduced and averaged) or FSDP2 (parameters, gradients and optimizer state sharded).

    With one process and no ``fsdp`` the model is returned as it is.
    """
    if fsdp:
        if not dist.is_initialized():
            raise ValueError("--fsdp needs a process group: launch with torchrun (even --nproc_per_node=1)")
        from torch.distributed.fsdp import fully_shard

        for block in model.trf_blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    if not ctx.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # No buffer sync per step: GPTModel has no buffers (its causal mask is built per call). torch 2.13 renamed the
    # flag (``broadcast_buffers`` is deprecated there); older releases only know the old name.
    import inspect

    new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    no_sync = {"forward_sync_buffers" if new_name else "broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=device_ids, **no_sync)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside a DDP wrapper (FSDP2 shards in place, so it is the model itself)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient all-reduce on the micro-steps of gradient accumulation that are not the last."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "require_backward_grad_sync"):  # DDP
        model.require_backward_grad_sync = enabled


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state), unsharded on CPU, keyed by parameter name -- the same for 1 process, DDP
    and FSDP2, so a checkpoint written by one resumes under another. Collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # ~2 s import: lazily

    return get_state_dict(model, getattr(optimizer, "parts", optimizer),  # Muon + AdamW: both, keyed by name
                          options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: dict) -> None:
    """Inverse of ``full_state`` for the optimizer (every rank passes the same full dict; FSDP2 keeps its shard).
    The weights themselves come back through ``load_model`` before wrapping."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    try:
        # strict=False: a parameter that never had a gradient (a reward model's unused LM head) has no AdamW state.
        set_optimizer_state_dict(model, getattr(optimizer, "parts", optimizer), optimizer_state,
                                 options=StateDictOptions(full_state_dict=True, strict=False))
    except (KeyError, ValueError, RuntimeError) as err:  # a state keyed otherwise (an older fine-tuning run's)
        raise ValueError(f"cannot restore the optimizer state of the checkpoint ({type(err).__name__}: {err}); "
                         f"start a fresh run from its model instead") from None


def all_reduce_mean(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= ctx.world_size
    return value


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """Whether ``flag`` is true on any rank (a collective when distributed): every rank then takes the same branch,
    as a stop on a signal that reached only some of them must."""
    if not ctx.distributed:
        return flag
    value = torch.tensor(int(flag), device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def check_same_on_every_rank(value: int, ctx: DistContext, message: Callable[[list[int]], str]) -> None:
    """``ValueError(message(values))`` on every rank unless every rank passed the same ``value`` (a collective)."""
    if not ctx.distributed:
        return
    gathered = [torch.zeros((), dtype=torch.long, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, torch.tensor(value, dtype=torch.long, device=ctx.device))
    seen = [int(v) for v in gathered]
    if len(set(seen)) > 1:
        raise ValueError(message(seen))


def is_main_process() -> bool:
    """Rank 0, or not under torchrun (read from the environment torchrun sets: usable before and after the
    process group exists, e.g. for the command line's final summary)."""
    return int(os.environ.get("RANK", "0")) == 0
