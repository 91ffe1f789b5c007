"""Auditing what the TFE parties receive.

- `server_view`: reads the partition graphs a session really ran and pairs
  every `_Recv` on a party with its `_Send`.
- `party_audit`: `audit_party_inputs` / `PartyAuditHook`, the allow-list audit.
- `masks`: values as owner data plus signed masks.
- `owner_graph`: service mode: an owner's graph lets out only fresh keys and masked shares.

Example::

    from tfe_estimator.audit.party_audit import PartyAuditHook
    hook = PartyAuditHook(party_devices)
"""
__all__ = []
