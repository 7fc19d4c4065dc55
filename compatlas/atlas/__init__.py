"""Stage 5, the atlas: one DuckDB database of views over the Parquet shards (``database``), its
files and their integrity (``files``), and the read-only query tool's guard and hints
(``query_guard``, ``query_hints``); the derived views' SQL in ``views/``. Builds on the shared
bottom only: it reads shards, not models. ``compatlas.atlas.connect`` opens an atlas."""

from compatlas.atlas.database import MIN_CLASS, MIN_READERS, build_atlas, connect, query

__all__ = ["MIN_CLASS", "MIN_READERS", "build_atlas", "connect", "query"]
