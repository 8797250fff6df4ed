r"""The joint sharding + checkpointing + memory ILP, built as numpy arrays and solved by HiGHS
(highspy's array API; PuLP's CBC when highspy is missing, see ``solver.compat``).

The ILP is built on the reduced problem of ``solver.reduce`` (tie classes ``C`` with their alive
strategies ``s``, class edges ``e = (a, b)``) and the checkpoint groups of ``solver.checkpoint_groups``
(twin groups ``G`` of ``n_G`` instances inside family groups ``F`` of ``n_F = n_G`` instances).
Seconds are divided by a scale ``T`` and bytes by ``B`` so coefficients are O(1); the stated
constant terms (``const_time``, ``const_bytes``, ``work_lb``) are what the reductions folded away.

Variables
    x[C,s]   in {0,1}        class C picks strategy s
    y[e,s,t] in [0,1]        edge e=(a,b) sees a on s and b on t (integral whenever x is)
    k[G]     in {0..n_G}     how many instances of twin group G are checkpointed
    w[G,C,s] >= 0            = k[G] * x[C,s] for every class C in G's nodes or keep nodes
    v[G,e,l] >= 0            = k[G] * sum_{(s,t) in L_l} y[e,s,t] for every class edge e whose
                             kept copies G holds, per level l (the y cells L_l where G keeps the
                             same bytes kept_Ge[l])
    z[G]     in {0,1}        = [k[G] >= 1] (for n_G = 1, z[G] is k[G] itself)
    tau      >= work_lb      the transient bytes on top of everything kept

Objective (``_Formulation.set_objective``), seconds per step
    min  sum_C sum_s time_C[s] x[C,s] + sum_e sum_{s,t} cost_e[s,t] y[e,s,t]
       + sum_G sum_C sum_s rec_GC[s] w[G,C,s] + const_time
    (with ``peak=True``: min P, the peak bytes, for the ``Infeasible`` report)

Constraints
    onehot[C]            sum_s x[C,s] = 1                                         (add_onehot)
    edge_src[e,s]        sum_t y[e,s,t] = x[a,s]                                  (add_edges)
    edge_dst[e,t]        sum_s y[e,s,t] = x[b,t]                                  (add_edges)
    ck_count[G,C]        sum_s w[G,C,s] = k[G]                                    (add_checkpoints)
    ck_link[G,C,s]       w[G,C,s] <= n_G x[C,s]                                   (add_checkpoints)
    ck_once[F,q]         sum_{G in Q_q} k[G] <= n_F   for each set Q_q of groups covering a
                         common node (nested segments: at most one per node)     (add_checkpoints)
    ck_any[G]            k[G] <= n_G z[G]                                         (add_checkpoints)
    ck_edge[G,e]         sum_l v[G,e,l] = k[G];  v[G,e,l] <= n_G sum_{L_l} y[e,s,t]  (add_checkpoints)
    transient_work[C]    tau >= sum_s work_C[s] x[C,s]                            (add_memory)
    transient_ckpt_w[G]  tau >= (sum_C sum_s act_GC[s] w[G,C,s]
                                + sum_e sum_l kept_Ge[l] v[G,e,l]) / n_G  (exact for n_G = 1)
                                                                                  (add_memory)
    transient_ckpt[G]    only for n_G > 1: tau >= sum_C sum_s act_GC[s] x[C,s]
                         + sum_e sum_{s,t} kept_Ge[s,t] y[e,s,t] - M_G (1 - z[G]),
                         M_G = sum_C max_s act_GC[s] + sum_e max kept_Ge          (add_memory)
    mem_peak             sum_C sum_s (static_C[s] + cov_C[s]) x[C,s]
                         + sum_e sum_{s,t} kept_e[s,t] y[e,s,t]
                         - sum_G sum_C sum_s act_GC[s] w[G,C,s]
                         - sum_G sum_e sum_l kept_Ge[l] v[G,e,l]
                         + sum_G sum_K sum_s keep_GK[s] w[G,K,s] + tau + const_bytes
                         <= memory_budget   (or <= P)                             (add_memory)

Exactness. For binary x the transportation rows force y[e,s,t] = x[a,s] x[b,t], and the
``ck_count``/``ck_link`` rows force w[G,C,s] = k[G] x[C,s]; so the ILP prices every choice exactly
as ``solver.evaluate`` does. ``time_C``/``static_C``/``cov_C``/``work_C`` are a class's summed
member terms (``cov``: saved bytes of members inside some segment); ``act_GC``, ``rec_GC``,
``keep_GK`` are one instance's bytes and seconds of group G on class C; ``kept_e`` the bytes the
consumers of class edge e keep (``Edge.mem``), ``kept_Ge`` one instance's part of it inside G. For integral x the y cells are one-hot, so one
level's v is k[G] and the others 0, exactly. Counts are turned back into
segment ids by ``solver.checkpoint_groups.decompose``.

Solve path (``solve``): answers are cached by ``Problem.digest``; with a budget the problem
without it is solved first and its optimum kept when it fits (a budget only removes choices);
without one the LP relaxation runs first and an integral optimum is returned as proven; otherwise
the MIP runs from the Lagrangian incumbent of ``solver.heuristic``, and its claimed optimum is
checked against that known answer (``_check_claim``).
"""
from __future__ import annotations

import dataclasses
import math
import time as _time
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pulp

from .compat import ArrayModel, solve_model
from .evaluate import describe_terms, evaluate, memory_terms
from .checkpoint_groups import decompose
from .heuristic import incumbent
from .model import Infeasible, Problem, Solution, SolverError, SolverWarning, fmt_bytes
from .reduce import Compact, reduce_problem

__all__ = ["solve", "ilp_size", "infeasible_error"]


@dataclass(frozen=True, kw_only=True)
class _Result:
    status: str
    picks: dict[int, int]
    counts: dict[int, int]
    gap: float
    seconds: float
    objective: float = math.nan
    """The ILP's own objective in seconds (bytes with ``peak``), without the folded constants."""
    bound: float = -math.inf
    """Proven lower bound of ``objective`` (same units)."""
    values: np.ndarray | None = None
    integral: bool = False


class _Formulation:
    """The ILP of the module docstring over ``cp`` as numpy arrays (``solver.compat.ArrayModel``);
    with ``peak`` it minimises the peak bytes. Columns are ints in creation order and rows keep
    their stable names in creation order: the same problem always gives the same model."""

    def __init__(self, cp: Compact, budget: float | None, *, peak: bool = False, name: str = ""):
        self.cp, self.budget, self.peak, self.name = cp, budget, peak, name
        self.memory = budget is not None
        self.rows: dict[str, int] = {}  # stable row name -> row index
        self.col_names: list[str] = []
        self._lo: list[float] = []
        self._up: list[float] = []
        self._int: list[bool] = []
        self._starts, self._index, self._value = [0], [], []  # CSR rows, grown in blocks
        self._rlo: list[float] = []
        self._rup: list[float] = []
        self.cost: np.ndarray | None = None
        cls = cp.classes.values()
        # Scales: seconds divided by the largest time coefficient and bytes by the largest byte
        # coefficient, so the matrix and costs span O(1) (HiGHS warns on tiny costs otherwise).
        recs = [r for g in cp.groups for r in g.rec.values()]
        byts = ([b for g in cp.groups for d in (g.act, g.keep, g.emem) for b in d.values()]
                + list(cp.emem.values()))
        self.T = max([float(np.abs(t.time[t.alive]).max()) for t in cls]
                     + [float(np.abs(m).max()) for m in cp.edges.values()]
                     + [float(r.max()) for r in recs] + [1e-30])
        self.B = max([float((t.static + t.cov)[t.alive].max()) for t in cls]
                     + [float(t.work[t.alive].max()) for t in cls] + [float(b.max()) for b in byts] + [1.0])
        self.x: dict[int, dict[int, int]] = {}
        self.y: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.k: dict[int, int] = {}
        self.w: dict[tuple[int, int], dict[int, int]] = {}
        self.v: dict[tuple[int, tuple[int, int]], tuple[np.ndarray, np.ndarray]] = {}  # (G, e) -> (v, levels)
        self.kept: dict[tuple[int, int], np.ndarray] = {}          # e -> kept_e per y column
        self.kept_g: dict[tuple[int, tuple[int, int]], np.ndarray] = {}  # (G, e) -> kept_Ge per y column
        self.z: dict[int, int] = {}
        self.add_onehot()
        self.add_edges()
        if self.memory:
            self.add_checkpoints()
            self.add_memory()
        self.set_objective()

    def var(self, name: str, low: float | None = 0.0, up: float | None = None, cat=pulp.LpContinuous) -> int:
        """A new column (its index); ``cat`` is PuLP's category word (binary = integer in [0, 1])."""
        self.col_names.append(name)
        binary = cat == pulp.LpBinary
        self._lo.append(-math.inf if low is None else float(low))
        self._up.append(1.0 if binary else math.inf if up is None else float(up))
        self._int.append(binary or cat == pulp.LpInteger)
        return len(self.col_names) - 1

    def block(self, count: int, low: float = 0.0, up: float = math.inf) -> int:
        """``count`` continuous columns at once; returns the first index (the caller names them)."""
        first = len(self._lo)
        self._lo.extend([low] * count)
        self._up.extend([up] * count)
        self._int.extend([False] * count)
        return first

    def row(self, name: str, terms: dict, sense: int, rhs: float) -> None:
        """Add ``sum terms (sense) rhs`` under the stable ``name``; ``terms``: column -> coefficient."""
        self.rows_block([name], [len(terms)], list(terms), list(terms.values()), sense, [rhs])

    def rows_block(self, names: list[str], sizes, cols, coefs, sense: int, rhs) -> None:
        """Several rows at once: row ``r`` has ``sizes[r]`` entries, taken in order from ``cols``
        and ``coefs``; all share ``sense`` (PuLP's -1 <=, 0 =, 1 >=)."""
        for name in names:
            while name in self.rows:  # a repeated label: keep both rows, the later one primed
                name += "'"
            self.rows[name] = len(self.rows)
        self._starts.extend((self._starts[-1] + np.cumsum(sizes)).tolist())
        self._index.append(np.asarray(cols, dtype=np.int32))
        self._value.append(np.asarray(coefs, dtype=np.float64))
        rhs = [float(v) for v in rhs]
        self._rlo.extend(rhs if sense != pulp.LpConstraintLE else [-math.inf] * len(rhs))
        self._rup.extend(rhs if sense != pulp.LpConstraintGE else [math.inf] * len(rhs))

    def add_onehot(self) -> None:
        """x[C,s] binaries and onehot[C]."""
        for c, t in self.cp.classes.items():
            self.x[c] = {int(s): self.var(f"x_{c:06d}_{s:04d}", cat=pulp.LpBinary) for s in t.alive}
            self.row(f"onehot[{self.cp.names[c]}]", {v: 1.0 for v in self.x[c].values()}, pulp.LpConstraintEQ, 1.0)

    def add_edges(self) -> None:
        """y[e,i,j] over the row groups I_i / column groups J_j of each edge's cost (strategies with
        identical cost rows / columns) and the transportation rows edge_src[e,i], edge_dst[e,j]."""
        held: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}  # e -> [(G, kept_Ge)]
        for g, grp in enumerate(self.cp.groups if self.memory else ()):
            for key, m in grp.emem.items():
                held.setdefault(key, []).append((g, m))
        for e, ((a, b), m) in enumerate(self.cp.edges.items()):
            sa, sb = sorted(self.x[a]), sorted(self.x[b])
            kept = self.cp.emem.get((a, b)) if self.memory else None
            layers = [m] + ([kept] + [k for _, k in held.get((a, b), ())] if kept is not None else [])
            rows, cols, _ = _groups(np.stack([x[np.ix_(sa, sb)] for x in layers], axis=-1))
            first_r, first_c = [g[0] for g in rows], [g[0] for g in cols]
            cost = m[np.ix_(sa, sb)][np.ix_(first_r, first_c)]
            if kept is not None:
                self.kept[(a, b)] = kept[np.ix_(sa, sb)][np.ix_(first_r, first_c)].ravel()
                for g, k in held.get((a, b), ()):
                    self.kept_g[(g, (a, b))] = k[np.ix_(sa, sb)][np.ix_(first_r, first_c)].ravel()
            ni, nj = len(rows), len(cols)
            first = self.block(ni * nj, 0.0, 1.0)
            ye = np.arange(first, first + ni * nj).reshape(ni, nj)  # column of y[e,i,j]
            self.col_names.extend(f"y_{e:06d}_{i:04d}_{j:04d}" for i in range(ni) for j in range(nj))
            self.y[(a, b)] = (ye, cost)
            tag = f"{self.cp.names[a]}->{self.cp.names[b]}"
            # edge_src[e,i]: sum_j y[i,j] - sum_{s in I_i} x[a,s] = 0 (named by the group's first strategy)
            xa = [[self.x[a][sa[s]] for s in g] for g in rows]
            self.rows_block([f"edge_src[{tag},{sa[g[0]]}]" for g in rows], [nj + len(g) for g in xa],
                            np.concatenate([np.concatenate([ye[i], g]) for i, g in enumerate(xa)]),
                            np.concatenate([[1.0] * nj + [-1.0] * len(g) for g in xa]), pulp.LpConstraintEQ, [0.0] * ni)
            xb = [[self.x[b][sb[t]] for t in g] for g in cols]
            self.rows_block([f"edge_dst[{tag},{sb[g[0]]}]" for g in cols], [ni + len(g) for g in xb],
                            np.concatenate([np.concatenate([ye[:, j], g]) for j, g in enumerate(xb)]),
                            np.concatenate([[1.0] * ni + [-1.0] * len(g) for g in xb]), pulp.LpConstraintEQ, [0.0] * nj)

    def add_checkpoints(self) -> None:
        """k[G], w[G,C,s], z[G] with ck_count, ck_link, ck_any and ck_once."""
        for g, grp in enumerate(self.cp.groups):
            kg = self.var(f"k_{g:05d}", 0.0, float(grp.n), pulp.LpInteger)
            self.k[g] = kg
            for c in sorted(set(grp.act) | set(grp.keep)):
                wg = {s: self.var(f"w_{g:05d}_{c:06d}_{s:04d}") for s in self.x[c]}
                self.w[(g, c)] = wg
                self.row(f"ck_count[{grp.label},{self.cp.names[c]}]", {**{v: 1.0 for v in wg.values()}, kg: -1.0},
                         pulp.LpConstraintEQ, 0.0)
                for s, v in wg.items():
                    self.row(f"ck_link[{grp.label},{self.cp.names[c]},{s}]", {v: 1.0, self.x[c][s]: -float(grp.n)},
                             pulp.LpConstraintLE, 0.0)
            for key in sorted(k for (h, k) in self.kept_g if h == g):
                ye = self.y[key][0].ravel()
                levels, which = np.unique(self.kept_g[(g, key)], return_inverse=True)
                first = self.block(levels.size, 0.0, float(grp.n))
                vs = np.arange(first, first + levels.size)
                tag = f"{grp.label},{self.cp.names[key[0]]}->{self.cp.names[key[1]]}"
                self.col_names.extend(f"v_{g:05d}_{key[0]:06d}_{key[1]:06d}_{lv:04d}" for lv in range(levels.size))
                self.v[(g, key)] = (vs, levels)
                self.row(f"ck_edge[{tag}]", {**{int(v): 1.0 for v in vs}, kg: -1.0}, pulp.LpConstraintEQ, 0.0)
                for lv, v in enumerate(vs):
                    cells = ye[which == lv]
                    self.row(f"ck_edge_link[{tag},{lv}]", {int(v): 1.0, **{int(y): -float(grp.n) for y in cells}},
                             pulp.LpConstraintLE, 0.0)
            if grp.n == 1:
                self.z[g] = kg
            else:
                self.z[g] = self.var(f"z_{g:05d}", cat=pulp.LpBinary)
                self.row(f"ck_any[{grp.label}]", {kg: 1.0, self.z[g]: -float(grp.n)}, pulp.LpConstraintLE, 0.0)
        for f, fam in enumerate(self.cp.fams):
            for q, cover in enumerate(fam.covers):
                label = self.cp.groups[fam.groups[0]].label
                self.row(f"ck_once[{label},{q}]", {self.k[g]: 1.0 for g in cover}, pulp.LpConstraintLE, float(fam.n))

    def add_memory(self) -> None:
        """tau, transient_work[C], transient_ckpt[G] and mem_peak (all bytes divided by B)."""
        B, cp = self.B, self.cp
        lb = max([cp.work_lb] + [float(t.work[t.alive].min()) for t in cp.classes.values()])
        self.tau = self.var("tau", lb / B)
        for c, t in cp.classes.items():
            if t.work[t.alive].max() > lb:
                terms = {v: float(t.work[s]) / B for s, v in self.x[c].items()}
                self.row(f"transient_work[{cp.names[c]}]", {**terms, self.tau: -1.0}, pulp.LpConstraintLE, 0.0)
        for g, grp in enumerate(cp.groups):
            terms, big = {}, 0.0
            for c, act in grp.act.items():
                big += float(act[cp.classes[c].alive].max()) / B
                for s, v in self.x[c].items():
                    terms[v] = terms.get(v, 0.0) + float(act[s]) / B
            for key in grp.emem:
                k = self.kept_g[(g, key)]
                big += float(k.max()) / B
                for v, coef in zip(self.y[key][0].ravel(), k):
                    terms[int(v)] = terms.get(int(v), 0.0) + float(coef) / B
            if big <= 0:
                continue
            # tau >= A_G(x) k_G / n_G = sum act w / n_G: exact for n_G = 1 (w = z x) and, unlike the
            # big-M row, tight in the LP: a half-checkpointed segment saves half its bytes in
            # mem_peak but also lifts tau by half of them, as the integer model does.
            terms_w = {v: float(act[s]) / (B * grp.n) for c, act in grp.act.items()
                       for s, v in self.w[(g, c)].items()}
            for key in grp.emem:
                for v, coef in zip(*self.v[(g, key)]):
                    terms_w[int(v)] = float(coef) / (B * grp.n)
            self.row(f"transient_ckpt_w[{grp.label}]", {**terms_w, self.tau: -1.0}, pulp.LpConstraintLE, 0.0)
            if grp.n > 1:  # tau >= A_G(x) - M_G (1 - z_G): exact when 1 <= k_G < n_G
                terms[self.z[g]] = big
                terms[self.tau] = -1.0
                self.row(f"transient_ckpt[{grp.label}]", terms, pulp.LpConstraintLE, big)
        terms: dict = {self.tau: 1.0}
        for c, t in cp.classes.items():
            for s, v in self.x[c].items():
                terms[v] = float(t.static[s] + t.cov[s]) / B
        for (g, c), ws in self.w.items():
            grp = cp.groups[g]
            for s, v in ws.items():
                coef = float(grp.keep[c][s]) if c in grp.keep else 0.0
                coef -= float(grp.act[c][s]) if c in grp.act else 0.0
                terms[v] = terms.get(v, 0.0) + coef / B
        for key, k in self.kept.items():
            for v, coef in zip(self.y[key][0].ravel(), k):
                if coef:
                    terms[int(v)] = terms.get(int(v), 0.0) + float(coef) / B
        for (g, key), (vs, levels) in self.v.items():
            for v, coef in zip(vs, levels):
                if coef:
                    terms[int(v)] = -float(coef) / B
        if self.peak:
            self.P = self.var("P")
            terms[self.P] = -1.0
            self.row("mem_peak", terms, pulp.LpConstraintLE, -cp.const_static / B)
        else:
            self.row("mem_peak", terms, pulp.LpConstraintLE, (self.budget - cp.const_static) / B)

    def set_objective(self) -> None:
        """Seconds (divided by T): node time + resharding + recompute; or the peak P."""
        cost = np.zeros(len(self._lo))
        if self.peak:
            cost[self.P] = 1.0
            self.cost = cost
            return
        T, cp = self.T, self.cp
        for c, t in cp.classes.items():
            for s, v in self.x[c].items():
                cost[v] = float(t.time[s]) / T
        for ys, m in self.y.values():
            cost[ys.ravel()] = m.ravel() / T
        for (g, c), ws in self.w.items():
            rec = cp.groups[g].rec.get(c)
            for s, v in ws.items():
                if rec is not None and rec[s] != 0:
                    cost[v] = float(rec[s]) / T
        self.cost = cost

    @property
    def num_variables(self) -> int:
        return len(self._lo)

    def model(self) -> ArrayModel:
        """The formulation as arrays, columns and rows in creation order."""
        index = np.concatenate(self._index) if self._index else np.zeros(0, dtype=np.int32)
        value = np.concatenate(self._value) if self._value else np.zeros(0)
        return ArrayModel(cost=self.cost, col_lo=np.array(self._lo), col_up=np.array(self._up),
                          integer=np.array(self._int, dtype=bool), row_lo=np.array(self._rlo),
                          row_up=np.array(self._rup), starts=np.array(self._starts, dtype=np.int32),
                          index=index.astype(np.int32), value=value, col_names=tuple(self.col_names),
                          row_names=tuple(self.rows))

    def run(self, time_limit: float, mip_gap: float, *, start: np.ndarray | None = None,
            relax: bool = False) -> _Result:
        """Solve (the LP relaxation with ``relax``); status is "optimal", "time_limit" or
        "infeasible" (SolverError otherwise). ``start``: a feasible point to begin from.
        ``_Result.integral`` says whether the relaxation's optimum is already integral."""
        if not self.cp.classes:  # everything was folded into constants: only the budget to check
            fits = self.peak or not self.memory or self.cp.const_static + self.cp.work_lb <= self.budget
            return _Result(status="optimal" if fits else "infeasible", picks={}, counts={}, gap=0.0, seconds=0.0,
                           integral=True)
        model = self._model = getattr(self, "_model", None) or self.model()
        # The relaxation runs without presolve: on sharding models presolve removes ~1% of the
        # rows and costs 4x the simplex itself (0.4 s of 0.5 s on Llama-3-8B 8x8).
        # With a start, the primal heuristics that hunt for a first incumbent (feasibility jump,
        # RINS, RENS) are dropped: on the GPT-2 frontier problems that saved 10-35% of the time.
        options = ({"presolve": "off"} if relax else
                   {f"mip_heuristic_run_{h}": False for h in ("feasibility_jump", "rins", "rens")} if start else None)
        out = solve_model(model, time_limit, mip_gap, start=start, relax=relax, options=options)
        if relax and out.status != "optimal":  # the caller goes on to the MIP
            return _Result(status=out.status, picks={}, counts={}, gap=math.inf, seconds=out.seconds)
        if out.status not in ("optimal", "time_limit", "infeasible"):
            raise SolverError(f"the MIP solver ended with status {out.status!r} and no usable solution "
                              f"after {out.seconds:.1f} s; raise Problem.time_limit (now {time_limit} s) "
                              f"or Problem.mip_gap")
        if out.status == "infeasible":
            return _Result(status=out.status, picks={}, counts={}, gap=math.inf, seconds=out.seconds)
        val = out.values
        picks = {c: max(xs, key=lambda s: (val[xs[s]], -s)) for c, xs in self.x.items()}
        counts = {g: int(round(val[k])) for g, k in self.k.items()}
        scale = self.B if self.peak else self.T
        ints = val[model.integer]
        integral = bool(np.all(np.abs(ints - np.round(ints)) <= 1e-6))
        return _Result(status=out.status, picks=picks, counts=counts, gap=out.gap, seconds=out.seconds,
                       objective=out.objective * scale, bound=out.bound * scale, values=val, integral=integral)

    def start(self, problem: Problem, choice: dict[str, int], ckpt: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(columns, values) of the x and k columns of a known answer, for a MIP start; a class
        whose chosen strategy was pruned is left out (HiGHS completes a partial start)."""
        cols: list[int] = []
        vals: list[float] = []
        first = {c: problem.nodes[m[0]].id for c, m in enumerate(problem.classes)}
        for c, xs in self.x.items():
            s = choice[first[c]]
            if s in xs:
                cols += list(xs.values())
                vals += [1.0 if t == s else 0.0 for t in xs]
        picked = {problem.segments[g].id for g in range(len(problem.segments))} & set(ckpt)
        for g, k in self.k.items():
            cols.append(k)
            vals.append(float(sum(problem.segments[i].id in picked for i in self.cp.groups[g].segments)))
        return np.array(cols, dtype=np.int32), np.array(vals)

    def decode(self, problem: Problem, res: _Result) -> tuple[dict[str, int], tuple[str, ...]]:
        """Node id -> strategy and checkpointed segment ids from an ILP result."""
        per_class = self.cp.expand(res.picks)
        cof = problem.class_of
        choice = {n.id: int(per_class[int(cof[i])]) for i, n in enumerate(problem.nodes)}
        segs: list[int] = []
        for fam in self.cp.fams:
            segs += decompose(fam, {g: res.counts.get(g, 0) for g in fam.groups})
        return choice, tuple(problem.segments[g].id for g in sorted(segs))


def _groups(m: np.ndarray) -> tuple[list[list[int]], list[list[int]], np.ndarray]:
    """Row groups and column groups of identical entries of ``m`` (k_a, k_b) or (k_a, k_b, L)
    (several matrices at once), in first-seen order, and the (rows, cols) matrix of their common
    entries. Resharding costs depend on the producer's output placement and the consumer's wanted
    input, so 10 strategies often make 3-4 groups."""
    def split(mat: np.ndarray) -> list[list[int]]:
        seen: dict[bytes, list[int]] = {}
        for i, r in enumerate(mat):
            seen.setdefault(r.tobytes(), []).append(i)
        return list(seen.values())

    rows, cols = split(m), split(m.swapaxes(0, 1))
    return rows, cols, m[np.ix_([g[0] for g in rows], [g[0] for g in cols])]


#: Solutions by ``Problem.digest``: planners solve the same per-stage problem for several
#: pipeline shapes and micro-batch counts; a hit costs a hash instead of an ILP.
_CACHE: OrderedDict[str, Solution | Infeasible] = OrderedDict()
CACHE_SIZE = 64
"""Most problems whose answers ``solve`` keeps (least recently used go first)."""


def solve(problem: Problem) -> Solution:
    """Choose a strategy per node and the checkpointed segments minimising seconds per step under
    ``problem.memory_budget``. Deterministic: the same problem always yields the same solution
    (answers are cached by the problem's content, ``Problem.digest``).
    Raises ``Infeasible`` (with ``min_budget`` and ``dominant``) when no choice fits the budget and
    ``SolverError`` when the time limit ends before any feasible solution is found."""
    key = problem.digest
    hit = _CACHE.get(key)
    if hit is None:
        try:
            hit = _solve(problem)
        except Infeasible as err:
            hit = err
        _CACHE[key] = hit
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    if isinstance(hit, Infeasible):
        raise Infeasible(str(hit), min_budget=hit.min_budget, dominant=hit.dominant)
    return dataclasses.replace(hit, choice=dict(hit.choice), split=dict(hit.split), stats=dict(hit.stats))


def _solve(problem: Problem) -> Solution:
    """``solve`` without the cache. With a budget, the problem without it comes first (the exact
    reductions usually fold it to a handful of columns): when its optimum fits the budget it is
    the optimum, since the budget only removes choices. Otherwise the budgeted MIP runs from the
    Lagrangian incumbent, which its answer is then checked against."""
    if problem.memory_budget is not None:
        free = solve(dataclasses.replace(problem, memory_budget=None))
        if free.peak_bytes <= problem.memory_budget:
            return dataclasses.replace(free, stats={**free.stats, "budget_binds": 0})
        sol = _solve_ilp(problem, lp_first=False)
        return dataclasses.replace(sol, stats={**sol.stats, "budget_binds": 1})
    return _solve_ilp(problem, lp_first=True)


def _solve_ilp(problem: Problem, *, lp_first: bool) -> Solution:
    """Reduce, formulate and solve. With ``lp_first`` the LP relaxation runs first: on sharding
    models without a budget it is usually integral, and then it is the optimum (its own bound)."""
    t0 = _time.perf_counter()
    cp = reduce_problem(problem)
    form = _Formulation(cp, problem.memory_budget, name=problem.name)
    build = _time.perf_counter() - t0
    seconds = 0.0
    if lp_first:
        lp = form.run(problem.time_limit, 0.0, relax=True)
        seconds = lp.seconds
        if lp.status == "optimal" and lp.integral:
            return _solution(problem, form, lp, "optimal", 0.0, build, seconds)
    t1 = _time.perf_counter()
    known = incumbent(problem, lambda p: _solve_ilp(p, lp_first=True)) if problem.memory_budget else None
    start = form.start(problem, known[0], known[1]) if known and form.x else None
    seconds += _time.perf_counter() - t1  # the incumbent's search counts as solving
    left = max(problem.time_limit - seconds, 0.1 * problem.time_limit)
    res = form.run(left, problem.mip_gap, start=start)
    if res.status == "infeasible":
        if known is not None:
            raise SolverError(f"problem {problem.name!r}: the MIP solver calls the budget infeasible, but "
                              f"a known answer fits it ({known[2]!r} s); the solver's answer is wrong")
        raise infeasible_error(problem, cp)
    sol = _solution(problem, form, res, res.status, res.gap, build, seconds + res.seconds)
    return sol if known is None else _check_claim(problem, sol, known, res.bound + cp.const_time)


def _check_claim(problem: Problem, sol: Solution, known, bound: float) -> Solution:
    """The MIP's answer against a known feasible one: a solver that stops on a worse point than one
    we hold (a claimed optimum above a known answer by more than its gap, or a weaker incumbent
    at a time limit) is overruled, with a warning when it claimed optimality."""
    choice, ckpt, objective = known
    if objective >= sol.objective * (1 - 1e-12):
        return sol
    if sol.status == "optimal" and objective < sol.objective * (1 - problem.mip_gap) - 1e-15:
        warnings.warn(f"problem {problem.name!r}: the MIP solver claimed {sol.objective!r} s optimal within a "
                      f"gap of {problem.mip_gap}, but a known answer costs {objective!r} s; returning that one",
                      SolverWarning, stacklevel=3)
        status = "unproven"
    else:
        status = sol.status
    ev = evaluate(problem, choice, ckpt)
    gap = max(0.0, (ev.objective - bound) / ev.objective) if ev.objective > 0 and math.isfinite(bound) else math.nan
    return dataclasses.replace(sol, choice=dict(choice), checkpointed=ckpt, objective=ev.objective, split=ev.split,
                               peak_bytes=ev.peak_bytes, status=status, gap=gap if status != "unproven" else math.nan,
                               stats={**sol.stats, "incumbent_kept": 1})


def _solution(problem: Problem, form: _Formulation, res: _Result, status: str, gap: float, build: float,
              seconds: float) -> Solution:
    choice, ckpt = form.decode(problem, res)
    ev = evaluate(problem, choice, ckpt)
    return Solution(choice=choice, checkpointed=ckpt, objective=ev.objective, split=ev.split,
                    peak_bytes=ev.peak_bytes, status=status, gap=gap, num_variables=form.num_variables,
                    num_constraints=len(form.rows), solve_seconds=seconds, build_seconds=build,
                    stats=dict(form.cp.stats))


def ilp_size(problem: Problem) -> dict[str, int]:
    """The ILP's size after the exact reductions, without solving: ``variables``, ``constraints``
    and the reduction figures of ``Solution.stats``."""
    cp = reduce_problem(problem)
    form = _Formulation(cp, problem.memory_budget, name=problem.name)
    return {"variables": form.num_variables, "constraints": len(form.rows), **cp.stats}


def infeasible_error(problem: Problem, cp: Compact | None = None) -> Infeasible:
    """The ``Infeasible`` for ``problem``: a second ILP minimises the peak to find ``min_budget``."""
    cp = cp or reduce_problem(problem)
    form = _Formulation(cp, problem.memory_budget, peak=True, name=problem.name)
    res = form.run(problem.time_limit, 0.0)
    choice, ckpt = form.decode(problem, res)
    least = evaluate(problem, choice, ckpt).peak_bytes
    dominant = describe_terms(memory_terms(problem, choice, ckpt))
    bound = "" if res.status == "optimal" else " (an upper bound: the peak ILP hit its time limit)"
    msg = (f"problem {problem.name!r}: no choice fits memory_budget={fmt_bytes(problem.memory_budget)} "
           f"(row 'mem_peak' cannot hold); the smallest feasible budget is {fmt_bytes(least)} "
           f"({math.ceil(least)} bytes){bound}, dominated by: {'; '.join(dominant) or 'nothing'}. "
           f"Raise memory_budget to at least {math.ceil(least)} bytes, or offer strategies that shard these "
           f"terms further (more devices, parameter sharding, checkpoint segments).")
    return Infeasible(msg, min_budget=least, dominant=dominant)
