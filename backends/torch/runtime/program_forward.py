"""The fixed part of a forward ``program.py`` (sections pasted by :mod:`parcomp_backends.torch.runtime`).

Real, importable Python; it runs with :mod:`.program_common` (whose sections
program.py holds too) and the stand-ins below for what the emitter generates.
"""
# flake8: noqa: E402,F403,F405 (program.py is one namespace: the common sections are in it)
import argparse

import torch

from .program_cluster import *
from .program_common import *

# ---- stand-ins for what the emitter generates (never pasted) ----
def forward(params, inputs):
    """Stand-in: program.py's generated forward step."""
    return {}


# >>> program.py: write_outputs
def write_outputs(outputs, path):
    """Rank 0 writes {name: full tensor}; with a sharded output every rank writes its slices."""
    local = {name: value.detach().cpu() for name, value in outputs.items()}
    if not SHARDED_OUTPUT:
        if RANK == 0:
            torch.save(local, path)
        return
    torch.save({"rank": RANK, "coords": list(COORD), "outputs": local, "layouts": OUTPUT_LAYOUTS,
                "global_shapes": OUTPUT_GLOBAL_SHAPES}, rank_path(path, RANK))
# <<< program.py


# >>> program.py: parse_args
def parse_args(argv):
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=f"parcomp program for mesh {MESH_TEXT}; run: {RUN_HINT}")
    ap.add_argument("--checkpoint", required=bool(PARAMS),
                    help=".safetensors, .pt state_dict, or a sharded checkpoint (directory or index.json)")
    ap.add_argument("--key-map", type=key_map_arg, default=(), metavar="RULES", help=KEY_MAP_HELP)
    ap.add_argument("--load-report", metavar="FILE", help=LOAD_REPORT_HELP)
    ap.add_argument("--input", required=bool(INPUTS), help=".pt or .safetensors dict of inputs")
    ap.add_argument("--output", help="where to write the outputs (.pt)")
    ap.add_argument("--device", choices=sorted({"cpu", PROFILE}), default=PROFILE)
    ap.add_argument("--bench", type=bench_count, default=0, metavar="N", help="time N forward steps")
    add_cluster_args(ap)
    return ap.parse_args(argv)
# <<< program.py


# >>> program.py: run
def load(args):
    """This rank's params and inputs (``--output``'s directory checked first); under agree()."""
    check_output(args)
    params = load_checkpoint(args.checkpoint, args.key_map, args.load_report) if PARAMS else {}
    inputs = load_inputs(read_inputs(args.input)) if INPUTS else {}
    return params, inputs


def run(args):
    """Everything between init_process_group and destroy_process_group."""
    FAULT["where"] = "loading"
    make_groups(args.timeout)
    params, inputs = agree(lambda: load(args), "loading")
    step = compiled_step(forward, args)
    FAULT["where"] = "the forward step"
    with torch.inference_mode():
        outputs = step(params, inputs)
        if args.bench > 0:
            bench(step, params, inputs, args.bench)
    if args.output:
        FAULT["where"] = "writing the outputs"
        agree(lambda: write_outputs(outputs, args.output), "writing the outputs")
# <<< program.py
