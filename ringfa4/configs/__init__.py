"""Hydra config tree of ringfa4-train (a package so that Hydra finds it in an installed ringfa4)."""
