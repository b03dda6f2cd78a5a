"""Framework integrations: Lightning, Hugging Face `Trainer`, accelerate.

Each submodule imports its framework only when it is itself imported, so `import slurmresume`
(and `import slurmresume.integrations`) loads no framework:

    from slurmresume.integrations.lightning import SlurmResume          # pip install slurmresume[lightning]
    from slurmresume.integrations.transformers import SlurmResumeCallback  # slurmresume[transformers]

accelerate needs no adapter: hand the prepared objects to a `slurmresume.Checkpointer` (see
`examples/accelerate_train.py` and the README).
"""
