"""The ``autopar`` command: profile, plan, show, explain, diff.

User errors (a bad SPEC, mesh, size or plan file) print one line ``autopar: error: ...`` naming
the problem and the fix, and exit with status 2; no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys

from autopar import report
from autopar.units import parse_mesh


class UserError(Exception):
    """An error in what the user typed or handed us: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------- SPEC
def load_spec(spec: str, *, batch=None, seq=None, device="meta"):
    """A built-in example name or ``package.module:factory`` -> ``autopar.zoo.Example``.

    A factory returns an ``Example`` or a tuple ``(model, args[, kwargs[, loss_fn[, target]]])``.
    """
    from autopar import zoo

    overrides = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}
    if ":" not in spec:
        if spec not in zoo.names():
            raise UserError(f"unknown example {spec!r}: use one of {', '.join(zoo.names())} "
                            f"or package.module:factory")
        fn = zoo._SMALL.get(spec) or zoo._BIG[spec][0]
        _check_takes(fn, f"example {spec!r}", overrides)
        return zoo.build(spec, device=device, **overrides)
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as err:
        raise UserError(f"cannot import module {mod_name!r} from SPEC {spec!r}: {err}") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise UserError(f"{mod_name!r} has no callable {attr!r} (SPEC is package.module:factory)")
    _check_takes(fn, spec, overrides)
    out = fn(**overrides)
    if isinstance(out, zoo.Example):
        return out
    if not isinstance(out, tuple) or len(out) < 2:
        raise UserError(f"factory {spec} must return an autopar.zoo.Example or (model, args[, kwargs, loss_fn, target])")
    model, args, *rest = out
    rest += [None] * (3 - len(rest))
    return zoo.Example(name=spec, model=model, args=tuple(args) if isinstance(args, (tuple, list)) else (args,),
                       kwargs=rest[0] or {}, loss_fn=rest[1], target=rest[2])


def _check_takes(fn, what: str, overrides: dict) -> None:
    """Refuse --batch/--seq for a factory that has no such parameter, before calling it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call decide
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    bad = [k for k in overrides if k not in params]
    if bad:
        raise UserError(f"{what} takes no {bad[0]!r} parameter, so --{bad[0]} cannot be applied; "
                        f"drop --{bad[0]}" + ("" if what.startswith("example") else f" or give the factory a "
                                              f"{bad[0]}= parameter"))


def _check_plan_options(a) -> None:
    """The option values of ``autopar plan``, checked before any model is built or profiled: they
    become the ``autopar.PlanOptions`` that ``autopar.plan`` and ``autopar.compile`` read."""
    from autopar.options import PlanOptions

    _check_sizes(a)
    layout = getattr(a, "layout", None)
    if layout is not None:
        if a.force is not None:
            raise UserError("give either --force (a plan family) or --layout (a hand-written layout), not both")
        layout = a.layout = parse_layout_flag(layout)
    given = {"memory_budget": ("--memory", a.memory), "force": ("--force", a.force),
             "optimizer": ("--optimizer", a.optimizer), "time_limit": ("--time-limit", a.time_limit),
             "precision": ("--precision", a.precision), "grad_reduce": ("--grad-reduce", a.grad_reduce),
             "layout": ("--layout", layout)}
    for field, (flag, value) in given.items():  # one at a time, so that the error names its flag
        try:
            PlanOptions(**{field: value})
        except (TypeError, ValueError) as err:
            raise UserError(f"{flag}: {err}") from None
    a.options = PlanOptions(**{field: value for field, (_, value) in given.items()})


def parse_layout_flag(text: str) -> dict:
    """``"pp=2,dp=32,tp=8,zero=1,recompute=full"`` -> the layout dict (checked by the planner)."""
    from autopar.planner import layout as L

    out: dict = {}
    for part in [p for p in text.split(",") if p.strip()]:
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise UserError(f"cannot read --layout {text!r}: use key=value pairs, e.g. pp=2,dp=32,tp=8,recompute=full")
        out[key] = int(value) if value.isdigit() else {"true": True, "false": False}.get(value.lower(), value)
    try:
        return L.parse(out).to_dict()
    except (TypeError, ValueError) as err:
        raise UserError(f"--layout: {err}") from None


def _check_sizes(a) -> None:
    for flag in ("batch", "seq"):
        v = getattr(a, flag, None)
        if v is not None and v < 1:
            raise UserError(f"--{flag} must be a positive integer, got {v}")


def _load_plan(path):
    from autopar.plan import Plan, PlanError

    try:
        return Plan.load(path)
    except PlanError as err:
        raise UserError(str(err)) from None


# ------------------------------------------------------------------------------- commands
def cmd_profile(a) -> int:
    import profiler

    _check_sizes(a)
    ex = load_spec(a.spec, batch=a.batch, seq=a.seq)
    gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    print(gp.table())
    return 0


def _mesh(a):
    from autopar.mesh import CLUSTERS, Mesh

    try:
        shape = parse_mesh(a.mesh)
    except ValueError as err:
        raise UserError(str(err)) from None
    if a.cluster not in CLUSTERS:
        raise UserError(f"unknown cluster {a.cluster!r}: use one of {', '.join(CLUSTERS)}")
    return Mesh(shape, cluster=a.cluster)


def cmd_plan(a) -> int:
    import autopar

    _check_plan_options(a)
    mesh = _mesh(a)
    ex = load_spec(a.spec, batch=a.batch, seq=a.seq)
    try:
        p = autopar.plan(ex.model, mesh, ex.args, options=a.options, example_kwargs=ex.kwargs, loss_fn=ex.loss_fn,
                         target=ex.target)
    except autopar.InfeasibleBudget as err:
        raise UserError(str(err)) from None
    except ValueError as err:
        if a.layout is None:
            raise
        raise UserError(str(err)) from None  # a layout the model cannot take: named, one line
    p.options["spec"] = a.spec
    print(p.summary())
    if getattr(a, "lowered", False):
        import profiler
        from autopar.lowering.program import lower_plan

        gp = profiler.profile(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        print("\n" + str(lower_plan(gp.captured, p)))
    if a.output:
        p.save(a.output)
        print(f"\nplan written to {a.output}")
    return 0


def cmd_show(a) -> int:
    p = _load_plan(a.plan)
    print(p.summary(full=a.full))
    if a.html:
        from autopar.html import render

        with open(a.html, "w") as f:
            f.write(render(p))
        print(f"\nHTML report written to {a.html}")
    return 0


def cmd_explain(a) -> int:
    from autopar.explain import explain

    p = _load_plan(a.plan)
    try:
        print(explain(p, a.node))
    except KeyError as err:
        raise UserError(err.args[0]) from None
    return 0


def cmd_diff(a) -> int:
    from autopar.explain import diff

    print(diff(_load_plan(a.a), _load_plan(a.b)))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Plan and inspect parallel training plans.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_args(sp):
        sp.add_argument("spec", metavar="SPEC", help="built-in example (gpt2, gpt2-xl, llama2-7b, llama3-8b, bert, "
                        "vit, resnet50, ...) or package.module:factory")
        sp.add_argument("--batch", type=int, help="global batch size (built-in examples)")
        sp.add_argument("--seq", type=int, help="sequence length (built-in language models)")

    sp = sub.add_parser("profile", help="per-layer FLOPs, saved activations, parameters and peak memory")
    spec_args(sp)
    sp.set_defaults(fn=cmd_profile)

    sp = sub.add_parser("plan", help="plan a model for a mesh (no GPU or process group needed)")
    spec_args(sp)
    sp.add_argument("--mesh", default="2x4", help="mesh shape, e.g. 2x4, 8 or 64x8 (nodes x GPUs per node), up to "
                    "4 axes (default: %(default)s)")
    sp.add_argument("--cluster", default="h100", help="cluster preset: a100, h100, h200, pcie, cpu (default: %(default)s)")
    sp.add_argument("--memory", help="per-device memory budget, e.g. 80GiB")
    sp.add_argument("--force", help="restrict to a plan family: dp, zero3, megatron, tp, atp-col-first, "
                    "atp-row-first, pp-tp, replicate")
    sp.add_argument("--optimizer", default="adamw", help="optimizer whose state counts in memory: adamw, adam, "
                    "sgd, sgd-momentum (default: %(default)s)")
    sp.add_argument("--time-limit", type=float, default=60.0, help="solver time limit in seconds")
    sp.add_argument("--precision", help="fp32 or bf16-mixed (default: bf16-mixed on GPU clusters, fp32 on cpu)")
    sp.add_argument("--grad-reduce", default="fp32", help="dtype of gradient reductions under bf16-mixed: fp32 or "
                                                          "bf16 (default: %(default)s)")
    sp.add_argument("--layout", help="price a hand-written layout instead of searching, e.g. "
                    "pp=2,dp=32,tp=8,zero=1,recompute=full,microbatches=48,schedule=1f1b (keys left out are searched)")
    sp.add_argument("-o", "--output", help="write the plan JSON here")
    sp.add_argument("--lowered", action="store_true", help="also print the lowered per-rank program: every "
                    "edge's collectives and the copies they share, parameter gradients, buckets, regions")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("show", help="print a plan file (optionally an HTML report)")
    sp.add_argument("plan", help="plan JSON file")
    sp.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    sp.add_argument("--full", action="store_true", help="every parameter placement of a layer, uncut")
    sp.set_defaults(fn=cmd_show)

    sp = sub.add_parser("explain", help="the strategies considered for a node or layer and the costs that decided")
    sp.add_argument("plan", help="plan JSON file")
    sp.add_argument("node", metavar="NODE_OR_LAYER", help="fx node name or layer/module path")
    sp.set_defaults(fn=cmd_explain)

    sp = sub.add_parser("diff", help="objective change and what moved between two plans")
    sp.add_argument("a")
    sp.add_argument("b")
    sp.set_defaults(fn=cmd_diff)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as err:
        print(f"autopar: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a model that cannot be captured or profiled is the user's to fix
        from profiler import ProfileError
        from profiler.capture import CaptureError

        if not isinstance(err, (CaptureError, ProfileError)):
            raise
        print(f"autopar: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
