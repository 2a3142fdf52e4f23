"""Seeing runs: `--tensorboard` scalars and `shardwise report`, from real short runs (a pipeline on
2 ranks through the CLI, `single` in this process)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers import CONFIGS, REPO, read_records, train_in_process

from shardwise.cli import main
from shardwise.config.load import load_config
from shardwise.trackers import scalars

STEPS, EVAL_EVERY, MICRO_BATCHES = 6, 3, 4
SHORT = [f"train.steps={STEPS}", f"train.eval_every={EVAL_EVERY}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """(single, pipeline) run directories of gpt-tiny, the pipeline with --tensorboard."""
    root = tmp_path_factory.mktemp("runs")
    pipe = root / "pipe"
    overrides = [arg for text in SHORT for arg in ("--set", text)]
    result = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "pipeline",
         "--nproc", "2", "--tensorboard", "--out", str(pipe), "--set",
         f"parallel.pipeline.micro_batches={MICRO_BATCHES}",
         *overrides],
        cwd=REPO, capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert result.returncode == 0, result.stderr
    single = root / "single"
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [*SHORT, f"run.out={single}"]))
    return single, pipe


def test_tensorboard_holds_the_metrics_jsonl_numbers(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    pipe = runs[1]
    events = EventAccumulator(str(pipe / "tensorboard"))
    events.Reload()
    got = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    steps = read_records(pipe)
    expected_tags = {f"train/{key}" for key in ("loss", "lr", "step_time_s", "samples_per_s", "tokens_per_s")}
    expected_tags |= {f"memory_MiB/rank{rank}/{category}" for rank in (0, 1)
                      for category in ("params", "grads", "optimizer", "activations", "peak", "gathered_peak")}
    assert set(got) == expected_tags | {"val/loss"}  # no MFU on CPU, no loss scale in fp32
    for record in steps:
        assert got["train/loss"][record["step"]] == pytest.approx(record["loss"], rel=1e-6)
        assert got["train/lr"][record["step"]] == pytest.approx(record["lr"], rel=1e-6)
        assert got["train/tokens_per_s"][record["step"]] == pytest.approx(record["tokens_per_s"], rel=1e-6)
        for rank, memory in enumerate(record["memory_by_rank"]):
            assert got[f"memory_MiB/rank{rank}/optimizer"][record["step"]] == pytest.approx(
                memory["optimizer"] / 2**20, rel=1e-6)
    assert sorted(got["train/loss"]) == list(range(1, STEPS + 1))
    (summary,) = read_records(pipe, "summary")
    (midway,) = read_records(pipe, "eval")
    assert got["val/loss"] == pytest.approx({EVAL_EVERY: midway["val_loss"], STEPS: summary["val_loss"]}, rel=1e-6)
    # What the writer sent is what it maps each record to, tag for tag.
    assert scalars(steps[0]).keys() == expected_tags


def test_tensorboard_missing_fails_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now fails, as if not installed
    out = tmp_path / "run"
    code = main(["train", str(CONFIGS / "gpt-tiny.toml"), "--tensorboard", "--out", str(out)])
    assert code == 2
    assert "pip install 'shardwise[tensorboard]'" in capsys.readouterr().err
    assert not out.exists()


def test_pipeline_records_each_stage_in_its_last_step(runs):
    (summary,) = read_records(runs[1], "summary")
    ranks = summary["stage_timeline"]
    assert [(r["rank"], r["stage"], r["stages"], r["replica"], r["tp_rank"]) for r in ranks] == [
        (0, 0, [0], 0, 0), (1, 1, [1], 0, 0)]
    accum = 16 // 8  # gpt-tiny: global batch 16, micro batch 8, one replica
    assert min(r["window"][0] for r in ranks) == 0
    for rank in ranks:
        ops = sorted((kind, i, s) for kind, i, s, _, _ in rank["intervals"])
        assert ops == sorted([(kind, i, rank["stage"]) for kind in ("F", "BW") for i in range(MICRO_BATCHES)] * accum)
        spans = [(start, end) for *_, start, end in rank["intervals"]]
        assert spans == sorted(spans)  # one stage computes one thing at a time, in schedule order
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        start, end = rank["window"]
        assert start <= spans[0][0] and spans[-1][1] <= end
    # Stage 1 cannot begin micro-batch 0's forward before stage 0 has finished it.
    first_forward = {r["stage"]: next(iv for iv in r["intervals"] if iv[:2] == ["F", 0]) for r in ranks}
    assert first_forward[1][3] >= first_forward[0][4]


class Page(HTMLParser):
    """The report's images (by id) and its summary table's cells (by run, then column class)."""

    def __init__(self) -> None:
        super().__init__()
        self.images: dict[str, dict[str, str]] = {}
        self.rows: list[dict[str, str]] = []
        self.ids: list[str] = []
        self._cell: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if "id" in attributes:
            self.ids.append(attributes["id"])
        if tag == "img":
            self.images[attributes["id"]] = attributes
        elif tag == "tr":
            self.rows.append({})
        elif tag == "td":
            self._cell = attributes["class"]
            self.rows[-1][self._cell] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self.rows[-1][self._cell] += data


def parse(path: Path) -> tuple[Page, str]:
    text = path.read_text()
    page = Page()
    page.feed(text)
    return page, text


def png_size(src: str) -> tuple[int, int]:
    """Width and height of a data-URI PNG, from its header."""
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix)
    data = base64.b64decode(src[len(prefix):])
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_compares_two_runs_with_one_image_per_plot_and_their_numbers(runs, tmp_path, capsys):
    single, pipe = runs
    out = tmp_path / "report.html"
    assert main(["report", str(single), str(pipe), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    page, text = parse(out)
    assert list(page.images) == ["loss-vs-step", "loss-vs-time", "throughput", "memory", "pipeline-timeline"]
    for image in page.images.values():
        width, height = png_size(image["src"])
        assert width >= 600 and height >= 300 and image["alt"]
    # MFU is null on CPU: said so, not drawn empty
    assert "mfu-not-known" in page.ids and "not known on CPU" in text
    assert "http" not in text and "<script" not in text  # self-contained: nothing fetched, nothing run

    rows = {row["run"]: row for row in page.rows if row}
    assert set(rows) == {"single (single on 1 rank)", "pipe (pipeline on 2 ranks)"}
    for run, label in ((single, "single (single on 1 rank)"), (pipe, "pipe (pipeline on 2 ranks)")):
        (summary,) = read_records(run, "summary")
        row = rows[label]
        assert row["steps"] == str(STEPS)
        assert row["final_loss"] == f"{summary['final_loss']:.4f}" == f"{read_records(run)[-1]['loss']:.4f}"
        assert row["val_loss"] == f"{summary['val_loss']:.4f}"
        assert row["median_step_time_ms"] == f"{summary['median_step_time_s'] * 1000:,.1f}"
        assert row["throughput"] == f"{summary['tokens_per_s']:,.0f} tokens/s"
        assert row["mfu"] == "not known"
        peaks = [m["peak"] / 2**20 for m in read_records(run)[-1]["memory_by_rank"]]
        assert row["peak_memory"] == ", ".join(f"r{r}: {p:,.1f}" for r, p in enumerate(peaks))
    assert rows["pipe (pipeline on 2 ranks)"]["peak_memory"].count("r") == 2


def test_an_unfinished_run_with_mfu_is_reported_beside_itself_by_default(runs, tmp_path, capsys):
    """A run stopped before its summary, on a device whose peak is known (MFU numbers written in):
    the table falls back to its step records, and the MFU plot is drawn."""
    run = tmp_path / "cut"
    shutil.copytree(runs[0], run)
    load_config(CONFIGS / "gpt-tiny.toml").save(run / "config.toml")  # as `shardwise train` writes it
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kept = [{**r, "mfu": 0.01 * r["step"]} if r["event"] == "step" else r for r in records if r["event"] != "summary"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert main(["report", str(run)]) == 0
    out = tmp_path / "report.html"  # beside the run directory
    assert capsys.readouterr().out.strip() == f"wrote {out.resolve()}"
    page, _ = parse(out)
    assert list(page.images) == ["loss-vs-step", "loss-vs-time", "throughput", "mfu", "memory"]
    (row,) = [row for row in page.rows if row]
    steps = [r for r in kept if r["event"] == "step"]
    middle = sorted(steps[1:], key=lambda r: r["step_time_s"])[len(steps[1:]) // 2]
    assert row["run"] == "cut (single on 1 rank)"  # from config.toml
    assert row["steps"] == f"{STEPS} (unfinished: no summary)"
    (midway,) = [r for r in kept if r["event"] == "eval"]
    assert row["val_loss"] == f"{midway['val_loss']:.4f} (step {EVAL_EVERY})"
    assert row["median_step_time_ms"] == f"{middle['step_time_s'] * 1000:,.1f}"
    assert row["mfu"] == f"{middle['mfu']:.1%}"


@pytest.mark.parametrize("case", ["missing", "no metrics", "empty"])
def test_report_refuses_what_is_not_a_run(tmp_path, capsys, case):
    run = tmp_path / "run"
    if case != "missing":
        run.mkdir()
    if case == "empty":
        (run / "metrics.jsonl").write_text("")
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 2
    error = capsys.readouterr().err
    assert str(run) in error
    assert {"missing": "no such run directory", "no metrics": "has no metrics.jsonl",
            "empty": "holds no step records"}[case] in error
    assert not (tmp_path / "r.html").exists()
