"""The `prmflow` command: one subcommand per stage, plus helpers.

    prmflow --help
    prmflow sft --help                       # every config key with its description and default
    prmflow sft --config configs/quickstart-cpu.yaml --set max_steps=200
    prmflow make-tiny-model outputs/tiny     # write the tiny preset as a HF directory
    prmflow tracking-sync outputs/.sft.tracking.jsonl   # upload what MLflow missed while it was down

A stage subcommand builds the stage's Config from `--config FILE` (the file's `<stage>:` section
when it has one), `--set key=value` and `--key value` flags, then calls `stage.run(config)`. User
errors (bad config, bad data, a directory that is not a model) print one paragraph and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import stages
from .components import config as config_lib
from .components.runtime import distributed
from .components.data import io
from .components.runtime import shutdown
from . import tracking
from .errors import OutputExistsError, PrmflowError
from .pipelines import commands


#: make-tiny-model's presets as its --help lists them (modeling.TINY_PRESETS and TINY_VL_PRESETS, named here so
#: that `prmflow --help` does not import torch; tests/test_cli.py keeps the two the same).
TINY_PRESET_NAMES = ("tiny-llama", "tiny-qwen2", "tiny-qwen2-bpe", "tiny-llama-tools", "tiny-llava")


def _summary(module) -> str:
    """The docstring's first paragraph on one line: a summary wrapped over two lines stays whole."""
    doc = (module.__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def _command(argv: list[str]) -> str | None:
    """The subcommand on the command line: its first argument that is not an option (the top-level
    options take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The `prmflow` parser, and {name: module} of the stages it has a subcommand for.

    When `argv` names a stage, only that stage's module is imported: the others pull in torch and
    transformers (~2 s), which `prmflow advantage` (numpy and pyarrow) never needs."""
    command = _command(sys.argv[1:] if argv is None else argv)
    if command in stages.STAGES:
        module = stages.load(command)
        stage_modules = {command: module} if module is not None else {}
    else:
        stage_modules = stages.available()
    parser = argparse.ArgumentParser(
        prog="prmflow", description="RL fine-tuning with step-level process rewards, stage by stage.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in stage_modules.items():
        p = sub.add_parser(name, help=_summary(module), description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        config_lib.add_arguments(p, module.Config)
        # after the stage too (`prmflow sft ... -v`, as run-local takes --verbose): SUPPRESS keeps a `prmflow -v sft`
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO level")
        p.set_defaults(stage=name)
    tiny = sub.add_parser("make-tiny-model", help="write a tiny preset model (config + tokenizer, random init) as a HF directory")
    tiny.add_argument("output", help="directory to create")
    tiny.add_argument("--preset", default="tiny-llama", help=f"{', '.join(TINY_PRESET_NAMES[:-1])} or {TINY_PRESET_NAMES[-1]} "
                      f"(tiny-qwen2-bpe: Qwen2.5's BPE tokenizer and chat template; tiny-llama-tools: JSON tool calls, a "
                      f"minimal chat template; tiny-llava: vision-language; default: "
                      f"tiny-llama)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random initial weights (default: 0)")
    tiny.set_defaults(stage=None, handler=_make_tiny)
    commands.add_parsers(sub)
    tracking.add_sync_command(sub)
    return parser, stage_modules


def _make_tiny(args) -> int:
    from .components.models import modeling  # torch and transformers: imported for this command only

    if not modeling.is_tiny(args.preset):
        known = sorted([*modeling.TINY_PRESETS, *modeling.TINY_VL_PRESETS])
        print(f"prmflow make-tiny-model: error: unknown preset '{args.preset}'; known presets: {', '.join(known)}.",
              file=sys.stderr)
        return 2
    if os.path.lexists(args.output):  # atomic_output_dir's own refusal offers an overwrite this command has not
        raise OutputExistsError(f"'{args.output}' already exists; make-tiny-model never replaces anything. Choose "
                                f"another directory, or remove it yourself.")
    io.check_creatable(args.output, "make-tiny-model", "output")  # before the model is built
    model, tok = modeling.load_causal_lm(args.preset, seed=args.seed)
    with io.atomic_output_dir(args.output, "policy", manifest={"config": {"preset": args.preset, "seed": args.seed}}) as tmp:
        modeling.save_pretrained(model, tok, tmp)
    print(f"wrote {args.preset} ({sum(p.numel() for p in model.parameters()):,} parameters) to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    shutdown.freeze_objects_at_exit()
    parser, stage_modules = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # MLflow's own INFO lines (store set-up, system metrics started/stopped) only with -v
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is imported, ranks included
        logging.getLogger("mlflow").setLevel(os.environ["MLFLOW_LOGGING_LEVEL"])  # ... or if it already was
    if not args.command:
        parser.print_help()
        return 0
    try:
        if getattr(args, "handler", None):
            return args.handler(args)
        module = stage_modules[args.stage]
        fills = {}
        if args.config:  # a pipeline config: the keys the pipeline fills in (ppo's LR span = pipeline.iterations)
            from .pipelines.settings import pipeline_fills
            fills = pipeline_fills(args.stage, args.config)
        cfg = config_lib.from_args(module.Config, args, section=args.stage, sections=(*stages.STAGES, "pipeline", "variants"),
                                   fills=fills)
        with distributed.leave_group_at_exit():
            module.run(cfg)
        return 0
    except PrmflowError as e:
        print(f"prmflow {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C (a training stage's first one saves a checkpoint and exits 130 itself)
        print(f"\nprmflow {args.command}: interrupted. An output is only ever committed whole, so nothing half-written "
              f"is left; run the same command again.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
