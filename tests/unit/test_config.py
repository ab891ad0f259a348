"""Unit tests of the run config: YAML and the command line, validation, defaults."""

from __future__ import annotations

import pytest
import yaml

from finetune.config import TrainConfig, load_config
from finetune.errors import UsageError


def test_yaml_config_is_overridden_by_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 7\nlearning_rate: 0.01\nmodel: small-gpt2\n")
    cfg = load_config(path, {"max_steps": "9"})
    assert (cfg.max_steps, cfg.learning_rate, cfg.model) == (9, 0.01, "small-gpt2")


def test_unknown_config_key_suggests_the_right_one(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rte: 0.01\n")
    with pytest.raises(UsageError, match="unknown key 'learning_rte'.*did you mean 'learning_rate'"):
        load_config(path, {})


@pytest.mark.parametrize("overrides, problem", [
    ({"max_steps": "-1"}, "--max_steps must be >= 0"),
    ({"block_size": "0"}, "--block_size must be > 0"),
    ({"validation_split": "1.5"}, "--validation_split must be between 0 and 1"),
    ({"learning_rate": "abc"}, "learning_rate: expected float"),
    ({"max_steps": "2.5"}, "max_steps: expected int"),
    ({"task": "translation"}, "--task 'translation' is not supported"),
    ({"max_shard_size": "inf"}, "--max_shard_size 'inf' is not a size"),
    ({"max_shard_size": "nanGB"}, "--max_shard_size 'nanGB' is not a size"),
    ({"dataset": ["builtin", "builtin"], "dataset_weights": ["1e308", "1e308"]}, "a positive, finite sum"),
    ({"dataset": ["builtin", "builtin"], "dataset_weights": ["1", "0"], "mixture_stop": "all_exhausted"},
     "every source must run out"),
    ({"dataset": ["builtin", "builtin"], "dataset_weights": ["1", "1e-9"], "mixture_stop": "all_exhausted"},
     "a share of 1e-09"),
])
def test_bad_values_are_rejected_before_anything_runs(overrides, problem):
    with pytest.raises(UsageError, match=problem):
        load_config(None, overrides)


GRPO = {"method": "grpo", "reward_funcs": ["exact_match"]}


@pytest.mark.parametrize("overrides, problem", [
    ({"method": "grpo"}, "--method grpo needs --reward_funcs"),
    ({**GRPO, "num_generations": "1"}, "a group needs 2 or more completions"),
    ({**GRPO, "per_device_batch_size": "6", "num_generations": "4"}, "pass --per_device_batch_size 4"),
    ({**GRPO, "max_completion_length": "128"}, "leaves no room for a prompt in --block_size 128"),
    ({**GRPO, "reward_weights": ["1", "2"]}, "2 weight\\(s\\) for 1 --reward_funcs"),
    ({**GRPO, "loss_type": "ppo"}, "--loss_type 'ppo' is not supported"),
    ({**GRPO, "beta": "-1"}, "--beta \\(the KL coefficient\\) must be >= 0"),
    ({**GRPO, "top_p": "0"}, "--top_p must be in"),
    ({**GRPO, "data_format": "chat"}, "--method grpo trains on prompts alone"),
    ({"data_format": "prompt"}, "--data_format prompt is what --method grpo or rloo trains on"),
    ({"num_generations": "4"}, "--num_generations is read by --method grpo or rloo, not by --method sft"),
    ({"method": "dpo", "reward_funcs": ["format"]}, "--reward_funcs is read by --method grpo"),
    ({"method": "orpo", "reference_model": "gpt2"}, "--reference_model is read by --method dpo, kto, grpo or rloo, "
                                                    "not by --method orpo; drop --reference_model"),
    ({"method": "dpo", "importance_sampling_level": "sequence"},
     "--importance_sampling_level is read by --method grpo or rloo, not by --method dpo"),
    ({"method": "grpo", "importance_sampling_level": "sentence"}, "--importance_sampling_level 'sentence' is not "
                                                                  "supported; choose one of token, sequence"),
    ({"method": "kto", "per_device_batch_size": "1"}, "KTO's KL estimate pairs each prompt with another row's"),
    ({"method": "kto", "desirable_weight": "0"}, "--desirable_weight must be a positive number"),
    ({"method": "kto", "data_format": "preference"}, "--method kto trains on unpaired completions"),
    ({"method": "rloo", "normalize_advantages": "true"}, "--method rloo needs --reward_funcs"),
    ({"method": "grpo", "reward_funcs": ["format"], "normalize_advantages": "true"},
     "--normalize_advantages is read by --method rloo, not by --method grpo"),
])
def test_an_objectives_options_are_checked_in_its_own_section(overrides, problem):
    with pytest.raises(UsageError, match=problem):
        load_config(None, overrides)


def test_an_objective_that_sets_other_defaults_gets_them_and_says_so_in_help():
    """RLOO starts from TRL's RLOOConfig values, a given value wins, and GRPO keeps its own."""
    rloo = load_config(None, {"method": "rloo", "reward_funcs": ["format"], "per_device_batch_size": "4"})
    assert (rloo.num_generations, rloo.beta) == (2, 0.05)
    given = load_config(None, {"method": "rloo", "reward_funcs": ["format"], "num_generations": "4", "beta": "0"})
    assert (given.num_generations, given.beta) == (4, 0.0)
    grpo = load_config(None, {"method": "grpo", "reward_funcs": ["format"]})
    assert (grpo.num_generations, grpo.beta) == (8, 0.0)


def test_an_objective_option_set_in_a_file_for_another_objective_is_refused(tmp_path):
    """A run config records every option; one the file sets away from its default for an objective that
    does not read it is the user's mistake, not a record."""
    path = tmp_path / "run.yaml"
    path.write_text("method: orpo\nreference_model: gpt2\n")
    with pytest.raises(UsageError, match=f"{path} sets reference_model, which is read by --method dpo"):
        load_config(path, {})
    path.write_text(yaml.safe_dump({**TrainConfig(objective="orpo").to_dict(), "output_dir": str(tmp_path)}))
    assert load_config(path, {}).objective == "orpo"  # a recorded config, every option at its default
    path.write_text("method: dpo\n")  # the name runs recorded before `objective`
    assert load_config(path, {}).objective == "dpo"


def test_grpo_takes_trls_defaults_and_learning_rates():
    cfg = load_config(None, {**GRPO, "model": "path/to/pretrained"})
    assert (cfg.num_generations, cfg.loss_type, cfg.epsilon, cfg.beta, cfg.scale_rewards, cfg.learning_rate) == \
        (8, "dapo", 0.2, 0.0, "group", 1e-6)
    assert load_config(None, {**GRPO, "model": "path/to/pretrained", "peft": "lora"}).learning_rate == 1e-5


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(None, {"max_steps": "11", "overwrite": "true"}).resolved()
    cfg.save(tmp_path / "run_config.yaml")
    assert load_config(tmp_path / "run_config.yaml", {}) == cfg


def test_defaults_follow_what_the_model_is():
    scratch, tuned = load_config(None, {"model": "tiny-gpt2"}), load_config(None, {"model": "path/to/pretrained"})
    assert (scratch.learning_rate, scratch.weight_decay, scratch.adam_beta2, scratch.lr_scheduler_type) == \
        (1e-3, 0.1, 0.95, "cosine_with_min_lr")
    assert (tuned.learning_rate, tuned.weight_decay, tuned.adam_beta2, tuned.lr_scheduler_type, tuned.warmup_ratio) == \
        (5e-5, 0.0, 0.999, "linear", 0.03)
    assert load_config(None, {"model": "path/to/pretrained", "learning_rate": 1e-4}).learning_rate == 1e-4


def test_config_defaults_are_valid():
    TrainConfig().validate()


def test_source_weights_are_the_shares_as_written():
    cfg = TrainConfig(dataset=["a", "b", "c"], dataset_weights=[0.6, 0.3, 0.1])
    assert cfg.source_weights == [0.6, 0.3, 0.1]  # not 0.6000000000000001 in summary.json
    assert TrainConfig(dataset=["a", "b"], dataset_weights=[2, 6]).source_weights == [0.25, 0.75]


def test_reward_code_is_taken_from_the_command_line_only(tmp_path):
    """A config file may come from someone else: its own reward functions run only when the command line names
    them; the built-ins need no such word."""
    path = tmp_path / "run.yaml"
    path.write_text("method: grpo\nreward_funcs: [evil.py:score, format]\n")
    with pytest.raises(UsageError, match="run only when the command line names them: pass --reward_funcs evil.py"):
        load_config(path, {})
    assert load_config(path, {"reward_funcs": ["format"]}).reward_funcs == ["format"]
    path.write_text("method: grpo\nreward_funcs: [format]\n")
    assert load_config(path, {}).reward_funcs == ["format"]


def test_a_refused_resume_change_names_the_runs_own_value_to_pass():
    """Leaving a recorded option out is not always possible (a reward function
    of the user's must be named again): the fix is the run's own value."""
    from finetune.config import resume_changes

    saved = {**TrainConfig(objective="grpo", reward_funcs=["/runs/r.py:score"]).to_dict(), "seed": 7}
    with pytest.raises(UsageError, match=r"resume with the run's own \(--seed 7 --reward_funcs /runs/r.py:score\)"):
        resume_changes(saved, TrainConfig(objective="grpo", reward_funcs=["/elsewhere/r.py:score"]))
