"""Checkpoint loading: each rank reads only its own bytes, from one .safetensors
or .pt file or transformers' sharded layout; key map, dtype rule, load report, and every
broken file a clear error naming it (exit 2 on every rank, no hang).

The loader is tested in-process as the real module program.py pastes
(backends/torch/runtime/program_loading.py); the torchrun tests run emitted programs.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.ir import parse_graph  # noqa: E402
from parcomp.spec import parse_spec  # noqa: E402
from parcomp_backends.torch import runtime  # noqa: E402
from parcomp_backends.torch.launch import rank_path, run_torchrun, write_program  # noqa: E402
from parcomp_backends.torch.runtime import program_loading as ld  # noqa: E402

MLP = """\
%x: f32[4,{D}] = input()
%fc1.weight: f32[{H},{D}] = param()
%fc1.bias: f32[{H}] = param()
%t1: f32[{D},{H}] = permute(%fc1.weight) {{perm=(1, 0)}}
%mm1: f32[4,{H}] = matmul(%x, %t1)
%h: f32[4,{H}] = add(%mm1, %fc1.bias)
%a: f32[4,{H}] = relu(%h)
%fc2.weight: f32[{D},{H}] = param()
%fc2.bias: f32[{D}] = param()
%t2: f32[{H},{D}] = permute(%fc2.weight) {{perm=(1, 0)}}
%mm2: f32[4,{D}] = matmul(%a, %t2)
%y: f32[4,{D}] = add(%mm2, %fc2.bias)
return %y as output
"""
TP2 = "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\noutput output replicated\n"
SHARDS = [["fc1.weight", "fc1.bias"], ["fc2.weight"], ["fc2.bias"]]
TIMEOUT = 240  # seconds: torchrun runs are killed, never left hanging


def mlp_params(H, D, seed=0):
    """The MLP's params, random, made in 16M-element chunks (fast even for 0.5 GB)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in (("fc1.weight", (H, D)), ("fc1.bias", (H,)), ("fc2.weight", (D, H)), ("fc2.bias", (D,))):
        t = torch.empty(shape).view(-1)
        for i in range(0, t.numel(), 1 << 24):
            t[i:i + (1 << 24)] = torch.rand(min(1 << 24, t.numel() - i), generator=g) - 0.5
        out[name] = t.view(shape)
    return out


def write_sharded(tensors, directory, groups=SHARDS):
    """transformers' layout: model-0000K-of-0000N.safetensors + model.safetensors.index.json."""
    os.makedirs(directory, exist_ok=True)
    weight_map = {}
    for k, keys in enumerate(groups, start=1):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({key: tensors[key] for key in keys}, os.path.join(directory, name))
        weight_map.update(dict.fromkeys(keys, name))
    index = os.path.join(directory, "model.safetensors.index.json")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(index, "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return index


def rank_block(ckpt, name, shape, dtype, narrows):
    """What load_params reads for one param: take(...).narrow(...) then read()."""
    s = ckpt.take(name, shape, dtype)
    for dim, start, length in narrows:
        s = s.narrow(dim, start, length)
    return s.read()


# --- in-process: formats, slices, key map, dtype ------------------------------------------


@pytest.mark.parametrize("shape,narrows", [
    ((8, 6), [(0, 4, 4)]),                      # rows: one run
    ((8, 2048), [(1, 1024, 1024)]),             # columns: one run per row (4 KiB each)
    ((8, 6), [(1, 3, 3)]),                      # small columns: whole rows read, cut here
    ((4, 6, 5), [(0, 2, 2), (1, 3, 3)]),        # two dims
    ((4, 6, 5), [(2, 1, 2)]),                   # last dim of three
    ((), []),                                   # a scalar
    ((5,), []),                                 # all of it
])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_block_read_equals_the_narrowed_tensor(tmp_path, shape, narrows, suffix):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    path = str(tmp_path / f"m{suffix}")
    (save_file if suffix == ".safetensors" else torch.save)({"w": full}, path)
    ckpt = ld.open_checkpoint(path)
    got = rank_block(ckpt, "w", shape, torch.float32, narrows)
    want = full
    for dim, start, length in narrows:
        want = want.narrow(dim, start, length)
    assert got.is_contiguous() and torch.equal(got, want)
    kept = want.numel() * 4
    assert ckpt.stats["bytes_kept"] == kept
    if suffix == ".safetensors" and narrows and narrows[-1][2] * 4 * np.prod(shape[narrows[-1][0] + 1:]) >= 4096:
        assert ckpt.stats["bytes_read"] == kept  # only this block's bytes were read


def test_bf16_loads_as_bf16_bit_for_bit_and_a_dtype_mismatch_names_the_file(tmp_path):
    full = torch.randn(6, 4).to(torch.bfloat16)
    save_file({"w": full}, str(tmp_path / "m.safetensors"))
    ckpt = ld.open_checkpoint(str(tmp_path / "m.safetensors"))
    got = rank_block(ckpt, "w", (6, 4), torch.bfloat16, [(0, 3, 3)])
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), full[3:].view(torch.int16))
    with pytest.raises(ld.LoadError, match=(f"param 'w' in {tmp_path / 'm.safetensors'} has dtype "
                                            "torch.bfloat16, but the program was compiled for "
                                            "torch.float32; nothing is cast")):
        ckpt.take("w", (6, 4), torch.float32)


def test_a_tensor_of_a_dtype_torch_cannot_name_only_fails_when_taken(tmp_path):
    save_file({"w": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    (tmp_path / "m.safetensors").write_bytes((tmp_path / "m.safetensors").read_bytes().replace(b'"F32"', b'"F4X"'))
    ckpt = ld.open_checkpoint(str(tmp_path / "m.safetensors"))
    with pytest.raises(ld.LoadError, match="param 'w' in .*m.safetensors has dtype F4X, but the program"):
        ckpt.take("w", (3,), torch.float32)


def test_legacy_pt_file_still_loads(tmp_path):
    full = torch.arange(12.0).reshape(3, 4)
    torch.save({"w": full}, str(tmp_path / "old.pt"), _use_new_zipfile_serialization=False)
    got = rank_block(ld.open_checkpoint(str(tmp_path / "old.pt")), "w", (3, 4), torch.float32, [(1, 2, 2)])
    assert torch.equal(got, full[:, 2:])


@pytest.mark.parametrize("where", ["dir", "index"])
def test_sharded_layout_equals_the_single_file_bit_for_bit(tmp_path, where):
    tensors = mlp_params(64, 16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    index = write_sharded(tensors, str(tmp_path / "sharded"))
    single = ld.open_checkpoint(str(tmp_path / "model.safetensors"))
    sharded = ld.open_checkpoint(os.path.dirname(index) if where == "dir" else index)
    assert len(sharded.stats["files"]) == 3
    for rank in (0, 1):
        for name, narrows in (("fc1.weight", [(0, 32 * rank, 32)]), ("fc2.weight", [(1, 32 * rank, 32)]),
                              ("fc2.bias", [])):
            shape = tuple(tensors[name].shape)
            a = rank_block(single, name, shape, torch.float32, narrows)
            b = rank_block(sharded, name, shape, torch.float32, narrows)
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_key_map_rules_and_the_nearest_keys_of_a_missing_one(tmp_path):
    save_file({"transformer.h.0.w": torch.ones(2), "transformer.h.0.b": torch.zeros(2)},
              str(tmp_path / "m.safetensors"))
    key_map = ld.parse_key_map("=transformer.,h.0.b=transformer.h.0.b")
    assert ld.checkpoint_key("h.0.w", key_map) == "transformer.h.0.w"
    ckpt = ld.open_checkpoint(str(tmp_path / "m.safetensors"), key_map)
    assert "h.0.w" in ckpt and "h.1.w" not in ckpt
    assert torch.equal(rank_block(ckpt, "h.0.w", (2,), torch.float32, []), torch.ones(2))
    with pytest.raises(ld.LoadError) as e:
        ckpt.take("h.1.w", (2,), torch.float32)
    assert str(e.value) == (f"param 'h.1.w' (checkpoint key 'transformer.h.1.w'), full shape [2], is not "
                            f"in checkpoint file {tmp_path / 'm.safetensors'}; nearest keys: "
                            "transformer.h.0.w, transformer.h.0.b (map names with --key-map "
                            "PARAM_PREFIX=KEY_PREFIX)")
    with pytest.raises(ValueError, match="key map rule 'oops' has no '='"):
        ld.parse_key_map("oops")
    (tmp_path / "map.json").write_text(json.dumps({"": "transformer."}))
    assert ld.parse_key_map(str(tmp_path / "map.json")) == (("", "transformer."),)


# --- in-process: every broken file is a LoadError naming it -----------------------------


def broken(tmp_path, how):
    """A sharded checkpoint broken in one way; returns (path to load, file the error names)."""
    index = write_sharded(mlp_params(64, 16), str(tmp_path))
    second = str(tmp_path / "model-00002-of-00003.safetensors")
    if how == "missing shard":
        os.remove(second)
        return index, second
    if how == "index names a missing file":
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
        data["weight_map"]["fc2.bias"] = "model-00004-of-00003.safetensors"
        with open(index, "w", encoding="utf-8") as f:
            json.dump(data, f)
        return index, str(tmp_path / "model-00004-of-00003.safetensors")
    with open(second, "r+b") as f:  # truncated: the last 100 bytes are gone
        f.truncate(os.path.getsize(second) - 100)
    return index, second


ERRORS = {"missing shard": "does not exist, but checkpoint index",
          "index names a missing file": "does not exist, but checkpoint index",
          "truncated": "is truncated: its header needs"}


@pytest.mark.parametrize("how", sorted(ERRORS))
def test_a_broken_sharded_checkpoint_is_a_load_error_naming_the_file(tmp_path, how):
    path, file = broken(tmp_path, how)
    with pytest.raises(ld.LoadError) as e:
        ld.open_checkpoint(path)
    assert file in str(e.value) and ERRORS[how] in str(e.value)


def test_truncated_pt_and_bad_index_name_the_file(tmp_path):
    torch.save({"w": torch.zeros(1000)}, str(tmp_path / "m.pt"))
    data = (tmp_path / "m.pt").read_bytes()
    (tmp_path / "m.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(ld.LoadError, match=f"cannot read torch checkpoint {tmp_path / 'm.pt'}"):
        ld.open_checkpoint(str(tmp_path / "m.pt"))
    (tmp_path / "x.index.json").write_text("{}")
    with pytest.raises(ld.LoadError, match="x.index.json has no \"weight_map\""):
        ld.open_checkpoint(str(tmp_path / "x.index.json"))
    with pytest.raises(ld.LoadError, match=f"checkpoint directory {tmp_path} holds no model.safetensors"):
        ld.open_checkpoint(str(tmp_path))


def test_the_loading_section_is_pasted_into_every_program():
    text = runtime.sections("program_loading")["loading"]
    assert text in runtime.RUNTIME and text in runtime.TRAIN_RUNTIME


# --- torchrun: 0.5 GB, each rank's peak memory; broken files exit 2 on every rank ----------

# the loader every program.py used before the whole file, then this rank's slices
WHOLE_FILE_LOAD = """\
import json, resource, sys
import torch, torch.distributed
from safetensors.torch import load_file
with open("/proc/self/statm") as f:
    before = int(f.read().split()[1]) * 4096
full = load_file(sys.argv[1], device="cpu")
H = full["fc1.bias"].shape[0] // 2
kept = {"fc1.weight": full["fc1.weight"].narrow(0, 0, H), "fc1.bias": full["fc1.bias"].narrow(0, 0, H),
        "fc2.weight": full["fc2.weight"].narrow(1, 0, H), "fc2.bias": full["fc2.bias"]}
kept = {k: torch.empty(v.shape, dtype=v.dtype).copy_(v) for k, v in kept.items()}
del full
print(json.dumps({"rss_before_bytes": before,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def mib(n):
    return f"{n / 2 ** 20:.0f} MiB"


@pytest.mark.slow
def test_half_a_gigabyte_mlp_each_rank_reads_its_own_bytes(tmp_path):
    H, D = 16384, 4096  # fc1 and fc2 weights: 256 MiB each
    tensors = mlp_params(H, D)
    single = str(tmp_path / "model.safetensors")
    save_file(tensors, single)
    index = write_sharded(tensors, str(tmp_path / "sharded"))
    x = torch.rand(4, D, generator=torch.Generator().manual_seed(2))
    del tensors
    compiled = compile_graph(parse_graph(MLP.format(H=H, D=D), "mlp.pcir"), parse_spec(TP2, "tp2.pcs"))
    write_program(compiled, tmp_path)
    reports, outputs = {}, {}
    for kind, ckpt in (("single", single), ("sharded", index)):
        res = run_torchrun(tmp_path, 2, ckpt, {"x": x}, str(tmp_path / f"{kind}.pt"),
                           ("--load-report", str(tmp_path / f"{kind}.json")), timeout=TIMEOUT)
        assert res.returncode == 0, res.stderr[-4000:]
        reports[kind] = [json.loads(open(rank_path(tmp_path / f"{kind}.json", r)).read()) for r in (0, 1)]
        outputs[kind] = torch.load(str(tmp_path / f"{kind}.pt"), weights_only=True)["output"]
    whole = json.loads(subprocess.run([sys.executable, "-c", WHOLE_FILE_LOAD, single], capture_output=True,
                                      text=True, timeout=TIMEOUT, check=True).stdout)
    size = os.path.getsize(single)
    print(f"\ncheckpoint {mib(size)}; whole-file load (one rank): peak RSS {mib(whole['peak_rss_bytes'])} "
          f"(before loading {mib(whole['rss_before_bytes'])})")
    for kind, reps in reports.items():
        for r in reps:
            print(f"{kind} rank {r['rank']}: peak RSS {mib(r['peak_rss_bytes'])} (before loading "
                  f"{mib(r['rss_before_bytes'])}), read {mib(r['bytes_read'])} from {len(r['files'])} "
                  f"file(s), kept {mib(r['bytes_kept'])}; {r['peak_rss_bytes'] / whole['peak_rss_bytes']:.2f} "
                  f"of the whole-file load")
            assert r["peak_rss_bytes"] < 0.6 * whole["peak_rss_bytes"]
            assert r["bytes_read"] == r["bytes_kept"] == compiled.report["checkpoint_load"]["bytes_read"]
            assert r["bytes_read"] < 0.51 * size
            cost, whole_cost = (r["peak_rss_bytes"] - r["rss_before_bytes"],
                                whole["peak_rss_bytes"] - whole["rss_before_bytes"])
            assert cost < 0.6 * whole_cost  # what loading added, too
    assert torch.equal(outputs["single"].view(torch.int32), outputs["sharded"].view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(ERRORS))
def test_a_broken_checkpoint_exits_2_on_every_rank(tmp_path, how):
    path, file = broken(tmp_path / "ckpt", how)
    compiled = compile_graph(parse_graph(MLP.format(H=64, D=16), "mlp.pcir"), parse_spec(TP2, "tp2.pcs"))
    write_program(compiled, tmp_path)
    res = run_torchrun(tmp_path, 2, path, {"x": np.zeros((4, 16), "f4")}, timeout=TIMEOUT)
    assert res.returncode != 0 and 'program.py", line' not in res.stderr  # no traceback of program.py
    for rank in (0, 1):
        line = next(s for s in res.stderr.splitlines() if s.startswith(f"program.py (rank {rank}): error:"))
        assert file in line and ERRORS[how] in line
    # torchrun's summary: every rank that failed, with its exit code
    codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)", res.stderr))
    assert codes == {"0": "2", "1": "2"}, res.stderr[-3000:]


def test_compile_report_says_each_ranks_load():
    from parcomp.report.report import format_load

    compiled = compile_graph(parse_graph(MLP.format(H=64, D=16), "mlp.pcir"), parse_spec(TP2, "tp2.pcs"))
    load = compiled.report["checkpoint_load"]
    slices = {"fc1.weight": 32 * 16, "fc1.bias": 32, "fc2.weight": 16 * 32, "fc2.bias": 16}  # elements
    assert load == {"bytes_read": 4 * sum(slices.values()), "checkpoint_bytes": 4 * (64 * 16 * 2 + 64 + 16),
                    "largest_slice_bytes": 4 * 512, "peak_host_bytes_cpu": 4 * sum(slices.values()),
                    "peak_host_bytes_accelerator": 4 * 512}
    assert format_load(load).startswith("checkpoint load per rank: reads 4.2 KiB of 8.3 KiB (50.4%")
