"""Case functions for ``test_idioms.py``: the idioms of a training script (torch's
``clip_grad_norm_``, non-elementwise optimizers, parameter groups and schedules, global shapes)
on every rank of the pool, against the same script on one device."""
from __future__ import annotations

import copy
import warnings

import torch
from torch.distributed.tensor import DTensor

import cases
from workers import mesh

STEPS = 3


def _optimizer(kind: str, params_or_model):
    if kind == "adafactor":
        return torch.optim.Adafactor(params_or_model.parameters(), lr=1e-2)
    if kind == "sgd":
        return torch.optim.SGD(params_or_model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    if kind == "adagrad":
        return torch.optim.Adagrad(params_or_model.parameters(), lr=1e-3)  # (it normalises each entry: a small lr)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params_or_model.parameters(), lr=1e-3)
    # AdamW with groups chosen by name and ndim: no weight decay on biases and norms
    decay, rest = [], []
    for n, p in params_or_model.named_parameters():
        (rest if p.ndim < 2 or n.endswith("bias") else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, foreach=True)


def _run(model, step, opt_kind: str, clip: str | None, named_model=None):
    """STEPS steps; ``step()`` returns the loss after backward. Returns losses and final state."""
    opt = _optimizer(opt_kind, named_model or model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4) if opt_kind == "adamw" else None
    losses, norms = [], []
    for _ in range(STEPS):
        loss = step()
        if clip == "torch":
            norms.append(float(torch.nn.utils.clip_grad_norm_((named_model or model).parameters(), 0.05)))
            torch.nn.utils.clip_grad_value_((named_model or model).parameters(), 0.02)
        elif clip == "ours":  # the module's own (foreach) clip
            norms.append(float(model.clip_grad_norm_(0.05)))
        elif clip == "torch-norm":  # what "ours" must equal, on one device
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms


def idioms_case(name: str, layout: dict, opt_kind: str, clip: str | None, mesh_spec=None) -> dict:
    """``name`` under ``layout`` with optimizer ``opt_kind`` and clipping ``clip`` ("torch":
    ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_``; "ours": ``pm.clip_grad_norm_``),
    against one device: relative errors of losses, norms and final parameters; the parameters'
    names, shapes and count against the model's."""
    import autopar

    ex = cases.example(name, **({"batch": 4} if name == "mixtral" else {}))
    ref = copy.deepcopy(ex.model)
    shapes_ref = {n: (tuple(p.shape), p.dtype) for n, p in ref.named_parameters()}
    count_ref = sum(p.numel() for p in ref.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(ex.model, mesh(*(mesh_spec or ())), example_inputs=ex.args, example_kwargs=ex.kwargs,
                             loss_fn=ex.loss_fn, target=ex.target, cache_dir=None, quiet=True, layout=layout)
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in pm.named_parameters()}
    count = sum(p.numel() for p in pm.parameters())
    numels = {n: p.numel() for n, p in pm.named_parameters()}

    def step_pm():
        return pm.train_step(*ex.args, target=ex.target, **ex.kwargs)

    def step_ref():
        out = ref(*ex.args, **ex.kwargs)
        loss = ex.loss_fn(out, ex.target) if ex.loss_fn is not None else (out.loss if hasattr(out, "loss") else out)
        loss.backward()
        return loss.detach()

    losses, norms = _run(pm, step_pm, opt_kind, clip)
    ref_losses, ref_norms = _run(ref, step_ref, opt_kind, "torch-norm" if clip == "ours" else clip)
    full = pm.full_state_dict()
    worst = max(cases.rel_err(full[n], p.detach()) for n, p in ref.named_parameters() if n in full)
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "norm_err": max((abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)), default=0.0),
            "param_err": worst, "shapes_equal": shapes == {n: shapes_ref[n] for n in shapes},
            "losses": (losses, ref_losses, norms, ref_norms),
            "names_equal": set(shapes) == set(shapes_ref), "count": count, "count_ref": count_ref,
            "numels": numels, "names_ref": sorted(shapes_ref),
            "dtensor": all(isinstance(p, DTensor) for p in pm.parameters())}


def check_idioms(res: list[dict], pipelined: bool, tol: float = 1e-5) -> None:
    """The properties every rank's ``idioms_case`` result must have (asserts)."""
    if pipelined:  # a stage lists its own parameters (global shapes); the stages together, the model's
        together = {}
        for r in res:
            together.update(r["numels"])
        assert sorted(together) == res[0]["names_ref"], "the stages' parameters are not the model's"
        assert sum(together.values()) == res[0]["count_ref"], (together, res[0]["count_ref"])
        assert all(set(r["numels"]) < set(r["names_ref"]) for r in res), "a stage lists another stage's parameters"
    for r in res:
        assert r["dtensor"], "parameters are not DTensors"
        assert r["shapes_equal"], "named_parameters() differ from the model's"
        if not pipelined:
            assert r["names_equal"], "named_parameters() differ from the model's"
            assert r["count"] == r["count_ref"], (r["count"], r["count_ref"])
        assert r["loss_err"] <= tol, r["losses"]
        assert r["norm_err"] <= tol, r
        assert r["param_err"] <= tol, (r["param_err"], r["losses"])


def work_registry_case(name: str, layout: dict, steps: int = 2) -> list[int]:
    """c10d's registry of unwaited Work objects after every ``train_step`` of ``name`` under
    ``layout`` (a Work dropped without a wait leaks itself and its buffer)."""
    import autopar

    ex = cases.example(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(ex.model, mesh(), example_inputs=ex.args, example_kwargs=ex.kwargs,
                             loss_fn=ex.loss_fn, target=ex.target, cache_dir=None, quiet=True, layout=layout)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    # Every collective the prefetcher starts is waited for: c10d's registry forgets a Work whose
    # output tensor is freed, so a gather dropped in flight leaves the registry empty while the
    # collective still writes into freed memory. Count starts and waits instead.
    from autopar.runtime import prefetch as P

    counts = {"started": 0, "waited": 0}
    start, finish = P._launched, P._finish_plain

    def counted_start(out):
        counts["started"] += 1
        return start(out)

    def counted_finish(out):
        counts["waited"] += 1
        return finish(out)

    P._launched, P._finish_plain = counted_start, counted_finish
    sizes = []
    try:
        for _ in range(steps):
            pm.train_step(*ex.args, target=ex.target, **ex.kwargs)
            sizes.append((int(torch._C._distributed_c10d._get_work_registry_size()),
                          counts["started"] - counts["waited"]))
            opt.step()
            opt.zero_grad()
    finally:
        P._launched, P._finish_plain = start, finish
    sizes.append(counts["started"])
    return sizes



def bucket_reuse_case(name: str, layout: dict) -> dict:
    """Gradient buckets kept between steps (as DDP keeps its own), trained against one device
    with the ways a script frees gradients: ``zero_grad()`` (buffers reused: the same data
    pointers step after step), a script that holds a step's ``.grad`` (a new buffer: what it
    holds keeps its values), then ``zero_grad(set_to_none=False)`` (gradients accumulate in their
    slots, the buffers reused)."""
    import autopar

    ex = cases.example(name)
    ref = copy.deepcopy(ex.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(ex.model, mesh(), example_inputs=ex.args, example_kwargs=ex.kwargs,
                             loss_fn=ex.loss_fn, target=ex.target, cache_dir=None, quiet=True, layout=layout)

    def step_ref():
        out = ref(*ex.args, **ex.kwargs)
        loss = ex.loss_fn(out, ex.target) if ex.loss_fn is not None else (out.loss if hasattr(out, "loss") else out)
        loss.backward()
        return loss.detach()

    steps = {"pm": lambda: pm.train_step(*ex.args, target=ex.target, **ex.kwargs), "ref": step_ref}
    opts = {"pm": torch.optim.AdamW(pm.parameters(), lr=1e-3), "ref": torch.optim.AdamW(ref.parameters(), lr=1e-3)}
    buckets = [b for b in pm._grad_sync.buckets if b.scatter is None]
    ptrs, losses, held, held_err = [], {k: [] for k in steps}, None, None
    for mode in ["none", "none", "hold", "keep", "keep", "none"]:
        for k in steps:
            losses[k].append(float(steps[k]()))
        ptrs.append([b.keep.data_ptr() if getattr(b, "keep", None) is not None else None for b in buckets])
        if held is not None:  # what the script held kept its values through this step
            held_err = max(float((g.full_tensor() - v).abs().max()) for g, v in held)
            held = None
        if mode == "hold":
            held = [(p.grad, p.grad.full_tensor().clone()) for p in pm.parameters() if p.grad is not None]
        for k in steps:
            opts[k].step()
            opts[k].zero_grad(set_to_none=mode != "keep")
    full = pm.full_state_dict()
    return {"buckets": len(buckets), "ptrs": ptrs, "held_err": held_err,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses["pm"], losses["ref"])),
            "param_err": max(cases.rel_err(full[n], p.detach()) for n, p in ref.named_parameters() if n in full)}


def early_buckets_case(name: str, layout: dict, steps: int = 3) -> dict:
    """Buckets launched by their hooks during the last micro-batch's backward (before
    ``GradSync.finish``) against those launched by ``finish``, per step, and the training against
    one device."""
    import autopar
    from autopar.runtime.grads import GradSync

    ex = cases.example(name, batch=16)
    ref = copy.deepcopy(ex.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(ex.model, mesh(), example_inputs=ex.args, example_kwargs=ex.kwargs,
                             loss_fn=ex.loss_fn, target=ex.target, cache_dir=None, quiet=True, layout=layout)
    gs = pm._grad_sync
    seen = {"in_finish": False, "early": 0, "late": 0}
    launch, finish = gs._launch, gs.finish

    def counted_launch(b):
        seen["late" if seen["in_finish"] else "early"] += 1
        return launch(b)

    def flagged_finish(*a, **k):
        seen["in_finish"] = True
        try:
            return finish(*a, **k)
        finally:
            seen["in_finish"] = False

    gs._launch, gs.finish = counted_launch, flagged_finish
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    losses, rlosses = [], []
    for _ in range(steps):
        losses.append(float(pm.train_step(*ex.args, target=ex.target, **ex.kwargs)))
        out = ref(*ex.args, **ex.kwargs)
        loss = ex.loss_fn(out, ex.target) if ex.loss_fn is not None else (out.loss if hasattr(out, "loss") else out)
        loss.backward()
        rlosses.append(float(loss))
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    full = pm.full_state_dict()
    return {"early": seen["early"], "late": seen["late"], "buckets": len(gs.buckets),
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, rlosses)),
            "param_err": max(cases.rel_err(full[n], p.detach()) for n, p in ref.named_parameters() if n in full)}


def loss_sync_case(name: str, layout: dict, steps: int = 2) -> dict:
    """The reductions inside ops during each ``train_step`` (``strategies.local``'s all-reduces:
    the count of targets of a mean cross entropy, the loss summed over its ranks), and the losses
    and weights against one device on batches whose ranks count different numbers of targets
    (-100 padding, each row its own length; under micro-batches every micro-batch counts the same,
    as they must: rows in pairs whose counts sum alike)."""
    import autopar
    import autopar.strategies.local as local

    ex = cases.example(name, batch=8)
    ids = ex.args[0]
    rows, seq = ids.shape
    micro = "microbatches" in layout
    labels = ids.clone()
    for r in range(rows):
        keep = (seq // 8) * (1 + (r // 2 if r % 2 == 0 else 7 - r // 2)) if micro else (seq * (r + 1)) // (rows + 1)
        labels[r, keep:] = -100
    ref = copy.deepcopy(ex.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(ex.model, mesh(), example_inputs=(ids,), example_kwargs={"labels": ids},
                             cache_dir=None, quiet=True, layout=layout)
    calls = [0]
    real = local._reduce

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    local._reduce = counted
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    per_step, losses, rlosses = [], [], []
    try:
        for _ in range(steps):
            calls[0] = 0
            losses.append(float(pm.train_step(ids, labels=labels)))
            per_step.append(calls[0])
            loss = ref(ids, labels=labels).loss
            loss.backward()
            rlosses.append(float(loss))
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
    finally:
        local._reduce = real
    full = pm.full_state_dict()
    known = pm._sig.ctx.target_count
    local_counts = int((labels[:, 1:] != -100).sum())
    recv = None
    if pm._pipe is not None:  # distinct sets of receive buffers (values, gradients) of this rank's stage
        st = pm._pipe.stages[0]

        def sets(d):
            return len({id(v) for v in d.values() if any(getattr(i, "buffer", None) is not None for i in v)})

        recv = [st.stage_index, sets(st.args_recv_info), sets(getattr(st, "grad_recv_info", {}))]
    return {"per_step": per_step, "partial": list(pm._sig.loss_partial), "recv": recv,
            "counted": None if known is None else float(known[1]), "global": local_counts,
            "last_stage": pm._pipe is None or pm._pipe.n_stages - 1 in pm._pipe.local,
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, rlosses)),
            "param_err": max(cases.rel_err(full[n], p.detach()) for n, p in ref.named_parameters() if n in full)}
