"""parcomp's graph IR: types, layouts, nodes, graphs, the op table and the text form."""
from .graph import Graph, Node, describe, make_attrs
from .names import NameGen
from .ops import COLLECTIVES, LAYOUT_OPS, OPS, Attr
from .text import parse_graph, print_graph
from .transitions import TRANSITIONS, Transition
from .types import (P, R, Layout, Mesh, Partial, Replicate, Shard, TensorType, layout_str,
                    local_shape, make_placement, parse_layout, replicated, shard_axes, shard_offsets)

__all__ = ["Graph", "Node", "describe", "make_attrs", "COLLECTIVES", "LAYOUT_OPS", "OPS", "Attr",
           "NameGen", "TRANSITIONS", "Transition", "make_placement", "parse_layout",
           "parse_graph", "print_graph", "P", "R", "Layout", "Mesh", "Partial", "Replicate",
           "Shard", "TensorType", "layout_str", "local_shape", "replicated", "shard_axes",
           "shard_offsets"]
