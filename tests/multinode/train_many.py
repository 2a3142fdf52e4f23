"""Several trainings in one job across the nodes of a test cluster, so that the nodes start (and
import torch) once, not once per training. Each node's launcher (`python -m bench.netns
node ... train_many RUNS.json`) starts its workers as `python -m train_many RUNS.json`, and each
trains every run in RUNS.json (a list of {"out": DIR, "overrides": ["section.key=value", ...]} on gpt-tiny), one
after another in one world. Node 1's first worker notes in each run directory the bytes its node
sent over the link meanwhile (node1-tx-bytes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt-tiny.toml"


def tx_bytes() -> int:
    return int(Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes").read_text())


def worker(runs: str) -> None:
    from shardwise.config.load import load_config
    from shardwise.dist import init_distributed, leave_process, shutdown_distributed
    from shardwise.trainer import Trainer

    ctx = init_distributed("gloo", timeout_s=60, threads_per_rank=1)
    counts = os.environ["GROUP_RANK"] == "1" and os.environ["LOCAL_RANK"] == "0"
    for run in json.loads(Path(runs).read_text()):
        before = tx_bytes() if counts else 0
        Trainer(load_config(CONFIG, [*run["overrides"], f"run.out={run['out']}"]), ctx).fit()
        if counts:
            (Path(run["out"]) / "node1-tx-bytes").write_text(str(tx_bytes() - before))
    shutdown_distributed()
    leave_process()


if __name__ == "__main__":
    worker(sys.argv[1])
