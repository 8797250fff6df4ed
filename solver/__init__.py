"""solver: the joint sharding + checkpointing + memory ILP and pipeline helpers, in plain numbers.

Imports neither torch nor autopar (numpy, networkx, pulp only). Build a ``Problem`` of ``Node``,
``Edge`` and ``Segment`` records and call ``solve``; ``brute_force`` is the exhaustive reference.
The ILP is stated as math in ``solver.ilp``; the exact reductions in ``solver.reduce``.
"""
from .brute import brute_force
from .evaluate import Evaluation, evaluate, memory_terms
from .ilp import ilp_size, solve
from .model import (Edge, Infeasible, Node, Problem, Segment, Solution, SolverError, SolverWarning, fmt_bytes,
                    nodes_of)
from .restrict import merge, restrict
from . import pipeline

__all__ = ["Node", "nodes_of", "Edge", "Segment", "Problem", "Solution", "Infeasible", "SolverError", "SolverWarning",
           "solve", "ilp_size",
           "brute_force", "evaluate", "Evaluation", "memory_terms", "fmt_bytes", "pipeline",
           "restrict", "merge"]
