"""ONNX frontend: a ``.onnx`` file becomes a parcomp Graph."""
