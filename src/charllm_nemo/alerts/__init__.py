"""Live alerts on rank 0 (docs/alerts.md): throttle onset and end, stragglers, thermal imbalance
per node, power over the limit; to the console, ``alerts.jsonl``, W&B and user functions.

* :class:`AlertsConfig` (Hydra group ``alerts``) and :func:`alerts_problems`;
* :class:`AlertDetector`: the logic, over step reports;
* :class:`AlertObserver` / :func:`alert_observer`: a step-API observer that delivers them;
* :class:`StageLayout`: each rank's pipeline stage and each stage's work (who is whose peer).
"""

from charllm_nemo.alerts.config import AlertsConfig, alerts_problems
from charllm_nemo.alerts.detect import ALERT_KINDS, AlertDetector
from charllm_nemo.alerts.observer import ALERTS_FILE, AlertObserver, alert_observer
from charllm_nemo.alerts.stages import StageLayout

__all__ = [
    "ALERTS_FILE",
    "ALERT_KINDS",
    "AlertDetector",
    "AlertObserver",
    "AlertsConfig",
    "StageLayout",
    "alert_observer",
    "alerts_problems",
]
