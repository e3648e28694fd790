"""`prmflow pipeline compile|submit|upload|run-local` and `prmflow stage-command`.

    prmflow pipeline compile --config configs/cluster/ppo-7b-2x8.yaml -o pipeline.yaml
    prmflow pipeline submit --host https://kubeflow.example.com/pipeline --cookie authservice_session=... \\
        --namespace my-profile --config configs/cluster/ppo-7b-2x8.yaml --set ppo.optim.lr=1e-6 --wait
    prmflow pipeline upload --config configs/cluster/ppo-7b-2x8.yaml --host ... --version v3   # a named pipeline, versioned
    (connection, parameters and operating a run: docs/submitting.md)
    prmflow pipeline run-local --config configs/pipeline-local.yaml      # kfp.local, no docker, CPU
    prmflow pipeline compare --config configs/compare.yaml               # one local run per RL variant + table
    prmflow stage-command ppo --run-id <MLflow run id of that stage>    # fetch its inputs, print the docker run line
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path

from .. import stages
from ..errors import ConfigError, PrmflowError
from . import advice, chain, client, plan, step
from .local import TaskFailed, local_shard_threads, print_summary, run_local  # noqa: F401 (the CLI's names)
from .params import effective_configs, merge_section, parse_params, run_arguments, split_sets
from .settings import PipelineSpec, load_spec, safe_loader


def _number(kind, unit: str, zero: bool):
    """An argparse type: a finite `kind` (int or float) above 0, or at least 0 with `zero` (argparse names the flag)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"'{text}' is not {what} of {unit}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"'{text}': give {'0 or more' if zero else 'more than 0'} {unit}")
        return value
    return parse


def add_parsers(sub) -> None:
    p = sub.add_parser("pipeline", help="compile, submit or run locally the whole KFP pipeline")
    psub = p.add_subparsers(dest="pipeline_command", metavar="ACTION", required=True)

    c = psub.add_parser("compile", help="write the compiled pipeline spec (YAML)")
    c.add_argument("--config", help="pipeline YAML (pipeline: + stage sections)")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a pipeline: key (iterations=3, images.gpu=...) or a stage key (ppo.optim.lr=1e-6)")
    c.add_argument("-o", "--output", default="pipeline.yaml", help="where to write the spec (default: pipeline.yaml)")
    c.set_defaults(handler=_compile)
    plan.add_parser(psub)

    s = psub.add_parser("submit", help="compile and start a run on a KFP cluster (docs/submitting.md)")
    _source_arguments(s)
    s.add_argument("--param", action="append", default=[], metavar="NAME=JSON",
                   help="pipeline parameter; a stage's is merged into its compiled config, e.g. "
                        "'ppo_config={\"optim\": {\"lr\": 1e-6}}' or tracking_uri=http://mlflow:5000")
    s.add_argument("--experiment", default="prmflow", help="KFP experiment to file the run under (default: prmflow)")
    s.add_argument("--run-name", default="", help="name of the KFP run")
    s.add_argument("--pipeline-root", default="", help="where the run's artifacts go, e.g. s3://bucket/prmflow "
                   "(default: the KFP deployment's)")
    s.add_argument("--service-account", default="", help="service account of the run's pods "
                   "(default: pipeline.cluster.service_account, else KFP's)")
    s.add_argument("--caching", action=argparse.BooleanOptionalAction, default=None,
                   help="turn KFP's result cache on or off for every step of this run (default: as compiled)")
    s.add_argument("--dry-run", action="store_true", help="print every stage's effective config and the arguments; send nothing")
    s.add_argument("--from-iteration", type=_number(int, "iterations", zero=True), default=0, metavar="N",
                   help="a chain of runs: start at the run that begins at iteration N (its predecessors' state is on "
                        "the workspace), not at run 1, whose sampled steps would run again (docs/cluster.md)")
    s.add_argument("--wait", action="store_true", help="wait for the run: status lines, then the failed task and its log tail")
    s.add_argument("--timeout", type=_number(float, "seconds", zero=False), default=7 * 24 * 3600,
                   help="with --wait: seconds to wait at most (default: 604800, a week)")
    s.add_argument("--poll", type=_number(float, "seconds", zero=True), default=30,
                   help="with --wait: seconds between status reads (default: 30; 0: read again at once)")
    s.add_argument("--log-lines", type=_number(int, "lines", zero=True), default=40,
                   help="with --wait: log lines of a failed task to print (default: 40; 0: none)")
    client.add_arguments(s)
    s.set_defaults(handler=_submit)

    u = psub.add_parser("upload", help="upload the pipeline to KFP as a named pipeline (a new version if it exists)")
    _source_arguments(u)
    u.add_argument("--name", default="", help="pipeline name in KFP (default: pipeline.name)")
    u.add_argument("--version", default="", help="version name (default: sha256- and the first 12 hex digits of the "
                                                  "compiled spec's sha256, e.g. sha256-3f9a0c1d2e4b)")
    u.add_argument("--description", default="", help="shown in the KFP UI")
    client.add_arguments(u)
    u.set_defaults(handler=_upload)

    st = psub.add_parser("step", help="run one step of a KFP run in its pod (the compiled spec's command; not for hand use)")
    st.add_argument("--executor_input", required=True, help="KFP's executor input (JSON), as the launcher passes it")
    st.add_argument("--function_to_execute", required=True, help="the step's function: a stage, locate, or a tracking step")
    st.set_defaults(handler=step.run)

    r = psub.add_parser("run-local", help="run the whole DAG on this machine through kfp.local (no docker)")
    r.add_argument("--config", default=None, help="pipeline YAML (without it: the pipeline: and stage defaults, not "
                   "configs/pipeline-local.yaml's smaller budget)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a pipeline: key (iterations=1) or a stage key (ppo.optim.lr=1e-4)")
    r.add_argument("--root", default="outputs/kfp-local",
                   help="pipeline root: where artifacts are written (default: outputs/kfp-local)")
    r.add_argument("--param", action="append", default=[], metavar="NAME=JSON", help="pipeline parameter")
    r.add_argument("--verbose", action="store_true",
                   help="stream every task's output here (default: one line per task, the full log in ROOT/run-local.log)")
    r.add_argument("--runs", type=_number(int, "runs", zero=False), default=None, metavar="N",
                   help="run only the first N runs of a chain (pipeline.iterations beyond one run's; docs/cluster.md), "
                        "then stop; the same command without --runs continues from there")
    r.set_defaults(handler=_run_local)

    cm = psub.add_parser("compare", help="run the pipeline locally once per RL variant (shared SFT and PRM); print a table")
    cm.add_argument("--config", default="configs/compare.yaml",
                    help="pipeline YAML with a variants: section (default: configs/compare.yaml)")
    cm.add_argument("--root", default="outputs/compare",
                    help="where each variant's artifacts are written (default: outputs/compare)")
    cm.add_argument("--param", action="append", default=[], metavar="NAME=JSON", help="pipeline parameter (all variants)")
    cm.add_argument("--verbose", action="store_true",
                    help="stream every task's output here (default: one line per task, the full logs in "
                         "ROOT/VARIANT/run-local.log)")
    cm.set_defaults(handler=_compare)

    sc = sub.add_parser(
        "stage-command", help="re-run one stage of a past run (a cluster's or this machine's): fetch its inputs, print the line",
        description="Fetch the inputs a recorded stage run read (from the object store, or where they are on this "
                    "machine) into a local cache, check them against the digests MLflow recorded, and print the "
                    "`docker run` line that re-runs the stage on them with the run's exact config (--run: run it).")
    sc.add_argument("stage", help=f"{', '.join(stages.PIPELINE_STAGES[:-1])} or {stages.PIPELINE_STAGES[-1]}")
    which = sc.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-id", help="MLflow run id of that stage's run (the stage run, not the pipeline's parent)")
    which.add_argument("--kfp-run-id", help="or: the KFP run id (KFP UI: Run details); finds the stage's run in MLflow")
    sc.add_argument("--iteration", type=int, default=None, help="with --kfp-run-id: the RL iteration of rollout/advantage/ppo")
    sc.add_argument("--tracking-uri", default="", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    sc.add_argument("--image", default="", help="image to run (default: the stage's CPU/GPU image)")
    sc.add_argument("--output", default="rerun", help="host directory for the re-run's output (default: ./rerun)")
    sc.add_argument("--fetch", default="", metavar="DIR",
                    help="cache for inputs fetched from the object store (default: ~/.cache/prmflow/handoffs); "
                         "credentials and endpoint from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL")
    sc.add_argument("--engine", default=None, choices=["docker", "podman"],
                    help="container engine of the printed line (default: docker if installed, else podman)")
    sc.add_argument("--run", action="store_true", help="run the line after printing it")
    sc.add_argument("--no-container", action="store_true",
                    help="print (and with --run, run) the stage command itself on the fetched inputs, no container")
    sc.set_defaults(handler=_stage_command)


def _source_arguments(p) -> None:
    """What `submit` and `upload` send: a config compiled now, or a spec compiled before."""
    p.add_argument("--config", help="pipeline YAML, compiled now")
    p.add_argument("--package", default="", metavar="FILE", help="a compiled spec (pipeline compile -o FILE) instead of --config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a pipeline: key (images.gpu=...) or a stage key (ppo.optim.lr=1e-6)")


def load_config(config: str | None, sets: list[str]) -> PipelineSpec:
    """The pipeline spec with --set applied: pipeline: keys, and stage keys merged into their sections."""
    pipeline, per_stage = split_sets(sets)
    spec = load_spec(config, pipeline)
    for stage, change in per_stage.items():
        spec.stages[stage] = merge_section(stage, spec.stages.get(stage) or {}, change, "--set")
    for note in advice.notes(spec):  # valid, but against what was measured: said once, never refused
        print(note, file=sys.stderr)
    return spec


def compile_for_cluster(spec: PipelineSpec, path: str, check_backend: bool = True, chained: bool = False):
    """Compile `spec` for a cluster: refused while an image is still a placeholder (a pod that cannot pull
    its image waits in ImagePullBackOff; better to fail here). chained: more iterations than one run holds
    become a chain (chain_packages.compile_chain; returns its runs and {shape: file}); else one package (its path)."""
    from .chain_packages import compile_chain
    from .pipeline import compile_to

    unset = spec.pipeline.images.placeholders()
    if unset:  # each unset image named with its build and its --set, not only the first
        one = len(unset) == 1
        keys = ", ".join(f"pipeline.images.{k}" for k in unset)
        values = ", ".join(getattr(spec.pipeline.images, k) for k in unset)
        builds = "; ".join(f"images/build.sh {k} REGISTRY/prmflow-{k}:TAG --push" for k in unset)
        sets = " ".join(f"--set images.{k}=REGISTRY/prmflow-{k}@sha256:..." for k in unset)
        raise ConfigError(f"{keys} {'is' if one else 'are'} still the placeholder ({values}): build and push "
                          f"{'the image' if one else 'each image'} "
                          f"({builds} {'prints its digest' if one else 'print their digests'}), "
                          f"then set {'it' if one else 'them'} in the config's pipeline.images section or with {sets}")
    return compile_chain(spec, path, check_backend) if chained else compile_to(spec, path, check_backend)


def server_family(kfp_client, conn: client.Connection) -> tuple[str, str]:
    """(the KFP API server's version, its family among those prmflow checks against, or '' where it states none
    or one newer than we know). Asked before anything is compiled for it: a server that cannot be reached is
    reported as such, not as a refusal by some other version's rules. A server older than the oldest we
    support is refused."""
    from .contracts import KFP_VERSIONS, version_tuple
    from .contracts import kfp as kfp_rules

    version = client.server_version(kfp_client, conn)
    if not version:
        return "", ""
    try:
        return version, kfp_rules.family(version)
    except ValueError:
        if version_tuple(version) < version_tuple(KFP_VERSIONS[0]):
            raise ConfigError(f"KFP at {conn.where()} is {version}; prmflow's pipeline needs Kubeflow Pipelines "
                              f"{KFP_VERSIONS[0]} or newer (fan-in of collected artifacts, the pipeline workspace).") from None
        return version, ""  # newer than we know: its rules are checked where they are known (the compiled-in version)


def check_server(conn: client.Connection, package: str, spec: PipelineSpec | None, version: str, family: str) -> None:
    """Refuse, before anything is created, a package the KFP API server's own version would refuse or not
    mount (compat.py). A config compiled now (`spec`) was not checked yet: it is checked against the
    server's version, else (a server that does not say, or one newer than we know) against its
    pipeline.cluster.kfp_version; a --package was checked against its kfp_version when it was compiled."""
    from . import compat, size
    from .settings import SERVER_DEFAULT_CLASS

    server_default = bool(spec) and spec.pipeline.cluster.workspace_storage_class == SERVER_DEFAULT_CLASS
    if not family:
        if not version:
            print(f"note: KFP at {conn.where()} does not state its version; the package was checked against "
                  f"pipeline.cluster.kfp_version only", file=sys.stderr)
        if spec:
            compat.check(_package_doc(package), spec.pipeline.cluster.kfp_version, server_default,
                         where=f"pipeline '{spec.pipeline.name}'")
            refusal = size.check_package(_package_doc(package), spec.pipeline.cluster.kfp_version)
            if refusal:
                raise ConfigError(f"pipeline '{spec.pipeline.name}': {refusal}")
        return
    if spec and family != spec.pipeline.cluster.kfp_version:
        print(f"note: checked for the server's Kubeflow Pipelines {version} (pipeline.cluster.kfp_version is "
              f"{spec.pipeline.cluster.kfp_version})", file=sys.stderr)
    compat.check(_package_doc(package), version, server_default,
                 where=f"the pipeline (compiled for pipeline.cluster.kfp_version "
                       f"{spec.pipeline.cluster.kfp_version if spec else 'as compiled'}; KFP at {conn.where()} is {version})")
    refusal = size.check_package(_package_doc(package), version)  # the run's size on the server's own version
    if refusal:
        raise ConfigError(f"KFP at {conn.where()} is {version}: {refusal}")


def _compile(args) -> int:
    spec = load_config(args.config, args.set)
    runs, written = compile_for_cluster(spec, args.output, chained=True)
    if len(runs) == 1:
        print(f"wrote {args.output}: {spec.pipeline.iterations} RL iterations, {spec.pipeline.rollout_shards} rollout shards")
        return 0
    print(f"{spec.pipeline.iterations} RL iterations, more than one run holds: a chain of {len(runs)} runs of at most "
          f"{runs[0].iterations} (pipeline.run_iterations; docs/cluster.md#long-runs-a-chain-of-runs)")
    for shape, path in written.items():
        what = {"first": "run 1 (sft, prm, the first iterations)", "next": "each middle run (first_iteration a run parameter)",
                "last": "the last run (and evaluate)", "manifest": "the chain: its runs and each package's modelled size"}[shape]
        print(f"wrote {path}: {what}")
    return 0


def _package(args, tmp: str, check_backend: bool = True) -> tuple[str, PipelineSpec | None, list[str]]:
    """(package path, the spec when compiled now, the --set items left for the run's arguments).
    check_backend=False: a config is compiled without its pipeline.cluster.kfp_version's rules, which the
    caller checks once it knows the server's version (`check_server`)."""
    if args.package:
        if args.config:
            raise ConfigError("Give --config (compiled now) or --package (compiled before), not both.")
        if not os.path.isfile(args.package):
            raise ConfigError(f"--package {args.package}: no such file (write one with `prmflow pipeline compile -o FILE`).")
        from .pipeline import is_compiled_spec

        if not is_compiled_spec(args.package):  # a pipeline config given here was a KeyError traceback
            raise ConfigError(f"--package {args.package} is not a compiled pipeline spec; give a pipeline config with "
                              f"--config, or compile one first (`prmflow pipeline compile --config CONFIG -o FILE`).")
        pipeline, _ = split_sets(args.set)
        if pipeline:
            raise ConfigError(f"--set {', '.join(pipeline)}: pipeline: keys are compiled into --package "
                              f"{args.package}; recompile with them (stage keys, STAGE.KEY=VALUE, still apply).")
        return args.package, None, list(args.set)  # all stage keys: they merge into the run's arguments
    spec = load_config(args.config, args.set)
    runs, written = compile_for_cluster(spec, os.path.join(tmp, "pipeline.yaml"), check_backend, chained=True)
    return written.get("whole") or written["first"], spec, []  # a chain's later packages lie beside it


def _package_doc(path: str) -> list[dict]:
    import yaml

    return [d for d in yaml.load_all(Path(path).read_text(), Loader=safe_loader()) if d]


def package_defaults(path: str) -> dict:
    """{parameter: default value} of a compiled pipeline spec."""
    params = _package_doc(path)[0].get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    return {name: p.get("defaultValue") for name, p in params.items()}


def _tasks(doc: dict):
    """Every task of a compiled pipeline spec: the root DAG's and those inside each component's DAG
    (the exit handler, the rollout loops)."""
    dags = [doc["root"].get("dag", {})] + [c.get("dag", {}) for c in doc.get("components", {}).values()]
    return [task for dag in dags for task in dag.get("tasks", {}).values()]


def compiled_sections(path: str) -> dict[str, dict]:
    """{stage: its section} for the stages whose config is compiled into their tasks rather than passed as a
    run parameter (prm-update with pipeline.prm_update): read from the first such task's constant input."""
    out = {}
    for task in _tasks(_package_doc(path)[0]):
        stage = task.get("componentRef", {}).get("name", "").removeprefix("comp-").rstrip("-0123456789")
        config = task.get("inputs", {}).get("parameters", {}).get("config", {}).get("runtimeValue", {})
        if stage == "prm-update" and "constant" in config:
            out.setdefault(stage, config["constant"] or {})
    return out


def with_caching(path: str, enabled: bool, out: str) -> str:
    """A copy of the package with every task's cache switched on or off. (kfp.Client's enable_caching
    reaches only the root DAG's tasks; ours sit inside the exit handler and the rollout loops.)"""
    import yaml

    docs = _package_doc(path)
    for task in _tasks(docs[0]):
        task.setdefault("cachingOptions", {})["enableCache"] = enabled
    Path(out).write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return out


def _start_chain(kfp_client, conn, args, package: str, later: dict, name: str, arguments: dict,
                 service_account: str) -> tuple[dict, str]:
    """The run parameters that make the first run of a chain go on: its later packages uploaded as versions of
    pipeline NAME-chain (chain.upload_packages), the experiment's id, and what each run passes to the next."""
    manifest = chain.read_manifest(package)[0]
    pipeline_id, versions = chain.upload_packages(kfp_client, conn, f"{name}-chain", later)
    with client.api_errors(conn, f"looking up experiment {args.experiment}"):
        exp = kfp_client.create_experiment(args.experiment, namespace=conn.namespace or None)
    cont = chain.Continuation(pipeline_id=pipeline_id, versions=versions, experiment_id=exp.experiment_id,
                              total=manifest["iterations"], per_run=manifest["run_iterations"],
                              arguments={k: v for k, v in arguments.items() if k != chain.CHAIN_ID_PARAM},
                              namespace=conn.namespace, kfp_namespace=conn.kfp_namespace,
                              run_name=args.run_name or name, pipeline_root=args.pipeline_root,
                              service_account=service_account)
    print(f"a chain of {len(manifest['runs'])} runs of at most {manifest['run_iterations']} iterations: each run "
          f"submits the next from the cluster when it succeeds (pipeline {name}-chain, versions "
          f"{', '.join(f'{k} {v}' for k, v in versions.items())})")
    first = manifest["runs"][0]
    return {chain.CHAIN_PARAM: cont.to_json(), chain.FIRST_PARAM: 0}, (
        f"{args.run_name or name} [1/{len(manifest['runs'])}: iterations 0..{first['iterations'] - 1}]")


def _run_from(args, package: str, later: dict, name: str) -> tuple[str, int, str]:
    """(package, first iteration, run name) of the chain's run that begins at --from-iteration."""
    manifest = chain.read_manifest(package)[0]
    runs = manifest["runs"]
    starts = [r["first_iteration"] for r in runs]
    if args.from_iteration not in starts[1:]:
        raise ConfigError(f"--from-iteration {args.from_iteration}: the chain's runs begin at iterations "
                          f"{', '.join(map(str, starts))}; give one of them after 0.")
    j = starts.index(args.from_iteration)
    shape = "last" if j == len(runs) - 1 else "next"
    first, n = runs[j]["first_iteration"], runs[j]["iterations"]
    return later[shape], first, f"{args.run_name or name} [{j + 1}/{len(runs)}: iterations {first}..{first + n - 1}]"


def _submit(args) -> int:
    import hashlib
    import tempfile

    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        # a dry run checks the config's kfp_version; a submission checks the server's, once it has asked
        package, spec, stage_sets = _package(args, tmp, check_backend=args.dry_run)
        defaults = package_defaults(package)
        _, per_stage = split_sets(stage_sets)
        arguments = run_arguments(defaults, parse_params(args.param), per_stage)
        if args.dry_run:
            sections = {stage: arguments.get(f"{stage}_config", defaults.get(f"{stage}_config")) or {}
                        for stage in stages.PIPELINE_STAGES if f"{stage}_config" in defaults}
            shown = {"effective stage configs": effective_configs(sections)}
            compiled = compiled_sections(package)
            if compiled:  # not run parameters: --set cannot change them here (run_arguments says so)
                shown["compiled-in stage configs (compile again to change)"] = effective_configs(compiled)
            print(yaml.safe_dump({**shown, "arguments sent": arguments}, sort_keys=False), end="")
            print("dry run: nothing submitted")
            return 0
        later = chain.read_manifest(package)[1] if chain.CHAIN_PARAM in defaults else {}
        compiled = package  # the chain's manifest lies beside it
        if args.caching is not None:
            package = with_caching(package, args.caching, os.path.join(tmp, "pipeline-caching.yaml"))
            later = {shape: with_caching(p, args.caching, os.path.join(tmp, f"pipeline-{shape}-caching.yaml"))
                     for shape, p in later.items()}
        service_account = args.service_account or (spec.pipeline.cluster.service_account if spec else "")
        conn = client.Connection.from_args(args)
        kfp_client = client.connect(conn)
        family = server_family(kfp_client, conn)
        for each in [package, *later.values()]:
            check_server(conn, each, spec, *family)
        # the chain's id (its MLflow parent run): the same package and arguments submitted again continue it
        name = spec.pipeline.name if spec else _package_doc(package)[0]["pipelineInfo"]["name"]
        arguments[chain.CHAIN_ID_PARAM] = arguments.get(chain.CHAIN_ID_PARAM) or chain.chain_id(
            name, conn.namespace, arguments, hashlib.sha256(Path(compiled).read_bytes()).hexdigest())
        run_name = args.run_name
        if later:  # the later runs' packages go up as pipeline versions; each run submits the next from the cluster
            params, run_name = _start_chain(kfp_client, conn, args, compiled, later, name, arguments, service_account)
            arguments.update(params)
            if args.from_iteration:  # a later run of the chain: its package, first_iteration and name
                package, arguments[chain.FIRST_PARAM], run_name = _run_from(args, compiled, later, name)
        elif args.from_iteration:
            raise ConfigError("--from-iteration: this pipeline is one run, not a chain; leave it out.")
        with client.api_errors(conn, "creating the run"):
            result = kfp_client.create_run_from_pipeline_package(
                package, arguments=arguments, run_name=run_name or None, experiment_name=args.experiment,
                namespace=conn.namespace or None, pipeline_root=args.pipeline_root or None,
                service_account=service_account or None)
        client.require_id(conn, result.run_id, "the new run")
    print(f"submitted run {result.run_id} (experiment {args.experiment}): {client.run_url(conn, result.run_id)}")
    if not args.wait:
        return 0
    run = client.wait(kfp_client, conn, result.run_id, args.timeout, args.poll)
    if str(run.state).upper() == "SUCCEEDED":
        print(f"run {result.run_id} SUCCEEDED")
        return 0
    print(client.failure_report(run, conn, args.log_lines), file=sys.stderr)
    return 1


def _upload(args) -> int:
    import hashlib
    import json as json_lib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        package, spec, stage_sets = _package(args, tmp, check_backend=False)  # checked for the server's version
        if chain.CHAIN_PARAM in package_defaults(package):
            raise ConfigError("upload: this is a chain of runs (pipeline.iterations beyond what one run holds); start "
                              "it with `pipeline submit`, which uploads its later runs' packages itself.")
        if stage_sets:  # a compiled package's stage defaults are what the UI offers: recompile to change them
            raise ConfigError("--set STAGE.KEY with --package: upload compiles stage keys in; use --config.")
        name = args.name or (spec.pipeline.name if spec else _package_doc(package)[0]["pipelineInfo"]["name"])
        version = args.version or "sha256-" + hashlib.sha256(Path(package).read_bytes()).hexdigest()[:12]
        conn = client.Connection.from_args(args)
        kfp_client = client.connect(conn)
        check_server(conn, package, spec, *server_family(kfp_client, conn))
        query = json_lib.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]})
        with client.api_errors(conn, f"looking up pipeline {name}"):
            found = kfp_client.list_pipelines(filter=query, namespace=conn.namespace or None).pipelines or []
        if not found:
            with client.api_errors(conn, f"uploading pipeline {name}"):
                made = kfp_client.upload_pipeline(package, pipeline_name=name, description=args.description or None,
                                                  namespace=conn.namespace or None)
            client.require_id(conn, made.pipeline_id, f"the upload of pipeline {name}")
            print(f"created pipeline {name} ({made.pipeline_id}) with its first version; start runs from it in the "
                  f"KFP UI, or upload again for a new version")
            return 0
        with client.api_errors(conn, f"uploading version {version} of pipeline {name}"):
            made = kfp_client.upload_pipeline_version(package, pipeline_version_name=version,
                                                      pipeline_id=found[0].pipeline_id,
                                                      description=args.description or None)
            client.require_id(conn, made.pipeline_version_id, f"the upload of version {version}")
    print(f"uploaded version {version} ({made.pipeline_version_id}) of pipeline {name} ({found[0].pipeline_id})")
    return 0


def _run_local(args) -> int:
    from .summary import ui_hint

    spec = load_config(args.config, args.set)
    params = parse_params(args.param)
    uri, experiment, parent = run_local(spec, params, Path(args.root), verbose=args.verbose, runs=args.runs)
    print_summary(uri, experiment, parent)
    if parent is not None:  # the page opens on the runs table, not MLflow's GenAI view
        print(ui_hint(uri, experiment, parent_run_id=parent))
    return 0


def _compare(args) -> int:
    from mlflow.tracking import MlflowClient

    from .compare import compare_hint, comparison_rows, format_rows, load_variants, shared_inputs

    _, variants = load_variants(args.config)
    params = parse_params(args.param)
    root = Path(args.root)
    runs: dict[str, str] = {}
    shared: dict[str, str] = {}
    specs = {name: load_spec(f"{args.config} [variant {name}]", None, data) for name, data in variants.items()}
    for name, spec in specs.items():  # every variant's config is checked before the first one runs
        spec.pipeline.run_name = name
    for i, (name, spec) in enumerate(specs.items()):
        for key, path in shared.items():
            if not getattr(spec.pipeline, key):
                setattr(spec.pipeline, key, path)
        print(f"=== variant {i + 1}/{len(specs)}: {name}" + (" (SFT policy and PRM imported from the first)" if shared else ""))
        uri, _, parent = run_local(spec, dict(params), root / name, verbose=args.verbose)
        if parent is None:
            raise PrmflowError("pipeline compare needs MLflow tracking (it reads every variant's results from it).")
        runs[name] = parent
        client = MlflowClient(uri)
        if not shared:
            shared = shared_inputs(client, parent)
    table = format_rows(comparison_rows(client, runs))
    print("\n" + table)
    (root / "comparison.txt").write_text(table + "\n")
    print(f"\nwritten to {root / 'comparison.txt'}\n{compare_hint(uri, runs)}")
    return 0


def _stage_command(args) -> int:
    import subprocess

    from mlflow.tracking import MlflowClient

    from .. import tracking
    from ..tracking.handoffs import handoffs_of_run
    from .console import check_root
    from .fetch import default_cache, fetch_inputs
    from .rerun import container_engine, direct_command, placeholder_image_note, rerun_report, stage_command
    from .settings import DEFAULT_CPU_IMAGE, DEFAULT_GPU_IMAGE

    check_root(Path(args.output), "stage-command", "--output")  # before anything is fetched
    cfg = tracking.TrackingConfig(uri=args.tracking_uri)
    tracking.check_store(*tracking.configured_uri(cfg, "--tracking-uri"), must_exist=True)  # reads runs: creates no store
    uri = tracking.resolve_uri(cfg)
    run_id = args.run_id or _stage_run_of(MlflowClient(uri), uri, args.kfp_run_id, args.stage, args.iteration)
    try:
        run = MlflowClient(uri).get_run(run_id)
    except Exception as e:  # MlflowException: not found, store unreachable
        raise PrmflowError(f"Cannot read MLflow run {run_id} from {uri}: {e}") from None
    logged_stage = run.data.tags.get("prmflow.stage")
    if logged_stage != args.stage:
        raise PrmflowError(f"MLflow run {run_id} is a {logged_stage!r} run, not {args.stage!r}.")
    cache = Path(args.fetch or default_cache()).expanduser()
    inputs = fetch_inputs(handoffs_of_run(run), cache)  # verified against the recorded digests
    if args.no_container:
        argv = direct_command(args.stage, run.data.params, args.output, inputs, cache / "gathered" / args.run_id)
    else:
        image = args.image or (DEFAULT_CPU_IMAGE if args.stage == "advantage" else DEFAULT_GPU_IMAGE)
        if note := placeholder_image_note(image, args.run):
            print(note, file=sys.stderr)
        argv = stage_command(args.stage, run.data.params, image, args.output, inputs,
                             engine=args.engine or container_engine())
    Path(args.output).mkdir(parents=True, exist_ok=True)  # podman refuses a mount source that does not exist
    print(shlex.join(argv), flush=True)
    if args.run:
        code = subprocess.run(argv).returncode
        if code == 0:
            print(rerun_report(args.stage, run, run.data.params, args.output))
        return code
    return 0


def _stage_run_of(client, uri: str, kfp_run_id: str, stage: str, iteration: int | None) -> str:
    """The MLflow run of `stage` (at `iteration`) in KFP run `kfp_run_id`; an error listing them if not one."""
    from ..tracking import PIPELINE_TAG

    query = f"tags.`{PIPELINE_TAG}` = '{kfp_run_id}' and tags.`prmflow.stage` = '{stage}'"
    if iteration is not None:
        query += f" and tags.`prmflow.iteration` = '{iteration}'"
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=query, max_results=100) if experiments else []
    if len(runs) == 1:
        return runs[0].info.run_id
    if not runs:
        raise PrmflowError(f"No {stage!r} run of KFP run {kfp_run_id}{'' if iteration is None else f' at iteration {iteration}'} "
                           f"in {uri}. Check --tracking-uri (the pipeline's tracking_uri) and the KFP run id.")
    listed = "\n".join(f"  {r.info.run_id}  {r.info.run_name}  {r.info.status}" for r in runs)
    raise PrmflowError(f"KFP run {kfp_run_id} has {len(runs)} {stage!r} runs; pick one with --run-id"
                       f"{'' if iteration is not None else ' (or narrow with --iteration)'}:\n{listed}")
