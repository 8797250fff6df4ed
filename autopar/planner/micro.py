"""Pricing one micro-batch of a pipeline stage (``Config.micro_batches = m > 1``).

A pipelined step runs every stage ``m`` times on ``batch / m`` samples. What each run costs
(``autopar/runtime/pipeline.py`` runs the stage graph once per micro-batch, ``GradSync`` reduces
gradients once after the last one):

- an op that depends on the user inputs (its activations carry the batch) does ``1 / m`` of the
  FLOPs and bytes, and still costs at least ``Device.kernel_floor`` per forward and per backward;
  its in-op collectives move ``1 / m`` of the bytes and pay their full latency;
- an op on parameters alone (a weight's transpose, a mask from constants) runs whole every time;
- resharding an activation moves ``1 / m`` of its bytes, with every step's full latency;
- a parameter stored sharded is gathered whole in every micro-batch's forward and its gradient
  reduce-scattered in every backward (the gather's backward, part of the stage graph);
- a parameter stored replicated on some axes (all of them under DDP; the data-parallel ones beside
  a tensor-parallel shard) gets a Partial gradient there from split ops, summed once per step by
  ``GradSync``: in the per-micro-batch problem that bucketed sum is charged ``1 / m`` (so the ILP
  weighs it against ``m`` micro-batches of work), and its full seconds are kept in
  ``Built.step_edges`` for the pipeline's step time.

The micro-batch must also be runnable: every sharded dim of an activation must divide at the
micro-batch size (a micro-batch may be one sample: ``autopar.microbatch.one_sample_capture``). Which dims
carry the batch is not recorded in the graph; a dim whose global size is a multiple of the batch
is taken to (``(batch, seq, hidden)``, ``(batch * seq, hidden)``, ``(3, batch, heads, seq, d)``):
that is safe (a batch dim is always such a multiple) and at worst also checks a hidden dim that
happens to be one (it then must divide by ``m`` times the shard count).
"""
from __future__ import annotations

import numpy as np

from autopar import placement as pl
from autopar.lowering.graph import tensor_vals
from autopar.planner.build import _input_vals

def batch_size(gp) -> int | None:
    """The global batch: dim 0 of the first user input with a dim, or None."""
    from autopar.microbatch import batch_of

    return batch_of(gp.captured)


def smallest_micro_batch(gp) -> int:
    """The fewest samples a micro-batch of ``gp``'s model may have: 1, or 2 once the runtime's
    one-sample graph was refused for it (``autopar.plan``/``compile`` check a plan that has one,
    and plan again: ``planner.checked_plan``)."""
    return 2 if getattr(gp, "one_sample_refused", None) else 1


def microbatch_counts(batch: int | None, candidates, smallest: int = 1) -> list[int]:
    """The counts of ``candidates`` that cut ``batch`` into equal micro-batches the runtime can run
    (of at least ``smallest`` samples)."""
    if batch is None:
        return []
    return sorted({m for m in candidates if 1 <= m <= batch and batch % m == 0 and batch // m >= smallest})


def depends_on_inputs(gm, inputs: set[str]) -> set[str]:
    """Names of the nodes whose value depends on a user input (the inputs included)."""
    out = set()
    for node in gm.graph.nodes:
        if node.name in inputs or any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


class _Scaled:
    """A tensor's shape and dtype with ``1 / m`` of its bytes per element: what the resharding
    search needs to price one micro-batch (latencies in full, bytes ``/ m``)."""

    def __init__(self, t, m: int):
        self.shape, self.dtype, self._size = t.shape, t.dtype, t.element_size() / m
        self._grad = (t.grad_element_size() if hasattr(t, "grad_element_size") else t.element_size()) / m

    def element_size(self) -> float:
        return self._size

    def grad_element_size(self) -> float:
        return self._grad


_FITS: dict = {}
"""(strategy, ...) -> whether its placements divide at a micro-batch size (``Micro._fits``)."""


class Micro:
    """What runs per micro-batch and what once per step (see the module docstring)."""

    def __init__(self, gm, gp, cfg):
        m, batch = int(cfg.micro_batches), batch_size(gp)
        if batch is None:
            raise ValueError("micro-batching needs a user input with a batch dim (dim 0); this graph has none")
        if m < 1 or m > batch or batch % m:
            raise ValueError(f"micro_batches={m} does not cut the batch of {batch} into equal micro-batches; use a "
                             f"count in {microbatch_counts(batch, range(1, batch + 1))}")
        cap = gp.captured
        self.m, self.batch, self.mesh_shape = m, batch, tuple(cfg.mesh.shape)
        self.params = set(cap.params)
        self.scaled = depends_on_inputs(gm, set(cap.user_inputs))
        self.leader: dict[str, str] = {}
        self.step: dict[tuple[str, str], np.ndarray] = {}
        self._once: dict[int, np.ndarray] = {}   # id(edge matrix) -> its once-per-step part
        self._keep: list = []                    # keeps those ids alive

    # ------------------------------------------------------------------ ops
    def scale(self, name: str) -> float:
        """The share of the batch one run of node ``name`` sees."""
        return 1.0 / self.m if name in self.scaled else 1.0

    def shape(self, shape) -> tuple[int, ...]:
        """The micro-batch shape of an activation of global ``shape`` (batch dims divided by m)."""
        return tuple(d // self.m if d and d % self.batch == 0 else d for d in shape)

    def valid(self, strats: list, node) -> list:
        """The strategies of ``node`` whose placements still divide at the micro-batch size."""
        if node.name not in self.scaled:
            return strats
        ins = [(p.name in self.scaled, t) for p, t in zip(node.all_input_nodes, _input_vals(node))]
        outs = tensor_vals(node)
        flags = tuple(f for f, _ in ins)
        keep = [s for s in strats if self._fits(s, ins, outs, flags)]
        if strats and not keep:
            raise ValueError(f"no strategy of {node.name} divides a micro-batch of {self.batch // self.m} on mesh "
                             f"{self.mesh_shape}; use fewer micro-batches or a larger batch")
        return keep

    def _fits(self, s, ins, outs, flags) -> bool:
        # (shared by the builds of a planning: the strategy kept, its id keys it; the shapes read
        # are its node's, which the strategy cache keys it by)
        key = (id(s), flags, self.m, self.batch, self.mesh_shape)
        hit = _FITS.get(key)
        if hit is None:
            ok = all(pl.fits(self.shape(t.shape), p, self.mesh_shape) for t, p in zip(outs, s.outputs))
            ok = ok and all(p is None or not f or not hasattr(t, "shape") or
                            pl.fits(self.shape(t.shape), p, self.mesh_shape)
                            for (f, t), p in zip(ins, s.inputs))
            if len(_FITS) > 200_000:
                _FITS.clear()
            hit = _FITS[key] = (ok, s)
        return hit[0]

    # ------------------------------------------------------------------ edges
    def kind(self, name: str) -> str:
        """``"act"`` (carries the batch), ``"param"`` (a parameter or a view of one) or ``"const"``."""
        if name in self.scaled:
            return "act"
        return "param" if self.leader.get(name, name) in self.params else "const"

    def matrix(self, pricer, name: str, outs, ins, grads, t, param_uses: int = 0, unit_share: float = 1.0) -> np.ndarray:
        """The resharding matrix of an edge out of node ``name``, per micro-batch (``param_uses``,
        ``unit_share``: as ``_EdgePricer.matrix``'s, for a parameter's edge)."""
        kind = self.kind(name)
        if kind == "act":
            return pricer.matrix(outs, ins, grads, _Scaled(t, self.m), param_uses, unit_share)
        full = pricer.matrix(outs, ins, grads, t, param_uses, unit_share)
        if kind != "param":
            return full
        # The bucketed reduction of the gradient over the axes the parameter is stored replicated
        # on (all of them for DDP; dp beside a tensor-parallel shard) is GradSync's, once per step;
        # the rest of the edge (a sharded weight's gather and its gradient's reduce-scatter) runs
        # in every micro-batch.
        once = full - pricer.matrix(outs, ins, grads, t, param_uses, unit_share, bucket=False)
        if not once.any():
            return full
        out = full - once + once / self.m
        self._once[id(out)] = once
        self._keep.append(out)
        return out

    def once_of(self, m: np.ndarray) -> np.ndarray | None:
        """The once-per-step part of edge matrix ``m`` (None when it has none)."""
        return self._once.get(id(m))

    def remember_once(self, m: np.ndarray, once: np.ndarray) -> None:
        """Record ``once`` as edge matrix ``m``'s once-per-step part (a matrix another build
        priced: ``build.edges``)."""
        self._once[id(m)] = once
        self._keep.append(m)

    def note(self, src: str, dst: str, m: np.ndarray) -> None:
        """Record the once-per-step part of edge matrix ``m`` between leaders ``src`` and ``dst``."""
        once = self._once.get(id(m))
        if once is None:
            return
        key = (src, dst)
        part = np.diag(once) if src == dst else once
        self.step[key] = self.step[key] + part if key in self.step else part.copy()
