"""The parallel spec language (``.pcs``): how a model is laid out on a device mesh.

    mesh tp=2
    c_fc.weight    colwise       # Megatron column-parallel
    c_proj.weight  rowwise       # Megatron row-parallel
    input  x       replicated
    output output  replicated

:func:`load_spec` / :func:`parse_spec` give a frozen :class:`Spec`;
:func:`check_names` checks its rules against a model's names.
"""
from .model import LAYOUT_WORDS, TARGETS, LayoutSpec, Rule, Spec, TrainSpec
from .parser import check_names, load_spec, parse_spec

__all__ = ["parse_spec", "load_spec", "check_names", "Spec", "Rule", "LayoutSpec", "TrainSpec",
           "LAYOUT_WORDS", "TARGETS"]
