"""Splits and concatenations of the random CNN graphs (``graphs.programs``): the structures of
Res2Net, Inception, DenseNet and dual-path nets, where a branch reads a channel slice of a tensor
and the branches' outputs are concatenated.

- ``pieces``: a channel split of any widths, each piece through its own op, concatenated in any order;
- ``hierarchical``: Res2Net's hierarchical split (each branch adds the previous branch's output);
- ``producers``: a concatenation of producers of different kinds (conv, pool, activation, input).

``draw(b)`` appends one of them to the program's builder (``graphs._Builder``).
"""
from __future__ import annotations

from hypothesis import strategies as st


def _widths(draw, c: int, most: int = 4) -> list:
    """``c`` channels cut into 2..``most`` pieces of any widths (at least one channel each)."""
    k = draw(st.integers(2, min(most, c)))
    cuts = sorted(draw(st.lists(st.integers(1, c - 1), min_size=k - 1, max_size=k - 1, unique=True)))
    return [hi - lo for lo, hi in zip([0] + cuts, cuts + [c])]


def pieces(b) -> None:
    """A channel split of any widths, each piece through its own op (kept, an activation, a 1x1 or
    3x3 conv of any width), concatenated in any order."""
    draw, widths = b.draw, _widths(b.draw, b.c)
    names = [f"p{i}" for i in range(len(widths))]
    b.fwd.append(f"{', '.join(names)} = torch.split(x, {widths}, dim=1)")
    outs, text, c = [], [], 0
    for name, wd in zip(names, widths):
        op = draw(st.sampled_from(["keep", "act", "conv1", "conv3"]))
        if op == "act":
            y, a = b.act(name)
        elif op.startswith("conv"):
            k, cout = int(op[-1]), draw(st.integers(1, 9))
            y, a = f"{b.mod(f'nn.Conv2d({wd}, {cout}, {k}, padding={k // 2})')}({name})", f"conv{k}->{cout}"
            wd = cout
        else:
            y, a = name, "keep"
        outs.append(y)
        text.append(f"{a}")
        c += wd
    order = draw(st.permutations(range(len(outs))))
    b.fwd.append(f"x = torch.cat([{', '.join(outs[i] for i in order)}], 1)")
    b.c = c
    b.desc.append(f"split{widths}-[{', '.join(text)}]-cat{list(order)}")
    b.ops.add("cat:pieces")


def hierarchical(b) -> None:
    """Res2Net's block: a split into pieces of one width (the last may be narrower), each piece but
    the first through a 3x3 conv after adding the previous branch's output, all concatenated."""
    draw = b.draw
    k = draw(st.integers(2, min(4, b.c)))
    wd = -(-b.c // k)
    widths = [wd] * (b.c // wd) + ([b.c % wd] if b.c % wd else [])
    names = [f"p{i}" for i in range(len(widths))]
    b.fwd.append(f"{', '.join(names)} = torch.split(x, {widths}, dim=1)")
    outs, prev = [names[0]], None
    for name, w in zip(names[1:], widths[1:]):
        src = f"{name} + {prev}" if prev is not None and w == wd else name
        y, _ = b.act(f"{b.mod(f'nn.Conv2d({w}, {w}, 3, padding=1, bias=False)')}({src})")
        b.fwd.append(f"{name} = {y}")
        outs.append(name)
        prev = name
    b.fwd.append(f"x = torch.cat([{', '.join(outs)}], 1)")
    b.desc.append(f"hierarchical-split{widths}-cat")
    b.ops.add("cat:hierarchical")


def producers(b) -> None:
    """A concatenation of producers of different kinds reading one input: a conv of any width, a
    3x3 pool, an activation, the input itself."""
    draw, parts, c, text = b.draw, [], 0, []
    for op in draw(st.lists(st.sampled_from(["conv", "pool", "act", "input"]), min_size=2, max_size=4)):
        if op == "conv":
            cout = draw(st.integers(1, 9))
            parts.append(f"{b.mod(f'nn.Conv2d({b.c}, {cout}, 1)')}(x)")
            c, text = c + cout, text + [f"conv->{cout}"]
            continue
        if op == "pool":
            parts.append("F.max_pool2d(x, 3, 1, 1)" if draw(st.booleans()) else "F.avg_pool2d(x, 3, 1, 1)")
        else:
            parts.append(b.act("x")[0] if op == "act" else "x")
        c, text = c + b.c, text + [op]
    b.fwd.append(f"x = torch.cat([{', '.join(parts)}], 1)")
    b.c = c
    b.desc.append(f"cat({', '.join(text)})")
    b.ops.add("cat:producers")


def draw(b) -> None:
    """One of the structures above, where the running channels allow it."""
    kind = b.draw(st.sampled_from(["pieces", "hierarchical", "producers"]))
    if kind != "producers" and b.c < 2:
        return
    {"pieces": pieces, "hierarchical": hierarchical, "producers": producers}[kind](b)
