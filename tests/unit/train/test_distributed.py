"""Multi-process training under torchrun (gloo, CPU): the update does not depend on the world size.

One snapshot is collected in-process; then ``tests/dist_worker.py`` runs offline train-lower
(PPO + GAE value head + KL + context bonus, 2 iterations) and train-upper (CQL + AWR text
loss, 2 steps) on it through the real pipelines, once as a single process and once as two
processes (plain DDP, DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 with offload). All runs use the same global batches
(lower.grad_accum = 2 and upper micro-batches of 2: one process runs both micro-batches, two
processes one each), so the trained adapters must agree to float tolerance (ZeRO-3 with CPU
offload included: it runs on CPU too). Also checked:
only rank 0 writes (one metrics line per iteration), DDP checkpoints resume into another
world size, and ZeRO checkpoints resume (same world size: DeepSpeed cannot re-partition them).

Slow: every launch imports torch and loads the model in each process (~30-60 s each), so runs of one
world size that need no fresh process of their own (the references, plain DDP) share a launch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tosca_mlmt.config import load_config
from tosca_mlmt.pipelines.collect import collect
from tosca_mlmt.parallel import free_port
from conftest import FP32, set_args

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
WORKER = REPO / "tests" / "dist_worker.py"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install 'tosca-mlmt[deepspeed]')")

# The episodes come from the embedded model (the session fixture), so some are right and every
# loss term has signal; the training runs on the random-weight debug base with the same
# tokenizer: world-size agreement does not depend on what the model knows, and it runs ~4x faster.
OVERRIDES = {
    **FP32, "model.solver": "tiny-random", "logging.wandb": False, "logging.progress": False,
    "solver_sampling.max_new_tokens": 16, "writer_sampling.max_new_tokens": 8, "episode.max_feedback_tokens": 8,
    "lower.iterations": 2, "lower.problems_per_iteration": 2, "lower.minibatch_size": 4, "lower.grad_accum": 2,
    # the bonus ungated, so every refine contributes a term the ranks must agree on
    "lower.epochs": 1, "lower.advantage": "gae", "lower.lr": 2e-3, "lower.kl_coef": 0.05, "lower.bonus.coef": 0.2,
    "lower.bonus.gate": "none",
    "lower.save_every": 1, "lower.keep_snapshots": False,
    "upper.steps": 2, "upper.batch_size": 4, "upper.micro_batch_size": 2, "upper.warmup_steps": 1,
    "upper.lr": 2e-3, "upper.save_every": 1, "upper.eval_every": 2, "upper.log_every": 1,
}
# fp32 sums in another order differ by ~1e-7 relative, but Adam divides each gradient by its own
# size, so the few elements whose gradient is ~eps move by a visible share of a step. Compared as
# a whole (L2 over the adapter) the updates agree to ~1e-4; a wrong shard or loss scale gives O(1).
REL_TOL = 1e-3


@pytest.fixture(scope="module")
def snapshot(policies, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist-snaps")
    cfg = load_config(overrides={**OVERRIDES, "task.limit": 2, "episode.n_samples": 2, "episode.rounds": 1,
                                 "collect.out": str(root)})
    return str(root), collect(cfg, policies=policies).snapshot_id



def job(out: Path, snapshot, stages=("lower", "upper"), **spec) -> dict:
    """One run of the worker: its out folder, stages and overrides (on top of OVERRIDES)."""
    root, sid = snapshot
    out.mkdir(parents=True, exist_ok=True)
    overrides = {**OVERRIDES, **spec.pop("overrides", {})}
    return {"out": str(out), "snapshot_root": root, "snapshot": sid, "stages": list(stages), "overrides": overrides,
            **spec}


def launch(out: Path, snapshot, nproc: int, stages=("lower", "upper"), **spec) -> None:
    launch_jobs(out, nproc, [job(out, snapshot, stages, **spec)])


def launch_jobs(folder: Path, nproc: int, jobs: list[dict]) -> None:
    """The jobs one after another in one launch of ``nproc`` processes (dist_worker's "jobs"): runs that
    only share a world size pay its start-up once."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps({"jobs": jobs}))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port())]
    # the 2 cores shared out: one process takes both, two take one each
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, 2 // nproc)), OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(REPO))
    p = subprocess.run([*launcher, str(WORKER), str(folder / "spec.json")], capture_output=True, text=True,
                       timeout=900, env=env, cwd=REPO)
    if p.returncode != 0:
        # the ranks' own errors come before the launcher's traceback (which only names the signal)
        cut = p.stderr.rfind("Traceback (most recent call last):\n  File \"<frozen runpy>\"")
        ranks, launcher_tb = (p.stderr[:cut], p.stderr[cut:]) if cut > 0 else (p.stderr, "")
        raise AssertionError(f"worker failed ({p.returncode}):\n{p.stdout[-2000:]}\n--- ranks' stderr (tail):\n"
                             f"{ranks[-6000:]}\n--- launcher:\n{launcher_tb[-2000:]}")


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "tensors.safetensors")


# GRPO, no value head, the bonus on the reference (which reads the reference pass, not pi_old): see
# test_two_processes_skip_the_first_minibatchs_pi_old_rows_as_one_does
SKIP = {"lower.advantage": "grpo", "lower.kl_mode": "loss", "lower.bonus.model": "reference", "lower.minibatch_size": 2}


@pytest.fixture(scope="module")
def ones(snapshot, tmp_path_factory):
    """The one-process references, in one launch (the fp32 runs before the bf16 one): both micro-batches
    of every step in one process. w1: the default overrides, both stages; skip: SKIP; bf16: BF16."""
    root = tmp_path_factory.mktemp("dist-one")
    outs = {name: root / name for name in ("w1", "skip", "bf16")}
    launch_jobs(root, 1, [job(outs["w1"], snapshot), job(outs["skip"], snapshot, ("lower",), overrides=SKIP),
                          job(outs["bf16"], snapshot, ("lower",), overrides=BF16)])
    return outs


@pytest.fixture(scope="module")
def single(ones):
    """The reference: one process, both micro-batches of every step in it."""
    return ones["w1"]


@pytest.fixture(scope="module")
def twos(snapshot, tmp_path_factory):
    """Two plain DDP processes, in one launch: ddp with the default overrides (both stages), skip with SKIP."""
    root = tmp_path_factory.mktemp("dist-two")
    outs = {name: root / name for name in ("ddp", "skip")}
    launch_jobs(root, 2, [job(outs["ddp"], snapshot), job(outs["skip"], snapshot, ("lower",), overrides=SKIP)])
    return outs


@pytest.fixture(scope="module")
def initial():
    from tosca_mlmt.models.policies import PolicyPair

    policies = PolicyPair(load_config(overrides=OVERRIDES).model, seed=0)  # as dist_worker builds it
    return {f"{r}/{k}": v.clone() for r in ("solver", "writer") for k, v in policies.adapter_state(r).items()}


def assert_same_update(a: dict, b: dict, initial: dict, role: str) -> None:
    keys = [k for k in a if k.startswith(role + "/")]
    assert keys and set(keys) == {k for k in b if k.startswith(role + "/")}
    change = float(torch.sqrt(sum(((a[k] - initial[k]) ** 2).sum() for k in keys)))
    diff = float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in keys)))
    assert change > 1e-2, f"{role}: training did not move the adapter (|update| {change:.2e})"
    assert diff <= REL_TOL * change, f"{role}: 1 vs 2 processes differ by {diff:.2e} (|update| {change:.2e})"


def _metric_lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(single: Path, out: Path) -> None:
    """Per-step losses and pre-clip gradient norms (Adam would hide a loss-scale error; the norm cannot)."""
    for stage, step_key, keys in (
            ("lower", "lower/iteration", ("lower/grad_norm", "lower/policy_loss", "lower/value_loss",
                                          "lower/bonus/mean", "lower/kl")),
            ("upper", "upper/td_loss", ("upper/grad_norm", "upper/loss", "upper/td_loss", "upper/text_loss"))):
        ref = [m for m in _metric_lines(single / stage) if step_key in m]
        got = [m for m in _metric_lines(out / stage) if step_key in m]
        assert len(got) == len(ref) == 2  # rank 0 alone writes: one record per step
        for r, g in zip(ref, got):
            for k in (k for k in keys if k in r):  # text_loss only once it is on
                # the bonus differences two forwards of different batch shapes: ~1e-7 per token each
                assert g[k] == pytest.approx(r[k], rel=1e-4, abs=1e-6 if "bonus" in k else 1e-7), (stage, k)


def test_two_process_ddp_gives_the_one_process_update(single, twos, initial):
    out = twos["ddp"]
    a, b = _tensors(single), _tensors(out)
    assert_same_update(a, b, initial, "solver")
    assert_same_update(a, b, initial, "writer")
    assert_same_metrics(single, out)
    assert json.loads((out / "worker.json").read_text())["world"] == 2


def test_ddp_checkpoint_resumes_into_another_world_size(single, snapshot, initial, tmp_path):
    """DDP keeps the optimizer whole on every rank, so its checkpoints do not depend on the world size."""
    out = tmp_path / "ddp-resume"
    launch(out, snapshot, 2, stages=("lower",), lower_stop_after=1)
    assert not (out / "lower" / "solver").exists()  # no final adapter: it stopped mid-run
    launch(out, snapshot, 1, stages=("lower",), resume=True)
    assert_same_update(_tensors(single), _tensors(out), initial, "solver")


def test_two_processes_skip_the_first_minibatchs_pi_old_rows_as_one_does(ones, twos, initial):
    """GRPO, no value head, the bonus on the reference (which reads the reference pass, not pi_old):
    lower.old_logprobs=auto scores pi_old only on the rows after the first minibatch (old_pass
    0.5), and two ranks share those rows out (one each) and spread them back into the batch as one
    process does: the same update and pre-update diagnostics."""
    one, two = ones["skip"], twos["skip"]
    assert_same_update(_tensors(one), _tensors(two), initial, "solver")
    ref = [m for m in _metric_lines(one / "lower") if "lower/iteration" in m]
    got = [m for m in _metric_lines(two / "lower") if "lower/iteration" in m]
    assert len(ref) == len(got) == 2 and all(m["lower/old_pass"] == 0.5 for m in ref + got)
    assert ref[1]["lower/kl"] > 0  # after an update the policy is off the reference, and the diagnostic sees it
    for r, g in zip(ref, got):
        for k in ("lower/grad_norm", "lower/policy_loss", "lower/kl", "lower/entropy"):
            assert g[k] == pytest.approx(r[k], rel=1e-4, abs=1e-7), k


@needs_deepspeed
@pytest.mark.parametrize("config", ["zero3-offload"])
def test_deepspeed_zero_gives_the_one_process_update(single, snapshot, initial, tmp_path, config):
    """ZeRO-3 also partitions the frozen base: rollouts, scoring, syncs and saves gather it."""
    out = tmp_path / config
    launch(out, snapshot, 2, overrides={"distributed.deepspeed": str(REPO / f"configs/deepspeed/{config}.json")})
    assert_same_update(_tensors(single), _tensors(out), initial, "solver")
    assert_same_update(_tensors(single), _tensors(out), initial, "writer")
    assert_same_metrics(single, out)


# bf16 (what `model.dtype: auto` and `lower.autocast: auto` pick on CPUs with native bf16). The
# scoring forwards run in chunks of 2 rows (lower.score_batch), so both runs make the same forward
# shapes. What remains is bf16 rounding that depends on the kernels' thread split: ONE process
# run with 1 and then 2 threads gives per-step losses and grad norms 1-4 % apart and adapter
# updates ~21 % apart (Adam turns gradient elements below the bf16 noise into full-size steps of
# random sign), the same as 1 vs 2 processes (21 %); in fp32 the same thread comparison gives
# 4e-5. So the bf16 gap is precision, not a reduction done in the wrong dtype: the grads, the
# all-reduce and the optimizer state are fp32. The bounds sit above that floor and below what a
# wrong shard or a loss scale error gives (grad norm off by the scale, update O(1)).
BF16 = {"lower.autocast": "bf16", "lower.score_batch": 2}
BF16_METRIC_REL = 0.1
BF16_UPDATE_REL = 0.5


@needs_deepspeed
def test_deepspeed_zero1_in_bf16_matches_one_process_within_bf16_precision(ones, snapshot, initial, tmp_path):
    one, two = ones["bf16"], tmp_path / "bf16-zero1"
    launch(two, snapshot, 2, stages=("lower",),
           overrides={**BF16, "distributed.deepspeed": str(REPO / "configs/deepspeed/zero1.json")})
    a, b = _tensors(one), _tensors(two)
    keys = [k for k in a if k.startswith("solver/")]
    change = float(torch.sqrt(sum(((a[k] - initial[k]) ** 2).sum() for k in keys)))
    diff = float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in keys)))
    assert change > 1e-2 and diff <= BF16_UPDATE_REL * change, (diff, change)
    ref = [m for m in _metric_lines(one / "lower") if "lower/iteration" in m]
    got = [m for m in _metric_lines(two / "lower") if "lower/iteration" in m]
    assert len(ref) == len(got) == 2
    for r, g in zip(ref, got):
        for k in ("lower/grad_norm", "lower/policy_loss", "lower/bonus/mean"):
            assert g[k] == pytest.approx(r[k], rel=BF16_METRIC_REL, abs=1e-3), k


@needs_deepspeed
def test_deepspeed_zero2_killed_and_resumed_gives_the_one_process_update(single, snapshot, initial, tmp_path):
    """Two ZeRO-2 processes stop after iteration 1 (as a crash would) and the run resumes from
    the partitioned checkpoint; only the same world size can load it (DeepSpeed's limit)."""
    from tosca_mlmt.train.distributed import saved_world_size

    ds = {"distributed.deepspeed": str(REPO / "configs/deepspeed/zero2.json")}
    out = tmp_path / "zero2"
    launch(out, snapshot, 2, stages=("lower",), overrides=ds, lower_stop_after=1)
    ck = out / "lower" / "checkpoints" / "step-000001"
    assert sorted(p.name for p in (ck / "deepspeed" / "state").glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert saved_world_size(ck) == 2 and not (out / "lower" / "solver").exists()
    launch(out, snapshot, 2, overrides=ds, resume=True)
    assert_same_update(_tensors(single), _tensors(out), initial, "solver")
    assert_same_update(_tensors(single), _tensors(out), initial, "writer")
    assert_same_metrics(single, out)


def test_train_joint_with_two_processes_through_the_cli(tmp_path):
    """The whole loop under torchrun: sharded collect and rollouts, one writer of every file."""
    sets = {"joint.rounds": 1, "joint.collect_problems": 2, "joint.lower_iterations": 1, "joint.upper_steps": 2,
            "upper.batch_size": 2, "upper.micro_batch_size": 1, "upper.warmup_steps": 1, "upper.log_every": 1,
            "lower.problems_per_iteration": 2, "lower.minibatch_size": 4, "lower.grad_accum": 2,
            "episode.n_samples": 2, "solver_sampling.max_new_tokens": 10, "writer_sampling.max_new_tokens": 8,
            "episode.max_feedback_tokens": 8, **FP32, "model.solver": "tiny-random", "logging.progress": False}
    run = tmp_path / "run"
    args = set_args(sets)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "tosca_mlmt.cli.main", "train-joint", "--out", str(run), "--no-wandb",
                        *args], capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-4000:]
    man = json.loads((run / "manifest.json").read_text())
    assert [r["done"] for r in man["rounds"]] == [["collect", "upper", "lower"]]
    snaps = [d for d in (run / "snapshots").iterdir() if d.name.startswith("snap-")]
    assert [d.name for d in snaps] == [man["rounds"][0]["snapshot"]]
    assert len(list((run / "snapshots" / "_logs").iterdir())) == 1  # collect's log: rank 0's only
    snap = json.loads((snaps[0] / "manifest.json").read_text())
    assert snap["rows"]["episodes"] == 4 and snap["summary"]["processes"] == 2  # both ranks' shares, gathered
    lower = run / man["rounds"][0]["lower"]
    assert [json.loads(x)["lower/iteration"] for x in (lower / "metrics.jsonl").read_text().splitlines()
            if "lower/iteration" in x] == [1]
    assert len(json.loads((lower / "snapshots" / man["rounds"][0]["lower_snapshots"][0] / "manifest.json")
                          .read_text())["task"]["problem_ids"]) == 2
    assert (run / "solver" / "adapter_model.safetensors").exists() and (run / "writer" / "q_head.safetensors").exists()
