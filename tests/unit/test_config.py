import pytest
import yaml

from looprl.config import ConfigError, load_config


def test_defaults_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_size: 4\ntask:\n  digits: 2\n")
    cfg = load_config(path, ["rollout.group_size=8", "task.operators=[+]", "model.path=/m"])
    assert cfg.rollout.group_size == 8  # override beats the file
    assert cfg.task.digits == 2
    assert cfg.task.operators == ["+"]
    assert cfg.model.path == "/m"
    assert cfg.rollout.batch_size == 8  # untouched default


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.grop_size=3", r"rollout\.grop_size: unknown field; did you mean 'group_size'"),
        ("rollout.group_size=abc", r"rollout\.group_size='abc'"),
        ("rollout.group_size=0", r"rollout\.group_size=0: .*greater than or equal to 1"),
        ("sampling.top_p=2", r"sampling\.top_p=2"),
        ("train.algorithm=ppo2", r"train\.algorithm='ppo2'"),
        ("nosuchsection.x=1", r"nosuchsection: unknown field"),
        ("rollout.group_size=80", r"rollout: group_size=80 > max_concurrent_rollouts=64"),
        ("rollout.dynamic_filtering=true", r"rollout: dynamic_filtering=true needs group_size"),
        ("train.mismatch_correction=clip", r"train\.mismatch_correction='clip'"),
        ("train.objective=ppo2", r"train\.objective='ppo2'"),
        ("train.behavior_weight_cap=5", r"train\.behavior_weight_cap: unknown field"),
        (
            "train.mismatch_floor=0.5",
            r"train: mismatch_floor=0.5 applies to mismatch_correction=mis only, not tis",
        ),
        ("train.mismatch_floor=5", r"train: mismatch_floor=5 must be below mismatch_cap=5"),
        (
            "train.mismatch_correction=none",
            r"train\.mismatch_correction=none with rollout\.max_head_offpolicyness=2",
        ),
        ("train.algorithm=distill", r"train: algorithm=distill needs train\.teacher_path"),
        ("train.teacher_path=t", r"teacher_path='t' is used by algorithm=distill only, not grpo"),
        (
            "metrics.backends=[jsonl,tensorbord]",
            r"metrics\.backends\.1='tensorbord': Input should be 'jsonl'",
        ),
        (
            "train.overlong.soft_penalty_buffer_tokens=49",
            r"soft_penalty_buffer_tokens=49 is longer than sampling\.max_new_tokens=48",
        ),
    ],
)
def test_bad_values_name_the_field_and_value(override, expected):
    extra = {
        "rollout.dynamic_filtering=true": ["rollout.group_size=1"],
        "train.mismatch_floor=0.5": ["train.mismatch_correction=tis"],
        "train.mismatch_correction=none": ["rollout.max_head_offpolicyness=2"],
    }.get(override, [])
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override, *extra])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["rollout.group_size"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_resolved_config_is_saved_and_reloads_identically(tmp_path):
    cfg = load_config(None, [f"run.fileroot={tmp_path}", "train.lr=3e-5"])
    path = cfg.save()
    assert path == tmp_path / "default" / "trial0" / "config.yaml"
    again = load_config(path)
    assert again == cfg
    assert yaml.safe_load(path.read_text())["train"]["lr"] == 3e-5


def test_hang_timeout_sits_between_the_rollout_and_the_collective_timeouts():
    with pytest.raises(ConfigError) as slow_rollouts:
        load_config(None, ["diagnostics.hang_timeout_s=100"])
    assert str(slow_rollouts.value) == (
        "invalid config:\n  diagnostics.hang_timeout_s=100 must be above rollout.timeout_s=300: "
        "a batch waiting on slow rollouts would be reported as a hang; raise "
        "diagnostics.hang_timeout_s (0 turns the watchdog off)"
    )
    with pytest.raises(ConfigError, match="hang_timeout_s=1000 must be below collective_timeout_s"):
        load_config(None, ["diagnostics.hang_timeout_s=1000"])
    assert load_config(None, ["diagnostics.hang_timeout_s=0"]).diagnostics.hang_timeout_s == 0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["engine.tensor_parallel_size=2"],
            "engine.tensor_parallel_size=2 applies to engine.type=vllm or sglang, not local",
        ),
        (
            ["engine.type=vllm", "engine.max_batch_size=8"],
            "engine.max_batch_size=8 applies to the local engine only",
        ),
        (
            ["engine.type=vllm", "engine.url=http://10.0.0.5:8000", "engine.max_model_len=4096"],
            "engine.max_model_len=4096 is a launch option, but engine.url connects to a server",
        ),
        (
            ["engine.type=sglang", "engine.kv_cache_gib=8"],
            "engine.kv_cache_gib=8 is a vLLM option; SGLang sizes its KV cache by "
            "engine.gpu_memory_fraction",
        ),
        (
            ["engine.type=vllm", "engine.url=10.0.0.5:8000"],
            "engine.url='10.0.0.5:8000' must start with http:// or https://",
        ),
        (["engine.type=tgi"], "engine.type='tgi'"),
        (["engine.type=vllm", "engine.gpu_memory_fraction=1.5"], "gpu_memory_fraction=1.5"),
    ],
)
def test_engine_options_must_fit_the_engine_type(overrides, expected):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert expected in str(error.value)


def test_remote_engine_options_round_trip_through_the_saved_config(tmp_path):
    cfg = load_config(
        None,
        [
            "engine.type=vllm",
            "engine.server_args=[--enforce-eager]",
            "engine.kv_cache_gib=2",
            f"run.fileroot={tmp_path}",
        ],
    )
    assert cfg.engine.server_args == ["--enforce-eager"] and cfg.engine.kv_cache_gib == 2
    assert load_config(cfg.save()) == cfg  # every field written, none rejected on reload


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["scheduler.trainer_ranks=2"], "scheduler.trainer_ranks=2 needs scheduler.type=ray"),
        (["scheduler.engine_replicas=3"], "scheduler.engine_replicas=3 needs scheduler.type=ray"),
        (["scheduler.allocation=local:d1+fsdp:d2"], "needs scheduler.type=ray"),
        (
            ["scheduler.type=ray", "engine.type=vllm", "scheduler.weight_sync=broadcast"],
            "engine.type=vllm servers load weight folders",
        ),
    ],
)
def test_scale_out_fields_are_refused_where_they_cannot_apply(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_ray_takes_replicas_and_ranks():
    cfg = load_config(None, ["scheduler.type=ray", "scheduler.trainer_ranks=2"])
    assert cfg.scheduler.trainer_ranks == 2 and cfg.scheduler.weight_sync == "auto"


@pytest.mark.parametrize(
    ("overrides", "clip"),
    [
        ([], (0.2, 0.2)),  # PPO
        (["train.objective=gspo"], (3e-4, 4e-4)),  # GSPO v2, section 5.1
        (["train.objective=cispo"], (1.0, 4.0)),  # no lower bound, a cap of 5
        (["train.objective=gspo", "train.eps_clip=1e-3"], (1e-3, 1e-3)),
        (["train.objective=cispo", "train.eps_clip_high=7"], (1.0, 7.0)),
        (["train.eps_clip=0.1", "train.eps_clip_high=0.3"], (0.1, 0.3)),
    ],
)
def test_clip_range_defaults_to_the_objectives_paper_values(overrides, clip):
    assert load_config(None, overrides).train.clip_range() == clip


def test_mismatch_correction_none_is_fine_when_synchronous():
    cfg = load_config(None, ["train.mismatch_correction=none"])
    assert cfg.train.mismatch_correction == "none" and cfg.rollout.max_head_offpolicyness == 0


def test_reward_section_names_its_fields():
    cfg = load_config(None, ["reward.type=code", "reward.code.tests_field=test_list"])
    assert cfg.reward.type == "code" and cfg.reward.code.tests_field == "test_list"
    assert load_config(None, []).reward.type == "function"
    with pytest.raises(ConfigError, match=r"reward.code.timeout: unknown field; did you mean"):
        load_config(None, ["reward.code.timeout=3"])
    with pytest.raises(ConfigError, match=r"reward.judge.prompt cannot be filled in"):
        load_config(None, ["reward.judge.prompt=Rate {answr}"])
    # A saved config's earlier isolations: the strongest one is now the box; the opt-in
    # to less must be asked for by its new name.
    for earlier in ("auto", "namespaces"):
        cfg = load_config(None, [f"reward.code.isolation={earlier}"])
        assert cfg.reward.code.isolation == "bubblewrap"
    with pytest.raises(ConfigError, match=r"'rlimits' is now 'unisolated'"):
        load_config(None, ["reward.code.isolation=rlimits"])
    with pytest.raises(ConfigError, match=r"reward.type=judge scores the built-in workflow"):
        load_config(None, ["reward.type=judge", "workflow.path=my.agent:Agent"])
