"""``torch.export`` without the work whose result is known in advance: same program, less time.

Where a capture's time goes (Llama-2-7B, batch 8 x 2048, torch 2.13.0, process CPU seconds of
``torch.export.export(strict=False)`` on a 2-core machine; ``benchmarks/profile_speed.py``):

=========================================  =======  =============================================
phase                                      seconds  what it is
=========================================  =======  =============================================
pre-dispatch trace (``make_fx``)           ~4.7     every op: torch-function modes, the proxy
                                                    tracer (node, ``meta["val"]`` snapshot,
                                                    ``tensor_meta``), fake dispatch with
                                                    python-dispatcher decompositions
``_replace_unbacked_bindings``             0.17     walks every node's shapes for unbacked
                                                    symbols; static shapes have none
``replace_set_grad_with_hop_pass``         0.16     HF rotary ``@torch.no_grad()``: split + inline
``ExportedProgram`` graph module           0.15     eager Python code generation of 2,222 nodes
runtime asserts, naming, verifier, guards  ~0.1     (guards, range constraints: ~0)
=========================================  =======  =============================================

The trace itself cannot be trimmed without changing the program (it *is* the program); what
:func:`trimmed_export` removes is exact:

- ``_replace_unbacked_bindings`` when the shape environment holds no unbacked symbol (no
  data-dependent size was created): the pass would look for symbols in an empty set and only
  drop ``meta["unbacked_bindings"]``, which we drop too;
- the final ``ExportedProgram`` graph module is a lazy one (``_LazyGraphModule``, what
  ``torch.compile`` uses): its Python code is generated on first call or ``.code`` access
  instead of at construction. Same graph, same module attributes;
- ``meta["tensor_meta"]``'s memory format, which the tracer computes for every node with
  ``torch._prims_common``'s symbolic contiguity checks, is integer arithmetic when sizes and
  strides are ints (about 10 us instead of 35 us a node: ~50 ms, ~1.3%, of a Llama-2-7B
  capture); other shapes take the original path.

Each replaces a private function of ``torch.export`` or its tracer (torch is pinned to 2.13.0)
and falls back to the original function when anything about its shortcut fails;
:func:`profiler.capture.capture` reruns plain ``torch.export.export`` when a failure went
through the trimmed path; outside torch 2.13 nothing is replaced.
"""
from __future__ import annotations

import contextlib
import functools
import traceback
from typing import Callable, Iterator

import torch

#: torch versions whose export internals these shortcuts were written against.
SUPPORTED_TORCH = ("2.13.",)


def _targets() -> list[tuple[object, str, Callable[[Callable], Callable]]]:
    """(module, function name, wrapper factory) for each export internal we replace."""
    try:
        import torch.export._trace as trace
        import torch.export.exported_program as exported_program
        import torch.fx.experimental.proxy_tensor as proxy_tensor
    except ImportError:
        return []
    targets = [(trace, "_replace_unbacked_bindings", _skip_without_unbacked),
               (exported_program, "_create_graph_module_for_export", _lazy_graph_module),
               (proxy_tensor, "_extract_tensor_metadata", _static_tensor_metadata)]
    if not torch.__version__.startswith(SUPPORTED_TORCH):
        return []
    return [t for t in targets if callable(getattr(t[0], t[1], None))]


class Trimming:
    """What :func:`trimmed_export` did: whether shortcuts are in place, and whether one failed."""

    def __init__(self):
        self.active = False
        """True when export internals were replaced (torch 2.13)."""
        self.failures: list[BaseException] = []
        """Exceptions that went through a shortcut (the shortcut's own or the original's)."""

    def caused(self, e: BaseException) -> bool:
        """Whether ``e`` may come from the trimmed path rather than from the model: it went
        through a shortcut, or through the lazy graph module's deferred code generation."""
        from torch.fx import _lazy_graph_module

        lazy = _lazy_graph_module.__file__
        seen: set[int] = set()
        while e is not None and id(e) not in seen:  # export may re-raise as another type
            seen.add(id(e))
            if any(f is e for f in self.failures):
                return True
            if self.active and any(f.filename == lazy for f in traceback.extract_tb(e.__traceback__)):
                return True
            e = e.__cause__ or e.__context__
        return False


@contextlib.contextmanager
def trimmed_export() -> Iterator[Trimming]:
    """Within the block ``torch.export`` skips the redundant passes above.

    Yields a :class:`Trimming`; callers rerun plain export when ``trimming.caused(error)``. Not
    thread-safe (it replaces module attributes of ``torch.export`` for the duration), like
    export's own global flags.
    """
    state = Trimming()
    replaced = []
    try:
        for module, name, make in _targets():
            original = getattr(module, name)
            setattr(module, name, _recording(make(original), state))
            replaced.append((module, name, original))
        state.active = bool(replaced)
        yield state
    finally:
        for module, name, original in reversed(replaced):
            setattr(module, name, original)


def _recording(fn: Callable, state: Trimming) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            state.failures.append(e)
            raise

    return call


def _skip_without_unbacked(original: Callable) -> Callable:
    @functools.wraps(original)
    def replace_unbacked_bindings(gm: torch.fx.GraphModule) -> None:
        try:
            shape_env, unbacked = _unbacked_symbols(gm)
        except Exception:  # internals moved: let export do its own pass
            return original(gm)
        if shape_env is None:
            return None  # the original returns here too
        if unbacked:
            return original(gm)
        for node in gm.graph.nodes:  # all the original would do with no symbol to look for
            node.meta.pop("unbacked_bindings", None)
        return None

    return replace_unbacked_bindings


def _unbacked_symbols(gm: torch.fx.GraphModule):
    """(shape env, its unbacked symbols not renamed), as ``_replace_unbacked_bindings`` computes them."""
    from torch._export.utils import _get_shape_env_from_gm
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    shape_env = _get_shape_env_from_gm(gm)
    if shape_env is None:
        return None, set()
    unbacked = {s for s in shape_env.var_to_range
                if symbol_is_type(s, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))
                and s not in shape_env.unbacked_renamings}
    return shape_env, unbacked


def _lazy_graph_module(original: Callable) -> Callable:
    @functools.wraps(original)
    def create_graph_module_for_export(root, graph):
        try:
            from torch.fx._lazy_graph_module import _LazyGraphModule

            return _LazyGraphModule(root, graph)
        except Exception:  # e.g. code generation the lazy module cannot defer: export's own way
            return original(root, graph)

    return create_graph_module_for_export



def _static_tensor_metadata(original: Callable) -> Callable:
    """``meta["tensor_meta"]`` of a node, without the symbolic machinery when shapes are ints.

    The tracer computes a ``TensorMetadata`` for every node; its memory format comes from
    ``torch._prims_common``'s contiguity checks, written for symbolic sizes (a guard per
    dimension). With plain-int sizes and strides the same checks are a few integer comparisons:
    :func:`_memory_format` is that arithmetic, tested equal on random strided layouts.
    """
    from torch.fx.passes.shape_prop import TensorMetadata

    @functools.wraps(original)
    def extract_tensor_metadata(result, include_contiguity: bool = True):
        try:
            shape, stride = result.shape, result.stride()
            simple = (result.layout == torch.strided and not result.is_quantized
                      and all(type(v) is int for v in shape) and all(type(v) is int for v in stride))
        except Exception:  # sparse, opaque or symbolic: the general path
            simple = False
        if not simple:
            return original(result, include_contiguity)
        fmt = _memory_format(tuple(shape), stride) if include_contiguity else None
        return TensorMetadata(shape, result.dtype, result.requires_grad, stride, fmt, False, {})

    return extract_tensor_metadata


#: (memory format, dimension order from fastest to slowest) for the channels-last layouts.
_CHANNELS_LAST = ((torch.channels_last, 4, (1, 3, 2, 0)), (torch.channels_last_3d, 5, (1, 4, 3, 2, 0)))


def _memory_format(shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.memory_format | None:
    """The first of contiguous / channels-last / channels-last-3d that (shape, stride) satisfies,
    as ``torch.fx.passes.shape_prop._extract_tensor_metadata`` picks it; None for none.

    Same rules as ``torch._prims_common.is_contiguous`` and ``is_channels_last_contiguous_{2,3}d``
    with int sizes: dimensions of size 1 are skipped; contiguous also accepts fewer than 2
    elements, and a stride equal to the running product of sizes with 0 counted as 1.
    """
    if _is_contiguous(shape, stride):
        return torch.contiguous_format
    for fmt, ndim, order in _CHANNELS_LAST:
        if len(shape) == ndim and _strides_follow(shape, stride, order):
            return fmt
    return None


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    numel = 1
    for size in shape:
        numel *= size
    if numel < 2:
        return True
    expected = expected_max = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size == 1:
            continue
        if st != expected and st != expected_max:
            return False
        expected_max *= max(size, 1)
        expected *= size
    return True


def _strides_follow(shape: tuple[int, ...], stride: tuple[int, ...], order: tuple[int, ...]) -> bool:
    expected = 1
    for idx in order:
        if shape[idx] == 1:
            continue
        if stride[idx] != expected:
            return False
        expected *= shape[idx]
    return True
