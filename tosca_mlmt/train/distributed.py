"""Multi-process training on existing engines: accelerate DDP or a DeepSpeed ZeRO engine.

Launch with ``torchrun --nproc_per_node N -m tosca_mlmt.cli.main <command>`` (CPU: gloo) or
``accelerate launch`` (GPUs). Conventions every trainer follows:

* a step's global batch is split into a fixed number of micro-batch *slots*; rank r runs
  slots [r * S/W, (r + 1) * S/W). Each micro-batch loss is scaled so that the summed,
  rank-averaged gradient equals the one-process gradient of the same global batch: the
  update does not depend on the world size (tested against a 1-process run);
* rollouts are sharded by problem and gathered, so every rank holds the same episodes;
* only rank 0 writes files (snapshots, checkpoints, metrics), except DeepSpeed's own
  partitioned optimizer state, which every rank writes into the same checkpoint folder.

Ranks come from torch.distributed, not accelerate's state: under DeepSpeed on CPU
accelerate reports one process on every rank (accelerate 1.15).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tosca_mlmt.errors import ConfigError, TrainingDiverged

# DeepSpeed JIT-builds its CPU comm op on first start (~30 s); keep the build beside the model cache.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ.get(
    "TOSCA_MLMT_CACHE", Path.home() / ".cache" / "tosca_mlmt")) / "torch_extensions"))


def init(backend: str = "auto", timeout_minutes: int = 30, force: bool = False) -> None:
    """Join the process group when launched with WORLD_SIZE > 1 (idempotent); ``force`` also
    for one process (DeepSpeed needs a group)."""
    import torch.distributed as dist

    if dist.is_initialized() or (int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not force):
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def free_port() -> int:
    """A TCP port free on this host now (a launcher's --master_port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if world() > 1:
        torch.distributed.barrier()


def gather(obj: Any) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def shard(n: int) -> list[int]:
    """This rank's contiguous share of range(n) (sizes differ by at most one)."""
    w, r = world(), rank()
    lo, hi = r * n // w, (r + 1) * n // w
    return list(range(lo, hi))


def gather_sharded(items: list, n: int) -> list:
    """Inverse of ``shard``: each rank passes its items for ``shard(n)``; all get the full list."""
    out = [x for part in gather(items) for x in part]
    if len(out) != n:
        raise RuntimeError(f"gathered {len(out)} items, expected {n}")
    return out


def all_sum(values: dict[str, float]) -> dict[str, float]:
    """Element-wise sum of a (same-keyed) dict of floats across ranks."""
    if world() == 1 or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def deepspeed_config_path(configured: str) -> str:
    """The DeepSpeed JSON to use: ``distributed.deepspeed``, else the one ``accelerate launch``
    was given in its config file (it exports it through the environment)."""
    if configured:
        return configured
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    return ""


def fill_deepspeed_config(conf: dict, micro_size: int, local_micros: int, max_grad_norm: float,
                          bf16: bool, source: str) -> dict:
    """Resolve "auto" fields from the trainer's own knobs; explicit values must agree with them
    (a silent mismatch would change the update)."""
    conf = json.loads(json.dumps(conf))
    want = {"train_micro_batch_size_per_gpu": micro_size, "gradient_accumulation_steps": local_micros,
            "train_batch_size": micro_size * local_micros * world(), "gradient_clipping": max_grad_norm}
    for key, value in want.items():
        have = conf.get(key, "auto")
        if have == "auto":
            conf[key] = value
        elif float(have) != float(value):
            raise ConfigError(f"{source}: '{key}' is {have} but the trainer's config implies {value}; "
                              f"set it to \"auto\"")
    for key, on in (("bf16", bf16), ("fp16", False)):
        section = conf.setdefault(key, {})
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = on
    conf.setdefault("zero_allow_untested_optimizer", True)  # the trainers bring torch AdamW
    conf.setdefault("steps_per_print", 10**9)
    return conf


# Live ZeRO-3 engines: their module hooks would re-partition parameters mid-block (see below).
_ZERO3_ENGINES: list = []


@contextlib.contextmanager
def full_parameters(*modules: nn.Module, modify: bool = False):
    """Block in which ZeRO-3-partitioned parameters of ``modules`` are whole, for generation,
    scoring, weight sync and saving; with ``modify`` what rank 0 writes into them is kept and
    re-partitioned on exit (loading). A no-op for every other engine and for parameters an
    enclosing block already gathered. Under ZeRO-3 it is a collective: every rank enters it.

    The engines' ZeRO-3 forward hooks are lifted for the block (as TRL does for generation):
    they would release the gathered weights after each sub-module and re-gather them with
    collectives, which ranks running different numbers of forwards cannot match."""
    params = [p for m in modules for p in m.parameters() if hasattr(p, "ds_id")]
    if params:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = [p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]
    if not params:
        yield
        return
    import deepspeed

    offloads = [e.optimizer.parameter_offload for e in _ZERO3_ENGINES]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
        for off in offloads:
            for p in off.module.parameters():
                p.ds_active_sub_modules.clear()
            for hook in off.forward_hooks + off.backward_hooks:
                hook.remove()
            off.forward_hooks, off.backward_hooks = [], []
        try:
            yield
        finally:
            for off in offloads:
                off._register_deepspeed_module(off.module)


def saved_world_size(folder: Path) -> int:
    """How many processes wrote the ZeRO checkpoint in ``folder`` (one optimizer shard each)."""
    return len(list((folder / "deepspeed" / "state").glob("zero_pp_rank_*_optim_states.pt")))


class Closure(nn.Module):
    """Holds a trainer's modules; ``forward(fn, ...)`` runs ``fn`` inside the engine's forward,
    so DDP and DeepSpeed see every trainable parameter that ``fn`` touches (heads included)."""

    def __init__(self, modules: dict[str, nn.Module]):
        super().__init__()
        self.parts = nn.ModuleDict(modules)

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(*args, **kwargs)


class TrainEngine:
    """The optimiser side of one trainer: forward/backward/step through DDP or DeepSpeed.

    ``slots`` is the number of micro-batches of a global step (fixed); this rank runs
    ``local_slots = slots / world`` of them. ``backward(loss, weight)`` takes the micro-batch's
    share ``weight`` of the global mean (sum over all slots of all ranks = 1)."""

    def __init__(self, dcfg, modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer,
                 scheduler, *, slots: int, micro_size: int, max_grad_norm: float, what: str,
                 find_unused: bool = False):
        self.world, self.max_grad_norm, self.what = world(), max_grad_norm, what
        self.steps = 0  # optimizer steps taken by this engine (named when training diverges)
        self._loss_sum: torch.Tensor | None = None
        if slots % self.world:
            raise ConfigError(f"invalid value for field '{what}': it gives {slots} micro-batch(es) per optimizer "
                              f"step, which {self.world} processes cannot share; make that a multiple of the "
                              f"world size")
        self.local_slots = slots // self.world
        self.module = Closure(modules)
        self.zero_stage = 0
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.optimizer, self.scheduler = optimizer, scheduler
        ds_path = deepspeed_config_path(dcfg.deepspeed)
        self.kind = "deepspeed" if ds_path else ("ddp" if self.world > 1 else "single")
        if self.kind == "deepspeed":
            import deepspeed

            if not torch.distributed.is_initialized():
                # DeepSpeed needs a process group even for one process started without a launcher.
                for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                             ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
                    os.environ.setdefault(k, v)
                init(dcfg.backend, dcfg.timeout_minutes, force=True)
            bf16 = any(p.dtype == torch.bfloat16 for p in self.params)
            conf = fill_deepspeed_config(json.loads(Path(ds_path).read_text()), micro_size, self.local_slots,
                                         max_grad_norm, bf16, ds_path)
            self.zero_stage = int(conf.get("zero_optimization", {}).get("stage", 0))
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=self.module, optimizer=optimizer, lr_scheduler=scheduler, config=conf,
                dist_init_required=False)
            if self.zero_stage == 3:
                _ZERO3_ENGINES.append(self.engine)
        elif self.kind == "ddp":
            from accelerate import Accelerator
            from accelerate.utils import DistributedDataParallelKwargs

            # Only the module is prepared: accelerate's scheduler wrapper would step the LR
            # schedule world-size times per step, which breaks world-size independence.
            self.acc = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[
                DistributedDataParallelKwargs(find_unused_parameters=find_unused)])
            self.engine = self.acc.prepare(self.module)
        else:
            self.engine = self.module

    def __call__(self, fn: Callable, *args, **kwargs):
        return self.engine(fn, *args, **kwargs)

    def zero_grad(self) -> None:
        if self.kind != "deepspeed":  # DeepSpeed zeroes its gradient partitions after its step
            self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, weight: float) -> None:
        # The step's losses are summed (no host sync here) so that step() can refuse a
        # non-finite one; zero-weight padding slots repeat a row some real slot holds.
        if weight > 0:
            value = loss.detach().double().sum()
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        # DDP and DeepSpeed average gradients over ranks (x world undoes it); DeepSpeed also
        # divides by its accumulation steps (x local_slots undoes it).
        if self.kind == "deepspeed":
            self.engine.backward(loss * (weight * self.world * self.local_slots))
            self.engine.step()  # applies the optimizer only at the accumulation boundary
        else:
            (loss * (weight * self.world)).backward()

    def step(self, at: str = "") -> float:
        """Clip, apply and advance the LR schedule; returns the pre-clip global grad norm.

        A NaN/inf loss (of any rank's micro-batch) or global grad norm raises
        :class:`TrainingDiverged` naming ``at`` (e.g. "iteration 3") instead: the optimizer
        does not step, so NaN never reaches the weights or a checkpoint, and the last good
        checkpoint stays the latest. Under DeepSpeed the engine has stepped inside
        ``backward`` already; the error still comes before anything is saved."""
        loss = self._step_loss()
        if self.kind == "deepspeed":
            norm = self.engine.get_global_grad_norm()
            self._check_finite(loss, None if norm is None else float(norm), at)
            self.steps += 1
            return float(norm) if norm is not None else float("nan")
        # A parameter without a gradient this step (the writer adapter while only the Q head
        # learns) still takes an AdamW step with a zero gradient, as it must under ZeRO, whose
        # flat buffers cannot skip it: same moments, step counts and decay on every engine.
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        self._check_finite(loss, norm, at)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        return norm

    def _step_loss(self) -> float:
        """Sum of this step's real micro-batch losses over all ranks (NaN/inf if any is).

        Reduced across ranks so that all of them raise together: a rank that raised alone
        would leave the others waiting in their next collective."""
        total, self._loss_sum = self._loss_sum, None
        if self.world == 1:
            return 0.0 if total is None else float(total)
        dev = (torch.device("cuda", torch.cuda.current_device())
               if torch.distributed.get_backend() == "nccl" else torch.device("cpu"))
        t = torch.zeros((), dtype=torch.float64, device=dev) if total is None else total.to(dev)
        torch.distributed.all_reduce(t)
        return float(t)

    def _check_finite(self, loss: float, norm: float | None, at: str) -> None:
        bad = [f"the loss is {loss}"] if not math.isfinite(loss) else []
        if norm is not None and not math.isfinite(norm):
            bad.append(f"the gradient norm is {norm}")
        if bad:
            stage = self.what.split(".")[0]
            done = "training stopped" if self.kind == "deepspeed" else "the step was not applied"
            raise TrainingDiverged(f"{stage} training diverged at {at or f'optimizer step {self.steps + 1}'}: "
                                   f"{' and '.join(bad)}; {done} and no checkpoint was written after the last "
                                   f"good one (try a smaller {stage}.lr)")

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder: Path, extra: dict | None = None) -> None:
        """Collective: every rank calls it. Optimizer (+ scheduler) state into ``folder``."""
        if self.kind == "deepspeed":
            # Frozen base weights are excluded: they never change and come from the model cache.
            self.engine.save_checkpoint(str(folder / "deepspeed"), tag="state", client_state=extra or {},
                                        exclude_frozen_parameters=True)
        elif is_main():
            torch.save({"optimizer": self.optimizer.state_dict(),
                        "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                        **(extra or {})}, folder / "optimizer.pt")

    def load(self, folder: Path) -> dict:
        """Restore what ``save`` wrote; returns its ``extra``."""
        ds_dir = folder / "deepspeed"
        if self.kind == "deepspeed":
            if not ds_dir.is_dir():
                raise ConfigError(f"{folder} was not written by a DeepSpeed run; resume it without "
                                  f"distributed.deepspeed")
            saved = saved_world_size(folder)
            if saved != self.world:
                # DeepSpeed 0.19 refuses to re-partition ZeRO optimizer state, and its universal
                # converter does not take these (non-Megatron) checkpoints.
                raise ConfigError(f"{folder} holds ZeRO state partitioned over {saved} processes; resume it "
                                  f"with {saved} processes (this launch has {self.world})")
            _, client = self.engine.load_checkpoint(str(ds_dir), tag="state", load_module_strict=False)
            if client is None:
                raise ConfigError(f"DeepSpeed could not load {ds_dir} (see its log above)")
            return client
        if ds_dir.is_dir():
            raise ConfigError(f"{folder} holds a DeepSpeed checkpoint; resume it with the same "
                              f"distributed.deepspeed config")
        st = torch.load(folder / "optimizer.pt", weights_only=False)
        self.optimizer.load_state_dict(st.pop("optimizer"))
        sched = st.pop("scheduler")
        if self.scheduler is not None and sched is not None:
            self.scheduler.load_state_dict(sched)
        return st

    def close(self) -> None:
        """Drop the wrappers so their gradient hooks leave the shared model's parameters."""
        if self.kind == "deepspeed":
            if self.engine in _ZERO3_ENGINES:
                _ZERO3_ENGINES.remove(self.engine)
            self.engine.destroy()
        self.engine = self.module
        if hasattr(self, "acc"):
            self.acc.free_memory()
            del self.acc
