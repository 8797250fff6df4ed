"""Plan files: exact JSON round trip, schema errors that name the field, a fuzzed loader."""
import json

import pytest
from hypothesis import given, settings, strategies as st

from autopar.plan import NodePlan, Pipeline, Plan, PlanError


def _plan(**kw) -> Plan:
    nodes = {
        "x": NodePlan(strategy="input", inputs=[], outputs=["S(0)R"], input_grads=[]),
        "w": NodePlan(strategy="param", inputs=[], outputs=["RS(0)"], input_grads=[]),
        "linear": NodePlan(strategy="dp x colwise", inputs=["S(0)R", "RS(0)"], outputs=["S(0)S(1)"],
                           input_grads=["S(0)P", "PS(0)"], recompute=True, chunks=2, time=1.5e-3, comm=2e-4),
    }
    base = dict(graph_hash="abc123", model="MLP", mesh={"shape": [2, 2], "axis_names": ["dp", "tp"]},
                sharding_axes=[0, 1], nodes=nodes, params={"fc.weight": "RS(0)"}, memory_budget=1e9,
                step_time=0.01, peak_bytes=5e8, breakdown={"compute": 0.008, "mem_params": 1e8},
                pipeline=Pipeline(axis=0, stages=[["x", "w"], ["linear"]], microbatches=4, schedule="1f1b"))
    base.update(kw)
    return Plan(**base)


def test_round_trip_is_exact():
    p = _plan()
    text = p.to_json()
    q = Plan.from_json(text)
    assert q == p
    assert q.to_json() == text
    assert q.digest() == p.digest()


def test_summary_mentions_the_essentials():
    s = _plan().summary()
    assert "MLP" in s and "2x2" in s and "1f1b" in s


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("graph_hash"), "missing field"),
    (lambda d: d.update(extra=1), "unknown field"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d.update(format="x"), "format"),
    (lambda d: d["nodes"]["linear"].update(outputs=["S(0)"]), "nodes.linear.outputs[0]"),
    (lambda d: d["nodes"]["linear"].update(outputs=["Q(0)R"]), "nodes.linear.outputs[0]"),
    (lambda d: d["nodes"]["linear"].update(time=-1.0), "nodes.linear.time"),
    (lambda d: d["nodes"]["linear"].update(chunks=0), "nodes.linear.chunks"),
    (lambda d: d["nodes"]["linear"].update(recompute="yes"), "nodes.linear.recompute"),
    (lambda d: d["params"].update({"fc.weight": "S(-1)R"}), "params.fc.weight"),
    (lambda d: d["pipeline"].update(schedule="zigzag"), "pipeline.schedule"),
    (lambda d: d["pipeline"].update(stages=[["nope"]]), "pipeline.stages[0]"),
    (lambda d: d.update(sharding_axes=[0, 5]), "sharding_axes"),
    (lambda d: d.update(step_time="fast"), "step_time"),
])
def test_schema_errors_name_the_field(mutate, field):
    d = json.loads(_plan().to_json())
    mutate(d)
    with pytest.raises(PlanError, match=field.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        Plan.from_json(json.dumps(d))


def test_nan_and_garbage_are_rejected():
    text = _plan().to_json().replace('"step_time": 0.01', '"step_time": NaN')
    with pytest.raises(PlanError, match="NaN"):
        Plan.from_json(text)
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{not json")
    with pytest.raises(PlanError, match="expected a JSON object"):
        Plan.from_json("[1, 2]")


def test_plan_made_for_another_model_is_refused():
    p = _plan()
    with pytest.raises(PlanError, match="another model"):
        p.check_fits("different")
    with pytest.raises(PlanError, match="mesh shape"):
        p.check_fits("abc123", {"shape": [4, 1]})


_json = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_loader_fuzz_yields_a_plan_or_a_clear_error(data):
    d = json.loads(_plan().to_json())
    # Replace one random leaf path with random JSON, or the whole thing.
    path = data.draw(st.lists(st.sampled_from(sorted(_all_keys(d))), max_size=3))
    target = d
    for k in path[:-1]:
        if isinstance(target, dict) and k in target and isinstance(target[k], dict):
            target = target[k]
    if path and isinstance(target, dict):
        target[path[-1]] = data.draw(_json)
    else:
        d = data.draw(_json)
    try:
        Plan.from_json(json.dumps(d))
    except PlanError:
        pass


def _all_keys(d, acc=None):
    acc = set() if acc is None else acc
    if isinstance(d, dict):
        for k, v in d.items():
            acc.add(k)
            _all_keys(v, acc)
    return acc
