"""Compile time of one model from ONNX beside the same model from torch.export.

Model: ``specs/models.py:mlp_chain(blocks=N)`` (default N = 48: 48 x Linear(32,128), GELU,
Linear(128,32); 192 parameters). Spec: ``mesh tp=2``, every block Megatron (first Linear
colwise, second rowwise), as in ``bench/compile_time.py``. The ONNX file is written once by
``torch.onnx.export(..., dynamo=True, optimize=False)`` (names kept) into a temporary
directory; its export time is printed but not part of either column.

Columns, median of 3 in one process with 1 thread:

  import        torch: ``import_torch`` (torch.export + lowering); ONNX: ``load_onnx``
                (onnx.load, onnx.checker, shape inference, lowering)
  compile       ``compile_graph(graph, spec)`` (the same passes for both graphs)
  emit          ``emit_program(compiled, "cpu")``
  total         import + compile + emit: from the model to program.py

Both graphs must give the same collectives; the script checks that.

``--model gpt2_lm``: transformers' GPT2LMHeadModel with ``--blocks`` layers (the
``specs/models.py:gpt2_lm`` config otherwise: n_embd 32, 4 heads, vocab 101, input ids
[2, 8]) and the rules of ``specs/gpt2_lm_tp2_train.pcs`` without its train line
(Megatron TP=2: 2 all_reduce per block); the ONNX graph then exercises attention (-> sdpa),
LayerNormalization, Gather (embeddings) and the fused q|k|v split.

Run:  .venv/bin/python bench/onnx_compile_time.py [--model mlp_chain|gpt2_lm] [--blocks 48]
      [--json out.json] [--plain]
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from compile_time import load_factories, spec_text  # noqa: E402

REPS = 3


def timed(fn, reps=REPS):
    """(median seconds, min, max, last result) of ``reps`` calls of ``fn``."""
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts), out


def export_onnx(module, inputs, names, path):
    prog = torch.onnx.export(module, inputs, dynamo=True, optimize=False, input_names=names,
                             output_names=["output"], verbose=False)
    prog.save(path)


def gpt2_lm(blocks: int):
    """``(module, inputs, names, spec)``: specs/models.py's GPT-2 LM with ``blocks`` layers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from parcomp.spec import parse_spec

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=blocks, n_head=4,
                        bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    text = open(os.path.join(os.path.dirname(HERE), "specs", "gpt2_lm_tp2_train.pcs")).read()
    spec = parse_spec("\n".join(l for l in text.splitlines() if not l.startswith("train")), "gpt2_lm_tp2.pcs")
    return GPT2LMHeadModel(config).eval(), (torch.randint(0, 101, (2, 8)),), ["input_ids"], spec


def main():
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.onnx.frontend import load_onnx
    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec import parse_spec
    from parcomp_backends.torch import emit_program

    torch.set_num_threads(1)
    blocks = int(C.arg_value("--blocks") or 48)
    name = C.arg_value("--model") or "mlp_chain"
    if name == "gpt2_lm":
        module, inputs, names, spec = gpt2_lm(blocks)
    else:
        module, inputs, names = load_factories().mlp_chain(blocks=blocks)
        spec = parse_spec(spec_text(blocks, False), f"mlp_chain_{blocks}.pcs")
    print(f"onnx_compile_time: {name}(blocks={blocks}, hidden=32), spec mesh tp=2 (every block "
          f"colwise/rowwise); median of {REPS}; {C.env_line()}")
    import_torch(*load_factories().torch_mlp())  # warm-up: torch.export's lazy imports
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{name}.onnx")
        t0 = time.perf_counter()
        export_onnx(module, inputs, names, path)
        export_s = time.perf_counter() - t0
        load_onnx(path)  # warm-up: onnx's lazy imports
        rows, results, collectives = [], {}, {}
        for label, load in (("torch.export", lambda: import_torch(module, inputs, names)),
                            ("ONNX", lambda: load_onnx(path)[0])):
            imp = timed(load)
            graph = imp[3]
            comp = timed(lambda: compile_graph(graph, spec))
            emit = timed(lambda: emit_program(comp[3], "cpu", model=os.path.basename(path)))
            collectives[label] = [(c["kind"], c["axis"], c["bytes"]) for c in comp[3].report["collectives"]]
            total = imp[0] + comp[0] + emit[0]
            results[label] = {"import": imp[:3], "compile": comp[:3], "emit": emit[:3], "total": total,
                              "ir_nodes": len(graph.nodes)}
            rows.append({"from": label, "nodes": len(graph.nodes), "import": imp[0], "compile": comp[0],
                         "compile_rng": f"{comp[1]:.3f}-{comp[2]:.3f}", "emit": emit[0], "total": total,
                         "colls": len(collectives[label])})
    C.print_table(f"compile time of {name}({blocks}), seconds (median of {REPS})",
                  [("from", "model from"), ("nodes", "IR nodes"), ("import", "import s"),
                   ("compile", "compile_graph s"), ("compile_rng", "compile min-max"),
                   ("emit", "emit_program s"), ("total", "total s"), ("colls", "collectives")], rows)
    same = collectives["torch.export"] == collectives["ONNX"]
    print(f"torch.onnx.export (dynamo, once, not in the table): {export_s:.2f} s")
    print(f"same collectives from both: {same} ({len(collectives['ONNX'])} all_reduce over tp)")
    print(f"ONNX / torch.export, total: x{results['ONNX']['total'] / results['torch.export']['total']:.2f}")
    C.dump_json({"model": name, "blocks": blocks, "onnx_export_s": export_s, "results": results,
                 "same_collectives": same})
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
