"""atlaslib: the library behind the book on test-time memorization.

One package per chapter, each with three rooms: ``recurrent.py`` (the per-token loop
that defines the model), ``chunk.py`` (the chunkwise-parallel algorithm) and
``kernel.py`` (a Triton kernel). See the book for the derivations.
"""
__version__ = "0.1.0"

# The chapter packages in the book's order: the one list that the benchmark, the exercises and
# the import-order test read (a new chapter adds its line here; see CONTRIBUTING.md).
CHAPTERS = {"linear": 1, "delta": 2, "miras": 3, "omega": 4, "atlas": 5, "deep": 6, "caching": 7}
