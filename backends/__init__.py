"""parcomp backends (import name parcomp_backends): reference, torch, ascend emitters."""
