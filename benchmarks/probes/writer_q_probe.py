"""Can a linear Q head on the writer's state features learn which strategy suits which attempt?

Offline, on a finished train-joint run: the run's final writer computes h(s) of every logged
decision of every round's collect snapshot; linear Q heads (standardised features, the train-upper
losses for a one-round episode: (Q(s, a) - r)^2 + alpha * CQL) are fitted on 4/5 of the decisions and
their greedy choices scored on the held-out fifth (5 folds). A choice is scored by the tabular mean
reward of its (first attempt right or wrong, strategy) cell over all decisions, the best a writer that
only knew the verdict could do. Printed beside it: that best tabular policy and the uniform one.
Fitted with h(s) alone and with the first attempt's correctness appended as a feature (as the
verdict environment's writer reads it in its prompt).

    python -m benchmarks.probes.writer_q_probe --run /tmp/tosca-bench-efficacy/verdict-.../mlmt/seed0/run --label verdict-mlmt-seed0

Writes benchmarks/results/writer_q_probe/<date>_<label>.json (VARIANT).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from benchmarks.common import result_path  # noqa: E402

VARIANT = ("label",)


def features(run: Path, reward: str, break_penalty: float):
    """(h [N, H], actions [N], rewards [N], first attempt right [N], strategy names) of every logged decision."""
    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.features import writer_state_features
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.store import open_snapshot
    from tosca_mlmt.upper.dataset import build_transitions

    manifest = json.loads((run / "manifest.json").read_text())
    sources, right = [], {}
    for r in manifest["rounds"]:
        if not r.get("snapshot"):
            continue
        snap = open_snapshot(run / "snapshots", r["snapshot"])
        eps = list(snap.episodes())
        sources.append((snap.id, eps))
        right.update({(snap.id, e.episode_id): bool(e.solver_turns[0].correct) for e in eps})
    trans = build_transitions(sources, reward_mode=reward, break_penalty=break_penalty)
    cfg = load_config(overrides={"model.writer_adapter": str(run / "writer"), "model.dtype": "float32"})
    policies = PolicyPair(cfg.model, seed=0)
    with torch.no_grad(), policies.use("writer") as model:
        h = torch.cat([writer_state_features(model, [t.state_ids for t in trans[i:i + 16]], policies.pad_id("writer"))
                       for i in range(0, len(trans), 16)])
    names = [s["name"] for s in (policies.strategies or cfg.episode.strategies)]
    return (h.float(), torch.tensor([t.action for t in trans]), torch.tensor([t.reward for t in trans]).float(),
            torch.tensor([right[(t.snapshot_id, t.episode_id)] for t in trans]).long(), names)


def fit_q(x: torch.Tensor, a: torch.Tensor, r: torch.Tensor, rows: torch.Tensor, n_actions: int, steps: int,
          lr: float, alpha: float, batch: int, seed: int) -> torch.Tensor:
    """Q [N, A] of every row from a linear head fitted on ``rows`` (standardised as QHead does)."""
    g = torch.Generator().manual_seed(seed)
    std = x[rows].std(0)
    z = (x - x[rows].mean(0)) / std.clamp_min(float(0.1 * std.median()))
    w = torch.zeros(x.shape[1], n_actions, requires_grad=True)
    b = torch.zeros(n_actions, requires_grad=True)
    opt = torch.optim.AdamW([w, b], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        idx = rows[torch.randint(len(rows), (batch,), generator=g)]
        q = z[idx] @ w + b
        qa = q.gather(1, a[idx, None]).squeeze(1)
        loss = (qa - r[idx]).pow(2).mean() + alpha * (torch.logsumexp(q, 1) - qa).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (z @ w + b).detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="a finished train-joint run folder")
    ap.add_argument("--label", required=True)
    ap.add_argument("--reward", default="improvement")
    ap.add_argument("--break-penalty", type=float, default=0.5)
    ap.add_argument("--alpha", type=float, default=0.5, help="CQL weight (upper.cql_alpha)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--folds", type=int, default=5)
    args = ap.parse_args()
    h, a, r, right, names = features(Path(args.run), args.reward, args.break_penalty)
    n, n_actions = len(a), len(names)
    cell = np.zeros((2, n_actions))
    count = np.zeros((2, n_actions))
    np.add.at(cell, (right.numpy(), a.numpy()), r.numpy())
    np.add.at(count, (right.numpy(), a.numpy()), 1)
    mean = cell / np.maximum(count, 1)
    share = np.bincount(right.numpy(), minlength=2) / n
    folds = np.array_split(np.random.default_rng(0).permutation(n), args.folds)
    fits = []
    for name, x in (("h", h), ("h+first_attempt_right", torch.cat([h, right[:, None].float()], 1))):
        for steps, lr in ((120, 1e-4), (120, 1e-3), (2000, 1e-4), (2000, 1e-3)):
            values, picks = [], np.zeros((2, n_actions), dtype=int)
            for k in range(args.folds):
                test = folds[k]
                train = torch.tensor(np.concatenate([folds[j] for j in range(args.folds) if j != k]))
                choice = fit_q(x, a, r, train, n_actions, steps, lr, args.alpha, args.batch, k)[test].argmax(1).numpy()
                values.append(float(np.mean(mean[right.numpy()[test], choice])))
                np.add.at(picks, (right.numpy()[test], choice), 1)
            fits.append({"features": name, "steps": steps, "lr": lr, "held_out_value": float(np.mean(values)),
                         "picks_when_right": dict(zip(names, picks[1].tolist())),
                         "picks_when_wrong": dict(zip(names, picks[0].tolist()))})
            print(f"{name:<22}{steps:>6} steps, lr {lr:g}: held-out value {np.mean(values):+.4f}")
    report = {"benchmark": "writer_q_probe", "date": dt.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.machine()} {os.cpu_count()} cores", "load_avg": os.getloadavg(),
              "run": str(args.run), "args": vars(args), "decisions": n, "strategies": names,
              "decisions_per_cell": {"right": dict(zip(names, count[1].astype(int).tolist())),
                                     "wrong": dict(zip(names, count[0].astype(int).tolist()))},
              "mean_reward_per_cell": {"right": dict(zip(names, mean[1].round(4).tolist())),
                                       "wrong": dict(zip(names, mean[0].round(4).tolist()))},
              "best_tabular_value": float((mean.max(1) * share).sum()),
              "uniform_value": float((mean.mean(1) * share).sum()), "fits": fits}
    print(f"best tabular {report['best_tabular_value']:+.4f}, uniform {report['uniform_value']:+.4f}")
    out = result_path("writer_q_probe", VARIANT, label=args.label)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
