"""Library shared by the stages: code more than one stage needs lives here, never in a stage package.

Imports run one way: ``common`` <- ``lib`` <- the stage packages, so a stage never imports another stage.
"""
