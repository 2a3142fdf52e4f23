"""`shardwise export`: a LoRA run's adapters in peft's own format, from the run's newest checkpoint.

peft's LoRA (`peft.PeftModel.from_pretrained(base, OUT)`) reads a directory of two files:

- `adapter_config.json`: the adapters' rank, alpha, dropout and the modules they are beside;
- `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
  [out, r] for each adapted module, named as in the transformers model.

shardwise's adapters are the same matrices (lora.py: A [r, in], B [out, r], scaled by alpha / r),
named `<module>.lora.A` and `.lora.B` in shardwise's model, whose hf-* wrapper holds the
transformers model as `lm`. A checkpoint of a LoRA run holds the adapters alone (checkpoint.py), so
they are read whole, a tensor at a time, in this one process, whatever strategy and world size
saved them.

`export_merged` writes the other export, the merged model, from the same checkpoint: each adapted
weight W + (alpha / r) B A over the pretrained weights the run started from (`model.weights`;
under QLoRA their NF4 rows dequantized, as the run computed with them), every other tensor the
checkpoint's or the pretrained one's, a tensor at a time (`checkpoint.write_model`): a
.safetensors file, or for hf-* runs a directory transformers loads. At the end of a run it is the
run's own `model.safetensors`, exactly.
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
    checkpoint_to_write,
    newest_good_checkpoint,
    read_tensor,
    safe_reader,
    write_model,
)
from shardwise.lora import is_adapter
from shardwise.nf4 import dequantize, quantize


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


def export_merged(run_dir: Path, out: Path, progress: bool = False) -> Path:
    """Write the merged model of `run_dir`'s newest good checkpoint (a LoRA run's, started from
    pretrained weights) to `out`; return the checkpoint used. CheckpointError where there is none,
    it is not a LoRA run's, or the run had no `model.weights` to merge onto."""
    from safetensors import safe_open

    from shardwise.config.load import load_config
    from shardwise.materialise import init_context
    from shardwise.models import build_model
    from shardwise.weights import common_prefix, stored_shapes, tied_names, weight_files

    cfg = load_config(Path(run_dir) / "config.toml")
    path = checkpoint_to_write(run_dir, cfg, out, "export")
    manifest = json.loads((path / MANIFEST).read_text())
    lora, saved = manifest.get("lora"), manifest["shapes"]
    if lora is None:
        raise CheckpointError(f"{path} is a full fine-tune's checkpoint: `shardwise consolidate` writes its model")
    if cfg.model.weights is None:
        raise CheckpointError(f"{run_dir}: the run's adapters were trained on the seed's weights, not on "
                              "model.weights; its own model.safetensors is the merged model")
    with init_context():
        model = build_model(cfg.model)
    state = model.state_dict(keep_vars=True)
    stored = stored_shapes(weight_files(Path(cfg.model.weights)))
    prefix, ties = common_prefix(list(state), set(stored)), tied_names(model)
    reader, scale = safe_reader(path), lora["alpha"] / lora["rank"]

    def pretrained(name: str) -> torch.Tensor:
        keys = [alias[len(prefix):] for alias in ties.get(name, [name]) if alias.startswith(prefix)]
        key = next((key for key in keys if key in stored), None)
        if key is None:
            raise CheckpointError(f"{name}: not in model.weights = {cfg.model.weights!r} as one tensor (the Hub's "
                                  "experts, one matrix each, do not merge here)")
        with safe_open(str(stored[key][1]), framework="pt") as handle:
            return handle.get_tensor(key)

    def merged(name: str) -> torch.Tensor:
        shape, dtype = state[name].shape, state[name].dtype
        weight = read_tensor(reader, name, shape, dtype) if name in saved else pretrained(name).to(dtype)
        layer = name.removesuffix(".weight")
        if not (name.endswith(".weight") and f"{layer}.lora.A" in saved):
            return weight
        a, b = (read_tensor(reader, f"{layer}.lora.{m}", saved[f"{layer}.lora.{m}"], torch.float32) for m in "AB")
        base = weight.float()
        if lora.get("quantize") == "nf4":
            base = dequantize(quantize(base), base.shape[1], torch.float32)
        return (base + scale * (b @ a)).to(dtype)

    write_model(cfg, model, out, merged, "export", progress)
    return path
