"""Every kind of bad value fails before any worker starts, with one line naming the key."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError


def error_for(tmp_path: Path, toml: str = "", overrides: tuple[str, ...] = (), flags: dict | None = None) -> str:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), flags)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_schemas_schedules_are_the_pipelines():
    """The schema names the schedules without importing the pipeline library (config/ imports no parallelism)."""
    from shardwise.config.schema import SCHEDULES
    from shardwise.parallel.pipeline.schedules import SCHEDULES as BUILT

    assert SCHEDULES == tuple(BUILT)


def test_defaults_are_valid_and_fill_the_gpt_preset():
    cfg = load_config()
    assert cfg.model.n_layer == 2 and cfg.model.d_model == 64 and cfg.model.vocab_size == 256
    assert cfg.grad_accum() == 2  # 16 / (1 x 8)


def test_file_then_set_then_flags_in_that_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nlr = 0.5\nsteps = 7\n")
    cfg = load_config(path, ["train.lr=0.25", "train.steps=9"], {"train.steps": 11})
    assert cfg.train.lr == 0.25 and cfg.train.steps == 11


def test_unknown_key_is_named_with_the_allowed_keys(tmp_path):
    message = error_for(tmp_path, "[train]\nlearning_rate = 1.0\n")
    assert "train.learning_rate" in message and "allowed in [train]" in message and "lr" in message


@pytest.mark.parametrize(("toml", "overrides", "moved"), [
    ("", ("parallel.micro_batches=4",), "parallel.micro_batches in --set: moved to parallel.pipeline.micro_batches"),
    ("[parallel]\nbucket_mb = 4.0\n", (), "parallel.bucket_mb in "),
    ("[parallel]\nps_servers = 2\n", (), "moved to parallel.param_server.servers"),
    ("", ("parallel.offload=optimizer",), "moved to parallel.sharding.offload"),
], ids=["set", "file", "renamed", "sharding"])
def test_a_key_that_moved_into_its_table_names_its_new_place(tmp_path, toml, overrides, moved):
    assert moved in error_for(tmp_path, toml, overrides)


def test_a_table_of_parallel_is_read_from_the_file_from_set_and_dotted(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[parallel]\nstrategy = 'ddp'\n\n[parallel.pipeline]\nschedule = 'gpipe'\nmicro_batches = 2\n")
    cfg = load_config(path, ["parallel.pipeline.micro_batches=8", "parallel.ddp.bucket_mb=4"])
    assert (cfg.parallel.pipeline.schedule, cfg.parallel.pipeline.micro_batches) == ("gpipe", 8)
    assert cfg.parallel.ddp.bucket_mb == 4.0
    assert "parallel.pipeline.micro_batches = 'many'" in error_for(tmp_path, overrides=(
        "parallel.pipeline.micro_batches=many",))
    assert "parallel.pipeline.stages in --set: unknown key; allowed in [parallel.pipeline]: micro_batches" in \
        error_for(tmp_path, overrides=("parallel.pipeline.stages=2",))
    assert "parallel.strategy.x in --set: parallel.strategy is a value" in error_for(tmp_path, overrides=(
        "parallel.strategy.x=2",))


def test_unknown_section_is_named(tmp_path):
    assert "[optimiser]" in error_for(tmp_path, "[optimiser]\nlr = 1.0\n")


def test_wrong_type_names_key_value_and_expected_type(tmp_path):
    message = error_for(tmp_path, overrides=("train.steps=ten",))
    assert "train.steps = 'ten'" in message and "expected int" in message


def test_a_float_is_not_accepted_for_an_int(tmp_path):
    assert "train.global_batch = 2.5" in error_for(tmp_path, "[train]\nglobal_batch = 2.5\n")


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=0", "train.steps"),
        ("train.global_batch=-8", "train.global_batch"),
        ("train.micro_batch=0", "train.micro_batch"),
        ("train.lr=-1e-3", "train.lr"),
        ("model.n_layer=0", "model.n_layer"),
        ("launch.nproc=0", "launch.nproc"),
        ("parallel.ddp.bucket_mb=0", "parallel.ddp.bucket_mb"),
        ("train.warmup_steps=-1", "train.warmup_steps"),
        ("launch.shutdown_timeout_s=-1", "launch.shutdown_timeout_s"),
    ],
)
def test_negative_or_zero_sizes_are_rejected(tmp_path, override, key):
    message = error_for(tmp_path, overrides=(override,))
    assert message.startswith(key) and "must be" in message


def test_global_batch_must_divide_by_world_times_micro_batch(tmp_path):
    message = error_for(
        tmp_path, overrides=("train.global_batch=12", "train.micro_batch=4", "parallel.strategy=ddp"),
        flags={"launch.nproc": 2},
    )
    assert "train.global_batch = 12" in message and "world size 2" in message and "micro_batch 4" in message


def test_unknown_strategy_lists_the_allowed_ones(tmp_path):
    message = error_for(tmp_path, overrides=("parallel.strategy=zero9",))
    assert "parallel.strategy = 'zero9'" in message and "single" in message


def test_single_strategy_on_two_processes_is_rejected(tmp_path):
    assert "parallel.strategy = 'single'" in error_for(tmp_path, flags={"launch.nproc": 2})


def test_data_must_suit_the_model(tmp_path):
    assert "data.name = 'digits'" in error_for(tmp_path, overrides=("data.name=digits",))


def test_width_must_divide_by_heads(tmp_path):
    assert "model.d_model = 65" in error_for(tmp_path, overrides=("model.d_model=65",))


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml.*not found"):
        load_config(tmp_path / "nope.toml")


def test_cli_reports_config_errors_before_any_worker_starts(tmp_path, tiny_config, capsys):
    out = tmp_path / "run"
    code = main(["train", str(tiny_config), "--out", str(out), "--set", "train.micro_batch=0"])
    assert code == 2
    assert "config error: train.micro_batch = 0" in capsys.readouterr().err
    assert not out.exists()


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["train.lr=0.01", "model.preset=small", "parallel.pipeline.split_points=[1]"])
    cfg.save(tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == cfg and again.model.d_model == 384 and again.parallel.pipeline.split_points == [1]
    assert "[parallel.pipeline]" in (tmp_path / "config.toml").read_text()


def test_a_config_read_while_another_rank_saves_it_is_the_whole_file(tmp_path):
    """Each replica group's first rank saves the run's resolved config while the others' ranks may be
    reading it: a read never sees the file half written (it did 3 reads in 4 here, a rank then
    training with AdamW, the default, where the file said SGD)."""
    path = tmp_path / "config.toml"
    cfg = load_config(None, ["train.optimizer=sgd", "train.lr=0.01"])
    cfg.save(path)
    saving = True

    def save_again_and_again() -> None:
        while saving:
            cfg.save(path)

    writer = threading.Thread(target=save_again_and_again)
    writer.start()
    try:
        deadline = time.monotonic() + 0.5
        reads = []
        while time.monotonic() < deadline:
            reads.append(load_config(path))
    finally:
        saving = False
        writer.join()
    assert len(reads) > 50 and all(read == cfg for read in reads)
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]  # no writer's partial file left


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("parallel.precision=fp8",), "parallel.precision = 'fp8': unknown; allowed: fp32, bf16-mixed"),
        (("parallel.recompute=every:0",), "parallel.recompute = 'every:0': expected none, blocks, selective or"),
        (("parallel.recompute=some",), "parallel.recompute = 'some'"),
        (("parallel.recompute=blocks", "model.name=cnn", "data.name=digits"), "'cnn' has no blocks to recompute"),
        (("train.compile=true", "model.name=cnn", "data.name=digits"), "train.compile: model.name = 'cnn' has no"),
        (("train.compile=true", "parallel.recompute=selective"), "its policy cannot see the operations inside"),
        (("parallel.sharding.reduce_dtype=fp16",),
         "parallel.sharding.reduce_dtype = 'fp16': unknown; allowed: fp32, bf16"),
        (("parallel.sharding.reduce_dtype=bf16", "parallel.strategy=ddp"), "only the sharded strategies"),
        (("parallel.sharding.offload=params",),
         "parallel.sharding.offload = 'params': unknown; allowed: none, optimizer"),
        (("parallel.sharding.offload=optimizer", "parallel.strategy=hsdp"),
         "parallel.sharding.offload = 'optimizer': only zero1, zero2, fsdp offload their optimizer state to the host; "
         "parallel.strategy is 'hsdp'"),
        (("parallel.loss_scale=0",), "parallel.loss_scale = 0.0: must be > 0"),
    ],
)
def test_bad_precision_and_recompute_settings_are_named(tmp_path, overrides, expected):
    assert expected in error_for(tmp_path, overrides=overrides)


def test_debug_collectives_is_refused_for_ddp_native_which_crashes_under_it(tmp_path):
    message = error_for(tmp_path, overrides=("launch.debug_collectives=true", "parallel.strategy=ddp-native",
                                             "launch.nproc=2"))
    assert "launch.debug_collectives = true" in message and "--strategy ddp" in message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("parallel.ddp.all_reduce=tree",), "parallel.ddp.all_reduce = 'tree': unknown; allowed: backend, ring"),
        (("parallel.ddp.grad_compression=int8",),
         "parallel.ddp.grad_compression = 'int8': unknown; allowed: none, fp16"),
        (("parallel.ddp.powersgd_rank=0",), "parallel.ddp.powersgd_rank = 0: must be > 0"),
        (("parallel.ddp.powersgd_start_step=-1",), "parallel.ddp.powersgd_start_step = -1: must be >= 0"),
        (("parallel.ddp.all_reduce=ring", "parallel.strategy=ddp-native"),
         "parallel.ddp.all_reduce = 'ring': only parallel.strategy = 'ddp' (ours) has it; parallel.strategy is "
         "'ddp-native'"),
        (("parallel.ddp.grad_compression=fp16", "parallel.strategy=fsdp"),
         "parallel.ddp.grad_compression = 'fp16': only parallel.strategy = 'ddp' (ours) has it"),
        (("parallel.ddp.grad_compression=powersgd", "parallel.strategy=ddp", "parallel.precision=fp16-mixed"),
         "parallel.ddp.grad_compression = 'powersgd': needs fp32 gradients on a steady scale"),
    ],
)
def test_bad_gradient_reduction_settings_are_named(tmp_path, overrides, expected):
    assert expected in error_for(tmp_path, overrides=overrides)


def test_precision_and_recompute_flags_reach_the_config():
    cfg = load_config(None, [], {"parallel.precision": "bf16-mixed", "parallel.recompute": "every:3"})
    assert (cfg.parallel.precision, cfg.parallel.recompute) == ("bf16-mixed", "every:3")
# --- the device mesh of the model-splitting strategies -----------------------------------------

def test_the_strategys_own_mesh_dimension_takes_the_ranks_left():
    assert load_config(None, ["parallel.strategy=pipeline", "launch.nproc=2"]).parallel.mesh_shape(2) == (1, 2, 1)
    assert load_config(None, ["parallel.strategy=pipeline", "parallel.dp=2", "launch.nproc=4"]
                       ).parallel.mesh_shape(4) == (2, 2, 1)
    cfg = load_config(None, ["parallel.strategy=tensor", "parallel.dp=2", "launch.nproc=4", "train.micro_batch=4"])
    assert cfg.parallel.mesh_shape(4) == (2, 1, 2)
    assert cfg.grad_accum() == 2  # 16 / (2 replicas x 4)
    assert load_config(None, ["parallel.strategy=ddp", "launch.nproc=4", "train.micro_batch=4"]
                       ).parallel.mesh_shape(4) == (4, 1, 1)


def test_mesh_must_multiply_to_the_world_size(tmp_path):
    message = error_for(tmp_path, overrides=("parallel.strategy=pipeline", "parallel.dp=2", "parallel.pp=2"),
                        flags={"launch.nproc": 2})
    assert "parallel.dp x pp x tp = 2 x 2 x 1 = 4" in message and "world size 2" in message and "--nproc 4" in message


def test_more_pipeline_stages_than_blocks_is_rejected(tmp_path):
    message = error_for(tmp_path, overrides=("parallel.strategy=pipeline",), flags={"launch.nproc": 3})
    assert "parallel.pp = 3" in message and "more pipeline stages than the model's 2 blocks" in message


PIPE2 = ("parallel.strategy=pipeline", "model.n_layer=4")


@pytest.mark.parametrize(("overrides", "expected"), [
    (("parallel.pipeline.schedule=interleaved-1f1b", "parallel.pipeline.virtual_stages=3"),
     "parallel.pp = 2 x parallel.pipeline.virtual_stages = 3 (interleaved-1f1b): 6 stages, more pipeline stages "
     "than the model's 4 blocks"),
    (("parallel.pipeline.schedule=interleaved-1f1b", "parallel.pipeline.virtual_stages=1"),
     "parallel.pipeline.virtual_stages = 1: interleaved-1f1b needs at least 2 stages per rank"),
    (("parallel.pipeline.schedule=zbv", "parallel.pipeline.virtual_stages=3"),
     "parallel.pipeline.virtual_stages = 3: zbv always has 2 stages per rank; leave it unset"),
    (("parallel.pipeline.schedule=zb-h1", "parallel.pipeline.virtual_stages=2"), "zb-h1 always has 1 stage per rank"),
    (("parallel.pipeline.schedule=dualpipev", "parallel.pipeline.micro_batches=2"),
     "parallel.pipeline.schedule = 'dualpipev': dualpipev on 2 ranks needs at least 4 micro-batches, got 2"),
    (("parallel.pipeline.schedule=zbv", "parallel.pipeline.split_points=[2]"),
     "parallel.pipeline.split_points = [2]: expected 3 increasing block indices in [1, 3], the first block of "
     "stages 2..4"),
    (("parallel.pipeline.schedule=zb-h1", "parallel.recompute=selective"),
     "parallel.recompute = 'selective': does not compose with zb-h1's split backward"),
], ids=["interleaved-too-many-stages", "interleaved-one", "zbv-three", "zb-h1-two", "dualpipev-few", "zbv-points",
        "selective"])
def test_pipeline_schedules_and_virtual_stages_are_checked(tmp_path, overrides, expected):
    assert expected in error_for(tmp_path, overrides=PIPE2 + overrides, flags={"launch.nproc": 2})


def test_micro_batches_must_divide_the_per_replica_batch(tmp_path):
    message = error_for(tmp_path, overrides=("parallel.strategy=pipeline", "parallel.pipeline.micro_batches=3"),
                        flags={"launch.nproc": 2})
    assert "parallel.pipeline.micro_batches = 3" in message and "must divide train.micro_batch = 8" in message


def test_tensor_parallel_size_must_divide_the_heads(tmp_path):
    message = error_for(tmp_path, overrides=("parallel.strategy=tensor", "model.n_head=4", "model.d_model=96"),
                        flags={"launch.nproc": 3})
    assert "parallel.tp = 3" in message and "model.n_head = 4" in message and "hidden size" in message


def test_split_points_must_be_increasing_block_indices(tmp_path):
    message = error_for(tmp_path, flags={"launch.nproc": 2},
                        overrides=("parallel.strategy=pipeline", "model.n_layer=4",
                                   "parallel.pipeline.split_points=[0]"))
    assert "parallel.pipeline.split_points = [0]" in message and "[1, 3]" in message
    assert "a list of integers" in error_for(tmp_path, overrides=("parallel.pipeline.split_points=[1.5]",))


def test_data_parallel_strategies_take_no_model_split(tmp_path):
    message = error_for(tmp_path, overrides=("parallel.strategy=ddp", "parallel.tp=2"), flags={"launch.nproc": 2})
    assert "parallel.strategy = 'ddp' is data parallel" in message


def test_a_mesh_error_stops_the_cli_before_any_worker_starts(tmp_path, tiny_config, capsys):
    out = tmp_path / "run"
    code = main(["train", str(tiny_config), "--out", str(out), "--strategy", "tensor", "--nproc", "4", "--dp", "2",
                 "--tp", "3"])
    assert code == 2
    assert "config error: parallel.dp x pp x tp = 2 x 1 x 3 = 6" in capsys.readouterr().err
    assert not out.exists()



def test_key_value_heads_must_divide_the_heads_and_only_grouped_query_families_take_fewer(tmp_path):
    assert "must divide model.n_head = 4" in error_for(
        tmp_path, overrides=("model.name=hf-llama", "model.n_head=4", "model.n_kv_head=3"))
    assert "one key/value head per head" in error_for(tmp_path, overrides=("model.name=gpt", "model.n_kv_head=1"))
    cfg = load_config(None, ["model.name=hf-qwen2", "model.n_kv_head=1"])
    assert (cfg.model.n_kv_head, cfg.model.d_ff) == (1, 4 * cfg.model.d_model)
