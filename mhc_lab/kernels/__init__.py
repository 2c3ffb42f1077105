"""TileLang tile programs, one factory per kernel (compile-time parameters in, tile program out)."""
