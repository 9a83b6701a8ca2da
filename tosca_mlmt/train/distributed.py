"""The optimiser side of training (``Trainer``) in one process or many: accelerate DDP or DeepSpeed ZeRO.

Launch with ``torchrun --nproc_per_node N -m tosca_mlmt.cli.main <command>`` (CPU: gloo) or
``accelerate launch`` (GPUs). Conventions every trainer follows:

* a step's global batch is split into a fixed number of micro-batch *slots*; rank r runs
  slots [r * S/W, (r + 1) * S/W). Each micro-batch loss is scaled so that the summed,
  rank-averaged gradient equals the one-process gradient of the same global batch: the
  update does not depend on the world size (tested against a 1-process run);
* rollouts are sharded by problem and gathered, so every rank holds the same episodes;
* only rank 0 writes files (snapshots, checkpoints, metrics), except DeepSpeed's own
  partitioned optimizer state, which every rank writes into the same checkpoint folder.

Rank, world size, collectives and ZeRO-3 gathering live in :mod:`tosca_mlmt.parallel`
(layers that do not train use them too); this module is the optimiser side only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tosca_mlmt.errors import ConfigError, TrainingDiverged
from tosca_mlmt.parallel import compute_device, free_port, init, is_main, track_zero3_engine, untrack_zero3_engine, world


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


def saved_world_size(folder: Path) -> int:
    """How many processes wrote the ZeRO checkpoint in ``folder`` (one optimizer shard each)."""
    return len(list((folder / "deepspeed" / "state").glob("zero_pp_rank_*_optim_states.pt")))


# A JIT build of DeepSpeed's comm op takes ~30 s on 2 cores; a build lock this old has no builder.
STALE_BUILD_LOCK_S = 600.0


def clear_stale_build_locks(root: Path, max_age_s: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """Remove torch-extension build locks older than ``max_age_s``. A process killed while it built
    (Ctrl-C, a test timeout) leaves ``<ext>/lock`` behind, and torch's FileBaton then waits on it
    forever with no message: every later DeepSpeed start hangs. The lock holds no pid, so age decides."""
    removed = []
    now = time.time()
    for lock in root.glob("*/lock"):
        try:
            if now - lock.stat().st_mtime <= max_age_s:
                continue
            lock.unlink()
        except FileNotFoundError:  # another rank removed it, or its build just finished
            continue
        removed.append(lock)
        warnings.warn(f"removed a stale torch-extension build lock (older than {max_age_s:.0f} s, its builder is "
                      f"gone): {lock}", stacklevel=2)
    return removed


def environment_key() -> str:
    """A folder name for this Python environment and torch build. A build's command lines name the
    environment's include paths, so two virtual environments sharing one build folder rebuild the op
    in turn (1-2 minutes each time either starts DeepSpeed); one folder each keeps both builds."""
    import hashlib

    digest = hashlib.sha1(f"{Path(sys.prefix).resolve()}\0{torch.__version__}".encode()).hexdigest()[:12]
    return f"py{sys.version_info[0]}{sys.version_info[1]}-{digest}"


def default_build_dir() -> Path:
    """Where DeepSpeed's ops build unless TORCH_EXTENSIONS_DIR says otherwise: beside the model
    cache, one folder per environment (environment_key)."""
    from tosca_mlmt.models.loading import cache_root

    return cache_root() / "torch_extensions" / environment_key()


def _deepspeed_build_dir() -> None:
    """DeepSpeed JIT-builds its CPU comm op on first start (~30 s); keep the build in
    default_build_dir(). Set when a DeepSpeed trainer starts, not on import: importing must not change the process."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default_build_dir()))
    clear_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))


def prebuild_deepspeed_ops() -> str | None:
    """Build DeepSpeed's CPU comm op now (``mlmt setup``) instead of inside the first distributed
    run: the build's command lines name the environment's include paths, so every fresh virtual
    environment rebuilds it (1-2 minutes on 2 busy cores, inside whichever run starts DeepSpeed
    first). Returns the build folder, or None where DeepSpeed is not installed, the accelerator is
    not the CPU, or the op does not apply to this machine; a failed build only warns (DeepSpeed
    then tries again, and reports, when a run starts it)."""
    if importlib.util.find_spec("deepspeed") is None:
        return None
    _deepspeed_build_dir()
    try:  # a broken DeepSpeed or a missing compiler must not fail the install
        # DeepSpeed logs to stdout, where `mlmt setup` prints the model folder
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.accelerator import get_accelerator
            from deepspeed.comm.torch import build_shm_op

            if get_accelerator().device_name() != "cpu":
                return None
            module = build_shm_op()  # the very call a run's comm backend makes: the build it loads
    except Exception as e:
        warnings.warn(f"could not build DeepSpeed's CPU comm op now ({e}); DeepSpeed will try again when a run "
                      f"starts it", stacklevel=2)
        return None
    return None if module is None else str(Path(module.__file__).parent)


class Closure(nn.Module):
    """Holds a trainer's modules; ``forward(fn, ...)`` runs ``fn`` inside the wrapper's forward,
    so DDP and DeepSpeed see every trainable parameter that ``fn`` touches (heads included)."""

    def __init__(self, modules: dict[str, nn.Module]):
        super().__init__()
        self.parts = nn.ModuleDict(modules)

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(*args, **kwargs)


class Trainer:
    """The optimiser side of one learner (PPO's policy and value head, the writer and its
    critic): forward/backward/step through DDP or DeepSpeed. Called a trainer, never an engine:
    engines are the rollout side (``rollout.engines``).

    ``slots`` is the number of micro-batches of a global step (fixed); this rank runs
    ``local_slots = slots / world`` of them. ``backward(loss, weight)`` takes the micro-batch's
    share ``weight`` of the global mean (sum over all slots of all ranks = 1). ``wrapped`` is
    the modules as the backend runs them: DeepSpeed's engine, the DDP module, or the modules."""

    def __init__(self, dcfg, modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer,
                 scheduler, *, slots: int, micro_size: int, max_grad_norm: float, what: str,
                 find_unused: bool = False):
        self.world, self.max_grad_norm, self.what = world(), max_grad_norm, what
        self.steps = 0  # optimizer steps taken by this trainer (named when training diverges)
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
            _deepspeed_build_dir()
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
            self.wrapped, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=self.module, optimizer=optimizer, lr_scheduler=scheduler, config=conf,
                dist_init_required=False)
            if self.zero_stage == 3:
                track_zero3_engine(self.wrapped)
        elif self.kind == "ddp":
            from accelerate import Accelerator
            from accelerate.utils import DistributedDataParallelKwargs

            # Only the module is prepared: accelerate's scheduler wrapper would step the LR
            # schedule world-size times per step, which breaks world-size independence.
            self.acc = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[
                DistributedDataParallelKwargs(find_unused_parameters=find_unused)])
            self.wrapped = self.acc.prepare(self.module)
        else:
            # DDP (accelerate) and DeepSpeed place the modules; one process places them itself
            self.wrapped = self.module.to(compute_device())

    def __call__(self, fn: Callable, *args, **kwargs):
        return self.wrapped(fn, *args, **kwargs)

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
            self.wrapped.backward(loss * (weight * self.world * self.local_slots))
            self.wrapped.step()  # applies the optimizer only at the accumulation boundary
        else:
            (loss * (weight * self.world)).backward()

    def step(self, at: str = "") -> float:
        """Clip, apply and advance the LR schedule; returns the pre-clip global grad norm.

        A NaN/inf loss (of any rank's micro-batch) or global grad norm raises
        :class:`TrainingDiverged` naming ``at`` (e.g. "iteration 3") instead: the optimizer
        does not step, so NaN never reaches the weights or a checkpoint, and the last good
        checkpoint stays the latest. Under DeepSpeed its engine has stepped inside
        ``backward`` already; the error still comes before anything is saved."""
        loss = self._step_loss()
        if self.kind == "deepspeed":
            norm = self.wrapped.get_global_grad_norm()
            self._check_finite(loss, None if norm is None else float(norm), at)
            self.steps += 1
            return float(norm) if norm is not None else float("nan")
        # A parameter without a gradient this step (the writer adapter while only the Q head
        # learns) still takes an AdamW step with a zero gradient, as it must under ZeRO, whose
        # flat buffers cannot skip it: same moments, step counts and decay on every backend.
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
            self.wrapped.save_checkpoint(str(folder / "deepspeed"), tag="state", client_state=extra or {},
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
            _, client = self.wrapped.load_checkpoint(str(ds_dir), tag="state", load_module_strict=False)
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
            untrack_zero3_engine(self.wrapped)
            self.wrapped.destroy()
        self.wrapped = self.module
        if hasattr(self, "acc"):
            self.acc.free_memory()
            del self.acc
