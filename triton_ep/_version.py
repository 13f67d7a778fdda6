"""triton-ep's version (one place: the package, its tuned tables and the build read it)."""
__version__ = "0.1.0"
