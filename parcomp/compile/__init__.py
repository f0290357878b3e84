"""The compile driver: graph + spec -> sharded graph, per-rank Program, report; block reuse."""
