"""The torch emitter's rows for the MoE ops, merged into ``emit.OP_FORMATS``; a
program using one gets the ``moe`` section of :mod:`parcomp_backends.torch.runtime.program_moe`."""
from __future__ import annotations

from ..runtime import sections

MOE_FORMATS = {
    "moe_route": "moe_route({0}, {top_k}, {capacity})",
    "moe_route_grad": "moe_route_grad({0}, {1}, {top_k}, {capacity})",
    "moe_dispatch": "moe_dispatch({0}, {1}, {capacity}, {weighted})",
    "moe_combine": "moe_combine({0}, {1}, {weighted})",
    "moe_combine_grad_c": "moe_combine_grad_c({0}, {1}, {2})",
    "all_to_all_ragged": "all_to_all_ragged({0}, {src_dim}, {dim}, {axis})",
}
MOE_DEFAULTS = {"moe_route": {"capacity": 0}, "moe_route_grad": {"capacity": 0},
                "moe_dispatch": {"weighted": False}, "moe_combine": {"weighted": True}}
DROPLESS_HELPERS = ("moe_route_plan", "moe_pack", "moe_unpack", "moe_pack_grad_c", "moe_grouped_mm",
                    "moe_grouped_wgrad", "moe_expert_plan", "moe_to_experts", "moe_to_rows")
HELPER_NAMES = ("moe_top_mask", "moe_weights", "moe_slots") + tuple(MOE_FORMATS) + DROPLESS_HELPERS


def moe_key(n, key: str) -> str:
    """The format key of ``n``: ``all_to_all_ragged`` for a ragged all_to_all, else ``key``."""
    return "all_to_all_ragged" if n.op == "all_to_all" and n.attr("ragged") else key


def moe_sections(program, dropless: bool = False) -> list:
    """The ``moe`` (and ``moe_ragged``, ``moe_dropless``) runtime sections ``program`` uses
    (``dropless``: its MoE layers run on the routed tokens only, emit/moe_dropless.py)."""
    got = sections("program_moe")
    return ([got["moe"]] if any(n.op in MOE_FORMATS for n in program.nodes) else []) + \
        ([got["moe_ragged"]] if any(n.attr("ragged") for n in program.nodes) else []) + \
        ([got["moe_dropless"]] if dropless else [])
