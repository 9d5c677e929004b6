"""Hydra plugins of charllm-nemo's sweeps (docs/sweeps.md): the ``charllm`` sweeper
(``hydra/sweeper=charllm``, which every ``conf/sweep/*.yaml`` selects) and submitit launchers
that tell it each job's id as they submit (the presets in ``conf/hydra/launcher/``)."""

from hydra.core.config_store import ConfigStore

from hydra_plugins.charllm_sweeps.sweeper import CharllmSweeperConf

ConfigStore.instance().store(
    group="hydra/sweeper", name="charllm", node=CharllmSweeperConf, provider="charllm"
)
