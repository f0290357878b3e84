"""How attention and the sequence are split: heads over tp, sequence parallel, context parallel."""
