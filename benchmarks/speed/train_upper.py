"""Samples/s of the upper level's updates on the embedded model, and peak memory.

Measures ``UpperLearner.update`` (the exact code ``mlmt train-upper`` runs) in four modes:

* ``q_head``        Q-learning only, Q head on no-grad trunk features (the default warm-up step);
* ``q_head_trunk``  Q-learning with TD gradients into the writer adapter (upper.q_trunk_grad);
* ``q_logits``      ToSCA's LM-logit Q (always trains the adapter);
* ``awr``           Q-learning + AWR on the logged feedback tokens (forward + backward over
                    prompt + feedback: the dominant cost of a train-upper step).

Decisions are built like collect builds them (writer chat template, problem, attempt and
feedback of fixed token lengths) so sequence lengths are controlled; ``--snapshot`` uses
real ones instead. Peak memory is the process's ru_maxrss after each mode (monotone).
Results go to ``benchmarks/results/train_upper/<date>_<variant>.json`` (VARIANT: data source, modes, dtype,
where off their defaults).

    .venv/bin/python -m benchmarks.speed.train_upper --decisions 16 --batch-size 4 --steps 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import time

from benchmarks.common import out_path  # noqa: E402

# the data (snapshot, else synthetic), the modes (where not all four), the dtype (where not float32)
VARIANT = ("data", "modes", "dtype")
MODES = {
    "q_head": {"upper.text_loss": "none"},
    "q_head_trunk": {"upper.text_loss": "none", "upper.q_trunk_grad": True},
    "q_logits": {"upper.text_loss": "none", "upper.q_source": "logits"},
    "awr": {"upper.text_loss": "awr", "upper.warmup_steps": 0},
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=16, help="synthetic decisions in the dataset")
    ap.add_argument("--attempt-tokens", type=int, default=128,
                    help="solver attempt length in the state (collect's default)")
    ap.add_argument("--feedback-tokens", type=int, default=64, help="feedback length (episode.max_feedback_tokens)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one untimed step)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--snapshot", default="", help="use this snapshot's decisions instead of synthetic ones (an id or a unique prefix under --root)")
    ap.add_argument("--root", default="snapshots")
    ap.add_argument("--out", default=None, help="result JSON (default: results/train_upper/<date>_<variant>.json)")
    return ap.parse_args(argv)


def synthetic_transitions(policies, strategies, n: int, attempt_tokens: int, feedback_tokens: int):
    """Decisions shaped like collect's: writer template + problem + attempt ids | strategy | feedback ids."""
    import torch

    from tosca_mlmt.prompts import WRITER_STATE, WRITER_STRATEGY, WRITER_SYSTEM, ChatFormat
    from tosca_mlmt.tasks.arith import generate
    from tosca_mlmt.upper.dataset import Transition

    fmt = ChatFormat(policies.tokenizer("writer"), policies.eos_ids("writer"))
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p = generate(2, i)
        attempt = torch.randint(1000, 20000, (attempt_tokens,), generator=g).tolist()
        pieces = [WRITER_STATE.format(question=p.question), "Student's attempt 1:\n", attempt, "\n\n"]
        a = i % len(strategies)
        ids, cut = fmt.user_prompt_with_ids(WRITER_SYSTEM, pieces + [
            WRITER_STRATEGY.format(instruction=strategies[a]["instruction"])])
        r = float(i % 3 == 0)
        out.append(Transition("synthetic", f"e{i}", 1, "arith/L2", ids, cut[len(pieces) - 1],
                              torch.randint(1000, 20000, (feedback_tokens,), generator=g).tolist(), a,
                              1 / len(strategies), [1 / len(strategies)] * len(strategies), r, True, -1, r, r))
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.policies import PolicyPair
    from tosca_mlmt.upper.learner import UpperLearner

    if args.threads:
        torch.set_num_threads(args.threads)
    base = {"model.dtype": args.dtype, "logging.wandb": False, "upper.batch_size": args.batch_size}
    cfg0 = load_config(overrides=base)
    rss0 = peak_rss_mb()
    t0 = time.perf_counter()
    policies = PolicyPair(cfg0.model, seed=0)
    load_s = time.perf_counter() - t0
    strategies = cfg0.episode.strategies
    if args.snapshot:
        from tosca_mlmt.store import open_snapshot
        from tosca_mlmt.upper.dataset import build_transitions, check_strategies

        snap = open_snapshot(args.root, args.snapshot)  # an id or a unique prefix, at any depth
        strategies = check_strategies([snap.manifest])
        transitions = build_transitions([(snap.id, snap.episodes())])
    else:
        transitions = synthetic_transitions(policies, strategies, args.decisions, args.attempt_tokens,
                                            args.feedback_tokens)
    init = {n: p.detach().clone() for n, p in policies.model("writer").named_parameters() if ".writer." in n}
    results = {}
    for mode in args.modes.split(","):
        with torch.no_grad():  # every mode starts from the same writer
            for n, p in policies.model("writer").named_parameters():
                if n in init:
                    p.copy_(init[n])
        policies.q_head = None
        learner = UpperLearner(load_config(overrides={**base, **MODES[mode]}), policies, transitions, strategies)
        learner.update()  # untimed: first-call allocations
        t = time.perf_counter()
        for _ in range(args.steps):
            learner.update()
        secs = time.perf_counter() - t
        n = args.steps * args.batch_size
        results[mode] = {"samples_per_s": round(n / secs, 3), "s_per_step": round(secs / args.steps, 3),
                         "peak_rss_mb_after": round(peak_rss_mb(), 1)}
        print(f"{mode:>13}: {results[mode]['samples_per_s']:8.3f} decisions/s  "
              f"{results[mode]['s_per_step']:7.2f} s/step  peak RSS {results[mode]['peak_rss_mb_after']:.0f} MiB",
              flush=True)
    lens = [len(t.prompt_ids) + len(t.response_ids) for t in transitions]
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
                    "torch_threads": torch.get_num_threads(), "loadavg": [round(x, 2) for x in os.getloadavg()],
                    "platform": platform.platform(), "torch": torch.__version__,
                    "cuda": torch.cuda.is_available()},
        "model": {"name": cfg0.model.solver, "dtype": str(policies.dtype), "lora_r": cfg0.model.lora.r,
                  "load_s": round(load_s, 2)},
        "data": {"source": args.snapshot or "synthetic", "decisions": len(transitions),
                 "state_tokens_mean": round(sum(t.state_len for t in transitions) / len(transitions), 1),
                 "seq_tokens_mean": round(sum(lens) / len(lens), 1),
                 "feedback_tokens_mean": round(sum(len(t.response_ids) for t in transitions) / len(transitions), 1)},
        "batch_size": args.batch_size, "timed_steps": args.steps,
        "peak_rss_mb_before_model": round(rss0, 1),
        "results": results,
    }
    out = out_path(args.out, "train_upper", VARIANT, data="snapshot" if args.snapshot else None,
                   modes=None if args.modes == ",".join(MODES) else args.modes.replace(",", "-"),
                   dtype=None if args.dtype == "float32" else args.dtype)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
