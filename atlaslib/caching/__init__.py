"""Chapter 7: Memory Caching (cached segment memories read back by residual, GRM, soup or SSC)."""
