"""Resume and snapshots refuse what they cannot trust: damaged checkpoints fall back to the
newest complete one (saying so), drifted configs are refused by name, snapshots are verified
on read, outputs are checked writable before any work, racing snapshot writers both succeed.

Fast tests need no model (errors happen before it loads); the ones marked slow train."""

import json
import multiprocessing as mp
import os
import re
import shutil
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from factories import make_episodes
from tosca_mlmt.cli.main import app
from tosca_mlmt.config import load_config
from tosca_mlmt.errors import ConfigError, MlmtError, SnapshotError
from tosca_mlmt.pipelines.support.drift import check_allow_drift, check_drift
from tosca_mlmt.pipelines.support.rundir import RunDir, check_writable
from tosca_mlmt.store import load_snapshot, verify_snapshot, write_snapshot
from tosca_mlmt.train.checkpoint import CheckpointManager, CheckpointWarning


# ---------------------------------------------------------------- checkpoints


def _three_checkpoints(tmp_path) -> CheckpointManager:
    ckm = CheckpointManager(tmp_path, keep=3)
    for step in (1, 2, 3):
        ckm.save(step, lambda d, s=step: (d / "adapter.safetensors").write_bytes(bytes([s]) * 1000),
                 {"iteration": step})
    return ckm


class _FakeCuda:
    """Per-device CUDA generator states on a machine without CUDA (what a GPU checkpoint must keep)."""

    def __init__(self, devices: int):
        self.states = {d: torch.tensor([d], dtype=torch.uint8) for d in range(devices)}

    def install(self, monkeypatch, local_rank: int) -> None:
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: self.states[device.index].clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, device: self.states.__setitem__(device.index, t))


def test_a_gpu_checkpoint_keeps_and_restores_this_process_cuda_generator(tmp_path, monkeypatch):
    """LoRA dropout on a GPU draws from the process's CUDA generator: a resume must put it back,
    on this rank's device and no other; a CPU machine resuming the same checkpoint skips it."""
    cuda = _FakeCuda(devices=2)
    cuda.install(monkeypatch, local_rank=1)
    ckm = CheckpointManager(tmp_path, keep=2)
    ckm.save(1, lambda d: None, {"iteration": 1})
    cuda.states[1] = torch.tensor([99], dtype=torch.uint8)  # draws after the save move the generator
    ckm.load_state(ckm.latest())
    assert cuda.states[1].tolist() == [1] and cuda.states[0].tolist() == [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a: pytest.fail("no CUDA generator to restore"))
    ckm.load_state(ckm.latest())


def test_pruning_keeps_the_newest_steps_by_number_past_six_digits(tmp_path):
    """step-1000000 sorts before step-999999 as text: pruning by name deleted the newest checkpoint."""
    ckm = CheckpointManager(tmp_path, keep=2)
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        ckm.save(step, lambda d: None, {"iteration": step})
    assert sorted(d.name for d in ckm.dir.glob("step-*")) == ["step-1000000", "step-1000001"]
    assert ckm.latest() == ckm.dir / "step-1000001"


def test_a_checkpoint_is_on_disk_before_it_is_published(tmp_path, monkeypatch):
    """Every file of the new checkpoint is flushed before its rename, so a power cut after the prune
    that follows cannot leave only a checkpoint whose files never reached the disk."""
    from tosca_mlmt.train import checkpoint

    flushed = []

    def fsync_tree(path, recursive=True):
        flushed.append((path.name, sorted(p.name for p in path.iterdir()), (tmp_path / "checkpoints" /
                                                                              "step-000001").exists()))
    monkeypatch.setattr(checkpoint, "fsync_tree", fsync_tree)
    CheckpointManager(tmp_path, keep=1).save(1, lambda d: (d / "adapter.safetensors").write_bytes(b"x"), {})
    assert flushed[0] == (".step-000001.partial", ["adapter.safetensors", "complete.json", "rng.pt",
                                                   "state.json"], False)


def test_intact_checkpoints_resume_from_the_newest_without_a_warning(tmp_path, recwarn):
    ckm = _three_checkpoints(tmp_path)
    assert CheckpointManager(tmp_path).latest() == ckm.dir / "step-000003"
    assert not [w for w in recwarn if issubclass(w.category, CheckpointWarning)]


@pytest.mark.parametrize("damage, why", [
    (lambda ck: (ck / "state.json").unlink(), "state.json missing"),
    (lambda ck: (ck / "adapter.safetensors").write_bytes(b"\x03" * 10), "adapter.safetensors is 10 bytes, 1000"),
    (lambda ck: (ck / "adapter.safetensors").write_bytes(b"\x09" * 1000), "adapter.safetensors changed"),
    (lambda ck: (ck / "complete.json").write_text("{"), "complete.json unreadable"),
    (lambda ck: [p.unlink() for p in ck.iterdir()], "complete.json and state.json missing"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_saying_so(tmp_path, damage, why):
    ckm = _three_checkpoints(tmp_path)
    damage(ckm.dir / "step-000003")
    with pytest.warns(CheckpointWarning, match=f"skipping checkpoint step-000003 \\({why}.*using step-000002"):
        assert CheckpointManager(tmp_path).latest() == ckm.dir / "step-000002"
    assert CheckpointManager.load_state(ckm.dir / "step-000002")["iteration"] == 2


def test_no_usable_checkpoint_is_an_error_not_a_silent_restart(tmp_path):
    ckm = _three_checkpoints(tmp_path)
    for ck in ckm.checkpoints():
        (ck / "state.json").unlink()
    with pytest.raises(MlmtError, match="no usable checkpoint to resume from: step-000003 .*step-000001"):
        CheckpointManager(tmp_path).latest()
    assert CheckpointManager(tmp_path / "fresh").latest() is None  # nothing saved yet: a fresh start


def test_an_old_format_checkpoint_is_used_unverified_with_a_warning(tmp_path):
    ckm = _three_checkpoints(tmp_path)
    for ck in ckm.checkpoints():
        (ck / "complete.json").unlink()
    with pytest.warns(CheckpointWarning, match="predates verified checkpoints"):
        assert CheckpointManager(tmp_path).latest() == ckm.dir / "step-000003"


def test_metrics_are_cut_back_to_the_checkpoint_they_resume_from(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    rd = RunDir(tmp_path, "train-lower")
    mark = rd.metrics_bytes()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\n{"step": 3, "torn')
    rd.rewind_metrics(mark)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    rd.rewind_metrics(None)  # a checkpoint that did not record it: left alone
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


# ---------------------------------------------------------------- config drift


def _run_with_config(tmp_path, **over):
    run = tmp_path / "run"
    RunDir(run, "train-lower").claim(load_config(overrides=over))
    return run


def test_drift_in_a_training_field_is_refused_naming_every_changed_field(tmp_path):
    run = _run_with_config(tmp_path, **{"seed": 0, "lower.lr": 1e-4})
    new = load_config(overrides={"seed": 1, "lower.lr": 1e-3, "logging.wandb": False, "lower.save_every": 5})
    with pytest.raises(MlmtError) as e:
        check_drift(run, new, "train-lower", allow=("lower.save_every",))
    msg = str(e.value)
    assert "lower.lr (0.0001 -> 0.001)" in msg and "seed (0 -> 1)" in msg
    assert "logging" not in msg and "save_every" not in msg  # logging always may change; save_every allowed


def test_safe_drift_needs_the_flag_and_lengths_may_only_grow(tmp_path):
    run = _run_with_config(tmp_path, **{"lower.iterations": 4, "lower.save_every": 2})
    longer = load_config(overrides={"lower.iterations": 6, "lower.save_every": 3})
    with pytest.raises(MlmtError, match="pass --allow-drift lower.iterations --allow-drift lower.save_every"):
        check_drift(run, longer, "train-lower", allow=())
    check_drift(run, longer, "train-lower", allow=("lower.iterations", "lower.save_every"))
    shorter = load_config(overrides={"lower.iterations": 3, "lower.save_every": 2})
    with pytest.raises(MlmtError, match=r"lower.iterations \(4 -> 3\): a run's length may only grow"):
        check_drift(run, shorter, "train-lower", allow=("lower.iterations",))


def test_a_run_written_before_a_knob_existed_resumes_with_its_default(tmp_path):
    """config.yaml from an older version lacks the knobs added since: each counts as its default (named in
    a warning), while a field the run did record still has to match."""
    import yaml

    run = _run_with_config(tmp_path, **{"lower.lr": 1e-4})
    old = yaml.safe_load((run / "config.yaml").read_text())
    del old["model"]["chat_template"], old["model"]["chat_template_kwargs"]
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    with pytest.warns(UserWarning, match="predates the fields model.chat_template, model.chat_template_kwargs"):
        check_drift(run, load_config(overrides={"lower.lr": 1e-4}), "train-lower", allow=())
    for over, field_ in (({"lower.lr": 1e-3}, "lower.lr (0.0001 -> 0.001)"),
                         ({"lower.lr": 1e-4, "model.chat_template": "chatml"}, "model.chat_template ('' -> 'chatml')")):
        with pytest.warns(UserWarning), pytest.raises(MlmtError, match=re.escape(field_)):
            check_drift(run, load_config(overrides=over), "train-lower", allow=())


def test_a_run_from_before_the_cpu_norm_kernel_resumes_only_with_the_pytorch_norm(tmp_path):
    """engine.vllm.cpu_norm_kernel defaults to on, which runs written before it did not do: such a run
    counts as off, so resuming it with the default names the field, and with the kernel off it resumes."""
    import yaml

    run = _run_with_config(tmp_path)
    old = yaml.safe_load((run / "config.yaml").read_text())
    del old["engine"]["vllm"]["cpu_norm_kernel"]
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    with pytest.warns(UserWarning, match="predates the fields engine.vllm.cpu_norm_kernel"), \
            pytest.raises(MlmtError, match=re.escape("engine.vllm.cpu_norm_kernel (False -> True)")):
        check_drift(run, load_config(), "train-lower", allow=())
    with pytest.warns(UserWarning, match="predates"):
        check_drift(run, load_config(overrides={"engine.vllm.cpu_norm_kernel": False}), "train-lower", allow=())


def test_allow_drift_accepts_only_fields_that_are_safe_for_the_stage():
    assert check_allow_drift("train-upper", ["upper.steps", "logging.wandb"]) == ("upper.steps", "logging.wandb")
    with pytest.raises(ConfigError, match="--allow-drift lower.lr: not a field that may change"):
        check_allow_drift("train-lower", ["lower.lr"])
    with pytest.raises(ConfigError, match="allowed: joint.rounds"):
        check_allow_drift("train-joint", ["lower.iterations"])  # joint runs lower with joint.lower_iterations


@pytest.mark.parametrize("stage, extra", [
    ("train-lower", []),
    ("train-joint", []),
    ("train-upper", ["--snapshot", "snap-x"]),
])
def test_cli_resume_with_a_drifted_config_exits_2_naming_the_field(tmp_path, stage, extra):
    base = {"upper.snapshots": ["snap-x"]} if stage == "train-upper" else {}
    run = _run_with_config(tmp_path, **base)
    (run / "manifest.json").write_text(json.dumps({"rounds": [], "solver": None, "writer": None}))
    res = CliRunner().invoke(app, [stage, "--out", str(run), *extra, "--resume", "--no-wandb",
                                   "--set", "seed=7", "--set", "lower.lr=0.5"])
    assert res.exit_code == 2, res.output
    # the error is one line after the line naming the config (cli.common.command_config)
    lines = res.stderr.splitlines()
    assert "seed (0 -> 7)" in res.stderr and "lower.lr" in res.stderr and len(lines) == 2, res.stderr
    assert lines[0].startswith("config: "), lines
    res = CliRunner().invoke(app, [stage, "--out", str(run), *extra, "--resume", "--allow-drift", "lower.lr"])
    assert res.exit_code == 2 and "--allow-drift lower.lr: not a field that may change" in res.stderr


def test_train_lower_resume_refuses_other_snapshots(tmp_path):
    run = _run_with_config(tmp_path)
    (run / "run.json").write_text(json.dumps({"snapshots": ["snap-a"]}))
    res = CliRunner().invoke(app, ["train-lower", "--out", str(run), "--snapshot", "snap-b", "--resume"])
    assert res.exit_code == 2 and "--snapshot snap-b differs from the run's (snap-a)" in res.stderr


# ---------------------------------------------------------------- outputs checked before the work


def test_check_writable_creates_nothing_and_names_the_blocker(tmp_path):
    check_writable(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(MlmtError, match="is a file, not a folder"):
        check_writable(tmp_path / "f")
    with pytest.raises(MlmtError, match=f"cannot be created: {tmp_path / 'f'} is a file"):
        check_writable(tmp_path / "f" / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_check_writable_refuses_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(MlmtError, match="cannot write in"):
            check_writable(ro / "out")
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("argv", [
    ["collect", "--task", "arith", "--limit", "1", "--no-wandb", "--out"],
    ["train-lower", "--no-wandb", "--out"],
    ["train-joint", "--no-wandb", "--out"],
    ["eval", "--limit", "1", "--no-wandb", "--out"],
    ["analyze", "RUN", "--out"],
])
def test_every_stage_refuses_an_output_that_is_a_file_before_doing_any_work(tmp_path, argv, monkeypatch):
    from tosca_mlmt.models import policies

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(policies.PolicyPair, "__init__", no_model)
    target = tmp_path / "taken"
    target.write_text("keep me")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    argv = [str(tmp_path / "run") if a == "RUN" else a for a in argv]
    res = CliRunner().invoke(app, [*argv, str(target)])
    assert res.exit_code == 2, res.output
    errors = [line for line in res.stderr.splitlines() if not line.startswith("config: ")]  # the config it ran
    assert errors[0].startswith("error:") and "is a file, not a folder" in res.stderr
    assert target.read_text() == "keep me"


def test_train_upper_refuses_an_output_that_is_a_file(tmp_path):
    sid, _ = write_snapshot(tmp_path / "snaps", make_episodes(), {})
    (tmp_path / "taken").write_text("x")
    res = CliRunner().invoke(app, ["train-upper", "--snapshot", sid, "--root", str(tmp_path / "snaps"),
                                   "--out", str(tmp_path / "taken")])
    assert res.exit_code == 2 and "is a file, not a folder" in res.stderr


# ---------------------------------------------------------------- snapshots verified on read


def _invert_rewards(folder):
    """What a careless edit does: flip every reward in place, keeping the manifest."""
    for name, cols in (("episodes.parquet", ("r1", "r_final")), ("turns.parquet", ("reward",))):
        t = pq.read_table(folder / name)
        for col in cols:
            t = t.set_column(t.schema.get_field_index(col), col, pc.subtract(pa.scalar(1.0), t[col]))
        pq.write_table(t, folder / name)


@pytest.fixture
def inverted(tmp_path):
    root = tmp_path / "snaps"
    sid, _ = write_snapshot(root, make_episodes(), {"task": {"name": "arith", "split": "train"}})
    _invert_rewards(root / sid)
    return root, sid


def test_a_snapshot_with_inverted_rewards_is_refused_by_every_reader(inverted, tmp_path):
    root, sid = inverted
    with pytest.raises(SnapshotError, match=f"snapshot {sid}: episodes.parquet: .*--no-verify"):
        load_snapshot(root, sid)
    assert load_snapshot(root, sid, verify=False).episodes()[0].r_final == 0.0  # the flag skips the check
    for argv in (["analyze", sid, "--root", str(root), "--out", str(tmp_path / "rep")],
                 ["train-upper", "--snapshot", sid, "--root", str(root), "--out", str(tmp_path / "up")],
                 ["train-lower", "--snapshot", sid, "--root", str(root), "--out", str(tmp_path / "lo")]):
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 2, (argv, res.output)
        errors = [line for line in res.stderr.splitlines() if not line.startswith("config: ")]  # the config it ran
        assert errors[0].startswith(f"error: snapshot {sid}: episodes.parquet") and len(errors) == 1, res.stderr


def test_analyze_no_verify_reads_the_snapshot_anyway(inverted, tmp_path):
    root, sid = inverted
    res = CliRunner().invoke(app, ["analyze", sid, "--root", str(root), "--out", str(tmp_path / "rep"), "--no-verify"])
    assert res.exit_code == 0, res.output


# ---------------------------------------------------------------- racing writers


def test_the_writer_that_loses_the_rename_race_sees_the_identical_snapshot_and_succeeds(tmp_path, monkeypatch):
    import tosca_mlmt.store.snapshot as snapshot

    real_rename = os.rename
    won = {}

    def rival_finishes_first(src, dst):
        monkeypatch.setattr(snapshot.os, "rename", real_rename)
        won["id"], won["created"] = write_snapshot(tmp_path, make_episodes(), {"who": "same"})
        return real_rename(src, dst)  # now the target exists: OSError, as on a real race

    monkeypatch.setattr(snapshot.os, "rename", rival_finishes_first)
    sid, created = write_snapshot(tmp_path, make_episodes(), {"who": "same"})
    assert won == {"id": sid, "created": True} and created is False
    assert verify_snapshot(tmp_path / sid) == [] and not list(tmp_path.glob(".tmp-*"))


def test_a_damaged_existing_snapshot_is_not_taken_for_the_identical_one(tmp_path):
    sid, _ = write_snapshot(tmp_path, make_episodes(), {})
    (tmp_path / sid / "turns.parquet").write_bytes(b"oops")
    with pytest.raises(SnapshotError, match=f"snapshot {sid}: already exists .* but is damaged"):
        write_snapshot(tmp_path, make_episodes(), {})


def _race_writer(root, barrier, out):
    barrier.wait()
    out.put(write_snapshot(root, make_episodes(5), {"who": "same"}))


def test_concurrent_processes_writing_one_snapshot_all_succeed(tmp_path):
    ctx = mp.get_context("fork")
    n = 4
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_race_writer, args=(tmp_path, barrier, out)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * n
    results = [out.get(timeout=5) for _ in range(n)]
    assert len({sid for sid, _ in results}) == 1 and sum(c for _, c in results) == 1
    sid = results[0][0]
    assert verify_snapshot(tmp_path / sid) == [] and sorted(p.name for p in tmp_path.iterdir()) == [sid]


# ---------------------------------------------------------------- with the model


@pytest.mark.slow
def test_train_lower_resume_skips_a_truncated_adapter_and_ends_like_the_full_run(debug_cfg, debug_policies,
                                                                                 tmp_path):
    from tosca_mlmt.pipelines.train_lower import train_lower

    policies = debug_policies
    cfg = replace(debug_cfg, deterministic=True,
                  solver_sampling=replace(debug_cfg.solver_sampling, max_new_tokens=12),
                  lower=replace(debug_cfg.lower, iterations=2, problems_per_iteration=1, save_every=1,
                                minibatch_size=2, lr=1e-2, keep_snapshots=False))
    model = policies.model("solver")
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_lower(cfg, tmp_path / "full", policies=policies)
    full = {n: p.detach().clone() for n, p in model.named_parameters() if ".solver." in n}
    # the same run killed after its last checkpoint, whose adapter then lost its tail
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "solver")
    adapter = cut / "checkpoints" / "step-000002" / "solver" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-100])
    for n, p in model.named_parameters():
        p.data.copy_(init[n])
    with pytest.warns(CheckpointWarning, match="skipping checkpoint step-000002 .*adapter_model.safetensors is"):
        res = train_lower(cfg, cut, policies=policies, resume=True)
    resumed = {n: p.detach().clone() for n, p in model.named_parameters() if ".solver." in n}
    for n, p in model.named_parameters():
        p.data.copy_(init[n])
    assert res.iterations == 2
    assert any(not torch.equal(full[n], init[n]) for n in full)  # training moved the adapter
    for n in full:
        assert torch.equal(full[n], resumed[n]), n
    steps = [json.loads(line)["step"] for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # iteration 2 ran twice; it is logged once
