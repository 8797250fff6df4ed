"""What running a step as micro-batches changes in the numbers, and the checks that keep it exact.

A pipeline runs the global batch as ``m`` micro-batches of the same graph and takes the step's
loss as the mean of the micro-batch losses (gradients likewise). That is the full-batch loss
exactly when the loss is a mean over the same number of terms in every micro-batch. Two things
break it, and neither is left silent:

- **Batch norm in training** normalises each micro-batch with its own statistics (what gradient
  accumulation does): not the full batch's numbers. :func:`training_batch_norms` finds it; the
  planner does not make pipelines of such a model unless asked (``pipeline=True``, a ``pp`` axis,
  a layout with ``pp > 1``), and then says so in the plan (``options["microbatch_semantics"]``).
- **A mean over counted targets** (cross entropy with ``ignore_index``, as every HF language
  model computes its loss): with padding (``-100``) the micro-batches may count different numbers
  of targets, and the mean of their means is not the full-batch mean. :func:`target_counter`
  rebuilds the target from the user inputs, and ``ParallelModule`` checks every step that each
  micro-batch counts the same number of targets, and stops with a clear error otherwise.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_BATCH_NORMS = (aten.batch_norm.default, aten.native_batch_norm.default,
                aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_functional.default)


def training_batch_norms(gm: fx.GraphModule) -> list[str]:
    """Names of the batch-norm nodes of ``gm`` that normalise with the batch's statistics."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _BATCH_NORMS:
            continue
        if n.target is aten.batch_norm.default:
            training = n.args[5] if len(n.args) > 5 else n.kwargs.get("training", False)
        elif n.target is aten._native_batch_norm_legit_functional.default:
            training = n.args[5] if len(n.args) > 5 else n.kwargs.get("training", True)
        else:
            training = n.args[5] if len(n.args) > 5 else n.kwargs.get("training", False)
        if training:
            out.append(n.name)
    return out


class TargetCounter:
    """Counts, per micro-batch, the targets a mean loss averages over (see module docstring)."""

    def __init__(self, gm: fx.GraphModule, inputs: list[str], ignore_index: int, node: str):
        self.gm, self.inputs, self.ignore_index, self.node = gm, inputs, ignore_index, node

    def counts(self, values: dict[str, torch.Tensor], m: int) -> list[int] | None:
        """Targets counted by each of ``m`` micro-batches (batch-major), or None when the target
        does not split into ``m`` rows."""
        with torch.no_grad():
            t = self.gm(*[values[k] for k in self.inputs])
        if t.numel() % m:
            return None
        valid = (t != self.ignore_index).reshape(m, -1).sum(1)
        return [int(c) for c in valid.tolist()]

    def check(self, values: dict[str, torch.Tensor], m: int) -> None:
        """Raise ``ValueError`` when the micro-batches count different numbers of targets."""
        counts = self.counts(values, m)
        if counts is not None and len(set(counts)) > 1:
            raise ValueError(
                f"the {m} micro-batches of this batch count {counts} targets for the mean loss {self.node!r} "
                f"(targets equal to ignore_index={self.ignore_index} are not counted): the mean of their means would "
                f"not be this batch's loss, so the pipeline stops rather than train on other numbers. Give every "
                f"micro-batch as many counted targets (order the batch by padding), or plan without a pipeline "
                f"(pipeline=False)")


def target_counter(captured) -> TargetCounter | None:
    """A :class:`TargetCounter` for a mean cross entropy with ``ignore_index`` whose target is
    computed from the user inputs alone (None when the loss is of another kind). Raises
    ``NotImplementedError`` for a class-weighted one (its micro-batch means weigh differently)."""
    gm = captured.gm
    losses = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.cross_entropy_loss.default]
    for n in losses:
        args = list(n.args) + [None] * (6 - len(n.args))
        weight = args[2] if args[2] is not None else n.kwargs.get("weight")
        reduction = args[3] if args[3] is not None else n.kwargs.get("reduction", 1)
        ignore = args[4] if args[4] is not None else n.kwargs.get("ignore_index", -100)
        if int(reduction) != 1:
            continue  # a sum (or per-element losses): micro-batch sums add up exactly
        if weight is not None:
            raise NotImplementedError(f"a class-weighted mean cross entropy ({n.name}) under micro-batches: their "
                                      f"means are weighted by each micro-batch's own targets; plan without a pipeline")
        target = n.args[1]
        users = set(captured.user_inputs)
        keep, stack = set(), [target]
        while stack:
            a = stack.pop()
            if a in keep:
                continue
            keep.add(a)
            if a.op == "placeholder" and a.name not in users:
                return None  # the target depends on state: not a label
            stack.extend(a.all_input_nodes)
        g, env, inputs = fx.Graph(), {}, []
        for a in gm.graph.nodes:
            if a not in keep:
                continue
            if a.op == "placeholder":
                env[a] = g.placeholder(a.name)
                inputs.append(a.name)
            elif a.op == "get_attr":
                env[a] = g.get_attr(a.target)
            else:
                env[a] = g.node_copy(a, lambda x: env[x])
        g.output(env[target])
        return TargetCounter(fx.GraphModule(gm, g), inputs, int(ignore), n.name)
    return None


__all__ = ["training_batch_norms", "target_counter", "TargetCounter"]
