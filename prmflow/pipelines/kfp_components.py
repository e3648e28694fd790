"""The KFP components: one thin shim per stage that turns KFP's arguments (artifact paths, the
workspace, the iteration) into the stage's `paths` and calls `kfp_shim.run_stage` (which runs `stage.run`).

KFP compiles each function's own source into the pipeline spec and runs it inside the stage's image,
so every import a shim needs is inside its body. The logic lives in the stages; these only translate.
Each pipeline stage of prmflow/stages.py has its function here, named `stages.component(stage)`.

Data flow (pipelines/kfp_shim.py): a stage that writes weights (sft, prm, prm-update, ppo) writes them once to
the workspace and its Model artifact is their *location* (a few KB: where, sha256s, sizes); a reader
opens them in place (`located`). Every reader of a location takes the `workspace` parameter, even one
that only opens it: KFP mounts its per-run workspace only into tasks whose parameters name it. Rollouts, advantages,
evaluation results and the KL controller's state are small and travel as ordinary artifacts. An input a configuration
does not read is not wired at all (an optional input left None): no critic without a critic, no reference model
without a KL term, no PRM with the oracle. The MLflow parent run is found through $PRMFLOW_KFP_RUN_ID.
"""

from typing import List

from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

def sft(config: dict, tracking_uri: str, experiment: str, workspace: str, policy: Output[Model], placement: str = ""):
    """Train the SFT policy; `policy` locates its HF checkpoint directory on the workspace. `placement`: a
    TrainJob step's image and node shape (TrainJobSpec.placement), a parameter so that KFP's cache key and the
    output's place on the workspace change with them (the TrainJob itself reads $PRMFLOW_TRAINJOB)."""
    from prmflow.pipelines.kfp_shim import artifact_metadata, run_stage, workspace_output, write_location
    from prmflow.components.sft import stage

    placed = {"placement": placement} if placement else {}  # a new image or node shape: computed anew, elsewhere
    out = workspace_output(workspace, "sft", "sft", config, placed) if workspace else policy.path
    metrics = run_stage("sft", stage, config, {"output": out}, tracking_uri=tracking_uri, experiment=experiment)
    policy.metadata.update(artifact_metadata(metrics))
    if workspace:
        policy.metadata.update(write_location(policy.path, out))


def prm(config: dict, tracking_uri: str, experiment: str, workspace: str, prm_model: Output[Model],
        base: Input[Model] = None, placement: str = ""):
    """Train the process reward model on `base` (the SFT policy; not wired when the config names its
    own backbone); `prm_model` locates its HF token-classification directory. `placement`: as sft's."""
    from prmflow.pipelines.kfp_shim import (artifact_metadata, located, location_fingerprint, run_stage,
                                            workspace_output, write_location)
    from prmflow.components.prm import stage

    inputs = {"base": location_fingerprint(base.path)} if base is not None else {}
    inputs.update({"placement": placement} if placement else {})
    out = workspace_output(workspace, "prm", "prm", config, inputs) if workspace else prm_model.path
    paths = {"output": out, **({"backbone": located(base.path)} if base is not None else {})}
    metrics = run_stage("prm", stage, config, paths, tracking_uri=tracking_uri, experiment=experiment)
    prm_model.metadata.update(artifact_metadata(metrics))
    if workspace:
        prm_model.metadata.update(write_location(prm_model.path, out))


def rollout(config: dict, tracking_uri: str, experiment: str, iteration: int, shard: int, num_shards: int,
            policy: Input[Model], rollouts: Output[Dataset], prm_model: Input[Model] = None,
            ref: Input[Model] = None, critic: Input[Model] = None, workspace: str = "", first_iteration: int = 0):
    """Sample and score shard `shard` of `num_shards` of this iteration's prompts. `workspace` is not read
    here: naming it makes KFP's driver mount the per-run workspace where the models' locations point.
    `first_iteration` (a run of a chain, pipelines/chain.py): the RL iteration is first_iteration + iteration."""
    from prmflow.pipelines.kfp_shim import dataset_metadata, located, run_stage
    from prmflow.components.rollout import stage

    iteration += first_iteration

    paths = {"policy": located(policy.path), "shard": shard, "num_shards": num_shards, "output": rollouts.path}
    for key, artifact in (("prm", prm_model), ("ref", ref), ("critic", critic)):
        if artifact is not None:
            paths[key] = located(artifact.path)
    run_stage("rollout", stage, config, paths, tracking_uri=tracking_uri, experiment=experiment, iteration=iteration)
    rollouts.metadata.update(dataset_metadata(rollouts.path))


def prm_update(config: dict, tracking_uri: str, experiment: str, workspace: str, iteration: int,
               prm_model: Input[Model], rollouts: Input[List[Dataset]], updated_prm: Output[Model],
               state: Output[Artifact], previous: Input[Artifact] = None, first_iteration: int = 0):
    """Keep the PRM on-policy: warm start from `prm_model` (the PRM that scored these rollouts), train on
    the collected `rollouts` shards, replaying the older rollouts `previous` (the last update's `state`)
    names. A later task cannot read an earlier task's artifact by path, so the rollouts (small Parquet)
    are copied into this update's workspace directory, DIR/replay/rollouts, beside DIR/replay/replay.json
    (the rollouts this update replayed); `state` locates DIR/replay, `updated_prm` the PRM in DIR/prm.
    `first_iteration`: as rollout's."""
    import json
    import os
    import shutil

    from prmflow.components.data.io import write_json_atomic
    from prmflow.pipelines.kfp_shim import (artifact_metadata, gather_shards, located, location_fingerprint,
                                            run_stage, workspace_output, write_location)
    from prmflow.components.prm import online_update as stage

    iteration += first_iteration
    shards = [r.path for r in rollouts]
    inputs = {"prm": location_fingerprint(prm_model.path), "rollouts": [location_fingerprint(p) for p in shards],
              "previous": location_fingerprint(previous.path) if previous is not None else "", "iteration": iteration}
    out = workspace_output(workspace, f"prm-update-{iteration}", "prm-update", config, inputs)
    kept, copy = os.path.join(out, "replay"), os.path.join(out, "replay", "rollouts")
    if not os.path.isdir(copy):  # copied whole, then renamed: a retried pod finds the full copy or none
        shutil.rmtree(copy + ".tmp", ignore_errors=True)
        shutil.copytree(gather_shards(shards, state.path + ".inputs"), copy + ".tmp")  # the shards, not the links
        os.replace(copy + ".tmp", copy)
    replay = []
    if previous is not None:  # everything the last update replayed, and the rollouts it trained on
        before = located(previous.path)
        with open(os.path.join(before, "replay.json")) as f:
            replay = json.load(f) + [os.path.join(before, "rollouts")]
    write_json_atomic(os.path.join(kept, "replay.json"), replay)
    paths = {"prm": located(prm_model.path), "input": copy, "replay": replay, "output": os.path.join(out, "prm")}
    metrics = run_stage("prm-update", stage, config, paths, tracking_uri=tracking_uri, experiment=experiment,
                        iteration=iteration)
    updated_prm.metadata.update({**artifact_metadata(metrics), **write_location(updated_prm.path, paths["output"])})
    state.metadata.update(write_location(state.path, kept))


def advantage(config: dict, tracking_uri: str, experiment: str, iteration: int, rollouts: Input[List[Dataset]],
              advantages: Output[Dataset], kl_state: Input[Artifact] = None, first_iteration: int = 0):
    """Turn the collected rollout shards into advantages; `kl_state` is the previous ppo step's KL
    controller state (a few bytes), wired only when the reward has a KL term and k > 0. `first_iteration`:
    as rollout's."""
    from prmflow.components.advantage import stage
    from prmflow.pipelines.kfp_shim import dataset_metadata, gather_shards, run_stage

    iteration += first_iteration
    paths = {"input": gather_shards([r.path for r in rollouts], advantages.path + ".inputs"), "output": advantages.path}
    if kl_state is not None:
        paths["kl_state"] = kl_state.path
    run_stage("advantage", stage, config, paths, tracking_uri=tracking_uri, experiment=experiment, iteration=iteration)
    advantages.metadata.update(dataset_metadata(advantages.path))


def ppo(config: dict, tracking_uri: str, experiment: str, workspace: str, iteration: int, policy: Input[Model],
        advantages: Input[Dataset], updated: Output[Model], critic: Output[Model], state: Output[Artifact],
        kl_state: Output[Artifact], previous: Input[Artifact] = None, placement: str = "", first_iteration: int = 0):
    """Update the policy (and critic). `placement`: as sft's. `updated` locates the new policy, `critic` the new critic (an empty
    location without train_critic; nothing wires it then), `state` the whole output on the workspace
    (critic, optimizer moments, updates.jsonl), `kl_state` is the KL controller's state for the next
    advantage step. `previous` (the last iteration's `state`) carries the critic and the optimizer over.
    `first_iteration`: as rollout's."""
    import os
    import shutil

    from prmflow.pipelines.kfp_shim import (artifact_metadata, located, location_fingerprint, run_stage,
                                            workspace_output, write_location)
    from prmflow.components.ppo import stage

    iteration += first_iteration
    inputs = {"policy": location_fingerprint(policy.path), "advantages": location_fingerprint(advantages.path),
              "previous": location_fingerprint(previous.path) if previous is not None else "", "iteration": iteration,
              **({"placement": placement} if placement else {})}
    out = workspace_output(workspace, f"ppo-{iteration}", "ppo", config, inputs) if workspace else state.path
    paths = {"policy": located(policy.path), "input": advantages.path, "output": out}
    if previous is not None:  # the critic and Adam's moments continue; a missing one starts fresh
        before = located(previous.path)
        for key, sub in (("critic", "critic"), ("optimizer_state", "optimizer")):
            if os.path.isdir(os.path.join(before, sub)):
                paths[key] = os.path.join(before, sub)
    metrics = run_stage("ppo", stage, config, paths, tracking_uri=tracking_uri, experiment=experiment,
                        iteration=iteration)
    updated.metadata.update({**artifact_metadata(metrics), **write_location(updated.path, out, "policy")})
    critic.metadata.update(write_location(critic.path, out, "critic"))
    if workspace:
        state.metadata.update(write_location(state.path, out))
    shutil.copyfile(os.path.join(out, "kl_state.json"), kl_state.path)


def evaluate(config: dict, tracking_uri: str, experiment: str, policy: Input[Model], baseline: Input[Model],
             results: Output[Model], scores: Output[Metrics], prm_model: Input[Model] = None, workspace: str = ""):
    """Evaluate the final policy against `baseline`; `scores` shows the eval metrics in the KFP UI.
    `workspace` is not read: naming it makes KFP's driver mount the workspace the models are on."""
    from prmflow.pipelines.kfp_shim import artifact_metadata, located, run_stage
    from prmflow.components.evaluate import stage

    paths = {"policy": located(policy.path), "baseline": located(baseline.path), "output": results.path}
    if prm_model is not None:
        paths["prm"] = located(prm_model.path)
    metrics = run_stage("evaluate", stage, config, paths, tracking_uri=tracking_uri, experiment=experiment)
    for key, value in artifact_metadata(metrics).items():
        scores.log_metric(key, value)


def locate(path: str, model: Output[Model]):
    """An existing model directory on the workspace volume (pipeline.sft_model / prm_model), recorded with
    its files' sha256 and sizes, so its readers open it in place and lineage pins its bytes."""
    from prmflow.pipelines.kfp_shim import write_location

    model.metadata.update(write_location(model.path, path))


def chain_resume(workspace: str, shape: str, first_iteration: int, needs: List[str], sft_config: dict,
                 prm_config: dict, rollout_config: dict, advantage_config: dict, ppo_config: dict,
                 policy: Output[Model], sft_policy: Output[Model], prm_model: Output[Model], critic: Output[Model],
                 state: Output[Artifact], kl_state: Output[Artifact], prm_state: Output[Artifact],
                 sampled_policy: Output[Model], sampled_critic: Output[Model], sampled_prm_model: Output[Model]):
    """The start of a run of a chain (pipelines/chain.py): the state the run before it ended with, read from
    the workspace record its chain_next wrote (named by `shape` and the stage configs), each piece as the
    location it was; `needs` are the pieces this run reads (refused when the record lacks one). Off by one, the
    sampled_* pieces are what the next rollout samples with (the policy, critic and PRM one update older)."""
    from prmflow.pipelines import chain

    key = chain.state_key(shape, {"sft": sft_config, "prm": prm_config, "rollout": rollout_config,
                                  "advantage": advantage_config, "ppo": ppo_config})
    record = chain.read_state(workspace, key, first_iteration, list(needs))
    chain.restore(record, {"policy": policy.path, "sft_policy": sft_policy.path, "prm_model": prm_model.path,
                           "critic": critic.path, "state": state.path, "prm_state": prm_state.path,
                           "sampled_policy": sampled_policy.path, "sampled_critic": sampled_critic.path,
                           "sampled_prm_model": sampled_prm_model.path}, kl_state.path)
    print(f"chain: resumed after iteration {first_iteration} from {chain.record_path(workspace, key, first_iteration)}")


def chain_next(workspace: str, shape: str, first_iteration: int, iterations: int, sft_config: dict,
               prm_config: dict, rollout_config: dict, advantage_config: dict, ppo_config: dict,
               policy: Input[Model], sft_policy: Input[Model] = None, prm_model: Input[Model] = None,
               critic: Input[Model] = None, state: Input[Artifact] = None, kl_state: Input[Artifact] = None,
               prm_state: Input[Artifact] = None, sampled_policy: Input[Model] = None,
               sampled_critic: Input[Model] = None, sampled_prm_model: Input[Model] = None, chain: str = "",
               chain_id: str = ""):
    """The end of a run of a chain that is not the last: record its final state on the workspace for the next
    run's chain_resume, then (on a cluster, `chain` = the continuation, chain.Continuation) submit that run
    from here with the pod's service account. Runs only when every task before it succeeded."""
    from prmflow.pipelines import chain as chain_lib

    key = chain_lib.state_key(shape, {"sft": sft_config, "prm": prm_config, "rollout": rollout_config,
                                      "advantage": advantage_config, "ppo": ppo_config})
    pieces = {name: artifact.path for name, artifact in (
        ("policy", policy), ("sft_policy", sft_policy), ("prm_model", prm_model), ("critic", critic),
        ("state", state), ("prm_state", prm_state), ("sampled_policy", sampled_policy),
        ("sampled_critic", sampled_critic), ("sampled_prm_model", sampled_prm_model)) if artifact is not None}
    after = first_iteration + iterations
    path = chain_lib.write_state(workspace, key, after, pieces, kl_state.path if kl_state is not None else "")
    print(f"chain: state after iteration {after} recorded at {path}")
    if chain:
        chain_lib.submit_next(chain, after, chain_id)
