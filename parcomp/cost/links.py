"""Link classes and the alpha-beta time of one collective on them (``parcomp explain``).

A collective over a mesh axis of ``n`` ranks that sends ``B`` bytes per rank (the ring
count of :mod:`parcomp.ir.transitions`) is estimated as::

    seconds = call_us * 1e-6 + hops * hop_us * 1e-6 + B / (gb_per_s * 1e9)

with ``hops`` the ring algorithm's sequential steps (:data:`RING_HOPS`: ``2(n-1)`` for
all_reduce, ``n-1`` for all_gather, reduce_scatter and all_to_all).  This is NCCL's own
tuning model (``src/graph/tuning.cc``: a base latency per call, a hardware latency per
ring step, a bus bandwidth), with one bandwidth per link class; local layout ops cost 0.

Presets (:data:`LINKS`), bandwidth per direction per rank:

==========  ===========  =======  =======  ===============================================
class       GB/s         hop us   call us  source
==========  ===========  =======  =======  ===============================================
nvlink      450          1.9      10.0     NVIDIA H100 SXM datasheet: NVLink 4, 900 GB/s
                                           bidirectional; latencies: NCCL tuning.cc
                                           (hwLat NVLink Ring/LL128 1.9 us, baseLat 10 us)
hccs        56           1.9      10.0     Huawei Atlas 800T A2 (Ascend 910B): HCCS full
                                           mesh, 56 GB/s per link (7 links, 392 GB/s);
                                           latencies taken as NVLink's (none published)
infiniband  50           4.0      10.0     NVIDIA ConnectX-7 / Quantum-2: NDR 400 Gb/s per
                                           port, one port per GPU; NCCL tuning.cc (hwLat
                                           NET Ring/LL128 4.0 us)
roce        25           5.0      10.0     RoCEv2 on 200 GbE (ConnectX-6 Dx); hop latency
                                           above InfiniBand's (lossless Ethernet, PFC)
pcie        32           2.5      10.0     PCI-SIG: PCIe 4.0 x16, 16 GT/s x 16 lanes
                                           = 31.5 GB/s per direction; NCCL tuning.cc
                                           (hwLat PCI Ring/LL128 2.5 us)
loopback    5            25.0     50.0     an assumption, not a published figure: gloo over
                                           TCP on one host (what ``parcomp run`` uses)
==========  ===========  =======  =======  ===============================================

The spec's ``topology`` line picks the classes and may override the numbers
(``docs/design/report.md``, "Explain"): ``intra=CLASS inter=CLASS`` (inside a node / across
nodes, default ``nvlink`` / ``infiniband``) and ``intra_gb_per_s=N``,
``intra_latency_ns=N`` (and ``inter_...``) in GB/s and nanoseconds per ring hop.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import SpecError


@dataclass(frozen=True)
class Link:
    """One link class: ``gb_per_s`` (GB/s per direction per rank), ``hop_us`` (latency of one
    ring step, microseconds), ``call_us`` (fixed cost of one collective call, microseconds)."""

    name: str
    gb_per_s: float
    hop_us: float
    call_us: float
    source: str

    def record(self) -> dict:
        """The JSON form (for ``explain --json``)."""
        return {"name": self.name, "gb_per_s": self.gb_per_s, "hop_us": self.hop_us,
                "call_us": self.call_us, "source": self.source}


LINKS = {l.name: l for l in (
    Link("nvlink", 450.0, 1.9, 10.0, "NVIDIA H100 SXM datasheet (NVLink 4); NCCL tuning.cc latencies"),
    Link("hccs", 56.0, 1.9, 10.0, "Huawei Atlas 800T A2 (Ascend 910B) HCCS, 56 GB/s per link"),
    Link("infiniband", 50.0, 4.0, 10.0, "InfiniBand NDR 400 Gb/s per GPU; NCCL tuning.cc latencies"),
    Link("roce", 25.0, 5.0, 10.0, "RoCEv2 on 200 GbE"),
    Link("pcie", 32.0, 2.5, 10.0, "PCIe 4.0 x16 (PCI-SIG); NCCL tuning.cc latencies"),
    Link("loopback", 5.0, 25.0, 50.0, "assumed: gloo over TCP loopback on one host"),
)}
"""link class name -> :class:`Link` preset (see the module docstring for the sources)."""

#: the topology keys that choose or change the links, and what each takes
LINK_KEYS = {"intra": "a link class", "inter": "a link class",
             "intra_gb_per_s": "GB/s", "inter_gb_per_s": "GB/s",
             "intra_latency_ns": "ns per ring hop", "inter_latency_ns": "ns per ring hop"}
DEFAULT_LINKS = {"intra": "nvlink", "inter": "infiniband"}


def ring_hops(kind: str, n: int) -> int:
    """Sequential steps of the ring algorithm of collective ``kind`` on ``n`` ranks (0 for local ops)."""
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1,
            "all_to_all": n - 1}.get(kind, 0)


def collective_seconds(kind: str, n: int, nbytes: int, link: Link) -> float:
    """Estimated seconds of one collective ``kind`` over ``n`` ranks sending ``nbytes`` per rank
    on ``link`` (module docstring); 0 for a local layout op or a one-rank axis."""
    hops = ring_hops(kind, n)
    if hops == 0:
        return 0.0
    return (link.call_us + hops * link.hop_us) * 1e-6 + nbytes / (link.gb_per_s * 1e9)


def spec_links(links) -> dict:
    """``{"intra": Link, "inter": Link}`` from a spec's ``links`` pairs (``(key, value)``).

    Raises:
        SpecError: an unknown link class (parse time catches the others).
    """
    opts = dict(links or ())
    out = {}
    for where, default in DEFAULT_LINKS.items():
        name = str(opts.get(where, default))
        if name not in LINKS:
            raise SpecError(f"unknown link class {name!r} for topology {where}= "
                            f"(classes: {', '.join(LINKS)})", where=f"topology {where}")
        link = LINKS[name]
        if f"{where}_gb_per_s" in opts:
            link = replace(link, gb_per_s=float(opts[f"{where}_gb_per_s"]),
                           source=link.source + "; bandwidth from the spec")
        if f"{where}_latency_ns" in opts:
            link = replace(link, hop_us=float(opts[f"{where}_latency_ns"]) / 1000,
                           source=link.source + "; latency from the spec")
        out[where] = link
    return out


def axis_links(spec, placement: dict) -> dict:
    """``{mesh axis: Link}``: an axis whose groups span nodes (``placement["cross_node_axes"]``,
    :func:`parcomp.cost.topology.check_topology`) uses the inter-node link, every other axis
    the intra-node one (without a ``topology`` line every axis is taken as inside one node)."""
    links = spec_links(getattr(spec, "links", ()))
    cross = set(placement.get("cross_node_axes") or ())
    return {a: links["inter" if a in cross else "intra"] for a in spec.mesh.names}
