"""The app's checkpoints: DCP files of the training state (`dcp`), the folder that holds them
(`files`: authenticated manifests, `latest`, pruning), one rank's part in saving and resuming
(`ranks`), reading received files without running their code (`safe`), and a run's newest
checkpoint as one plain model (`restore`, for `recover sample` and `recover export`).

Invariant: a checkpoint is read only after its manifest verifies under the run token, and its
DCP metadata only through the allow-list unpickler; nothing outside this package writes one.
"""
