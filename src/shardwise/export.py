"""`shardwise export`: a LoRA run's adapters in peft's own format, from the run's newest checkpoint.

peft's LoRA (`peft.PeftModel.from_pretrained(base, OUT)`) reads a directory of two files:

- `adapter_config.json`: the adapters' rank, alpha, dropout and the modules they are beside;
- `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
  [out, r] for each adapted module, named as in the transformers model.

shardwise's adapters are the same matrices (lora.py: A [r, in], B [out, r], scaled by alpha / r),
named `<module>.lora.A` and `.lora.B` in shardwise's model, whose hf-* wrapper holds the
transformers model as `lm`. A checkpoint of a LoRA run holds the adapters alone (checkpoint.py), so
they are read whole, a tensor at a time, in this one process, whatever strategy and world size
saved them. The merged model, the other export, is what the run itself writes at its end
(`model.safetensors`, for hf-* runs a directory transformers loads).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardwise.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_dir,
    newest_good_checkpoint,
    read_tensor,
    safe_reader,
)
from shardwise.lora import is_adapter


def export_peft(run_dir: Path, out: Path) -> Path:
    """Write the adapters of `run_dir`'s newest good checkpoint to `out` in peft's format; return
    the checkpoint used. Raises CheckpointError for a run without a checkpoint or without adapters."""
    path = newest_good_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"{checkpoint_dir(run_dir)}: no checkpoint to export")
    manifest = json.loads((path / MANIFEST).read_text())
    lora = manifest.get("lora")
    if lora is None:
        raise CheckpointError(f"{path} is a full fine-tune's checkpoint: only a LoRA run's adapters export to peft "
                              "(its model is `shardwise consolidate`'s)")
    if lora.get("train"):
        raise CheckpointError(f"{path}: the run trains {', '.join(lora['train'])} whole beside its adapters; the "
                              "peft export carries adapters alone: use the run's merged model.safetensors")
    adapters = sorted(name for name in manifest["shapes"] if is_adapter(name))
    reader = safe_reader(path)
    tensors, modules = {}, []
    for name in adapters:
        tensor = read_tensor(reader, name, manifest["shapes"][name], torch.float32)
        # the transformers model's name of the module, where shardwise's hf-* wrapper holds one as `lm`
        module = name[: -len(".lora.A")].removeprefix("lm.")
        tensors[f"base_model.model.{module}.lora_{name[-1]}.weight"] = tensor.contiguous()
        modules.append(module)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
              "lora_dropout": lora["dropout"], "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "target_modules": sorted(set(modules)), "base_model_name_or_path": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return path
