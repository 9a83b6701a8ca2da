"""`mlmt` end to end as a subprocess, the way users run it."""

import json
import signal
import subprocess
import time

import pytest

from conftest import MLMT, TINY, run_mlmt
from tosca_mlmt.store.index import list_snapshots
from tosca_mlmt.tasks.arith import ArithTask

pytestmark = pytest.mark.slow

# The random-weight debug base (conftest.DEBUG_MODEL): what these tests check is the CLI's plumbing
# (provenance, content-hashed ids, exit codes, row handling, signals), never what the model answers,
# and the embedded model's generation is most of a collect's time.
DEBUG = ["--set", "model.solver=tiny-random", *TINY]


@pytest.fixture(scope="module")
def greedy_snapshot(tmp_path_factory):
    out = tmp_path_factory.mktemp("snaps")
    p = run_mlmt("collect", "--task", "arith", "--limit", "2", "--engine", "hf", "--out", out, "--greedy",
                 "--n-samples", "1", *DEBUG, check=True)
    return out, p


def test_collect_prints_id_last_and_writes_full_provenance(greedy_snapshot):
    out, p = greedy_snapshot
    sid = p.stdout.strip().splitlines()[-1]
    assert sid.startswith("snap-") and (out / sid / "manifest.json").exists()
    m = json.loads((out / sid / "manifest.json").read_text())
    for key in ("parents", "created_at", "tosca_mlmt_version", "git_sha", "config", "models", "task", "seeds",
                "sampling", "packages", "rows", "files", "strategies", "summary"):
        assert key in m, key
    assert m["task"]["verifier_version"] == ArithTask.verifier_version and len(m["task"]["problem_ids"]) == 2
    assert m["summary"]["environment"] == "honest"
    assert set(m["models"]) == {"solver", "writer"} and m["models"]["solver"]["base_sha"]
    assert m["rows"] == {"episodes": 2, "turns": 6}
    assert m["config"]["solver_sampling"]["temperature"] == 0.0
    for k in ("acc_t1", "acc_final", "delta", "wrong_to_right", "right_to_wrong", "tokens_per_s"):
        assert k in m["summary"]
    # metrics file + offline wandb run next to the snapshots
    metrics = list((out / "_logs").glob("*/metrics.jsonl"))
    assert metrics and "collect/acc_t1" in metrics[0].read_text()
    assert list((out / "_logs").glob("*/wandb/offline-run-*"))
    # the sample episodes to read beside the curves, and the leak rate (arith's gold is a number)
    tables = list((out / "_logs").glob("*/wandb/offline-run-*/files/media/table/collect/samples_*.table.json"))
    assert tables and len(json.loads(tables[0].read_text())["data"]) == 2
    assert 0.0 <= m["summary"]["leak_rate"] <= 1.0


def test_same_config_and_seed_greedy_gives_the_same_snapshot_id(greedy_snapshot, tmp_path):
    out, p = greedy_snapshot
    p2 = run_mlmt("collect", "--task", "arith", "--limit", "2", "--engine", "hf", "--out", tmp_path, "--greedy",
                  "--n-samples", "1", "--no-wandb", *DEBUG, check=True)
    assert p2.stdout.strip().splitlines()[-1] == p.stdout.strip().splitlines()[-1]


def test_snapshots_list_show_verify(greedy_snapshot, tmp_path):
    import shutil

    out, p = greedy_snapshot
    sid = p.stdout.strip().splitlines()[-1]
    assert sid in run_mlmt("snapshots", "list", "--root", out, check=True).stdout
    assert json.loads(run_mlmt("snapshots", "show", sid, "--root", out, check=True).stdout)["id"] == sid
    assert run_mlmt("snapshots", "verify", sid, "--root", out).returncode == 0
    copy = tmp_path / "copy"
    shutil.copytree(out / sid, copy / sid)
    f = copy / sid / "turns.parquet"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0xFF
    f.write_bytes(bytes(data))
    bad = run_mlmt("snapshots", "verify", sid, "--root", copy)
    assert bad.returncode != 0 and "turns.parquet" in bad.stderr and "sha256 mismatch" in bad.stderr
    missing = run_mlmt("snapshots", "show", "snap-nope", "--root", out)
    assert missing.returncode == 2 and "no snapshot 'snap-nope'" in missing.stderr


@pytest.mark.parametrize("args, needle", [
    (["--set", "episode.nope=1"], "unknown config field 'episode.nope'"),
    (["--engine", "tgi"], "allowed: hf, vllm"),
    (["--set", "task.level=9"], "task.level"),
])
def test_invalid_config_exits_2_and_writes_nothing(tmp_path, args, needle):
    p = run_mlmt("collect", "--task", "arith", "--limit", "1", "--out", tmp_path / "o", "--no-wandb", *args)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr
    assert not (tmp_path / "o").exists()


def test_malformed_row_names_file_line_field_and_skip_bad_rows_counts_it(tmp_path):
    d = tmp_path / "data" / "gsm8k"
    d.mkdir(parents=True)
    rows = [{"question": "Tom has 2 cats and 3 dogs. How many pets?", "answer": "2+3=5\n#### 5"},
            {"question": "What is 4 times 2?"},
            {"question": "Sam had 9 pens and lost 4. How many are left?", "answer": "9-4=5\n#### 5"}]
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "test.jsonl").write_text("")
    base = ["collect", "--task", "gsm8k", "--data", tmp_path / "data", "--limit", "0", "--n-samples", "1",
            "--greedy", "--no-wandb", *DEBUG]
    p = run_mlmt(*base, "--out", tmp_path / "o")
    assert p.returncode == 2
    assert "train.jsonl:2" in p.stderr and "answer" in p.stderr
    assert not (tmp_path / "o").exists()
    p = run_mlmt(*base, "--out", tmp_path / "o2", "--skip-bad-rows", check=True)
    sid = p.stdout.strip().splitlines()[-1]
    m = json.loads((tmp_path / "o2" / sid / "manifest.json").read_text())
    assert m["task"]["skipped_rows"] == 1 and m["rows"]["episodes"] == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_collect_leaves_no_snapshot(tmp_path, sig):
    out = tmp_path / "o"
    with open(tmp_path / "err.txt", "w") as errf:
        proc = subprocess.Popen([*MLMT, "collect", "--task", "arith", "--limit", "16", "--out", str(out),
                                 "--no-wandb", "--set", "solver_sampling.max_new_tokens=200",
                                 # 16 x 2 episodes of 200-token turns: minutes of generation even on the debug base
                                 "--set", "model.solver=tiny-random"],
                                stdout=subprocess.PIPE, stderr=errf, text=True,
                                # a shell that starts jobs in the background (nohup ... &) hands them
                                # SIGINT ignored, and Python then installs no KeyboardInterrupt handler
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 900  # start-up only; generous for a loaded machine
        while "problems x" not in (tmp_path / "err.txt").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "err.txt").read_text()
            time.sleep(0.5)
        time.sleep(3)  # inside generation
        proc.send_signal(sig)
        try:  # SIGINT unwinds at the next bytecode; a loaded 2-core box can take minutes to get there
            proc.wait(timeout=900)
        finally:
            proc.kill()
    assert proc.returncode != 0
    assert list_snapshots(out) == []
    assert not list(out.glob(".tmp-*")) if out.exists() else True
