"""A package's graph at one batch size (``fxopt.package_batch``): the clones to a layout their input
already has, which a symbolic batch left in place, dropped where nothing can tell."""
import torch


def _clone_graph(src_val, fmt, mutate=False, to_output=False, of_input=False):
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = src_val
    y = x if of_input else g.call_function(aten.relu.default, (x,))
    y.meta["val"] = src_val
    c = g.call_function(aten.clone.default, (y,), {"memory_format": fmt})
    c.meta["val"] = torch.empty_like(src_val, memory_format=fmt)
    z = g.call_function(aten.relu_.default if mutate else aten.neg.default, (c,))
    z.meta["val"] = c.meta["val"]
    g.output((c, z) if to_output else (z,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_noop_layout_clones_are_dropped_only_where_safe():
    """At a specialised batch, a clone to the layout its input already has is a copy nothing needs
    (the layout pass leaves such clones where a symbolic batch left the layout undecided)."""
    from fxopt.package_batch import _drop_noop_layout_clones

    cl = torch.empty(4, 8, 5, 5, device="meta").contiguous(memory_format=torch.channels_last)
    gm = _clone_graph(cl, torch.channels_last)
    assert _drop_noop_layout_clones(gm) == 1
    assert not any(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)
    gm.graph.lint()
    x = torch.randn(4, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    assert torch.equal(gm(x)[0], -torch.relu(x))
    # a real layout change, a clone of an input, one the caller receives, a graph writing in place
    assert _drop_noop_layout_clones(_clone_graph(torch.empty(4, 8, 5, 5, device="meta"), torch.channels_last)) == 0
    assert _drop_noop_layout_clones(_clone_graph(cl, torch.channels_last, of_input=True)) == 0
    assert _drop_noop_layout_clones(_clone_graph(cl, torch.channels_last, to_output=True)) == 0
    assert _drop_noop_layout_clones(_clone_graph(cl, torch.channels_last, mutate=True)) == 0
