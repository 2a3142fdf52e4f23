"""Memory checkpoints (peer_checkpoints.py): what a node's shared memory holds, and which generation
a world restores. The whole path, on 3 namespace nodes with one killed and started again, is
tests/multinode/test_elastic.py's."""

from __future__ import annotations

from shardwise.peer_checkpoints import METADATA, PeerCheckpoints, file_name, newest_whole


def test_a_node_holds_the_files_whole_under_their_names_and_a_fresh_run_holds_none(tmp_path):
    directory = tmp_path / "node"
    (directory / "step-00000004-world-3-fsdp" / ".writing-1").mkdir(parents=True)  # a save under way
    for name, size in ((METADATA, 10), (file_name(0), 100), (file_name(2), 90), (f".{file_name(1)}", 80)):
        (directory / "step-00000004-world-3-fsdp" / name).write_bytes(b"x" * size)  # the last: still arriving
    (directory / "step-00000008-world-2-fsdp").mkdir()
    node = PeerCheckpoints(directory, nproc=2, fresh=False)
    assert node.generations() == {(4, 3, "fsdp"): {METADATA: 10, file_name(0): 100, file_name(2): 90},
                                  (8, 2, "fsdp"): {}}
    assert node.held_bytes == 100  # each of its 2 ranks' share
    assert PeerCheckpoints(directory, nproc=2, fresh=True).generations() == {}


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
