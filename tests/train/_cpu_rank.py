"""One rank of a CPU training test: ``python _cpu_rank.py <config.json> <result.json>``.

The test sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. With
``telemetry.enabled=false`` the rank trains with a bare WindowRecorder (no session) and writes its
RankResult plus every window it recorded to ``result.json``; with telemetry on, run_rank opens
the real session (windows go to the store) and only the RankResult is written.
"""

from __future__ import annotations

import json
import sys

from charllm_nemo.telemetry.windows import WindowRecorder
from charllm_nemo.train.config_io import load_train_config
from charllm_nemo.train.loop import run_rank


def main(config_path: str, out_path: str) -> None:
    cfg = load_train_config(config_path)  # as a launched rank reads its config (nested fields too)
    recorder = None if cfg.telemetry.enabled else WindowRecorder()
    result = run_rank(cfg, recorder=recorder)
    out = result.to_dict()
    out["windows"] = recorder.drain() if recorder is not None else []
    with open(out_path, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
