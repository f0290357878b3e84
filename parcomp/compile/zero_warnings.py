"""A warning when ``train ... zero=N`` cannot split a parameter's optimizer state over dp."""
from __future__ import annotations

from ..ir.types import Replicate, layout_str


def zero_warnings(logical, spec) -> list:
    """What the ``train ... zero=N`` line asks for and the compiler cannot honour: a
    trained parameter replicated over ``dp`` whose optimizer state stays replicated,
    since no dim is free of other axes and divisible by dp.  One message each."""
    from ..passes.autodiff import state_layout
    from ..spec.train_config import train_config

    if getattr(spec, "train", None) is None or "dp" not in spec.mesh.names:
        return []
    cfg = train_config(spec)
    if not cfg.zero:
        return []
    a, dp = spec.mesh.axis_index("dp"), spec.mesh.sizes[spec.mesh.axis_index("dp")]
    grads = {pub[:-5] for pub in logical.output_names if pub.endswith(".grad")}
    out = []
    for p in logical.params:
        if p.name in grads and p.layout[a] == Replicate() and state_layout(p, cfg, spec) == p.layout:
            out.append(f"zero={cfg.zero} is not applied to {p.name} ({p.type}, layout {layout_str(p.layout)}): "
                       f"no dim is free of other mesh axes and divisible by dp={dp}, so its gradient "
                       "and optimizer state stay replicated over dp")
    return out
