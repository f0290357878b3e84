"""A damaged torch.distributed.checkpoint (``program.py --save``'s directory): ``parcomp export``
and the training program's ``--resume`` both stop with exit 2 and one message naming the
damaged file and what is wrong with it, never DCP's traceback. The damage kinds: a truncated
``.distcp`` data file, ``latest`` naming a step that is not there, a missing ``.metadata``, a
truncated ``.metadata``, a missing ``.distcp`` and a ``.distcp`` with bytes flipped in a tensor's
data (found by the crc32 of every value the save wrote into the step's ``checksums.json``).

The checkpoint is a real one: a 1-rank training program.py, started as torchrun starts its
rank (``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` in the environment), trains a step and saves."""
import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from parcomp.cli.main import main  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.ir import parse_graph  # noqa: E402
from parcomp.spec import parse_spec  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import free_port  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODEL = os.path.join(ROOT, "specs", "tiny_relu_mlp.pcir")
SPEC = "mesh dp=1\ninput x [S(0)]\ntrain loss=mse optimizer=adamw(lr=0.01) input_grads=no steps=1\n"


def _halve(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip(file, value):
    """Flip 16 bytes in the middle of ``value``'s bytes in the DCP data ``file`` (where its
    directory's .metadata places them): the file keeps its size."""
    import torch.distributed.checkpoint as dcp

    index = dcp.FileSystemReader(os.path.dirname(file)).read_metadata()
    item = next(v for k, v in index.storage_data.items()
                if k.fqn == value and v.relative_path == os.path.basename(file))
    data = bytearray(file.read_bytes())
    middle = item.offset + item.length // 2
    for i in range(middle - 8, middle + 8):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def _damage(ck, kind):
    """Damage the checkpoint directory ``ck`` (latest -> step-1) in place; the file the message
    must name, relative to ``ck``, and words it must hold."""
    step = ck / "step-1"
    if kind == "truncated-distcp":
        _halve(step / "__0_0.distcp")
        return "step-1/__0_0.distcp", ("is truncated", "bytes", "fc2.weight")
    if kind == "latest-names-a-missing-step":
        (ck / "latest").write_text("step-7\n")
        return "latest", ("names step-7", "does not exist", "the steps there: step-1")
    if kind == "missing-metadata":
        (step / ".metadata").unlink()
        return "step-1/.metadata", ("is missing", "1 .distcp file(s)")
    if kind == "truncated-metadata":
        _halve(step / ".metadata")
        return "step-1/.metadata", ("cannot be read, truncated or corrupt",)
    if kind == "flipped-distcp":
        _flip(step / "__0_0.distcp", "fc2.weight")
        return "step-1/__0_0.distcp", ("(written by rank 0) is corrupt", "the bytes of fc2.weight",
                                       "crc32", "checksums.json")
    if kind == "missing-distcp":
        (step / "__0_0.distcp").unlink()
        return "step-1/__0_0.distcp", ("is missing", "fc1.weight")
    raise AssertionError(kind)


KINDS = ["truncated-distcp", "latest-names-a-missing-step", "missing-metadata", "truncated-metadata",
         "missing-distcp", "flipped-distcp"]


def _program(d, *args):
    """Run ``d``/program.py as torchrun starts its only rank; the CompletedProcess."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "program.py", "--checkpoint", "model.pt", "--input", "inputs.pt",
                           "--device", "cpu", *args], cwd=d, env=env, text=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory with program.py, its spec file and ``ck``: the checkpoint of one step)."""
    d = tmp_path_factory.mktemp("prog")
    with open(MODEL) as f:
        compiled = compile_graph(parse_graph(f.read(), MODEL), parse_spec(SPEC, "one.pcs"))
    (d / "program.py").write_text(emit_program(compiled))
    (d / "one.pcs").write_text(SPEC)
    torch.save({"fc1.weight": torch.randn(4, 2), "fc2.weight": torch.randn(2, 4)}, d / "model.pt")
    torch.save({"x": torch.randn(1, 2), "target": torch.randn(1, 2)}, d / "inputs.pt")
    res = _program(d, "--save", "ck")
    assert res.returncode == 0 and "saved step 1" in res.stdout, res.stderr[-3000:]
    assert sorted(os.listdir(d / "ck" / "step-1")) == [".metadata", "__0_0.distcp", "checksums.json"]
    return d


def _copy(saved, tmp_path, kind):
    ck = tmp_path / kind
    shutil.copytree(saved / "ck", ck)
    file, words = _damage(ck, kind)
    return ck, str(ck / file), words


@pytest.mark.parametrize("kind", KINDS)
def test_export_of_a_damaged_checkpoint_names_the_file(saved, tmp_path, capsys, kind):
    ck, file, words = _copy(saved, tmp_path, kind)
    out = tmp_path / "hf"
    rc = main(["export", MODEL, "--spec", str(saved / "one.pcs"), str(ck), "-o", str(out), "--json"])
    captured = capsys.readouterr()
    res = json.loads(captured.out.strip().splitlines()[-1])
    assert rc == 2 and res["kind"] == "ParcompError", res
    assert res["where"] == file and res["error"].startswith(file), res
    for w in words:
        assert w in res["error"], (w, res["error"])
    assert "Traceback" not in captured.err and "CheckpointException" not in captured.err, captured.err[-2000:]
    assert not out.exists()  # nothing half-written


def test_export_of_the_undamaged_checkpoint_writes_the_weights(saved, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", MODEL, "--spec", str(saved / "one.pcs"), str(saved / "ck"), "-o", str(out)]) == 0
    assert sorted(os.listdir(out)) == [".parcomp-output", "model.safetensors"]


@pytest.mark.parametrize("kind", KINDS)
def test_resume_from_a_damaged_checkpoint_names_the_file(saved, tmp_path, kind):
    ck, file, words = _copy(saved, tmp_path, kind)
    res = _program(saved, "--resume", str(ck))
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr and "CheckpointException" not in res.stderr, res.stderr[-3000:]
    line = next(s for s in res.stderr.splitlines() if s.startswith("program.py (rank 0): error: --resume"))
    assert line.startswith(f"program.py (rank 0): error: --resume {ck}: {file} "), line
    for w in words:
        assert w in line, (w, line)


def test_resume_from_the_undamaged_checkpoint_runs_step_2(saved):
    res = _program(saved, "--resume", "ck")
    assert res.returncode == 0 and "step 2 loss" in res.stdout, res.stderr[-3000:]


TP2 = "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ntrain loss=mse optimizer=adamw(lr=0.01) input_grads=no steps=1\n"


def _exit_codes(stderr):
    """Every failed rank's exit code in torchrun's failure report, by rank order."""
    import re

    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return [code for _, code in sorted((int(r), int(c)) for r, c in found)]


@pytest.mark.slow
def test_resume_from_a_corrupt_latest_step_stops_every_rank_naming_the_file_and_the_step_before(tmp_path):
    """tp=2 on 2 gloo ranks saves steps 1 and 2 (--save-every 1); bytes of fc1.weight flipped in
    rank 1's file of step 2 (the step ``latest`` names): --resume stops both ranks with exit 2
    within the bound, each naming the file, the rank that wrote it, the value and the earlier
    step; resuming from that step (as the message says) runs step 2 again."""
    from parcomp_backends.torch.launch import run_torchrun

    with open(MODEL) as f:
        compiled = compile_graph(parse_graph(f.read(), MODEL), parse_spec(TP2, "tp2.pcs"))
    (tmp_path / "program.py").write_text(emit_program(compiled))
    torch.save({"fc1.weight": torch.randn(4, 2), "fc2.weight": torch.randn(2, 4)}, tmp_path / "model.pt")
    torch.save({"x": torch.randn(1, 2), "target": torch.randn(1, 2)}, tmp_path / "inputs.pt")

    def run(*extra):
        return run_torchrun(tmp_path, 2, str(tmp_path / "model.pt"), str(tmp_path / "inputs.pt"), None,
                            ("--device", "cpu", "--timeout", "60", *extra), timeout=240)

    res = run("--steps", "2", "--save", "ck", "--save-every", "1")
    assert res.returncode == 0 and "saved step 2" in res.stdout, res.stderr[-3000:]
    ck = tmp_path / "ck"
    _flip(ck / "step-2" / "__1_0.distcp", "fc1.weight")
    res = run("--steps", "1", "--resume", "ck")
    assert _exit_codes(res.stderr) == [2, 2], res.stderr[-3000:]
    assert 'program.py", line' not in res.stderr, res.stderr[-3000:]
    for rank in (0, 1):
        line = next(s for s in res.stderr.splitlines() if s.startswith(f"program.py (rank {rank}): error: reading"))
        assert (f"ck/step-2/__1_0.distcp (written by rank 1) is corrupt: the bytes of fc1.weight differ from the "
                f"crc32 written when it was saved") in line, line
        assert "the newest earlier step is ck/step-1" in line and "--resume ck/step-1" in line, line
    (ck / "step-2").rename(tmp_path / "step-2.corrupt")
    res = run("--steps", "1", "--resume", "ck/step-1")
    assert res.returncode == 0 and "step 2 loss" in res.stdout, res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_pipelined_resume_from_a_damaged_checkpoint_names_the_file(tmp_path, damage):
    """The pipelined program.py (pp=2 on 2 gloo ranks) reads its --resume with the same checks:
    its checkpoint of one step with a rank's .distcp file cut in half, or with bytes flipped,
    stops with the file named."""
    import numpy as np

    from parcomp_backends.torch.launch import run_torchrun

    from graphs import spec
    from test_pipeline import TRAIN, chain_graph, reference

    g = chain_graph(blocks=2)
    (tmp_path / "program.py").write_text(emit_program(compile_graph(g, spec(f"mesh pp=2\n{TRAIN} microbatches=2 "
                                                                             f"schedule=1f1b\n"))))
    ref, feeds, _ = reference(g)
    torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"},
               tmp_path / "model.pt")
    torch.save({k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}, tmp_path / "inputs.pt")

    def run(*extra):
        return run_torchrun(tmp_path, 2, str(tmp_path / "model.pt"), str(tmp_path / "inputs.pt"),
                            str(tmp_path / "out.pt"), extra, timeout=240)

    res = run("--save", "ck")
    assert res.returncode == 0 and "saved step 1" in res.stdout, res.stderr[-3000:]
    shard = tmp_path / "ck" / "step-1" / "__1_0.distcp"
    if damage == "truncated":
        _halve(shard)
    else:
        import torch.distributed.checkpoint as dcp

        _flip(shard, next(k.fqn for k, v in dcp.FileSystemReader(str(shard.parent)).read_metadata().storage_data.items()
                          if v.relative_path == shard.name and k.fqn != "step"))
    res = run("--resume", "ck")
    assert res.returncode != 0 and 'program.py", line' not in res.stderr, res.stderr[-3000:]
    assert _exit_codes(res.stderr) == [2, 2], res.stderr[-3000:]
    line = next(s for s in res.stderr.splitlines() if "error: --resume ck:" in s)
    assert f"ck/step-1/__1_0.distcp {'is truncated' if damage == 'truncated' else '(written by rank 1) is corrupt'}" \
        in line, line
