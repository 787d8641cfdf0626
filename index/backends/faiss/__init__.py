"""The FAISS backend: a qswap index in one folder (FAISS structure, float16 embedding log,
SQLite documents, a manifest naming the committed generation).

- :mod:`~qswap.index.backends.faiss.index`: :class:`DocumentIndex`, opening and reading a folder.
- :mod:`~qswap.index.backends.faiss.search` (ANN + rescoring), :mod:`~qswap.index.backends.faiss.commit`
  (atomic changes), :mod:`~qswap.index.backends.faiss.reindex` (other options from the stored vectors).
- :mod:`~qswap.index.backends.faiss.faiss_index` (the FAISS structure), :mod:`~qswap.index.backends.faiss.embeddings`
  (the float16 log), :mod:`~qswap.index.backends.faiss.docstore` (SQLite documents),
  :mod:`~qswap.index.backends.faiss.generation`, :mod:`~qswap.index.backends.faiss.recovery` and
  :mod:`~qswap.index.backends.faiss.rwlock` (generations, crash recovery, the reader/writer lock).
"""
