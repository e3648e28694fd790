"""The `prmflow` command's own help: what a new user reads first."""

import re

import pytest

from prmflow import cli, stages


def test_top_level_help_gives_every_stage_summary_whole(capsys):
    """Each stage's line in `prmflow --help` is the first paragraph of its module docstring, whole: a
    summary wrapped over two lines in the source is not cut at the line break (prm-label's read "label a
    step by what")."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse re-wraps to the terminal width
    for name in stages.STAGES:
        first_paragraph = " ".join(stages.load(name).__doc__.strip().split("\n\n")[0].split())
        assert re.search(rf"\b{re.escape(name)}\s+{re.escape(first_paragraph)}", shown), (name, first_paragraph)
    assert "label a step by what the policy can still reach from it." in shown


def test_make_tiny_model_under_a_file_is_one_line_and_the_file_is_kept(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert cli.main(["make-tiny-model", str(notes / "tiny")]) == 2
    err = capsys.readouterr().err
    assert f"'{notes}' is a file, not a directory" in err and "Traceback" not in err
    assert notes.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_every_atomic_output_refuses_a_path_under_a_file_before_it_writes(tmp_path):
    from prmflow.components.data import io
    from prmflow.errors import OutputExistsError

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="is a file, not a directory"):
        with io.atomic_output_dir(tmp_path / "notes.txt" / "out", "policy"):
            raise AssertionError("the block must not run")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_stage_given_a_pipeline_yaml_without_its_section_says_so(tmp_path, capsys):
    """`prmflow evaluate --config configs/pipeline-local.yaml` (a file with no evaluate: section) read the
    whole file as evaluate's keys: "'pipeline.iterations' is not a config key. Did you mean 'iteration'?"."""
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("pipeline:\n  iterations: 2\nsft:\n  max_steps: 3\n")
    out = tmp_path / "advantages"
    assert cli.main(["advantage", "--config", str(cfg), "--input", str(tmp_path), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg} has section(s) pipeline, sft but no 'advantage:' section" in err and "Did you mean" not in err
    assert not out.exists()


def test_a_stage_config_with_a_key_written_twice_is_refused_naming_both_lines(tmp_path, capsys):
    """YAML keeps the last of two equal keys: `estimator: grpo_progress` written twice in one section, the second
    a slip, ran the stage on the second without a word. Now the file, both lines, exit 2, nothing written."""
    cfg = tmp_path / "adv.yaml"
    cfg.write_text("advantage:\n  estimator: grpo_progress\n  process_weight: 0.5\n  estimator: grpo\n")
    out = tmp_path / "advantages"
    assert cli.main(["advantage", "--config", str(cfg), "--input", str(tmp_path), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "key 'estimator' is written twice in one mapping (first on line 2)" in err
    assert f'in "{cfg}", line 4' in err and "Traceback" not in err
    assert not out.exists()


def test_an_empty_stage_section_takes_the_defaults_and_a_scalar_one_is_named(tmp_path):
    from prmflow.components.advantage.config import Config
    from prmflow.components import config
    from prmflow.errors import ConfigError

    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("sft:\n  max_steps: 3\nadvantage:\n  # estimator: grpo\n")  # every key commented out
    assert config.load(Config, cfg, section="advantage", sections=stages.STAGES) == Config()
    cfg.write_text("advantage: grpo\n")
    with pytest.raises(ConfigError, match="section 'advantage' must be a mapping of its keys"):
        config.load(Config, cfg, section="advantage", sections=stages.STAGES)


def test_a_config_path_that_is_a_directory_is_named_as_one(tmp_path, capsys):
    assert cli.main(["advantage", "--config", str(tmp_path)]) == 2
    assert f"Config file '{tmp_path}' is a directory; pass the YAML file itself" in capsys.readouterr().err


def test_ctrl_c_in_a_stage_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C in a stage without a resume checkpoint (rollout, advantage, evaluate) was a KeyboardInterrupt
    traceback from wherever it landed."""
    from prmflow.components.advantage import stage

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "run", interrupted)
    try:
        assert cli.main(["advantage", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out")]) == 130
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt left cli.main: a traceback on the terminal")
    err = capsys.readouterr().err
    assert "prmflow advantage: interrupted." in err and "run the same command again" in err


def test_an_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path, capsys):
    """`--output` typed the same as `--input`: with --overwrite true the advantages replaced the rollouts
    they were computed from."""
    import pyarrow as pa

    from prmflow.components.data import io, schema

    rollouts = tmp_path / "rollouts"
    with schema.DatasetWriter(rollouts, "rollouts") as w:
        w.write(pa.Table.from_pylist([{"prompt_id": "p0", "sample_idx": i, "iteration": 0, "response_ids": [1, 2],
                                       "outcome_reward": float(i)} for i in range(2)]))
    before = io.read_manifest(rollouts)["files"]
    for output in (rollouts, tmp_path):
        assert cli.main(["advantage", "--input", str(rollouts), "--output", str(output), "--estimator", "grpo",
                         "--overwrite", "true", "--tracking.enabled", "false"]) == 2
        assert f"output '{output}' {'is' if output == rollouts else 'holds'} its input '{rollouts}'" in capsys.readouterr().err
    manifest = io.read_manifest(rollouts)
    assert manifest["kind"] == "rollouts" and manifest["files"] == before
    io.verify_files(rollouts, manifest)


def test_every_stage_docstring_command_with_a_config_file_builds_its_config(monkeypatch):
    """`prmflow rollout --help` opened on `prmflow rollout --config configs/quickstart-cpu.yaml --set num_prompts=16`,
    a file with only an sft: section: the command failed on its first key ('sft.policy' is not a config key)."""
    import shlex
    from pathlib import Path

    from prmflow.components import config as config_lib

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    commands = [(name, line.strip()) for name in stages.STAGES  # a command continued with \ is read whole
                for line in stages.load(name).__doc__.replace("\\\n", " ").splitlines()
                if line.strip().startswith(f"prmflow {name} --config ")]
    assert {name for name, _ in commands} >= {"sft", "rollout", "ppo"}
    for name, line in commands:
        parser, modules = cli.build_parser(shlex.split(line, comments=True)[1:])
        args = parser.parse_args(shlex.split(line, comments=True)[1:])
        config_lib.from_args(modules[name].Config, args, section=name, sections=stages.STAGES)  # raises if it cannot


def test_docstring_commands_on_the_quickstart_config_name_paths_where_it_writes():
    """`prmflow ppo --help` showed `--config configs/quickstart-cpu.yaml ... optimizer_state=outputs/ppo-2/optimizer`,
    a directory that config never writes (its stages write under outputs/quickstart/)."""
    import os
    import re
    import shlex
    from pathlib import Path

    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "quickstart-cpu.yaml").read_text())
    root = os.path.commonpath([section["output"] for section in config.values()])  # outputs/quickstart
    checked = 0
    for name in stages.STAGES:
        for line in stages.load(name).__doc__.replace("\\\n", " ").splitlines():
            if "--config configs/quickstart-cpu.yaml" not in line:
                continue
            for word in shlex.split(line, comments=True):
                for path in re.findall(r"(?:^|=)(outputs/\S+)", word):
                    checked += 1
                    assert Path(path).is_relative_to(root), f"prmflow {name} --help: {path} is not under {root}"
    assert checked >= 4  # the ppo example names four such paths


def test_stage_command_output_that_is_a_file_is_refused_before_anything_is_fetched(tmp_path, capsys):
    """`stage-command ... --output notes.txt` fetched the run's inputs, then died in mkdir's FileExistsError."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    store = tmp_path / "mlflow.db"
    assert cli.main(["stage-command", "advantage", "--run-id", "0" * 32, "--tracking-uri", f"sqlite:///{store}",
                     "--no-container", "--output", str(notes)]) == 2
    assert f"stage-command: --output '{notes}' is a file, not a directory" in capsys.readouterr().err
    assert notes.read_text() == "mine" and not store.exists()  # refused before MLflow was opened


def test_make_tiny_model_over_an_existing_directory_says_what_to_do(tmp_path, capsys):
    """It said 'pass overwrite', which make-tiny-model has no option for."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "notes.txt").write_text("mine")
    assert cli.main(["make-tiny-model", str(tmp_path / "tiny")]) == 2
    err = capsys.readouterr().err
    assert "make-tiny-model never replaces anything" in err and "overwrite" not in err
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("argv", [["-v", "advantage"], ["advantage", "-v"], ["advantage", "--verbose"]])
def test_verbose_is_taken_before_or_after_the_stage(argv):
    """`prmflow sft ... -v` was 'unrecognized arguments: -v' (only `prmflow -v sft` worked)."""
    parser, _ = cli.build_parser(argv)
    assert parser.parse_args(argv).verbose is True
    assert parser.parse_args(["advantage"]).verbose is False


def test_a_key_outside_the_stage_section_is_named_not_dropped(tmp_path, capsys):
    """`estimator: grpo` above an `advantage:` section was dropped without a word: the stage ran grpo_process."""
    cfg = tmp_path / "advantage.yaml"
    cfg.write_text("estimator: grpo\nadvantage:\n  gamma: 0.9\n")
    out = tmp_path / "advantages"
    assert cli.main(["advantage", "--config", str(cfg), "--input", str(tmp_path), "--output", str(out)]) == 2
    assert f"{cfg}: 'estimator' is outside every section; with the section 'advantage:' only the keys under it are read" \
        in capsys.readouterr().err
    assert not out.exists()


def test_make_tiny_model_help_names_every_preset_it_takes(capsys):
    """`prmflow make-tiny-model --help` listed tiny-llama, tiny-qwen2 and tiny-llava, but not tiny-qwen2-bpe (the
    stand-in for a real Qwen2.5-Instruct directory), which the command takes: the help names exactly the presets."""
    from prmflow.components.models import modeling

    with pytest.raises(SystemExit):
        cli.main(["make-tiny-model", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    presets = {*modeling.TINY_PRESETS, *modeling.TINY_VL_PRESETS}
    assert set(cli.TINY_PRESET_NAMES) == presets
    for name in presets:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", shown.split("--preset PRESET", 2)[-1]), name


def test_compile_with_both_images_unset_says_how_to_set_each(tmp_path, capsys):
    """With neither image set, compile named both keys but showed only the CPU placeholder and told the user to
    build and --set only the CPU image; the GPU one was refused again on the next try. Each unset image is named
    with its value, its build line and its --set; one unset image alone is named alone."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[1] / "configs" / "pipeline-local.yaml")
    out = tmp_path / "spec.yaml"
    assert cli.main(["pipeline", "compile", "--config", config, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    for kind in ("cpu", "gpu"):
        assert f"registry.invalid/prmflow-{kind}:set-pipeline.images.{kind}" in err, err
        assert f"images/build.sh {kind} REGISTRY/prmflow-{kind}:TAG --push" in err, err
        assert f"--set images.{kind}=REGISTRY/prmflow-{kind}@sha256:..." in err, err
    assert cli.main(["pipeline", "compile", "--config", config, "-o", str(out),
                     "--set", "images.cpu=registry.example.com/prmflow-cpu@sha256:00"]) == 2
    err = capsys.readouterr().err
    assert "pipeline.images.gpu is still the placeholder" in err and "images.cpu" not in err, err
    assert not out.exists()


def _helper_options():
    """(command, option, default, help) of every option of the helper commands that has a default worth showing."""
    import argparse

    parser, _ = cli.build_parser(["pipeline"])
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    found = []

    def walk(p, name):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    walk(sp, f"{name} {sub}")
            elif a.default not in (None, "", [], False, argparse.SUPPRESS) and a.help not in (None, argparse.SUPPRESS):
                found.append((name, a.option_strings[-1], a.default, a.help))

    for name in ("pipeline", "stage-command", "tracking-sync", "make-tiny-model"):
        walk(commands[name], name)
    return found


def test_helper_command_help_shows_each_default():
    """`prmflow pipeline run-local --help` did not say artifacts go to outputs/kfp-local (compare: outputs/compare,
    compile -o: pipeline.yaml), though docs/ points users at paths under them; every option of the helper commands
    with a default now shows it in its help, as the stage flags do."""
    options = _helper_options()
    assert len(options) >= 10  # the walk sees the pipeline actions' options
    missing = [f"prmflow {name} {opt}: default {default!r}" for name, opt, default, text in options
               if str(default).removeprefix("./") not in text]
    assert not missing, "help does not show the default:\n" + "\n".join(missing)


def test_run_local_help_does_not_promise_the_local_config_without_config():
    """run-local without --config takes the pipeline: and stage defaults (sft max_steps 700), not
    configs/pipeline-local.yaml (300): its help said the latter."""
    help_text = next(text for name, opt, _, text in _helper_options() if name == "pipeline run-local" and opt == "--root")
    assert "outputs/kfp-local" in help_text
    import argparse

    parser, _ = cli.build_parser(["pipeline"])
    run_local = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["pipeline"]
    sub = next(a for a in run_local._actions if isinstance(a, argparse._SubParsersAction)).choices["run-local"]
    config_help = next(a.help for a in sub._actions if "--config" in a.option_strings)
    assert "default: configs/pipeline-local.yaml" not in config_help


@pytest.mark.parametrize("name", list(stages.STAGES))
def test_each_stage_help_gives_set_examples_it_takes(name, capsys):
    """Every stage's --set help said "e.g. --set optim.lr=1e-4 --set engine.zero_stage=2"; rollout, advantage,
    evaluate and prm-label have neither key, so the example they showed was refused. Each example in a stage's help
    now builds that stage's config."""
    from prmflow.components import config

    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    examples = re.findall(r"--set (\S+?)=(\S+)", shown.split("override one key, e.g.", 1)[1].split(" -v, ")[0])
    assert examples, shown
    module = stages.load(name)
    for key, value in examples:
        config.load(module.Config, None, {key: value})  # raises ConfigError for a key the stage does not have
