"""Train shardwise's GPT on Shakespeare in your own loop, through the Python API.

    python examples/train_api.py                                          # one process (single)
    torchrun --nproc-per-node 2 examples/train_api.py --strategy fsdp     # two processes, FSDP
    torchrun --nproc-per-node 2 examples/train_api.py --strategy ddp --grad-accum 2 --save runs/api
    python examples/train_api.py --resume runs/api --steps 40             # go on from it, any strategy

Prints each step's loss (the mean over the global batch) and the validation loss at the end;
`--json FILE` also writes them. Global batch k is the same samples whatever the strategy and the
number of processes, so every strategy prints the losses `single` prints. (Under `pipeline` and
`model-parallel` a step is `run.forward_backward(micro_batches, loss_fn)`, not this loop.)
"""

from __future__ import annotations

import argparse
import json

import torch

import shardwise as sw
from shardwise.data.corpus import TokenWindows, load_corpus, split_tokens
from shardwise.dist import leave_process
from shardwise.models import GPT, GPTConfig, loss_fn

SEQ_LEN = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="single", help="single, ddp, ddp-native, zero1, zero2, fsdp, ...")
    parser.add_argument("--precision", default="fp32", help="fp32, bf16-mixed, fp16-mixed or bf16-true")
    parser.add_argument("--steps", type=int, default=30, help="train up to this many global batches")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per global batch, over all ranks")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per global batch on each rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", metavar="DIR", help="checkpoint into DIR at the end")
    parser.add_argument("--resume", metavar="DIR", help="start from DIR's newest checkpoint")
    parser.add_argument("--json", metavar="FILE", help="write the losses here (rank 0)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    run = sw.setup(strategy=args.strategy, precision=args.precision, grad_accum=args.grad_accum, grad_clip=1.0)
    train_tokens, val_tokens = split_tokens(load_corpus("shakespeare"), val_fraction=0.05)
    train_set, val_set = TokenWindows(train_tokens, SEQ_LEN), TokenWindows(val_tokens, SEQ_LEN)

    # Built after setup, which seeds every rank alike: every rank starts from the same weights.
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=SEQ_LEN, vocab_size=256))
    model, optimizer = run.prepare(model, lambda params: torch.optim.AdamW(params, lr=args.lr))
    if args.resume:
        run.load(args.resume)

    losses = []
    step_loss = torch.zeros(())
    batches = run.loader(train_set, args.batch_size, steps=args.steps - run.global_step)
    for i, (inputs, targets) in enumerate(batches):
        loss = loss_fn(model(inputs), targets)
        run.backward(loss)
        run.step(optimizer)  # steps after the global batch's last micro-batch, else only returns False
        step_loss += loss.detach().cpu() / args.grad_accum
        if (i + 1) % args.grad_accum == 0:
            losses.append(run.reduce_mean(step_loss).item())
            step_loss.zero_()
            if run.is_main:
                print(f"step {run.global_step}: loss {losses[-1]:.4f}", flush=True)

    model.eval()
    with torch.no_grad():
        val_sum = sum(loss_fn(model(x), y).cpu() for x, y in run.loader(val_set, args.batch_size, steps=2, start=0))
    val_loss = run.reduce_mean(val_sum / (2 * args.grad_accum)).item()
    if args.save:
        run.save(args.save)
    result = {"strategy": args.strategy, "world_size": run.world_size, "first_step": run.global_step - len(losses),
              "losses": losses, "val_loss": val_loss}
    if run.is_main:
        print(f"{args.strategy} on {run.world_size} process(es): validation loss {val_loss:.4f}")
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
