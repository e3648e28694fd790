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
import importlib
import logging
import os
import sys

from .components.common import config as config_lib
from .components.common.errors import PrmflowError

#: Stage subcommands, in pipeline order: name -> module with `Config` and `run(config)`.
STAGES = {
    "sft": "prmflow.components.sft.stage",
    "prm": "prmflow.components.prm.stage",
    "prm-label": "prmflow.components.prm.label",
    "rollout": "prmflow.components.rollout.stage",
    "advantage": "prmflow.components.advantage.stage",
    "ppo": "prmflow.components.ppo.stage",
    "evaluate": "prmflow.components.evaluate.stage",
}


def _available_stages() -> dict[str, object]:
    found = {}
    for name, module in STAGES.items():
        try:
            found[name] = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (e.name == module or module.startswith(e.name + ".")):
                continue  # that stage is not part of this build yet
            raise
    return found


def _summary(module) -> str:
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    stages = _available_stages()
    parser = argparse.ArgumentParser(
        prog="prmflow", description="RL fine-tuning with step-level process rewards, stage by stage.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in stages.items():
        p = sub.add_parser(name, help=_summary(module), description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        config_lib.add_arguments(p, module.Config)
        p.set_defaults(stage=name)
    tiny = sub.add_parser("make-tiny-model", help="write a tiny preset model (config + tokenizer, random init) as a HF directory")
    tiny.add_argument("output", help="directory to create")
    tiny.add_argument("--preset", default="tiny-llama", help="tiny-llama, tiny-qwen2 or tiny-llava (vision-language)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(stage=None, handler=_make_tiny)
    from .pipelines import commands

    commands.add_parsers(sub)
    from .components.common import tracking

    tracking.add_sync_command(sub)
    return parser, stages


def _make_tiny(args) -> int:
    from .components.common import io, modeling

    if not modeling.is_tiny(args.preset):
        known = sorted([*modeling.TINY_PRESETS, *modeling.TINY_VL_PRESETS])
        print(f"error: unknown preset '{args.preset}'; known presets: {', '.join(known)}.", file=sys.stderr)
        return 2
    model, tok = modeling.load_causal_lm(args.preset, seed=args.seed)
    with io.atomic_output_dir(args.output, "policy", manifest={"config": {"preset": args.preset, "seed": args.seed}}) as tmp:
        modeling.save_pretrained(model, tok, tmp)
    print(f"wrote {args.preset} ({sum(p.numel() for p in model.parameters()):,} parameters) to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser, stages = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help()
        return 0
    try:
        if getattr(args, "handler", None):
            return args.handler(args)
        module = stages[args.stage]
        cfg = config_lib.from_args(module.Config, args, section=args.stage)
        module.run(cfg)
        return 0
    except PrmflowError as e:
        print(f"prmflow {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
