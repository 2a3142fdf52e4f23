"""A backward split in two, as the zero-bubble pipeline schedules run it: B, the gradients of a
stage's inputs only (what the stage before waits for), now; W, the gradients of its weights,
later, from what B left, without running any of B's work again.

Autograd runs only the nodes a call needs: asked for the inputs' gradients, it runs the nodes
between the output and the inputs (the input path) and, of each node there, only the outputs
the inputs need. A weight's gradient flows off that path where a node of it (a matmul's backward,
a norm's) also hands a gradient towards the weight. `backward_input` finds those nodes, the
frontier, keeps the gradient each one receives during B (a hook), and returns `WeightGradients`,
which later asks autograd for the weights' gradients starting from the frontier nodes with those
gradients: each frontier node runs again for its weight side only, then the nodes between it and
the weights, which B never ran. The graph (and every tensor its nodes saved, the inputs of the
matmuls W needs among them) lives until W is done; under activation recomputation B recomputes
the blocks' forwards once and W uses what B recomputed.

A node where two weight paths meet (a norm's weight and bias) makes one group; W asks autograd
once per group. Where one group's frontier nodes lie one after the other on the input path, W
hands each the gradient it received in B, so the one run again does not add to the next.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Each node of the graph below `root`, with the nodes that hand it gradients."""
    parents: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _above(starts: Iterable[Node], parents: dict[Node, list[Node]], stop: Iterable[Node] = ()) -> \
        tuple[list[Node], list[Node]]:
    """The nodes that hand gradients, directly or not, to `starts` (walking towards the output),
    not going past the nodes of `stop`; and the nodes of `stop` reached. Both in the order met, so
    that W sums gradients in the same order on every run."""
    stop = set(stop)
    seen: dict[Node, None] = {}
    reached: dict[Node, None] = {}
    queue = deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                reached[parent] = None
            elif parent not in seen:
                seen[parent] = None
                queue.append(parent)
    return list(seen), list(reached)


@dataclass(eq=False)
class _Group:
    params: list[nn.Parameter]
    frontier: list[Node]
    received: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)  # in B


def _as_received(received: tuple[torch.Tensor | None, ...], grad_outputs: tuple) -> tuple:
    return tuple(received[i] if i < len(received) else None for i in range(len(grad_outputs)))


@dataclass
class WeightGradients:
    """The W of one backward_input: run it once, later; it adds to each weight's .grad."""

    groups: list[_Group]

    def run(self) -> None:
        for group in self.groups:
            edges, grads = [], []
            for node in group.frontier:
                for nr, grad in enumerate(group.received.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, nr))
                        grads.append(grad)
            if not edges:
                continue
            # Frontier nodes after one another: each takes what it received in B, not that plus the
            # earlier one's share again.
            handles = [node.register_prehook(functools.partial(_as_received, group.received.get(node, ())))
                       for node in group.frontier] if len(group.frontier) > 1 else []
            try:
                weights = torch.autograd.grad(edges, [get_gradient_edge(p) for p in group.params], grads,
                                              retain_graph=True, allow_unused=True)
            finally:
                for handle in handles:
                    handle.remove()
            for param, grad in zip(group.params, weights, strict=True):
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad + grad
        self.groups = []  # the graph goes with them


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, inputs: Sequence[torch.Tensor],
                   params: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor | None], WeightGradients]:
    """B: the gradients of `inputs` (tensors `output` was computed from, leaves or not) given
    `grad`, the gradient of `output` (None for a scalar loss), without touching any .grad; and the
    W that computes `params`' gradients later."""
    root = output.grad_fn
    parents = _parents(root)
    input_edges = [get_gradient_edge(x) for x in inputs]
    input_nodes = [edge.node for edge in input_edges]
    input_path = {root, *_above(input_nodes, parents)[0]}

    # Each weight's frontier: the first input-path nodes above it; or an input itself that leads
    # to weights (a later layer's input that is an earlier layer's output), whose gradient B returns.
    groups: list[_Group] = []
    group_of: dict[Node, _Group] = {}
    for param in params:
        node = get_gradient_edge(param).node
        if node not in parents:
            continue  # not used by this forward
        _, frontier = _above([node], parents, [*input_path, *input_nodes])
        group = _Group([param], frontier)
        for other in {id(group_of[f]): group_of[f] for f in frontier if f in group_of}.values():
            group.params += other.params
            group.frontier += [f for f in other.frontier if f not in group.frontier]
            groups.remove(other)
        groups.append(group)
        for f in group.frontier:
            group_of[f] = group

    def keep(group: _Group, node: Node):
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            group.received[node] = grad_outputs
        return hook

    handles = [node.register_prehook(keep(group, node)) for group in groups for node in group.frontier
               if node not in input_nodes]
    try:
        input_grads = list(torch.autograd.grad(output, list(inputs), grad, retain_graph=True, allow_unused=True))
    finally:
        for handle in handles:
            handle.remove()
    for edge, x_grad in zip(input_edges, input_grads, strict=True):
        for group in groups:
            if edge.node in group.frontier and x_grad is not None:
                received = list(group.received.get(edge.node, (None,) * (edge.output_nr + 1)))
                received += [None] * (edge.output_nr + 1 - len(received))
                received[edge.output_nr] = x_grad
                group.received[edge.node] = tuple(received)
    return input_grads, WeightGradients(groups)
