"""The verdict of ``parcomp check`` / ``run``: the unsharded ground truth and the comparison."""
