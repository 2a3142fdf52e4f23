"""fsdp's all-gather of a unit's float8 weights as float8 bytes (`parallel.float8 = "tensorwise"`):
half of bf16's bytes for those weights, the rest of the unit gathered as before, in one all-gather.

Each weight's scale must be the whole weight's, as single computes it, for a sharded run to equal
single's: every rank takes the amax of its shard (in the working dtype: bf16's rounding is
monotonic, so the largest bf16 value is the bf16 of the largest), one all-reduce (MAX) of the unit's
amaxes gives each weight's, and every rank casts its shard with that scale. The gathered float8
rows are then the whole weight's cast, bit for bit; the layer computes from them (`Float8Linear.gathered`)
and its bf16 parameter is never filled. The gather's buffer is bytes: each weight's region one byte
an element, every other parameter's its working dtype's bytes (the layers' sizes are multiples of
16, so every region starts on an even byte).

`rowwise` gathers in the working dtype: its forward scales the weight along its input features
and its backward along its output features, two casts no single float8 copy serves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.parallel.float8 import E4M3, Float8Linear, Scaled, cast, scale_of
from shardwise.parallel.shard import Unit, copy_out


class Float8Gather:
    """How `unit`'s parameters travel when gathered: `layers` by parameter index, the tensorwise
    Float8Linear whose weight each is (those go as float8)."""

    def __init__(self, unit: Unit, layers: dict[int, Float8Linear]) -> None:
        self.unit, self.layers = unit, layers
        self.working = unit.full_dtype
        lengths = [length * (1 if i in layers else self.working.itemsize) for i, length in enumerate(unit.lengths)]
        self.byte_offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        self.byte_lengths = lengths
        self.scales: dict[int, torch.Tensor] = {}  # each float8 weight's (by parameter index), as last gathered

    @property
    def full_bytes(self) -> int:
        """Bytes of the unit's gathered parameters: its float8 weights one byte an element."""
        return sum(p.numel() * (1 if i in self.layers else p.element_size()) for i, p in enumerate(self.unit.params))

    def pack(self, shards: torch.Tensor) -> torch.Tensor:
        """This rank's packed shards (in the working dtype) as the bytes it sends: the float8
        weights cast with the whole weight's scale (one all-reduce of the unit's amaxes first)."""
        regions = [shards[offset : offset + length] for offset, length in zip(self.unit.offsets, self.unit.lengths,
                                                                                strict=True)]
        indices = sorted(self.layers)
        amax = torch.stack([regions[i].abs().max().float() for i in indices])  # a shard holds a row at least
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.unit.over.group)
        self.scales = {i: scale_of(a, E4M3, power_of_2=False) for i, a in zip(indices, amax, strict=True)}
        return torch.cat([(cast(region, self.scales[i], E4M3) if i in self.layers else region).view(torch.uint8)
                          for i, region in enumerate(regions)])

    def unpack(self, per_rank: torch.Tensor) -> None:
        """Every rank's bytes (one row each) into the unit: each float8 weight whole in float8, with
        its scale, handed to its layer; every other parameter's storage refilled, as a gather does."""
        for i, (param, shape, rows) in enumerate(zip(self.unit.params, self.unit.shapes, self.unit.rows, strict=True)):
            region = per_rank[:, self.byte_offsets[i] : self.byte_offsets[i] + self.byte_lengths[i]]
            if i in self.layers:
                full = torch.empty(param.shape, dtype=E4M3, device=per_rank.device)
                copy_out(full, shape, rows, 0, region.view(E4M3))
                self.layers[i].gathered = Scaled(full, self.scales[i])
                continue
            storage = param.untyped_storage()
            if storage.size() == 0:
                storage.resize_(param.numel() * param.element_size())
            copy_out(param.data, shape, rows, 0, region.view(self.working))

    def release(self) -> None:
        """The gathered float8 weights dropped, as a unit's freed parameters are."""
        for layer in self.layers.values():
            layer.gathered = None

    def tensors(self) -> list[torch.Tensor]:
        """The float8 weights alive now (for the memory count)."""
        return [layer.gathered.data for layer in self.layers.values() if layer.gathered is not None]
