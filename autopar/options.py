"""The keyword options of ``autopar.plan``, ``plan_profile`` and ``autopar.compile``, and the check
that refuses a misspelt or unknown one instead of letting it vanish into ``**options``."""
from __future__ import annotations

import difflib
import inspect
from typing import Callable, Iterable

#: Planner options read from ``**options`` rather than named in ``plan_profile``'s signature.
EXTRA_PLAN_OPTIONS = ("chunks",)


def keyword_names(fn: Callable) -> tuple[str, ...]:
    """The names ``fn`` takes by keyword (its ``**kwargs`` catch-all left out)."""
    return tuple(name for name, p in inspect.signature(fn).parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def plan_options() -> tuple[str, ...]:
    """Every option ``plan_profile`` understands (besides the profile and the mesh)."""
    from autopar.planner import plan_profile

    return tuple(n for n in keyword_names(plan_profile) if n not in ("gp", "mesh")) + EXTRA_PLAN_OPTIONS


def refuse_unknown(where: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Raise ``TypeError`` naming the first of ``given`` not in ``known`` and the closest known name."""
    known = sorted(set(known))
    for name in given:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f"; the options are: {', '.join(known)}"
        raise TypeError(f"{where}() got an unknown option {name!r}{hint}")
