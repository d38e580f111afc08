"""A stage's backward pass in two halves, as zero-bubble schedules run it (Qi et al. 2024): first the gradient of
the stage's input, which the previous stage is waiting for, then, whenever the schedule finds a gap, the gradients
of the weights, which nobody is waiting for.

How, with plain autograd. The graph of a stage's forward has two kinds of nodes: those on a path from the output to
the input (they carry the input gradient; call them the spine) and the rest, which only lead to weights. Every path
from the output to a weight leaves the spine exactly once, at a spine node whose backward also feeds a weight (a
linear layer's `AddmmBackward`, a layer norm's backward; a *fork*).

- `backward_input`: `torch.autograd.grad(output, input, grad, retain_graph=True)` runs the spine only (autograd
  computes just what leads to the input: at a fork, the input's gradient, not the weight's), and a hook on each
  fork keeps the gradient that arrived there. The graph stays alive, and with it every saved activation.
- `WeightGradients.run`: at each fork, autograd again from the kept gradient, asked only for the weights behind that
  fork: it computes exactly what the first pass skipped, nothing of the spine again. Forks whose weights overlap (a
  weight used twice) are run together, each fork's gradient pinned to the kept one so no path counts twice (such a
  group may run a stretch of spine between its forks again, so every call but the last keeps the graph: it goes,
  with the activations, when the last group is done and nothing refers to it). The weight gradients accumulate
  into `.grad` inside autograd, as in a plain backward.

A stage whose input needs no gradient (the first stage gets token ids) has no spine: its input half is empty and
its weight half is the whole backward. torch.distributed.pipelining does the same split (`stage_backward_input`,
`stage_backward_weight`) with the same autograd calls, grouped its own way.

What it costs, and why a stage is split layer by layer. The two halves compute exactly a plain backward's FLOPs; what
they add is host work: autograd's engine walks the whole graph below a call's starting points before it runs
anything, so one call per fork over a stage-long graph is quadratic in the stage's layers (docs/bench.md). So the
engine runs a split micro-batch's forward one layer at a time, each layer's input cut from the previous one's output
(`forward_cut`), and splits each layer's backward: the input pass is one call per layer, walking that layer only;
the weight pass takes the k-th group of every layer together in one call (their graphs share no node), as many
calls as the layer with the most forks has groups (`backward_input_cut`, `WeightGradients.together`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _children(root: Node) -> tuple[dict[Node, list[Node]], list[Node]]:
    """Every node reachable from `root` with the nodes its backward feeds, and all of them children first."""
    children: dict[Node, list[Node]] = {}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        children[node] = [child for child, _ in node.next_functions if child is not None]
        stack.append((node, True))
        stack.extend((c, False) for c in children[node] if c not in children)
    return children, order


Group = tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]  # fork edges, kept gradients, weights


class WeightGradients:
    """The deferred weight half of one backward: calls, each a list of groups of (fork edges, their kept gradients,
    the weights behind them) run by one autograd call. `run` adds the weight gradients into `.grad`, as
    `backward()` would have, and lets the graph go."""

    def __init__(self, groups: list[Group]):
        self.calls: list[list[Group]] = [[group] for group in groups]

    @classmethod
    def together(cls, halves: Sequence[WeightGradients]) -> WeightGradients:
        """The weight halves of graphs that share no node (the layers of a stage cut from each other, `forward_cut`)
        as one: the k-th call of each joined into one call, so that the calls are as many as the longest half's."""
        joined = cls([])
        for k in range(max((len(h.calls) for h in halves), default=0)):
            joined.calls.append([group for h in halves if k < len(h.calls) for group in h.calls[k]])
        return joined

    def run(self) -> None:
        """Each call's weight gradients accumulated into `.grad` by autograd itself (`backward(inputs=...)`, as a
        plain backward's AccumulateGrad does: no gradient tensor of our own to add); every call but the last keeps
        the graph, the last frees what it passes through as it goes, as a plain backward does."""
        last = len(self.calls) - 1
        for k, groups in enumerate(self.calls):
            pins = [edge.node.register_prehook(_pin(edges, grads, edge.node))
                    for edges, grads, _ in groups if len({e.node for e in edges}) > 1 for edge in edges]
            edges = [edge for group in groups for edge in group[0]]
            grads = [grad for group in groups for grad in group[1]]
            weights = list({id(w): w for group in groups for w in group[2]}.values())  # a weight two layers share
            try:
                torch.autograd.backward(edges, grads, retain_graph=k < last, inputs=weights)
            finally:
                for handle in pins:
                    handle.remove()
        self.calls = []


@dataclass
class LinearWeightPass:
    """One linear layer's weight half for one micro-batch, read off its fork: the gradient of the layer's output
    (rows x out) and the input autograd saved for it (rows x in). Its weight's gradient is grad^T @ inp, its bias's
    the column sums of grad: of several micro-batches, one product over their rows stacked (`run_batched`)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    grad: torch.Tensor
    inp: torch.Tensor

    @classmethod
    def of(cls, group: Group) -> LinearWeightPass | None:
        """The group as a plain linear layer's weight half, or None: one fork, an `addmm` (with a bias) or `mm`
        (without) of the layer's input by the transpose of a leaf weight, the group's weights exactly that weight
        and bias, no hook on either (a hook would expect autograd to accumulate). Anything else (a layer norm, a
        tied weight, a weight cast by autocast on its way in) is left to autograd."""
        edges, grads, weights = group
        if len(edges) != 1 or edges[0].output_nr != 0 or grads[0].dim() != 2:
            return None
        node = edges[0].node
        if node.name() == "AddmmBackward0" and node._saved_alpha == 1 and node._saved_beta == 1:
            (bias_node, _), _, (t_node, _) = node.next_functions
            inp = node._saved_mat1
        elif node.name() == "MmBackward0":
            bias_node, ((_, _), (t_node, _)) = None, node.next_functions
            inp = node._saved_self
        else:
            return None
        if t_node is None or t_node.name() != "TBackward0":
            return None
        weight, bias = _leaf(t_node.next_functions[0][0]), _leaf(bias_node)
        if weight is None or (bias_node is not None and bias is None):
            return None
        mine = [w for w in (weight, bias) if w is not None]
        if {id(w) for w in weights} != {id(w) for w in mine} or any(_hooked(w) for w in mine):
            return None
        return cls(weight, bias, grads[0], inp)


def _leaf(node: Node | None) -> torch.Tensor | None:
    """The leaf tensor an `AccumulateGrad` node adds into (None for any other node)."""
    return getattr(node, "variable", None) if node is not None else None


def _hooked(w: torch.Tensor) -> bool:
    return bool(w._backward_hooks) or bool(getattr(w, "_post_accumulate_grad_hooks", None))


def _accumulate(w: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` into `w.grad`, as autograd's AccumulateGrad does."""
    if w.grad is None:
        w.grad = grad
    else:
        w.grad.add_(grad)


def run_batched(halves: Sequence[WeightGradients]) -> None:
    """The weight halves of several micro-batches (graphs that share no node), run with each linear layer's
    weight gradient as one product over all their rows: grad^T @ inp with the micro-batches' rows stacked, instead
    of one product per micro-batch (the zero-bubble papers' W passes batched). Everything that is not a plain
    linear layer (`LinearWeightPass.of`) runs through autograd as `WeightGradients.together` would. The same sums
    as one backward per micro-batch, added in another order (fp32: within rounding)."""
    linears: dict[int, list[LinearWeightPass]] = {}
    for half in halves:
        kept = []
        for groups in half.calls:
            rest = []
            for group in groups:
                linear = LinearWeightPass.of(group)
                if linear is None:
                    rest.append(group)
                else:
                    linears.setdefault(id(linear.weight), []).append(linear)
            kept.append(rest)
        half.calls = [groups for groups in kept if groups]
    with torch.no_grad():  # as autograd's engine computes gradients: the saved input may require one (a cut)
        for parts in linears.values():
            grad = torch.cat([p.grad for p in parts]) if len(parts) > 1 else parts[0].grad
            inp = torch.cat([p.inp for p in parts]) if len(parts) > 1 else parts[0].inp
            _accumulate(parts[0].weight, grad.t().mm(inp))
            if parts[0].bias is not None:
                _accumulate(parts[0].bias, grad.sum(0))
    WeightGradients.together(halves).run()


def _pin(edges: list[GradientEdge], grads: list[torch.Tensor], node: Node):
    """A hook replacing whatever gradient reaches `node` in the weight pass by the one the input pass kept there
    (a fork reached both as a starting point and through another fork of its group counts once)."""
    kept = {e.output_nr: g for e, g in zip(edges, grads) if e.node is node}

    def hook(grad_outputs):
        return tuple(kept.get(i, g) for i, g in enumerate(grad_outputs))

    return hook


def backward_input(output: torch.Tensor, grad: torch.Tensor, inp: torch.Tensor | None,
                   weights: Iterable[torch.Tensor]) -> tuple[torch.Tensor | None, WeightGradients]:
    """The gradient of `inp` (None if it needs none) from `output` and its gradient `grad`, computed now; the
    weights' gradients returned as a `WeightGradients` to run later. The graph is kept until then."""
    weights = [w for w in weights if w.requires_grad]
    root = output.grad_fn
    if root is None:
        return None, WeightGradients([])
    if inp is None or not inp.requires_grad:
        return None, WeightGradients([([get_gradient_edge(output)], [grad], weights)])
    children, order = _children(root)
    target = get_gradient_edge(inp).node
    weight_node = {get_gradient_edge(w).node: w for w in weights}
    on_spine: set[Node] = set()
    behind: dict[Node, frozenset[Node]] = {}  # off the spine: the weights a node's backward leads to
    for node in order:  # children first
        if node is target or any(c in on_spine for c in children[node]):
            on_spine.add(node)
        else:
            found = {node} if node in weight_node else set()
            behind[node] = frozenset(found.union(*(behind[c] for c in children[node])))
    forks: dict[Node, frozenset[Node]] = {}  # spine node -> the weights only its side branches lead to
    for node in (n for n in order if n in on_spine):  # nearest the input first: the input pass ended there
        side = frozenset().union(*(behind[c] for c in children[node] if c not in on_spine))
        if side:
            forks[node] = side
    kept: dict[Node, tuple] = {}
    handles = [node.register_prehook(lambda grads, node=node: kept.__setitem__(node, grads)) for node in forks]
    try:
        (inp_grad,) = torch.autograd.grad(output, inp, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    groups: list[tuple[list[Node], set[Node]]] = []  # forks whose weights overlap go together
    for node, side in forks.items():
        joined = [g for g in groups if g[1] & side]
        merged = ([node] + [n for g in joined for n in g[0]], set(side).union(*(g[1] for g in joined)))
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    runs = []
    for nodes, side in groups:
        edges, grads = [], []
        for node in nodes:
            for i, g in enumerate(kept[node]):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        runs.append((edges, grads, [weight_node[n] for n in side]))
    return inp_grad, WeightGradients(runs)


@dataclass
class Cut:
    """One piece of a forward run piece by piece (`forward_cut`): its input, cut from the previous piece's output
    (a leaf that needs a gradient), its output, and the weights it may use."""

    inp: torch.Tensor
    out: torch.Tensor
    weights: list[torch.Tensor]


def forward_cut(pieces: Sequence[tuple[Callable[[torch.Tensor], torch.Tensor], Iterable[torch.Tensor]]],
                x: torch.Tensor) -> list[Cut]:
    """Run `pieces` (each a function and the weights it uses, e.g. a stage's layers) one after another from `x`,
    each on its predecessor's output cut from the graph where that output needs a gradient, as stages are cut from
    each other. Each piece must reach the earlier ones only through its input (a stage's layers pass the hidden
    state; the micro-batch's context is made from token ids, never from weights): a path around the cut would lose
    its gradient. The same tensors as one uncut forward, so the same memory."""
    cuts: list[Cut] = []
    h = x
    for fn, weights in pieces:
        inp = h.detach().requires_grad_() if cuts and h.requires_grad else h
        h = fn(inp)
        cuts.append(Cut(inp, h, [w for w in weights if w.requires_grad]))
    return cuts


def backward_input_cut(cuts: Sequence[Cut], grad: torch.Tensor) -> tuple[torch.Tensor | None, WeightGradients]:
    """`backward_input` of a forward run piece by piece (`forward_cut`): each piece's input gradient, last piece
    first, down to the first piece's input (None if it needs none); the pieces' weight halves joined
    (`WeightGradients.together`): the same gradients as one uncut split, in far fewer autograd calls."""
    halves = []
    for cut in reversed(cuts):
        grad, later = backward_input(cut.out, grad, cut.inp if cut.inp.requires_grad else None, cut.weights)
        halves.append(later)
        if grad is None:  # nothing before this piece needs a gradient
            break
    return grad, WeightGradients.together(halves)
