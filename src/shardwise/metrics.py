"""What a run reports: one JSON object per step in OUT/metrics.jsonl (and the same numbers to the
trackers the config asks for: TensorBoard, MLflow, W&B; trackers.py), progress on rank 0, MFU."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from shardwise.trackers import Trackers

# Dense bf16 tensor-core peaks from the vendors' datasheets, in FLOP/s.
DEVICE_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


def device_peak_flops(device: torch.device) -> float | None:
    """The device's bf16 dense peak, or None where it is unknown (every CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DEVICE_PEAK_FLOPS.items() if key in name), None)


def mfu(flops_per_sample: int | None, samples_per_s: float, world_size: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices in the world."""
    if flops_per_sample is None or peak is None:
        return None
    return flops_per_sample * samples_per_s / (peak * world_size)


class MetricsWriter:
    """Appends JSON records to OUT/metrics.jsonl and hands each to `trackers`; only the main rank
    writes. A resumed run keeps the records of the steps its checkpoint had completed (`resumed_at`)
    and drops the rest."""

    def __init__(self, path: Path, enabled: bool, resumed_at: int = 0, trackers: Trackers | None = None) -> None:
        self._file: TextIO | None = None
        self._trackers = trackers
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if resumed_at and path.is_file():
                records = []
                for line in filter(str.strip, path.read_text().splitlines()):
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:  # the last line, torn by a kill as it was written
                        break
                kept = [r for r in records if r.get("event") != "summary" and r.get("step", 0) <= resumed_at]
            # The kept records go to a file of their own, renamed over the old one, so that a kill
            # in between leaves the old records or the new ones, never a truncated file.
            rewritten = path.with_name(f".{path.name}.rewrite")
            with open(rewritten, "w") as file:
                file.writelines(json.dumps(record) + "\n" for record in kept)
            os.replace(rewritten, path)
            self._file = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._trackers is not None:
            self._trackers.write(record)

    def close(self, failed: bool = False) -> None:
        """Close the file, then end the trackers' runs (marked failed where the training raised)."""
        if self._file is not None:
            self._file.close()
        if self._trackers is not None:
            self._trackers.close(failed)


class Progress:
    """A progress bar on an interactive terminal; elsewhere (CI, logs) a plain line every few steps."""

    def __init__(self, total: int, enabled: bool, log_every: int, first: int = 0) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.total = total
        self.first = first  # steps already done before this process (a resumed run)
        self.started = time.perf_counter()
        interactive = enabled and sys.stderr.isatty()
        self._bar = tqdm(total=total, initial=first, dynamic_ncols=True, unit="step") if interactive else None

    def update(self, step: int, loss: float, tokens_per_s: float | None, samples_per_s: float) -> None:
        if not self.enabled:
            return
        rate = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s is not None else f"{samples_per_s:,.0f} samples/s"
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}  {rate}", refresh=False)
            self._bar.update(1)
            return
        done = step + 1
        if done % self.log_every == 0 or done == self.total:
            elapsed = time.perf_counter() - self.started
            eta = elapsed / (done - self.first) * (self.total - done)
            print(f"step {done}/{self.total}  loss {loss:.4f}  {rate}  eta {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _gib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _float8(summary: dict[str, Any]) -> str:
    """The float8 part of the summary's precision line, if the run had one."""
    if "float8" not in summary:
        return ""
    f8 = summary["float8"]
    left = f"; left out for their sizes: {', '.join(f8['left_out'])}" if f8["left_out"] else ""
    return f", float8 {f8['recipe']} ({f8['layers']} layers{left})"


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run table rank 0 prints."""
    rate = summary["tokens_per_s"]
    resumed = f" (resumed after step {summary['resumed_at']})" if summary["resumed_at"] else ""
    skipped = f", {summary['skipped_steps']} steps skipped on overflow" if summary["skipped_steps"] else ""
    rows = [
        ("strategy", f"{summary['strategy']} on {summary['world_size']} process(es)"),
        ("steps", f"{summary['steps']}{resumed}"),
        ("precision", f"{summary['precision']}{_float8(summary)}, recompute {summary['recompute']}{skipped}"),
        ("final train loss", f"{summary['final_loss']:.4f}"),
        ("validation loss", f"{summary['val_loss']:.4f}"),
        ("median step time", f"{summary['median_step_time_s'] * 1000:.1f} ms"),
        ("throughput", f"{rate:,.0f} tokens/s" if rate is not None else f"{summary['samples_per_s']:,.0f} samples/s"),
        ("MFU", f"{summary['mfu']:.1%}" if summary["mfu"] is not None else "n/a (device peak unknown)"),
    ]
    rows += [(f"memory: {k}", _gib(v) if v is not None else "n/a") for k, v in summary["memory"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
