"""A pipelined program.py compiled for each device profile (cpu: gloo, cuda: NCCL, ascend: HCCL
through torch_npu) runs on CPU ranks under gloo with ``--device cpu`` and gives the cpu
program's steps bit for bit; each rank reads only its stage's (and its tp block's) bytes of the
checkpoint (``--load-report``)."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from test_pipeline import chain_graph, reference  # noqa: E402

ADAMW = "train optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b"
TP_LAYOUTS = "".join(f"{3 * k}.weight colwise\n{3 * k + 2}.weight rowwise\n" for k in range(4))


def _files(tmp_path, mesh, layouts=""):
    """(directory, {profile: program.py name}, the checkpoint's tensors) of a 4-block chain."""
    from safetensors.torch import save_file

    g = chain_graph(blocks=4)
    compiled = compile_graph(g, spec(f"mesh {mesh}\n{layouts}{ADAMW}\n"))
    d = tmp_path / mesh.replace(" ", "_").replace("=", "")
    d.mkdir()
    names = {}
    for profile in ("cpu", "cuda", "ascend"):
        names[profile] = f"program_{profile}.py"
        (d / names[profile]).write_text(emit_program(compiled, profile))
    ref, feeds, _ = reference(g, ADAMW)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"
          and ".exp_avg" not in k}  # the model's weights only: the optimizer state starts at zeros
    save_file(ck, str(d / "model.safetensors"))
    torch.save({k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}, d / "inputs.pt")
    return d, names, ck, compiled.program_.pipeline


def _run(d, nproc, program, out, *extra):
    res = run_torchrun(d, nproc, str(d / "model.safetensors"), str(d / "inputs.pt"), str(d / out),
                       ("--steps", "2", *extra), timeout=300, program=program)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    got = {}
    for s in range(2):
        got.update(torch.load(d / f"{out}.stage{s}"))
    return got


def _stage_bytes(ck, plan, stage, split=1):
    names = {n for g in (plan.stages[stage].forward, plan.stages[stage].backward) for n in
             (x.name for x in g.params)}
    return sum(ck[n].numel() * ck[n].element_size() for n in names if n in ck) // split, len(names & set(ck))


@pytest.mark.slow
def test_cuda_and_ascend_pipelines_run_on_cpu_equal_to_the_cpu_program_reading_only_their_stage(tmp_path):
    d, names, ck, plan = _files(tmp_path, "pp=2")
    want = _run(d, 2, names["cpu"], "cpu.pt")
    assert len(want["losses"]) == 2 and "11.weight" in want
    for profile in ("cuda", "ascend"):
        got = _run(d, 2, names[profile], f"{profile}.pt", "--device", "cpu", "--load-report", str(d / f"{profile}.json"))
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (profile, k)
    total = sum(t.numel() * t.element_size() for t in ck.values())
    for r in range(2):  # rank r holds stage r: it reads that stage's params' bytes, no other
        report = json.loads((d / f"cuda.rank{r}.json").read_text())
        nbytes, count = _stage_bytes(ck, plan, r)
        assert report["bytes_read"] == nbytes < total and report["params"] == count, report


@pytest.mark.slow
def test_pp_tp_pipeline_for_cuda_runs_on_cpu_equal_to_the_cpu_program_reading_its_block(tmp_path):
    # pp=2 x tp=2 on 4 ranks: a tp rank keeps its stage's replicated params whole and its half
    # of each split one, and reads no other stage's bytes
    d, names, ck, plan = _files(tmp_path, "pp=2 tp=2", TP_LAYOUTS)
    want = _run(d, 4, names["cpu"], "cpu.pt")
    got = _run(d, 4, names["cuda"], "cuda.pt", "--device", "cpu", "--load-report", str(d / "cuda.json"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for r in range(4):  # rank r: stage r // 2, tp coordinate r % 2
        stage, local = plan.stages[r // 2], plan.local[r // 2]
        names = {x.name for g in (stage.forward, stage.backward) for x in g.params} & set(ck)
        split = {n for n in names if any(hasattr(q, "dim") for q in local.layouts.get(n, ()))}
        nbytes = sum(ck[n].numel() * ck[n].element_size() // (2 if n in split else 1) for n in names)
        whole = sum(ck[n].numel() * ck[n].element_size() for n in names)
        report = json.loads((d / f"cuda.rank{r}.json").read_text())  # a block's short runs: whole rows read
        assert split and report["bytes_kept"] == nbytes and report["bytes_read"] <= whole, (r, report)


@pytest.mark.slow
def test_gpt2_pipeline_loads_a_plain_transformers_state_dict(tmp_path):
    # a GPT2LMHeadModel's own state_dict(): c_attn's fused weight [32, 96] and bias [96] (the
    # program views them per part, [3, 32] for the bias), lm_head.weight tied to wte; loss of
    # the first step equals torch's cross-entropy of the model's logits
    pytest.importorskip("transformers")
    import importlib.util

    from parcomp.cli.main import main

    from test_pipeline import ROOT

    models = str(ROOT / "specs" / "models.py")
    (tmp_path / "s.pcs").write_text(
        "mesh pp=2\nstage 0: transformer transformer.h.0\nstage 1: transformer.h.1 transformer.ln_f lm_head\n"
        "train loss=cross_entropy optimizer=sgd(lr=0.1) input_grads=no microbatches=2 schedule=1f1b\n")
    out = tmp_path / "out"
    assert main(["compile", f"{models}:gpt2_lm", "--spec", str(tmp_path / "s.pcs"), "--profile", "cuda",
                 "-o", str(out)]) == 0
    assert "'transformer.h.0.attn.c_attn.bias': [96]" in (out / "program.py").read_text()
    spec_ = importlib.util.spec_from_file_location("models_for_gpt2", models)
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    module = mod.gpt2_lm()[0]
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 101, (2, 8)), torch.randint(0, 101, (2, 8))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(module(ids).logits.reshape(-1, 101), labels.reshape(-1))
    res = run_torchrun(out, 2, module.state_dict(), {"input_ids": ids, "labels": labels}, str(out / "o.pt"),
                       ("--device", "cpu"), timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    got = torch.load(out / "o.pt.stage1")["losses"]
    assert got.shape == (1,) and abs(got[0].item() - want.item()) < 1e-5 * want.item(), (got, want)
