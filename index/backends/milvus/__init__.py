"""The Milvus backend: a qswap index kept in a Milvus collection (milvus-lite file or server).

- :mod:`~qswap.index.backends.milvus.collection`: :class:`MilvusIndex`, building and opening
  collections, locations (``milvus://...``).
- :mod:`~qswap.index.backends.milvus.expr`: filter and id expressions (the injection defence).
"""
