"""Device profiles: what the time and memory models need to know about an accelerator and the
links between accelerators. Presets for common GPUs (datasheet numbers, sources beside each),
or a JSON file `shardwise bench hardware --out FILE` measured on the machine itself.

Datasheet numbers are peaks; `matmul_efficiency` and `link_efficiency` say what fraction of them
training reaches (measured profiles hold achieved numbers, so theirs are 1).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.planner.model import PlanError

GB = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """A device's figures; hashable (its dicts left out of the hash), for the planner's caches."""

    name: str
    memory_bytes: int  # one device's memory (a CPU rank: its share of the host's)
    reserved_bytes: int  # taken before training allocates anything (CUDA context, NCCL buffers)
    matmul_flops: dict[str, float] = field(hash=False)  # dense matmul FLOP/s by compute dtype: fp32, bf16, fp16
    memory_bandwidth: float  # bytes/s: the optimizer step and other elementwise work
    intra_node_bandwidth: float  # bytes/s one rank sends in a ring collective inside a node
    inter_node_bandwidth: float  # the same across nodes (per rank)
    latency_s: float = 10e-6  # per ring hop of a collective
    op_overhead_s: float = 5e-6  # per operator, whatever its size: a kernel launch, or a CPU's dispatch
    matmul_efficiency: float = 1.0
    link_efficiency: float = 1.0
    overlap: float = 1.0  # fraction of communication that can run hidden behind computation
    # Measured bus bandwidth of each collective inside a node (all_reduce, all_gather, reduce_scatter),
    # where they differ from the link's: Gloo's all-gather and reduce-scatter are far slower than its all-reduce.
    collective_bandwidth: dict[str, float] = field(default_factory=dict, hash=False)
    # What a reduce-scatter puts on a link, over the ring's (n-1)/n of the buffer: 2 on Gloo, whose
    # reduce-scatter is an all-reduce underneath (over a 100 Mbit/s link, 8 MB between 2 ranks:
    # reduce-scatter 0.72 s, all-reduce 0.72, all-gather 0.43). Measured collective figures hold it.
    reduce_scatter_volume: float = 1.0
    gpus_per_node: int = 8
    source: str = ""

    def flops(self, dtype: str) -> float:
        return self.matmul_flops[dtype] * self.matmul_efficiency

    def bandwidth(self, inter_node: bool, collective: str = "all_reduce") -> float:
        """Bytes/s one rank sends in `collective` (all_reduce, all_gather, reduce_scatter, p2p)."""
        if not inter_node and collective in self.collective_bandwidth:
            return self.collective_bandwidth[collective]
        link = (self.inter_node_bandwidth if inter_node else self.intra_node_bandwidth) * self.link_efficiency
        return link / self.reduce_scatter_volume if collective == "reduce_scatter" else link

    def computing_for(self, share: float) -> DeviceProfile:
        """This profile for a rank that computes `share` of the time (ranks outnumbering cores)."""
        return dataclasses.replace(self, matmul_flops={k: v * share for k, v in self.matmul_flops.items()},
                                   memory_bandwidth=self.memory_bandwidth * share,
                                   op_overhead_s=self.op_overhead_s / share)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16/FP16 989 TFLOPS dense (1979 with sparsity),
# FP32 67 TFLOPS (our fp32 does not use TF32), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (both
# directions together: 450 GB/s each way). DGX H100: one 400 Gb/s ConnectX-7 (NDR InfiniBand) per
# GPU, 50 GB/s. Efficiencies: ~0.5-0.6 MFU is what well-tuned large-model training reports
# (Megatron-LM, Narayanan et al. 2021; PaLM, Chowdhery et al. 2022); nccl-tests bus bandwidth
# reaches ~0.8 of the link rate.
H100 = DeviceProfile(
    name="h100-sxm", memory_bytes=80 * 2**30, reserved_bytes=2**30,
    matmul_flops={"fp32": 67e12, "bf16": 989e12, "fp16": 989e12}, memory_bandwidth=3.35e12,
    intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB, latency_s=10e-6,
    matmul_efficiency=0.55, link_efficiency=0.8, overlap=0.9, gpus_per_node=8,
    source="NVIDIA H100 datasheet (SXM5); DGX H100 user guide (8x ConnectX-7 400 Gb/s)",
)
# NVIDIA H200 datasheet (SXM): the H100's compute (BF16 989 TFLOPS dense, FP32 67), 141 GB HBM3e
# at 4.8 TB/s, NVLink 900 GB/s; DGX H200 has the same 400 Gb/s per GPU network as DGX H100.
H200 = dataclasses.replace(
    H100, name="h200", memory_bytes=141 * 10**9, memory_bandwidth=4.8e12,
    source="NVIDIA H200 datasheet (SXM); DGX H200 (8x ConnectX-7 400 Gb/s)",
)
# NVIDIA A100 datasheet (80GB SXM): BF16/FP16 312 TFLOPS dense, FP32 19.5, 80 GB HBM2e at
# 2.04 TB/s, NVLink 600 GB/s (300 each way); DGX A100: one 200 Gb/s HDR InfiniBand per GPU, 25 GB/s.
A100 = DeviceProfile(
    name="a100-80gb", memory_bytes=80 * 2**30, reserved_bytes=2**30,
    matmul_flops={"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}, memory_bandwidth=2.04e12,
    intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB, latency_s=10e-6,
    matmul_efficiency=0.55, link_efficiency=0.8, overlap=0.9, gpus_per_node=8,
    source="NVIDIA A100 datasheet (80GB SXM); DGX A100 user guide (8x ConnectX-6 200 Gb/s)",
)
# A rank of the 2-core development machine, one thread each, Gloo over loopback, as
# shardwise/FACTS measured it (all_reduce of 100 MB at 1.6-2.1 GB/s); fp16 has no matmul units on
# CPUs (~20x slower than fp32). Measure your own with `shardwise bench hardware --out FILE`.
CPU = DeviceProfile(
    name="cpu", memory_bytes=4 * 2**30, reserved_bytes=300 * 2**20,
    matmul_flops={"fp32": 40e9, "bf16": 70e9, "fp16": 2e9}, memory_bandwidth=5e9,
    intra_node_bandwidth=1.8 * GB, inter_node_bandwidth=0.12 * GB, latency_s=50e-6, op_overhead_s=10e-6,
    overlap=0.3, reduce_scatter_volume=2.0, gpus_per_node=2,
    source="measured on the 2-core development machine (FACTS-torch-cpu.md), 1 thread per rank",
)

PRESETS = {profile.name: profile for profile in (H100, H200, A100, CPU)}
ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "h200-sxm": "h200"}


def load_profile(name_or_path: str) -> DeviceProfile:
    """A preset by name (case-insensitive), or a profile JSON written by `shardwise bench hardware`."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in PRESETS:
        return PRESETS[key]
    path = Path(name_or_path)
    if not path.is_file():
        raise PlanError(f"--device {name_or_path!r}: neither a preset ({', '.join(PRESETS)}) nor an existing "
                        "profile file; write one with `shardwise bench hardware --out profile.json`")
    try:
        data = json.loads(path.read_text())
        return DeviceProfile(**data)
    except (json.JSONDecodeError, TypeError) as exc:
        fields = ", ".join(f.name for f in dataclasses.fields(DeviceProfile))
        raise PlanError(f"--device {name_or_path!r}: not a device profile ({exc}); expected a JSON object with "
                        f"{fields}, as `shardwise bench hardware --out FILE` writes") from None
