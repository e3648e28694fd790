"""Library shared by the stages: code more than one stage needs lives here, never in a stage package.

Imports run one way: ``common`` <- ``lib`` <- the stage packages, so a stage never imports another stage.

    supervised_data.py  prompt/response examples and the response-token loss (sft, ppo's ptx term)
    supervised.py       the supervised training loop sft and prm share (resume, eval, checkpoints, SIGTERM)
    prm_model.py        the PRM: head, step readout (`encode`), loading, identity layers
    prm_scoring.py      PRMScorer: per-step scores of (prompt, response) text (rollout, evaluate, best-of-N)
    prm_metrics.py      step AUC, step accuracy, first-error recall
    bestofn.py          best-of-N sampling and reranking against majority vote, random pick and pass@1
    kl_state.py         the adaptive KL controller's state carried between RL iterations
"""
