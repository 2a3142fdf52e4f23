"""`shardwise train` end to end: real workers through torch.distributed.run."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import COMPARED_STEPS, CONFIGS, REPO, assert_same_training, read_records, shardwise, train_in_process
from safetensors.torch import load_file

from shardwise.config.load import load_config


def test_single_trains_30_steps_and_the_loss_falls(tmp_path, cli_single_run):
    out, result = cli_single_run
    steps = read_records(out)
    assert [r["step"] for r in steps] == list(range(1, 31))
    losses = [r["loss"] for r in steps]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    for key in ("lr", "step_time_s", "tokens_per_s", "mfu"):
        assert key in steps[0]
    memory = steps[-1]["memory"]
    assert memory["params"] > 0 and memory["grads"] == memory["params"]
    # AdamW: two moments the size of the parameters, plus one 4-byte step counter per tensor
    assert 0 < memory["optimizer"] - 2 * memory["params"] < 4 * 100
    assert memory["activations"] > 0 and memory["peak"] > memory["params"]
    (summary,) = read_records(out, "summary")
    assert summary["steps"] == 30 and summary["val_loss"] < 5.0
    assert "validation loss" in result.stdout
    assert load_config(out / "config.toml").train.steps == 30
    weights = load_file(str(out / "model.safetensors"))
    assert "blocks.0.attn.qkv.weight" in weights

    # The same config trained in this process (a world of one, one thread as in the worker)
    # gives the same losses, step for step.
    train_in_process(load_config(out / "config.toml", [f"run.out={tmp_path / 'b'}"]))
    assert [r["loss"] for r in read_records(tmp_path / "b")] == losses


def test_a_failing_worker_fails_the_command_with_its_error_shown(tmp_path, tiny_config):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = shardwise("train", str(tiny_config), "--steps", "2", "--out", str(tmp_path / "run"),
                       env={"SHARDWISE_CACHE": str(blocker / "cache")})
    assert result.returncode == 1
    tail = result.stderr[result.stderr.index("shardwise train:"):]
    assert "worker rank 0 failed" in tail and "NotADirectoryError" in tail


def test_ddp_on_2_processes_gives_the_single_device_losses(tmp_path, cli_single_compared):
    out = tmp_path / "d"
    result = shardwise("train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "ddp", "--nproc", "2",
                       "--steps", str(COMPARED_STEPS), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "ddp on 2 process(es)" in result.stdout
    assert_same_training(out, cli_single_compared, steps=COMPARED_STEPS, weights=False)


def test_the_worker_runs_under_an_external_torchrun(tmp_path, cli_single_compared):
    out = tmp_path / "n"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "shardwise.worker", str(CONFIGS / "gpt-tiny.toml"), "--set", "parallel.strategy=ddp-native",
         "--set", f"train.steps={COMPARED_STEPS}", "--set", f"run.out={out}"],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert load_config(out / "config.toml").launch.nproc == 2  # the world torchrun made, recorded
    assert_same_training(out, cli_single_compared, steps=COMPARED_STEPS, weights=False)


def test_sampling_on_2_pipeline_stages_writes_the_text_one_process_writes(cli_single_run):
    run, _ = cli_single_run
    args = ("sample", str(run), "--prompt", "ROMEO.", "--tokens", "40")
    alone = shardwise(*args)
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.startswith("ROMEO.") and len(alone.stdout) > 40
    ranked = shardwise(*args, "--nproc", "2", "--strategy", "pipeline")  # each rank holds one stage
    assert ranked.returncode == 0, ranked.stderr
    assert ranked.stdout == alone.stdout


def test_sampling_refuses_what_cannot_run_before_any_rank_starts(cli_single_run, tmp_path, capsys):
    """The command's own main, in this process: a refusal starts no rank (nor torchrun) to refuse."""
    from shardwise.cli import main

    run, _ = cli_single_run
    assert main(["sample", str(run), "--nproc", "4", "--strategy", "tensor"]) == 2  # gpt-tiny has 2 heads
    assert "parallel.tp = 4: must divide model.n_head = 2" in capsys.readouterr().err
    assert main(["sample", str(run), "--strategy", "fsdp"]) == 2
    assert "give --nproc N" in capsys.readouterr().err
    assert main(["sample", str(tmp_path), "--nproc", "2"]) == 2
    assert "model.safetensors: not found" in capsys.readouterr().err


FORK_SERVER_PROBE = """
import multiprocessing, os, sys, time
from multiprocessing import forkserver
from shardwise.fork_server import start_fork_server

private = os.open(sys.argv[1], os.O_RDONLY)  # a descriptor of the launcher's, not to be kept by the server
start_fork_server("json")
rank = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
rank.start()  # the server serves: it has closed what it does not keep
rank.join(60)
server = forkserver._forkserver._forkserver_pid


def target(fd):
    try:
        return os.readlink(f"/proc/{server}/fd/{fd}")
    except FileNotFoundError:  # closed between the listing and the reading (a rank's pipe, passed and done)
        return None


kept = {target(fd) for fd in os.listdir(f"/proc/{server}/fd")}
same_command = open(f"/proc/{server}/cmdline").read() == open("/proc/self/cmdline").read()
print(same_command, sys.argv[1] in kept, rank.exitcode)
"""


def test_the_fork_server_is_forked_from_the_launcher_with_none_of_its_other_descriptors(tmp_path):
    """fork_server.py: the ranks' server is the launcher forked (its command line, not a new
    interpreter's), holding only what multiprocessing passes it, and it forks ranks."""
    private = tmp_path / "private"
    private.write_text("")
    result = subprocess.run([sys.executable, "-c", FORK_SERVER_PROBE, str(private)], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "0"]
