"""The sweep: every registered op x example shapes x every strategy on a 2x2 mesh, checked
against the unsharded op (values, input gradients, written inputs).

Examples come from the real nodes of the zoo models' captured graphs (with the values they take
in a real run) and from hand-made nodes for ops the zoo does not use. Strategies with in-op
collectives or rank-dependent code run under ``LocalTensorMode`` with the fake process group;
the others run rank by rank (see ``autopar.strategies.oracle``). ``KNOWN_FAILURES`` may only
shrink.
"""
from __future__ import annotations

import collections
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from autopar import zoo
from autopar.strategies import RunContext, registered_ops, strategies_for
from autopar.strategies import oracle as V
from autopar.strategies.dtensor import rule_for as dtensor_rule

aten = torch.ops.aten
MESH = (2, 2)

#: (case id, strategy name) pairs known to fail. This set may only shrink.
KNOWN_FAILURES: set[tuple[str, str]] = set()

#: Ops returning uninitialised memory: only local shapes are compared.
UNINITIALISED = {aten.empty.memory_format, aten.new_empty.default, aten.empty_like.default}

#: Long-tail ops served by DTensor's single-dim rules (autopar.strategies.dtensor), measured here.
DTENSOR_OPS = (aten.atan2.default, aten.lerp.Scalar, aten.addcmul.default, aten.hypot.default,
               aten.erfc.default, aten.log2.default, aten.xlogy.Tensor, aten.threshold.default,
               aten.sgn.default, aten.trunc.default)

Case = collections.namedtuple("Case", "id node values")


# ------------------------------------------------------------------------------ zoo examples
def _record(cap, ex):
    """Every node's value in one real run of the captured graph."""
    flat = cap.ep._graph_module_flat_inputs((ex.args, ex.kwargs, ex.target), {})
    interp = fx.Interpreter(cap.gm, garbage_collect_values=False)
    interp.run(*flat)
    return interp.env


def _numel(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (list, tuple)):
        return sum(_numel(x) for x in v)
    return 0


@functools.lru_cache(maxsize=1)
def zoo_cases(per_op: int = 3) -> dict[str, list[Case]]:
    """Up to ``per_op`` distinct examples per op (smallest first, taking turns between models)."""
    from profiler.capture import capture

    by_model: dict[str, dict[str, list]] = {}
    for name in zoo.ZOO:
        ex = zoo.build(name, batch=4)
        cap = capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        env = _record(cap, ex)
        ops: dict[str, list] = collections.defaultdict(list)
        for n in cap.gm.graph.nodes:
            if n.op == "call_function":
                vals = [env[m] for m in n.all_input_nodes]
                ops[str(n.target)].append((_numel(vals), Case(f"{name}:{n.name}", n, vals)))
        by_model[name] = ops
    out: dict[str, list[Case]] = collections.defaultdict(list)
    seen = set()
    for op in sorted({op for ops in by_model.values() for op in ops}):
        queues = [sorted(by_model[m].get(op, []), key=lambda x: x[0]) for m in zoo.ZOO]
        while len(out[op]) < per_op and any(queues):
            for q in queues:
                while q and len(out[op]) < per_op:
                    case = q.pop(0)[1]
                    key = _signature(case.node)
                    if key not in seen:
                        seen.add(key)
                        out[op].append(case)
                        break
    return out


def _signature(node):
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            return (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else "node"
        return repr(a)
    return (str(node.target), tuple(sig(a) for a in node.args), tuple(sorted((k, sig(v)) for k, v in node.kwargs.items())))


# ------------------------------------------------------------------------------ hand-made nodes
def make_case(case_id: str, op, args: tuple, kwargs: dict | None = None, nograd: tuple = ()) -> Case:
    """A one-op fx graph whose tensor arguments are placeholders (see ``validate.one_op_node``)."""
    node, values = V.one_op_node(op, args, kwargs, nograd)
    return Case(case_id, node, values)


_GEN = torch.Generator().manual_seed(7)


def rnd(*shape, low=None):
    t = torch.randn(shape, generator=_GEN)
    return t.abs() + low if low is not None else t


def ints(high, *shape):
    return torch.randint(0, high, shape, generator=_GEN)


def mask(*shape):
    return torch.rand(shape, generator=_GEN) > 0.5


POSITIVE = {aten.log.default, aten.log1p.default, aten.sqrt.default, aten.rsqrt.default, aten.reciprocal.default,
            aten.pow.Tensor_Tensor, aten.log2.default, aten.xlogy.Tensor}
BOOLEAN = {aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
           aten.bitwise_not.default, aten.logical_and.default, aten.logical_or.default,
           aten.logical_not.default, aten.any.dim, aten.all.dim}


def pointwise_case(op) -> Case:
    """Arguments from the schema: a (4, 6) tensor, a broadcast (6,) second tensor, scalars."""
    args, tensors = [], 0
    for a in op._schema.arguments:
        if a.kwarg_only:
            break
        typ = str(a.type)
        if typ.startswith("Tensor"):
            shape = (4, 6) if tensors == 0 else (6,)
            t = mask(*shape) if op in BOOLEAN else rnd(*shape, low=0.5 if op in POSITIVE else None)
            args.append(t)
            tensors += 1
        elif typ in ("Scalar", "number"):
            args.append(0.5)
        elif a.has_default_value():
            break
        else:
            raise ValueError(f"no generic example for {op} argument {a.name}: {typ}")
    return make_case(f"hand:{op}", op, tuple(args))


def _pointwise_examples(x3, x4) -> list:
    """Pointwise ops whose arguments the schema alone does not give."""
    return [
        # pointwise with special arguments
        (aten.masked_fill.Scalar, (rnd(4, 6), mask(6), -1.0)),
        (aten.masked_fill.Tensor, (rnd(4, 6), mask(4, 1), torch.tensor(2.0))),
        (aten.masked_fill_.Scalar, (rnd(4, 6), mask(4, 6), 0.0)),
        (aten.where.self, (mask(4, 6), rnd(4, 6), rnd(6))),
        (aten.where.ScalarOther, (mask(4, 6), rnd(6), 0.5)),
        (aten.where.ScalarSelf, (mask(6), -2.0, rnd(4, 6))),
        (aten.clamp.default, (rnd(4, 6), -0.5, 0.5)),
        (aten.pow.Tensor_Scalar, (rnd(4, 6), 2)),
        (aten.div.Tensor_mode, (rnd(4, 6), rnd(6, low=0.5)), {"rounding_mode": "floor"}),
        (aten.to.dtype, (rnd(4, 6), torch.float64)),
        (aten.to.dtype_layout, (rnd(4, 6),), {"dtype": torch.float64, "layout": torch.strided, "device": "cpu"}),
        (aten.to.device, (rnd(4, 6), "cpu", torch.float32)),
        (aten._to_copy.default, (rnd(4, 6),), {"dtype": torch.float64}),
        (aten.type_as.default, (rnd(4, 6), rnd(2))),
        (aten.copy_.default, (rnd(4, 6), rnd(6))),
        (aten.fill_.Scalar, (rnd(4, 6), 1.5)),
        (aten.fill_.Tensor, (rnd(4, 6), torch.tensor(1.5))),
        (aten.dropout.default, (x3, 0.0, True)),
        (aten.native_dropout.default, (x3, 0.0, True)),
        (aten.softmax.int, (x3, 1)), (aten._softmax.default, (x3, -1, False)),
        (aten.log_softmax.int, (x3, 2)), (aten._log_softmax.default, (x3, 1, False)),
        (aten._safe_softmax.default, (x3, -1)),
    ]

def _reduction_view_examples(x3, x4) -> list:
    """Reductions, scans and views of a (4, 6, 8) tensor."""
    return [
        # reductions
        (aten.sum.default, (x3,)), (aten.sum.dim_IntList, (x3, [1], False)), (aten.mean.default, (x3,)),
        (aten.mean.dim, (x3, [0, 2], True)), (aten.amax.default, (x3, [1])), (aten.amin.default, (x3, [2], True)),
        (aten.max.dim, (x3, 1)), (aten.min.dim, (x3, 2, True)), (aten.argmax.default, (x3, 1)),
        (aten.argmin.default, (x3, 0)), (aten.var.correction, (x3, [1])), (aten.std.correction, (x3, [2])),
        (aten.var_mean.correction, (x3, [1])), (aten.any.dim, (mask(4, 6, 8), 1)), (aten.all.dim, (mask(4, 6, 8), 2)),
        (aten.logsumexp.default, (x3, [1])), (aten.prod.dim_int, (rnd(4, 6, 8, low=0.5), 1)),
        (aten.cumsum.default, (x3, 1)), (aten.cumprod.default, (rnd(4, 6, 8, low=0.5), 2)),
        (aten.cummax.default, (x3, 1)), (aten.cummin.default, (x3, 0)),
        # views
        (aten.view.default, (x3, [4, 48])), (aten.reshape.default, (x3, [24, 8])),
        (aten._unsafe_view.default, (rnd(4, 2, 4, 8), [4, 8, 8])), (aten.flatten.using_ints, (x4, 1)),
        (aten.unflatten.int, (rnd(4, 48), 1, [6, 8])), (aten.transpose.int, (x3, 0, 2)), (aten.t.default, (rnd(4, 6),)),
        (aten.permute.default, (x3, [2, 0, 1])), (aten.movedim.int, (x3, 0, 2)), (aten.unsqueeze.default, (x3, 1)),
        (aten.squeeze.dim, (rnd(4, 1, 8), 1)), (aten.squeeze.dims, (rnd(4, 1, 8), [1])),
        (aten.squeeze.default, (rnd(4, 1, 8),)), (aten.expand.default, (rnd(4, 1, 8), [4, 6, 8])),
        (aten.expand.default, (rnd(6, 8), [4, 6, 8])),
    ]

def _index_matmul_examples(x3, x4) -> list:
    """Slicing, joining, indexing and matrix products."""
    return [
        # slicing, joining, indexing
        (aten.slice.Tensor, (x3, 1, 0, 3)), (aten.narrow.default, (x3, 2, 1, 4)), (aten.split.Tensor, (x3, 2, 1)),
        (aten.split_with_sizes.default, (x3, [2, 4], 1)), (aten.chunk.default, (x3, 2, 2)), (aten.select.int, (x3, 1, 2)),
        (aten.unbind.int, (x3, 1)), (aten.cat.default, ([x3, rnd(4, 2, 8)], 1)), (aten.stack.default, ([x3, x3 * 2], 1)),
        (aten.index.Tensor, (x3, [ints(4, 5)])), (aten.index_select.default, (x3, 1, ints(6, 4))),
        (aten.gather.default, (x3, 2, ints(8, 4, 6, 2))), (aten.pad.default, (x3, [1, 1])),
        (aten.constant_pad_nd.default, (x3, [0, 0, 1, 2], 0.0)), (aten.diff.default, (x3, 1, 1)),
        (aten.repeat.default, (x3, [1, 2, 1])), (aten.flip.default, (x3, [1])), (aten.tril.default, (rnd(4, 6, 6),)),
        (aten.triu.default, (rnd(4, 6, 6), 1)),
        # matrix products
        (aten.linear.default, (x3, rnd(4, 8), rnd(4))), (aten.linear.default, (rnd(4, 8), rnd(6, 8))),
        (aten.addmm.default, (rnd(6), rnd(4, 8), rnd(8, 6))), (aten.mm.default, (rnd(4, 8), rnd(8, 6))),
        (aten.bmm.default, (x3, rnd(4, 8, 2))), (aten.baddbmm.default, (rnd(4, 6, 2), x3, rnd(4, 8, 2))),
        (aten.matmul.default, (x3, rnd(8, 4))), (aten.matmul.default, (rnd(8), rnd(4, 8, 6))),
        (aten.matmul.default, (rnd(2, 1, 6, 8), rnd(2, 4, 8, 4))), (aten.einsum.default, ("bik,bkj->bij", [x3, rnd(4, 8, 2)])),
    ]

def _nn_examples(x3, x4) -> list:
    """Norms, convolutions, pooling, embedding, attention and losses."""
    return [
        # norms, convolutions, pooling
        (aten.layer_norm.default, (x3, [8], rnd(8), rnd(8), 1e-5)), (aten.layer_norm.default, (x3, [6, 8])),
        (aten.rms_norm.default, (x3, [8], rnd(8), 1e-6)), (aten.group_norm.default, (x4, 2, rnd(6), rnd(6))),
        (aten.conv1d.default, (x3, rnd(4, 6, 3), rnd(4))), (aten.conv2d.default, (x4, rnd(8, 3, 3, 3), None, [1, 1], [1, 1], [1, 1], 2)),
        (aten.conv2d.default, (x4, rnd(6, 1, 3, 3), rnd(6), [1, 1], [1, 1], [1, 1], 6)),
        (aten.conv3d.default, (rnd(2, 4, 4, 4, 4), rnd(2, 4, 2, 2, 2))),
        (aten.convolution.default, (x4, rnd(4, 6, 2, 2), rnd(4), [1, 1], [0, 0], [1, 1], False, [0, 0], 1)),
        (aten.max_pool1d.default, (x3, [2])), (aten.max_pool2d.default, (x4, [2, 2])), (aten.max_pool3d.default, (rnd(2, 4, 4, 4, 4), [2])),
        (aten.max_pool2d_with_indices.default, (x4, [2, 2])), (aten.max_pool3d_with_indices.default, (rnd(2, 4, 4, 4, 4), [2])),
        (aten.avg_pool1d.default, (x3, [2])), (aten.avg_pool2d.default, (x4, [2, 2])), (aten.avg_pool3d.default, (rnd(2, 4, 4, 4, 4), [2])),
        (aten.adaptive_avg_pool1d.default, (x3, [2])), (aten.adaptive_avg_pool2d.default, (x4, [1, 1])),
        (aten.adaptive_avg_pool3d.default, (rnd(2, 4, 4, 4, 4), [2, 2, 2])), (aten._adaptive_avg_pool2d.default, (x4, [2, 2])),
        (aten._adaptive_avg_pool3d.default, (rnd(2, 4, 4, 4, 4), [1, 1, 1])), (aten.adaptive_max_pool1d.default, (x3, [2])),
        (aten.adaptive_max_pool2d.default, (x4, [2, 2])), (aten.adaptive_max_pool3d.default, (rnd(2, 4, 4, 4, 4), [2, 2, 2])),
        # embedding, attention, losses
        (aten.embedding.default, (rnd(8, 6), ints(8, 4, 4), 0)),
        (aten.scaled_dot_product_attention.default, (rnd(4, 2, 6, 4), rnd(4, 2, 6, 4), rnd(4, 2, 6, 4)), {"is_causal": True}),
        (aten.scaled_dot_product_attention.default, (rnd(4, 4, 6, 4), rnd(4, 2, 6, 4), rnd(4, 2, 6, 4), rnd(6, 6)), {"enable_gqa": True}),
        (aten.cross_entropy_loss.default, (rnd(8, 6), torch.tensor([0, 5, -100, 2, 3, -100, 1, 4]))),
        (aten.cross_entropy_loss.default, (rnd(8, 6), ints(6, 8), None, 2)),
        (aten.cross_entropy_loss.default, (rnd(8, 6), ints(6, 8), None, 0, -100, 0.1)),
        (aten.cross_entropy_loss.default, (rnd(4, 6, 4), ints(6, 4, 4), rnd(6, low=0.5)), {}, (2,)),
        (aten.mse_loss.default, (x3, rnd(4, 6, 8))), (aten.mse_loss.default, (x3, rnd(4, 6, 8), 2)),
    ]

def _factory_examples(x3, x4) -> list:
    """Factories and graph plumbing."""
    return [
        # factories
        (aten.arange.default, (8,)), (aten.arange.start, (2, 10)), (aten.arange.start_step, (0.5, 4.5, 0.5)),
        (aten.ones.default, ([4, 6],)), (aten.zeros.default, ([4, 6],)), (aten.full.default, ([4, 6], 2.0)),
        (aten.empty.memory_format, ([4, 6],)), (aten.new_ones.default, (x3, [4, 6])), (aten.new_zeros.default, (x3, [4, 2])),
        (aten.new_full.default, (x3, [4, 6], 3.0)), (aten.new_empty.default, (x3, [4, 6])), (aten.zeros_like.default, (x3,)),
        (aten.ones_like.default, (x3,)), (aten.full_like.default, (x3, 2.0)), (aten.empty_like.default, (x3,)),
        (aten.scalar_tensor.default, (3.0,)), (aten.rand.default, ([4, 6],)), (aten.randn.default, ([4, 6],)),
        (aten.randint.default, (5, [4, 6])), (aten.randint.low, (1, 5, [4, 6])), (aten.randperm.default, (6,)),
        (aten.rand_like.default, (x3,)), (aten.randn_like.default, (x3,)), (aten.bernoulli.p, (x3, 0.5), {}, (0,)),
        (aten.bernoulli.default, (rnd(4, 6).sigmoid(),), {}, (0,)),
        # graph plumbing
        (aten._assert_tensor_metadata.default, (x3,), {"dtype": torch.float32}),
        (aten._assert_scalar.default, (True, "ok")), (aten.sym_constrain_range_for_size.default, (3,)),
        (aten.sym_size.int, (x3, 1)), (aten.sym_numel.default, (x3,)), (aten._assert_async.msg, (torch.tensor(True), "ok")),
    ]

def _routing_examples(x3, x4) -> list:
    """Mixture-of-experts routing: top-k, sorts, histograms, one-hot, gathers and scatters,
    grouped matmuls (autopar.strategies.routing)."""
    rows = torch.stack([torch.randperm(6, generator=_GEN)[:3] for _ in range(4)])  # (4, 3), no repeats per row
    return [
        (aten.topk.default, (x3, 3)), (aten.topk.default, (x3, 2, 1, False)),
        (aten.sort.default, (x3, 1)), (aten.sort.stable, (x3,), {"stable": True, "dim": -1, "descending": True}),
        (aten.argsort.default, (x3, 0)), (aten.argsort.stable, (x3,), {"stable": True, "dim": 1}),
        (aten.one_hot.default, (ints(4, 4, 6), 4)),
        (aten.floor_divide.default, (ints(20, 4, 6), ints(3, 6) + 1)), (aten.floor_divide.Scalar, (ints(20, 4, 6), 3)),
        (aten.repeat_interleave.self_int, (x3, 2, 1)), (aten.repeat_interleave.self_int, (x3, 3, 0), {"output_size": 12}),
        (aten.repeat_interleave.self_int, (rnd(4, 6), 2)),
        (aten.histc.default, (rnd(4, 6), 6, -1.5, 1.5), {}, (0,)), (aten.histc.default, (rnd(8), 4), {}, (0,)),
        (aten.index.Tensor, (x3, [None, ints(6, 5)])), (aten.index.Tensor, (x3, [ints(4, 2, 4), None, ints(8, 4)])),
        (aten.index.Tensor, (x3, [None, ints(6, 4, 1), ints(8, 2)])), (aten.index.Tensor, (x3, [torch.tensor([-1, 0, 3, -4])])),
        (aten.index_add.default, (rnd(6, 8), 0, ints(6, 4), rnd(4, 8))),
        (aten.index_add.default, (x3, 1, ints(6, 8), rnd(4, 8, 8)), {"alpha": 0.5}),
        (aten.index_add_.default, (rnd(6, 8), 0, ints(6, 4), rnd(4, 8))),
        (aten.scatter_add.default, (rnd(4, 6), 1, ints(6, 4, 4), rnd(4, 4))),
        (aten.scatter_add.default, (rnd(6, 4), 0, ints(6, 4, 4), rnd(4, 4))),
        (aten.scatter_add_.default, (rnd(4, 6), 1, ints(6, 4, 4), rnd(4, 4))),
        (aten.scatter.src, (rnd(4, 6), 1, rows, rnd(4, 3))), (aten.scatter.value, (rnd(4, 6), 1, rows, 2.0)),
        (aten.scatter_.src, (rnd(4, 6), 1, rows, rnd(4, 3))), (aten.scatter_.value, (rnd(4, 6), 1, rows, 2.0)),
    ]


def _grouped_mm_cases() -> list[Case]:
    """torch._grouped_mm: its fake kernel takes bfloat16 only (the CUDA kernel's dtypes) and its
    CPU kernel float32 too, so the node is made in bfloat16 and checked in float32. Rows and
    columns of 16 floats: the CPU kernel wants 16-byte strides, also on quarter shards."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    offs = torch.tensor([3, 8, 8, 16], dtype=torch.int32)  # 4 groups of 16 rows, one empty
    cases = []
    for k, args in enumerate([(rnd(16, 16), rnd(4, 16, 16), offs), (rnd(4, 8, 16), rnd(4, 16, 16))]):
        low = tuple(a.bfloat16() if a.is_floating_point() else a for a in args)
        node, _ = V.one_op_node(aten._grouped_mm.default, low)
        mode = FakeTensorMode()
        for ph, a in zip(node.all_input_nodes, args):
            ph.meta["val"] = mode.from_tensor(a.detach().clone().requires_grad_(a.is_floating_point()))
        node.meta["val"] = mode.from_tensor(aten._grouped_mm.default(*args))
        cases.append(Case(f"hand:grouped_mm{k}", node, [a.detach() for a in args]))
    return cases

def hand_cases() -> dict[str, list[Case]]:
    """``(op, args[, kwargs[, nograd]])`` examples, then generic ones for the pointwise tables."""
    x3, x4 = rnd(4, 6, 8), rnd(4, 6, 4, 4)
    examples = []
    for part in (_pointwise_examples, _reduction_view_examples, _index_matmul_examples, _nn_examples,
                 _factory_examples, _routing_examples):
        examples += part(x3, x4)
    out: dict[str, list[Case]] = collections.defaultdict(list)
    for k, item in enumerate(examples):
        op, args = item[0], item[1]
        kwargs = item[2] if len(item) > 2 else {}
        nograd = item[3] if len(item) > 3 else ()
        out[str(op)].append(make_case(f"hand{k}:{op}", op, args, kwargs, nograd))
    out[str(aten.batch_norm.default)].append(make_case(
        "hand:batch_norm", aten.batch_norm.default, (x4, rnd(6), rnd(6), torch.zeros(6), torch.ones(6), True, 0.1, 1e-5, False),
        nograd=(3, 4)))
    out[str(aten._grouped_mm.default)] += _grouped_mm_cases()
    for op in list(_generic_ops()) + list(DTENSOR_OPS):
        if str(op) not in out:
            out[str(op)].append(pointwise_case(op))
    return out


def _generic_ops():
    from autopar.strategies import pointwise

    yield from pointwise.LINEAR
    yield from pointwise.NONLINEAR


@functools.lru_cache(maxsize=1)
def all_cases() -> dict[str, list[Case]]:
    cases = collections.defaultdict(list)
    for src in (zoo_cases(), hand_cases()):
        for op, cs in src.items():
            cases[op].extend(cs)
    return cases


# ------------------------------------------------------------------------------ the sweep
@pytest.fixture(scope="module")
def sim():
    """Fake process group of 4 ranks, a 2x2 DeviceMesh and a LocalTensorMode over it."""
    dist.init_process_group("fake", rank=0, world_size=math.prod(MESH), store=FakeStore())
    try:
        dm = init_device_mesh("cpu", MESH, mesh_dim_names=("a", "b"))
        yield RunContext(device_mesh=dm), LocalTensorMode(math.prod(MESH))
    finally:
        dist.destroy_process_group()


def _sweep_ops() -> list[str]:
    return sorted({str(op) for op in registered_ops()} | {str(op) for op in DTENSOR_OPS})


@pytest.mark.parametrize("op", _sweep_ops())
def test_every_strategy_matches_the_unsharded_op(op, sim):
    ctx, lm = sim
    cases = all_cases().get(op)
    assert cases, f"no example for {op}: add one to hand_cases()"
    failures, checked = {}, 0
    for case in cases:
        if case.node.op == "call_function" and op in map(str, DTENSOR_OPS):
            assert dtensor_rule(case.node.target) is not None, f"{op} is not served by DTensor's rules"
        gen = torch.Generator().manual_seed(0)
        ref = V.reference(case.node, case.values, gen)
        for st in strategies_for(case.node, MESH):
            checked += 1
            try:
                V.check(case.node, st, case.values, ref, ctx, lm, gen, loop=not V.needs_simulation(case.node, st),
                        compare_values=case.node.target not in UNINITIALISED)
            except Exception as e:  # every failure is reported, not just the first
                failures[(case.id, st.name)] = f"{type(e).__name__}: {str(e)[:300]}"
    new = {k: v for k, v in failures.items() if k not in KNOWN_FAILURES}
    assert not new, f"{len(new)} of {checked} strategy checks fail:\n" + "\n".join(
        f"  {cid} [{name}]: {msg}" for (cid, name), msg in sorted(new.items())[:20])


def test_known_failures_only_shrink():
    # Every listed failure must name an existing example (stale entries are removed).
    ids = {c.id for cs in all_cases().values() for c in cs}
    assert {cid for cid, _ in KNOWN_FAILURES} <= ids
