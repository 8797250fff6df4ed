"""GraphProfile.table(): aligned columns, human units, layers collapsed or listed."""
from __future__ import annotations


def test_table_collapses_layers_and_aligns_columns(zoo_profile):
    _, _, prof = zoo_profile("gpt2")
    text = prof.table()
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "x", "nodes", "fwd", "FLOP", "bwd", "FLOP", "saved", "params"]
    rows = [ln for ln in lines[2:] if ln and not ln.startswith("-")]
    block = next(ln for ln in rows if ln.startswith("transformer.h.{0..1}"))
    assert " x2 " in block and "FLOP" in block and "KiB" in block
    table_rows = lines[: lines.index("")]
    widths = {len(ln) for ln in table_rows if not ln.startswith("-")}
    assert len(widths) == 1  # right-aligned figures end in one column
    total = next(ln for ln in rows if ln.startswith("total"))
    assert "MFLOP" in total
    assert "peak memory of one step (adamw, one device): fp32" in text and "bf16-mixed" in text
    for part in ("transformer.wte", "transformer.ln_f", "lm_head"):
        assert any(ln.startswith(part) for ln in rows), part


def test_table_lists_each_layer_when_asked(zoo_profile):
    _, _, prof = zoo_profile("gpt2")
    rows = prof.table(collapse=False).splitlines()
    assert any(ln.startswith("transformer.h.0 ") for ln in rows)
    assert any(ln.startswith("transformer.h.1 ") for ln in rows)
