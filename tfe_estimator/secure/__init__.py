"""The secure sum: ring encodings, protocols, our kernels and tf-encrypted.

Lowest layer of the package. Nothing here knows about distribution strategies
or Estimator; data flows down into it, never back up:

- `precision`: the rings ("low": 64-bit, "high": 128-bit) and their bit budgets.
- `protocols`: the protocol table (Pond, ABY3) and argument validation.
- `secure_sum`: pure functions (encode, share, add, reveal, decode) on tf-encrypted.
- `fused_sum`: the same sum on our fused kernels (`kernels`).
- `tfe_backend`: the one module that knows tf-encrypted's internals.
- `kernels`: the compiled AES-CTR, secure-sum and noise ops.

Example::

    from tfe_estimator.secure.precision import get_precision
    print(get_precision("low").ring_bits)
"""
__all__ = []
