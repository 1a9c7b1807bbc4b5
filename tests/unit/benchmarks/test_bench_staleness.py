"""`miles bench staleness`, its pieces: the buffer settings that make each cell's staleness happen (on
the real DataBuffer), the cell configs the run accepts, equal trained samples, and the last line."""

from collections import deque
from pathlib import Path

import pytest

from benchmarks import staleness as bench
from miles.buffer.data_buffer import BufferConfig, DataBuffer
from miles.buffer.types import Group, Sample
from miles.config import load_config
from miles.run_config import RunConfig
from miles.data.prompts import PromptSource, TaskConfig

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "arithmetic"


def collected_staleness(max_staleness: int, pps: int, steps: int) -> tuple[list[list[int]], float]:
    """Trainer steps on the real DataBuffer with the cell's settings, against an engine faster than the
    trainer (as on the benchmark's machine): each step's groups' staleness, and the groups dropped as
    too stale. The engine is stepped in turn with the trainer, so the interleaving is exact."""
    over = bench.run_ahead(max_staleness, pps)
    buf = DataBuffer(BufferConfig(max_staleness=int(over["buffer.max_staleness"]),
                                  max_inflight_groups=int(over["buffer.max_inflight_groups"]),
                                  capacity=int(over["buffer.capacity"]), filter="none"),
                     PromptSource(TaskConfig(), "train", seed=0))
    finished: deque[Group] = deque()  # generated, waiting for room in the buffer; equal lengths finish in order

    def engine():
        """Start every prompt admission allows (under the weights held now); land finished groups while
        there is room, each landing freeing an in-flight slot for the next prompt."""
        while True:
            while (prompt := buf.admit(timeout=0)) is not None:
                finished.append(Group(samples=[Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.1],
                                                      loss_mask=[1], reward=0.0, weight_versions=[buf.weight_version],
                                                      prompt_index=prompt.index)], prompt_index=prompt.index))
            if not finished or ready() >= buf.cfg.capacity:
                return
            assert buf.put(finished.popleft()) == (None, None)

    def ready() -> int:
        return int(buf.metrics(reset=False)["buffer/ready"])

    per_step = []
    for v in range(steps):
        engine()  # training outlasts generation: the rollout is as far ahead as the settings allow
        got: list[Group] = []
        while len(got) < pps:
            assert ready(), "the trainer would wait for data it can never get"
            got += buf.get(min(ready(), pps - len(got)))
            engine()  # groups started while the trainer collects run under the version it collects at
        per_step.append([buf.policy_version - g.oldest_weight_version for g in got])
        buf.set_policy_version(v + 1)
        buf.set_weight_version(v + 1)  # the push after the step
    return per_step, buf.metrics()["buffer/dropped_stale"]


@pytest.mark.parametrize("max_staleness", [1, 4, 8])
def test_each_cell_trains_groups_exactly_its_bound_old_once_the_rollout_is_ahead(max_staleness):
    per_step, dropped = collected_staleness(max_staleness, pps=3, steps=max_staleness + 4)
    # The first steps train what the rollout produced while it ran ahead; from then on every group is
    # as stale as the bound allows and no group is generated only to be dropped as too stale.
    assert per_step == [[min(k, max_staleness)] * 3 for k in range(max_staleness + 4)]
    assert dropped == 0


@pytest.mark.parametrize("objective", list(bench.OBJECTIVES))
def test_every_cell_config_is_a_run_the_loader_accepts(objective, tiny_model_dir):
    over = {"model.path": tiny_model_dir, **bench.cell_overrides(4, objective, 32, 9)}
    cfg = load_config(RunConfig, EXAMPLE / "grpo.toml", over)
    assert cfg.loop.schedule == "fully_async" and cfg.loop.num_steps == 9
    assert (cfg.buffer.max_staleness, cfg.buffer.max_inflight_groups, cfg.buffer.capacity) == (4, 32, 96)
    a = cfg.trainer.algorithm
    keys = ("sequence_weight", "m2_threshold", "group_reweight", "behav_kl_coef")
    options = tuple(getattr(a, k, None) for k in keys)
    assert (a.name, a.tis_mode, options) == {
        "grpo_tis": ("grpo", "truncate", (None, None, None, None)),
        "decoupled_ppo": ("decoupled_ppo", "off", (False, 0.0, False, 1.0)),
        "decoupled_ppo_areal": ("decoupled_ppo", "off", (False, 0.0, False, 0.0)),
        "decoupled_ppo_seq": ("decoupled_ppo", "off", (True, 0.0, False, 0.0)),
        "decoupled_ppo_seq_m2": ("decoupled_ppo", "off", (True, 0.04, False, 0.0)),
        "decoupled_ppo_m2": ("decoupled_ppo", "off", (False, 0.04, False, 0.0)),
        "decoupled_ppo_reweighted": ("decoupled_ppo", "off", (False, 0.0, True, 0.0))}[objective]


def test_cells_train_at_least_the_samples_sync_trained_in_whole_steps():
    # Sync keeps only groups with signal (2240 samples over 10 steps); a fully_async step trains 32 × 8.
    assert bench.steps_for_samples(2240, 32, 8) == 9
    assert bench.steps_for_samples(2048, 32, 8) == 8
    assert bench.steps_for_samples(0, 32, 8) == 1


def test_the_last_line_averages_seeds_and_gives_the_decoupled_gap_at_staleness_4():
    def run(acc, hist, capped=None):
        steps = [{f"buffer/staleness/{k}": n for k, n in h.items()} | {"buffer/samples_trained": 256} for h in hist]
        for r, c in zip(steps, capped or []):
            r["decoupled_ppo/clipped_frac_weight_cap"] = c
        return bench.figures({"eval_accuracy_after": acc, "eval_accuracy_before": 0.6, "wall_time_s": 1.0}, steps)

    sync = [run(0.70, [{0: 32}]), run(0.74, [{0: 32}])]
    cells = {(4, "decoupled_ppo"): [run(0.70, [{0: 32}, {1: 32}], [0.0, 0.02]),
                                    run(0.72, [{3: 16, 4: 16}, {4: 32}], [0.02, 0.04])],
             (4, "grpo_tis"): [run(0.66, [{4: 32}]), run(0.66, [{4: 32}])]}
    line = bench.table(sync, cells)
    assert line["sync_eval_accuracy"] == pytest.approx(0.72)
    d4, g4 = line["cells"]
    assert (d4["max_staleness"], d4["objective"]) == (4, "decoupled_ppo")
    assert d4["eval_accuracy"] == pytest.approx(0.71) and d4["eval_accuracy_per_seed"] == [0.70, 0.72]
    # Mean staleness over every trained group of a run (by the histogram), then over seeds.
    assert d4["mean_staleness"] == pytest.approx((0.5 + (3 * 16 + 4 * 48) / 64) / 2)
    assert d4["max_staleness_seen"] == 4
    assert d4["weights"] == {"decoupled_ppo/clipped_frac_weight_cap": pytest.approx(0.02)}  # over steps, then seeds
    assert line["gap_points_decoupled_s4"] == pytest.approx(1.0)
    assert g4["gap_points"] == pytest.approx(6.0)
    assert line["gap_points_s4"] == {"decoupled_ppo": pytest.approx(1.0), "grpo_tis": pytest.approx(6.0)}
    assert line["sync_trained_samples"] == 256


def test_bad_options_are_refused_naming_the_option(capsys):
    for argv, named in ((["--only", "ppo"], "--only"), (["--staleness", "0,4"], "--staleness"),
                        (["--seeds", "a"], "--seeds"), (["--minibatches", "0"], "--minibatches"),
                        (["--threads", "0"], "--threads"),
                        (["--set", "trainer.lr"], "--set")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert named in capsys.readouterr().err


def test_set_overrides_every_cell_and_leaves_sync_alone_threads_reach_every_run(monkeypatch, tmp_path, capsys):
    # The runs themselves are stood in for (the test checks what each is configured with, not training).
    import miles.orchestration.ray_cluster as ray_cluster

    configured: dict[str, dict] = {}

    def rl_run(model, out, name, over):
        configured[name] = over
        steps = [{"buffer/staleness/0": 27, "buffer/samples_trained": 216}] * int(over["loop.num_steps"])
        return {"eval_accuracy_after": 0.5, "eval_accuracy_before": 0.4, "wall_time_s": 1.0}, steps

    monkeypatch.setattr(bench, "rl_run", rl_run)
    monkeypatch.setattr(bench, "warm_start", lambda out, path, preset, steps: Path(path))
    monkeypatch.setattr(ray_cluster, "ensure_ray", lambda cfg: None)
    assert bench.main(["--sft-model", str(tmp_path), "--steps", "4", "--staleness", "4", "--only", "decoupled_ppo",
                       "--set", "trainer.algorithm.behav_kl_coef=0.3", "--threads", "2", "--out", str(tmp_path)]) == 0
    assert configured["decoupled_ppo-s4-seed0"]["trainer.algorithm.behav_kl_coef"] == "0.3"
    assert configured["decoupled_ppo-s4-seed0"]["loop.num_steps"] == "4"  # 864 samples in whole steps of 256
    assert "trainer.algorithm.behav_kl_coef" not in configured["sync-seed0"]
    for run in configured.values():  # --threads reaches every run, sync included
        assert (run["trainer.num_threads"], run["rollout.engine.num_threads"]) == ("2", "2")
    assert '"cell_overrides": {"trainer.algorithm.behav_kl_coef": "0.3"}' in capsys.readouterr().out
