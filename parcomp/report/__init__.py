"""What a compile says: report.json, ``parcomp explain``, plots, SP-vs-CP and MoE reports."""
