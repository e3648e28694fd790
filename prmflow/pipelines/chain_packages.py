"""What a chain of runs (pipelines/chain.py) is compiled to: K, the iterations one run holds (from the size model
of each package shape on every KFP version it may run on), and the packages and manifest `pipeline compile` writes.
Apart from chain.py, which the DAG builder and the KFP components import, because these compile the DAG."""

from __future__ import annotations

import os

from ..errors import ConfigError
from .chain import MANIFEST_KIND, SHAPES, Segment, is_manifest, package_paths, segments, shape_at, versions_from


def per_run(spec, capacity_of=None) -> int:
    """K, the iterations of one run: pipeline.iterations when one run holds them all; else pipeline.run_iterations,
    or as many as one run of every chained package (first, next, last) holds on every KFP version from
    pipeline.cluster.kfp_version up (the oldest a package is meant to run on). A run_iterations above that is
    refused, naming the key. capacity_of(shape, version) -> size.Capacity (default: compiled here)."""
    pipe = spec.pipeline
    if pipe.run_iterations >= pipe.iterations:
        return pipe.iterations  # one run: its own size check (compile_to) says whether it fits
    capacity_of = capacity_of or capacities(spec)
    versions = versions_from(pipe.cluster.kfp_version)
    if not pipe.run_iterations and pipe.iterations <= min(capacity_of("whole", v).max_iterations()[0] for v in versions):
        return pipe.iterations
    holds = min(capacity_of(shape, v).max_iterations()[0] for shape in SHAPES for v in versions)
    if pipe.run_iterations > holds:
        raise ConfigError(f"pipeline.run_iterations is {pipe.run_iterations}, but one run of a chain holds at most "
                          f"{holds} iterations on Kubeflow Pipelines {pipe.cluster.kfp_version} and later (pipeline "
                          f"plan says why); set it to {holds} or fewer, or 0 for that many.")
    return pipe.run_iterations or holds


def capacities(spec):
    """(shape, version) -> size.Capacity of `spec`'s package of that shape, each compiled once (lazily) at
    size.LOW and size.HIGH iterations: a chained package carries more per iteration (first_iteration)."""
    from functools import lru_cache

    from . import size
    from .pipeline import compiled_docs

    @lru_cache(maxsize=None)
    def docs(shape: str, n: int):
        return compiled_docs(spec, n, shape_at(shape, n))

    return lambda shape, version: size.capacity(lambda n: docs(shape, n), version)


def compile_chain(spec, path: str, check_backend: bool = True) -> tuple[list[Segment], dict[str, str]]:
    """Compile what a chain of `spec` submits: one package per distinct run shape (first, next, last; the
    first iteration is a run parameter, so every middle run shares one package), each measured against every
    KFP version from pipeline.cluster.kfp_version up (compile_to refuses one that would outgrow a limit), and
    the chain's manifest: its runs and each package's modelled size per version. Nothing is written unless
    every part is. One run: `path` alone, as before."""
    import yaml

    from . import size
    from .pipeline import compile_to, is_compiled_spec
    from .settings import safe_loader

    segs = segments(spec.pipeline.iterations, per_run(spec))
    if len(segs) == 1:
        return segs, {"whole": compile_to(spec, path, check_backend)}
    if not spec.pipeline.cluster.workspace_pvc:
        raise ConfigError(f"pipeline.iterations is {segs[0].total}, more than one run holds ({segs[0].iterations}): "
                          f"the runs of a chain hand their state on over the workspace, and KFP's per-run workspace "
                          f"is deleted with each run. Set pipeline.cluster.workspace_pvc to a ReadWriteMany PVC.")
    paths = package_paths(path, len(segs))
    for shape, target in paths.items():  # a file of the user's is never replaced
        ours = is_compiled_spec(target) if shape != "manifest" else is_manifest(target)
        if shape != "first" and os.path.lexists(target) and not ours:
            raise ConfigError(f"{target} exists and is not what `pipeline compile` writes there; it is left as it "
                              f"is. Name another output with -o.")
    tmp = {shape: os.path.join(os.path.dirname(os.path.abspath(p)), f".tmp-{os.getpid()}-{os.path.basename(p)}")
           for shape, p in paths.items()}
    sizes: dict[str, dict] = {}
    try:
        for shape in SHAPES:
            seg = next((s for s in segs if s.shape == shape), None)
            if seg is None:
                continue
            compile_to(spec, tmp[shape], check_backend, segment=seg)
            with open(tmp[shape]) as f:
                docs = [d for d in yaml.load_all(f, Loader=safe_loader()) if d]
            sizes[shape] = {}
            for v in versions_from(spec.pipeline.cluster.kfp_version):
                m, lim = size.measure(docs, v), size.limits(v)
                sizes[shape][v] = {"spec_kib": round(m.spec / 1024, 1),
                                   "stored_kib": round((m.spec + m.compressed) / 1024, 1),
                                   "stored_limit_kib": round(lim["stored"][0] / 1024, 1),
                                   "component_arg_kib": round(m.component_arg / 1024, 1),
                                   "component_arg_limit_kib": round(lim["component_arg"][0] / 1024, 1),
                                   "margin": size.MARGIN}
        manifest = {"kind": MANIFEST_KIND, "pipeline": spec.pipeline.name, "iterations": segs[0].total,
                    "run_iterations": segs[0].iterations,
                    "runs": [{"run": s.index, "first_iteration": s.first, "iterations": s.iterations,
                              "package": os.path.basename(paths[s.shape])} for s in segs],
                    "packages": {shape: os.path.basename(paths[shape]) for shape in sizes}, "modelled_size": sizes}
        with open(tmp["manifest"], "w") as f:
            yaml.safe_dump(manifest, f, sort_keys=False)
        for shape in [*sizes, "manifest"]:
            os.replace(tmp[shape], paths[shape])
    finally:
        for t in tmp.values():
            if os.path.exists(t):
                os.remove(t)
    return segs, {shape: paths[shape] for shape in [*sizes, "manifest"]}
