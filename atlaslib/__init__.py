"""atlaslib: the library behind the book on test-time memorization.

One package per chapter, each with three rooms: ``recurrent.py`` (the per-token loop
that defines the model), ``chunk.py`` (the chunkwise-parallel algorithm) and
``kernel.py`` (a Triton kernel). See the book for the derivations.
"""
__version__ = "0.1.0"
