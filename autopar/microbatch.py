"""What running a step as micro-batches changes in the numbers, and the checks that keep it exact.

- **How the loss combines** (:func:`loss_reduction`): a mean over the batch is the mean of equal
  micro-batches' means, a sum is the sum of their sums; the runtime combines the micro-batch
  losses and gradients accordingly. A loss that is neither (a load-balancing term made of batch
  means, a reduction over another dim) has no micro-batch form: micro-batched plans of it are
  refused, and the free search makes none.

A pipeline runs the global batch as ``m`` micro-batches of the same graph and takes the step's
loss as the mean of the micro-batch losses (gradients likewise). That is the full-batch loss
exactly when the loss is a mean over the same number of terms in every micro-batch. Three things
break it, and neither is left silent:

- **A scale computed from the batch size** (``x.sum() / x.shape[0]``) is a constant in each
  capture: :func:`loss_reduction` compares it with the micro-batch capture's, so a sum over the
  batch size is combined as a mean, and any other such scale is refused.
- **Batch norm in training** normalises each micro-batch with its own statistics (what gradient
  accumulation does): not the full batch's numbers. :func:`training_batch_norms` finds it; the
  planner does not make pipelines of such a model unless asked (``pipeline=True``, a ``pp`` axis,
  a layout with ``pp > 1``), and then says so in the plan (``options["microbatch_semantics"]``).
- **A mean over counted targets** (cross entropy with ``ignore_index``, as every HF language
  model computes its loss): with padding (``-100``) the micro-batches may count different numbers
  of targets, and the mean of their means is not the full-batch mean. :func:`target_counter`
  rebuilds the target from the user inputs, and ``ParallelModule`` checks every step that each
  micro-batch counts the same number of targets, and stops with a clear error otherwise.

**Samples that meet** (:func:`couplings`). Micro-batches are exact only when every value the loss
reads is computed sample by sample. The check follows the batch through the whole graph, reading
each value's batch dims off the plan's capture and the micro-batch capture (the dims whose size
differs, wherever transposes, views and matmuls moved them), and refuses by op and layer where
samples meet: a reduction or matmul over the batch, a value with two batch dims (contrastive
logits, every image against every text), a scan or softmax along the batch, samples taken by
position, a batch-sized ``arange`` read as data (targets made from the batch size), a number that
depends on the batch size. Routing stays exact: expert ids sorted and counted over the tokens
decide where rows go, not what they compute. The planner runs the check on every micro-batched
plan it returns (``autopar.planner.checked_plan``; the free search then plans without
micro-batches), and the module on every micro-batched plan it builds.

**Micro-batches of one sample** (:func:`one_sample_capture`). ``torch.export`` specialises dims
of size 1 (a broadcast it can see through, a view it folds), so a capture at one sample is not the
plan's graph. The micro-batch graph is instead the model's graph at two and three samples (two
captures that must have the plan's nodes), with every integer argument that differs between them
carried to one sample along the line through the two (a view's ``[2, 16, 64]`` and
``[3, 16, 64]`` give ``[1, 16, 64]``; ``2 * seq`` and ``3 * seq`` give ``seq``). That is the
graph the plan priced, run on one sample: the general path, which is what the full batch
computes. It is checked, not trusted: shapes are propagated through it at one sample (fake
tensors) and every value's shape must lie on the same line; any other argument that depends on
the batch (a float such as ``1 / batch``), a size that is not linear in it, or an op that cannot
run on one sample (batch norm over a 1x1 map) is refused by name.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

aten = torch.ops.aten
_BATCH_NORMS = (aten.batch_norm.default, aten.native_batch_norm.default,
                aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_functional.default)


def batch_of(captured) -> int | None:
    """The batch of a capture: dim 0 of its first user input that has a dim, or None."""
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    for name in captured.user_inputs:
        v = nodes[name].meta.get("val") if name in nodes else None
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return None


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


#: Losses with a ``reduction`` argument (position in the schema): 1 mean, 2 sum, 0 none.
_REDUCING = {
    "cross_entropy_loss": 3, "nll_loss": 3, "nll_loss_nd": 3, "nll_loss2d": 3, "mse_loss": 2, "l1_loss": 2,
    "smooth_l1_loss": 2, "huber_loss": 2, "binary_cross_entropy": 3, "binary_cross_entropy_with_logits": 4,
    "kl_div": 2, "soft_margin_loss": 2, "multilabel_margin_loss": 2, "multi_margin_loss": 5,
    "margin_ranking_loss": 4, "hinge_embedding_loss": 3, "cosine_embedding_loss": 4, "poisson_nll_loss": 5,
}
#: Ops that combine along a dim (``dim`` their second argument).
_ALONG = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "logsumexp", "prod",
          "norm", "linalg_vector_norm", "argmax", "argmin", "cumsum", "cumprod", "topk", "softmax", "_softmax",
          "log_softmax", "_log_softmax"}
_SCALAR_PASS = {"_to_copy", "to", "clone", "alias", "detach", "view", "reshape", "squeeze", "unsqueeze",
                "_unsafe_view", "contiguous", "type_as", "neg"}


def loss_reduction(captured, micro=None, *, head: set | None = None) -> str | None:
    """How the step's loss combines over the batch: ``"mean"`` (the mean of equal micro-batches'
    losses is the batch's), ``"sum"`` (their sum is), or None (neither is established: a product of
    batch means such as a load-balancing term, a reduction over something other than the batch).

    Read off the graph from the loss back: through casts and views, scaling by constants, and sums
    or differences of terms that all combine alike, to a loss op with a mean or sum reduction, or
    to ``mean``/``sum`` over every dim of a tensor whose dim 0 carries the batch (a multiple of
    it). Micro-batches are equal (they must divide the batch).

    A scale that the micro-batch capture holds at another value came from the batch size: a sum
    divided by the batch (``x.sum() / x.shape[0]``, a hand-written mean) is a mean; any other such
    scale is None (summing or averaging the micro-batches' losses would not give the batch's).

    Which tensors carry the batch in dim 0: with ``micro`` (the capture at ``batch / m``, which a
    micro-batched module builds), exactly those whose dim 0 differs between the two captures;
    without it, those whose dim 0 is a multiple of the batch (a guess that may also take an
    expert count for one, and then answers None: the safe side).

    ``head``, when given, receives the nodes of the loss's own reduction that the answer rests on
    (the loss op or the mean/sum, and the scalings and sums above it)."""
    shrunk = None
    small_nodes = {n.name: n for n in micro.gm.graph.nodes} if micro is not None else {}
    if micro is not None:
        small = {n.name: n.meta.get("val") for n in micro.gm.graph.nodes}
        shrunk = set()
        for n in captured.gm.graph.nodes:
            v, w = n.meta.get("val"), small.get(n.name)
            if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor) and v.dim() > 0 and w.dim() > 0 and \
                    int(v.shape[0]) != int(w.shape[0]):
                shrunk.add(n.name)
    batch = batch_of(captured)
    micro_batch = batch_of(micro) if micro is not None else None
    micro_ratio = batch / micro_batch if batch and micro_batch else None  # the batch over the micro-batch

    def sized(x) -> bool:
        if shrunk is not None:
            return isinstance(x, fx.Node) and x.name in shrunk
        v = x.meta.get("val") if isinstance(x, fx.Node) else None
        return isinstance(v, torch.Tensor) and v.dim() > 0 and batch is not None and int(v.shape[0]) % batch == 0

    def couples(n) -> bool:  # an op that combines samples: a reduction (or scan, sort) along dim 0
        base = getattr(n.target, "__name__", str(n.target)).split(".")[0] if n.op == "call_function" else ""
        if base not in _ALONG or not n.args or not sized(n.args[0]):
            return False
        nd = n.args[0].meta["val"].dim()
        if base == "topk":  # topk(self, k, dim=-1, ...)
            dims = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)
        else:
            dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if dims is None or dims == []:
            return True
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        return any(isinstance(d, int) and d % nd == 0 for d in dims)

    def carries(x) -> bool:
        """Dim 0 of ``x`` is the batch, sample by sample: sized like it, and no op it is computed
        from combines samples along dim 0."""
        if not sized(x):
            return False
        seen, stack = set(), [x]
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if couples(a):
                return False
            stack.extend(a.all_input_nodes)
        return True

    def everything(n) -> bool:  # a reduction of every dim to a scalar
        v = n.meta.get("val")
        return isinstance(v, torch.Tensor) and v.dim() == 0

    def constant(x) -> bool:
        return not isinstance(x, fx.Node)

    def scaled(n, at, base, inner):
        """``inner`` scaled by the constant ``n.args[at]``. A constant that differs in the
        micro-batch capture came from the batch size: ``sum / batch`` (or ``sum * (1 / batch)``)
        is a mean; any other such constant has no micro-batch form (None)."""
        if micro is None or inner is None:
            return inner
        twin = small_nodes.get(n.name)
        c_small = twin.args[at] if twin is not None and len(twin.args) > at else None
        c = n.args[at]
        if c_small == c:
            return inner
        if inner != "sum" or not micro_ratio or not isinstance(c, (int, float)) or \
                not isinstance(c_small, (int, float)) or not c or not c_small:
            return None
        ratio = c / c_small if base == "div" else c_small / c
        return "mean" if abs(ratio - micro_ratio) <= 1e-9 * micro_ratio else None

    def kind(n, depth=0) -> str | None:
        got = _kind(n, depth)
        if got is not None and head is not None:
            head.add(n)
        return got

    def _kind(n, depth=0) -> str | None:
        if not isinstance(n, fx.Node) or n.op != "call_function" or depth > 64:
            return None
        base = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if base in _REDUCING:
            pos = _REDUCING[base]
            args = list(n.args)
            red = args[pos] if len(args) > pos else n.kwargs.get("reduction", 1)
            if not carries(n.args[0]):
                return None
            return {1: "mean", 2: "sum"}.get(int(red))
        if base in ("mean", "sum") and everything(n) and carries(n.args[0]):
            return base
        if base in _SCALAR_PASS:
            return kind(n.args[0], depth + 1)
        if base in ("mul", "div"):
            a, b = n.args[0], n.args[1]
            for i, (x, y) in enumerate(((a, b), (b, a)) if base == "mul" else ((a, b),)):
                if constant(y):
                    return scaled(n, 1 - i, base, kind(x, depth + 1))
            return None
        if base in ("add", "sub"):
            a, b = n.args[0], n.args[1]
            ka, kb = kind(a, depth + 1), kind(b, depth + 1)
            return ka if ka is not None and ka == kb else None
        return None

    return kind(captured.loss_node)



# ------------------------------------------------------------------ samples that meet (coupling)
#: Ops whose integer arguments are sizes: they may differ between the captures (a view of the batch).
_SHAPE_ARGS = {"view", "reshape", "_unsafe_view", "_reshape_alias", "expand", "new_zeros", "new_ones", "new_empty",
               "new_full", "zeros", "ones", "empty", "full", "empty_strided", "unflatten", "repeat", "randn", "rand",
               "randint", "normal", "as_strided", "view_as", "expand_as", "reshape_as", "split_with_sizes", "split",
               "slice", "narrow", "arange", "sym_size", "alias", "_to_copy", "to", "permute", "transpose", "t",
               "unsqueeze", "squeeze", "flatten", "clone", "contiguous", "detach", "select", "getitem", "chunk",
               "unbind", "tensor_split"}
#: Ops that make a tensor whose values are the same along every dim: a batch-sized one is the same
#: tensor per micro-batch (zeros, a broadcast, random draws).
_BROADCASTS = {"expand", "new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones", "empty", "full",
               "empty_strided", "zeros_like", "ones_like", "empty_like", "full_like", "randn", "rand", "randint",
               "randn_like", "rand_like", "randint_like", "normal", "bernoulli", "repeat", "view", "reshape",
               "_unsafe_view", "unsqueeze", "alias", "_to_copy", "to", "clone", "contiguous", "detach",
               "scalar_tensor", "lift_fresh_copy"}
#: Ops that combine values along a dim and keep it (a scan, a normalisation along it, a reorder).
_SCANS = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax", "_softmax", "log_softmax",
          "_log_softmax", "flip", "roll", "topk", "kthvalue", "median", "mode", "nanmedian"}
#: Ops that count or order rows across the batch (routing: a histogram of expert ids, the order
#: that groups rows by expert). What they give is a *route*: exact only as indices and offsets.
_ROUTERS = {"histc", "bincount", "sort", "argsort", "unique_consecutive", "_unique2"}
#: Ops that read or write rows at positions (index, offsets): the positions may be a route or the
#: batch's own positions; on a batch dim nothing else.
_INDEXING = {"index", "index_select", "gather", "index_add", "index_put", "index_put_", "_index_put_impl",
             "index_copy", "scatter", "scatter_add", "scatter_reduce", "index_fill", "take_along_dim",
             "_grouped_mm", "grouped_mm", "grouped_mm_fallback", "embedding"}
#: Ops that read only the dtype and device of their tensor argument, not its values.
_TEMPLATES = {"new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
              "full_like", "randn_like", "rand_like", "randint_like", "_assert_tensor_metadata", "sym_size",
              "sym_numel", "sym_stride"}
_BATCH_NORM_NAMES = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                     "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training"}


def _op(n: fx.Node) -> str:
    if n.op != "call_function":
        return ""
    t = n.target
    name = getattr(t, "__name__", str(t))
    return name.split(".")[0]


def _leaves(v) -> list:
    return [t for t in pytree.tree_leaves(v)] if isinstance(v, (list, tuple)) else [v]


class Coupling(ValueError):
    """Micro-batches would not compute the batch's numbers: samples meet at ``node``."""

    def __init__(self, message: str, node: str = "", layer: str = ""):
        super().__init__(message)
        self.node, self.layer = node, layer


def couplings(captured, micro) -> list[tuple[fx.Node, str]]:
    """Where samples of the batch meet in ``captured`` (the plan's capture), read against
    ``micro`` (the same model captured at ``batch / m``, same nodes): each ``(node, why)`` whose
    value reaches the loss, first first. Empty when every value the loss reads is computed sample
    by sample, so that micro-batches compute the batch's numbers exactly (module docstring).

    A value's *batch dims* are the dims whose size differs between the two captures (they scale
    with the batch, wherever transposes, views and matmuls moved them). Samples meet where:

    - an op reduces a batch dim away (a sum or matmul over samples, a mean over the batch) or
      makes a value with two batch dims (every sample against every other: contrastive logits);
    - an op scans, normalises or reorders along a batch dim (cumsum, softmax, flip, top-k);
    - an op selects samples by position (``x[: B // 2]``, ``x[0]``, a split of the batch, an index
      that is not per sample);
    - a tensor made in the graph has a batch dim and values that are not the same along it
      (``torch.arange(batch)`` used as data, as targets);
    - a number in an op's arguments depends on the batch size (``x / x.shape[0]`` in the model),
      where it is not a size.

    Two exceptions keep their documented meaning: batch norm in training (per-micro-batch
    statistics, :func:`training_batch_norms`) and the loss's own reduction over the batch
    (:func:`loss_reduction`). Routing stays exact: a histogram or sort of expert ids over the
    tokens (a *route*) may decide where rows go (indices, group offsets) but not what a row
    computes; ``arange(batch)`` may index the batch dim (each sample picks its own row)."""
    small = {n.name: n for n in micro.gm.graph.nodes}
    head: set = set()
    if loss_reduction(captured, micro, head=head) is None:
        return []  # no micro-batch form of the loss at all: refused by that check, by name
    state: dict[str, tuple[str, str]] = {}  # name -> (tag, why); tag: "mixed", "route", "iota"
    bdims: dict[str, list[set[int]]] = {}
    found: list[tuple[fx.Node, str]] = []

    def dims_of(n: fx.Node) -> list[set[int]]:
        if n.name in bdims:
            return bdims[n.name]
        twin = small.get(n.name)
        out = []
        va, vb = _leaves(n.meta.get("val")), _leaves(twin.meta.get("val") if twin is not None else None)
        for a, b in zip(va, vb + [None] * (len(va) - len(vb))):
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim():
                out.append({d for d in range(a.dim()) if int(a.shape[d]) != int(b.shape[d])})
            else:
                out.append(set())
        bdims[n.name] = out
        return out

    def batched(x) -> bool:
        return isinstance(x, fx.Node) and any(dims_of(x))

    def tag(x) -> str | None:
        return state.get(x.name, (None, ""))[0] if isinstance(x, fx.Node) else None

    def dim_arg(n, pos, name, default=None):
        d = n.args[pos] if len(n.args) > pos else n.kwargs.get(name, default)
        return d

    def norm(d, nd):
        return d % nd if isinstance(d, int) and nd else d

    for n in captured.gm.graph.nodes:
        if n.op != "call_function":
            continue
        base = _op(n)
        ins = n.all_input_nodes
        nd0 = n.args[0].meta["val"].dim() if ins and isinstance(n.args[0], fx.Node) and \
            isinstance(n.args[0].meta.get("val"), torch.Tensor) else 0
        b0 = dims_of(n.args[0])[0] if n.args and isinstance(n.args[0], fx.Node) and dims_of(n.args[0]) else set()
        outd = dims_of(n)
        mixed_in = next((x for x in ins if tag(x) == "mixed"), None)
        why = None
        new = None
        if base in _BATCH_NORM_NAMES:
            new = "mixed" if mixed_in is not None else None
            if mixed_in is not None:
                state[n.name] = state[mixed_in.name]
            continue
        if n in head:
            continue
        if mixed_in is not None:
            state[n.name] = state[mixed_in.name]
            continue
        twin = small.get(n.name)
        flat_a = pytree.tree_leaves((n.args, n.kwargs))
        flat_b = pytree.tree_leaves((twin.args, twin.kwargs)) if twin is not None else flat_a
        differs = [(a, b) for a, b in zip(flat_a, flat_b) if not isinstance(a, fx.Node) and a != b]
        routes = [x for x in ins if tag(x) == "route"]
        iotas = [x for x in ins if tag(x) == "iota"]
        # 1. numbers that depend on the batch size
        if differs and base not in _SHAPE_ARGS:
            why = (f"has an argument that depends on the batch size ({differs[0][0]!r} for the batch, "
                   f"{differs[0][1]!r} for a micro-batch)")
        # 2. selecting samples by position
        elif base in ("slice", "narrow") and b0:
            d = norm(dim_arg(n, 1, "dim", 0), nd0)
            if d in b0:
                full_in, full_out = n.args[0].meta["val"].shape[d], n.meta["val"].shape[d]
                if int(full_in) != int(full_out):
                    why = "takes some of the samples by position (a slice of the batch)"
        elif base == "select" and b0:
            if norm(dim_arg(n, 1, "dim", 0), nd0) in b0:
                why = "takes one sample by position"
        elif base in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split") and b0:
            d = norm(dim_arg(n, 2 if base != "unbind" else 1, "dim", 0), nd0)
            if d in b0 and len(_leaves(n.meta.get("val"))) > 1:
                why = "splits the batch into parts by position"
        elif base in _SCANS and b0:
            d = dim_arg(n, 2 if base == "topk" else 1, "dim", -1 if base not in ("flip", "roll") else None)
            ds = d if isinstance(d, (list, tuple)) else ([d] if d is not None else list(range(nd0)))
            if base == "roll" and len(n.args) > 2:
                ds = n.args[2] if isinstance(n.args[2], (list, tuple)) else [n.args[2]]
            if any(norm(x, nd0) in b0 for x in ds):
                why = f"combines values along the batch dim ({base})"
        if why is None and base in _TEMPLATES:
            pass  # reads no values
        elif why is None and base in _ROUTERS and any(batched(x) for x in ins):
            new = "route"
        elif why is None and base in _INDEXING:
            why, new = _index_rule(n, base, dims_of, tag)
        elif why is None and base == "arange" and any(outd):
            new = "iota"
        elif why is None:
            if routes and any(batched(x) and tag(x) is None for x in ins):
                why = f"uses an order or count over the whole batch ({routes[0].name}) as data"
            elif iotas and base not in _BROADCASTS:
                why = f"uses the positions of the samples in the batch ({iotas[0].name}, an arange over the batch) " \
                      f"as data"
            elif iotas:
                new = "iota"
            elif routes:
                new = "route"
            elif any(batched(x) for x in ins) and (lost := [v for d, v in zip(outd, _leaves(n.meta.get("val")))
                                                          if not d and isinstance(v, torch.Tensor) and v.numel()]):
                if all(not (v.is_floating_point() or v.is_complex()) for v in lost):
                    new = "route"  # a count over the batch: exact as positions, not as data
                else:
                    why = "reduces over the samples of the batch"
            elif any(len(d) > 1 for d in outd) and not any(len(d) > 1 for x in ins for d in dims_of(x)) \
                    and any(batched(x) for x in ins):
                why = "pairs every sample with every other (a value with two batch dims)"
            elif any(outd) and not any(batched(x) for x in ins) and base not in _BROADCASTS:
                why = f"makes a batch-sized tensor ({base}) whose values differ along the batch"
        if why is not None:
            found.append((n, why))
            state[n.name] = ("mixed", why)
        elif new is not None:
            state[n.name] = (new, "")
    # What reaches the loss: the inputs of the loss's own reduction.
    bad = set()
    for h in head:
        for x in h.all_input_nodes:
            if x not in head and tag(x) in ("mixed", "iota", "route"):
                bad.add(x.name)
    if not bad:
        return []
    # The couplings upstream of what reaches the loss.
    up, stack = set(), [x for x in captured.gm.graph.nodes if x.name in bad]
    while stack:
        a = stack.pop()
        if a.name in up:
            continue
        up.add(a.name)
        stack.extend(a.all_input_nodes)
    hits = [(n, why) for n, why in found if n.name in up]
    if not hits:  # an arange or a route read as the loss's data
        x = next(x for x in captured.gm.graph.nodes if x.name in bad)
        hits = [(x, "is the positions of the samples (an arange over the batch) or an order or count over the "
                    "batch, read by the loss as data")]
    return hits


def _index_rule(n, base, dims_of, tag):
    """(why, tag) of an indexing op: on a batch dim the positions must be a route or the batch's own
    positions; a route elsewhere picks what a row computes."""
    def bd(x):
        return dims_of(x)[0] if isinstance(x, fx.Node) and dims_of(x) else set()

    data = n.args[0] if n.args else None
    if base == "embedding":  # embedding(weight, indices): rows of a table by per-sample ids
        return None, None
    pairs = []  # (dim of data, index node)
    if base in ("index", "index_put", "index_put_", "_index_put_impl"):
        for d, i in enumerate(n.args[1] if len(n.args) > 1 else []):
            if isinstance(i, fx.Node):
                pairs.append((d, i))
    elif base in ("_grouped_mm", "grouped_mm", "grouped_mm_fallback"):
        offs = n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")
        if isinstance(offs, fx.Node) and tag(offs) == "iota":
            return "uses the positions of the samples as group offsets", None
        return None, None  # the offsets of the groups: a route (rows grouped by expert) or fixed
    elif len(n.args) > 2 and isinstance(n.args[2], fx.Node):
        nd = data.meta["val"].dim() if isinstance(data, fx.Node) else 1
        pairs.append((n.args[1] % max(nd, 1) if isinstance(n.args[1], int) else n.args[1], n.args[2]))
    db = bd(data)
    for d, i in pairs:
        t = tag(i)
        if d in db:
            if t not in ("route", "iota") and not (base in ("gather", "take_along_dim") and d in bd(i) and t is None
                                                   and False):
                return (f"reads or writes samples at positions that are not each sample's own (index {i.name} on "
                        f"the batch dim)"), None
        elif t == "route":
            return f"picks what a row computes by an order or count over the whole batch ({i.name})", None
        elif t == "iota":
            return f"uses the positions of the samples ({i.name}) to index a dim that is not the batch's", None
    used = {i for _, i in pairs}
    if any(tag(x) in ("route", "iota") for x in n.all_input_nodes if x not in used):
        return None, "route"  # positions written at positions: a permutation (its inverse), still a route
    return None, None


def micro_check(model: nn.Module, captured, microbatches: int, loss_fn=None):
    """The capture of ``model`` at ``batch / microbatches`` (:func:`microbatch_capture`), once
    :func:`couplings` proves that its micro-batches compute the batch's numbers; raises
    :class:`Coupling` naming the op and the layer where samples meet otherwise."""
    micro = microbatch_capture(model, captured, microbatches, loss_fn)
    hits = couplings(captured, micro)
    if hits:
        from profiler.capture import module_path

        n, why = hits[0]
        layer = module_path(n) or "the model's top level"
        more = "; also " + "; ".join(f"{x.name} ({_op(x)}) in {module_path(x) or 'the top level'}: {w}"
                                     for x, w in hits[1:4]) if len(hits) > 1 else ""
        raise Coupling(
            f"this model cannot run as {microbatches} micro-batches: samples of the batch meet at {n.name} ({_op(n)}) "
            f"in {layer}, which {why}{more}. Each micro-batch would see only its own samples, and the step would "
            f"train on other numbers than the batch's. Plan without micro-batches (no 'pp' or 'microbatches' in the "
            f"layout, pipeline=False), or make the loss per sample", node=n.name, layer=layer)
    return micro


def microbatch_capture(model: nn.Module, captured, microbatches: int, loss_fn=None):
    """The capture of ``model`` at ``batch / microbatches`` (see module docstring)."""
    from profiler.align import follow
    from profiler.capture import capture as _capture

    def capture(*a, **k):  # in the op order and names of ``captured`` (profiler.align)
        cap = _capture(*a, **k)
        follow(cap, captured)
        return cap

    (args, kwargs, target), _ = captured.ep.example_inputs

    def cut(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % microbatches:
            raise ValueError(f"the batch dim {t.shape[0]} of an input does not divide into {microbatches} "
                             f"micro-batches; use a batch size divisible by the micro-batch count")
        return t[: t.shape[0] // microbatches]

    small = pytree.tree_map(cut, (args, kwargs, target))
    size = next((t.shape[0] for t in pytree.tree_leaves(small) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if size == 1:
        from autopar.microbatch import one_sample_capture

        def at(b):  # the inputs' first b samples (repeated where the batch has fewer)
            def take(t):
                if not isinstance(t, torch.Tensor) or t.dim() == 0:
                    return t
                return torch.cat([t] * -(-b // t.shape[0]))[:b]

            a, k, tg = pytree.tree_map(take, (args, kwargs, target))
            return capture(model, a, k, loss_fn=loss_fn, target=tg)

        return one_sample_capture(at, captured)
    args, kwargs, target = small
    cap = capture(model, args, kwargs, loss_fn=loss_fn, target=target)
    want = [(n.name, str(n.target)) for n in captured.gm.graph.nodes]
    got = [(n.name, str(n.target)) for n in cap.gm.graph.nodes]
    if want != got:
        diff = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        raise ValueError(f"the micro-batch capture differs from the planned graph at node {diff} "
                         f"({want[diff] if diff < len(want) else None} vs {got[diff] if diff < len(got) else None}): "
                         f"the model's graph depends on the batch size; plan without a pipeline")
    return cap


def one_sample_capture(capture_at, planned):
    """The micro-batch graph at one sample (module docstring), from ``capture_at(b)`` (the
    model's capture at ``b`` samples) and the plan's ``planned`` capture, whose nodes both
    captures must have."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.fx.passes.shape_prop import _extract_tensor_metadata
    from torch._guards import detect_fake_mode

    batch = batch_of(planned)
    two, three = capture_at(2), capture_at(3)
    # A third point checks the line: the planned capture, or one at 4 samples.
    far, check = (batch, planned) if batch >= 4 else (4, capture_at(4))
    want = [(n.name, str(n.target)) for n in planned.gm.graph.nodes]
    for b, cap in ((2, two), (3, three), (far, check)):
        got = [(n.name, str(n.target)) for n in cap.gm.graph.nodes]
        if got != want:
            raise ValueError(f"the capture at {b} samples differs from the planned graph: the model's graph depends on "
                             f"the batch size, so micro-batches of one sample cannot run it; use micro-batches of at "
                             f"least 2 samples (fewer micro-batches)")

    def refuse(node, why):
        return ValueError(f"micro-batches of one sample cannot run this model: node {node.name} "
                          f"({node.target}) {why}; use micro-batches of at least 2 samples (fewer micro-batches)")

    def line(a, b):  # the value at one sample on the line through a (2 samples) and b (3)
        return 2 * a - b

    def on_line(a, b, c):  # c (at ``far`` samples) lies on that line
        return c == a + (b - a) * (far - 2)

    nodes2, nodes3 = list(two.gm.graph.nodes), list(three.gm.graph.nodes)
    for n2, n3, nf in zip(nodes2, nodes3, check.gm.graph.nodes):
        l2, spec2 = pytree.tree_flatten((n2.args, n2.kwargs))
        l3, spec3 = pytree.tree_flatten((n3.args, n3.kwargs))
        lf, specf = pytree.tree_flatten((nf.args, nf.kwargs))
        if not spec2 == spec3 == specf:
            raise refuse(n2, "has arguments of another structure at another batch size")
        out, changed = [], False
        for a, b, c in zip(l2, l3, lf):
            if isinstance(a, fx.Node) or a == b == c:
                out.append(a)
                continue
            if type(a) is not int or type(b) is not int or type(c) is not int:
                raise refuse(n2, f"has an argument that depends on the batch and is not a size ({a!r} at 2 samples, "
                                 f"{b!r} at 3, {c!r} at {far})")
            v = line(a, b)
            if v < 0 or not on_line(a, b, c):
                raise refuse(n2, f"has an argument that is not linear in the batch ({a} at 2 samples, {b} at 3, "
                                 f"{c} at {far})")
            out.append(v)
            changed = True
        if changed:
            n2.args, n2.kwargs = pytree.tree_unflatten(out, spec2)
    two.gm.recompile()

    # Shapes at one sample, checked against the line through 2 and 3 samples.
    old2 = {n.name: n.meta.get("val") for n in nodes2}
    old3 = {n.name: n.meta.get("val") for n in nodes3}
    oldf = {n.name: n.meta.get("val") for n in check.gm.graph.nodes}
    phs = [n for n in nodes2 if n.op == "placeholder"]
    mode = detect_fake_mode([n.meta["val"] for n in phs if isinstance(n.meta.get("val"), torch.Tensor)])
    inputs = []
    with mode:
        for n in phs:
            v, w = old2[n.name], old3[n.name]
            if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(w.shape):
                v = torch.empty([line(a, b) for a, b in zip(v.shape, w.shape)], dtype=v.dtype, device=v.device)
            inputs.append(v)
        try:
            FakeTensorProp(two.gm, mode).propagate_dont_convert_inputs(*inputs)
        except Exception as e:  # noqa: BLE001 - any op that cannot run on one sample
            import re

            at = re.search(r"While executing %(\w+)", str(e))
            where = f" at node {at.group(1)}" if at else ""
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"micro-batches of one sample cannot run this model: it fails on one sample{where} "
                             f"({type(e).__name__}: {first}); use micro-batches of at least 2 samples (fewer "
                             f"micro-batches)") from e

    def shapes(v):
        return [tuple(int(d) for d in t.shape) for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]

    for n in nodes2:
        new, v, w = n.meta.get("val"), old2[n.name], old3[n.name]
        if n.op == "output":  # export leaves the output without a value
            if v is None:
                n.meta.pop("val", None)
            continue
        s1, s2, s3, sf = shapes(new), shapes(v), shapes(w), shapes(oldf[n.name])
        if not len(s1) == len(s2) == len(s3) == len(sf) or any(
                not len(a) == len(b) == len(c) == len(d) or list(a) != [line(x, y) for x, y in zip(b, c)]
                or not all(on_line(x, y, z) for x, y, z in zip(b, c, d))
                for a, b, c, d in zip(s1, s2, s3, sf)):
            raise refuse(n, f"has shape {s1} at one sample where its shapes at 2 and 3 samples ({s2}, {s3}) "
                            f"give {[[line(x, y) for x, y in zip(b, c)] for b, c in zip(s2, s3)]}")
        if s1 == s2:  # unchanged: keep export's value (its autograd flags)
            n.meta["val"] = v
            continue
        if isinstance(new, torch.Tensor) and isinstance(v, torch.Tensor):
            if v.requires_grad and new.is_floating_point() and not new.requires_grad:
                new.requires_grad_(True)
            n.meta["tensor_meta"] = _extract_tensor_metadata(new)
    return two


__all__ = ["couplings", "Coupling", "micro_check", "training_batch_norms", "target_counter", "TargetCounter", "loss_reduction", "microbatch_capture",
           "one_sample_capture"]
