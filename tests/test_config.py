"""The config tree, recipe + CLI resolution, env expansion, and the shipped recipes."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import (
    FLAGS,
    SCORER_SHORT_NAMES,
    SECTIONS,
    ConfigError,
    RunConfig,
    expand_env,
    format_help,
    load_config,
    recipe_world_size,
    world_size_from_env,
    _jsonable,
)
from trainer.preflight import PreflightError, validate

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    "lora": ROOT / "configs" / "qwen_image_t2i_lora_8gpu.toml",
    "full": ROOT / "configs" / "qwen_image_t2i_full_8gpu.toml",
    "flowgrpo_cfg": ROOT / "configs" / "qwen_image_t2i_lora_flowgrpo_cfg.toml",
    "sd35m_pickscore": ROOT / "configs" / "sd35m_t2i_lora_pickscore.toml",
    "demo": ROOT / "configs" / "tiny_cpu_demo.toml",
    "flux": ROOT / "configs" / "flux1dev_t2i_lora_pickscore.toml",
    "wan_ocr": ROOT / "configs" / "wan21_t2v_lora_ocr.toml",
    "qwen_edit": ROOT / "configs" / "qwen_image_edit_i2i_lora_8gpu.toml",
    "kontext": ROOT / "configs" / "flux1kontext_i2i_lora_8gpu.toml",
    "tiny_edit": ROOT / "configs" / "tiny_cpu_edit.toml",
    "wan22_pickscore": ROOT / "configs" / "wan22_t2v_lora_pickscore.toml",
}
#: the recipes written for 2 CPU processes (the others for 8 GPUs)
TWO_RANK_RECIPES = {"demo", "tiny_edit"}


def write(tmp_path: Path, text: str, name: str = "r.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------------------ the tree


def test_sections_hold_the_agreed_fields():
    expected = {
        "model": {"train_backend", "generation_task", "model_path", "model_revision", "model_adapter_path"},
        "rollout": {
            "rollout_engine_class_path", "rollout_function_path", "custom_convert_samples_to_train_data_path",
            "custom_reward_post_process_path", "rollout_num_gpus_per_engine", "rollout_batch_size",
            "n_samples_per_prompt", "global_batch_size", "rollout_seed", "generation_seed", "sampling_config",
            "prompt_data", "num_rollout", "engine_batch_size",
        },
        "artifacts": {"artifact_root", "artifact_retention_rollouts"},
        "fsdp": {
            "fsdp_trainable_mode", "fsdp_trainable_attr", "fsdp_param_dtype", "fsdp_reduce_dtype",
            "fsdp_master_dtype", "no_fsdp_reshard_after_forward", "fsdp_activation_checkpointing",
            "fsdp_cpu_offload", "fsdp_load_wave_size", "fsdp_lr_scheduler", "fsdp_debug_fingerprint",
        },
        "lora": {"lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_adapter_mode", "lora_merge_mode"},
        "optim": {"lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "weight_decay",
                  "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"},
        "grpo": {"advantage_estimator", "eps_clip", "eps_clip_high", "num_updates_per_batch", "micro_batch_size",
                 "disable_grpo_std_normalization", "generative_advantage_std_mode", "adv_clip_max", "kl_coef",
                 "use_kl_loss"},
        "reward": {"reward_runtime", "reward_scorer_path", "reward_model_path", "reward_required_components",
                   "reward_component_weights", "reward_endpoint"},
        "sync": {"weight_sync_mode", "weight_sync_wire_dtype", "weight_sync_bucket_size_mb"},
        "colocate": {"colocate", "offload_train", "offload_rollout", "fully_async", "hybrid",
                     "actor_num_gpus_per_node", "actor_num_nodes", "resource"},
        "checkpoint": {"save", "load", "save_interval", "rotate_ckpt", "max_actor_ckpt_to_keep", "async_save", "save_hf"},
        "eval": {"eval_prompt_data", "eval_interval", "n_samples_per_eval_prompt"},
        "logging": {"tensorboard_dir"},
    }
    cfg = RunConfig()
    for sec, names in expected.items():
        have = {f.name for f in dataclasses.fields(getattr(cfg, sec))}
        assert names <= have, (sec, names - have)
    for name in ("use_dynamic_batch_size", "max_tokens_per_gpu", "autoscaler_config", "load_debug_rollout_data",
                 "save_debug_train_data", "use_fault_tolerance"):
        assert name in FLAGS


def test_every_field_is_a_flag_with_help():
    n_fields = sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert len(FLAGS) == n_fields  # names are unique across sections
    for spec in FLAGS.values():
        assert spec.flag == "--" + spec.name.replace("_", "-")
        assert len(spec.help) > 20, spec.name
    text = format_help()
    assert all(spec.flag in text for spec in FLAGS.values())


def test_reference_defaults():
    c = RunConfig()
    assert (c.rollout.generation_seed, c.rollout.rollout_num_gpus_per_engine) == (1234, 1)
    assert c.artifacts.artifact_retention_rollouts == 2
    assert (c.fsdp.fsdp_trainable_mode, c.fsdp.fsdp_trainable_attr) == ("full", "transformer")
    assert (c.fsdp.fsdp_param_dtype, c.fsdp.fsdp_reduce_dtype, c.fsdp.fsdp_master_dtype) == ("bf16", "fp32", None)
    assert (c.fsdp.fsdp_load_wave_size, c.fsdp.fsdp_lr_scheduler) == (0, "constant")
    assert not (c.fsdp.no_fsdp_reshard_after_forward or c.fsdp.fsdp_activation_checkpointing
                or c.fsdp.fsdp_cpu_offload or c.fsdp.fsdp_debug_fingerprint)
    assert (c.grpo.num_updates_per_batch, c.grpo.micro_batch_size, c.grpo.eps_clip, c.grpo.eps_clip_high) == (1, 1, 0.2, None)
    assert c.optim.clip_grad == 1.0
    assert (c.reward.reward_runtime, c.reward.reward_scorer_path) == ("cpu", None)
    assert (c.sync.weight_sync_mode, c.sync.weight_sync_wire_dtype, c.sync.weight_sync_bucket_size_mb) == ("full", "bf16", 512)
    assert c.model.train_backend == "fsdp"  # deliberate: only fsdp exists here
    # t2i like every tool: the task a model directory of any shipped family draws
    assert c.model.generation_task == "t2i" and c.model.model_path is None


def test_preflight_and_config_import_no_torch():
    code = "import sys, trainer.config, trainer.preflight, trainer.train; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_scorer_short_names_match_the_reward_package():
    from trainer.rewards.base import SHIPPED_SCORERS

    assert SCORER_SHORT_NAMES == SHIPPED_SCORERS


# ------------------------------------------------------------------------------ recipe + CLI


def test_cli_overrides_recipe_and_records_what_was_set(tmp_path):
    r = write(tmp_path, 'lr = 3e-4\neps-clip = 1e-4\nrollout_batch_size = 32\nlora-target-modules = ["to_q", "to_k"]\n')
    cfg = load_config(["--config", str(r), "--lr", "1e-3", "--n-samples-per-prompt", "8"])
    assert cfg.optim.lr == 1e-3  # CLI wins
    assert cfg.grpo.eps_clip == 1e-4  # recipe value kept
    assert cfg.rollout.rollout_batch_size == 32  # underscore key accepted
    assert cfg.lora.lora_target_modules == ["to_q", "to_k"]
    assert cfg.optim.adam_eps == 1e-8  # default kept
    assert {"lr", "eps_clip", "rollout_batch_size", "n_samples_per_prompt", "lora_target_modules"} == set(cfg.explicit)
    cfg2 = load_config(["--config", str(r), "--lr=2e-3"])
    assert cfg2.optim.lr == 2e-3


def test_dict_flags_from_toml_tables_and_cli_json(tmp_path):
    r = write(tmp_path, '[sampling-config]\nheight = 256\neta = 0.7\n\n[reward-component-weights]\npickscore = 1.0\nocr = 0.5\n')
    cfg = load_config(["--config", str(r)])
    assert cfg.rollout.sampling_config == {"height": 256, "eta": 0.7}
    assert cfg.reward.reward_component_weights == {"pickscore": 1.0, "ocr": 0.5}
    # a dict flag on the CLI merges its keys over the recipe's value (null removes one, none drops it)
    cfg = load_config(["--config", str(r), "--sampling-config", '{"width": 128, "eta": null}'])
    assert cfg.rollout.sampling_config == {"height": 256, "width": 128}
    cfg = load_config(["--config", str(r), "--reward-component-weights", '{"ocr": null, "jpeg": 2}'])
    assert cfg.reward.reward_component_weights == {"pickscore": 1.0, "jpeg": 2}
    assert load_config(["--config", str(r), "--sampling-config", "none"]).rollout.sampling_config is None


def test_dict_flag_keys_one_at_a_time(tmp_path):
    """--sampling-config.KEY VALUE, FlowGRPO's --config.sample.num_steps=10: the value is JSON when it
    parses, else a string; several keys (and a JSON object) collect into one patch over the recipe."""
    r = write(tmp_path, '[sampling-config]\nheight = 256\neta = 0.7\nsde_indices = [1, 2]\n')
    cfg = load_config(["--config", str(r), "--sampling-config.num_inference_steps", "10",
                       "--sampling-config.sde_type=dance", "--sampling-config.sde_indices", "[1, 3]",
                       "--sampling-config.eta", "null"])
    assert cfg.rollout.sampling_config == {"height": 256, "num_inference_steps": 10, "sde_type": "dance",
                                           "sde_indices": [1, 3]}
    with pytest.raises(ConfigError, match="--lr.x sets one key of a dict-valued flag, and --lr is not one"):
        load_config(["--lr.x", "1"])
    with pytest.raises(ConfigError, match=r"--sampling-config.eta takes one value"):
        load_config(["--sampling-config.eta", "1", "2"])


def test_list_and_pair_flags(tmp_path):
    cfg = load_config([
        "--reward-required-components", '["pickscore", "ocr"]',
        "--lora-target-modules", "attn.to_q", "attn.to_k",
        "--eval-prompt-data", "a", "a.jsonl", "b", "b.jsonl",
    ])
    assert cfg.reward.reward_required_components == ["pickscore", "ocr"]
    assert cfg.lora.lora_target_modules == ["attn.to_q", "attn.to_k"]
    assert cfg.eval.eval_prompt_data == [("a", "a.jsonl"), ("b", "b.jsonl")]
    with pytest.raises(ConfigError, match="NAME PATH pairs, got an odd number"):
        load_config(["--eval-prompt-data", "a", "a.jsonl", "b"])
    # none drops a recipe's eval sets, and the eval schedule that needs them
    r = write(tmp_path, 'eval-prompt-data = ["a", "a.jsonl"]\neval-interval = 4\n')
    cfg = load_config(["--config", str(r), "--eval-prompt-data", "none"])
    assert (cfg.eval.eval_prompt_data, cfg.eval.eval_interval) == ([], None)
    assert load_config(["--config", str(r), "--eval-prompt-data=none", "--eval-interval", "2"]).eval.eval_interval == 2


def test_eval_pairs_in_toml_flat_or_nested(tmp_path):
    flat = write(tmp_path, 'eval-prompt-data = ["a", "a.jsonl", "b", "b.jsonl"]\n', "flat.toml")
    nested = write(tmp_path, 'eval-prompt-data = [["a", "a.jsonl"], ["b", "b.jsonl"]]\n', "nested.toml")
    want = [("a", "a.jsonl"), ("b", "b.jsonl")]
    assert load_config(["--config", str(flat)]).eval.eval_prompt_data == want
    assert load_config(["--config", str(nested)]).eval.eval_prompt_data == want


def test_bool_flag_forms():
    assert load_config(["--offload-train"]).colocate.offload_train is True
    assert load_config(["--offload-train", "false"]).colocate.offload_train is False
    assert load_config(["--colocate=no"]).colocate.colocate is False
    cfg = load_config(["--offload-train", "--offload-rollout"])
    assert cfg.colocate.offload_train and cfg.colocate.offload_rollout


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lr", "abc"], "--lr expects a number, got 'abc'"),
        (["--save-interval", "2.5"], "--save-interval expects an integer"),
        (["--colocate", "maybe"], "--colocate expects true/false"),
        (["--sampling-config", "{height: 1}"], "--sampling-config expects JSON"),
        (["--sampling-config", "[1, 2]"], "expects a JSON object"),
        (["--lr"], "--lr needs a value"),
        (["--lr", "1", "2"], "--lr takes one value"),
        (["lr", "1"], "unexpected argument 'lr'"),
        (["--config"], "--config needs a recipe path"),
    ],
)
def test_cli_value_errors_name_the_flag(argv, needle):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    assert needle in str(info.value)


# a value outside a flag's choices: refused while parsing, naming the flag, the value and the choices
CHOICE_CASES = [
    (["--fsdp-trainable-mode", "partial"], "--fsdp-trainable-mode 'partial' must be 'full' or 'lora'"),
    (["--weight-sync-wire-dtype", "fp16"], "--weight-sync-wire-dtype 'fp16' must be 'bf16' or 'fp32'"),
    (["--fsdp-lr-scheduler", "step"], "--fsdp-lr-scheduler 'step' must be 'constant', 'linear' or 'cosine'"),
    (["--fsdp-param-dtype", "fp16"], "--fsdp-param-dtype 'fp16' must be 'bf16' or 'fp32'"),
    (["--fsdp-reduce-dtype", "fp16"], "--fsdp-reduce-dtype 'fp16' must be 'bf16' or 'fp32'"),
    (["--fsdp-master-dtype", "fp8"], "--fsdp-master-dtype 'fp8' must be 'bf16' or 'fp32', or none to leave it unset"),
    (["--advantage-estimator", "ppo"], "--advantage-estimator 'ppo' must be 'grpo'"),
    (["--generative-advantage-std-mode", "global"], "--generative-advantage-std-mode 'global' must be 'group', 'batch' or 'none'"),
    (["--reward-runtime", "dedicated"], "--reward-runtime 'dedicated' must be 'cpu', 'colocate' or 'remote' ('dedicated' was removed: use colocate)"),
    (["--train-backend", "megatron"], "--train-backend 'megatron' must be 'fsdp' (only FSDP2 over torchrun ranks exists here"),
    (["--weight-sync-mode", "merged"], "--weight-sync-mode 'merged' must be 'full' or 'adapter'"),
]


@pytest.mark.parametrize("argv, needle", CHOICE_CASES, ids=[c[0][0] for c in CHOICE_CASES])
def test_choices_are_checked_while_parsing(argv, needle, tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    assert str(info.value).startswith(f"command line: {needle}"), str(info.value)
    # the same rule for a recipe and for a resolved tree read back
    flag, value = argv[0][2:], argv[1]
    r = write(tmp_path, f'{flag} = "{value}"\n')
    with pytest.raises(ConfigError, match=re.escape(f"recipe {r}: {needle}")):
        load_config(["--config", str(r)])
    spec = FLAGS[flag.replace("-", "_")]
    with pytest.raises(ConfigError, match=re.escape(needle)):
        RunConfig.from_dict({spec.section: {spec.name: value}})


def test_choices_come_from_the_annotations_and_agree_with_the_code_using_them():
    from trainer.core.dtypes import DTYPES
    from trainer.flow_grpo import STD_MODES
    from trainer.lr_schedule import SCHEDULES

    assert FLAGS["fsdp_lr_scheduler"].choices == SCHEDULES
    assert FLAGS["generative_advantage_std_mode"].choices == STD_MODES
    for name in ("fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_master_dtype", "weight_sync_wire_dtype"):
        assert set(FLAGS[name].choices) <= set(DTYPES), name
    # an optional choice flag is unset with none; every choice is accepted
    assert load_config(["--fsdp-master-dtype", "none"]).fsdp.fsdp_master_dtype is None
    for value in FLAGS["reward_runtime"].choices:
        assert load_config(["--reward-runtime", value]).reward.reward_runtime == value
    assert "--fsdp-trainable-mode (one of full, lora, default \"full\")" in format_help()


def test_unknown_flag_and_key_suggest_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown flag '--n-sample-per-prompt' \(did you mean '--n-samples-per-prompt'\?\)"):
        load_config(["--n-sample-per-prompt", "8"])
    r = write(tmp_path, "rollout-batchsize = 32\n")
    with pytest.raises(ConfigError, match=r"unknown key 'rollout-batchsize' \(did you mean 'rollout-batch-size'\?\)"):
        load_config(["--config", str(r)])
    r = write(tmp_path, "eps_clp = 0.1\n", "u.toml")
    with pytest.raises(ConfigError, match=r"did you mean 'eps-clip'"):
        load_config(["--config", str(r)])
    with pytest.raises(ConfigError, match=r"unknown flag '--zzzz'; "):
        load_config(["--zzzz"])


def test_recipe_structure_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--config", str(write(tmp_path, "lr = = 1\n", "bad.toml"))])
    with pytest.raises(ConfigError, match="'lr' and 'eps-clip'|set the same flag --eps-clip"):
        load_config(["--config", str(write(tmp_path, "eps-clip = 0.1\neps_clip = 0.2\n", "dup.toml"))])
    with pytest.raises(ConfigError, match="'lr' is a table, but --lr is not a dict-valued flag"):
        load_config(["--config", str(write(tmp_path, "[lr]\nvalue = 1\n", "tbl.toml"))])
    with pytest.raises(ConfigError, match=r"sec.toml \[fsdp\]: key 'lr' belongs in \[optim\], not \[fsdp\]"):
        load_config(["--config", str(write(tmp_path, "[fsdp]\nlr = 1e-3\n", "sec.toml"))])
    with pytest.raises(ConfigError, match="--lr expects a number, got 'fast'"):
        load_config(["--config", str(write(tmp_path, 'lr = "fast"\n', "type.toml"))])
    with pytest.raises(ConfigError, match="--rollout-batch-size expects an integer, got 1.5"):
        load_config(["--config", str(write(tmp_path, "rollout-batch-size = 1.5\n", "int.toml"))])


# ------------------------------------------------------------------------------ sectioned recipes


def test_sectioned_recipe_keys_sit_under_their_section(tmp_path):
    r = write(tmp_path, 'eps-clip = 1e-4\n'
                        '[optim]\nlr = 3e-4\nadam_eps = 1e-15\n'
                        '[fsdp]\nfsdp-trainable-mode = "lora"\n'
                        '[colocate]\ncolocate = true\noffload-train = true\n'
                        '[rollout.sampling-config]\nheight = 256\n')
    cfg = load_config(["--config", str(r), "--lr", "1e-3"])
    assert (cfg.optim.lr, cfg.optim.adam_eps, cfg.grpo.eps_clip) == (1e-3, 1e-15, 1e-4)
    assert cfg.fsdp.fsdp_trainable_mode == "lora" and cfg.colocate.offload_train
    assert cfg.rollout.sampling_config == {"height": 256}
    assert {"lr", "adam_eps", "eps_clip", "fsdp_trainable_mode", "colocate", "offload_train",
            "sampling_config"} == set(cfg.explicit)


@pytest.mark.parametrize("text, needle", [
    ("[fsdp]\nlr = 1\n", "r.toml [fsdp]: key 'lr' belongs in [optim], not [fsdp]"),
    ("[fsdp]\nfsdp-param-dtyp = 'fp32'\n", "r.toml [fsdp]: unknown key 'fsdp-param-dtyp' (did you mean 'fsdp-param-dtype'?)"),
    ("[optim]\nlr-warmup = 2\n", "r.toml [optim]: unknown key 'lr-warmup' (did you mean 'lr-warmup-iters'?)"),
    ("[fsdp]\nmicro-batch-sise = 2\n", "unknown key 'micro-batch-sise' (did you mean 'micro-batch-size' in [grpo]?)"),
    ("[optimizer]\nlr = 1\n", "r.toml: unknown key 'optimizer' (did you mean 'optim'?)"),
    ("lr = 1\n[optim]\nlr = 2\n", "'[optim] lr' and 'lr' set the same flag --lr"),
    ("[optim.lr]\nvalue = 1\n", "r.toml [optim]: 'lr' is a table, but --lr is not a dict-valued flag"),
    ("[fsdp]\nfsdp-param-dtype = 'fp16'\n", "r.toml [fsdp]: --fsdp-param-dtype 'fp16' must be 'bf16' or 'fp32'"),
])
def test_sectioned_recipe_errors_name_the_file_section_and_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(write(tmp_path, text))])
    assert needle in str(info.value) and str(tmp_path) in str(info.value), str(info.value)


def _toml(value) -> str:
    """A TOML value for a recipe value (None is never written: it is every optional flag's default)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def sectioned(flat: dict) -> str:
    """A flat recipe's {key: value} rewritten with every key under its section."""
    by_section: dict[str, list[str]] = {}
    for key, value in flat.items():
        spec = FLAGS[key.replace("-", "_")]
        by_section.setdefault(spec.section, []).append(f"{key} = {_toml(value)}")
    return "".join(f"[{sec}]\n" + "\n".join(lines) + "\n\n" for sec, lines in by_section.items())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_shipped_recipes_load_the_same_sectioned(name, recipe_env, tmp_path):
    import tomllib

    flat = tomllib.loads(RECIPES[name].read_text())
    text = sectioned(flat)
    assert len(re.findall(r"^\[[a-z]+\]$", text, re.M)) > 3  # really spread over several sections
    as_sections = write(tmp_path, text, f"{name}_sectioned.toml")
    want = load_config(["--config", str(RECIPES[name])], env=recipe_env)
    got = load_config(["--config", str(as_sections)], env=recipe_env)
    assert got.to_dict() == want.to_dict() and got.explicit == want.explicit


@pytest.mark.parametrize("name, extra", [("demo", []), ("lora", ["--lr", "1e-4", "--num-rollout", "7"]),
                                         ("full", ["--eps-clip", "2e-4"])])
def test_a_runs_recipe_record_reproduces_its_config(name, extra, recipe_env, tmp_path):
    """Parse a recipe, write the run's recipe record the way the loop does, load the record back
    with --config: every resolved field is the same, and preflight says the same of both."""
    from types import SimpleNamespace

    from trainer.loop import Trainer
    from trainer.sampling import parse_sampling_config

    argv = ["--config", str(RECIPES[name]), *extra, "--artifact-root", str(tmp_path / "artifacts")]
    cfg = load_config(argv, env=recipe_env)
    world = recipe_world_size(cfg)
    run = SimpleNamespace(rank=0, cfg=cfg, recipe_name=name, world=world,
                          num_groups=cfg.rollout.rollout_batch_size,
                          sampling=parse_sampling_config(cfg.rollout.sampling_config))
    record = Trainer.write_recipe_record(run)
    assert record.suffix == ".json" and record.parent == tmp_path / "artifacts" / "recipes"
    back = load_config(["--config", str(record)], env={})  # resolved values: nothing to expand
    for sec in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, sec)):
            assert getattr(getattr(back, sec), f.name) == getattr(getattr(cfg, sec), f.name), (sec, f.name)
    assert back == cfg
    assert validate(back, world) == validate(cfg, world)
    # the command line still overrides the record
    assert load_config(["--config", str(record), "--lr", "5e-5"]).optim.lr == 5e-5


def test_the_documented_sectioned_example_loads(tmp_path):
    doc = (ROOT / "docs" / "configuration.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", doc, re.S)
    text = "\n".join(line[2:] if line.startswith("  ") else line for line in block.splitlines())
    cfg = load_config(["--config", str(write(tmp_path, text))])
    assert (cfg.rollout.rollout_batch_size, cfg.optim.lr) == (4, 3e-4)
    assert cfg.rollout.sampling_config == {"num_inference_steps": 8, "sde_indices": [1, 3, 5]}


def test_a_json_recipe_must_be_a_record(tmp_path):
    with pytest.raises(ConfigError, match="is JSON but not a recipe record"):
        load_config(["--config", str(write(tmp_path, '{"lr": 1e-3}', "flat.json"))])
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(["--config", str(write(tmp_path, '{"config": ', "bad.json"))])
    r = write(tmp_path, json.dumps({"config": {"optim": {"lr": 1e-3}, "fsdp": {"lr": 1.0}}}), "rec.json")
    with pytest.raises(ConfigError, match=r"rec.json \[fsdp\]: key 'lr' belongs in \[optim\]"):
        load_config(["--config", str(r)])


# ------------------------------------------------------------------------------ env expansion


def test_env_expansion(tmp_path):
    r = write(
        tmp_path,
        'model-path = "${MODEL_DIR}/Qwen-Image"\n'
        'save = "${EXP_DIR:-runs/x}/ckpt"\n'
        'save-interval = "${EVERY}"\n'
        'eval-prompt-data = ["ps", "${DATA_DIR}/eval.jsonl"]\n'
        '[sampling-config]\nsample_id_mode = "${MODE}"\n',
    )
    env = {"MODEL_DIR": "/m", "EVERY": "5", "DATA_DIR": "/d", "MODE": "metadata"}
    cfg = load_config(["--config", str(r)], env=env)
    assert cfg.model.model_path == "/m/Qwen-Image"
    assert cfg.checkpoint.save == "runs/x/ckpt"  # default used when unset
    assert cfg.checkpoint.save_interval == 5  # a string value for an int flag is parsed after expansion
    assert cfg.eval.eval_prompt_data == [("ps", "/d/eval.jsonl")]
    assert cfg.rollout.sampling_config == {"sample_id_mode": "metadata"}
    assert load_config(["--config", str(r)], env={**env, "EXP_DIR": "/e"}).checkpoint.save == "/e/ckpt"


def test_unset_env_var_names_the_variable_and_key(tmp_path):
    r = write(tmp_path, 'model-path = "${MODEL_DIR}/Qwen-Image"\n')
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(r)], env={})
    msg = str(info.value)
    assert "MODEL_DIR is not set" in msg and "'model-path'" in msg
    # overriding the key on the command line means the recipe's value is never expanded
    cfg = load_config(["--config", str(r), "--model-path", "/elsewhere"], env={})
    assert cfg.model.model_path == "/elsewhere"


def test_expand_env_leaves_other_dollars_alone():
    assert expand_env("cost $5 and ${A}", "x", {"A": "a"}) == "cost $5 and a"


# ------------------------------------------------------------------------------ derived values


def test_derived_values_follow_the_reference():
    cfg = load_config(["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--num-rollout", "10",
                       "--num-updates-per-batch", "2", "--lora-adapter-mode",
                       "--rollout-engine-class-path", "sglang", "--reward-scorer-path", "ocr"])
    assert cfg.rollout.global_batch_size == 256
    assert cfg.sync.weight_sync_mode == "adapter"
    assert cfg.grpo.generative_advantage_std_mode == "group"
    assert cfg.optim.lr_decay_iters == 20
    assert cfg.rollout.rollout_engine_class_path == "trainer.engine.sglang_engine.SGLangEngine"
    assert cfg.reward.reward_scorer_path == "trainer.rewards.ocr.OcrScorer"
    assert load_config(["--disable-grpo-std-normalization"]).grpo.generative_advantage_std_mode == "none"
    # explicit values are never overwritten by a derivation
    cfg = load_config(["--lora-adapter-mode", "--weight-sync-mode", "full", "--global-batch-size", "7",
                       "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"])
    assert cfg.sync.weight_sync_mode == "full" and cfg.rollout.global_batch_size == 7


def test_to_dict_is_json_and_round_trips():
    cfg = load_config(["--eval-prompt-data", "a", "a.jsonl", "--sampling-config", '{"eta": 0.7}', "--lr", "3e-4"])
    d = cfg.to_dict()
    assert list(d) == list(SECTIONS)
    assert json.loads(json.dumps(d)) == d
    assert d["eval"]["eval_prompt_data"] == [["a", "a.jsonl"]]
    assert RunConfig.from_dict(d) == cfg
    flags = cfg.to_flags()
    assert flags["lr"] == 3e-4 and "eval-prompt-data" in flags and len(flags) == len(FLAGS)
    with pytest.raises(ConfigError):
        RunConfig.from_dict({"optim": {"learning_rate": 1.0}})


def test_world_size_sources():
    assert world_size_from_env({"WORLD_SIZE": "8"}) == 8
    assert world_size_from_env({}) is None
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        world_size_from_env({"WORLD_SIZE": "eight"})
    assert recipe_world_size(RunConfig()) is None
    assert recipe_world_size(load_config(["--actor-num-gpus-per-node", "4", "--actor-num-nodes", "2"])) == 8
    assert recipe_world_size(load_config(["--actor-num-gpus-per-node", "4"])) == 4


# ------------------------------------------------------------------------------ shipped recipes


@pytest.fixture
def recipe_env(tmp_path):
    """MODEL_DIR / DATA_DIR / EXP_DIR pointing at temp dirs holding every file the recipes name."""
    models, data, exp = tmp_path / "models", tmp_path / "data", tmp_path / "exp"
    for d in (models / "Qwen-Image", models / "stable-diffusion-3.5-medium", models / "FLUX.1-dev",
              models / "PickScore_v1", data / "processed" / "t2i", exp / "demo-base"):
        d.mkdir(parents=True)
    for name in ("pickapic_train", "pickapic_eval256", "pickapic_eval64"):
        (data / "processed" / "t2i" / f"{name}.jsonl").write_text('{"prompt": "a red panda in a teacup", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    (models / "Wan2.1-T2V-1.3B-Diffusers").mkdir()
    (models / "Wan2.2-T2V-A14B-Diffusers").mkdir()
    (data / "processed" / "t2v").mkdir()
    (data / "processed" / "t2v" / "ocr_train.jsonl").write_text(
        '{"prompt": "a sign that says \\"open\\"", "metadata": {"task": "t2v", "sample_id": "p0"}}\n')
    (data / "processed" / "t2v" / "pickapic_train.jsonl").write_text(
        '{"prompt": "a red panda in a teacup", "metadata": {"task": "t2v", "sample_id": "p0"}}\n')
    (exp / "data").mkdir()
    for name in ("demo_train", "demo_eval"):
        (exp / "data" / f"{name}.jsonl").write_text('{"prompt": "a red square", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    # the edit recipes: their model directories, and records whose source image exists beside them
    for d in (models / "Qwen-Image-Edit-2511", models / "FLUX.1-Kontext-dev", exp / "tiny-edit",
              data / "processed" / "i2i" / "media"):
        d.mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (16, 16), (200, 30, 30)).save(data / "processed" / "i2i" / "media" / "src.png")
    (exp / "data" / "media").mkdir()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(exp / "data" / "media" / "src.png")
    edit = '{"prompt": "<image> make it blue", "images": ["media/src.png"], "metadata": {"task": "i2i", "sample_id": "e0"}}\n'
    for path in (data / "processed" / "i2i" / "train.jsonl", data / "processed" / "i2i" / "eval.jsonl",
                 exp / "data" / "train.jsonl"):
        path.write_text(edit)
    return {"MODEL_DIR": str(models), "DATA_DIR": str(data), "EXP_DIR": str(exp)}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_shipped_recipes_pass_preflight(name, recipe_env):
    cfg = load_config(["--config", str(RECIPES[name])], env=recipe_env)
    world = recipe_world_size(cfg)
    assert world == (2 if name in TWO_RANK_RECIPES else 8)
    assert validate(cfg, world) == []
    assert validate(cfg, None) == []
    # the same recipe on a smaller torchrun world is the same training, and preflight says how
    # the ranks share it out
    if world > 1:
        report = validate(cfg, world // 2)
        assert len(report) == 1 and "the same training" in report[0], report


def test_lora_recipe_is_the_validated_reference(recipe_env):
    c = load_config(["--config", str(RECIPES["lora"])], env=recipe_env)
    assert (c.rollout.rollout_batch_size, c.rollout.n_samples_per_prompt, c.rollout.global_batch_size) == (32, 8, 256)
    assert (c.grpo.micro_batch_size, c.grpo.num_updates_per_batch, c.grpo.eps_clip) == (1, 2, 1e-4)
    assert (c.rollout.rollout_seed, c.rollout.generation_seed) == (42, 42)
    assert (c.lora.lora_rank, c.lora.lora_alpha, c.lora.lora_dropout, c.lora.lora_adapter_mode) == (64, 128, 0.0, True)
    assert (c.fsdp.fsdp_trainable_mode, c.fsdp.fsdp_master_dtype, c.fsdp.fsdp_load_wave_size) == ("lora", "fp32", 2)
    assert c.fsdp.fsdp_activation_checkpointing and c.colocate.offload_train and c.colocate.offload_rollout
    assert (c.optim.lr, c.optim.lr_warmup_iters, c.optim.adam_eps, c.optim.weight_decay) == (3e-4, 0, 1e-8, 0.0)
    assert c.grpo.generative_advantage_std_mode == "group"
    assert c.sync.weight_sync_mode == "adapter" and c.sync.weight_sync_bucket_size_mb == 2048
    assert (c.reward.reward_runtime, c.reward.reward_required_components) == ("colocate", ["pickscore"])
    assert c.reward.reward_component_weights == {"pickscore": 1.0}
    assert (c.eval.eval_interval, c.eval.n_samples_per_eval_prompt) == (10, 2)
    assert c.eval.eval_prompt_data[0][1].endswith("pickapic_eval256.jsonl")
    assert (c.checkpoint.save_interval, c.checkpoint.max_actor_ckpt_to_keep) == (20, 10)
    assert c.rollout.sampling_config == {
        "height": 384, "width": 384, "num_inference_steps": 12, "guidance_scale": 1.0, "eta": 0.7,
        "sde_type": "sde", "sde_indices": [3, 4, 5], "sde_resample_per_rollout": True, "num_sde_steps": 3,
        "sde_pool": [1, 2, 3, 4, 5], "driver_xt": True, "sample_id_mode": "metadata",
    }


def test_full_recipe_differs_where_the_reference_says(recipe_env):
    lora = load_config(["--config", str(RECIPES["lora"])], env=recipe_env).to_flags()
    full = load_config(["--config", str(RECIPES["full"])], env=recipe_env).to_flags()
    diff = {k for k in lora if lora[k] != full[k]}
    assert diff == {
        "fsdp-trainable-mode", "fsdp-master-dtype", "lora-rank", "lora-alpha", "lora-adapter-mode", "weight-sync-mode",
        "rollout-batch-size", "global-batch-size", "micro-batch-size", "sampling-config", "lr", "lr-warmup-iters",
        "adam-eps", "eval-prompt-data", "max-actor-ckpt-to-keep", "artifact-root", "tensorboard-dir", "save",
    }
    assert (full["rollout-batch-size"], full["global-batch-size"], full["micro-batch-size"]) == (8, 64, 2)
    assert (full["lr"], full["lr-warmup-iters"], full["adam-eps"]) == (3e-5, 20, 1e-15)
    assert full["sampling-config"]["sde_indices"] == [1, 3, 5]
    assert full["max-actor-ckpt-to-keep"] == 2 and full["eval-prompt-data"][0][1].endswith("pickapic_eval64.jsonl")


def test_recipes_hold_no_machine_paths():
    for path in RECIPES.values():
        for line in path.read_text().splitlines():
            value = line.split("#", 1)[0]
            assert not re.search(r'"/|"~|"[A-Za-z]:\\', value), f"{path.name}: {line}"


def test_configuration_doc_lists_every_flag():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [spec.flag for spec in FLAGS.values() if f"`{spec.flag}`" not in doc]
    assert missing == []


def test_configuration_doc_flag_tables_match_the_code():
    """Every flag's row in docs/configuration.md states the code's type, default and help."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    rows = {}
    for line in doc.splitlines():
        m = re.match(r"^\| `(--[a-z0-9-]+)` \| ([^|]+) \| `([^`]*)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3), m.group(4))
    stale = []
    for spec in FLAGS.values():
        kind = spec.kind + (" or unset" if spec.optional else "")
        want = (kind, json.dumps(_jsonable(spec.default)), spec.help)
        if rows.get(spec.flag) != want:
            stale.append((spec.flag, rows.get(spec.flag), want))
    assert stale == []


# The reference's validated LoRA launch block, verbatim but for ${MODEL_DIR} / ${DATA_DIR}.
REFERENCE_LORA_BLOCK = r"""
--resource '{"actor": [1, 8], "rollout": [1, 8]}'
--colocate
--train-backend fsdp
--generation-task t2i
--model-path ${MODEL_DIR}/Qwen-Image
--model-adapter-path relax.models.qwen_image.adapter.QwenImageAdapter
--rollout-engine-class-path relax.backends.sglang.diffusion_engine.SGLangNativeGenerationEngine
--rollout-function-path relax.engine.rollout.native_generation.generate_rollout
--custom-convert-samples-to-train-data-path relax.engine.rollout.native_generation.convert_samples_to_train_data
--custom-reward-post-process-path relax.engine.rewards.generative.post_process
--rollout-batch-size 32
--n-samples-per-prompt 8
--global-batch-size 256
--micro-batch-size 1
--rollout-seed 42
--eval-prompt-data pickscore ${DATA_DIR}/processed/t2i/pickapic_eval256.jsonl
--eval-interval 10
--n-samples-per-eval-prompt 2
--sampling-config '{"height":384,"width":384,"num_inference_steps":12,"guidance_scale":1.0,"eta":0.7,"sde_type":"sde","sde_indices":[3,4,5],"sde_resample_per_rollout":true,"num_sde_steps":3,"sde_pool":[1,2,3,4,5],"driver_xt":true,"sample_id_mode":"metadata"}'
--generation-seed 42
--lora-rank 64
--lora-alpha 128
--lora-dropout 0.0
--lora-adapter-mode          # script default; set ADAPTER_MODE=0 for merge-mode sync validation
--fsdp-trainable-mode lora
--fsdp-trainable-attr transformer
--fsdp-param-dtype bf16
--fsdp-reduce-dtype fp32
--fsdp-master-dtype fp32
--fsdp-activation-checkpointing
--fsdp-load-wave-size 2
--offload-train
--offload-rollout
--advantage-estimator grpo
--eps-clip 1e-4
--generative-advantage-std-mode group
--num-updates-per-batch 2
--lr 3e-4
--lr-warmup-iters 0
--adam-eps 1e-8
--weight-decay 0.0
--reward-runtime colocate
--reward-scorer-path relax.engine.rewards.pickscore.PickScoreScorer
--reward-model-path ${MODEL_DIR}/PickScore_v1
--reward-required-components '["pickscore"]'
--reward-component-weights '{"pickscore":1.0}'
--weight-sync-wire-dtype bf16
--weight-sync-bucket-size-mb 2048
--rollout-num-gpus-per-engine 1
--save ${EXP_DIR}/runs/qwen-image-t2i-lora/
--save-interval 20
--max-actor-ckpt-to-keep 10
"""


def test_reference_command_line_parses_and_names_every_replacement(recipe_env):
    text = "\n".join(line.split("#", 1)[0] for line in REFERENCE_LORA_BLOCK.splitlines())
    for var, value in recipe_env.items():
        text = text.replace("${%s}" % var, value)
    argv = shlex.split(text)
    cfg = load_config(argv)
    assert cfg.rollout.global_batch_size == 256 and cfg.sync.weight_sync_mode == "adapter"
    with pytest.raises(PreflightError) as info:
        validate(cfg, 8)
    flags = sorted(p.split(" ", 1)[0] for p in info.value.problems)
    # every reference-only dotpath is named with what replaces it, plus the run's own
    # required flags that the reference passes elsewhere
    assert flags == sorted([
        "--model-adapter-path", "--rollout-engine-class-path", "--rollout-function-path",
        "--custom-convert-samples-to-train-data-path", "--custom-reward-post-process-path",
        "--reward-scorer-path", "--num-rollout", "--artifact-root", "--prompt-data",
    ]), info.value.problems
    assert "use trainer.models.qwen_image.QwenImageAdapter" in str(info.value)
    assert "use trainer.rewards.pickscore.PickScoreScorer" in str(info.value)


def test_readme_links_and_commands_exist():
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        assert (ROOT / target).exists(), target
    for path in re.findall(r"`(configs/[\w.]+\.toml)`", readme):
        assert (ROOT / path).is_file(), path


def test_wan_recipe_is_flowgrpos(recipe_env):
    """configs/wan21_t2v_lora_ocr.toml holds FlowGRPO's Wan OCR values (docs/video.md's table)."""
    c = load_config(["--config", str(RECIPES["wan_ocr"])], env=recipe_env)
    s = c.rollout.sampling_config
    assert (c.model.generation_task, c.model.model_adapter_path) == ("t2v", "trainer.models.wan.WanAdapter")
    assert (s["num_frames"], s["height"], s["width"], s["num_inference_steps"]) == (33, 240, 416, 20)
    assert (s["sde_type"], s["eta"], s["sde_indices"]) == ("wan", 1.0, list(range(19)))
    assert (s["guidance_scale"], s["negative_prompt"], s["cfg_renorm"]) == (4.5, "", False)
    assert (c.rollout.n_samples_per_prompt, c.grpo.eps_clip, c.optim.lr, c.optim.weight_decay) == (4, 1e-3, 1e-4, 1e-4)
    assert (c.lora.lora_rank, c.lora.lora_alpha, c.reward.reward_scorer_path) == (
        32, 64, "trainer.rewards.video.VideoOcrScorer")


def test_wan22_recipe_is_flow_factorys(recipe_env):
    """configs/wan22_t2v_lora_pickscore.toml holds Flow-Factory's Wan2.2 LoRA values (its header)."""
    c = load_config(["--config", str(RECIPES["wan22_pickscore"])], env=recipe_env)
    s = c.rollout.sampling_config
    assert c.model.model_path.endswith("Wan2.2-T2V-A14B-Diffusers") and c.model.generation_task == "t2v"
    assert (s["num_frames"], s["height"], s["width"], s["num_inference_steps"]) == (5, 480, 480, 10)
    assert (s["guidance_scale"], s["guidance_scale_2"], s["sde_type"], s["eta"]) == (4.0, 3.0, "sde", 0.9)
    assert (s["sde_resample_per_rollout"], s["num_sde_steps"], s["sde_pool"]) == (True, 1, [1, 2, 3])
    assert (c.rollout.rollout_batch_size, c.rollout.n_samples_per_prompt, c.grpo.eps_clip) == (48, 16, 1e-4)
    assert (c.lora.lora_rank, c.lora.lora_alpha, c.optim.lr, c.optim.weight_decay) == (64, 128, 1e-4, 1e-4)
    assert not c.grpo.use_kl_loss and (c.optim.ema_decay, c.optim.clip_grad) == (0.9, 1.0)
