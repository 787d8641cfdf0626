"""What runs forward passes when the service embeds: the serving runtimes.

- :mod:`~qswap.encoders.runtime.protocol`: the query :class:`Backend` protocol;
  :mod:`~qswap.encoders.runtime.backend`: the torch backend and :func:`make_backend`.
- :mod:`~qswap.encoders.runtime.shared` (one ONNX Runtime session for every encoder, adapters
  bound per run; :mod:`~qswap.encoders.runtime.shared_export`, :mod:`~qswap.encoders.runtime.shared_run`)
  and :mod:`~qswap.encoders.runtime.onnx` (a merged export per encoder;
  :mod:`~qswap.encoders.runtime.onnx_export`); both keep their exports through
  :mod:`~qswap.encoders.runtime.export_cache`.
- :mod:`~qswap.encoders.runtime.documents`: the document tower (ONNX or torch, fp32 or bf16), with
  :mod:`~qswap.encoders.runtime.bf16_linear` and :mod:`~qswap.encoders.runtime.token_batches`.
"""
