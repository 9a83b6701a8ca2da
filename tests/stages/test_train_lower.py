"""train-lower as a stage (pipelines/train_lower.py): resume, snapshot training, strategy draws, the
engine it starts and closes."""

from dataclasses import replace

import pytest
import torch

from conftest import restored


@pytest.mark.slow
def test_resume_reaches_the_same_weights_as_an_uninterrupted_run(debug_cfg, debug_policies, tmp_path):
    from tosca_mlmt.pipelines.train_lower import train_lower

    policies = debug_policies
    cfg = replace(debug_cfg, deterministic=True,
                  solver_sampling=replace(debug_cfg.solver_sampling, max_new_tokens=12),
                  task=replace(debug_cfg.task, level=1),
                  lower=replace(debug_cfg.lower, iterations=2, problems_per_iteration=1, save_every=1,
                                minibatch_size=2, lr=1e-2, advantage="gae", keep_snapshots=False))
    model = policies.model("solver")
    init = {n: p.detach().clone() for n, p in model.named_parameters()}

    def reset():
        for n, p in model.named_parameters():
            p.data.copy_(init[n])

    train_lower(cfg, tmp_path / "full", policies=policies)
    full = {n: p.detach().clone() for n, p in model.named_parameters() if ".solver." in n}
    reset()
    train_lower(cfg, tmp_path / "cut", policies=policies, stop_after=1)
    reset()  # a fresh process: initial weights, then --resume loads the checkpoint
    train_lower(cfg, tmp_path / "cut", policies=policies, resume=True)
    resumed = {n: p.detach().clone() for n, p in model.named_parameters() if ".solver." in n}
    reset()
    assert any(not torch.equal(full[n], init[n]) for n in full)
    for n in full:
        assert torch.equal(full[n], resumed[n]), n
    m_full = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    m_cut = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert len(m_full) == len(m_cut) == 2  # nothing repeated, nothing skipped


@pytest.mark.slow
def test_an_iteration_with_nothing_to_train_on_names_the_prompt_limit(debug_cfg, debug_policies, tmp_path):
    from tosca_mlmt.errors import MlmtError
    from tosca_mlmt.pipelines.train_lower import train_lower

    cfg = replace(debug_cfg, episode=replace(debug_cfg.episode, max_prompt_tokens=8),
                  lower=replace(debug_cfg.lower, iterations=1, problems_per_iteration=1))
    with restored({n: p for n, p in debug_policies.model("solver").named_parameters()}):
        with pytest.raises(MlmtError, match=r"iteration 1: all 2 episodes .*episode\.max_prompt_tokens=8"):
            train_lower(cfg, tmp_path / "run", policies=debug_policies)


@pytest.mark.slow
def test_training_from_an_off_policy_snapshot_warns_and_uses_behaviour_logprobs(debug_cfg, debug_policies, tmp_path):
    """A snapshot whose solver fingerprint is another adapter's: the run warns, and PPO's pi_old is the
    logged sampling log-probs (here drawn by these very weights, so the first ratio is ~1). What the
    model knows plays no part: the debug base."""
    from tosca_mlmt.rollout.engines.hf import HFEngine
    from tosca_mlmt.rollout.runner import EpisodeRunner
    from tosca_mlmt.pipelines.train_lower import train_lower
    from tosca_mlmt.store import write_snapshot
    from tosca_mlmt.tasks.arith import ArithTask

    cfg, policies = replace(debug_cfg, lower=replace(debug_cfg.lower, minibatch_size=4)), debug_policies
    task = ArithTask(1)
    eps = EpisodeRunner(cfg, task, HFEngine(policies, 8), policies).run(task.load("train", 1).problems)
    fp = dict(policies.fingerprint("solver"), adapter_sha="someone-else")
    sid, _ = write_snapshot(tmp_path / "snaps", eps, {"models": {"solver": fp}})
    model = policies.model("solver")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = replace(cfg, lower=replace(cfg.lower, iterations=1, problems_per_iteration=1, old_logprobs="behaviour",
                                     advantage="gae"))
    with pytest.warns(UserWarning, match="off-policy"):
        res = train_lower(cfg, tmp_path / "run", snapshot_ids=[sid], snapshot_root=tmp_path / "snaps", policies=policies)
    assert res.iterations == 1 and res.last_metrics["lower/episodes"] == 2
    # behaviour logprobs were sampled by the same weights here, so the first ratio is ~1
    assert res.last_metrics["lower/ratio_mean"] == pytest.approx(1.0, abs=0.05)
    for n, p in model.named_parameters():
        p.data.copy_(before[n])


def test_engine_scored_bonus_is_refused_for_snapshot_training(tiny_cfg, tmp_path):
    """Training from snapshots starts no engine: the run stops before anything loads, naming the knob."""
    from tosca_mlmt.errors import ConfigError
    from tosca_mlmt.pipelines.train_lower import train_lower

    cfg = replace(tiny_cfg, lower=replace(tiny_cfg.lower, bonus=replace(tiny_cfg.lower.bonus, scorer="engine")))
    with pytest.raises(ConfigError, match="lower.bonus.scorer=engine"):
        train_lower(cfg, tmp_path / "run", snapshot_ids=["0123abcd"], snapshot_root=tmp_path)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("temperature,epsilon", [(-1.0, -1.0), (0.25, 0.0), (-1.0, 0.6)])
def test_train_lower_batches_pick_strategies_with_the_lower_temperature_and_epsilon(
        debug_cfg, debug_policies, tmp_path, monkeypatch, temperature, epsilon):
    """lower.strategy_temperature / strategy_epsilon (-1 = the episode's) set how the PPO batches'
    strategies are drawn from the writer's Q; the logged behaviour distribution is
    epsilon / A + (1 - epsilon) softmax(Q / T), computed here by hand for a head whose Q is its bias."""
    import numpy as np
    import torch

    from tosca_mlmt.models.q_head import QHead
    from tosca_mlmt.pipelines import train_lower as tl

    policies = debug_policies
    A = len(debug_cfg.episode.strategies)
    head = QHead(policies.model("writer").config.hidden_size, A)
    q = np.array([0.0, 0.5, 0.0, 2.0, 0.0, -1.0])
    with torch.no_grad():
        head.proj.bias.copy_(torch.tensor(q))
    cfg = replace(debug_cfg, solver_sampling=replace(debug_cfg.solver_sampling, max_new_tokens=8),
                  episode=replace(debug_cfg.episode, strategy_selection="auto", strategy_temperature=1.0,
                                  epsilon=0.3, min_q_decisions=0),
                  lower=replace(debug_cfg.lower, iterations=1, problems_per_iteration=1, minibatch_size=2,
                                advantage="gae", keep_snapshots=False, strategy_temperature=temperature,
                                strategy_epsilon=epsilon))
    seen = []

    class Spy(tl.EpisodeRunner):
        def run(self, *a, **k):
            eps = super().run(*a, **k)
            seen.extend(t.behaviour_probs for ep in eps for t in ep.turns if t.kind == "feedback")
            return eps

    monkeypatch.setattr(tl, "EpisodeRunner", Spy)
    saved = policies.q_head, policies.q_decisions
    policies.q_head, policies.q_decisions = head, 10**6
    # the run trains the session's shared debug solver: later tests expect its adapter untouched
    solver = {n: p for n, p in policies.model("solver").named_parameters() if ".solver." in n}
    try:
        with restored(solver):
            tl.train_lower(cfg, tmp_path / "run", policies=policies)
    finally:
        policies.q_head, policies.q_decisions = saved
    T = 1.0 if temperature == -1 else temperature
    e = 0.3 if epsilon == -1 else epsilon
    soft = np.exp(q / T) / np.exp(q / T).sum()
    want = e / A + (1 - e) * soft
    assert len(seen) == cfg.episode.n_samples and all(np.allclose(p, want, atol=1e-5) for p in seen)


def test_train_lower_closes_the_engine_it_started_also_when_the_update_fails(
        debug_cfg, debug_policies, tmp_path, monkeypatch):
    """train-lower starts its own rollout engine when none is passed; a failing run must still close
    it (an in-process vLLM engine holds the model and its KV cache until closed), and an engine the
    caller passed (train-joint's) stays open for the caller."""
    from tosca_mlmt.pipelines import train_lower as tl
    from tosca_mlmt.rollout.engines.hf import HFEngine

    started = []

    class Engine(HFEngine):
        closed = False

        def close(self):
            self.closed = True

    def make_engine(cfg, pol):
        started.append(Engine(pol, batch_size=8))
        return started[-1]

    def fail(self, trajs, it, timer, engine=None):
        raise FloatingPointError("loss is nan")

    monkeypatch.setattr(tl, "make_engine", make_engine)
    monkeypatch.setattr(tl.LowerLearner, "update", fail)
    cfg = replace(debug_cfg, solver_sampling=replace(debug_cfg.solver_sampling, max_new_tokens=8),
                  lower=replace(debug_cfg.lower, iterations=1, problems_per_iteration=1, minibatch_size=2,
                                keep_snapshots=False))
    with pytest.raises(FloatingPointError):
        tl.train_lower(cfg, tmp_path / "own", policies=debug_policies)
    assert len(started) == 1 and started[0].closed
    mine = Engine(debug_policies, batch_size=8)
    with pytest.raises(FloatingPointError):
        tl.train_lower(cfg, tmp_path / "given", policies=debug_policies, engine=mine)
    assert not mine.closed and len(started) == 1


@pytest.mark.slow
def test_refine_groups_train_every_sampled_refine_and_each_attempt_once(debug_cfg, debug_policies, tmp_path):
    """lower.refine_samples 2: each attempt's feedback is refined twice, both refines are in the batch
    snapshot and in the loss, the shared first attempt once (what lower/loss_tokens counts)."""
    import json

    from tosca_mlmt.pipelines.train_lower import train_lower
    from tosca_mlmt.store import open_snapshot

    cfg = replace(debug_cfg, solver_sampling=replace(debug_cfg.solver_sampling, max_new_tokens=8),
                  episode=replace(debug_cfg.episode, n_samples=2),
                  lower=replace(debug_cfg.lower, iterations=1, problems_per_iteration=2, minibatch_size=4,
                                advantage="grpo", refine_samples=2, lr=1e-2))
    solver = {n: p for n, p in debug_policies.model("solver").named_parameters() if ".solver." in n}
    with restored(solver):  # the debug base's rewards all tie (0), so grpo moves nothing: the mask is the check
        res = train_lower(cfg, tmp_path / "run", policies=debug_policies)
    snaps = [p for p in (res.run_dir / "snapshots").iterdir() if p.name.startswith("snap-")]
    eps = open_snapshot(res.run_dir / "snapshots", snaps[0].name).episodes()
    assert len(eps) == 2 * 2 * 2
    refines = [e.solver_turns[-1] for e in eps]
    assert [t.info["branch"] for t in refines] == [0, 1] * 4
    row = json.loads((res.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    firsts = sum(len(e.solver_turns[0].response_ids) for e in eps if e.solver_turns[-1].info["branch"] == 0)
    assert row["lower/loss_tokens"] == firsts + sum(len(t.response_ids) for t in refines)
    assert row["lower/refine_group_frac_reward_zero_std"] == 1.0  # the debug base's refines all score 0
    # the batch replayed from its snapshot: both problems' groups whole, every branch of every attempt
    with restored(solver):
        again = train_lower(cfg, tmp_path / "offline", policies=debug_policies, snapshot_ids=[snaps[0].name],
                            snapshot_root=res.run_dir / "snapshots")
    assert again.last_metrics["lower/episodes"] == len(eps)
    assert again.last_metrics["lower/loss_tokens"] == row["lower/loss_tokens"]


def test_a_replayed_batch_takes_whole_problem_groups():
    """Training from snapshots: an iteration replays lower.problems_per_iteration problems' groups
    (their turn-1 samples and every refine branch), cycling; cut by episode count, a group of 2 samples x
    2 branches would split, and the second half's first branch would train a shared turn 1 again."""
    import copy

    from factories import make_episodes
    from tosca_mlmt.lower.trajectory import episode_to_trajectory, to_tensors
    from tosca_mlmt.pipelines.train_lower import problem_groups, replay_batch
    from tosca_mlmt.records import Episode
    from tosca_mlmt.rollout.runner import branch_episodes

    firsts = make_episodes(3)
    eps = [e if s == 0 else Episode(f"{e.problem.id}/s{s}", e.problem, s, copy.deepcopy(e.turns))
           for e in firsts for s in range(2)]
    eps = branch_episodes(eps, 2)
    for i, ep in enumerate(eps):
        ep.turns[-1].info["branch"] = i % 2
    groups = problem_groups(eps)
    assert [len(g) for g in groups] == [4, 4, 4]
    ids = [[e.problem.id for e in replay_batch(groups, i, 2)] for i in range(3)]
    pid = [e.problem.id for e in firsts]
    assert ids == [[pid[0]] * 4 + [pid[1]] * 4, [pid[2]] * 4 + [pid[0]] * 4, [pid[1]] * 4 + [pid[2]] * 4]
    trajs = [episode_to_trajectory(e) for e in replay_batch(groups, 1, 2)]
    s1, e1 = trajs[0].turn_spans[0]
    # turn 1 trained once per attempt: 2 problems x 2 samples
    assert (to_tensors(trajs, pad_id=0).mask[:, s1:e1].sum(1) > 0).sum().item() == 4
