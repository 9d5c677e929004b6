"""The paper's sweeps as resumable Hydra multiruns (docs/sweeps.md): the sweep directory and
its manifest (manifest.py), states from attempts and SLURM (status.py), planning before
submission (plan.py) and the job side (job.py). The Hydra plugins that drive them live in
``hydra_plugins/charllm_sweeps``."""
