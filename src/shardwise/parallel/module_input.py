"""A module's input as its forward pre-hooks see it, and replaced there: how the parallelisms that
enter a model's blocks from outside (tensor parallel's regions, a pipeline stage's first block,
sequence parallel's split) reach the tensor a block computes from, whether the model passes it
positionally or by keyword (transformers' layers take `hidden_states=`)."""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn


@functools.cache
def _input_name(module_class: type) -> str:
    """The name of the first parameter of the class's forward after self."""
    return list(inspect.signature(module_class.forward).parameters)[1]


def module_input(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """What a forward pre-hook (`with_kwargs=True`) sees as the module's input: its first positional
    argument, or its forward's first parameter passed by keyword (transformers' layers are called
    with `hidden_states=`)."""
    return args[0] if args else kwargs[_input_name(type(module))]


def with_input(module: nn.Module, args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    """`args` and `kwargs` with the module's input (as `module_input` finds it) replaced by `x`."""
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, _input_name(type(module)): x}
