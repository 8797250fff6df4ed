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
  instead of at construction. Same graph, same module attributes.

Both replace private functions of ``torch.export`` (torch is pinned to 2.13.0); each falls back
to the original function when anything about its shortcut fails; :func:`profiler.capture.capture`
reruns plain ``torch.export.export`` when a failure went through the trimmed path; outside torch
2.13 nothing is replaced.
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
    except ImportError:
        return []
    targets = [(trace, "_replace_unbacked_bindings", _skip_without_unbacked),
               (exported_program, "_create_graph_module_for_export", _lazy_graph_module)]
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

