"""torch.export frontend: an ``nn.Module`` becomes a parcomp Graph."""
