"""``parcomp plan``: choose every layout for a mesh and write it as a spec."""
