"""parcomp.parallelize's argument handling on one in-process gloo rank: keyword inputs, and a
world size that does not match the spec's mesh found before anything is compiled."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import parcomp
import parcomp.api.parallel as parallel
from parcomp.errors import ParcompError


class Embed(nn.Module):
    """A module whose forward takes ``input_ids`` (as transformers' models do) and a ``scale``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)

    def forward(self, input_ids, scale):
        return self.fc(self.emb(input_ids)) * scale


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank in this process, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield tmp_path
    finally:
        dist.destroy_process_group()


def test_inputs_by_name_as_the_forward_names_them(one_rank):
    torch.manual_seed(0)
    model = Embed().eval()
    ids, scale = torch.randint(0, 16, (2, 4)), torch.full((2, 4, 1), 0.5)
    par = parcomp.parallelize(model, (ids, scale), "mesh tp=1\n", cache_dir=one_rank / "cache")
    want = model(ids, scale)
    for got in (par(ids, scale), par(input_ids=ids, scale=scale), par(ids, scale=scale),
                par(scale=scale, input_ids=ids)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ParcompError, match=r"no input named ids.*missing input_ids"):
        par(ids=ids, scale=scale)
    with pytest.raises(ParcompError, match="given in order and by name input_ids"):
        par(ids, input_ids=ids, scale=scale)


def test_a_world_size_that_is_not_the_meshs_is_found_before_compiling(one_rank, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before checking the world size")

    monkeypatch.setattr(parallel, "compile_for", no_compile)
    model, example = Embed().eval(), (torch.randint(0, 16, (2, 4)), torch.ones(2, 4, 1))
    for spec in ("mesh dp=2 tp=2\n", ({"fc": None}, {"tp": 2})):
        with pytest.raises(ParcompError, match=r"mesh has (4|2) ranks but the process group has 1.*nproc-per-node"):
            parcomp.parallelize(model, example, spec, cache_dir=one_rank / "cache")
