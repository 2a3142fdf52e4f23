"""Memory checkpoints (peer_checkpoints.py): DCP's files written to and read from memory, and which
generation the survivors of a loss restore. The whole path, on 3 namespace nodes with one killed, is
tests/multinode/test_elastic.py's."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from shardwise.peer_checkpoints import METADATA, MemoryFiles, MemoryReader, file_name, newest_whole


def test_a_state_saved_into_memory_loads_back_equal_with_no_file_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.randn(5, 3), "m": {"step": torch.tensor(7), "v": torch.arange(4.0)}}
    writer = FileSystemWriter("memory", sync_files=False)
    writer.fs = MemoryFiles()
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert sorted(writer.fs.files) == [METADATA, file_name(0)] and not list(tmp_path.iterdir())
    loaded = {"w": torch.zeros(5, 3), "m": {"step": torch.tensor(0), "v": torch.zeros(4)}}
    dcp.load(loaded, storage_reader=MemoryReader(writer.fs.files), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["m"]["v"], state["m"]["v"])
    assert int(loaded["m"]["step"]) == 7


def held(**generations: set[str]) -> dict:
    """A rank's generations of a 3-rank fsdp world: their files' sizes by name, by step."""
    return {(int(step.removeprefix("step")), 3, "fsdp"): dict.fromkeys(names, 100)
            for step, names in generations.items()}


def test_a_copy_under_way_when_its_node_was_lost_leaves_the_generation_before_it():
    """3 ranks, one a node, each sending its file to the next: rank 2 lost while step 8's copies travelled
    (rank 0 had not yet received rank 2's); step 4's is whole among ranks 0 and 1, rank 2's file on rank 0."""
    rank0 = held(step4={METADATA, file_name(0), file_name(2)}, step8={METADATA, file_name(0)})
    rank1 = held(step4={METADATA, file_name(1), file_name(0)}, step8={METADATA, file_name(1), file_name(0)})
    (step, world, _), holders = newest_whole([rank0, rank1])
    assert (step, world) == (4, 3)
    assert holders == {METADATA: 0, file_name(0): 0, file_name(1): 1, file_name(2): 0}
    # once it had arrived, step 8's is
    rank0[(8, 3, "fsdp")][file_name(2)] = 100
    assert newest_whole([rank0, rank1])[0][0] == 8


def test_two_neighbouring_nodes_lost_leave_no_whole_generation():
    """4 ranks: 1 and 2 lost; rank 1's file was on 1 and on 2 alone."""
    def four(*ranks: int) -> dict:
        return {(4, 4, "fsdp"): dict.fromkeys([METADATA, *map(file_name, ranks)], 100)}

    assert newest_whole([four(0, 3), four(3, 2)]) is None
    assert newest_whole([four(0, 3), four(3, 2), four(1, 0)])[0][0] == 4
