"""What a client and a verifier need to check the ledger's word, and the server uses too: no SQL, no
torch, no web (``tests/service/test_import_boundaries.py`` enforces it).

``signing``: Ed25519 keys, the messages the server signs (certificates, audit-chain heads) and
their checks. ``audit_chain``: the hash of an audit-chain entry and ``check_chain``, the one walk
of the hash-chained log, run by the server on its rows and by ``ledger check`` on an exported
chain. ``artifacts``: whether a model version's bytes are the ones its signed certificate certifies
(``artifact_problem``, which ``service.training.nets.load_model`` runs before loading weights).
``history``: what a bundle's audit chain proves (each certificate anchored once, the spend
recomputed from them); ``bundle``: the offline checks of an exported bundle and ``evaluate``, which
``ledger check`` runs and prints. A certificate's own re-verification (its hash, budget and every
batch's reserve and commit recomputed) is pure privacy mathematics and lives in
``accountant.certificates``.
"""
