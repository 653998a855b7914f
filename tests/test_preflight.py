"""Preflight: every rule fires on its own, several at once are listed in one error,
and a clean config passes with no warnings."""

from __future__ import annotations

import json

import pytest

from trainer.config import load_config
from trainer.preflight import HEADER, PreflightError, validate

SAMPLING = {"height": 64, "width": 64, "num_inference_steps": 8, "eta": 0.7, "sde_indices": [1, 2, 3]}
LORA = ["--fsdp-trainable-mode", "lora", "--lora-rank", "8", "--fsdp-master-dtype", "fp32"]


@pytest.fixture
def base(tmp_path):
    """argv of a valid 2-rank config whose paths all exist under tmp_path.

    16 candidates (4 prompts x 4) -> 8 per rank -> 2 updates of 4 -> micro-batches of 2.
    """
    model = tmp_path / "models" / "Qwen-Image"
    pick = tmp_path / "models" / "PickScore_v1"
    model.mkdir(parents=True)
    pick.mkdir()
    train = tmp_path / "train.jsonl"
    evalf = tmp_path / "eval.jsonl"
    train.write_text('{"prompt": "a red panda in a teacup", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    evalf.write_text('{"prompt": "a lighthouse at dusk", "metadata": {"task": "t2i", "sample_id": "p0"}}\n')
    return [
        "--generation-task", "t2i",
        "--model-path", str(model),
        "--prompt-data", str(train),
        "--num-rollout", "3",
        "--actor-num-gpus-per-node", "2",
        "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4",
        "--num-updates-per-batch", "2",
        "--micro-batch-size", "2",
        "--sampling-config", json.dumps(SAMPLING),
        "--eps-clip", "1e-4",
        "--reward-scorer-path", "pickscore",
        "--reward-model-path", str(pick),
        "--reward-required-components", '["pickscore"]',
        "--reward-component-weights", '{"pickscore": 1.0}',
        "--artifact-root", str(tmp_path / "artifacts"),
        "--eval-prompt-data", "pickscore", str(evalf),
        "--eval-interval", "2",
        "--save", str(tmp_path / "ckpt"),
        "--save-interval", "2",
    ]


def problems(argv, world_size=None) -> list[str]:
    """The violation lines for argv ([] when it passes)."""
    try:
        validate(load_config(argv), world_size)
    except PreflightError as exc:
        assert str(exc).startswith(HEADER)
        assert str(exc).count("\n  - ") == len(exc.problems)
        return exc.problems
    return []


def warnings_of(argv, world_size=None) -> list[str]:
    return validate(load_config(argv), world_size)


def test_base_config_passes_without_warnings(base):
    assert warnings_of(base) == []
    assert warnings_of(base + LORA) == []
    assert warnings_of(base, world_size=2) == []


# (extra flags, substring every listed line must contain one of, number of lines).
# "{tmp}" is replaced by the test's tmp_path.
ERROR_CASES = [
    # the reference's list
    (["--generation-task", "i2v"], ["--generation-task 'i2v' is not in GENERATION_TASKS"], 1),
    (["--generation-task", "none"], ["--generation-task None is not in GENERATION_TASKS"], 1),
    (["--model-adapter-path", ""], ["--model-adapter-path is required"], 1),
    (["--model-path", "none"], ["--model-path is required"], 1),
    (["--fsdp-trainable-mode", "lora", "--fsdp-master-dtype", "fp32"], ["needs --lora-rank > 0"], 1),
    (["--lora-rank", "8"], ["--lora-rank 8 without --fsdp-trainable-mode lora"], 1),
    (LORA + ["--lora-dropout", "0.1"], ["--lora-dropout 0.1: must be 0.0"], 1),
    (LORA + ["--fsdp-cpu-offload"], ["--fsdp-cpu-offload is rejected under --fsdp-trainable-mode lora"], 1),
    (["--fsdp-frozen-params", "replicate", "--fsdp-cpu-offload"], ["--fsdp-frozen-params replicate with --fsdp-cpu-offload"],
     1),
    (
        ["--weight-sync-mode", "adapter"],
        ["--weight-sync-mode 'adapter' under --fsdp-trainable-mode full", "--weight-sync-mode adapter needs --lora-adapter-mode"],
        2,
    ),
    (LORA + ["--lora-adapter-mode", "--weight-sync-mode", "full"], ["--lora-adapter-mode with an explicit --weight-sync-mode full"], 1),
    (LORA + ["--weight-sync-mode", "adapter"], ["--weight-sync-mode adapter needs --lora-adapter-mode"], 1),
    (["--sampling-config", json.dumps({**SAMPLING, "sde_indices": [0, 2]})], ["key 'sde_indices' [0, 2] trains step 0"], 1),
    (
        ["--sampling-config", json.dumps({**SAMPLING, "sde_resample_per_rollout": True, "num_sde_steps": 2, "sde_pool": [0, 1, 2]})],
        ["key 'sde_pool' [0, 1, 2] lets the per-rollout redraw pick step 0"],
        1,
    ),
    (
        ["--sampling-config", json.dumps({"num_inference_steps": 12, "eta": 0.7, "num_sde_steps": 3, "sde_timestep_fraction": [0.0, 0.5]})],
        ["key 'sde_timestep_fraction' [0.0, 0.5] over 12 steps starts at step 0"],
        1,
    ),
    (["--fully-async"], ["--fully-async is rejected"], 1),
    (["--hybrid"], ["--hybrid is rejected"], 1),
    (["--colocate", "false"], ["--colocate false is rejected: actor and engine time-share every device here"], 1),
    (["--kl-coef", "0.01"], ["--kl-coef 0.01 without --use-kl-loss"], 1),
    (["--use-kl-loss"], ["--use-kl-loss with --kl-coef 0 adds nothing"], 1),
    (["--kl-coef", "-1", "--use-kl-loss"], ["--kl-coef must be >= 0"], 1),
    (["--kl-coef", "0.04", "--use-kl-loss", "--fsdp-trainable-mode", "full"],
     ["--use-kl-loss with --fsdp-trainable-mode full"], 1),
    (["--rollout-num-gpus-per-engine", "0"], ["--rollout-num-gpus-per-engine must be >= 1"], 1),
    (
        ["--rollout-num-gpus-per-engine", "3"],
        ["--rollout-num-gpus-per-engine 3 does not divide the actor world size 2", "only 1 is supported"],
        2,
    ),
    (["--rollout-num-gpus-per-engine", "2"], ["--rollout-num-gpus-per-engine 2: each rank runs its own"], 1),
    (["--reward-required-components", '["pickscore", "ocr"]'], ["--reward-required-components 'ocr' has no --reward-component-weights entry"], 1),
    (["--use-dynamic-batch-size"], ["--use-dynamic-batch-size is rejected"], 1),
    (["--max-tokens-per-gpu", "4096"], ["--max-tokens-per-gpu 4096 is rejected"], 1),
    (["--autoscaler-config", "{}"], ["--autoscaler-config {} is rejected"], 1),
    (["--save-hf", "{tmp}/hf"], ["--save-hf {tmp}/hf is rejected: export a committed checkpoint offline"], 1),
    (["--load-debug-rollout-data", "{tmp}/x.pt"], ["--load-debug-rollout-data {tmp}/x.pt is rejected"], 1),
    # ours: dotpaths and hooks
    (
        ["--model-adapter-path", "relax.models.qwen_image.adapter.QwenImageAdapter"],
        ["relax.* modules do not exist here; use trainer.models.qwen_image.QwenImageAdapter"],
        1,
    ),
    (["--model-adapter-path", "QwenImageAdapter"], ["is not a dotpath of the form package.module.Class"], 1),
    (["--model-adapter-path", "trainer.models.no_such_family.Adapter"], ["module file trainer/models/no_such_family.py does not exist"], 1),
    (["--reward-scorer-path", "trainer.rewards.nope.Scorer"], ["module file trainer/rewards/nope.py does not exist"], 1),
    (
        ["--rollout-function-path", "relax.engine.rollout.native_generation.generate_rollout"],
        ["--rollout-function-path relax.engine.rollout.native_generation.generate_rollout is rejected: the rollout stage"],
        1,
    ),
    (["--custom-convert-samples-to-train-data-path", "a.b"], ["--custom-convert-samples-to-train-data-path a.b is rejected"], 1),
    (["--custom-reward-post-process-path", "a.b"], ["--custom-reward-post-process-path a.b is rejected"], 1),
    # ours: candidate split
    (["--global-batch-size", "12"], ["--global-batch-size 12 != --rollout-batch-size 4 x --n-samples-per-prompt 4 = 16"], 1),
    (["--actor-num-gpus-per-node", "3"], ["= 16 candidates do not divide evenly over 3 ranks"], 1),
    (["--num-updates-per-batch", "3"], ["--num-updates-per-batch 3 does not divide the 8 candidates per rank"], 1),
    (["--micro-batch-size", "3"], ["--micro-batch-size 3 does not divide the 4 candidates of each update"], 1),
    (["--rollout-batch-size", "none"], ["--rollout-batch-size is required"], 1),
    (["--n-samples-per-prompt", "0"], ["--n-samples-per-prompt must be >= 1, got 0"], 1),
    (["--num-updates-per-batch", "0"], ["--num-updates-per-batch must be >= 1, got 0"], 1),
    (["--micro-batch-size", "0"], ["--micro-batch-size must be >= 1, got 0"], 1),
    (["--num-rollout", "0"], ["--num-rollout must be >= 1, got 0"], 1),
    (["--engine-batch-size", "-1"], ["--engine-batch-size must be >= 0"], 1),
    (["--max-sequence-length", "0"], ["--max-sequence-length must be >= 1, got 0"], 1),
    (["--max-sequence-length", "2048"], ["--max-sequence-length 2048 is more than trainer.models.qwen_image.QwenImageAdapter "
                                         "allows (1024 text tokens"], 1),
    # ours: paths
    (["--prompt-data", "{tmp}/missing.jsonl"], ["--prompt-data {tmp}/missing.jsonl: does not exist"], 1),
    (["--prompt-data", "{tmp}"], ["--prompt-data {tmp}: is not a file"], 1),
    (["--model-path", "{tmp}/no-model"], ["--model-path {tmp}/no-model: does not exist"], 1),
    (["--reward-model-path", "none"], ["--reward-model-path is required"], 1),
    (["--reward-model-path", "{tmp}/no-pickscore"], ["--reward-model-path {tmp}/no-pickscore: does not exist"], 1),
    (["--eval-prompt-data", "ps", "{tmp}/no-eval.jsonl"], ["--eval-prompt-data ps {tmp}/no-eval.jsonl: does not exist"], 1),
    (["--load", "{tmp}/no-ckpt"], ["--load {tmp}/no-ckpt: does not exist"], 1),
    (["--artifact-root", "none"], ["--artifact-root is required"], 1),
    (["--artifact-writer-queue", "-1"], ["--artifact-writer-queue must be >= 0 (0 writes artifacts synchronously), got -1"], 1),
    # ours: numbers (a value outside a flag's choices is a parse error: tests/test_config.py)
    (["--eps-clip", "0"], ["--eps-clip must be > 0"], 1),
    (["--eps-clip-high", "-0.1"], ["--eps-clip-high must be > 0"], 1),
    (["--lr", "0"], ["--lr must be a finite number > 0"], 1),
    (["--min-lr", "1"], ["--min-lr 1.0 must be in [0, --lr"], 1),
    (["--adam-beta2", "1.0"], ["--adam-beta2 must be in [0, 1)"], 1),
    (["--adam-eps", "0"], ["--adam-eps must be > 0"], 1),
    (["--clip-grad", "0"], ["--clip-grad must be > 0"], 1),
    (["--ema-decay", "1.0"], ["--ema-decay must be in [0, 1) (0 = no EMA), got 1.0"], 1),
    (["--ema-decay", "-0.1"], ["--ema-decay must be in [0, 1)"], 1),
    (["--ema-decay", "0.9", "--ema-update-interval", "0"], ["--ema-update-interval must be >= 1, got 0"], 1),
    (["--ema-update-interval", "8"], ["--ema-update-interval 8 has no effect without an EMA: set --ema-decay"], 1),
    (["--eval-use-ema"], ["--eval-use-ema needs an EMA to evaluate: set --ema-decay"], 1),
    (["--weight-decay", "-1"], ["--weight-decay must be >= 0"], 1),
    (["--fsdp-lr-scheduler", "cosine", "--lr-decay-iters", "0"], ["--lr-decay-iters must be >= 1"], 1),
    (["--fsdp-load-wave-size", "-1"], ["--fsdp-load-wave-size must be >= 0"], 1),
    (["--weight-sync-bucket-size-mb", "0"], ["--weight-sync-bucket-size-mb must be >= 1"], 1),
    (
        ["--disable-grpo-std-normalization", "--generative-advantage-std-mode", "batch"],
        ["--disable-grpo-std-normalization contradicts --generative-advantage-std-mode batch"],
        1,
    ),
    (["--lora-adapter-mode"], ["--lora-adapter-mode / --lora-merge-mode need --fsdp-trainable-mode lora", "--weight-sync-mode 'adapter' under"], 2),
    (LORA + ["--lora-adapter-mode", "--lora-merge-mode"], ["--lora-adapter-mode and --lora-merge-mode are exclusive"], 1),
    (LORA + ["--lora-target-modules", "[]"], ["--lora-target-modules is an empty list"], 1),
    # ours: reward
    (["--reward-runtime", "remote"], ["--reward-runtime remote needs --reward-endpoint"], 1),
    (["--reward-scorer-path", "none"], ["--reward-scorer-path is required unless --reward-runtime remote"], 1),
    (["--reward-component-weights", '{"pickscore": "high"}'], ["--reward-component-weights 'pickscore': weight must be a finite number"], 1),
    # ours: eval / checkpoints
    (["--eval-interval", "0"], ["--eval-interval must be >= 1"], 1),
    (["--n-samples-per-eval-prompt", "0"], ["--n-samples-per-eval-prompt must be >= 1"], 1),
    (["--eval-prompt-data", "a", "{tmp}/train.jsonl", "a", "{tmp}/eval.jsonl"], ["--eval-prompt-data names must be unique"], 1),
    (["--save", "none"], ["--save-interval needs --save DIR"], 1),
    (["--rotate-ckpt"], ["--rotate-ckpt needs --max-actor-ckpt-to-keep"], 1),
    (["--max-actor-ckpt-to-keep", "0"], ["--max-actor-ckpt-to-keep must be >= 1"], 1),
    # ours: placement / Ray-only flags
    (["--resource", '{"actor": [1, 2], "rollout": [1, 1]}'], ["--resource actor [1, 2] != rollout [1, 1]"], 1),
    (["--resource", '{"actor": [1, 4], "rollout": [1, 4]}'], ["--resource actor [1, 4] = 4 devices but the world size is 2"], 1),
    (["--resource", '{"actor": [1, 2], "rollout": [1, 2], "critic": [1, 1]}'], ["--resource has unknown roles ['critic']"], 1),
    (["--rollout-num-gpus", "4"], ["--rollout-num-gpus 4 != world size 2"], 1),
    (["--actor-num-nodes", "0"], ["--actor-num-nodes must be >= 1"], 1),
    (["--use-fault-tolerance"], ["--use-fault-tolerance is rejected"], 1),
    (["--use-wandb"], ["--use-wandb is rejected", "wandb sync --sync-tensorboard <tensorboard-dir>/<recipe name>"], 1),
    (["--use-clearml"], ["--use-clearml is rejected"], 1),
    # ours: sampling config problems folded in
    (["--sampling-config", json.dumps({**SAMPLING, "guidance_scale": 0.5})],
     ["key 'guidance_scale': must be a number >= 1.0"], 1),
    (
        ["--sampling-config", json.dumps({**SAMPLING, "eta": -1, "heigth": 64})],
        ["key 'heigth': unknown key (did you mean 'height'?)", "key 'eta': must be a number >= 0"],
        2,
    ),
    (["--sampling-config", json.dumps({"eta": 0.7})], ["--sampling-config trains no SDE step"], 1),
    (["--sampling-config", "none"], ["--sampling-config trains no SDE step"], 1),
]


@pytest.mark.parametrize("extra, needles, count", ERROR_CASES, ids=[" ".join(c[0])[:60] for c in ERROR_CASES])
def test_each_rule_on_its_own(base, tmp_path, extra, needles, count):
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    needles = [n.replace("{tmp}", str(tmp_path)) for n in needles]
    got = problems(base + extra)
    assert len(got) == count, got
    for needle in needles:
        assert any(needle in line for line in got), (needle, got)


def test_every_unsupported_flag_is_reported_at_once(base):
    """One argv setting every flag of UNSUPPORTED_FLAGS to something other than its default: each
    rejected one is one error line, each no-effect one a warning, and nothing else is reported."""
    from trainer.config import FLAGS, UNSUPPORTED_FLAGS

    values = {"bool": None, "float": "0.5", "int": "7", "str": "x.y", "dict": '{"a": 1}'}
    argv = []
    for name in UNSUPPORTED_FLAGS:
        spec = FLAGS[name]
        argv += [spec.flag, "false"] if spec.default is True else [spec.flag] + ([values[spec.kind]] if values[spec.kind] else [])
    cfg = load_config(base + argv)
    with pytest.raises(PreflightError) as info:
        validate(cfg)
    rejected = sorted(FLAGS[n].flag for n, why in UNSUPPORTED_FLAGS.items() if why.rejected)
    assert sorted(p.split(" ", 1)[0] for p in info.value.problems) == rejected, info.value.problems
    for name, why in UNSUPPORTED_FLAGS.items():
        assert any(why.reason in p for p in info.value.problems) == why.rejected, name
    cfg_warn = load_config(base + [a for n in UNSUPPORTED_FLAGS if not UNSUPPORTED_FLAGS[n].rejected
                                   for a in (FLAGS[n].flag, *([] if FLAGS[n].kind == "bool" else ["x.pt"]))])
    warns = validate(cfg_warn)
    assert sorted(w.split(" ", 1)[0] for w in warns) == sorted(
        FLAGS[n].flag for n, why in UNSUPPORTED_FLAGS.items() if not why.rejected)
    # an empty string is unset, like none
    assert problems(base + ["--rollout-function-path", "", "--save-hf", "none"]) == []


def test_sglang_engine_takes_any_wire_dtype(base):
    """The SGLang engine copies the sent tensors into its parameters itself (any dtype; fp32 keeps
    CPU runs exact), so the wire dtype is never a problem of the engine choice."""
    for dtype in ("fp32", "bf16"):
        got = problems(base + ["--rollout-engine-class-path", "sglang", "--weight-sync-wire-dtype", dtype])
        assert not any("--weight-sync-wire-dtype" in p for p in got), got


def test_another_torchrun_world_trains_the_same_recipe_and_says_how(base):
    # the recipe names 2 ranks (16 candidates, 2 updates, micro-batch 2); on 4 the same training
    assert problems(base, world_size=4) == []
    report = [w for w in warnings_of(base, world_size=4) if "the recipe names 2 ranks" in w]
    assert len(report) == 1 and "the same training" in report[0] and "2 optimizer steps per rollout" in report[0]
    assert "4 ranks replay 2 candidates each in 1 micro-batch of 2" in report[0], report
    # a world that cannot share an update out says so, naming the recipe's own
    got = problems(base + ["--micro-batch-size", "4"], world_size=4)
    assert len(got) == 1 and "(the recipe names 2)" in got[0] and "--micro-batch-size 4" in got[0], got
    # without actor flags the torchrun world decides the split: 16 over 4 ranks -> 4 per rank,
    # 2 per update, micro-batch 2: fine; over 3 ranks it does not divide
    no_actor = base + ["--actor-num-gpus-per-node", "none"]
    assert problems(no_actor, world_size=4) == []
    got = problems(no_actor, world_size=3)
    assert len(got) == 1 and "do not divide evenly over 3 ranks" in got[0], got


def test_unknown_world_size_skips_split_with_a_warning(base):
    cfg = load_config(base + ["--actor-num-gpus-per-node", "none", "--micro-batch-size", "3"])
    warns = validate(cfg)
    assert any("world size unknown" in w for w in warns), warns


WARNING_CASES = [
    (["--fsdp-trainable-mode", "lora", "--lora-rank", "8"], "without --fsdp-master-dtype fp32"),
    (["--async-save"], "--async-save has no effect"),
    (["--lr-decay-style", "cosine"], "--lr-decay-style cosine has no effect"),
    (["--save-debug-train-data", "x.pt"], "--save-debug-train-data x.pt has no effect"),
    (["--num-updates-per-batch", "1"], "--num-updates-per-batch 1: the importance ratio is always exactly 1"),
    (["--n-samples-per-prompt", "1", "--rollout-batch-size", "16"], "--n-samples-per-prompt 1: a group of one"),
    (["--artifact-retention-rollouts", "0"], "grows without bound"),
    (["--eval-interval", "none"], "--eval-prompt-data is set but --eval-interval is not"),
    (["--fsdp-cpu-offload"], "--fsdp-cpu-offload: gradient clipping over CPU-offloaded DTensors"),
]


@pytest.mark.parametrize("extra, needle", WARNING_CASES, ids=[" ".join(c[0]) for c in WARNING_CASES])
def test_each_warning_on_its_own(base, extra, needle):
    warns = warnings_of(base + extra)
    assert len(warns) == 1 and needle in warns[0], warns


def test_several_violations_are_listed_in_one_error(base, tmp_path):
    bad = base + [
        "--kl-coef", "0.1",
        "--fully-async",
        "--micro-batch-size", "3",
        "--prompt-data", str(tmp_path / "nope.jsonl"),
        "--sampling-config", json.dumps({**SAMPLING, "sde_indices": [0, 1]}),
        "--save-hf", str(tmp_path / "hf"),
        "--lora-rank", "4",
    ]
    with pytest.raises(PreflightError) as info:
        validate(load_config(bad))
    msg = str(info.value)
    assert msg.startswith(HEADER + "\n")
    for flag in ("--kl-coef", "--fully-async", "--micro-batch-size 3", "--prompt-data", "trains step 0", "--save-hf", "--lora-rank 4"):
        assert flag in msg, (flag, msg)
    assert len(info.value.problems) == 7
    assert isinstance(info.value, ValueError)


def test_preflight_does_not_create_anything(base, tmp_path):
    before = sorted(p.name for p in tmp_path.rglob("*"))
    warnings_of(base)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_sampling_problems_and_step_zero_are_reported_together(base):
    bad = {**SAMPLING, "guidance_scale": 0.5, "sde_indices": [0, 1]}
    got = problems(base + ["--sampling-config", json.dumps(bad)])
    assert len(got) == 2, got
    assert any("key 'guidance_scale': must be a number >= 1.0" in p for p in got)
    assert any("key 'sde_indices' [0, 1] trains step 0" in p for p in got)


def test_a_shipped_but_absent_implementation_is_named_as_such(base, monkeypatch):
    import trainer.preflight as pf

    path = "trainer.models.no_such_family.Adapter"
    monkeypatch.setattr(pf, "_SHIPPED_DOTPATHS", pf._SHIPPED_DOTPATHS | {path})
    got = problems(base + ["--model-adapter-path", path])
    assert len(got) == 1 and "is not in this build" in got[0] and "spelling" not in got[0], got


def test_judge_eval_scorer_and_watch_flags_are_checked_before_anything_loads(base, tmp_path):
    aesthetic = tmp_path / "models" / "aesthetic"
    bad = [
        "--reward-judge-score-min", "5", "--reward-judge-score-max", "5",
        "--reward-judge-max-concurrency", "0",
        "--reward-judge-timeout-s", "-1",
        "--reward-judge-score-regex", r"\d+",
        "--hacking-stat-threshold", "0",
        "--hacking-patience", "0",
        "--eval-reward-scorers", json.dumps(["aesthetic", f"clipscore={aesthetic}", "trainer.rewards.nosuch.Scorer"]),
    ]
    found = problems(base + bad)
    for needle in ("--reward-judge-score-max (5.0) must exceed", "--reward-judge-max-concurrency",
                   "--reward-judge-timeout-s must be a number > 0", "--reward-judge-score-regex",
                   "--hacking-stat-threshold must be a number > 0", "--hacking-patience",
                   "entry 'aesthetic' needs its model directory", "entry 'clipscore'",
                   "entry 'trainer.rewards.nosuch.Scorer'"):
        assert any(needle in p for p in found), (needle, found)
    aesthetic.mkdir()
    assert problems(base + ["--eval-reward-scorers", json.dumps([f"aesthetic={aesthetic}", "jpeg_compressibility"])]) == []
    no_eval = _without(_without(base, "--eval-prompt-data", 2), "--eval-interval", 1)
    assert any("needs --eval-prompt-data" in p for p in problems(no_eval + ["--eval-reward-scorers",
                                                                         '["jpeg_compressibility"]']))


def _without(argv: list[str], flag: str, nvalues: int) -> list[str]:
    """argv less `flag` and the `nvalues` values after it."""
    if flag not in argv:
        return list(argv)
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + nvalues:]


def test_model_directory_and_adapter_of_different_families_are_refused(base, tmp_path):
    """model_index.json names the family: a StableDiffusion3Pipeline directory with the Qwen-Image
    adapter given explicitly is refused before anything loads, naming the adapter to use; the
    right adapter passes, and without --model-adapter-path it is the one chosen."""
    model = tmp_path / "models" / "Qwen-Image"
    (model / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    qwen = ["--model-adapter-path", "trainer.models.qwen_image.QwenImageAdapter"]
    found = [p for p in problems(base + qwen) if "--model-adapter-path" in p]
    assert len(found) == 1 and "StableDiffusion3Pipeline" in found[0] and "trainer.models.sd3.SD3Adapter" in found[0]
    assert problems(base + ["--model-adapter-path", "trainer.models.sd3.SD3Adapter"]) == []
    assert problems(base) == []
    assert load_config(base).model.model_adapter_path == "trainer.models.sd3.SD3Adapter"


def test_sglang_engine_with_a_family_it_does_not_bridge_is_refused(base):
    found = problems(base + ["--model-adapter-path", "trainer.models.sd3.SD3Adapter",
                             "--rollout-engine-class-path", "sglang"])
    assert any("bridges SGLang's Qwen-Image pipeline only" in p and "trainer.models.sd3.SD3Adapter" in p
               and "native" in p for p in found), found


def test_old_logprob_source_rollout_refused_with_guard_and_nft_warned_where_inexact(base, monkeypatch):
    """--old-logprob-source rollout: exact runs pass silently; GRPO-Guard (needs the anchor's
    transition means) and nft (no log-probs) are refused; a compiled, FP8 or SGLang rollout is
    warned about (its first ratio carries the rollout-to-replay gap), not refused."""
    src = ["--old-logprob-source", "rollout"]
    assert problems(base + src) == [] and warnings_of(base + src) == warnings_of(base)
    got = problems(base + src + ["--grpo-guard"])
    assert any("--old-logprob-source rollout with --grpo-guard" in p for p in got), got
    got = problems(base + src + ["--algorithm", "nft", "--adv-clip-max", "5"])
    assert any("--old-logprob-source rollout with --algorithm nft" in p for p in got), got
    # the same options with the default (replay) source raise no anchor complaint
    assert not any("--old-logprob-source" in p for p in problems(base + ["--grpo-guard"]))
    import trainer.preflight as pf

    monkeypatch.setattr(pf, "_sglang_importable", lambda: True)  # the engine itself is not what is checked here
    for extra, flag in ((["--rollout-compile"], "--rollout-compile"),
                        (["--rollout-precision", "fp8"], "--rollout-precision fp8"),
                        (["--rollout-engine-class-path", "sglang"], "--rollout-engine-class-path sglang")):
        warns = [w for w in warnings_of(base + src + extra) if w.startswith("--old-logprob-source rollout")]
        assert len(warns) == 1 and flag in warns[0] and "not exactly 1" in warns[0], warns
        assert not any(w.startswith("--old-logprob-source") for w in warnings_of(base + extra))


# ------------------------------------------------------------------------------ --compile-cache-dir


def test_compile_cache_dir_is_checked_before_code_is_loaded_from_it(base, tmp_path, monkeypatch):
    import os

    from trainer.loop import use_compile_cache

    fresh = tmp_path / "cc" / "new"
    assert problems(base + ["--fsdp-compile", "--compile-cache-dir", str(fresh)]) == []
    assert any("has no effect without --rollout-compile" in w
               for w in warnings_of(base + ["--compile-cache-dir", str(fresh)]))

    # the run creates it private to the user, and inductor then caches there
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset-after-the-test")  # restored at teardown
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    use_compile_cache(str(fresh))
    assert fresh.is_dir() and fresh.stat().st_mode & 0o777 == 0o700
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(fresh)
    assert problems(base + ["--fsdp-compile", "--compile-cache-dir", str(fresh)]) == []

    # a file the umask left group-writable inside the private directory: nobody else can reach it
    kernels = fresh / "fxgraph" / "ab"
    kernels.mkdir(parents=True)
    (kernels / "k.py").write_text("x = 1\n")
    os.chmod(kernels / "k.py", 0o666)
    assert problems(base + ["--fsdp-compile", "--compile-cache-dir", str(fresh)]) == []
    # once others can search the directory, the same file is a way to run code in the trainer:
    # refused, with the fix
    os.chmod(fresh, 0o755)
    (msg,) = problems(base + ["--fsdp-compile", "--compile-cache-dir", str(fresh)])
    assert msg.startswith(f"--compile-cache-dir {fresh}:") and "k.py is writable by group or others" in msg
    assert f"chmod -R go-w {fresh}" in msg
    os.chmod(kernels / "k.py", 0o644)
    assert problems(base + ["--fsdp-compile", "--compile-cache-dir", str(fresh)]) == []

    # a directory another user owns is refused too (or its parent, where the tests do not run as root)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(fresh).st_uid + 1)
    (msg,) = problems(base + ["--fsdp-compile", "--compile-cache-dir", str(fresh)])
    assert f"is owned by uid {os.stat(fresh).st_uid}" in msg


def test_without_compile_cache_dir_torchs_own_cache_is_checked(base, tmp_path, monkeypatch):
    """No --compile-cache-dir: the kernels come from torch's cache (TORCHINDUCTOR_CACHE_DIR, else a
    directory under the temp dir that another user can create first), so it gets the same check;
    a run that compiles nothing does not care; TRITON_CACHE_DIR, where set, is checked too."""
    import os

    import trainer.preflight as pf

    cache = tmp_path / "inductor"
    cache.mkdir(mode=0o755)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    assert pf.torch_compile_cache_dir() == (str(cache), "TORCHINDUCTOR_CACHE_DIR")
    assert problems(base + ["--rollout-compile"]) == []
    (cache / "k.py").write_text("x = 1\n")
    os.chmod(cache / "k.py", 0o664)
    (msg,) = problems(base + ["--rollout-compile"])
    assert msg.startswith(f"--rollout-compile / --fsdp-compile load compiled kernels from TORCHINDUCTOR_CACHE_DIR {cache}:")
    assert "k.py is writable by group or others" in msg and "pass --compile-cache-dir DIR" in msg
    assert problems(base) == []  # nothing compiles, nothing is loaded
    assert problems(base + ["--fsdp-compile", "--compile-cache-dir", str(tmp_path / "mine")]) == []

    # torch's default: found without being created, and checked the same way
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    default = tmp_path / "tmp" / "torchinductor_someone"
    monkeypatch.setattr("torch._inductor.runtime.cache_dir_utils.default_cache_dir", lambda: str(default))
    assert pf.torch_compile_cache_dir() == (str(default), "torch's default cache")
    assert problems(base + ["--fsdp-compile"]) == [] and not default.exists()
    default.mkdir(parents=True)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(default).st_uid + 1)  # created first by another user
    (msg,) = problems(base + ["--fsdp-compile"])
    assert f"torch's default cache {default}" in msg and f"is owned by uid {os.stat(default).st_uid}" in msg
    monkeypatch.undo()

    os.chmod(cache / "k.py", 0o644)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache / "k.py"))
    assert problems(base + ["--rollout-compile"]) == []
    os.chmod(cache / "k.py", 0o666)
    got = problems(base + ["--rollout-compile"])
    assert len(got) == 2 and got[1].startswith(f"TRITON_CACHE_DIR {cache / 'k.py'}:") and "or unset it" in got[1]


def test_a_compile_cache_whose_parent_others_can_write_is_refused(base, tmp_path):
    """Whoever can write a parent without the sticky bit can rename the cache away and put their
    own in its place; a sticky parent (as /tmp) is fine."""
    import os

    shared = tmp_path / "shared"
    shared.mkdir()
    cache = shared / "cc"
    os.chmod(shared, 0o775)
    (msg,) = problems(base + ["--fsdp-compile", "--compile-cache-dir", str(cache)])
    assert f"its parent {shared} is writable by group or others without the sticky bit (mode 775)" in msg
    os.chmod(shared, 0o1777)
    assert problems(base + ["--fsdp-compile", "--compile-cache-dir", str(cache)]) == []
    os.chmod(shared, 0o755)


def test_compile_cache_dir_under_a_file_is_refused(base, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    (msg,) = problems(base + ["--fsdp-compile", "--compile-cache-dir", str(blocker / "cc")])
    assert msg.startswith("--compile-cache-dir") and "regular file" in msg


def test_checkpointing_every_kth_block_needs_checkpointing_and_k_at_least_1(base):
    assert problems(base + ["--fsdp-activation-checkpointing", "--fsdp-activation-checkpointing-every", "2"]) == []
    (msg,) = problems(base + ["--fsdp-activation-checkpointing-every", "2"])
    assert msg.startswith("--fsdp-activation-checkpointing-every 2 without --fsdp-activation-checkpointing")
    assert "add --fsdp-activation-checkpointing, or drop it" in msg
    (msg,) = problems(base + ["--fsdp-activation-checkpointing", "--fsdp-activation-checkpointing-every", "0"])
    assert msg == "--fsdp-activation-checkpointing-every must be >= 1 (1 = every block), got 0"
