"""Capture a model's training loss as one fx graph with ``torch.export`` (training IR).

``capture(model, args, kwargs, loss_fn=, target=)`` wraps the model and its loss into a module whose
forward returns the scalar loss and exports it with ``torch.export.export(strict=False)``. The
result keeps high-level aten ops (``aten.linear``, ``aten.layer_norm``,
``aten.scaled_dot_product_attention``, ``aten.embedding``, ``aten.cross_entropy_loss``): nothing is
decomposed. Parameters and buffers are lifted to placeholders; every node carries
``meta["val"]`` (a FakeTensor) and ``meta["nn_module_stack"]``.

Models whose parameters live on the meta device (big configs) capture without allocating
weights: export only ever sees fake tensors. With meta example inputs the graph is traced on the
meta device; with real example inputs (CPU or CUDA), the meta weights stand in as fake tensors on
the inputs' device (:func:`weights_on`), so the graph (and its hash) is the one a model built on
that device gives, and a per-rank program can run it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import inspect
import logging
import os
import traceback
from typing import Any, Callable

import torch
import torch.nn as nn

from .fastexport import trimmed_export

#: Prefix export gives to FQNs of the wrapped model (the wrapper holds it as ``self.model``).
_PREFIX = "model."

#: Remedies by kind of failure; a message appends only those that fit it.
_REMEDY = {
    "cache": "pass use_cache=False (HF models) so no cache objects are built",
    "inputs": "pass every input the forward needs as example args/kwargs",
    "control": ("replace data-dependent Python control flow (`if x.sum() > 0:`, `.item()`, `.tolist()`) "
                "with tensor ops such as torch.where"),
    "dtype": ("give every example input the dtype the model expects: token ids as torch.long, floating "
              "inputs in the parameters' dtype (x.float() for float32 weights), or convert the model"),
    "shape": "check the example inputs' shapes against what the forward expects",
    "loss": ("check loss_fn against the model's output: it is called as loss_fn(output, target) "
             "(loss_fn(output) when no target= is given)"),
}

#: What a data-dependent size failure appends.
_REMEDIES = "remedy: " + _REMEDY["control"]


def _remedies(*kinds: str) -> str:
    text = "; ".join(_REMEDY[k] for k in kinds)
    return ("remedy: " if len(kinds) == 1 else "remedies: ") + text


class CaptureError(RuntimeError):
    """The model (with its example inputs) could not be captured as a graph.

    ``construct`` names the failing line of model code (file:line and source) when known;
    ``cause`` is the original exception raised by ``torch.export`` or by the model.
    """

    def __init__(self, message: str, *, construct: str | None = None, cause: BaseException | None = None):
        super().__init__(message)
        self.construct = construct
        self.cause = cause


@dataclasses.dataclass(kw_only=True)
class Captured:
    """A captured training-loss graph and the maps from its placeholders to the model's names."""

    ep: torch.export.ExportedProgram
    """The exported program (training IR, parameters and buffers lifted)."""
    gm: torch.fx.GraphModule
    """``ep.graph_module``: the fx graph whose placeholders are parameters, buffers, then user inputs."""
    params: dict[str, str]
    """Parameter placeholder name -> FQN in the model (e.g. ``"transformer.h.0.attn.c_attn.weight"``)."""
    buffers: dict[str, str]
    """Buffer placeholder name -> FQN in the model."""
    param_aliases: dict[str, tuple[str, ...]]
    """Tied parameters: the placeholder the graph reads -> every FQN of that one tensor (GPT-2
    ``wte``/``lm_head``). Export also lifts a placeholder for each other FQN; those have no users."""
    user_inputs: list[str]
    """User-input placeholder names in call order: flattened args, then kwargs, then the target
    (a placeholder whose value is None when no target is given)."""
    loss_node: torch.fx.Node
    """The node computing the scalar loss (the graph's user output)."""
    mutated_buffers: dict[str, str]
    """Buffer placeholder name -> name of the graph output holding its new value (BatchNorm stats)."""
    causal: dict[str, str] = dataclasses.field(default_factory=dict)
    """Attention nodes whose provably causal mask was replaced by ``is_causal=True`` at capture
    (:mod:`profiler.causal`), with the proof's one-line reason."""
    aligned: dict | None = None
    """Set when the graph was rebuilt in another process's op order and names
    (:func:`profiler.align.align`: each process's hash seed may order a model's ops differently)."""

    @property
    def graph(self) -> torch.fx.Graph:
        """The fx graph (``gm.graph``)."""
        return self.gm.graph

    def tied_duplicates(self) -> set[str]:
        """Parameter placeholders that repeat a tied parameter another placeholder already holds."""
        out = set()
        fqn_to_ph = {fqn: ph for ph, fqn in self.params.items()}
        for primary, fqns in self.param_aliases.items():
            out.update(fqn_to_ph[f] for f in fqns if f in fqn_to_ph and fqn_to_ph[f] != primary)
        return out

    def module_path(self, node: torch.fx.Node) -> str:
        """Innermost module path of ``node`` in the model's own names (``"transformer.h.3.attn"``)."""
        return module_path(node)

    def graph_hash(self) -> str:
        """sha256 over ops, arguments, shapes, dtypes and parameter names, in graph order.

        Identical for two captures of the same model and inputs; different when the model, its
        config or the input shapes differ.
        """
        h = hashlib.sha256()
        fqn = {**self.params, **self.buffers}
        _hash_graph(h, self.gm, fqn)
        return h.hexdigest()


def module_path(node: torch.fx.Node) -> str:
    """Innermost module path of ``node`` from ``meta["nn_module_stack"]``, without the wrapper prefix."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = next(reversed(stack.values()))[0]
    return _strip(path)


def _strip(path: str) -> str:
    if path == "model":
        return ""
    return path[len(_PREFIX):] if path.startswith(_PREFIX) else path


class _LossModule(nn.Module):
    """``forward(args, kwargs, target)`` -> the scalar training loss of ``model``."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, args, kwargs, target):
        out = self.model(*args, **kwargs)
        if self.loss_fn is not None:
            return self.loss_fn(out, target) if target is not None else self.loss_fn(out)
        return _find_loss(out)


def _find_loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)  # HF ModelOutput
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor):
        loss = out
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss if loss.dim() == 0 else loss.reshape(())
    raise CaptureError(
        f"no scalar loss in the model's output ({_describe(out)}): pass loss_fn= (and target=) to "
        "turn the output into a loss, or make the model return its loss (HF models: pass labels=)")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)} {x.dtype}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}: " + ", ".join(_describe(v) for v in list(x)[:3])
    return type(x).__name__


def capture(model: nn.Module, args, kwargs: dict | None = None, *, loss_fn: Callable | None = None,
            target: Any = None, stack_traces: bool = False, causal: bool = True) -> Captured:
    """Capture ``model``'s scalar training loss on the example inputs as a training-IR graph.

    The loss is ``loss_fn(model(*args, **kwargs), target)`` when ``loss_fn`` is given, else the
    model's own loss (``output.loss`` of an HF ModelOutput, ``output[0]``, or a scalar output).
    ``stack_traces=True`` records a Python stack trace per node (slower to capture).
    ``causal=True`` rewrites attention whose mask is provably the causal triangle (a constant of
    the shapes, no user input) to ``is_causal=True`` without the mask (:mod:`profiler.causal`),
    the call eager code makes; ``False`` keeps the graph as traced.
    Raises :class:`CaptureError` with the failing construct and remedies when export fails, and
    before any tracing when the inputs do not fit ``model.forward``.
    """
    args, kwargs, target = _check_inputs(model, args, kwargs, loss_fn, target)
    wrapper = _LossModule(model, loss_fn)
    with paused_gc(), _export_context(stack_traces), weights_on(model, _input_device(args, kwargs, target)):
        try:
            ep = _export(wrapper, (args, kwargs, target))
        except CaptureError:
            raise
        except Exception as e:  # export raises many types; all are reported the same way
            raise _capture_error(model, e) from e
        _refuse_data_dependent_sizes(ep, model)
        captured = _build_captured(ep, model)
        if causal:
            from profiler.causal import causal_attention, rewrite_causal_attention

            proofs = causal_attention(captured.graph)
            done = rewrite_causal_attention(captured.gm, proofs=proofs)
            captured.causal = {name: proofs[name].reason for name in done}
        return captured


def _refuse_data_dependent_sizes(ep: torch.export.ExportedProgram, model: nn.Module) -> None:
    """Raise :class:`CaptureError` when a node's output size depends on tensor values.

    torch.export accepts such a graph (an unbacked symbol stands for the size, e.g. the rows a
    boolean mask keeps), but every later pass — FLOPs, memory, sharding, the per-rank program —
    needs static shapes, and a fake tensor cannot produce the data-dependent size.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not _may_have_unbacked(ep):
        return
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if not any(isinstance(v, torch.Tensor) and free_unbacked_symbols(v) for v in vals):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path = next(reversed(stack.values()))[0] if stack else ""
        module = path[len("model."):] if path.startswith("model.") else ""  # the loss wrapper's prefix
        where = f" in module '{module}'" if module else f" in {type(model).__name__}.forward"
        raise CaptureError(
            f"capturing {type(model).__name__} failed: {node.target} ({node.name}){where} has a data-dependent "
            f"output shape: its size depends on tensor values (boolean-mask indexing, nonzero, unique, ...). "
            f"autopar plans static shapes; keep the shape fixed instead (multiply by the mask or use "
            f"torch.where, and divide by the mask's sum for a mean).\n{_REMEDIES}",
            construct=f"{node.target}{where}")


def _may_have_unbacked(ep: torch.export.ExportedProgram) -> bool:
    """False when the trace's shape environment never created an unbacked (data-dependent) size,
    so no node can carry one (skips a walk over every node's shapes); True when unsure."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    try:
        from torch._export.utils import _get_shape_env_from_gm

        shape_env = _get_shape_env_from_gm(ep.graph_module)
    except Exception:  # internals moved: walk the nodes
        return True
    if shape_env is None:
        return False  # no symbolic value anywhere: every size is an int
    return any(symbol_is_type(s, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT)) for s in shape_env.var_to_range)


def _export(wrapper: nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    """``torch.export.export(strict=False)`` with its redundant passes trimmed (see
    :mod:`profiler.fastexport`); plain export when a failure comes from the trimmed path itself."""
    with trimmed_export() as trimming:
        try:
            return torch.export.export(wrapper, inputs, strict=False)
        except Exception as e:
            if not trimming.caused(e):
                raise  # the model's own failure: plain export would fail the same way
    return torch.export.export(wrapper, inputs, strict=False)


@contextlib.contextmanager
def _export_context(stack_traces: bool):
    """Speed-ups for big graphs that change nothing in the captured program.

    A lazy GraphModule defers Python code generation to the first call (export recompiles the
    graph after each of its passes: about 1.5 s of a 4 s Llama-2-7B capture); skipping stack
    traces saves a traceback per node (the caller pauses the cyclic garbage collector: see
    :class:`paused_gc`). FakeTensor logs failing meta kernels at ERROR level: we report them
    ourselves.
    """
    try:
        from torch.fx import config as fx_config
    except ImportError:  # older torch: stack traces are always recorded
        fx_config = None
    old = getattr(fx_config, "do_not_emit_stack_traces", None)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    old_level = fake_log.level
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
        lazy = _use_lazy_graph_module(True)
    except ImportError:  # older torch: eager recompiles, same result
        lazy = contextlib.nullcontext()
    try:
        if old is not None:
            fx_config.do_not_emit_stack_traces = not stack_traces
        fake_log.setLevel(logging.CRITICAL)
        with lazy:
            yield
    finally:
        if old is not None:
            fx_config.do_not_emit_stack_traces = old
        fake_log.setLevel(old_level)


class paused_gc:
    """Pause Python's cyclic garbage collector for a tracing pass (a context manager).

    Tracing creates hundreds of thousands of small objects (fake tensors, fx nodes, pytree
    specs); with a big model alive, each automatic full collection walks all of them. Nothing
    cyclic needs freeing before the pass ends; the collector resumes afterwards. A class, not a
    generator: resuming is the last thing its exit does, so the young collection that the pass's
    allocations have queued runs at the caller's next allocation, not inside this exit (which
    lets :func:`profiler.profile.profile_captured` freeze the capture's objects first).
    """

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc) -> None:
        if self.was_enabled:
            gc.enable()


def _check_inputs(model, args, kwargs, loss_fn, target) -> tuple[tuple, dict, Any]:
    """Cheap checks that catch wrong example inputs before tracing starts; the inputs come back
    de-aliased (:func:`dealias_inputs`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture() needs an nn.Module, got {type(model).__name__}")
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"example args must be a tuple of inputs, got {type(args).__name__}: "
                        "pass (x,) for a single input")
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        sig = inspect.signature(model.forward)
        raise CaptureError(
            f"example inputs do not fit {type(model).__name__}.forward{sig}: {e}; got "
            f"args=({', '.join(_describe(a) for a in args)}) kwargs={sorted(kwargs)}", cause=e) from e
    if target is not None and loss_fn is None:
        raise CaptureError("target= was given without loss_fn=: pass loss_fn=(output, target) -> loss, "
                           "or drop target if the model returns its own loss")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    _check_devices(model, args, kwargs, target)
    args, kwargs, target = dealias_inputs(tuple(args), kwargs, target)
    return args, kwargs, target


def dealias_inputs(args: tuple, kwargs: dict, target: Any) -> tuple[tuple, dict, Any]:
    """The inputs with every tensor that repeats (or views) an earlier one replaced by a copy.

    torch.export lifts one placeholder per distinct tensor: when the example passes one tensor in
    two places (``(tokens,)`` and ``labels=tokens``), the graph reads both inputs from one
    placeholder and the other is left without users, so a later call whose labels differ from its
    ids computes the wrong loss. A copy per extra occurrence keeps every user input its own graph
    input. Aliasing is judged by object identity and by a shared view base (storage is not
    inspected: fake and meta tensors have none to compare).
    """
    seen: set[int] = set()

    def own(x):
        if not isinstance(x, torch.Tensor):
            return x
        keys = {id(x)} | ({id(x._base)} if x._base is not None else set())
        if keys & seen:
            return x.clone()
        seen.update(keys)
        return x

    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs, target))
    args, kwargs, target = torch.utils._pytree.tree_unflatten([own(x) for x in flat], spec)
    return tuple(args), dict(kwargs), target


def _input_device(args, kwargs, target) -> torch.device | None:
    """The one device of the example inputs' tensors (None when there is none)."""
    flat = torch.utils._pytree.tree_leaves((args, kwargs, target))
    devices = {t.device for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
    return next(iter(devices)) if len(devices) == 1 else None


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (no data)."""
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


@contextlib.contextmanager
def weights_on(model: nn.Module, device: torch.device | None):
    """For the time of a capture, every meta parameter and buffer of ``model`` is a fake tensor on
    ``device`` (a real device: no storage is allocated), so export traces the graph a model built
    on ``device`` gives (``arange(..., device=...)``, strides, constants). Tied tensors stay one.
    Put back afterwards, also when the capture raises. Nothing happens when ``device`` is None or
    meta, or when no weight is on meta."""
    if device is None or device.type == "meta" or not on_meta(model):
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    make = mode.fake_tensor_converter.from_meta_and_device
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            for table in (mod._parameters, mod._buffers):
                for key, t in list(table.items()):
                    if t is None or t.device.type != "meta":
                        continue
                    if id(t) not in fakes:
                        f = make(mode, t, device)
                        fakes[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) \
                            if isinstance(t, nn.Parameter) else f
                    swapped.append((table, key, t))
                    table[key] = fakes[id(t)]
        yield
    finally:
        for table, key, t in reversed(swapped):
            table[key] = t


def _check_devices(model, args, kwargs, target) -> None:
    param_devices = {t.device.type for t in model.parameters()} | {t.device.type for t in model.buffers()}
    flat = torch.utils._pytree.tree_leaves((args, kwargs, target))
    input_devices = {t.device.type for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
    if "meta" in param_devices and len(input_devices - {"meta"}) > 1:
        raise CaptureError(
            f"the model's parameters are on the meta device and example inputs on several devices "
            f"{sorted(input_devices)}: give every example input one device (the one the model will train on)")
    if "meta" in param_devices and "meta" in input_devices and input_devices - {"meta"}:
        raise CaptureError(
            f"example inputs are on the meta device and on {sorted(input_devices - {'meta'})}: give every "
            f"example input one device (the one the model will train on, or meta to plan only)")
    if param_devices - {"meta"} and "meta" in input_devices:
        raise CaptureError(
            f"example inputs are on the meta device but the model's parameters are on "
            f"{sorted(param_devices - {'meta'})}: build the model with device='meta' too")


def _capture_error(model: nn.Module, e: BaseException) -> CaptureError:
    construct = _failing_construct(e)
    name = type(e).__name__
    text = str(e).strip().split("\n\n")[0][:2000]
    where = f" at {construct}" if construct else ""
    lowered = text.lower()
    cache = "cache" in lowered
    if _is_data_dependent(e):
        what = "data-dependent control flow or output shape (a Python branch or size that needs tensor values)"
        kinds = ("control",)
    elif _raised_in_loss_fn(e):
        what = "the loss function raised on the model's output"
        kinds = ("loss",)
    elif isinstance(e, (RuntimeError, TypeError, ValueError, IndexError)) and _raised_in_model(e):
        if _is_dtype_error(lowered):
            what = "the model's forward raised on the example inputs: an input has the wrong dtype"
            kinds = ("dtype",)
        elif isinstance(e, TypeError) and ("argument" in lowered or "positional" in lowered):
            what = "the model's forward raised on the example inputs: a missing or extra input"
            kinds = ("inputs",)
        else:
            what = ("the model's forward raised on the example inputs (wrong shape, dtype or arity of an "
                    "input?)")
            kinds = ("cache", "shape") if cache else ("shape", "inputs")
    else:
        what = "torch.export could not capture the model"
        kinds = ("cache",) if cache else ("cache", "inputs", "control")
    msg = (f"capturing {type(model).__name__} failed{where}: {what}.\n"
           f"export said ({name}): {text}\n{_remedies(*kinds)}")
    return CaptureError(msg, construct=construct, cause=e)


def _is_dtype_error(lowered_text: str) -> bool:
    """The message of an op that rejected an input's dtype (mixed float types, float indices...)."""
    return any(m in lowered_text for m in (
        "scalar type", "scalar types", "dtype", "should be the same", "expected both", "found dtype",
        "expected tensor for argument", "but found double", "but found float", "mat1 and mat2 must have the same"))


def _raised_in_loss_fn(e: BaseException) -> bool:
    """The failure happened inside ``loss_fn`` (the capture wrapper's call of it is on the stack)."""
    here = os.path.abspath(__file__)
    for f in traceback.extract_tb(e.__traceback__):
        if f.name == "forward" and os.path.abspath(f.filename) == here and "self.loss_fn(" in (f.line or ""):
            return True
    return False


def _is_data_dependent(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    markers = {"GuardOnDataDependentSymNode", "DataDependentOutputException", "DynamicOutputShapeException",
               "PendingUnbackedSymbolNotFound"}
    return bool(names & markers) or "data-dependent" in str(e).lower() or "data dependent" in str(e).lower()


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)


def _user_frames(e: BaseException) -> list[traceback.FrameSummary]:
    frames = traceback.extract_tb(e.__traceback__)
    py_lib = os.path.dirname(contextlib.__file__)
    return [f for f in frames if not f.filename.startswith((_TORCH_DIR, _OWN_DIR, py_lib))]


def _raised_in_model(e: BaseException) -> bool:
    return bool(_user_frames(e))


def _failing_construct(e: BaseException) -> str | None:
    frames = _user_frames(e)
    if not frames:
        return None
    f = frames[-1]
    line = (f.line or "").strip()
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": `{line}`" if line else "")


# ---------------------------------------------------------------- result assembly
def _build_captured(ep: torch.export.ExportedProgram, model: nn.Module) -> Captured:
    sig = ep.graph_signature
    params = {ph: _strip(fqn) for ph, fqn in sig.inputs_to_parameters.items()}
    buffers = {ph: _strip(fqn) for ph, fqn in sig.inputs_to_buffers.items()}
    aliases = _param_aliases(model, params, ep.graph)
    user_outputs = list(sig.user_outputs)
    if len(user_outputs) != 1:
        raise CaptureError(f"expected one scalar loss output, the graph returns {len(user_outputs)} values")
    nodes = {n.name: n for n in ep.graph.nodes}
    fqn_to_ph = {fqn: ph for ph, fqn in buffers.items()}
    mutated = {fqn_to_ph[_strip(fqn)]: out for out, fqn in sig.buffers_to_mutate.items()
               if _strip(fqn) in fqn_to_ph}
    mutated.update({b: n for b, n in _inplace_buffer_writes(ep.graph, buffers).items() if b not in mutated})
    # The graph's last placeholders, in call order; a None input (no target) keeps its placeholder.
    placeholders = [n.name for n in ep.graph.nodes if n.op == "placeholder"]
    user_inputs = placeholders[len(placeholders) - len(sig.user_inputs):]
    for name in user_inputs:
        nodes[name].meta["user_input"] = True  # (a value every rank is handed whole: the batch)
    return Captured(ep=ep, gm=ep.graph_module, params=params, buffers=buffers, param_aliases=aliases,
                    user_inputs=user_inputs, loss_node=nodes[user_outputs[0]], mutated_buffers=mutated)


# batch_norm's schema does not mark the running stats as written; it writes them when training.
_RUNNING_STATS = {"aten::batch_norm": (3, 4, 5), "aten::instance_norm": (3, 4, 5)}


def _inplace_buffer_writes(graph: torch.fx.Graph, buffers: dict[str, str]) -> dict[str, str]:
    """Buffer placeholder -> last node writing it in place (training IR keeps such updates in place)."""
    base: dict[torch.fx.Node, torch.fx.Node] = {}  # view node -> the placeholder it aliases
    writes: dict[str, str] = {}
    for n in graph.nodes:
        if n.op == "placeholder" and n.name in buffers:
            base[n] = n
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        schema = n.target._schema
        written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        stats = _RUNNING_STATS.get(schema.name)
        if stats and len(n.args) > stats[2] and n.args[stats[2]]:
            written += list(stats[:2])
        for i in written:
            arg = n.args[i] if i < len(n.args) else None
            if isinstance(arg, torch.fx.Node) and arg in base:
                writes[base[arg].name] = n.name
        # a view of a buffer aliases it (output 0 shares the input's storage)
        if schema.returns and schema.returns[0].alias_info is not None and n.args \
                and isinstance(n.args[0], torch.fx.Node) and n.args[0] in base:
            base[n] = base[n.args[0]]
    return writes


def _param_aliases(model: nn.Module, params: dict[str, str], graph: torch.fx.Graph) -> dict[str, tuple[str, ...]]:
    """Tied parameters: the placeholder the graph reads -> every FQN of that tensor.

    Export lifts one placeholder per FQN and reads only one of them; the others have no users.
    """
    by_id: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(fqn)
    fqn_to_ph = {fqn: ph for ph, fqn in params.items()}
    used = {n.name for n in graph.nodes if n.op == "placeholder" and n.users}
    out = {}
    for fqns in by_id.values():
        phs = [fqn_to_ph[f] for f in fqns if f in fqn_to_ph]
        if len(fqns) > 1 and phs:
            primary = next((ph for ph in phs if ph in used), phs[0])
            out[primary] = tuple(fqns)
    return out


# ---------------------------------------------------------------- hashing
def _hash_graph(h, gm: torch.fx.GraphModule, fqn: dict[str, str]) -> None:
    index = {}
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        val = n.meta.get("val")
        parts = [n.op, _target_name(n.target), _fmt(n.args, index), _fmt(n.kwargs, index), _fmt_val(val)]
        if n.op == "placeholder":
            parts.append(fqn.get(n.name, n.name))
        if n.op == "get_attr":
            sub = getattr(gm, n.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                _hash_graph(h, sub, {})
        h.update(("|".join(parts) + "\n").encode())


def _target_name(target) -> str:
    if isinstance(target, (str, torch._ops.OpOverload)):
        return str(target)
    name = getattr(target, "__name__", None) or str(target)
    return f"{getattr(target, '__module__', '') or ''}.{name}"


def _fmt(x, index) -> str:
    if isinstance(x, torch.fx.Node):
        return f"%{index.get(x, x.name)}"
    if isinstance(x, (list, tuple)):
        inner = ",".join(_fmt(v, index) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}:{_fmt(v, index)}" for k, v in x.items()) + "}"
    if isinstance(x, torch.Tensor):
        return f"T{tuple(x.shape)}{x.dtype}"
    return repr(x)


def _fmt_val(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{tuple(val.shape)}:{val.dtype}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_fmt_val(v) for v in val) + ")"
    return type(val).__name__ if val is not None else "-"
