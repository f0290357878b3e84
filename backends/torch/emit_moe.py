"""The torch emitter's rows for the MoE ops (issue 14), merged into ``emit.OP_FORMATS``; a
program using one gets the ``moe`` section of :mod:`.program_moe`."""
from __future__ import annotations

from .runtime import sections

MOE_FORMATS = {
    "moe_route": "moe_route({0}, {top_k}, {capacity})",
    "moe_route_grad": "moe_route_grad({0}, {1}, {top_k}, {capacity})",
    "moe_dispatch": "moe_dispatch({0}, {1}, {capacity}, {weighted})",
    "moe_combine": "moe_combine({0}, {1}, {weighted})",
    "moe_combine_grad_c": "moe_combine_grad_c({0}, {1}, {2})",
}
MOE_DEFAULTS = {"moe_route": {"capacity": 0}, "moe_route_grad": {"capacity": 0},
                "moe_dispatch": {"weighted": False}, "moe_combine": {"weighted": True}}
HELPER_NAMES = ("moe_top_mask", "moe_weights", "moe_slots") + tuple(MOE_FORMATS)


def moe_sections(program) -> list:
    """The ``moe`` runtime section if ``program`` uses an MoE op, else ``[]``."""
    return [sections("program_moe")["moe"]] if any(n.op in MOE_FORMATS for n in program.nodes) else []
