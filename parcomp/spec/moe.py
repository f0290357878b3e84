"""``moe capacity_factor=F [drop=tokens]`` / ``moe drop=none``: the MoE capacity policy.

The statement sets the capacity of every MoE layer of the model (every ``moe_route`` and the
``moe_dispatch`` it feeds), whatever capacity the model was built with:

- ``capacity_factor=F`` (a number > 0), ``drop=tokens`` (the default with a factor): an expert
  takes at most ``C = min(ceil(F * S * top_k / E), S)`` tokens of a row (S tokens per row, E
  experts; S is the most one expert can receive, since a token's top_k experts differ),
  in token order; a later token's slot is dropped (GShard, Switch Transformer): its combine
  weight is 0, not renormalised again, so a token dropped from all its slots leaves the block
  as zeros and the model's residual carries it on unchanged (Switch's "passed through the
  residual connection"). The dispatch buffer is ``[B, E, C, H]``.
- ``drop=none``: no capacity (Mixtral): ``C = S``, nothing dropped.

:func:`parcomp.passes.moe_capacity.apply_moe_spec` rewrites the graph. Every error is a
:class:`~parcomp.errors.SpecError` at the statement or at the option.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SourceLoc

#: drop policies built; named-but-not-built ones get a located error, never a silent other policy
DROPS = ("tokens", "none")
NOT_BUILT = {"priority": "batch prioritized routing (V-MoE), dropping the lowest router weights first"}
_WHAT = "moe takes capacity_factor=F (a number > 0) with drop=tokens (the default), or drop=none"


@dataclass(frozen=True)
class MoeSpec:
    """A parsed ``moe`` statement: ``capacity_factor`` (None with ``drop=none``), ``drop``."""

    capacity_factor: float | None
    drop: str
    loc: SourceLoc

    def capacity(self, seq: int, top_k: int, experts: int) -> int:
        """Slots per expert per row: ``min(ceil(F * seq * top_k / experts), seq)``, 0 for
        ``drop=none`` (the route's "nothing dropped"; its dispatch buffer then has ``seq`` slots).

        The cap is exact for top-k routing: a token picks ``top_k`` *distinct* experts, so one
        expert receives at most one slot per token, ``seq`` per row; more slots would only be
        padding (GShard and Switch cap it the same way, at the tokens of the group)."""
        if self.drop == "none":
            return 0
        return min(self.asked(seq, top_k, experts), seq)

    def asked(self, seq: int, top_k: int, experts: int) -> int:
        """``ceil(F * seq * top_k / experts)`` (at least 1): the capacity the factor asks for,
        before :meth:`capacity` caps it at ``seq``; 0 for ``drop=none``."""
        if self.drop == "none":
            return 0
        return max(1, math.ceil(self.capacity_factor * seq * top_k / experts))


def make_moe(builder, tok, payload) -> MoeSpec:
    """The :class:`MoeSpec` of one statement (``payload``: its ``(key token, value)`` options).

    Raises:
        SpecError: an unknown option (one given twice: the parser's ``no_repeats``), a factor that is no number > 0,
            an unknown or not-built drop policy, a factor with ``drop=none``, neither given.
    """
    opts = {}
    for key, val in payload:
        k = str(key)
        if k not in ("capacity_factor", "drop"):
            raise builder.err(key, f"moe has no option {k!r}; {_WHAT}")
        opts[k] = (key, val)
    factor, drop = opts.get("capacity_factor"), opts.get("drop")
    if drop is not None:
        key, val = drop
        if val in NOT_BUILT:
            raise builder.err(key, f"moe drop={val} ({NOT_BUILT[val]}) is not built yet; built: "
                                   f"{', '.join(DROPS)}")
        if val not in DROPS:
            raise builder.err(key, f"moe drop={val!r} is not a drop policy; choose one of: {', '.join(DROPS)}")
    policy = drop[1] if drop else ("tokens" if factor else None)
    if policy is None:
        raise builder.err(tok, f"moe says nothing: {_WHAT}")
    if policy == "none":
        if factor is not None:
            raise builder.err(factor[0], "moe drop=none has no capacity (nothing is dropped); "
                                         "drop capacity_factor=, or say drop=tokens")
        return MoeSpec(None, "none", builder.loc(tok))
    if factor is None:
        raise builder.err(drop[0], "moe drop=tokens needs capacity_factor=F (C = ceil(F * S * top_k / E) "
                                   "slots per expert per row)")
    key, val = factor
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
        raise builder.err(key, f"moe capacity_factor={val!r}: give a number > 0 and finite, such as 1.25")
    return MoeSpec(float(val), "tokens", builder.loc(tok))
