"""The Milvus backend: a qswap index kept in a Milvus collection (milvus-lite file or server).

- :mod:`~qswap.index.backends.milvus.collection`: :class:`MilvusIndex` (search, reads, changes, info).
- :mod:`~qswap.index.backends.milvus.build`: building collections from documents or a corpus.
- :mod:`~qswap.index.backends.milvus.connection`: locations (``milvus://...``), the connection, the
  server's features by version, deadlines, and Milvus failures as named errors.
- :mod:`~qswap.index.backends.milvus.expr`: filter and id expressions (the injection defence).
"""
