"""`shardwise bench data`: your own corpus (data/prepare.py) at 1 MiB and at 1 GiB of JSON Lines:
how fast it is prepared (on one process and on the default pool, one process per core), how long a
micro-batch takes to read from the prepared tokens against a training step of the demo model, and
what the reading costs a rank in memory.

A driver: it writes each corpus (1 KiB lines of text, byte tokenizer), prepares it from this
process on one process and then on the default pool (into caches of their own, the same bytes),
then starts one fresh process per corpus that reads `--steps` x `--reads` of the demo
config's micro-batches (16 windows of 129 tokens) through the trainer's own sampler and
`TokenWindows`, as a rank does, and reports the median read time and its RSS after them above what
it held before the datasets were made; and one process that times the demo model's training step (`single`,
one thread, the same micro-batch). The loader must never be the bottleneck: its read is compared
with the step, and its RSS between the two corpora.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import ROOT, bench_env
from bench.common import write_json

LINE_BYTES = 1024
DEMO = ROOT / "configs" / "demo.toml"


def write_corpus(path: Path, mib: int) -> None:
    """`mib` MiB of JSON lines of ~1 KiB of words each (a 1 MiB block written again with other ids)."""
    words = "the of and to a in that is was he for it with as his on be at by i this had not are but from".split()
    text = " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(LINE_BYTES // 4))[: LINE_BYTES - 40]
    block = "".join(json.dumps({"id": i, "text": text}) + "\n" for i in range((1 << 20) // LINE_BYTES))
    with open(path, "w") as f:
        for _ in range(mib):
            f.write(block)


def config_overrides(corpus: Path) -> list[str]:
    return [f"data.path={corpus}", "run.out=unused"]


def read_batches(corpus: str, reads: int) -> dict[str, float]:
    """In a fresh process: `reads` micro-batches read as a rank reads them; the median read time
    and the RSS then above the process's before the datasets were made."""
    from shardwise.config.load import load_config
    from shardwise.data import GlobalBatchSampler, make_datasets

    cfg = load_config(DEMO, config_overrides(Path(corpus)))
    before = _rss()
    train, _ = make_datasets(cfg)
    sampler = GlobalBatchSampler(len(train), cfg.train.global_batch, cfg.train.seed)
    times = []
    for step in range(reads):
        started = time.perf_counter()
        for indices in sampler.micro_batches(step, 0, 2, cfg.train.micro_batch):  # rank 0 of the demo's 2
            train.batch(indices)
        times.append(time.perf_counter() - started)
    times.sort()
    return {"read_s": times[len(times) // 2], "rss_rise_mib": (_rss() - before) / 2**20,
            "windows": len(train)}


def step_time(steps: int) -> float:
    """In a fresh process: the demo model's median training step on one thread, one micro-batch."""
    from shardwise.config.load import load_config
    from shardwise.dist import init_distributed
    from shardwise.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(DEMO, ["parallel.strategy=single", "launch.nproc=1", "train.global_batch=16", "run.out=unused"])
    trainer = Trainer(cfg, init_distributed(threads_per_rank=1))
    times = []
    for step in range(steps + 2):
        started = time.perf_counter()
        trainer.run_step(step)
        times.append(time.perf_counter() - started)
    times = sorted(times[2:])
    return times[len(times) // 2]


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


def _rss() -> int:
    """This process's resident bytes now (what a peak would hide: importing torch passes higher)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def _in_child(*args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "bench.data", "--child", *args], capture_output=True,
                         text=True, check=True, env=bench_env())
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(sizes_mib: list[int], steps: int, reads: int) -> dict[str, Any]:
    from shardwise.config.load import load_config
    from shardwise.data import prepare

    load_before = os.getloadavg()[0]
    corpora = {}
    workers = prepare.default_workers()
    with tempfile.TemporaryDirectory() as tmp:
        for mib in sizes_mib:
            corpus = Path(tmp) / f"corpus-{mib}mib.jsonl"
            write_corpus(corpus, mib)
            cfg = load_config(DEMO, config_overrides(corpus))
            os.environ["SHARDWISE_CACHE"] = str(Path(tmp) / "cache-1-process")
            one_process_s = _timed(prepare.prepare, cfg.data, cfg.data.path, workers=1)
            shutil.rmtree(Path(tmp) / "cache-1-process")
            os.environ["SHARDWISE_CACHE"] = str(Path(tmp) / "cache")
            prepared_s = _timed(prepare.prepare, cfg.data, cfg.data.path, workers=workers)
            again_s = _timed(prepare.prepare, cfg.data, cfg.data.path)  # again: the manifest is there
            read = _in_child("read", str(corpus), str(reads))
            corpora[f"{mib} MiB"] = {"bytes": corpus.stat().st_size, "prepare_1_process_s": one_process_s,
                                     "prepare_s": prepared_s, "prepare_speedup": one_process_s / prepared_s,
                                     "prepare_mib_per_s": mib / prepared_s, "prepare_again_s": again_s, **read}
            corpus.unlink()
        step = _in_child("step", str(steps))
    rss = [entry["rss_rise_mib"] for entry in corpora.values()]
    return {
        "bench": "data",
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "prepare_processes": workers,
        "demo_step_s": step,
        "corpora": corpora,
        "read_over_step": {name: entry["read_s"] / step for name, entry in corpora.items()},
        "rss_rise_spread_mib": max(rss) - min(rss),
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"data bench: demo model step {result['demo_step_s'] * 1000:.1f} ms (one thread); load average "
             f"{result['load_average_before_after'][0]:.1f} -> {result['load_average_before_after'][1]:.1f}"]
    for name, entry in result["corpora"].items():
        lines.append(f"  {name:>9}: prepared in {entry['prepare_1_process_s']:7.2f} s on 1 process, "
                     f"{entry['prepare_s']:7.2f} s on {result['prepare_processes']} ({entry['prepare_speedup']:.2f}x, "
                     f"{entry['prepare_mib_per_s']:6.1f} MiB/s; again {entry['prepare_again_s'] * 1000:.1f} ms), "
                     f"{entry['windows']:,} windows; a step's "
                     f"micro-batch read in {entry['read_s'] * 1000:.3f} ms ({result['read_over_step'][name]:.5f} of "
                     f"a step), RSS +{entry['rss_rise_mib']:.1f} MiB")
    lines.append(f"  RSS rise spread between the corpora: {result['rss_rise_spread_mib']:.1f} MiB")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__)
    parser.add_argument("--steps", type=int, default=12, help="demo training steps timed")
    parser.add_argument("--reads", type=int, default=200, help="steps' micro-batches read per corpus")
    parser.add_argument("--sizes-mib", default="1,1024", help="corpus sizes, MiB, comma-separated")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        value = read_batches(rest[0], int(rest[1])) if kind == "read" else step_time(int(rest[0]))
        print(json.dumps(value))
        return
    result = run([int(s) for s in args.sizes_mib.split(",")], args.steps, args.reads)
    write_json(result, args.json)
    print(format_result(result), flush=True)


if __name__ == "__main__":
    main()
