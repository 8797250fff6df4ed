"""Peak memory of a pipelined plan, per rank of the pipeline axis (``Plan.peak_bytes``).

``autopar.runtime.pipeline`` runs each stage's part of the per-rank graph once per micro-batch
under ``torch.distributed.pipelining``'s schedule. :func:`pipeline_peaks` replays that with the
profiler's liveness walk (``profiler.memory``'s forward and backward passes, one micro-batch
copy of the stage's step nodes at a time, in the schedule's order) on the sizes of
``autopar.planner.peak.rank_peak`` divided by the micro-batch count where an op carries the
batch. What one rank holds is listed at :func:`_rank_replay`; it was measured with
``autopar.runtime.live_memory.LiveMemory`` on 4 gloo processes (``tests/dist/test_train.py``).
"""
from __future__ import annotations

import dataclasses

from autopar.lowering import GRAD_BUCKET_BYTES
from autopar.lowering.graph import tensor_vals
from autopar.planner.peak import (_buckets, _chunked, _Ctx, _insert_copies, _local, _placeholders, _regions,
                                  _scaled_node, lower_choice)
from profiler.memory import step_replace


def _micro(n, m: int):
    """Step node ``n`` at ``1 / m`` of the batch (an op on activations: its bytes scale; a
    parameter's 16-bit copy does not)."""
    return step_replace(n, storages={k: b if k in n.param_copies else b // m for k, b in n.storages.items()},
                               fwd_alloc=n.fwd_alloc // m,
                               bwd_alloc=n.bwd_alloc // m, fwd_max_op=n.fwd_max_op // m,
                               bwd_max_op=n.bwd_max_op // m, grad_bytes=n.grad_bytes // m)


def _renamed(nodes: list, i: int, fixed) -> list:
    """Micro-batch ``i``'s copy of the stage's step nodes (names outside the stage's own nodes,
    ``fixed``, keep theirs: state and received values are shared by the micro-batches)."""
    def r(x):
        return x if x in fixed else f"{x}#{i}"

    def rk(k):
        return (r(k[0]), k[1])

    return [step_replace(n, name=r(n.name), storages={rk(k): b for k, b in n.storages.items()},
                                float_size={rk(k): v for k, v in n.float_size.items()},
                                out_keys=[rk(k) for k in n.out_keys], saved=[rk(k) for k in n.saved],
                                param_copies={rk(k): v for k, v in n.param_copies.items()},
                                inputs=[r(a) for a in n.inputs], users=[r(u) for u in n.users]) for n in nodes]


def _actions(schedule: str, p: int, stage: int, m: int) -> list[tuple[str, int]]:
    """Forward/backward order of one stage's micro-batches, as ``torch.distributed.pipelining``
    runs them: GPipe all forwards then all backwards; 1F1B ``min(m, p - stage)`` forwards
    (``Schedule1F1B``'s warm-up), then one backward and one forward in turn."""
    if schedule != "1f1b":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, p - stage)
    out, f = [("F", i) for i in range(warm)], warm
    for b in range(m):
        out.append(("B", b))
        if f < m:
            out.append(("F", f))
            f += 1
    return out


def _stage_of(steps: list, plan_stage: dict) -> dict[str, int]:
    """Stage of every step node: the plan's, a reshard copy its consumer's, others their inputs';
    never before an input's (``autopar.runtime.pipeline`` cuts the graph the same way)."""
    out: dict[str, int] = {}
    for n in steps:
        owner = n.name if n.name in plan_stage else (n.users[0] if n.users and "->" in n.name else None)
        ins = [out[a] for a in n.inputs if a in out]
        out[n.name] = max([plan_stage.get(owner, 0)] + ins)
    return out


def _received(steps: list, stage_of: dict, placeholders, n_stages: int) -> list[list[str]]:
    """Per stage, the values it receives from the stage before (``split_stages``: what it or a
    later stage reads and no stage from it on defines; user inputs are passed along)."""
    needs = [set() for _ in range(n_stages)]
    for n in steps:
        s = stage_of[n.name]
        for a in n.inputs:
            ph = placeholders.get(a)
            if (ph is not None and ph.kind == "input") or (ph is None and a in stage_of and stage_of[a] != s):
                needs[s].add(a)
    defined = [{n.name for n in steps if stage_of[n.name] == s} for s in range(n_stages)]
    recv = [set() for _ in range(n_stages)]
    for s in range(n_stages - 1, 0, -1):
        later = recv[s + 1] if s + 1 < n_stages else set()
        recv[s] = needs[s] | (later - defined[s])
    return [sorted(r) for r in recv]


def pipeline_peaks(gp, strategy_of: dict, mesh, pipeline, *, recompute=frozenset(), optimizer: str = "adamw",
                   dtype: str = "float32", foreach: bool | None = None, bucket_bytes: int = GRAD_BUCKET_BYTES,
                   chunks: dict | None = None, stop_above: float | None = None, zero=None) -> list:
    """Per rank of the pipeline axis, the ``profiler.memory.MemoryEstimate`` of one pipelined
    step (``pipeline``: an ``autopar.plan.Pipeline``; ``mesh``: the sharding sub-mesh the
    placements of ``strategy_of`` refer to; ``recompute`` and ``chunks`` as for ``rank_peak``).
    See :func:`_rank_replay` for what is replayed. ``stop_above``: stop after the first rank
    whose peak exceeds it (a budget check needs no more; the list is then shorter)."""
    from autopar.planner.micro import depends_on_inputs

    ctx = _Ctx(gp, strategy_of, mesh, zero, dtype)
    m, cap = int(pipeline.microbatches), gp.captured
    scaled = depends_on_inputs(cap.gm, set(cap.user_inputs))
    base = gp.step_nodes("bf16-mixed" if dtype == "bf16-mixed" else "fp32")
    chunks, rec = chunks or {}, set(recompute)
    plan_stage = {n: k for k, st in enumerate(pipeline.stages) for n in st}
    lowered = lower_choice(ctx, recompute, chunks, stages=plan_stage, bucket_bytes=bucket_bytes)
    steps = _insert_copies(ctx, [_chunked(ctx, _scaled_node(ctx, n), chunks.get(n.name, 1), n.name in rec)
                                 for n in base], gp._placeholders, lowered)
    steps = [_micro(n, m) if (n.name if n.name in ctx.nodes else n.inputs[0]) in scaled else n for n in steps]
    placeholders = _placeholders(ctx, gp._placeholders, lowered)
    placeholders = {k: dataclasses.replace(ph, nbytes=ph.nbytes // m) if ph.kind == "input" else ph
                    for k, ph in placeholders.items()}
    stage_of = _stage_of(steps, plan_stage)
    n_stages = len(pipeline.stages)
    regions = []
    for r in _regions(steps, lowered):
        for s in sorted({stage_of[x] for x in r}):  # a region never crosses a stage boundary
            regions.append([x for x in r if stage_of[x] == s])
    uses: dict[str, set] = {}
    for n in steps:
        for a in n.inputs:
            if a in placeholders and placeholders[a].kind == "param":
                uses.setdefault(a, set()).add(stage_of[n.name])
    from autopar.planner.peak import _gathered_early

    world = dict(steps=steps, placeholders=placeholders, stage_of=stage_of, regions=regions, m=m,
                 early=_gathered_early(regions, lowered),
                 received=_received(steps, stage_of, placeholders, n_stages), loss=cap.loss_node.name,
                 shared={a for a, st in uses.items() if len(st) > 1}, ctx=ctx, scaled=scaled,
                 bucketed={a for b in _buckets(lowered, placeholders) for a in b})
    p = n_stages // max(1, int(pipeline.virtual_stages or 1))  # ranks along the pipeline axis
    if foreach is None:
        foreach = getattr(mesh, "cluster", "cpu") != "cpu"
    schedule = pipeline.schedule if p == n_stages else "gpipe"  # interleaved: every micro-batch in flight
    out = []
    for d in range(p):  # rank 0 first: under 1F1B it holds the most micro-batches in flight
        out.append(_rank_replay(world, [s for s in range(n_stages) if s % p == d], schedule, p, optimizer, foreach))
        if stop_above is not None and out[-1].peak > stop_above:
            break
    return out


def _value_bytes(world, name: str) -> int:
    """Local bytes of one micro-batch of value ``name`` (a node's outputs, or a user input)."""
    ph = world["placeholders"].get(name)
    if ph is not None:
        return ph.nbytes
    ctx = world["ctx"]
    node = ctx.nodes.get(name)
    if node is None:
        return 0
    total = sum(_local(t, ctx.out_pl(name, i), ctx.shape) for i, t in enumerate(tensor_vals(node)))
    return total // world["m"] if name in world["scaled"] else total


def _rank_replay(world, local: list[int], schedule: str, p: int, optimizer: str, foreach: bool):
    """One rank of the pipeline axis running stages ``local`` (``autopar.runtime.pipeline``):

    - resident: the parameters its stages read and those read by several stages (the runtime
      holds them on every rank and gives them a gradient there), with their gradients and AdamW
      state; every buffer of the model;
    - ``PipelineStage``'s buffers: the values received from the stage before and the gradients
      received for the values sent on, one set per micro-batch, or under 1F1B one per micro-batch
      in flight, shared in turn (``solver.pipeline.in_flight``, as ``runtime.pipeline`` shares
      them); the gradients of the received
      values are held by their sends: under 1F1B until the next micro-batch's receive (the
      schedule waits for the send there), else until the end of the schedule;
    - the stage's micro-batches forward and backward in the schedule's order, each a replay of
      the stage's step nodes at ``1 / m`` of the batch; the values sent on are kept until their
      micro-batch's backward; gradients accumulate in place after the first backward;
    - then ``GradSync.finish``: every Partial gradient flattened into its bucket at once; then
      the optimizer's transient.
    """
    from profiler.memory import MemoryEstimate, Placeholder, ReplayState, Sizer, optimizer_transient, static_bytes

    m, size, places = world["m"], Sizer("fp32"), world["placeholders"]
    mine = [n for n in world["steps"] if world["stage_of"][n.name] in local]
    names = {n.name for n in mine}
    used = {a for n in mine for a in n.inputs if a in places}
    ph = {}
    for a, x in places.items():
        if x.kind == "param":  # the runtime drops parameters of other stages (numel-0 placeholders)
            if a in used or a in world["shared"]:
                ph[a] = x
        elif x.kind != "input" or 0 in local:
            ph[a] = x
    by_name = {n.name: n for n in world["steps"]}
    recv = [v for s in local if s > 0 for v in world["received"][s] if v not in names]
    import solver

    n_stages = len(world["received"])
    one_each = schedule == "1f1b" and len(local) == 1  # buffer sets: one per micro-batch in flight
    sets = int(solver.pipeline.in_flight("1f1b", n_stages, m)[local[0]]) if one_each else m
    grad_in = 0  # bytes of the received values' gradients, per micro-batch
    for v in recv:
        ph[v] = Placeholder(nbytes=sets * _value_bytes(world, v), float_size=0, kind="input")
        if v in by_name and by_name[v].grad_bytes:
            grad_in += _value_bytes(world, v)
    sent = [v for s in local if s + 1 < len(world["received"]) for v in world["received"][s + 1] if v in names]
    for v in sent:
        if by_name[v].grad_bytes:
            ph[f"grad:{v}"] = Placeholder(nbytes=sets * _value_bytes(world, v), float_size=0, kind="input")
    if sent and mine:  # the schedule keeps what it sent until that micro-batch's backward
        keep = [k for v in sent for k in by_name[v].out_keys]
        mine = [step_replace(mine[0], saved=list(mine[0].saved) + keep)] + mine[1:]
    regions = [r for r in world["regions"] if r[0] in names]
    early = {at: xs for at, xs in world["early"].items() if at in names}
    state = ReplayState(static=static_bytes(ph, size, optimizer))
    # The gradient buckets of data parallelism are kept from one step to the next (each gradient
    # copied into its slot once its last micro-batch has added to it: GradSync.accumulate); a
    # ZeRO-1/2 parameter's is flattened when the schedule is done and freed after its reduction.
    bucketed = [x for a, x in ph.items() if x.kind == "param" and a in world["bucketed"]]
    state.grads += sum(x.nbytes for x in bucketed if x.state_share == 1)
    loss = world["loss"] if world["loss"] in names else ""
    _run_schedule(state, mine, ph, regions, loss, (schedule, p, local[0], m), grad_in, size, early)
    # GradSync.finish: gradients of parameters read by no local stage arrive as zeros
    state.grads += sum(x.nbytes for a, x in ph.items() if x.kind == "param" and a not in used)
    state.observe("backward", "grad_sync", sum(x.nbytes for x in bucketed if x.state_share < 1))
    state.observe("optimizer", "optimizer.step", optimizer_transient(ph, size, optimizer, foreach))
    best, st = state.best, state.static
    return MemoryEstimate(peak=best["total"], phase=best["phase"], node=best["node"], params=st["params"],
                          buffers=st["buffers"], inputs=st["inputs"], grads=best["grads"],
                          optimizer_state=st["optimizer"], activations=best["acts"], activations_end_of_forward=0)


def _run_schedule(state, mine: list, ph: dict, regions: list, loss: str, sched: tuple, grad_in: int, size,
                  early: dict | None = None) -> None:
    """The stage's micro-batches through ``state`` in the schedule's order (``sched``: schedule,
    pipeline ranks, stage, micro-batches). The micro-batches are identical, so not all of them
    are replayed: 1F1B repeats one backward-forward cycle once the gradients exist (two cycles
    past the warm-up reach every peak); GPipe's i-th forward and backward differ only by the
    saved activations of the micro-batches still in flight, which two replayed micro-batches
    plus the saved bytes of the others reproduce (later backwards hold less). ``early``: the
    ZeRO-3 gathers each micro-batch's backward starts ahead (``peak._gathered_early``)."""
    from profiler.memory import Checkpoints, replay_backward, replay_forward

    schedule, p, stage, m = sched
    m_run = min(m, min(m, p - stage) + 2) if schedule == "1f1b" else min(m, 2)
    frozen = {a: dataclasses.replace(x, kind="frozen") if x.kind == "param" else x for a, x in ph.items()}
    fixed, runs, first_backward, last_sent = set(ph), {}, True, None
    for kind, i in _actions(schedule, p, stage, m_run):
        if kind == "F":
            nodes = _renamed(mine, i, fixed)
            ck = Checkpoints(nodes, ph, [[f"{x}#{i}" for x in r] for r in regions],
                             {f"{at}#{i}": [f"{x}#{i}" for x in xs] for at, xs in (early or {}).items()})
            runs[i] = (nodes, ck)
            before = state.live_bytes
            replay_forward(nodes, ph, f"{loss}#{i}" if loss else "", size, state, ck)
            if schedule != "1f1b" and i == 0 and m > m_run:  # the micro-batches not replayed
                state.add(("in flight", 0), (m - m_run) * (state.live_bytes - before))
        else:
            nodes, ck = runs.pop(i)
            # after the first backward, gradients accumulate in place
            replay_backward(nodes, ph if first_backward else frozen, size, state, ck, {})
            first_backward = False
            if schedule == "1f1b":  # the send before it has been waited for: its gradient is freed
                state.free(("recv_grad", last_sent))
                last_sent = i
            state.add(("recv_grad", i), grad_in)  # the received value's gradient, held by its send
    state.free(("in flight", 0))
    if schedule != "1f1b":  # every send waited for at the end of the schedule
        state.add(("recv_grad", m_run), (m - m_run) * grad_in)
